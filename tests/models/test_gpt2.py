from __future__ import annotations

import pytest
import torch

from gptoughts.models import Family, build_model, model_args
from gptoughts.models.gpt2 import (
    GPT2,
    GPT2_SIZES,
    HF_MODEL_TYPES,
    GPT2Args,
    args_from_hf,
    from_hf,
    hf_config,
    to_hf,
)
from gptoughts.models.hf import HFAdapter, UnsupportedHFConfig
from gptoughts.sampling import generate


def _args(**overrides) -> GPT2Args:
    return model_args("gpt2", "debug", overrides)


def _model(seed: int = 0, **overrides) -> GPT2:
    torch.manual_seed(seed)
    return build_model("gpt2", _args(**overrides), device="cpu").eval()


def _ids(b: int = 2, t: int = 12, vocab: int = 512, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


def test_shapes_hidden_times_head_is_logits_and_tied():
    model = _model()
    ids = _ids()
    logits = model(ids)
    assert logits.shape == (2, 12, 512) and logits.dtype == torch.float32
    hidden = model(ids, return_hidden=True)
    assert hidden.shape == (2, 12, 64)
    torch.testing.assert_close(hidden @ model.output_weight.T, logits, rtol=0, atol=1e-5)
    assert model.output_weight is model.wte.weight
    assert not any(k.startswith(("lm_head", "output")) for k in model.state_dict())


def test_causality():
    model = _model()
    ids = _ids(t=16)
    changed = ids.clone()
    changed[:, 9] = (changed[:, 9] + 1) % 512
    a, b = model(ids), model(changed)
    assert (a[:, :9] - b[:, :9]).abs().max() <= 1e-6
    assert (a[:, 9:] - b[:, 9:]).abs().max() > 1e-4


def test_meta_build_then_init_matches_direct_build_and_is_finite():
    args = _args()
    direct = GPT2(args)
    torch.manual_seed(123)
    direct.init_weights()
    with torch.device("meta"):
        lazy = GPT2(args)
    lazy.to_empty(device="cpu")
    with torch.no_grad():
        for t in lazy.parameters():
            t.fill_(float("nan"))
    torch.manual_seed(123)
    lazy.init_weights()
    ref = dict(direct.named_parameters())
    for name, t in lazy.named_parameters():
        assert torch.isfinite(t).all(), name
        assert torch.equal(t, ref[name]), name
    assert torch.isfinite(lazy.eval()(_ids())).all()
    # GPT-2's init: c_proj scaled down by sqrt(2 L), biases zero, LayerNorms (1, 0).
    names = dict(lazy.named_parameters())
    assert torch.count_nonzero(names["layers.0.attn.c_attn.bias"]) == 0
    assert torch.equal(names["layers.1.ln_2.weight"], torch.ones(64))


def test_kv_cache_matches_full_forward_and_position_ids():
    model = _model()
    ids = _ids(t=20)
    full = model(ids)
    cache = model.new_cache(batch_size=2, max_len=20)
    parts = [
        model(ids[:, :8], cache=cache),
        model(ids[:, 8:13], cache=cache),
        *(model(ids[:, t : t + 1], cache=cache) for t in range(13, 20)),
    ]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=0, atol=1e-5)
    pos = torch.arange(20).expand(2, 20)
    torch.testing.assert_close(model(ids, position_ids=pos), full, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(_ids(t=257))


def test_generation_with_and_without_cache_agree():
    model = _model()
    prompt = _ids(b=2, t=5)
    cached = generate(model, prompt, 12, temperature=0.0, use_cache=True)
    plain = generate(model, prompt, 12, temperature=0.0, use_cache=False)
    assert cached.shape == (2, 17) and torch.equal(cached, plain)


def test_param_counts():
    small = build_model("gpt2", model_args("gpt2", "small", {}), device="meta")
    assert small.num_params() == 124_439_808  # GPT-2 small's published count (vocab 50257, 1024 positions)
    assert small.num_params(non_embedding=True) == 124_439_808 - (50257 + 1024) * 768
    counts = {
        s: build_model("gpt2", model_args("gpt2", s, {}), device="meta").num_params()
        for s in ("medium", "large", "xl")
    }
    assert counts == {"medium": 354_823_168, "large": 774_030_080, "xl": 1_557_611_200}
    model = _model()
    n = model.num_params(non_embedding=True) + 512 * 64
    assert model.flops_per_token(256) == 6 * n + 12 * 2 * 64 * 256


# ------------------------------------------------------------------------------- parity with transformers

transformers = pytest.importorskip("transformers")


def _hf_model(seed: int = 0, **config_overrides):
    args = _args(vocab_size=256, max_seq_len=64)
    cfg = transformers.GPT2Config(**(hf_config(args) | config_overrides))
    cfg._attn_implementation = "eager"  # an independent reference: plain matmul + softmax
    torch.manual_seed(seed)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    # HF inits biases to 0 and LayerNorms to (1, 0), which would hide a mis-mapped bias or norm: perturb all.
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.2 * noise if ".ln_" in name and name.endswith("weight") else 0.05 * noise)
    return hf, args


