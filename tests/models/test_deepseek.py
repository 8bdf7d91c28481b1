from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from gptoughts.errors import ConfigError, UserError
from gptoughts.models import build_model, list_sizes, model_args
from gptoughts.models import deepseek as ds
from gptoughts.models.deepseek import DeepSeek, DeepSeekArgs, GroupedExperts
from gptoughts.sampling import generate


def _args(**overrides) -> DeepSeekArgs:
    return model_args("deepseek", "debug", overrides)


def _model(seed: int = 0, **overrides) -> DeepSeek:
    torch.manual_seed(seed)
    return build_model("deepseek", _args(**overrides), device="cpu").eval()


def _ids(b: int = 2, t: int = 12, vocab: int = 512, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


def _plain_ce(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = F.linear(hidden.reshape(-1, hidden.size(-1)), weight)
    return F.cross_entropy(logits.float(), targets.reshape(-1), ignore_index=-100, reduction="sum")


# ----------------------------------------------------------------------------------------- protocol


def test_shapes_and_hidden_times_head_is_logits():
    model = _model(q_lora_rank=16)
    ids = _ids()
    logits = model(ids)
    assert logits.shape == (2, 12, 512) and logits.dtype == torch.float32
    hidden = model(ids, return_hidden=True)
    assert hidden.shape == (2, 12, 64)
    assert model.output_weight.shape == (512, 64)
    torch.testing.assert_close(hidden @ model.output_weight.T, logits, rtol=0, atol=1e-5)
    assert isinstance(model.layers, torch.nn.ModuleList) and len(model.layers) == 3
    assert [b.is_moe for b in model.layers] == [False, True, True]  # the first n_dense_layers are dense


def test_causality():
    model = _model()
    ids = _ids(t=16)
    changed = ids.clone()
    changed[:, 9] = (changed[:, 9] + 1) % 512
    a, b = model(ids), model(changed)
    assert (a[:, :9] - b[:, :9]).abs().max() <= 1e-6  # routing is per token: no leak through the MoE
    assert (a[:, 9:] - b[:, 9:]).abs().max() > 1e-4


def _all_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def test_meta_build_then_init_matches_direct_build():
    args = _args(q_lora_rank=16, mtp_depth=1)
    direct = DeepSeek(args)
    torch.manual_seed(123)
    direct.init_weights()

    with torch.device("meta"):
        lazy = DeepSeek(args)
    assert all(t.is_meta for t in _all_tensors(lazy).values())
    lazy.to_empty(device="cpu")
    with torch.no_grad():
        for t in _all_tensors(lazy).values():
            t.fill_(float("nan"))  # whatever to_empty left must not survive
    torch.manual_seed(123)
    lazy.init_weights()

    ref = _all_tensors(direct)
    got = _all_tensors(lazy)
    assert got.keys() == ref.keys()
    for name, t in got.items():
        assert torch.isfinite(t).all(), name
        assert torch.equal(t, ref[name]), name
    assert "layers.1.feed_forward.expert_bias" in lazy.state_dict()  # persistent: checkpointed and exported
    assert torch.isfinite(lazy.eval()(_ids())).all()


def test_param_counts_and_flops():
    model = _model()
    a = model.args
    assert model.num_params() == sum(p.numel() for p in model.parameters()) == 252_960
    per_expert = 3 * a.d_model * a.moe_inter_dim
    idle = a.n_moe_layers * (a.n_routed_experts - a.n_activated_experts) * per_expert
    assert model.num_active_params() == model.num_params() - idle
    non_emb = model.num_active_params(non_embedding=True)
    assert non_emb == model.num_params() - idle - a.vocab_size * a.d_model
    attn = 6 * a.n_layers * a.n_heads * (a.qk_head_dim + a.v_head_dim) * 256
    assert model.flops_per_token(256) == 6 * non_emb + attn
    # MTP: counted in the total, and in training FLOPs (one more block and a second head pass), not in "active"
    mtp = _model(mtp_depth=1)
    mtp_params = sum(p.numel() for p in mtp.mtp.parameters())
    assert mtp.num_params() == model.num_params() + mtp_params
    assert mtp.num_active_params() == model.num_active_params()
    extra = mtp_params - (a.n_routed_experts - a.n_activated_experts) * per_expert + a.vocab_size * a.d_model
    attn_mtp = 6 * (a.n_layers + 1) * a.n_heads * (a.qk_head_dim + a.v_head_dim) * 256
    assert mtp.flops_per_token(256) == 6 * (non_emb + extra) + attn_mtp


@pytest.mark.parametrize(
    "size, total, active",
    [("small", 1_118_151_680, 262_906_880), ("16b", 15_706_484_224, 2_661_150_208)],
)
def test_size_presets_on_meta(size, total, active):
    assert size in list_sizes("deepseek")
    model = build_model("deepseek", model_args("deepseek", size), device="meta")
    assert model.num_params() == total
    assert model.num_active_params() == active
    if size == "16b":  # DeepSeek-V2-Lite: 15.7B total, ~2.4B active (non-embedding)
        assert round(total / 1e9, 1) == 15.7
        assert 2.3e9 < model.num_active_params(non_embedding=True) < 2.5e9


def test_args_validation():
    with pytest.raises(ConfigError, match="n_activated_experts"):
        _args(n_activated_experts=9)
    with pytest.raises(ConfigError, match="score_func"):
        _args(score_func="relu")
    with pytest.raises(ConfigError, match="n_expert_groups"):
        _args(n_expert_groups=3)
    with pytest.raises(ConfigError, match="mtp_depth"):
        _args(mtp_depth=2)
    with pytest.raises(ConfigError, match="rope_scaling"):
        _args(rope_scaling={"type": "yarn", "factor": 4.0})
    with pytest.raises(ConfigError, match="unknown field"):
        _args(n_experts=4)


# ----------------------------------------------------------------------------------------- KV cache


def test_latent_cache_matches_full_forward():
    model = _model(q_lora_rank=16)
    ids = _ids(t=20)
    full = model(ids)
    cache = model.new_cache(batch_size=2, max_len=20)
    parts = [
        model(ids[:, :8], cache=cache),  # prefill into an empty cache
        model(ids[:, 8:13], cache=cache),  # prefill after a prefix (explicit mask)
        *(model(ids[:, t : t + 1], cache=cache) for t in range(13, 20)),  # one token at a time
    ]
    assert cache.latent[0].shape == (2, 20, 32 + 8)  # kv_lora_rank + qk_rope_head_dim per token
    assert cache.length == 20
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="KV cache overflow"):
        model(_ids(t=1), cache=cache)


def test_generate_with_and_without_cache_agree():
    model = _model()
    prompt = _ids(t=5, seed=3)
    with_cache = generate(model, prompt, 12, temperature=0, use_cache=True)
    without = generate(model, prompt, 12, temperature=0, use_cache=False)
    assert with_cache.shape == (2, 17)
    assert torch.equal(with_cache, without)


# ----------------------------------------------------------------------------------------- MoE


def _naive_experts(x, idx, gates, w1, w3, w2):
    out = torch.zeros_like(x)
    for n in range(x.size(0)):
        for k in range(idx.size(1)):
            e = int(idx[n, k])
            h = F.silu(x[n] @ w1[e].T) * (x[n] @ w3[e].T)
            out[n] += gates[n, k] * (h @ w2[e].T)
    return out


@pytest.mark.parametrize("impl", ["loop", "grouped_mm"])
def test_moe_dispatch_matches_naive_reference(impl):
    if impl == "grouped_mm" and not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm not available")
    torch.manual_seed(0)
    experts = GroupedExperts(16, 24, n_experts=6)
    experts.reset_parameters(0.3, 0.3)
    experts.impl = impl
    x = torch.randn(37, 16, requires_grad=True)
    idx = torch.stack([torch.randperm(6)[:3] for _ in range(37)])
    idx[:10] = torch.tensor([0, 1, 2])  # crowd some experts: groups of very different sizes
    gates = torch.rand(37, 3)
    out, counts = experts(x, idx, gates)
    ref = _naive_experts(x, idx, gates, experts.w1, experts.w3, experts.w2)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(counts, torch.bincount(idx.flatten(), minlength=6))
    # gradients flow to the inputs and to every expert that received tokens, like the reference
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (x, experts.w1, experts.w2), g)
    ref_grads = torch.autograd.grad(ref, (x, experts.w1, experts.w2), g)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_moe_dispatch_handles_empty_experts_and_bf16_grouped_gemm():
    torch.manual_seed(1)
    experts = GroupedExperts(16, 32, n_experts=8)
    experts.reset_parameters(0.2, 0.2)
    x = torch.randn(20, 16)
    idx = torch.randint(0, 3, (20, 1))  # experts 3..7 get nothing
    gates = torch.rand(20, 1)
    out, counts = experts(x, idx, gates)
    assert counts[3:].sum() == 0
    torch.testing.assert_close(
        out, _naive_experts(x, idx, gates, experts.w1, experts.w3, experts.w2), rtol=1e-5, atol=1e-5
    )
    if torch.bfloat16 in experts._gmm_dtypes:  # the CUDA training path (grouped GEMM under bf16 autocast)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low, _ = experts(x, idx, gates)
        assert low.dtype == torch.bfloat16
        torch.testing.assert_close(low.float(), out, rtol=0.05, atol=0.05)


