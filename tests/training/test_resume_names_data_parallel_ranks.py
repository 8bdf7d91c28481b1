"""A run resumed on another number of data-parallel ranks keeps its global batch, and the plan (or the refusal)
says so in data-parallel ranks: a --parallel.tp 2 run (1 rank of 2 processes) resumed under DDP on the same 2
processes was said to be "resuming on 2 process(es) a run saved on 1", which reads as a process count that did not
change. The saved run is stood in for by its run.json's counts (what the resume reads of it)."""

from __future__ import annotations

import json

import pytest
from cli_helpers import FASTRUN, ok, run_cli


@pytest.fixture
def run(tmp_path, text_corpus, cache_dir, capsys):
    out = tmp_path / "run"
    ok(["train", "--data", str(text_corpus), "--out", str(out), "--size", "debug", "--tokenizer", "bytes",
        "--max_steps", "1", "--grad_accum", "1", *FASTRUN], capsys)  # fmt: skip
    return out


def _saved_on(out, world_size: int, dp_size: int, rows: float) -> None:
    """Make run.json say the run trained on ``dp_size`` ranks of ``world_size`` processes, ``rows`` times this
    command's batch a step."""
    record = json.loads((out / "run.json").read_text())
    record.update(
        world_size=world_size, dp_size=dp_size, tokens_per_step=int(record["tokens_per_step"] * rows)
    )
    (out / "run.json").write_text(json.dumps(record))


def _resume(out, capsys):
    return run_cli(
        ["train", "--resume", "auto", "--out", str(out), "--max_steps", "2", "--dry_run", *FASTRUN], capsys
    )


def test_the_kept_global_batch_counts_data_parallel_ranks_not_processes(run, capsys):
    # 2 data-parallel ranks of 4 processes (tensor parallel 2), resumed on 1 process
    _saved_on(run, 4, 2, rows=2)
    code, text = _resume(run, capsys)
    line = next(ln for ln in text.splitlines() if ln.startswith("  batch: "))
    assert code == 0 and "accumulation 2 =" in line, text[-1500:]
    assert "on 1 data-parallel rank(s) (it was saved on 2 data-parallel rank(s) of 4 processes)" in line, line
    assert "process(es)" not in line, line


def test_the_refusal_to_change_the_global_batch_counts_data_parallel_ranks(run, capsys):
    # a global batch of 3 rows over 2 ranks: not a whole accumulation on one
    _saved_on(run, 4, 2, rows=1.5)
    code, text = _resume(run, capsys)
    errors = [ln for ln in text.splitlines() if ln.startswith("error:")]
    assert code != 0 and len(errors) == 1, text[-1500:]
    assert (
        "resuming on 1 data-parallel rank(s) a run saved on 2 data-parallel rank(s) of 4 processes"
        in errors[0]
    )
