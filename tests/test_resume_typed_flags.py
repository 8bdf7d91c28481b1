"""A run resumed on another number of processes keeps its global batch by raising or lowering the accumulation; a
--grad_accum typed in the resuming command wins over that, and the plan says the global batch changes. The config
could not tell this command's flags from the resumed run's own (its run.json ``given``), so the typed flag was
replaced. The two-process run is stood in for by its run.json's process count (what the resume reads of it);
tests/parallel/test_resume_across_process_counts.py resumes a real one."""

from __future__ import annotations

import json

import pytest
from cli_helpers import FASTRUN, ok

from gptoughts.config import load_config


@pytest.fixture
def saved_on_two(tmp_path, text_corpus, cache_dir, capsys):
    """A run whose run.json says it trained on 2 processes of batch 2 x 32 tokens (128 tokens per step)."""
    out = tmp_path / "run"
    ok(["train", "--data", str(text_corpus), "--out", str(out), "--size", "debug", "--tokenizer", "bytes",
        "--max_steps", "1", "--grad_accum", "1", *FASTRUN], capsys)  # fmt: skip
    record = json.loads((out / "run.json").read_text())
    record.update(world_size=2, dp_size=2, tokens_per_step=2 * record["tokens_per_step"])
    (out / "run.json").write_text(json.dumps(record))
    return out, record["tokens_per_step"]


def _batch_line(text: str) -> str:
    return next(line for line in text.splitlines() if line.startswith("  batch: "))


def test_a_typed_grad_accum_wins_over_the_kept_global_batch(saved_on_two, capsys):
    out, saved_tokens = saved_on_two
    resume = [
        "train",
        "--resume",
        "auto",
        "--out",
        str(out),
        "--max_steps",
        "2",
        "--dry_run",
        "--no_progress",
    ]
    line = _batch_line(ok([*resume, "--grad_accum", "1"], capsys))
    assert "accumulation 1 =" in line and f"{saved_tokens // 2:,} tokens per step" in line, line
    assert "global batch changes" in line and f"{saved_tokens:,}" in line, line
    # The first command's --grad_accum 1 (in its run.json's given) is not typed now: the global batch is kept.
    line = _batch_line(ok(resume, capsys))
    assert "accumulation 2 =" in line and f"{saved_tokens:,} tokens per step" in line, line
    assert "keeps the resumed run's global batch" in line, line
    cfg = load_config(overrides={"run.resume": "auto", "run.out": str(out), "train.max_steps": 2})
    assert cfg.is_given("train.grad_accum") and cfg.flags == {"run.resume", "run.out", "train.max_steps"}
