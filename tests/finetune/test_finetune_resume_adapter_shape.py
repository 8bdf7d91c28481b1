"""`gptoughts finetune --resume auto --lora_r 8` (or --target_modules) on a LoRA run of another rank or layers: one
line naming the LoRA setting, old and new, as an architecture change is named, before anything loads; not every
checkpoint called unreadable, nor a hint to another --size."""

from __future__ import annotations

import pytest

from gptoughts.config import load_config
from gptoughts.errors import UserError
from gptoughts.training.rundir import _check_same_model


def test_a_lora_resume_with_other_adapter_shapes_is_named(hf_model):
    base = str(hf_model("llama"))
    run = {"model.init_from": base, "lora.enabled": True}
    old = load_config("finetune", run)
    assert (
        _check_same_model(old, load_config("finetune", {**run, "lora.alpha": 64}), "RUN holds", "fix") is None
    )
    for key, value, said in (
        ("lora.r", 8, "lora.r 16 -> 8"),
        ("lora.target_modules", ["wq"], "lora.target_modules [] -> ['wq']"),
    ):
        with pytest.raises(UserError, match="another architecture") as e:
            _check_same_model(old, load_config("finetune", {**run, key: value}), "RUN holds", "fix")
        assert said in str(e.value)