def test_hf_config_round_trip():
    assert HF_MODEL_TYPES == ("gpt2",)
    for args in (_args(), model_args("gpt2", "xl", {}), _args(ffn_dim=96, gelu_approximate="none")):
        cfg = hf_config(args)
        assert cfg["architectures"] == ["GPT2LMHeadModel"] and cfg["model_type"] == "gpt2"
        assert args_from_hf(cfg) == args
        # What HF itself writes to config.json reads back the same way.
        assert args_from_hf(transformers.GPT2Config(**cfg).to_dict()) == args


def test_parity_with_transformers():
    hf, args = _hf_model()
    assert args_from_hf(hf.config.to_dict()) == args
    ours = build_model("gpt2", args, device="cpu").eval()
    missing, unexpected = ours.load_state_dict(from_hf(hf.state_dict(), args), strict=True)
    assert not missing and not unexpected
    ids = _ids(b=2, t=24, vocab=256)
    with torch.no_grad():
        assert (ours(ids) - hf(input_ids=ids).logits).abs().max().item() <= 1e-4
        pos = torch.arange(24).expand(2, 24) + 30
        assert (ours(ids, position_ids=pos) - hf(input_ids=ids, position_ids=pos).logits).abs().max() <= 1e-4


def test_parity_exact_gelu_and_custom_inner():
    hf, _ = _hf_model(activation_function="gelu", n_inner=96)
    args = args_from_hf(hf.config.to_dict())
    assert args.gelu_approximate == "none" and args.ffn_dim == 96
    ours = build_model("gpt2", args, device="cpu").eval()
    ours.load_state_dict(from_hf(hf.state_dict(), args), strict=True)
    ids = _ids(t=16, vocab=256)
    with torch.no_grad():
        assert (ours(ids) - hf(input_ids=ids).logits).abs().max().item() <= 1e-4


def test_export_to_transformers():
    torch.manual_seed(0)
    ours = build_model("gpt2", _args(vocab_size=256, max_seq_len=64), device="cpu").eval()
    with torch.no_grad():  # move norms and biases off their init so a swapped mapping would show
        for p in ours.parameters():
            p.add_(0.05 * torch.randn_like(p))
    exported = to_hf(ours.state_dict(), ours.args)
    assert "lm_head.weight" not in exported  # tied, as save_pretrained writes it
    assert all(t.is_contiguous() for t in exported.values())  # safetensors needs contiguous tensors
    cfg = transformers.GPT2Config(**hf_config(ours.args))
    cfg._attn_implementation = "eager"
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    missing, unexpected = hf.load_state_dict(exported, strict=False)
    assert list(missing) == ["lm_head.weight"] and not unexpected
    assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()  # still tied in HF
    ids = _ids(t=16, vocab=256)
    with torch.no_grad():
        ref = ours(ids)
        assert (hf(input_ids=ids).logits - ref).abs().max().item() <= 1e-4
        # Back again: exactly the tensors we started from.
        back = from_hf(hf.state_dict(), ours.args)
        assert back.keys() == ours.state_dict().keys()
        assert all(torch.equal(back[k], v) for k, v in ours.state_dict().items())