def test_model_output_same_with_loop_and_grouped_gemm():
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm not available")
    model = _model()
    ids = _ids()
    outputs = []
    for impl in ("loop", "grouped_mm"):
        for moe in model.moe_layers():
            moe.experts.impl = impl
        outputs.append(model(ids))
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-5, atol=1e-5)


def test_group_limited_routing_restricts_choices():
    torch.manual_seed(0)
    args = _args(n_expert_groups=4, n_limited_groups=1, n_activated_experts=2)
    moe = ds.MoE(args)
    moe.reset_parameters(0.5, 0.1)
    _, idx, _ = moe.route(torch.randn(50, 64))
    groups = idx // 2  # 8 experts in 4 groups of 2
    assert torch.equal(groups[:, 0], groups[:, 1])  # both experts come from the one allowed group


def test_bias_update_balances_a_skewed_router():
    model = _model(n_layers=2, bias_update_rate=0.02, seq_aux_loss_coef=0.0).train()  # one MoE layer
    # Every token carries a small shared component c and each router's row 0 points along it, so expert 0 wins
    # for every token (load fraction 1/2 with top-2, against 1/8 when balanced); the other rows are spread out
    # so that the second choice still varies from token to token.
    g = torch.Generator().manual_seed(0)
    c = torch.randn(64, generator=g)
    with torch.no_grad():
        model.tok_embeddings.weight += 0.02 * c
        for moe in model.moe_layers():
            moe.gate.weight.normal_(0, 0.2, generator=g)
            moe.gate.weight[0] = 2.0 * c / c.norm()
    ids = _ids(b=4, t=32, seed=5)

    def loads() -> torch.Tensor:
        model.moe_step_load.zero_()
        model(ids)
        return model.moe_step_load.clone()

    def cv(load: torch.Tensor) -> float:
        frac = load / load.sum(-1, keepdim=True)
        return (frac.std(-1, correction=0) / frac.mean(-1)).mean().item()

    before = loads()
    assert (before[:, 0] / before.sum(-1)).min() > 0.45  # skewed: expert 0 takes (nearly) every token
    for _ in range(20):
        model(ids)
        model.after_optimizer_step()
        assert model.moe_step_load.abs().sum() == 0  # consumed and cleared by the update
    after = loads()
    assert cv(after) < 0.3 * cv(before)
    assert (after[:, 0] / after.sum(-1)).max() < 0.25
    assert after.min() > 0  # no starved expert left
    for moe in model.moe_layers():
        assert moe.expert_bias[0] < moe.expert_bias[1:].min()  # the overloaded expert's bias went down
        assert moe.gate.weight.grad is None  # the bias moves outside autograd


