"""A resume that changes the run's length says that the schedule is recomputed and how the next step's learning
rate moves (a newcomer extended a finished quickstart with --max_steps and its rate went back up unannounced)."""

from __future__ import annotations

from cli_helpers import QUIET_CPU, run_cli


def test_extending_a_finished_run_says_the_learning_rate_goes_back_up(
    tmp_path, text_corpus, cache_dir, capsys
):
    out = tmp_path / "r"
    argv = ["train", "--data", str(text_corpus), "--size", "debug", "--tokenizer", "bytes", "--block_size", "32",
            *QUIET_CPU, "--batch_size", "2", "--warmup_steps", "1", "--out", str(out)]  # fmt: skip
    rc, text = run_cli([*argv, "--max_steps", "4"], capsys)
    assert rc == 0, text
    assert "schedule is recomputed" not in text
    rc, text = run_cli([*argv, "--max_steps", "4", "--resume", "auto"], capsys)
    # the same length: nothing to train, refused before any schedule is planned
    assert rc == 2 and "complete at step 4" in text and "schedule is recomputed" not in text, text
    rc, text = run_cli([*argv, "--max_steps", "8", "--resume", "auto"], capsys)
    assert rc == 0, text
    line = next(x for x in text.splitlines() if "schedule is recomputed" in x)
    assert "for 8 steps (the run was planned for 4): the learning rate at step 5 moves from" in line
    old, new = (float(v) for v in line.split("moves from ")[1].split(" to "))
    assert new > old
