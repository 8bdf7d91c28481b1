"""The MoE speed switches (``DeepSeekArgs.moe_*``) compute what the reference path computes.

Reference: ``moe_combine = bmm``, ``moe_permute = index_put``, ``moe_router = mask``, ``moe_shared = after``.
Each switch is compared with it on the same weights and inputs: outputs, counts, and the gradients of the
tokens, the gates and every expert weight; the router switch bit for bit. The dropless grouped-GEMM path is
traced whole (``fullgraph``) to prove it never synchronises with the host.
"""

from __future__ import annotations

import copy

import pytest
import torch

from gptoughts import cli
from gptoughts.errors import ConfigError
from gptoughts.models.deepseek import DeepSeek, DeepSeekArgs, GroupedExperts, MoE, moe

VARIANTS = [("sum", "index_put"), ("hidden", "index_put"), ("sum", "gather"), ("hidden", "gather")]
HAS_GMM = hasattr(torch, "_grouped_mm")


def _inputs(n: int = 41, d: int = 16, e: int = 6, k: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
    idx[:12] = torch.arange(k)  # crowd the first experts: groups of very different sizes
    gates = torch.rand(n, k, generator=g)
    return x, idx, gates


def _experts(
    combine: str, permute: str, impl: str, d: int = 16, e: int = 6, w13: str = "separate"
) -> GroupedExperts:
    torch.manual_seed(0)
    ex = GroupedExperts(d, 24, n_experts=e, combine=combine, permute=permute, w13=w13)
    ex.reset_parameters(0.3, 0.3)
    ex.impl = impl
    return ex


def _run_and_grads(ex: GroupedExperts, x, idx, gates, autocast: bool = False):
    x = x.clone().requires_grad_()
    gates = gates.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out, counts = ex(x, idx, gates)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    grads = torch.autograd.grad(out.float(), (x, gates, ex.w1, ex.w3, ex.w2), g)
    return out, counts, grads


@pytest.mark.parametrize("impl", ["loop", "grouped_mm"])
@pytest.mark.parametrize(("combine", "permute"), VARIANTS)
def test_expert_switches_match_the_reference_in_fp32(combine, permute, impl):
    if impl == "grouped_mm" and not HAS_GMM:
        pytest.skip("torch._grouped_mm not available")
    x, idx, gates = _inputs()
    ref = _run_and_grads(_experts("bmm", "index_put", impl), x, idx, gates)
    got = _run_and_grads(_experts(combine, permute, impl), x, idx, gates)
    assert torch.equal(got[1], ref[1])  # tokens per expert
    assert got[1][-1] > 0 and (got[1] > 0).all()
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-6)
    for name, a, b in zip(("x", "gates", "w1", "w3", "w2"), got[2], ref[2]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"grad {n}: {m}")


@pytest.mark.parametrize(("combine", "permute"), VARIANTS)
def test_expert_switches_match_the_reference_under_bf16_grouped_gemm(combine, permute):
    ref_ex = _experts("bmm", "index_put", "auto")
    if torch.bfloat16 not in ref_ex._gmm_dtypes:
        pytest.skip("no bf16 grouped GEMM on this CPU/torch")
    x, idx, gates = _inputs(seed=1)
    fp32 = _run_and_grads(_experts("bmm", "index_put", "loop"), x, idx, gates)
    ref = _run_and_grads(ref_ex, x, idx, gates, autocast=True)
    got = _run_and_grads(_experts(combine, permute, "auto"), x, idx, gates, autocast=True)
    assert got[0].dtype == ref[0].dtype == torch.bfloat16
    assert torch.equal(got[1], ref[1])
    # Both bf16 paths are within bf16 rounding of the fp32 result, and the switch no farther than the reference.
    for a, b, exact in zip((got[0], *got[2]), (ref[0], *ref[2]), (fp32[0], *fp32[2])):
        err_ref = (b.float() - exact).abs().max()
        err_got = (a.float() - exact).abs().max()
        assert err_got <= 2 * err_ref + 1e-3 * exact.abs().max(), (err_got, err_ref)