def test_bias_steers_selection_but_not_gates():
    torch.manual_seed(0)
    moe = ds.MoE(_args())
    moe.reset_parameters(0.02, 0.01)
    x = torch.randn(30, 64)
    gates0, idx0, scores = moe.route(x)
    with torch.no_grad():
        moe.expert_bias[5] = 10.0  # expert 5 is now always chosen...
    gates, idx, scores2 = moe.route(x)
    assert (idx == 5).any(dim=1).all()
    torch.testing.assert_close(scores2, scores)
    # ...with a gate computed from the unbiased scores (normalised over the chosen experts, times route_scale)
    chosen = scores.gather(1, idx)
    torch.testing.assert_close(gates, 2.5 * chosen / chosen.sum(-1, keepdim=True))


def test_packed_rows_with_doc_ids_match_separate_documents():
    model = _model(mtp_depth=1)
    a, b = _ids(b=1, t=7, seed=11), _ids(b=1, t=9, seed=12)
    packed = torch.cat([a, b], dim=1)
    doc_ids = torch.tensor([[0] * 7 + [1] * 9])
    pos = torch.cat([torch.arange(7), torch.arange(9)])[None]
    out = model(packed, position_ids=pos, doc_ids=doc_ids)
    torch.testing.assert_close(out[:, :7], model(a), rtol=0, atol=1e-5)
    torch.testing.assert_close(out[:, 7:], model(b), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="doc_ids"):
        model(packed[:, :4], cache=model.new_cache(1, 16), doc_ids=doc_ids[:, :4])
    # MTP never predicts across a boundary: position 5 (doc 0) would predict token 7, the first token of doc 1,
    # through targets[6]; that target must not enter the MTP loss (the main loss is not part of extra_loss)
    model.train()
    targets = torch.roll(packed, -1, dims=1)

    def mtp_loss(y: torch.Tensor) -> torch.Tensor:
        model(packed, position_ids=pos, doc_ids=doc_ids, return_hidden=True)
        return model.extra_loss(y, _plain_ce)

    with torch.no_grad():
        ref = mtp_loss(targets)
        changed = targets.clone()
        changed[0, 6] = (changed[0, 6] + 5) % 512
        torch.testing.assert_close(mtp_loss(changed), ref, rtol=0, atol=1e-6)
        changed = targets.clone()
        changed[0, 5] = (changed[0, 5] + 5) % 512  # token 6, predicted from position 4 of the same document
        assert (mtp_loss(changed) - ref).abs() > 1e-4


