"""The plan says where a wsd run's warmup runs into the decay window train.decay_fraction asks for: the decay then
starts where the warmup ends (training/optim.py ``Schedule.decay_start``), over fewer steps than asked."""

from __future__ import annotations

from types import SimpleNamespace

from gptoughts.config import load_config
from gptoughts.training import plan


def _lines(overrides: dict, total: int, warmup: int) -> list[str]:
    cfg = load_config(None, {"train.schedule": "wsd", **overrides})
    return plan._wsd_decay_cut(cfg.train, SimpleNamespace(total_steps=total, warmup_steps=warmup))


def test_a_warmup_into_the_decay_window_is_named_with_the_steps_left():
    (line,) = _lines({"train.decay_fraction": 0.2}, total=100, warmup=90)
    assert "last 20 steps" in line and "last 10 only" in line and "--warmup_steps" in line
    assert "--decay_fraction to 0.1 " in line  # the advice clears the line (raising the fraction never does)
    assert _lines({"train.decay_fraction": 0.1}, total=100, warmup=90) == []


def test_a_warmup_before_the_window_says_nothing():
    assert _lines({"train.decay_fraction": 0.2}, total=100, warmup=80) == []
    assert _lines({"train.decay_fraction": 0.5}, total=100, warmup=90) != []
    assert _lines({"train.decay_fraction": 0.05}, total=1_000, warmup=20) == []
