from __future__ import annotations

import inspect
import math
import re

import pytest
import torch

from gptoughts.models import build_model, model_args
from gptoughts.models.layers import sdpa
from gptoughts.models.llama import Llama, LlamaArgs


def _args(**overrides) -> LlamaArgs:
    return model_args("llama", "debug", overrides)


def _model(seed: int = 0, **overrides) -> Llama:
    torch.manual_seed(seed)
    return build_model("llama", _args(**overrides), device="cpu").eval()


def _ids(b: int = 2, t: int = 12, vocab: int = 512, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


def test_shapes_and_hidden_times_head_is_logits():
    model = _model()
    ids = _ids()
    logits = model(ids)
    assert logits.shape == (2, 12, 512) and logits.dtype == torch.float32
    hidden = model(ids, return_hidden=True)
    assert hidden.shape == (2, 12, 64)
    assert model.output_weight.shape == (512, 64)
    torch.testing.assert_close(hidden @ model.output_weight.T, logits, rtol=0, atol=1e-5)


def test_causality():
    model = _model()
    ids = _ids(t=16)
    changed = ids.clone()
    changed[:, 9] = (changed[:, 9] + 1) % 512
    a, b = model(ids), model(changed)
    assert torch.equal(a[:, :9], b[:, :9]) or (a[:, :9] - b[:, :9]).abs().max() <= 1e-6
    assert (a[:, 9:] - b[:, 9:]).abs().max() > 1e-4  # the change does propagate forward


def test_gqa_equals_mha_with_duplicated_kv_heads():
    torch.manual_seed(0)
    gqa = build_model("llama", _args(n_heads=4, n_kv_heads=2), device="cpu").eval()
    mha = build_model("llama", _args(n_heads=4, n_kv_heads=4), device="cpu").eval()
    sd = gqa.state_dict()
    hd = 16
    for k, v in list(sd.items()):
        if k.endswith(("attention.wk.weight", "attention.wv.weight")):
            # kv head j serves query heads 2j and 2j+1: repeat each head's rows.
            sd[k] = v.view(2, hd, 64).repeat_interleave(2, dim=0).reshape(4 * hd, 64)
    mha.load_state_dict(sd)
    ids = _ids()
    torch.testing.assert_close(gqa(ids), mha(ids), rtol=0, atol=1e-5)
    # multi-query attention (one kv head) runs too
    mqa = _model(n_kv_heads=1)
    assert torch.isfinite(mqa(ids)).all()


@pytest.mark.parametrize(
    "overrides",
    [dict(qk_norm=True), dict(qkv_bias=True), dict(qk_norm=True, qkv_bias=True, head_dim=32)],
)
def test_variants_forward_backward(overrides):
    model = _model(**overrides).train()
    names = dict(model.named_parameters())
    if overrides.get("qk_norm"):
        assert "layers.0.attention.q_norm.weight" in names and "layers.0.attention.k_norm.weight" in names
    if overrides.get("qkv_bias"):
        assert "layers.0.attention.wq.bias" in names and "layers.0.attention.wo.bias" not in names
        assert torch.count_nonzero(names["layers.0.attention.wq.bias"]) == 0
    if overrides.get("head_dim"):
        assert names["layers.0.attention.wq.weight"].shape == (4 * 32, 64)
    ids = _ids()
    logits = model(ids)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_tied_embeddings_share_storage():
    model = _model(tie_embeddings=True)
    assert model.output is None
    assert model.output_weight.data_ptr() == model.tok_embeddings.weight.data_ptr()
    assert "output.weight" not in model.state_dict()
    untied = _model()
    assert untied.num_params() - model.num_params() == 512 * 64
    assert model.num_params(non_embedding=True) == untied.num_params(non_embedding=True) - 512 * 64
    # the head matmul still runs, so its FLOPs still count
    assert model.flops_per_token(128) == untied.flops_per_token(128)


def _all_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


@pytest.mark.parametrize("overrides", [{}, dict(qk_norm=True, qkv_bias=True, tie_embeddings=True)])
def test_meta_build_then_init_matches_direct_build(overrides):
    args = _args(**overrides)
    direct = Llama(args)  # default PyTorch init, consumed RNG: must all be overwritten by init_weights
    torch.manual_seed(123)
    direct.init_weights()

    with torch.device("meta"):
        lazy = Llama(args)
    assert all(t.is_meta for t in _all_tensors(lazy).values())
    lazy.to_empty(device="cpu")
    with torch.no_grad():
        for t in _all_tensors(lazy).values():
            t.fill_(float("nan"))  # whatever to_empty left must not survive
    torch.manual_seed(123)
    lazy.init_weights()

    torch.manual_seed(123)
    registry = build_model("llama", args, device="cpu")

    ref = _all_tensors(direct)
    for other in (lazy, registry):
        got = _all_tensors(other)
        assert got.keys() == ref.keys()
        for name, t in got.items():
            assert torch.isfinite(t).all(), name
            assert torch.equal(t, ref[name]), name
    assert torch.isfinite(lazy.eval()(_ids())).all()


def test_init_statistics():
    torch.manual_seed(0)
    args = _args(d_model=256, n_layers=8, n_heads=4, n_kv_heads=4, ffn_dim=512, qkv_bias=True)
    model = build_model("llama", args, device="cpu")
    out_std = 0.02 / math.sqrt(2 * 8)
    for name, p in model.named_parameters():
        if name.endswith(("norm.weight",)):
            assert torch.equal(p, torch.ones_like(p)), name
        elif name.endswith(".bias"):
            assert torch.count_nonzero(p) == 0, name
        elif name.endswith(("wo.weight", "w2.weight")):
            assert abs(p.std().item() - out_std) < 0.1 * out_std, name
        else:
            assert abs(p.std().item() - 0.02) < 0.002, name
            assert abs(p.mean().item()) < 0.002, name


def test_param_count_and_flops_of_debug_size():
    a = _args()
    d, L, V, ffn, hd = a.d_model, a.n_layers, a.vocab_size, a.ffn_dim, a.d_model // a.n_heads
    attn = d * (a.n_heads * hd) + 2 * d * (a.n_kv_heads * hd) + (a.n_heads * hd) * d
    mlp = 3 * d * ffn
    per_layer = attn + mlp + 2 * d
    expected = V * d + L * per_layer + d + V * d
    model = _model()
    assert model.num_params() == expected == 139_584
    assert model.num_params(non_embedding=True) == expected - V * d
    assert model.flops_per_token(256) == 6 * (expected - V * d) + 12 * L * d * 256


def test_kv_cache_matches_full_forward():
    model = _model()
    ids = _ids(t=20)
    full = model(ids)
    cache = model.new_cache(batch_size=2, max_len=20)
    parts = [
        model(ids[:, :8], cache=cache),  # prefill into an empty cache (is_causal path)
        model(ids[:, 8:13], cache=cache),  # prefill after a prefix (explicit mask path)
        *(model(ids[:, t : t + 1], cache=cache) for t in range(13, 20)),  # decode one token at a time
    ]
    assert cache.length == 20
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="KV cache overflow"):
        model(_ids(t=1), cache=cache)
    cache.reset()
    torch.testing.assert_close(model(ids[:, :8], cache=cache), full[:, :8], rtol=0, atol=1e-5)


