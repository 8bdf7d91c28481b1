"""An interrupted run (Ctrl-C, a scheduler's SIGTERM with its short grace period) stops at its checkpoint: it does
not spend time generating the end-of-run sample, which a finished run prints in its summary."""

from __future__ import annotations

import json
import signal

import pytest
from cli_helpers import FASTRUN, run_cli

from gptoughts.training.trainer import Trainer


@pytest.mark.slow  # a whole training run
def test_an_interrupted_run_saves_and_exits_without_generating_its_end_sample(
    tmp_path, text_corpus, cache_dir, monkeypatch, capsys
):
    out = tmp_path / "run"
    original = Trainer.train_step

    def train_step(self):
        result = original(self)
        if self.state.step + 1 == 2:  # SIGTERM as the handler receives it, during step 2 of 6
            self._on_signal(signal.SIGTERM, None)
        return result

    monkeypatch.setattr(Trainer, "train_step", train_step)
    argv = ["train", "--data", str(text_corpus), "--out", str(out), "--max_steps", "6", *FASTRUN]
    code, text = run_cli(
        [*argv, "--tokenizer", "bytes", "--size", "debug", "--sample_prompts", "def "], capsys
    )
    assert code == 128 + signal.SIGTERM, text[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stop_reason"].startswith("interrupted (checkpoint saved"), summary["stop_reason"]
    assert summary["steps"] == 2 and (out / "checkpoints" / "step_000002").is_dir()
    assert summary["sample"] is None and "sample ('def '" not in text, text[-2000:]
