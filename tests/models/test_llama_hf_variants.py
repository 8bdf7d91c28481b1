"""Every combination of the Llama switches that choose a transformers class either names one or is refused with
a ``UserError`` (one line naming the switches), never another exception: the plan and ``export`` both ask."""

from __future__ import annotations

import itertools

import pytest

from gptoughts.errors import UserError
from gptoughts.models import llama_hf, model_args

GRID = list(
    itertools.product(
        [False, True],  # qkv_bias
        [False, True],  # qk_norm
        ["swiglu", "relu2"],  # mlp
        [None, 8],  # sliding_window
        [0, 1],  # full_attention_layers
    )
)


@pytest.mark.parametrize("qkv_bias, qk_norm, mlp, window, full", GRID)
def test_each_switch_combination_exports_or_is_refused_in_one_line(qkv_bias, qk_norm, mlp, window, full):
    args = model_args(
        "llama",
        "debug",
        {"qkv_bias": qkv_bias, "qk_norm": qk_norm, "mlp": mlp, "sliding_window": window,
         "full_attention_layers": full},
    )  # fmt: skip
    try:
        cfg = llama_hf.hf_config(args)
    except UserError as e:
        assert "\n" not in str(e) and "model." in str(e)
        return
    assert cfg["model_type"] in llama_hf.HF_MODEL_TYPES
    # What the class computes is what args describe: reading the config back gives the same switches.
    back = llama_hf.args_from_hf(cfg)
    assert (back.qkv_bias, back.qk_norm, back.mlp) == (qkv_bias, qk_norm, mlp)
    assert (back.sliding_window, back.full_attention_layers) == ((window, full) if window else (None, 0))


def test_windowed_llama_with_full_first_layers_is_refused_naming_both_switches():
    args = model_args("llama", "debug", {"sliding_window": 8, "full_attention_layers": 1})
    with pytest.raises(UserError, match=r"model\.full_attention_layers = 1 with model\.sliding_window = 8"):
        llama_hf.hf_model_type(args)
