"""Muon's step for one group of same-shape matrices (a "bucket": every layer's wq, say): momentum, the Newton-Schulz
orthogonalization of ``torch.optim.Muon`` batched over the bucket, weight decay and the update.

Three ways to run it, chosen by :class:`~gptoughts.training.optim.Muon`:

* eager (the reference): foreach passes, ``torch.stack`` of the updates, the iteration in bf16;
* compiled (``perf.muon_compile``): :func:`bucket_step` as one ``torch.compile`` graph per bucket, so the
  stack, the bf16 cast, the norm and the scaled update fuse into the elementwise kernels around the matmuls;
* sharded (FSDP2/TP DTensors): each matrix is gathered whole and every rank orthogonalizes every matrix
  (:func:`gather_orthogonalize`), or, with ``perf.muon_distribute``, each rank orthogonalizes 1/N of a bucket's
  matrices (:func:`distributed_orthogonalize`: one all-to-all in, one out).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable

import torch

Coefficients = tuple[float, float, float]


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def lr_adjustment(kind: str, shape: torch.Size) -> float:
    """``torch.optim.Muon``'s learning-rate adjustment, for one matrix (the last two dimensions)."""
    rows, cols = shape[-2], shape[-1]
    if kind == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    if kind == "original":
        return math.sqrt(max(1.0, rows / cols))
    return 1.0


def orthogonalize(
    x: torch.Tensor, coefficients: Coefficients, steps: int, square: bool = False
) -> torch.Tensor:
    """The Newton-Schulz iteration of ``torch.optim.Muon`` over the last two dimensions, in bf16; leading
    dimensions are a batch of matrices (a bucket, MoE experts), each normalised and iterated alone.
    ``square`` (a batch, for the compiled step): each iteration as x <- (aI + bG + cG^2) x."""
    a, b, c = coefficients
    x = x.bfloat16()
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    if x.ndim == 2:  # torch.optim.Muon's exact sequence (addmm rounds once)
        x = x / x.norm().clamp(min=1e-7)
        for _ in range(steps):
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    else:
        shape = x.shape
        x = x.reshape(-1, *shape[-2:])
        x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=1e-7)
        # The square form: three plain matmuls and one element-wise pass over the small n x n matrices (G and G^2,
        # bf16 matmul outputs, summed with aI in fp32 and rounded once), where baddbmm's beta-accumulate made
        # inductor copy each input first (docs/performance.md).
        eye = torch.eye(x.size(-2), device=x.device) if square else None
        for _ in range(steps):
            gram = x @ x.mT
            if eye is not None:
                x = (c * (gram @ gram).float() + b * gram.float() + a * eye).bfloat16() @ x
            else:
                x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        x = x.reshape(shape)
    return x.mT if tall else x


def momentum(
    grads: list[torch.Tensor],
    bufs: list[torch.Tensor],
    *,
    mu: float,
    nesterov: bool,
    grad_scale: torch.Tensor | None,
    keep: torch.Tensor | None,
) -> list[torch.Tensor]:
    """Update the momentum buffers in place; returns the updates to orthogonalize (nesterov: the gradient
    pulled towards the new buffer). ``keep`` = 0 (a non-finite step) leaves the buffers as they were."""
    if grad_scale is not None:
        grads = torch._foreach_div(grads, grad_scale)
    if (
        keep is not None
    ):  # a skipped step's "gradient" is the buffer itself: the lerp leaves the buffer as it was
        grads = [torch.where(keep > 0, g, b) for g, b in zip(grads, bufs)]
    torch._foreach_lerp_(bufs, grads, 1 - mu)
    return torch._foreach_lerp(grads, bufs, mu) if nesterov else bufs


def apply_update(
    weights: list[torch.Tensor],
    ortho: list[torch.Tensor],
    *,
    lr_wd: float | torch.Tensor,
    scale: float | torch.Tensor,
    keep: torch.Tensor | None,
) -> None:
    """Decoupled weight decay (``lr_wd`` = lr x weight decay), then the orthogonalized update times ``scale``."""
    if keep is None:
        torch._foreach_mul_(weights, 1 - lr_wd)
        if isinstance(scale, torch.Tensor):  # the compiled path: the learning rate is a tensor (no recompile)
            torch._foreach_add_(weights, torch._foreach_mul(ortho, -scale))
        else:
            torch._foreach_add_(weights, ortho, alpha=-scale)
    else:
        torch._foreach_mul_(weights, 1 - lr_wd * keep)
        torch._foreach_add_(weights, torch._foreach_mul(ortho, -scale * keep))


def bucket_step(
    weights: list[torch.Tensor],
    grads: list[torch.Tensor],
    bufs: list[torch.Tensor],
    *,
    mu: float,
    nesterov: bool,
    lr_wd: float | torch.Tensor,
    scale: float | torch.Tensor,
    grad_scale: torch.Tensor | None,
    keep: torch.Tensor | None,
    coefficients: Coefficients,
    steps: int,
    square: bool = False,
) -> None:
    """One Muon step of a bucket of unsharded matrices of one :func:`oriented` shape: the matrices go through
    Newton-Schulz together, a handful of batched matmuls instead of five small ones per matrix. A tall matrix is
    iterated transposed, as :func:`orthogonalize` does alone, so it shares a batch with the wide ones of its shape
    (an MLP's w1, w3 and w2) and gets the same update. ``square``: :func:`orthogonalize`'s."""
    updates = momentum(grads, bufs, mu=mu, nesterov=nesterov, grad_scale=grad_scale, keep=keep)
    if len(updates) == 1:
        ortho = [orthogonalize(updates[0], coefficients, steps, square)]
    else:
        tall = [u.size(-2) > u.size(-1) for u in updates]
        wide = torch.stack([u.mT if t else u for u, t in zip(updates, tall)])
        done = orthogonalize(wide, coefficients, steps, square).unbind(0)
        ortho = [o.mT if t else o for o, t in zip(done, tall)]
    apply_update(weights, ortho, lr_wd=lr_wd, scale=scale, keep=keep)


