"""Importing local Hugging Face folders: native adapters (parity with transformers), shards, .bin, generic path."""

from __future__ import annotations

import json
import pickle

import pytest
import torch
from hf_helpers import hf_logits, transformers

from gptoughts.errors import UserError
from gptoughts.models.hf import load_pretrained, read_state_dict
from gptoughts.models.hf_generic import HFCausalLM


def _ids(t: int = 24, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 320, (2, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "kind, kw",
    [
        ("llama", {}),
        ("llama", {"tie_word_embeddings": True}),
        ("mistral", {"sliding_window": 8}),  # 24 tokens > window: the banded mask matters
        ("qwen2", {}),
        ("qwen3", {}),
    ],
)
def test_native_import_matches_transformers(hf_model, kind, kw):
    folder = hf_model(kind, **kw)
    pre = load_pretrained(folder)
    assert pre.family == "llama" and not pre.generic and pre.notice is None
    a = pre.args
    assert (a.qkv_bias, a.qk_norm) == (kind == "qwen2", kind == "qwen3")
    assert a.tie_embeddings == bool(kw.get("tie_word_embeddings"))
    assert a.sliding_window == kw.get("sliding_window")
    ids = _ids()
    with torch.no_grad():
        got = pre.model(ids)
    assert (got - hf_logits(folder, ids)).abs().max().item() <= 1e-4


def test_sliding_window_matches_sdpa_and_changes_logits(hf_model):
    windowed_dir = hf_model("mistral", name="w", sliding_window=6)
    windowed = load_pretrained(windowed_dir).model
    full = load_pretrained(
        hf_model("mistral", name="f", sliding_window=None)
    ).model  # same weights, no window
    ids = _ids(t=20)
    with torch.no_grad():
        got = windowed(ids)
        ref = full(ids)
    assert (got - hf_logits(windowed_dir, ids, attn="sdpa")).abs().max().item() <= 1e-4
    # The first 6 positions see the same keys either way; later ones must differ.
    assert (got[:, :6] - ref[:, :6]).abs().max() <= 1e-5
    assert (got[:, 10:] - ref[:, 10:]).abs().max() > 1e-3


def test_sharded_safetensors_and_bin_weights(hf_model, tmp_path):
    folder = hf_model("qwen2")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder))
    sharded = tmp_path / "sharded"
    model.save_pretrained(str(sharded), max_shard_size="60KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (sharded / f).write_bytes((folder / f).read_bytes())
    ids = _ids()
    with torch.no_grad():
        ref = load_pretrained(folder).model(ids)
        assert torch.equal(load_pretrained(sharded).model(ids), ref)

    # A plain tensor pickle is read with weights_only=True...
    as_bin = tmp_path / "bin"
    as_bin.mkdir()
    for f in folder.iterdir():
        if f.suffix != ".safetensors":
            (as_bin / f.name).write_bytes(f.read_bytes())
    torch.save(read_state_dict(folder), as_bin / "pytorch_model.bin")
    with torch.no_grad():
        assert torch.equal(load_pretrained(as_bin).model(ids), ref)
    # ...and one that would run code is refused, not executed.
    (as_bin / "pytorch_model.bin").write_bytes(pickle.dumps(_Evil()))
    with pytest.raises(UserError, match="not a plain tensor file"):
        read_state_dict(as_bin)


class _Evil:
    def __reduce__(self):
        return (print, ("this must never run",))


def test_folder_errors_are_user_errors(hf_model, tmp_path):
    with pytest.raises(UserError, match="no config.json"):
        load_pretrained(tmp_path)
    folder = hf_model("llama")
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer_config.json").unlink()
    with pytest.raises(UserError, match="no tokenizer files"):
        load_pretrained(folder)
    other = hf_model("llama", name="noweights")
    (other / "model.safetensors").unlink()
    with pytest.raises(UserError, match="holds no weights"):
        load_pretrained(other)


def test_unsupported_config_takes_generic_path_with_notice(hf_model):
    folder = hf_model("llama", mlp_bias=True)  # a bias our SwiGLU does not have: must not load natively
    pre = load_pretrained(folder)
    assert pre.generic and isinstance(pre.model, HFCausalLM)
    assert "bias on the MLP" in pre.notice and "\n" not in pre.notice
    ids = _ids()
    with torch.no_grad():
        logits = pre.model(ids)
        hidden = pre.model(ids, return_hidden=True)
    assert (logits - hf_logits(folder, ids)).abs().max().item() <= 1e-4
    torch.testing.assert_close(hidden @ pre.model.output_weight.T, logits, rtol=0, atol=1e-4)


def test_generic_wrapper_protocol_and_trust_remote_code_off(hf_model, monkeypatch):
    folder = hf_model("gpt_neox")
    seen = {}
    original = transformers.AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy)
    pre = load_pretrained(folder)
    assert seen["trust_remote_code"] is False
    m = pre.model
    assert pre.generic and "gpt_neox" in pre.notice and len(m.layers) == 2
    assert m.args.vocab_size == 320 and m.args.d_model == 64
    # the wrapped modules are not registered twice: one name per parameter
    assert len(m.state_dict()) == len(m.hf.state_dict())
    assert m.flops_per_token(32) > 6 * m.num_params(non_embedding=True)
    out = m.hf_generate(_ids(t=4)[:1], 3, temperature=0.0, eos_id=None)
    assert out.shape == (1, 7)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == "gpt_neox"


def _other_family(kind: str):
    if kind == "gpt2":
        return transformers.GPT2LMHeadModel(
            transformers.GPT2Config(
                n_embd=64,
                n_layer=2,
                n_head=4,
                vocab_size=320,
                n_positions=128,
                bos_token_id=0,
                eos_token_id=0,
            )
        )
    return transformers.DeepseekV3ForCausalLM(
        transformers.DeepseekV3Config(
            hidden_size=64,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
            vocab_size=320,
            max_position_embeddings=128,
        )
    )


@pytest.mark.parametrize("kind, family", [("gpt2", "gpt2"), ("deepseek_v3", "deepseek")])
def test_other_registered_adapters_import_and_export(kind, family, tmp_path):
    from hf_helpers import make_tokenizer, randomize

    from gptoughts.models.hf_export import save_hf

    folder = tmp_path / kind
    model = _other_family(kind)
    randomize(model)
    model.save_pretrained(str(folder))
    make_tokenizer().save(folder)
    pre = load_pretrained(folder)
    assert pre.family == family and not pre.generic
    ids = _ids(t=16)
    with torch.no_grad():
        ours = pre.model(ids)
    assert (ours - hf_logits(folder, ids)).abs().max().item() <= 1e-4
    out = save_hf(pre.model, family, pre.args, pre.tokenizer, tmp_path / "out", base_config=pre.config)
    assert (ours - hf_logits(out, ids)).abs().max().item() <= 1e-4