@pytest.mark.skipif(not HAS_GMM, reason="torch._grouped_mm not available")
@pytest.mark.parametrize(("combine", "permute"), [("bmm", "index_put"), ("hidden", "gather")])
def test_fused_w13_matches_two_gemms(combine, permute):
    """``moe_w13 = fused``: one grouped GEMM over [w1; w3] gives the two GEMMs' outputs and gradients, and it
    is one GEMM fewer forward (two fewer with the backward's)."""
    x, idx, gates = _inputs(seed=2)
    ex = {w: _experts(combine, permute, "grouped_mm", w13=w) for w in ("separate", "fused")}
    ref, got = (_run_and_grads(ex[w], x, idx, gates) for w in ("separate", "fused"))
    assert torch.equal(got[1], ref[1])
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-6)
    for name, a, b in zip(("x", "gates", "w1", "w3", "w2"), got[2], ref[2]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"grad {n}: {m}")
    from torch.fx.experimental.proxy_tensor import make_fx

    def gemms(m: GroupedExperts) -> int:
        gm = make_fx(lambda x: m(x, idx, gates)[0])(x)
        return sum(1 for n in gm.graph.nodes if "_grouped_mm" in str(n.target))

    counts = {w: gemms(m) for w, m in ex.items()}
    assert counts == {"separate": 3, "fused": 2}


def test_gather_permutation_saves_no_token_copies():
    """The gather path's graph keeps only indices and the expert outputs, never the [N*K, d] token copies."""
    x, idx, gates = _inputs(n=64, d=16, k=3)
    sizes = {}
    for combine, permute in (("bmm", "index_put"), ("hidden", "gather")):
        ex = _experts(combine, permute, "loop")
        saved: list[torch.Tensor] = []

        def pack(t: torch.Tensor, saved: list[torch.Tensor] = saved) -> torch.Tensor:
            saved.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            ex(x.clone().requires_grad_(), idx, gates.clone().requires_grad_())
        sizes[permute] = sum(t.is_floating_point() and t.numel() == 64 * 3 * 16 for t in saved)
    assert sizes["index_put"] > 0  # the reference saves the gathered [N, K, d] outputs for its bmm
    assert sizes["gather"] == 0


def _aten_ops(fn, *inputs) -> dict[str, set[int]]:
    """The aten ops ``fn`` runs (forward and, when it calls autograd, backward), traced by ``make_fx``: op name
    -> the ranks of its outputs."""
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(lambda *a: fn(*a))(*inputs)
    ops: dict[str, set[int]] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and str(n.target).startswith("aten."):
            val = n.meta.get("val")
            ops.setdefault(str(n.target).split(".")[1], set()).add(val.dim() if hasattr(val, "dim") else -1)
    return ops


@pytest.mark.parametrize(("combine", "permute"), [("bmm", "index_put"), *VARIANTS])
def test_switches_change_the_ops_forward_and_backward(combine, permute):
    ex = _experts(combine, permute, "loop")
    x, idx, gates = _inputs()

    def step(x, gates):
        out, _ = ex(x, idx, gates)
        return torch.autograd.grad(out.sum(), (x, gates, ex.w1))

    ops = _aten_ops(step, x.requires_grad_(), gates.requires_grad_())
    assert ("bmm" in ops) == (combine == "bmm")  # the batched GEMV and its backward GEMVs
    # index_put on [rows, d]: the scatter of the token copies and the accumulating backward of yp[dest]. The
    # gather path only lays [rows] index and gate vectors out with it.
    assert (2 in ops.get("index_put", set())) == (permute == "index_put")


def _moe_args(**kw) -> DeepSeekArgs:
    base = dict(d_model=32, n_layers=2, n_heads=2, vocab_size=64, max_seq_len=32, kv_lora_rank=16,
                qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=16, n_shared_experts=1,
                n_activated_experts=4, moe_inter_dim=16, dense_inter_dim=32, n_dense_layers=1)  # fmt: skip
    return DeepSeekArgs(**{**base, **kw})