# ------------------------------------------------------------------------------------- extra loss, metrics


def test_extra_loss_is_finite_has_grads_and_is_summed_over_tokens():
    model = _model(mtp_depth=1, seq_aux_loss_coef=0.01).train()
    ids = _ids(b=2, t=16, seed=2)
    targets = torch.roll(ids, -1, dims=1)

    def extra(x, y):
        model(x, return_hidden=True)
        return model.extra_loss(y, _plain_ce)

    loss = extra(ids, targets)
    assert loss is not None and loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    for name in (
        "mtp.eh_proj.weight",
        "mtp.block.feed_forward.gate.weight",
        "layers.1.feed_forward.gate.weight",
        "layers.0.attention.wkv_a.weight",
        "tok_embeddings.weight",
    ):
        p = dict(model.named_parameters())[name]
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert model.extra_loss(targets, _plain_ce) is None  # consumed

    with torch.no_grad():
        single = extra(ids, targets)
        double = extra(torch.cat([ids, ids]), torch.cat([targets, targets]))  # same rows twice: twice the sum
        torch.testing.assert_close(double, 2 * single, rtol=1e-5, atol=1e-6)
        # MTP at position t predicts targets[t + 1]: targets[:, 0] is never used, the last target is
        masked = targets.clone()
        masked[:, 0] = (masked[:, 0] + 7) % 512
        torch.testing.assert_close(extra(ids, masked), single, rtol=0, atol=1e-6)
        masked = targets.clone()
        masked[:, -1] = (masked[:, -1] + 7) % 512
        assert (extra(ids, masked) - single).abs() > 1e-6
        ignored = targets.clone()
        ignored[:, :5] = -100  # SFT-style masking: still finite, and fewer tokens means a smaller sum
        assert 0 < extra(ids, ignored) < single

        # the pieces: balance loss alone is coef * loss * n_tokens with the loss ~1 for near-uniform routing
        bal = _model(seq_aux_loss_coef=0.01).train()
        bal(ids, return_hidden=True)
        aux = bal._seq_aux
        assert 2 * 0.5 < aux < 2 * 3  # two MoE layers, each sum_i f_i P_i >= ~1
        torch.testing.assert_close(bal.extra_loss(targets, _plain_ce), 0.01 * aux * targets.numel())

    model.eval()
    model(ids, return_hidden=True)
    assert model.extra_loss(targets, _plain_ce) is None  # validation loss stays the plain LM loss
    assert _model(seq_aux_loss_coef=0.0).train().extra_loss(targets, _plain_ce) is None


def test_log_metrics_load_fractions_accumulate_and_reset():
    model = _model().train()
    assert model.log_metrics() == {}
    ids = _ids(b=2, t=16)
    model(ids)
    model(ids)
    assert model.moe_log_load.device == model.output_weight.device  # accumulated on the device
    assert model.moe_log_load.sum() == 2 * 2 * (2 * 16 * 2)  # 2 forwards, 2 MoE layers, B*T*K slots each
    model.eval()
    model(ids)  # eval forwards do not count
    assert model.moe_log_load.sum() == 2 * 2 * (2 * 16 * 2)
    metrics = model.log_metrics()
    fracs = [v for k, v in metrics.items() if k.startswith("moe/l1_e")]
    assert len(fracs) == 8 and math.isclose(sum(fracs), 1.0, rel_tol=1e-6)
    assert metrics["moe/load_min"] <= 1 / 8 <= metrics["moe/load_max"]
    assert metrics["moe/load_cv"] >= 0 and metrics["moe/maxvio"] >= 0
    assert set(metrics) >= {"moe/load_max", "moe/load_min", "moe/load_cv", "moe/maxvio", "moe/bias_absmax"}
    assert model.log_metrics() == {}  # reset when read
    assert model.moe_step_load.sum() > 0  # the bias-update accumulator is separate


