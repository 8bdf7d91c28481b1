"""The fused INL integrator (``model.integrator_impl = "fused"``, models/inl_fused.py) against the reference module:
the same outputs and gradients (fp32 and bf16 autocast), fewer saved bytes, and it composes with torch.compile
(fullgraph) and activation checkpointing."""

from __future__ import annotations

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks

from gptoughts import models
from gptoughts.errors import ConfigError
from gptoughts.models.inl import Integrator
from gptoughts.models.inl_fused import update, update_backward
from gptoughts.perf.checkpointing import apply_activation_checkpointing


def _integrators(k: int, d: int = 32, hidden: int = 8, impl: str = "fused") -> tuple[Integrator, Integrator]:
    """(reference, ``impl``) with the same weights: initialised, then every parameter perturbed (the controller's
    output layer starts at zero) so that the whole input-dependent dynamics is exercised, without blowing up."""
    torch.manual_seed(
        0
    )  # reset_parameters draws from the global generator: the same weights in any test order
    ref = Integrator(d, k, dt=0.1, hidden=hidden, impl="reference")
    ref.reset_parameters(0.02)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    other = Integrator(d, k, dt=0.1, hidden=hidden, impl=impl)
    other.load_state_dict(ref.state_dict())
    assert ref.w_out.abs().min() > 0
    return ref, other


def _run(module: torch.nn.Module, h: torch.Tensor, bf16: bool) -> list[torch.Tensor]:
    """[output, dL/dh, dL/dparam...] for a loss weighting every output element differently."""
    h = h.detach().clone().requires_grad_()
    module.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        y = module(h)
    weights = torch.linspace(-1, 1, y.numel()).view_as(y)
    (y * weights).sum().backward()
    return [y.detach(), h.grad, *(p.grad for p in module.parameters())]


NAMES = ["output", "h", "w_in", "b_in", "w_out", "b_out", "mu", "kappa_raw"]


@pytest.mark.parametrize("k", [1, 2, 4])
def test_fp32_outputs_and_gradients_equal_the_reference(k):
    ref, fused = _integrators(k)
    h = torch.randn(3, 7, 32, generator=torch.Generator().manual_seed(1))
    for name, a, b in zip(NAMES, _run(ref, h, False), _run(fused, h, False), strict=True):
        assert b.dtype == a.dtype, name
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5 * a.abs().max().item(), msg=name)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_bf16_autocast_is_as_close_to_fp32_as_the_reference(k):
    # Under autocast both run the controller's matmuls in bf16 and the state in fp32; the reference also rounds
    # sigmoid/softplus of bf16 logits to bf16, the fused update computes them in fp32. So neither equals the
    # other bit for bit: each is compared with the fp32 function, and the fused one must be as close as the
    # reference (within 1.5x, plus a floor of bf16's resolution), and close to it.
    ref, fused = _integrators(k)
    h = torch.randn(4, 32, 32, generator=torch.Generator().manual_seed(1))
    truth = _run(ref, h, False)
    for name, t, a, b in zip(NAMES, truth, _run(ref, h, True), _run(fused, h, True), strict=True):
        assert b.dtype == a.dtype, name
        scale = t.abs().max().item()
        err_ref, err_fused = ((x - t).abs().max().item() / scale for x in (a, b))
        assert err_fused <= 1.5 * err_ref + 2e-3, (name, err_fused, err_ref)
        assert (a - b).abs().max().item() / scale < 2e-2, name


@pytest.mark.parametrize("first", [True, False])
def test_elementwise_backward_is_autograds(first):
    # The hand-written backward of one update (v_0 = 0 is passed as None), in fp64 against autograd.
    g = torch.Generator().manual_seed(2)
    n, d = 6, 5

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    u, x, mu, kappa = rand(n, 4 * d), rand(n, d), rand(d), rand(d).abs()
    v = None if first else rand(n, d)
    gx, gv = rand(n, d), rand(n, d)
    leaves = [t.clone().requires_grad_() for t in (u, x, mu, kappa)] + (
        [] if first else [v.clone().requires_grad_()]
    )
    v_in = None if first else leaves[4]
    x_next, v_next = update(leaves[0], leaves[1], v_in, leaves[2], leaves[3], 0.1)
    expected = torch.autograd.grad((x_next * gx).sum() + (v_next * gv).sum(), leaves)
    du, dx, dv, dmu, dkappa = update_backward(u, x, v, mu, kappa, 0.1, gx, gv)
    got = [du, dx, dmu, dkappa] + ([] if first else [dv])
    assert (dv is None) == first
    for name, a, b in zip(["u", "x", "mu", "kappa", "v"], expected, got, strict=False):
        torch.testing.assert_close(b.double(), a, rtol=1e-10, atol=1e-12, msg=name)


