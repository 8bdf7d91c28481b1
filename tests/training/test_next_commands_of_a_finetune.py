"""The summary's "next:" line offers an eval that a fine-tuning run's data can be scored with (api._print_summary):
``eval --data`` reads plain text and refuses chat examples, answers are scored with ``--tasks``."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from gptoughts import api
from gptoughts.training.metrics import console


def _summary() -> dict:
    return {
        "tokens_per_s": 1000.0,
        "mfu": None,
        "best_val_loss": 2.0,
        "best_step": 10,
        "final_val_loss": 2.0,
        "final_val_ppl": 7.39,
        "session_steps": 10,
        "session_tokens": 100,
        "wall_s": 1.0,
        "resumed_at_step": None,
        "plots": ["x.png"],
        "checkpoints": "run/checkpoints",
    }


@pytest.mark.parametrize(
    ("sft", "prefs", "offered"),
    [
        (object(), None, "--tasks TASKS.jsonl"),
        (None, object(), "--prefs PAIRS.jsonl"),
        (None, None, "--data PATH"),
    ],
)
def test_the_eval_offered_reads_what_the_run_trained_on(sft, prefs, offered):
    asm = SimpleNamespace(run_dir=Path("run"), data=SimpleNamespace(sft=sft, prefs=prefs))
    history = SimpleNamespace(summary=_summary(), sample=None, stop_reason="max steps")
    with console.capture() as cap:
        api._print_summary(asm, history)
    line = next(ln for ln in cap.get().splitlines() if "next:" in ln)
    assert f"gptoughts eval run {offered}" in line, line