def test_a_few_training_steps_reduce_the_loss():
    model = _model(n_layers=2, mtp_depth=1).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = _ids(b=2, t=32, seed=9)
    x, y = ids[:, :-1], ids[:, 1:]
    losses = []
    for _ in range(6):
        hidden = model(x, return_hidden=True)
        loss = _plain_ce(hidden, model.output_weight, y) + model.extra_loss(y, _plain_ce)
        loss = loss / y.numel()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            model.after_optimizer_step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5
    assert any(m.expert_bias.abs().sum() > 0 for m in model.moe_layers())


def test_block_compiles_without_graph_breaks():
    torch._dynamo.reset()
    model = _model().train().to(torch.bfloat16)
    if torch.bfloat16 not in model.moe_layers()[0].experts._gmm_compiled_dtypes:
        pytest.skip("no compilable grouped GEMM for bf16 on this torch/device")
    x = torch.randn(2, 8, 64, dtype=torch.bfloat16)
    cos, sin = model.rope(8)
    explanation = torch._dynamo.explain(model.layers[1])(x, cos, sin)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    torch._dynamo.reset()


# ----------------------------------------------------------------------------------------- transformers

transformers = pytest.importorskip("transformers")


def _hf_model(
    q_lora_rank: int | None, groups: tuple[int, int], rope: dict | None = None, interleave: bool = True
):
    cfg = transformers.DeepseekV3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=8,
        kv_lora_rank=32,
        q_lora_rank=q_lora_rank,
        qk_rope_head_dim=8,
        v_head_dim=12,
        qk_nope_head_dim=16,
        n_group=groups[0],
        topk_group=groups[1],
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        max_position_embeddings=256,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        rope_interleave=interleave,
        tie_word_embeddings=False,
        rope_parameters=rope or {"rope_type": "default", "rope_theta": 10000.0},
    )
    cfg._attn_implementation = "eager"  # an independent reference: plain matmul + softmax
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(cfg).eval()
    # HF inits norms to 1 and the correction bias to 0, which would hide a mis-mapped norm or bias: perturb all.
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.2 * noise if "norm" in name else 0.1 * noise)
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    return hf


YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "original_max_position_embeddings": 32,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


@pytest.mark.parametrize(
    "q_lora_rank, groups, rope, interleave",
    [
        (None, (1, 1), None, True),  # V2-Lite style: plain q projection
        (48, (4, 2), None, True),  # V3 style: q-LoRA and group-limited routing
        (None, (1, 1), None, False),  # non-interleaved rope checkpoints
        (48, (1, 1), YARN, True),  # yarn tables and the mscale_all_dim softmax scale
    ],
)
def test_parity_with_transformers(q_lora_rank, groups, rope, interleave):
    hf = _hf_model(q_lora_rank, groups, rope, interleave)
    args = ds.args_from_hf(hf.config.to_dict())
    assert (args.q_lora_rank, args.n_expert_groups, args.n_limited_groups) == (q_lora_rank, *groups)
    ours = DeepSeek(args)
    ours.init_weights()
    ours.load_state_dict(
        ds.from_hf(hf.state_dict(), args), strict=True
    )  # transformers 5 fused-experts layout
    ours.eval()
    ids = _ids(b=2, t=24, vocab=256)
    pos = torch.arange(24).expand(2, 24) + 90  # beyond yarn's original_max_position_embeddings
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        assert (ours(ids) - ref).abs().max().item() <= 1e-4
        assert (ours(ids, position_ids=pos) - hf(input_ids=ids, position_ids=pos).logits).abs().max() <= 1e-4
    if interleave:  # the rope permutation matters: skipping it breaks parity
        plain = DeepSeek(args)
        plain.init_weights()
        plain.load_state_dict(
            ds.from_hf(hf.state_dict(), ds.DeepSeekArgs(**{**vars(args), "hf_rope_interleave": False}))
        )
        with torch.no_grad():
            assert (plain.eval()(ids) - ref).abs().max() > 1e-3


