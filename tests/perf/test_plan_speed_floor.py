"""The plan's time on a GPU has the estimate's floor: a step never shorter than MIN_STEP_S (a tiny model is bound by
its kernel launches). The review found `gptoughts estimate` floored and train's plan not: 430M tokens/s for the
debug model on an H200, where `estimate` said 455k."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from gptoughts import models
from gptoughts.perf.estimate import MIN_STEP_S, estimate
from gptoughts.training.estimates import estimate_speed


def _plan_speed(size: str, micro: int, block: int) -> tuple[float, str]:
    raw = models.build_model("llama", models.model_args("llama", size), device="meta")
    env = SimpleNamespace(
        device=torch.device("cuda"), hw=SimpleNamespace(peak_bf16_flops=989e12, name="H200")
    )
    model = SimpleNamespace(raw=raw, args=raw.args)
    return estimate_speed(env, model, block, micro, 1)


def test_the_plans_speed_of_a_tiny_model_is_the_estimates_floor():
    tps, basis = _plan_speed("debug", 8, 256)
    assert tps == 8 * 256 / MIN_STEP_S and "at most" in basis
    assert tps == estimate("llama", "debug", batch_size=8, block_size=256, gpu="H200").tokens_per_s


def test_a_large_models_plan_speed_is_its_flops():
    tps, basis = _plan_speed("1b", 8, 2048)
    assert tps < 8 * 2048 / MIN_STEP_S and "MFU 0.55" in basis
