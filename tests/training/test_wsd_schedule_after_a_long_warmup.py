"""wsd (warmup-stable-decay) where the warmup runs into the decay window (a short run, a long warmup): the decay
starts where the warmup ends and still reaches the floor at the run's end, as cosine's does, rather than the rate
dropping from the peak in one step when the warmup ends."""

from __future__ import annotations

import pytest

from gptoughts.training.optim import Schedule


def test_a_warmup_into_the_decay_window_hands_over_at_the_peak_and_decays_to_the_end():
    # decay window: the last 20 steps (80..99); the warmup covers 0..89
    s = Schedule("wsd", 1.0, total_steps=100, warmup_steps=90, min_lr_ratio=0.0, decay_fraction=0.2)
    assert s.lr_at(89) == pytest.approx(1.0)  # the warmup's last step reaches the peak
    assert s.lr_at(90) == pytest.approx(1.0)  # and the decay starts from it
    assert s.lr_at(95) == pytest.approx(0.5)
    assert s.lr_at(100) == pytest.approx(0.0)
    lrs = [s.lr_at(i) for i in range(100)]
    after = lrs[90:]
    assert all(a > b for a, b in zip(after, after[1:]))
    # no step moves the rate by more than one step of the shortened decay (the old schedule fell by half at once)
    assert max(abs(a - b) for a, b in zip(lrs, lrs[1:])) <= 0.1 + 1e-9


def test_a_warmup_before_the_decay_window_leaves_the_window_as_asked():
    s = Schedule("wsd", 2.0, total_steps=100, warmup_steps=40, min_lr_ratio=0.1, decay_fraction=0.25)
    assert s.lr_at(74) == pytest.approx(2.0)
    assert s.lr_at(75) == pytest.approx(2.0)
    assert s.lr_at(75 + 12.5) == pytest.approx(2.0 + (0.2 - 2.0) * 0.5)
    assert s.lr_at(100) == pytest.approx(0.2)


def test_a_warmup_over_the_whole_run_never_decays():
    s = Schedule("wsd", 1.0, total_steps=50, warmup_steps=50, min_lr_ratio=0.0, decay_fraction=0.2)
    lrs = [s.lr_at(i) for i in range(50)]
    assert lrs == sorted(lrs) and lrs[-1] == pytest.approx(1.0)
