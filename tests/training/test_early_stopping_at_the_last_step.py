"""Early stopping whose patience runs out at the run's last evaluation, the one at its end: the run ended by its own
stopping rule, complete. It said "done (early stopping)" and offered `--resume auto --early_stopping_patience none`
to train on, which is refused: the run is complete at its --max_steps."""

from __future__ import annotations

import json

from cli_helpers import FASTRUN, run_cli

FLAGS = [*FASTRUN, "--tokenizer", "bytes", "--size", "debug"]


def test_patience_used_up_at_the_last_step_ends_a_complete_run(tmp_path, text_corpus, cache_dir, capsys):
    out = tmp_path / "run"
    # patience 0: the run's one evaluation, at its end, uses it up
    argv = ["train", "--data", str(text_corpus), "--out", str(out), "--max_steps", "3", *FLAGS]
    code, text = run_cli([*argv, "--eval_interval", "0", "--early_stopping_patience", "0"], capsys)
    assert code == 0, text[-2000:]
    assert "done (max steps)" in text and "--early_stopping_patience none" not in text, text[-2000:]
    assert json.loads((out / "summary.json").read_text())["stop_reason"] == "max steps"