def oriented(shape: torch.Size) -> tuple[int, ...]:
    """``shape`` with its last two dimensions as Newton-Schulz iterates them: the shorter one first."""
    *lead, rows, cols = shape
    return (*lead, min(rows, cols), max(rows, cols))


def gather_orthogonalize(
    update: torch.Tensor,
    param: torch.Tensor,
    coefficients: Coefficients,
    steps: int,
    ns: Callable[..., torch.Tensor] = orthogonalize,
) -> torch.Tensor:
    """``update`` is this rank's shard of a sharded ``param``'s update (a DTensor's local tensor): gathered,
    orthogonalized whole (Newton-Schulz needs the whole matrix; every rank does the same work) and cut back to
    this rank's shard."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    mesh, placements = param.device_mesh, param.placements
    home = update.device
    # Offloaded shards (FSDP2 CPUOffloadPolicy) live on the CPU: gather and orthogonalize them on the mesh's
    # accelerator (NCCL, tensor cores) rather than through gloo and CPU matmuls.
    work = update.to(mesh.device_type) if home.type != mesh.device_type else update
    full = DTensor.from_local(work, mesh, placements, shape=param.shape, stride=param.stride()).full_tensor()
    full = ns(full, coefficients, steps)
    return distribute_tensor(full, mesh, placements, src_data_rank=None).to_local().to(home)


def can_distribute(param: torch.Tensor) -> bool:
    """Whether :func:`distributed_orthogonalize` takes ``param``'s bucket: a DTensor whose placements are plain
    ``Shard``/``Replicate`` (FSDP2, HSDP, TP; not FSDP over TP's strided shards) on more than one rank."""
    from torch.distributed.tensor import Replicate, Shard

    if not hasattr(param, "device_mesh") or param.device_mesh.size() < 2:
        return False
    return all(type(p) is Shard or isinstance(p, Replicate) for p in param.placements)


def distributed_orthogonalize(
    updates: list[torch.Tensor],
    param: torch.Tensor,
    coefficients: Coefficients,
    steps: int,
    ns: Callable[..., torch.Tensor] = orthogonalize,
) -> list[torch.Tensor]:
    """The orthogonalized updates of a bucket of sharded matrices shaped and placed like ``param``, each rank
    computing 1/N of them: the shards are stacked into one DTensor ``[G, *shape]`` (each placement's dim moved
    by one), redistributed so that each rank holds whole matrices (``Shard(0)`` over every mesh dimension: an
    all-to-all), orthogonalized there as one batch, and redistributed back to this rank's shards."""
    from torch.distributed.tensor import DTensor, Shard

    mesh, home = param.device_mesh, updates[0].device
    stacked = torch.stack(updates)
    if home.type != mesh.device_type:  # offloaded shards: the collectives and matmuls on the accelerator
        stacked = stacked.to(mesh.device_type)
    shifted = [Shard(p.dim + 1) if isinstance(p, Shard) else p for p in param.placements]
    whole = [Shard(0)] * mesh.ndim
    shape = torch.Size((len(updates), *param.shape))
    stride = torch.empty(shape, device="meta").stride()
    mine = DTensor.from_local(stacked, mesh, shifted, shape=shape, stride=stride).redistribute(mesh, whole)
    done = ns(mine.to_local(), coefficients, steps)
    back = DTensor.from_local(done, mesh, whole, shape=shape, stride=stride).redistribute(mesh, shifted)
    return list(back.to_local().to(home).unbind(0))


def warm_all_to_all(mesh: object) -> None:
    """One tiny all-to-all on each of ``mesh``'s dimensions, now. NCCL sets up its peer-to-peer buffers at a
    group's first all-to-all with cudaMalloc, outside PyTorch's allocator; at the first optimizer step that
    allocator's cache holds the GPU and the setup fails ("unhandled cuda error": DeepSeek-16b under FSDP2 x 4 with
    perf.muon_distribute, whose Newton-Schulz redistribution is the run's first all-to-all)."""
    import torch.distributed as dist

    for dim in range(mesh.ndim):
        group = mesh.get_group(dim)
        # a group of one (EP over every rank: its efsdp dimension) exchanges nothing
        if (n := dist.get_world_size(group)) > 1:
            x = torch.zeros(n, device=mesh.device_type)
            dist.all_to_all_single(torch.empty_like(x), x, group=group)


@functools.cache
def compiled(fn: Callable[..., object], backend: str = "inductor") -> Callable[..., object]:
    """``fn`` (:func:`bucket_step` or :func:`orthogonalize`) compiled whole with static shapes: one graph per
    bucket shape (a handful per model), compiled at its first call."""
    # Inductor's loop reordering asserts (torch 2.11, CUDA) on a batch that stacks transposed matrices beside
    # others (bucket_step's tall ones): off for these small graphs.
    options = {"loop_ordering_after_fusion": False} if backend == "inductor" else None
    graph = torch.compile(fn, fullgraph=True, dynamic=False, backend=backend, options=options)
    # Lift dynamo's recompile limit, which would fall back to eager after 8 graphs of one function.
    unlimited = getattr(torch._dynamo.utils, "disable_cache_limit", contextlib.nullcontext)

    def call(*args: object, **kwargs: object) -> object:
        with unlimited():
            return graph(*args, **kwargs)

    return call
