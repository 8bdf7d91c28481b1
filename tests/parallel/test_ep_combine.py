"""The expert-parallel dispatch (parallel/ep.py) moves and combines the tokens as ``moe_combine`` / ``moe_permute``
say, as the one-process experts do (models/deepseek/dispatch.py).

In one process (gloo, a group of one: the all-to-alls run and return their input), the expert-parallel experts give
the outputs and gradients of the plain ones for every setting, and keep no more for the backward: before the EP
dispatch followed the settings, its ``bmm`` combine saved the ``[tokens, top_k, d]`` expert outputs on top of what
the one-process path saves. On two ranks (slow tier), each setting trains as one process does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from ep_helpers import _close, _rows
from torch.distributed.device_mesh import init_device_mesh

from gptoughts.models.deepseek import GroupedExperts
from gptoughts.parallel.ep import ExpertParallelExperts, apply_ep
from gptoughts.training.checkpoint import store as ckpt
from gptoughts.training.checkpoint.restore import read_model_file
from gptoughts.training.checkpoint.sharded import consolidated_weights
from gptoughts.training.checkpoint.store import is_dcp

SETTINGS = [
    ("bmm", "index_put"),
    ("sum", "index_put"),
    ("hidden", "index_put"),
    ("sum", "gather"),
    ("hidden", "gather"),
]
N, D, HIDDEN, E, K = 48, 32, 24, 6, 3


@pytest.fixture
def ep_mesh():
    """A process group of one and its one-dimensional ``ep`` mesh."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))
    dist.destroy_process_group()


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)])
    idx[:10] = torch.arange(K)  # groups of very different sizes
    return x, idx, torch.rand(N, K, generator=g)


def _experts(combine: str, permute: str, mesh=None) -> GroupedExperts:
    torch.manual_seed(0)
    ex = GroupedExperts(D, HIDDEN, E, combine=combine, permute=permute)
    ex.reset_parameters(0.3, 0.3)
    if mesh is not None:
        apply_ep(ex, mesh)
        assert isinstance(ex, ExpertParallelExperts)
    return ex


def _weights(ex: GroupedExperts) -> list[torch.Tensor]:
    return [ex.w1, ex.w3, ex.w2]


def _local(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor under a DTensor or a functional collective's result (``AsyncCollectiveTensor``)."""
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.elem if hasattr(t, "elem") else t


def _forward_backward(ex: GroupedExperts, x, idx, gates):
    """Output, counts and the gradients of x, gates and the expert weights; and the bytes the forward saved for
    the backward (each storage once, parameters excluded)."""
    x, gates = x.clone().requires_grad_(), gates.clone().requires_grad_()
    params = {_local(w).untyped_storage().data_ptr() for w in _weights(ex)}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = _local(t).untyped_storage()
        if s.data_ptr() not in params:
            saved[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, counts = ex(x, idx, gates)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    grads = torch.autograd.grad(out, (x, gates, *_weights(ex)), g)
    return out, counts, [_local(t) for t in grads], sum(saved.values())


@pytest.mark.parametrize(("combine", "permute"), SETTINGS)
def test_ep_dispatch_computes_what_one_process_computes(ep_mesh, combine, permute):
    x, idx, gates = _inputs()
    one = _forward_backward(_experts(combine, permute), x, idx, gates)
    ep = _forward_backward(_experts(combine, permute, ep_mesh), x, idx, gates)
    assert torch.equal(ep[1], one[1])
    torch.testing.assert_close(ep[0], one[0], rtol=1e-6, atol=1e-6)
    for name, a, b in zip(("x", "gates", "w1", "w3", "w2"), ep[2], one[2]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"grad {n}: {m}")


@pytest.mark.parametrize(("combine", "permute"), SETTINGS)
def test_ep_dispatch_saves_no_more_than_one_process(ep_mesh, combine, permute):
    """Beyond what the same setting saves in one process, the EP dispatch saves a few scalars per token copy
    (its own indices and row weights), never a ``[tokens, top_k, d]`` tensor (the old bmm combine's)."""
    x, idx, gates = _inputs()
    one = _forward_backward(_experts(combine, permute), x, idx, gates)[3]
    ep = _forward_backward(_experts(combine, permute, ep_mesh), x, idx, gates)[3]
    per_copy_scalars = 4 * N * K * 8
    assert N * K * D * x.element_size() > 3 * per_copy_scalars  # the tensor this test would see
    assert ep - one <= per_copy_scalars, (ep, one)


def _weights_at(step_dir: Path) -> dict[str, torch.Tensor]:
    return consolidated_weights(step_dir) if is_dcp(step_dir) else read_model_file(step_dir)


# Two real ranks for the reference pair only: test_ep.py trains the defaults (hidden, gather) on two ranks, and
# every pair's all-to-all maths is checked above against one process on a real ep mesh (the second tier's time).
@pytest.mark.slow
@pytest.mark.distributed
def test_ep2_trains_like_one_process_for_each_setting(ep_runs):
    """Two ranks (experts split, tokens all-to-all) and one process, same setting (bmm combine, index_put
    permutation; the runs: tests/parallel/conftest.py): the same losses over 5 steps and the same weights after
    them."""
    tmp, _ = ep_runs
    one, ep = tmp / "one_bmm", tmp / "ep_bmm"
    _close(_rows(one), _rows(ep), [1, 2, 3, 4, 5])
    a = _weights_at(ckpt.step_dir(one / "checkpoints", 5))
    b = _weights_at(ckpt.step_dir(ep / "checkpoints", 5))
    assert sorted(a) == sorted(b) and any("experts.w1" in name for name in a)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
