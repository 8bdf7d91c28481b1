"""The "next:" line at the end of a run launched under torchrun suggested `gptoughts train --resume auto --out RUN`,
which resumes it on one process; it names the launch the run had."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest


def _next_line(capsys) -> str:
    from gptoughts.api import _print_summary

    summary = {"tokens_per_s": 100.0, "mfu": None, "best_val_loss": None, "best_step": None, "final_val_loss": None,
               "session_steps": 3, "session_tokens": 96, "wall_s": 1.0, "resumed_at_step": 0, "steps": 3,
               "tokens": 96, "plots": [], "checkpoints": "RUN/checkpoints"}  # fmt: skip
    history = SimpleNamespace(sample=None, summary=summary, stop_reason="max steps")
    asm = SimpleNamespace(run_dir=Path("RUN"), data=SimpleNamespace(prefs=None, sft=None))
    _print_summary(asm, history)
    return next(ln for ln in capsys.readouterr().out.splitlines() if "next:" in ln)


@pytest.mark.parametrize(
    ("world", "local", "resume"),
    [
        (None, None, "  gptoughts train --resume auto --out RUN --max_steps N  |"),
        (
            "4",
            "4",
            "  torchrun --nproc_per_node 4 -m gptoughts train --resume auto --out RUN --max_steps N  |",
        ),
        ("16", "8", "  the same torchrun command with --resume auto --out RUN --max_steps N  |"),
    ],
    ids=["one process", "one node", "two nodes"],
)
def test_the_resume_hint_names_the_launch_of_the_run(world, local, resume, monkeypatch, capsys):
    for name, value in (("WORLD_SIZE", world), ("LOCAL_WORLD_SIZE", local)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    line = _next_line(capsys)
    assert resume in line, line
    assert "gptoughts sample RUN" in line  # (sample, eval and export run in one process)
