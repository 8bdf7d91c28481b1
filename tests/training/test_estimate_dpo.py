"""The plan's memory estimate of a DPO run counts both rows of every pair (chosen and rejected share a forward)."""

from types import SimpleNamespace

import torch

from gptoughts.config import load_config
from gptoughts.models import model_args
from gptoughts.training.estimates import estimate_peak


def _peak(objective: str, micro_batch: int) -> float:
    base = load_config("default", {"model.size": "debug"})  # a DPO config needs a pretrained model to load
    cfg = SimpleNamespace(train=SimpleNamespace(**{**vars(base.train), "objective": objective}), lora=base.lora,
                          perf=base.perf)  # fmt: skip
    env = SimpleNamespace(
        device=torch.device("cpu"),
        hw=None,
        precision="fp32",
        dist=SimpleNamespace(pp=1, strategy="none", cpu_offload=False, reshard_after_forward=True),
    )
    model = SimpleNamespace(
        args=model_args("llama", "debug"), family=SimpleNamespace(name="llama"), pretrained=None
    )
    e = estimate_peak(cfg, env, model, micro_batch, 64, 1)
    assert e is not None
    return e.total_gib


def test_dpo_estimate_is_the_estimate_of_twice_the_rows():
    assert _peak("dpo", 2) == _peak("auto", 4)
    assert _peak("dpo", 2) > _peak("auto", 2)
