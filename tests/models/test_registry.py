from __future__ import annotations

import dataclasses

import pytest
import torch

from gptoughts.errors import ConfigError, UserError
from gptoughts.models import FAMILIES, Family, build_model, get_family, list_sizes, model_args
from gptoughts.models.llama import Llama, LlamaArgs


def test_registry_is_explicit():
    assert set(FAMILIES) == {"llama", "deepseek", "llada", "inl", "gpt2"}
    for name, fam in FAMILIES.items():  # every family is tiny-testable on CPU
        assert fam.name == name and "debug" in fam.sizes
    fam = get_family("llama")
    assert fam is FAMILIES["llama"] and get_family(fam) is fam
    assert fam.model_cls is Llama and fam.args_cls is LlamaArgs and fam.objective == "causal"
    with pytest.raises(dataclasses.FrozenInstanceError):
        fam.name = "other"


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_family_has_debug_size_and_valid_presets(name):
    assert "debug" in list_sizes(name)
    for size in list_sizes(name):
        args = model_args(name, size, {})
        model = build_model(name, args, device="meta")
        assert model.num_params() > 0


def test_sizes_in_order_and_case_insensitive():
    assert list_sizes("llama") == ["debug", "125m", "350m", "760m", "1b", "3b", "8b"]
    assert model_args("llama", "125M", {}) == model_args("llama", "125m", {})


def test_benchmark_shapes_are_fixed():
    def shape(size: str) -> tuple[int, ...]:
        a = model_args("llama", size, {})
        return (a.d_model, a.n_layers, a.n_heads, a.n_kv_heads, a.ffn_dim, a.vocab_size)

    assert shape("125m") == (768, 12, 12, 12, 2048, 32768)
    assert shape("1b") == (2048, 16, 32, 8, 8192, 32768)
    assert shape("3b") == (3072, 28, 24, 8, 8192, 32768)
    assert model_args("llama", "8b", {}).rope_theta == 500000.0


def test_unknown_family_names_closest():
    with pytest.raises(ConfigError, match="`llama`"):
        get_family("lama")
    with pytest.raises(ConfigError, match="llama"):
        model_args("llamma", "debug", {})
    assert issubclass(ConfigError, UserError)


def test_unknown_size_names_closest():
    with pytest.raises(ConfigError, match="`125m`") as info:
        model_args("llama", "12m", {})
    assert "12m" in str(info.value)


def test_unknown_override_names_closest():
    with pytest.raises(ConfigError, match="`n_layers`"):
        model_args("llama", "debug", {"n_layer": 3})
    with pytest.raises(ConfigError, match="`tie_embeddings`"):
        model_args("llama", "debug", {"tied_embeddings": True})


def test_overrides_apply_and_coerce():
    a = model_args("llama", "debug", {"n_layers": 3, "rope_theta": 500000, "head_dim": None, "qk_norm": True})
    assert a.n_layers == 3 and a.d_model == 64 and a.qk_norm
    assert isinstance(a.rope_theta, float) and a.rope_theta == 500000.0
    a = model_args("llama", "debug", {"rope_scaling": {"type": "linear", "factor": 2.0}})
    assert a.rope_scaling == {"type": "linear", "factor": 2.0}


@pytest.mark.parametrize(
    "key, value, expected",
    [
        ("n_layers", "2", "int"),
        ("n_layers", 2.0, "int"),
        ("tie_embeddings", 1, "bool"),
        ("rope_theta", "1e4", "float"),
        ("head_dim", "16", "int or None"),
        ("rope_scaling", "llama3", "dict"),
    ],
)
def test_wrong_types_name_field_and_type(key, value, expected):
    with pytest.raises(ConfigError) as info:
        model_args("llama", "debug", {key: value})
    msg = str(info.value)
    assert key in msg and expected in msg


def test_inconsistent_args_are_config_errors():
    with pytest.raises(ConfigError, match="n_kv_heads"):
        model_args("llama", "debug", {"n_kv_heads": 3})
    with pytest.raises(ConfigError, match="head_dim"):
        model_args("llama", "debug", {"d_model": 66})
    with pytest.raises(ConfigError, match="rope_scaling"):
        model_args("llama", "debug", {"rope_scaling": {"type": "yarn", "factor": 2.0}})
    with pytest.raises(ConfigError, match="low_freq_factor"):
        model_args("llama", "debug", {"rope_scaling": {"type": "llama3", "factor": 8.0}})


def test_build_model_devices():
    args = model_args("llama", "debug", {})
    meta = build_model("llama", args, device="meta")
    assert all(p.is_meta for p in meta.parameters())
    torch.manual_seed(0)
    a = build_model(get_family("llama"), args)
    torch.manual_seed(0)
    b = build_model("llama", args, device=torch.device("cpu"))
    assert isinstance(a, Llama) and a.args is args
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), name
    with pytest.raises(TypeError, match="LlamaArgs"):
        build_model("llama", {"d_model": 64})


def test_family_record_fits_future_families():
    # A family is plain data: a diffusion family (LLaDA) is the same record with another objective.
    fam = Family(
        "toy", Llama, LlamaArgs, {"debug": {"d_model": 32, "n_heads": 2, "n_kv_heads": 2}}, "diffusion"
    )
    args = model_args(fam, "debug", {"n_layers": 1, "vocab_size": 64, "ffn_dim": 64})
    model = build_model(fam, args, device="cpu")
    assert model(torch.zeros(1, 4, dtype=torch.long)).shape == (1, 4, 64)
    assert "toy" not in FAMILIES
