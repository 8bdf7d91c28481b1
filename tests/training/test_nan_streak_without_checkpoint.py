"""A run that ends on a streak of non-finite steps before its first checkpoint lost every step it had trained: the
error said "no good checkpoint was written before it" and left nothing (a short run saves only at its end). The
streak's steps were skipped, so the weights and optimizer from before it are still there: they are saved as the
step before the streak, and the run resumes from it."""

from __future__ import annotations

from test_recovery import _argv, _main, _one_line_error, install_fault, nan_on_calls

from gptoughts.training.checkpoint import restore
from gptoughts.training.checkpoint import store as ckpt


def test_a_nan_streak_before_the_first_checkpoint_saves_the_state_before_it(
    tmp_path, text_corpus, cache_dir, fast, monkeypatch, capsys
):
    install_fault(monkeypatch.setattr, nan_on_calls(6, None))  # steps 6.. are non-finite, for good
    out = tmp_path / "run"
    flags = ("--train.max_steps", "10", "--train.save_interval", "0", "--train.max_bad_steps", "3")
    code, _, err = _main(_argv(text_corpus, out, fast, *flags, "--train.nan_policy", "rollback"), capsys)
    line = _one_line_error(code, err)
    assert "training diverged at step 8 (3 consecutive non-finite steps" in line, line
    assert "step_000005" in line and "resume from it with a lower --learning_rate" in line, line
    assert ckpt.list_steps(out / "checkpoints") == [5]
    trainer = restore.load_state(ckpt.step_dir(out / "checkpoints", 5))["trainer"]
    assert (trainer["step"], trainer["data_steps_skipped"], trainer["bad_steps"]) == (5, 3, 0)
    monkeypatch.undo()  # the fault gone: the run goes on from step 5, past the streak's batches
    code, stdout, err = _main(
        _argv(text_corpus, out, fast, "--resume", "auto", "--train.max_steps", "7"), capsys
    )
    assert code == 0, err
    assert ckpt.list_steps(out / "checkpoints")[-1] == 7


def test_a_streak_from_the_first_step_saves_nothing(
    tmp_path, text_corpus, cache_dir, fast, monkeypatch, capsys
):
    # nothing was trained before it: the initial weights are not a checkpoint worth keeping
    install_fault(monkeypatch.setattr, nan_on_calls(1, None))
    out = tmp_path / "run"
    flags = ("--train.max_steps", "6", "--train.save_interval", "0", "--train.max_bad_steps", "2")
    code, _, err = _main(_argv(text_corpus, out, fast, *flags, "--train.nan_policy", "skip"), capsys)
    assert "no good checkpoint was written before it" in _one_line_error(code, err)
    assert ckpt.list_steps(out / "checkpoints") == []
