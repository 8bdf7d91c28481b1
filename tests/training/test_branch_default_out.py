"""``train --resume PATH`` without --out branches into a folder named after the run and checkpoint it comes from
(beside that run), never into the family-size default (``runs/llama-debug``), which may hold an unrelated run.
``--resume auto`` is unchanged: it continues the run in --out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_helpers import FASTRUN, ok, refused_leaving

from gptoughts.config import load_config

TRAIN = ["train", "--size", "debug", "--tokenizer", "bytes", *FASTRUN]


@pytest.fixture
def run(text_corpus: Path, cache_dir: Path, capsys) -> Path:
    """runs/a (relative to the test's own working folder), checkpoints at steps 2 and 4."""
    ok(
        [*TRAIN, "--data", str(text_corpus), "--out", "runs/a", "--max_steps", "4", "--save_interval", "2"],
        capsys,
    )
    return Path("runs/a")


def test_the_default_out_of_a_branch_is_named_after_its_source(run: Path):
    step2 = run / "checkpoints" / "step_000002"
    assert load_config(None, {"run.resume": str(step2)}).run.out == "runs/a-from-step_000002"
    assert load_config(None, {"run.resume": str(run)}).run.out == "runs/a-branch"
    assert load_config(None, {"run.resume": str(run / "checkpoints")}).run.out == "runs/a-branch"
    assert load_config(None, {"run.resume": str(step2), "run.out": "elsewhere"}).run.out == "elsewhere"
    # --resume auto is unchanged: it continues the run in --out (or the default one)
    assert load_config(None, {"run.resume": "auto", "run.out": str(run)}).run.out == str(run)


def test_a_branch_without_out_lands_beside_its_run_and_a_second_is_refused(run: Path, text_corpus, capsys):
    # an unrelated run in the family-size folder, where a branch without --out used to go (and was refused)
    ok([*TRAIN, "--data", str(text_corpus), "--max_steps", "2"], capsys)
    other = json.loads(Path("runs/llama-debug/run.json").read_text())
    step2 = str(run / "checkpoints" / "step_000002")
    plan = ok(["train", "--resume", step2, "--dry_run", *FASTRUN], capsys)
    assert f"out: runs/a-from-step_000002 (resuming {step2})" in plan, plan[-2000:]
    text = ok(["train", "--resume", step2, *FASTRUN], capsys)
    assert "resumed from" in text and "run: runs/a-from-step_000002" in text, text[-2000:]
    assert json.loads(Path("runs/a-from-step_000002/run.json").read_text())["plan"]["start_step"] == 2
    assert json.loads(Path("runs/llama-debug/run.json").read_text()) == other
    # the same branch again finds the first one there: refused in one line, naming how to continue it
    refused_leaving(Path("runs"), ["train", "--resume", step2, *FASTRUN], capsys, "runs/a-from-step_000002",
                    "--resume auto")  # fmt: skip
