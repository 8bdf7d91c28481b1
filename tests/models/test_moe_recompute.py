"""DeepSeek's MoE under full activation checkpointing when the experts' inputs are not where their weights were
at init (FSDP2's CPU offload: weights on the CPU, inputs on the GPU; here: built on meta, materialised on the
CPU without ``init_weights``). The grouped-GEMM probe then first ran inside a checkpointed forward, saved its
own tensors there but not in the recomputation, and the backward failed."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from gptoughts.models import build_model, model_args
from gptoughts.models.deepseek import moe
from gptoughts.perf.checkpointing import apply_activation_checkpointing


def _moved_model(seed: int = 0) -> torch.nn.Module:
    """A debug DeepSeek built on meta and moved to the CPU with its weights set by hand: its experts still believe
    they live on meta (as offloaded ones believe they live on the CPU)."""
    with torch.device("meta"):
        model = build_model("deepseek", model_args("deepseek", "debug"))
    model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.zero_()
        model.rope.reset_parameters()
    return model


@pytest.fixture
def fresh_probe_cache(monkeypatch):
    """An empty probe cache: the probe really runs (another test may have filled the process-wide one)."""
    monkeypatch.setattr(moe, "_GMM_SUPPORT", {})


def _grads(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    hidden = model(ids)
    loss = hidden.float().pow(2).mean()
    loss.backward()
    grads = {n.replace("._checkpoint_wrapped_module", ""): p.grad for n, p in model.named_parameters()}
    return loss.detach(), {n: g.clone() for n, g in grads.items() if g is not None}


def test_full_checkpointing_survives_a_first_probe_in_forward_and_keeps_gradients(fresh_probe_cache):
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    ref_loss, ref = _grads(_moved_model(), ids)
    moe._GMM_SUPPORT.clear()  # the checkpointed model probes again, inside its first block's forward
    model = _moved_model()
    assert {m._gmm_device for m in model.modules() if isinstance(m, moe.GroupedExperts)} == {"meta"}
    apply_activation_checkpointing(model, "full")
    loss, got = _grads(model, ids)  # raised CheckpointError ("a different number of tensors was saved")
    assert torch.equal(loss, ref_loss)
    assert got.keys() == ref.keys() and len(got) > 10
    for name, g in ref.items():
        torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-7, msg=name)


def test_the_probe_reaches_no_saved_tensor_hook(fresh_probe_cache):
    packed: list[torch.Size] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        inside = moe.grouped_mm_supported(torch.device("cpu"), torch.float32)
        w = torch.ones(3, requires_grad=True)
        (w * w).sum()  # an ordinary op after the probe still reaches the outer hook
    assert len(packed) == 2
    moe._GMM_SUPPORT.clear()
    assert moe.grouped_mm_supported(torch.device("cpu"), torch.float32) == inside


def test_probe_experts_tells_every_expert_module_its_compute_device(fresh_probe_cache):
    model = _moved_model()
    n = moe.probe_experts(model, torch.device("cpu"))
    a = model.args
    assert n == a.n_layers - a.n_dense_layers + (1 if model.mtp is not None else 0)
    experts = [m for m in model.modules() if isinstance(m, moe.GroupedExperts)]
    assert {m._gmm_device for m in experts} == {"cpu"}
    # forward only reads the answer now: a checkpointed block forward saves the same tensors as its recompute
    block = model.layers[-1]
    x = torch.randn(2, 8, a.d_model, requires_grad=True)
    cos, sin = model.rope(8, 0, None)
    y, _, _ = checkpoint(block, x, cos, sin, use_reentrant=False)
    y.float().pow(2).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
