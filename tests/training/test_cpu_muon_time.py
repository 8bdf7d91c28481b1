"""A CPU run's time estimate counts Muon's step: its Newton-Schulz matmuls run in bf16 (torch.optim.Muon's), ~3x
slower than fp32 on a CPU without bf16 instructions, and were left out (a newcomer's 20-step Muon run was planned at
10 s and took 56)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from gptoughts.config import load_config
from gptoughts.models import build_model, model_args
from gptoughts.perf.estimate import newton_schulz_flops
from gptoughts.training import estimates


def test_muons_newton_schulz_is_timed_at_the_cpus_bf16_matmul_speed(monkeypatch):
    monkeypatch.setattr(estimates, "_cpu_matmul_flops", lambda dtype=None: 1e9)
    model = SimpleNamespace(raw=build_model("llama", model_args("llama", "debug")))
    muon = load_config("default", {"model.size": "debug", "train.optimizer": "muon"})
    adamw = load_config("default", {"model.size": "debug"})
    lora = SimpleNamespace(train=muon.train, lora=SimpleNamespace(enabled=True))  # adapters train with AdamW
    assert estimates.cpu_optimizer_seconds(muon, model) == pytest.approx(newton_schulz_flops(model.raw) / 1e9)
    assert newton_schulz_flops(model.raw) > 0
    assert estimates.cpu_optimizer_seconds(adamw, model) == estimates.cpu_optimizer_seconds(lora, model) == 0


def test_an_optimizer_step_slows_the_forward_backward_speed_by_its_seconds():
    # 1,000 tokens a step at 1,000 tokens/s is 1 s; with a 1 s optimizer step, 2 s: 500 tokens/s
    assert estimates.with_optimizer_step(1000.0, 1000, 1.0) == pytest.approx(500.0)
    assert estimates.with_optimizer_step(1000.0, 1000, 0.0) == 1000.0
