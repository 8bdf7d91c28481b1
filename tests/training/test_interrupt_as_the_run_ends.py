"""A signal (Ctrl-C, a scheduler's SIGTERM) that arrives as a run ends by its own rule, and one that interrupts a run
without checkpoints: what the summary, the exit code and a later ``--resume auto`` say must agree."""

from __future__ import annotations

import json
import signal
from pathlib import Path

from cli_helpers import FASTRUN, run_cli, signal_during_step

FLAGS = [*FASTRUN, "--tokenizer", "bytes", "--size", "debug"]


def test_a_signal_during_the_last_step_ends_a_complete_run_not_an_interrupted_one(
    tmp_path, text_corpus, cache_dir, monkeypatch, capsys
):
    """SIGTERM during the last step: the run saved that step and was complete, yet said "interrupted" and exited
    143, so a scheduler resumed it with --resume auto, which was refused (exit 2: the run is complete)."""
    out = tmp_path / "run"
    signal_during_step(monkeypatch, 4)
    code, text = run_cli(
        ["train", "--data", str(text_corpus), "--out", str(out), "--max_steps", "4", *FLAGS], capsys
    )
    assert code == 0, text[-2000:]
    assert "done (max steps)" in text, text[-2000:]
    assert json.loads((out / "summary.json").read_text())["stop_reason"] == "max steps"
    monkeypatch.undo()
    code, text = run_cli(["train", "--resume", "auto", "--out", str(out)], capsys)
    assert code == 2 and "is complete at step 4" in text, text[-2000:]


def test_an_interrupted_run_without_checkpoints_does_not_offer_a_resume(
    tmp_path, text_corpus, cache_dir, monkeypatch, capsys
):
    """A run with checkpoint.checkpoints false, interrupted, said "the last good one kept; resume with --resume
    auto": it has none, and that resume is refused."""
    out = tmp_path / "run"
    signal_during_step(monkeypatch, 2)
    argv = ["train", "--data", str(text_corpus), "--out", str(out), "--max_steps", "6", *FLAGS]
    code, text = run_cli([*argv, "--checkpoint.checkpoints", "false"], capsys)
    assert code == 128 + signal.SIGTERM, text[-2000:]
    reason = json.loads((out / "summary.json").read_text())["stop_reason"]
    assert reason.startswith("interrupted") and "--resume" not in reason, reason
    assert not Path(out / "checkpoints").exists()
