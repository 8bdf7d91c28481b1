"""The plan of a resume that is not a plain continuation: a branch that changes the run's length, a checkpoint that
carries the learning-rate cut of its rollbacks."""

from __future__ import annotations

from cli_helpers import FASTRUN, ok
from test_recovery import install_fault, nan_on_calls

BASE = ["--size", "debug", "--tokenizer", "bytes", *FASTRUN, "--eval_interval", "0", "--sample_interval", "0"]


def test_a_branch_that_changes_the_length_says_how_the_rate_moves(tmp_path, text_corpus, cache_dir, capsys):
    """`--resume RUN/checkpoints/step_N --max_steps M` into a new folder recomputes the schedule as --resume auto
    does, but its plan read the run record of the (empty) branch folder and said nothing of the jump."""
    run = tmp_path / "a"
    ok(["train", "--data", str(text_corpus), *BASE, "--max_steps", "4", "--save_interval", "2", "--out", str(run)],
       capsys)  # fmt: skip
    step2 = run / "checkpoints" / "step_000002"
    text = ok(["train", "--resume", str(step2), "--max_steps", "8", "--dry_run"], capsys)
    assert f"out: {run}-from-step_000002" in text, text[-2000:]
    assert "the cosine schedule is recomputed for 8 steps (the run was planned for 4)" in text, text[-2000:]


def test_a_resume_after_rollbacks_says_the_rate_stays_cut(
    tmp_path, text_corpus, cache_dir, monkeypatch, capsys
):
    """A checkpoint saved after a rollback carries its cut of the learning rate (0.5x), which a resume keeps on top of
    the schedule, a new --learning_rate included (what a run stopped by max_rollbacks tells to pass); the plan showed
    only the schedule's peak."""
    install_fault(monkeypatch.setattr, nan_on_calls(6, 7))
    run = tmp_path / "a"
    flags = ["--max_steps", "12", "--save_interval", "4", "--log_interval", "1", "--max_bad_steps", "2",
             "--nan_policy", "rollback"]  # fmt: skip
    ok(["train", "--data", str(text_corpus), *BASE, *flags, "--out", str(run)], capsys)
    monkeypatch.undo()
    text = ok(["train", "--resume", "auto", "--out", str(run), "--max_steps", "14", "--dry_run"], capsys)
    assert "the learning rate runs at 0.5x the schedule's above" in text, text[-2000:]