def test_export_reloads_in_transformers_with_identical_logits(tmp_path):
    from safetensors.torch import save_file

    args = _args(q_lora_rank=24, n_expert_groups=2, n_limited_groups=1)
    torch.manual_seed(0)
    model = DeepSeek(args)
    model.init_weights()
    with torch.no_grad():
        for moe in model.moe_layers():
            moe.expert_bias.normal_(0, 0.05)  # as after some training
    model.eval()
    hf_sd = ds.to_hf(model.state_dict(), args)
    assert "model.layers.2.mlp.experts.7.down_proj.weight" in hf_sd  # the on-disk (per-expert) layout
    save_file(hf_sd, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(ds.hf_config(args)))
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager").eval()
    ids = _ids(b=2, t=30)
    with torch.no_grad():
        assert (hf(input_ids=ids).logits - model(ids)).abs().max().item() <= 1e-5
    # and back: config and weights round-trip exactly
    assert ds.args_from_hf(json.loads((tmp_path / "config.json").read_text())) == args
    back = ds.from_hf(hf_sd, args)
    assert back.keys() == model.state_dict().keys()
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())


def test_mtp_weights_use_deepseek_layer_names():
    args = _args(mtp_depth=1)
    model = _model(mtp_depth=1)
    hf_sd = ds.to_hf(model.state_dict(), args)
    for name in (
        "enorm.weight",
        "hnorm.weight",
        "eh_proj.weight",
        "shared_head.norm.weight",
        "self_attn.kv_b_proj.weight",
        "mlp.gate.e_score_correction_bias",
        "mlp.experts.0.up_proj.weight",
    ):
        assert f"model.layers.3.{name}" in hf_sd, name
    assert ds.hf_config(args)["num_nextn_predict_layers"] == 1
    back = ds.from_hf(hf_sd, args)
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())
    # importing into a model without MTP drops those weights instead of failing
    plain = ds.from_hf(hf_sd, _args())
    assert not any(k.startswith("mtp.") for k in plain) and "layers.2.attention.wo.weight" in plain
    with pytest.raises(ConfigError, match="softmax"):
        ds.hf_config(_args(score_func="softmax"))


def test_import_of_a_save_pretrained_folder(tmp_path):
    from safetensors.torch import load_file

    hf = _hf_model(48, (1, 1))
    hf.save_pretrained(str(tmp_path))  # on disk: per-expert tensors, config.json with transformers' defaults
    config = json.loads((tmp_path / "config.json").read_text())
    on_disk = load_file(str(tmp_path / "model.safetensors"))
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in on_disk
    args = ds.args_from_hf(config)
    model = build_model("deepseek", args, device="cpu")
    missing, unexpected = model.load_state_dict(ds.from_hf(on_disk, args), strict=False)
    assert not missing and not unexpected
    ids = _ids(b=2, t=20, vocab=256)
    with torch.no_grad():
        assert (model.eval()(ids) - hf(input_ids=ids).logits).abs().max() <= 1e-4
    with pytest.raises(UserError, match="lacks tensor"):
        ds.from_hf({k: v for k, v in on_disk.items() if "experts.3." not in k}, args)
    with pytest.raises(UserError, match="unexpected"):
        ds.from_hf({**on_disk, "model.layers.0.mlp.extra.weight": torch.zeros(1)}, args)


@pytest.mark.parametrize(
    "change",
    [
        {"attention_bias": True},
        {"hidden_act": "gelu"},
        {"rope_parameters": {"rope_type": "dynamic"}},
        {"num_key_value_heads": 2},
        {"model_type": "deepseek_v2"},
    ],
)
def test_configs_the_native_code_cannot_reproduce_are_refused(change):
    from gptoughts.models.hf import UnsupportedHFConfig

    config = {**ds.hf_config(_args()), **change}
    with pytest.raises(UnsupportedHFConfig):
        ds.args_from_hf(config)


def test_hf_config_keeps_the_base_config_keys():
    base = {
        "model_type": "deepseek_v3",
        "bos_token_id": 5,
        "eos_token_id": 6,
        "quantization_config": {"x": 1},
        "hidden_size": 7168,
    }
    cfg = ds.hf_config(_args(), base)
    assert cfg["bos_token_id"] == 5 and cfg["eos_token_id"] == 6
    assert cfg["hidden_size"] == 64 and "quantization_config" not in cfg  # ours win; stale keys dropped
