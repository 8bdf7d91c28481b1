"""torchrun environment, process groups and data-parallel wrapping.

The trainer works with a :class:`DistInfo` whatever the launch: a plain ``python -m gptoughts train`` is one
process of world size 1 and no process group; ``torchrun --nproc_per_node=N -m gptoughts train`` sets
RANK/WORLD_SIZE/LOCAL_RANK and we join the group (NCCL on CUDA, gloo on CPU).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from gptoughts.errors import ConfigError


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init(device: torch.device, backend: str = "auto", strategy: str = "auto") -> DistInfo:
    """Join the process group torchrun set up (idempotent); world size 1 when not under torchrun."""
    if not launched_by_torchrun() or int(os.environ["WORLD_SIZE"]) == 1:
        if strategy == "ddp" and not launched_by_torchrun():
            raise ConfigError("parallel.strategy = ddp needs several processes: launch with "
                              "`torchrun --nproc_per_node=N -m gptoughts train ...`")
        return DistInfo()
    if strategy == "none":
        raise ConfigError("parallel.strategy = none but torchrun started several processes; use auto or ddp")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", 0))
    if not dist.is_initialized():
        if backend == "auto":
            backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=30),
                                device_id=device if device.type == "cuda" else None)
    return DistInfo(rank=rank, local_rank=local, world_size=world)


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def wrap_ddp(model: nn.Module, device: torch.device, info: DistInfo) -> nn.Module:
    if not info.enabled:
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    # gradient_as_bucket_view avoids a copy of every gradient into the all-reduce buckets; static_graph lets
    # DDP skip the unused-parameter search each step (our graphs never change shape).
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
               gradient_as_bucket_view=True, static_graph=True)


def all_reduce_sum(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.enabled:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def broadcast_object(obj: object, info: DistInfo, src: int = 0) -> object:
    if not info.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model under DDP / torch.compile wrappers (for state dicts and generation)."""
    while True:
        if hasattr(model, "module") and isinstance(model.module, nn.Module):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model