@pytest.mark.parametrize("score_func", ["sigmoid", "softmax"])
def test_gathered_group_limited_routing_is_bit_identical(score_func):
    args = _moe_args(n_expert_groups=4, n_limited_groups=2, score_func=score_func)
    ref = MoE(args)
    ref.reset_parameters(0.5, 0.1)
    with torch.no_grad():
        ref.expert_bias.normal_(0, 0.1)
        ref.gate.weight[8:12] = ref.gate.weight[4:8]  # groups 1 and 2 tie exactly: ties broken the same way
    fast = copy.deepcopy(ref)
    fast.router = "gather"
    x = torch.randn(300, 32)
    for a, b in zip(fast.route(x), ref.route(x)):
        assert torch.equal(a, b)
    ops = {mode: _aten_ops(m.route, x) for mode, m in (("mask", ref), ("gather", fast))}
    assert "masked_fill" in ops["mask"] and "masked_fill" not in ops["gather"]  # no masked [N, E] copy
    groups_used = ((ref.route(x)[1] // 4).unsqueeze(-1) == torch.arange(4)).any(1).sum(-1)
    assert (groups_used <= 2).all() and (groups_used == 2).any()  # the restriction is active


@pytest.mark.parametrize("mode", ["before", "stream"])
def test_shared_experts_first_give_the_same_output_and_gradients(mode):
    args = _moe_args()
    ref = MoE(args)
    ref.reset_parameters(0.2, 0.1)
    fast = copy.deepcopy(ref)
    fast.shared_mode = mode  # stream on a CPU tensor: computed first, in order
    x = torch.randn(2, 9, 32)
    outs = []
    for m in (ref, fast):
        xi = x.clone().requires_grad_()
        out, counts, _ = m(xi)
        gx, gs = torch.autograd.grad(out.square().sum(), (xi, m.shared_experts.w1.weight))
        outs.append((out, counts, gx, gs))
    (out, counts, gx, gs), (ref_out, ref_counts, ref_gx, ref_gs) = outs
    assert torch.equal(out, ref_out) and torch.equal(counts, ref_counts)
    # x's gradient sums the shared and routed contributions in the other order: equal up to rounding
    torch.testing.assert_close(gx, ref_gx, rtol=1e-5, atol=1e-6)
    assert torch.equal(gs, ref_gs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_shared_experts_on_a_side_stream_match_on_cuda():
    args = _moe_args(moe_shared="stream")
    fast = MoE(args).cuda()
    fast.reset_parameters(0.2, 0.1)
    ref = copy.deepcopy(fast)
    ref.shared_mode = "after"
    x = torch.randn(4, 64, 32, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        a, b = fast(x)[0], ref(x)[0]
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert fast._side_stream is not None


def test_model_with_every_switch_on_trains_like_the_reference():
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    on = dict(moe_combine="hidden", moe_permute="gather", moe_router="gather", moe_shared="before")
    reference = dict(moe_combine="bmm", moe_permute="index_put", moe_router="mask", moe_shared="after")
    losses, grads = [], []
    for kw in (reference, on):
        torch.manual_seed(0)
        model = DeepSeek(_moe_args(n_expert_groups=4, n_limited_groups=2, **kw))
        model.init_weights()
        for m in model.moe_layers():
            m.experts.impl = "loop"  # fp32 on CPU: the per-expert GEMMs
        logits = model(ids)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=1e-6)
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-4, atol=1e-6, msg=name)


def _traced_graphs(fn, *inputs) -> list[set[str]]:
    """The aten ops of ``fn``'s forward and backward graphs (in that order) traced by
    ``torch.compile(fullgraph=True)``: a ``.item()``, ``.tolist()`` or data-dependent shape (``nonzero``) would
    break the graph, hence raise; an op that syncs without breaking it shows in the sets."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs: list[set[str]] = []

    def record(gm, _inputs):
        graphs.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    out = torch.compile(fn, fullgraph=True, backend=aot_autograd(fw_compiler=record, bw_compiler=record))(
        *inputs
    )
    sum(o.float().sum() for o in out if o.is_floating_point()).backward()
    return graphs


SYNC_OPS = (
    "aten._local_scalar_dense",
    "aten.nonzero",
    "aten.item",
    "aten.bincount",
    "aten.unique",
    "aten.masked_select",
)


@pytest.mark.parametrize("switches", [dict(moe_combine="bmm", moe_permute="index_put"), dict(moe_combine="hidden", moe_permute="gather", moe_router="gather",
                                                moe_shared="before"), dict(moe_combine="sum", moe_permute="gather")])  # fmt: skip
def test_dropless_grouped_gemm_path_never_syncs_with_the_host(switches):
    if not HAS_GMM or torch.bfloat16 not in GroupedExperts(16, 32, n_experts=8)._gmm_compiled_dtypes:
        pytest.skip("no compilable bf16 grouped GEMM on this CPU/torch")
    layer = MoE(_moe_args(n_expert_groups=4, n_limited_groups=2, **switches)).to(torch.bfloat16)
    layer.reset_parameters(0.2, 0.1)
    layer.experts.impl = "grouped_mm"
    x = torch.randn(2, 24, 32, dtype=torch.bfloat16, requires_grad=True)
    graphs = _traced_graphs(lambda t: layer(t)[:2], x)
    assert len(graphs) == 2  # one forward graph, one backward graph: nothing broke them
    for ops in graphs:  # the path under test was traced, forward and backward
        assert "aten._grouped_mm.default" in ops
        assert not [o for o in ops if o.split(".")[:2] in [s.split(".") for s in SYNC_OPS]], sorted(ops)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("w13", ["separate", "fused"])
@pytest.mark.parametrize(("combine", "permute"), [("bmm", "index_put"), *VARIANTS])
def test_dropless_path_never_syncs_on_cuda(combine, permute, w13):
    args = _moe_args(
        moe_combine=combine, moe_permute=permute, moe_w13=w13, n_expert_groups=4, n_limited_groups=2
    )
    layer = MoE(args).cuda()
    layer.reset_parameters(0.2, 0.1)
    if torch.bfloat16 not in layer.experts._gmm_dtypes:
        pytest.skip("no bf16 grouped GEMM on this GPU")
    x = torch.randn(2, 64, 32, device="cuda", requires_grad=True)
    layer(x)  # first call: lazy CUDA initialisations may sync
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out, counts, _ = layer(x)
        out.float().square().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert int(counts.sum()) == 2 * 64 * 4


def test_switch_values_are_checked():
    with pytest.raises(ConfigError, match="moe_combine"):
        _moe_args(moe_combine="gemv")
    with pytest.raises(ConfigError, match="moe_combine = sum or hidden"):
        _moe_args(moe_permute="gather", moe_combine="bmm")
    with pytest.raises(ConfigError, match="moe_shared"):
        _moe_args(moe_shared="overlap")
    assert moe.MoE(_moe_args(moe_permute="gather", moe_combine="sum")).experts.permute == "gather"


def test_cli_refuses_an_unknown_switch_in_one_line(tmp_path, capsys):
    out = tmp_path / "run"
    code = cli.main(["train", "--model.family", "deepseek", "--size", "debug", "--model.moe_router", "fused",
                     "--data", str(tmp_path), "--tokenizer", "bytes", "--max_steps", "1", "--device", "cpu",
                     "--threads", "1", "--out", str(out)])  # fmt: skip
    err = capsys.readouterr().err
    assert code != 0
    assert "model.moe_router must be one of mask, gather" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert not out.exists()


@pytest.mark.parametrize("combine,permute", [("hidden", "gather"), ("sum", "gather"), ("bmm", "index_put")])
def test_a_rank_that_receives_no_rows_gets_empty_outputs_and_gradients(combine, permute):
    # Under expert parallelism a rank may receive no token for its experts: the layer must still run forward
    # and backward (the gather path's padding rows would read token 0 of an empty input).
    experts = GroupedExperts(8, 16, n_experts=4, combine=combine, permute=permute)
    experts.reset_parameters(0.2, 0.1)
    experts.impl = "loop"
    x = torch.zeros(0, 8, requires_grad=True)
    out, counts = experts(x, torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2))
    assert out.shape == (0, 8) and counts.tolist() == [0, 0, 0, 0]
    out.sum().backward()
    assert x.grad.shape == (0, 8) and experts.w1.grad is not None
