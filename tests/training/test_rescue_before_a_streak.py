"""The state from before a streak of non-finite steps, saved where a run would otherwise stop with nothing to resume.

A streak's steps are skipped on the device, so the weights and optimizer are still those of the step before it; a
run that stops on bad steps with no good checkpoint before them saves them as that step (with the loader past the
bad batches): when the streak diverges, when a signal stops the run inside it, and when ``nan_policy = stop`` stops
it at a non-finite step or a reproducible loss spike (a held spike is skipped too; where good steps followed the
non-finite one, the state of now is saved as it is)."""

from __future__ import annotations

import signal

import pytest
from cli_helpers import signal_during_step
from test_recovery import (
    SPIKE,
    _argv,
    _check_checkpoints,
    _main,
    _one_line_error,
    install_fault,
    nan_on_calls,
)

from gptoughts.training.checkpoint import restore
from gptoughts.training.checkpoint import store as ckpt


def test_a_signal_inside_a_streak_before_the_first_checkpoint_saves_the_state_before_it(
    tmp_path, text_corpus, cache_dir, fast, monkeypatch, capsys
):
    """SIGTERM at step 8 of a run non-finite from step 6 that saves only at its end: the save was refused and the
    run left nothing, saying "the last good one kept" of a checkpoint that did not exist; its 5 trained steps were
    lost."""
    install_fault(monkeypatch.setattr, nan_on_calls(6, None))
    signal_during_step(monkeypatch, 8)
    out = tmp_path / "run"
    code, stdout, _ = _main(
        _argv(text_corpus, out, fast, "--train.max_steps", "20", "--train.save_interval", "0"), capsys
    )
    assert code == 128 + signal.SIGTERM
    assert (
        "interrupted (the state from before the bad steps saved as step_000005; resume with --resume auto)"
        in (stdout)
    ), stdout[-1500:]
    assert ckpt.list_steps(out / "checkpoints") == [5]
    trainer = restore.load_state(ckpt.step_dir(out / "checkpoints", 5))["trainer"]
    assert (trainer["step"], trainer["data_steps_skipped"], trainer["bad_steps"]) == (5, 3, 0)


def test_a_signal_inside_a_streak_from_the_first_step_says_no_checkpoint_was_written(
    tmp_path, text_corpus, cache_dir, fast, monkeypatch, capsys
):
    # nothing was trained before the streak: nothing to save, and the end line does not claim a checkpoint kept
    install_fault(monkeypatch.setattr, nan_on_calls(1, None))
    signal_during_step(monkeypatch, 3)
    out = tmp_path / "run"
    code, stdout, _ = _main(
        _argv(text_corpus, out, fast, "--train.max_steps", "20", "--train.save_interval", "0"), capsys
    )
    assert code == 128 + signal.SIGTERM
    assert "interrupted (no checkpoint written yet; resume with --resume auto)" in stdout, stdout[-1500:]
    assert ckpt.list_steps(out / "checkpoints") == []


def test_the_saved_state_keeps_no_evaluation_of_the_streak(
    tmp_path, text_corpus, cache_dir, fast, monkeypatch, capsys
):
    """Non-finite from step 2, evaluated every 2 steps: the evaluation of step 2 (inside the streak, counted as one
    without improvement) was kept in the checkpoint of step 1, so its resume evaluated step 2 a second time and
    early stopping counted it twice."""
    install_fault(monkeypatch.setattr, nan_on_calls(2, None))
    out = tmp_path / "run"
    flags = ("--train.max_steps", "10", "--train.save_interval", "0", "--train.max_bad_steps", "3")
    code, _, err = _main(_argv(text_corpus, out, fast, *flags, "--train.eval_interval", "2"), capsys)
    assert code == 2 and "saved as" in err and "step_000001" in err, err[-1500:]
    trainer = restore.load_state(ckpt.step_dir(out / "checkpoints", 1))["trainer"]
    assert [h["step"] for h in trainer["history"]] == []
    assert trainer["evals_without_improvement"] == 0


@pytest.mark.parametrize(
    ("log_interval", "saved", "skipped"),
    [("1", 5, 1), ("4", 8, 0)],  # the bad step alone in its window; followed by good steps 7 and 8
)
def test_the_stop_policy_saves_what_a_non_finite_step_left(
    log_interval, saved, skipped, tmp_path, text_corpus, cache_dir, fast, monkeypatch, capsys
):
    """nan_policy stop, one non-finite step (6) in a run that saves only at its end: the error said "no good
    checkpoint was written before it; start again" and the 5 (or 7) trained steps were lost."""
    install_fault(monkeypatch.setattr, nan_on_calls(6, 6))
    out = tmp_path / "run"
    flags = ("--train.max_steps", "20", "--train.save_interval", "0", "--train.log_interval", log_interval)
    code, _, err = _main(_argv(text_corpus, out, fast, *flags, "--train.nan_policy", "stop"), capsys)
    line = _one_line_error(code, err)
    assert "non-finite loss or gradient at step 6 (recovery.nan_policy = stop)" in line, line
    assert f"step_{saved:06d}; resume from it with a lower --learning_rate" in line, line
    assert _check_checkpoints(out) == [saved]
    trainer = restore.load_state(ckpt.step_dir(out / "checkpoints", saved))["trainer"]
    assert trainer["data_steps_skipped"] == skipped


def test_the_stop_policy_saves_what_a_reproducible_spike_left(
    tmp_path, text_corpus, cache_dir, fast, monkeypatch, capsys
):
    """A spike on batch 10 every time it runs, logged every 4 steps: steps 10-12 are held (skipped), so the state is
    that of step 9, with the loader past step 12's batches."""
    install_fault(monkeypatch.setattr, lambda _c, batch, _s: 100.0 if batch == 10 else None)
    out = tmp_path / "run"
    code, _, err = _main(_argv(text_corpus, out, fast, *SPIKE, "--train.nan_policy", "stop"), capsys)
    line = _one_line_error(code, err)
    assert "reproducible loss spike at step 10" in line and "step_000009; resume from it" in line, line
    assert _check_checkpoints(out) == [9]
    trainer = restore.load_state(ckpt.step_dir(out / "checkpoints", 9))["trainer"]
    assert trainer["data_steps_skipped"] == 3
