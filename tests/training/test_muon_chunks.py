"""Muon's Newton-Schulz batches are bounded in bytes (``Muon.chunk_bytes``): a bucket of large matrices (MoE
experts of every layer) is cut into chunks, each matrix still orthogonalized alone, so the step is unchanged."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from gptoughts.training import newton_schulz
from gptoughts.training.optim import Muon

PLAIN = newton_schulz.orthogonalize


def _params() -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(3)
    # five same-shape matrices (one bucket) and three stacked-expert tensors (another)
    shapes = [(12, 20)] * 5 + [(4, 8, 10)] * 3
    return [nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def _run(chunk_bytes: int | None, monkeypatch) -> tuple[list[torch.Tensor], list[int]]:
    params = _params()
    opt = Muon([{"params": params, "muon": True, "weight_decay": 0.1}], lr=0.02)
    if chunk_bytes is not None:
        opt.chunk_bytes = chunk_bytes
    batches: list[int] = []
    monkeypatch.setattr(
        newton_schulz,
        "orthogonalize",
        lambda x, *a: batches.append(x.shape[0] if x.ndim > 2 else 1) or PLAIN(x, *a),
    )
    g = torch.Generator().manual_seed(7)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return [p.detach() for p in params], batches


def test_a_bucket_is_cut_into_chunks_that_step_like_the_whole(monkeypatch):
    whole, whole_batches = _run(None, monkeypatch)
    # 2 matrices of 12 x 20 fp32 a chunk; an expert tensor (4 x 8 x 10) is larger than that: one a chunk
    cut, cut_batches = _run(2 * 12 * 20 * 4, monkeypatch)
    assert whole_batches == [5, 3] * 3
    assert cut_batches == [2, 2, 1, 4, 4, 4] * 3  # 2 + 2 + 1 matrices; each expert tensor alone (4 experts)
    start = _params()
    for a, b, s in zip(cut, whole, start):
        assert (b - s).abs().max().item() > 1e-3  # the step moved it
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_distributed_chunks_keep_a_multiple_of_the_ranks(monkeypatch):
    """Under perf.muon_distribute each rank orthogonalizes whole matrices of the chunk: the budget counts what
    one rank stacks (its share of whole matrices), and a chunk holds a multiple of the rank count."""
    opt = Muon([{"params": [nn.Parameter(torch.zeros(2, 2))], "muon": True}], lr=0.02)
    monkeypatch.setattr(opt, "_distributes", lambda p: True)
    mesh = SimpleNamespace(size=lambda: 4)
    bucket = [SimpleNamespace(device_mesh=mesh, numel=lambda: 1000) for _ in range(19)]
    opt.chunk_bytes = 3 * 4000  # three whole fp32 matrices a rank
    assert [len(c) for c in opt._chunks(bucket)] == [12, 7]
    opt.chunk_bytes = 100  # less than one matrix: still one a rank
    assert [len(c) for c in opt._chunks(bucket)] == [4, 4, 4, 4, 3]
    opt.chunk_bytes = 1 << 30
    assert [len(c) for c in opt._chunks(bucket)] == [19]


def _warm_at_build(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from gptoughts.models import build_model, model_args
    from gptoughts.training.optim import build_muon

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        model = build_model("llama", model_args("llama", "debug"))
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        calls: list[int] = []
        plain = dist.all_to_all_single
        dist.all_to_all_single = lambda *a, **k: calls.append(1) or plain(*a, **k)
        kw = dict(lr=1e-3, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8, fused=False)
        build_muon(model, **kw, distribute=True)
        at_build = len(calls)
        build_muon(model, **kw, distribute=False)
        not_distributed = len(calls) - at_build
        from torch.distributed.device_mesh import init_device_mesh

        from gptoughts.training.newton_schulz import warm_all_to_all

        warm_all_to_all(init_device_mesh("cpu", (1, world)))  # EP over every rank: (efsdp 1, ep 2)
        if rank == 0:
            torch.save({"distribute": at_build, "not": not_distributed, "2-D": len(calls) - at_build}, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.distributed
def test_a_distributing_muon_sets_up_the_all_to_all_when_built(tmp_path):
    """Under FSDP2 with perf.muon_distribute, building the optimizer runs one all-to-all on the (1-D) mesh, so that
    NCCL allocates its peer buffers before training fills the GPU; without distribute, none; on a 2-D mesh, one per
    dimension of more than one rank."""
    import torch.multiprocessing as mp

    out = tmp_path / "calls.pt"
    mp.spawn(_warm_at_build, args=(2, f"file://{tmp_path / 'rdzv'}", str(out)), nprocs=2, join=True)
    assert torch.load(out, weights_only=True) == {"distribute": 1, "not": 0, "2-D": 1}