def test_explicit_position_ids_and_length_limit():
    model = _model(max_seq_len=32)
    ids = _ids(t=10)
    pos = torch.arange(10).expand(2, 10)
    torch.testing.assert_close(model(ids, position_ids=pos), model(ids), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(_ids(t=33))
    with pytest.raises(ValueError, match="max_seq_len"):
        model.new_cache(1, 64)


def test_sdpa_masked_gqa_path_matches_reference():
    torch.manual_seed(0)
    q = torch.randn(2, 4, 3, 8)
    k = torch.randn(2, 2, 7, 8)
    v = torch.randn(2, 2, 7, 8)
    out = sdpa(q, k, v, causal=True)
    kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = q @ kr.transpose(-1, -2) / math.sqrt(8)
    allowed = torch.ones(3, 7, dtype=torch.bool).tril(diagonal=4)  # query i sits at position 4 + i
    ref = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ vr
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------- parity with transformers

transformers = pytest.importorskip("transformers")

_HF_RENAMES = [
    (r"^model\.embed_tokens\.", "tok_embeddings."),
    (r"^model\.norm\.", "norm."),
    (r"^lm_head\.", "output."),
    (r"^model\.layers\.", "layers."),
    (r"\.self_attn\.q_proj\.", ".attention.wq."),
    (r"\.self_attn\.k_proj\.", ".attention.wk."),
    (r"\.self_attn\.v_proj\.", ".attention.wv."),
    (r"\.self_attn\.o_proj\.", ".attention.wo."),
    (r"\.self_attn\.q_norm\.", ".attention.q_norm."),
    (r"\.self_attn\.k_norm\.", ".attention.k_norm."),
    (r"\.mlp\.gate_proj\.", ".feed_forward.w1."),
    (r"\.mlp\.up_proj\.", ".feed_forward.w3."),
    (r"\.mlp\.down_proj\.", ".feed_forward.w2."),
    (r"\.input_layernorm\.", ".attention_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
]


def _hf_to_ours(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in state_dict.items():
        for pattern, repl in _HF_RENAMES:
            name = re.sub(pattern, repl, name)
        out[name] = tensor
    return out


def _hf_config(cls, rope_theta: float, rope_scaling: dict | None, **kw):
    # transformers 5 takes `rope_parameters`; 4.x took `rope_theta` + `rope_scaling`.
    if "rope_parameters" in inspect.signature(cls.__init__).parameters:
        params = {"rope_type": "default", "rope_theta": rope_theta}
        if rope_scaling:
            params.update(
                {k: v for k, v in rope_scaling.items() if k != "type"}, rope_type=rope_scaling["type"]
            )
        kw["rope_parameters"] = params
    else:
        kw["rope_theta"] = rope_theta
        if rope_scaling:
            kw["rope_scaling"] = {("rope_type" if k == "type" else k): v for k, v in rope_scaling.items()}
    return cls(**kw)


def _randomize(model: torch.nn.Module) -> None:
    # HF inits norms to 1 and biases to 0, which would hide a mis-mapped norm or bias: perturb everything.
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.2 * noise if "norm" in name else 0.05 * noise)


LLAMA3_SCALING = {
    "type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


@pytest.mark.parametrize(
    "family, extra",
    [
        ("llama", {}),
        ("llama", dict(rope_scaling=LLAMA3_SCALING, rope_theta=500000.0)),
        ("llama", dict(rope_scaling={"type": "linear", "factor": 4.0})),
        ("qwen2", dict(qkv_bias=True)),
        ("qwen3", dict(qk_norm=True, head_dim=32)),
    ],
)
def test_parity_with_transformers(family, extra):
    theta = extra.get("rope_theta", 10000.0)
    common = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=256,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    if family == "llama":
        cfg = _hf_config(
            transformers.LlamaConfig, theta, extra.get("rope_scaling"), attention_bias=False, **common
        )
        hf_cls = transformers.LlamaForCausalLM
    elif family == "qwen2":
        cfg = _hf_config(transformers.Qwen2Config, theta, None, use_sliding_window=False, **common)
        hf_cls = transformers.Qwen2ForCausalLM
    else:
        cfg = _hf_config(
            transformers.Qwen3Config,
            theta,
            None,
            head_dim=32,
            attention_bias=False,
            use_sliding_window=False,
            **common,
        )
        hf_cls = transformers.Qwen3ForCausalLM
    cfg._attn_implementation = "eager"  # an independent reference: plain matmul + softmax
    torch.manual_seed(0)
    hf = hf_cls(cfg).eval()
    _randomize(hf)

    ours = build_model("llama", _args(vocab_size=256, max_seq_len=256, **extra), device="cpu").eval()
    missing, unexpected = ours.load_state_dict(_hf_to_ours(hf.state_dict()), strict=True)
    assert not missing and not unexpected

    ids = _ids(b=2, t=24, vocab=256)
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        got = ours(ids)
        assert (got - ref).abs().max().item() <= 1e-4
        pos = torch.arange(24).expand(2, 24) + 90  # beyond original_max_position_embeddings: scaling matters
        ref_pos = hf(input_ids=ids, position_ids=pos).logits
        got_pos = ours(ids, position_ids=pos)
        assert (got_pos - ref_pos).abs().max().item() <= 1e-4