def _saved_bytes(module: torch.nn.Module, h: torch.Tensor, bf16: bool, backend: str | None = None) -> int:
    """Bytes autograd keeps for backward: each saved storage counted once (parameters excluded). With ``backend``,
    those of the module compiled by it (a first call compiles it, outside the count)."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            storages[s.data_ptr()] = s.nbytes()
        return t

    run = module if backend is None else torch.compile(module, backend=backend, fullgraph=True)
    with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
        if backend is not None:
            run(h.requires_grad_())
        with saved_tensors_hooks(pack, lambda t: t):
            run(h.requires_grad_())
    return sum(storages.values())


@pytest.mark.parametrize(
    ("bf16", "backend"),
    [(False, None), (True, None), pytest.param(True, "aot_eager_decomp_partition", marks=pytest.mark.slow)],
)
def test_fused_saves_only_the_state_and_the_controller_input(bf16, backend):
    # The compiled case uses inductor's partitioner (min-cut rematerialisation) without inductor's codegen: left
    # alone, it moves the backward's recomputations into the forward and saves their results.
    torch._dynamo.reset()
    k, d, hid, n = 4, 64, 16, 2 * 32
    ref, fused = _integrators(k, d, hid)
    h = torch.randn(2, 32, d, dtype=torch.bfloat16 if bf16 else torch.float32)
    got, reference = _saved_bytes(fused, h, bf16, backend), _saved_bytes(ref, h, bf16, backend)
    mm = 2 if bf16 else 4  # the matmul dtype's bytes; the state is fp32
    # h; x_i and v_i for i = 1..K-1 (fp32); c_i for every i; κ; plus the weights' bf16 copies under autocast.
    weights = (7 * d * hid + 4 * d) * 2 if bf16 else 0  # W_h, W_xv, W_out, b_out
    bound = n * d * h.element_size() + (k - 1) * 2 * n * d * 4 + k * n * hid * mm + d * 4 + weights
    assert got <= bound
    assert reference > (2.5 if backend else 4) * got  # compiled, the reference saves ~3x the bytes, eager ~6x


def _model(impl: str, k: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    args = models.model_args("inl", "debug", {"integrator_impl": impl, "n_iterations": k, "n_layers": 1})
    model = models.build_model("inl", args, device="cpu")
    with torch.no_grad():
        g = torch.Generator().manual_seed(3)
        for name, p in model.named_parameters():
            if ".integrator." in name:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model


def _loss_and_grads(model: torch.nn.Module, ids: torch.Tensor) -> list[torch.Tensor]:
    out = model(ids)
    out.float().square().mean().backward()
    return [out.detach(), *(p.grad for p in model.parameters())]


@pytest.mark.parametrize("ac", ["none", "selective", "full"])
def test_compiled_fullgraph_block_with_checkpointing_equals_eager_reference(ac):
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    expected = _loss_and_grads(_model("reference"), ids)
    model = _model("fused")
    assert model.layers[0].integrator.impl == "fused"
    apply_activation_checkpointing(model, ac)
    for block in model.layers:
        # aot_eager: dynamo and AOTAutograd (the graph capture and the checkpoint partitioning) without
        # inductor's C++ compile, which takes minutes on CPU (the slow test below runs it).
        block.compile(backend="aot_eager", fullgraph=True)
    for a, b in zip(expected, _loss_and_grads(model, ids), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5 * a.abs().max().item())


@pytest.mark.slow
def test_inductor_compiled_fused_block_under_bf16_equals_the_reference():
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    results = []
    for impl in ("reference", "fused"):
        model = _model(impl)
        apply_activation_checkpointing(model, "selective")
        for block in model.layers:
            block.compile(fullgraph=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            results.append(_loss_and_grads(model, ids))
    for a, b in zip(*results, strict=True):
        assert (a - b).abs().max() <= 2e-2 * a.abs().max()


def test_switch_keeps_the_checkpoint_and_is_checked():
    ref, fused = _model("reference"), _model("fused")
    assert ref.state_dict().keys() == fused.state_dict().keys()
    with pytest.raises(ConfigError, match="integrator_impl"):
        models.model_args("inl", "debug", {"integrator_impl": "cuda"})


def test_memory_estimate_counts_the_fused_integrators_saved_tensors():
    from gptoughts.perf.estimate import _activation_bytes

    per_token = {}
    for impl in ("reference", "fused"):
        args = models.model_args("inl", "3b", {"integrator_impl": impl})
        per_token[impl] = _activation_bytes("inl", args, "none", 4)[0] / args.n_layers
    d, k, hid = args.d_model, args.n_iterations, args.controller_hidden
    # The reference's K (22d + 4H) becomes (K - 1) 8d + 2KH (h, 2d, is in both).
    assert (
        per_token["reference"] - per_token["fused"] == k * (22 * d + 4 * hid) - (k - 1) * 8 * d - 2 * k * hid
    )