def test_from_hf_accepts_bare_gpt2model_names_and_old_buffers():
    hf, args = _hf_model()
    sd = {k.removeprefix("transformer."): v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    sd["h.0.attn.bias"] = torch.ones(1, 1, 64, 64).tril()  # the mask buffers of OpenAI's checkpoints
    sd["h.0.attn.masked_bias"] = torch.tensor(-1e4)
    ours = build_model("gpt2", args, device="cpu")
    ours.load_state_dict(from_hf(sd, args), strict=True)
    with pytest.raises(ValueError, match="unexpected"):
        from_hf({**hf.state_dict(), "score.weight": torch.zeros(2, 64)}, args)
    untied = dict(hf.state_dict())
    untied["lm_head.weight"] = untied["lm_head.weight"] + 1
    with pytest.raises(ValueError, match="untied"):
        from_hf(untied, args)


@pytest.mark.parametrize(
    "key, value",
    [
        ("activation_function", "relu"),
        ("scale_attn_by_inverse_layer_idx", True),
        ("tie_word_embeddings", False),
    ],
)
def test_unsupported_hf_configs_fall_back_to_the_generic_path(key, value):
    # UnsupportedHFConfig (not a user error) makes models/hf.py load the checkpoint through transformers.
    cfg = hf_config(_args()) | {key: value}
    with pytest.raises(UnsupportedHFConfig, match=key if key != "activation_function" else "relu"):
        args_from_hf(cfg)


def test_hf_config_keeps_the_base_config():
    base = {"model_type": "gpt2", "eos_token_id": 7, "task_specific_params": {"x": 1}, "n_embd": 999}
    cfg = hf_config(_args(), base)
    assert cfg["eos_token_id"] == 7 and cfg["task_specific_params"] == {"x": 1} and cfg["n_embd"] == 64
    assert hf_config(_args())["eos_token_id"] is None  # not GPT-2's 50256: the writer sets the tokenizer's


def test_save_hf_folder_loads_in_transformers_and_back(tmp_path, monkeypatch):
    # End to end through the generic machinery of models/hf.py: save_hf writes config.json + safetensors
    # (tied head omitted) + tokenizer, transformers' own from_pretrained reads it, and load_pretrained takes
    # the native path back once the family's adapter is registered (as the registry will do).
    from gptoughts import models
    from gptoughts.data.tokenizer import bytes_tokenizer
    from gptoughts.models.hf import load_pretrained
    from gptoughts.models.hf_export import save_hf

    fam = Family(
        "gpt2",
        GPT2,
        GPT2Args,
        GPT2_SIZES,
        hf=HFAdapter(HF_MODEL_TYPES, args_from_hf, hf_config, from_hf, to_hf),
    )
    ours = _model(vocab_size=320, max_seq_len=64)
    tok = bytes_tokenizer()
    out = save_hf(ours, fam, ours.args, tok, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), attn_implementation="eager").eval()
    assert type(hf).__name__ == "GPT2LMHeadModel" and hf.config.eos_token_id == tok.eos_id
    ids = _ids(t=16, vocab=320)
    with torch.no_grad():
        assert (hf(input_ids=ids).logits - ours(ids)).abs().max().item() <= 1e-4
    monkeypatch.setitem(models.FAMILIES, "gpt2", fam)
    back = load_pretrained(out)
    assert back.family == "gpt2" and not back.generic and back.args == ours.args
    with torch.no_grad():
        assert torch.equal(back.model(ids), ours(ids))


def test_packed_rows_match_separate_documents():
    model = _model()
    a, b = _ids(b=1, t=5, seed=3), _ids(b=1, t=7, seed=4)
    packed = torch.cat([a, b], dim=1)
    pos = torch.cat([torch.arange(5), torch.arange(7)])[None]
    docs = torch.tensor([[0] * 5 + [1] * 7])
    out = model(packed, position_ids=pos, doc_ids=docs)
    torch.testing.assert_close(out, torch.cat([model(a), model(b)], dim=1), rtol=0, atol=1e-5)
