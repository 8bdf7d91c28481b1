"""torchrun environment, process groups, data-parallel wrapping (DDP or FSDP2) and full state dicts.

:class:`DistInfo` describes any launch: one process without a process group, or ``torchrun`` ranks (NCCL on
CUDA, gloo on CPU). With ``parallel.pp`` or ``parallel.tp`` > 1 the ranks form the mesh ``(pp, dp, tp)`` and
data parallelism runs over ``dp`` only; every reduction of per-rank data runs over the ``dp`` group. DDP does
not reduce DTensor gradients, so tensor parallelism takes FSDP2. One-process and DDP runs checkpoint in the
single-file format, which FSDP runs also resume from (:func:`load_full_state_dict`,
:func:`load_optimizer_state`: every rank reads the whole and keeps its shard); FSDP and TP runs write sharded
DCP checkpoints. Meshes, checkpoint layouts and the scaling measurements: ``docs/parallel.md``.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from gptoughts.errors import ConfigError, UserError, first_line

T = TypeVar("T")


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    strategy: str = "none"
    """none (one process), ddp or fsdp: how the data-parallel dimension is handled."""
    tp: int = 1
    """Tensor-parallel degree (ranks that split each block's matrices and read the same data)."""
    pp: int = 1
    """Pipeline-parallel degree (stages)."""
    ep: int = 1
    """Expert-parallel degree: the routed experts are split over groups of ``ep`` consecutive ranks of the
    data-parallel dimension (``parallel/ep.py``); every rank still reads its own data."""
    ep_mesh: Any = None
    """Under expert parallelism, the DeviceMesh ``(efsdp, ep)`` (dims named so): ``ep`` the ranks that split the
    experts (all-to-all), ``efsdp`` the ranks holding the same experts (FSDP2 shards them over it)."""
    mesh: Any = None
    """The DeviceMesh ``(pp, dp, tp)`` (dims named so) when tensor or pipeline parallelism is on, else None
    (plain data parallelism over the default group)."""
    cpu_offload: bool = False
    """FSDP2 keeps parameters, gradients and optimizer state in CPU memory (``parallel.cpu_offload``); also a
    one-process run, then in a process group of one."""
    reshard_after_forward: bool = True
    """FSDP2 frees each block's gathered weights after its forward (``parallel.reshard_after_forward``, resolved
    by the run's assembly: ``training.resolve.reshard_rule``)."""
    sync_every_microbatch: bool = False
    """FSDP2 reduce-scatters the gradients after every micro-batch of an accumulated step, not only the last
    (``parallel.grad_sync_every_microbatch``, resolved by ``training.resolve.grad_sync_rule``)."""
    ddp_bucket_mb: int = 0
    """DDP's gradient bucket size in MB (``parallel.ddp_bucket_mb``; 0: :func:`ddp_bucket_mb` decides)."""

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: how many different micro-batches one step reads."""
        return self.world_size // (self.tp * self.pp)

    @property
    def dp_rank(self) -> int:
        """Which slice of the data this rank reads (the same for every rank of a tensor/pipeline group)."""
        return (self.rank // self.tp) % self.dp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def pp_rank(self) -> int:
        """The pipeline stage (rank order: pp outermost, tp innermost, like torchtitan's mesh)."""
        return self.rank // (self.tp * self.dp_size)

    @property
    def dp_group(self) -> Any:
        """The process group of the data-parallel dimension (None: the default group)."""
        return self.mesh["dp"].get_group() if self.mesh is not None else None

    @property
    def model_parallel(self) -> bool:
        """Tensor or pipeline parallelism: a rank holds a part of each layer or only some layers."""
        return self.tp > 1 or self.pp > 1

    @property
    def sharded(self) -> bool:
        """Parameters are sharded across ranks (FSDP or tensor parallel): state dicts, eval and sampling are
        collectives."""
        return self.strategy == "fsdp" or self.tp > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init(
    device: torch.device,
    backend: str = "auto",
    strategy: str = "auto",
    tp: int = 1,
    pp: int = 1,
    cpu_offload: bool = False,
    *,
    ddp_bucket_mb: int = 0,
    ep: int = 1,
) -> DistInfo:
    """Join the process group torchrun set up (idempotent); world size 1 when not under torchrun. With
    ``tp``/``pp`` > 1, also the device mesh ``(pp, dp, tp)``. ``cpu_offload``: FSDP2 on any number of
    processes (one process joins a group of one), with a gloo backend beside NCCL for the collectives on
    CPU tensors (the global gradient norm, Muon's gathers of offloaded shards). ``ep`` > 1: FSDP2 and the
    expert mesh (:attr:`DistInfo.ep_mesh`)."""
    world_env = int(os.environ["WORLD_SIZE"]) if launched_by_torchrun() else 1
    _check_launch(world_env, tp, pp)
    _check_ep_launch(world_env, ep)
    if ep > 1:
        strategy = "fsdp"  # the configuration refused ddp and none with ep > 1
    if cpu_offload:
        strategy, backend = _offload_choices(device, backend, strategy, tp, pp)
    if world_env == 1:
        return _one_process(device, backend, strategy, cpu_offload)
    if strategy == "none":
        raise ConfigError("parallel.strategy = none but torchrun started several processes; use auto or ddp")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", 0))
    dp = world // (tp * pp)
    strategy = _with_tp(strategy, tp, dp)
    if not dist.is_initialized():
        _join_group(device, backend)
    return DistInfo(
        rank=rank,
        local_rank=local,
        world_size=world,
        strategy="fsdp" if strategy == "fsdp" else "ddp",
        tp=tp,
        pp=pp,
        mesh=_mesh(device, pp, dp, tp) if tp > 1 or pp > 1 else None,
        cpu_offload=cpu_offload,
        ddp_bucket_mb=ddp_bucket_mb,
        ep=ep,
        ep_mesh=_ep_mesh(device, world, ep) if ep > 1 else None,
    )


def _check_launch(world_env: int, tp: int, pp: int) -> None:
    """Tensor and pipeline parallelism need torchrun and a process count they divide."""
    if tp * pp > 1 and not launched_by_torchrun():
        raise ConfigError(
            f"parallel.tp x parallel.pp = {tp} x {pp} needs {tp * pp} processes or a multiple: launch with "
            f"`torchrun --nproc_per_node={tp * pp} -m gptoughts train ...`"
        )
    if world_env % (tp * pp):
        raise ConfigError(
            f"parallel.tp x parallel.pp = {tp} x {pp} does not divide the {world_env} process(es) torchrun "
            f"started; use --nproc_per_node a multiple of {tp * pp}"
        )


def _check_ep_launch(world_env: int, ep: int) -> None:
    """Expert parallelism needs torchrun and a process count it divides."""
    if ep > 1 and (not launched_by_torchrun() or world_env % ep):
        raise ConfigError(
            f"--parallel.ep {ep} splits the experts over {ep} processes: launch a multiple of {ep} with "
            f"`torchrun --nproc_per_node={ep} -m gptoughts train ...` ({world_env} process(es) now)"
        )


def _ep_mesh(device: torch.device, world: int, ep: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    # ep innermost: the ranks exchanging tokens are neighbours (one host's NVLink before the network)
    mesh = init_device_mesh(device.type, (world // ep, ep), mesh_dim_names=("efsdp", "ep"))
    if hasattr(mesh, "_flatten"):
        # the experts' gradient norm (sharded over both dimensions) then takes one all-reduce, not two in a row
        mesh["efsdp", "ep"]._flatten("efsdp_ep")
    return mesh


def _offload_choices(device: torch.device, backend: str, strategy: str, tp: int, pp: int) -> tuple[str, str]:
    """The strategy and backend CPU offload takes (FSDP2; gloo beside NCCL for the collectives on CPU tensors), or
    a ConfigError where the rest of the launch rules it out."""
    if strategy in ("ddp", "none"):
        raise ConfigError(
            f"parallel.cpu_offload keeps FSDP2's shards in CPU memory; parallel.strategy = {strategy} "
            "does not shard: use --parallel.strategy fsdp (or auto)"
        )
    if tp > 1 or pp > 1:
        raise ConfigError("parallel.cpu_offload is for FSDP alone; drop --parallel.tp / --parallel.pp")
    if backend == "auto":
        backend = "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"
    return "fsdp", backend


def _one_process(device: torch.device, backend: str, strategy: str, cpu_offload: bool) -> DistInfo:
    """One process: no process group, except a group of one for FSDP2's CPU offload."""
    if cpu_offload:
        if not dist.is_initialized():
            if device.type == "cuda":
                torch.cuda.set_device(device)
            # One process: an in-memory store, no rendezvous (no port, no torchrun).
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
        return DistInfo(strategy="fsdp", cpu_offload=True)
    if strategy in ("ddp", "fsdp") and not launched_by_torchrun():
        raise ConfigError(
            f"parallel.strategy = {strategy} needs several processes: launch with "
            "`torchrun --nproc_per_node=N -m gptoughts train ...`"
        )
    return DistInfo()


def check_layout(strategy: str, cpu_offload: bool, tp: int, pp: int, dp: int) -> None:
    """The launch's refusals of a layout, made without a launch (``gptoughts estimate`` answers what train takes)."""
    if cpu_offload:
        _offload_choices(torch.device("cpu"), "gloo", strategy, tp, pp)
    _with_tp(strategy, tp, dp)


def _with_tp(strategy: str, tp: int, dp: int) -> str:
    """Tensor parallelism with several data-parallel ranks takes FSDP2: DDP does not reduce DTensor gradients.
    Refused before joining the group: every rank says it alone."""
    if tp > 1 and dp > 1:
        if strategy == "ddp":
            raise ConfigError(
                "parallel.strategy = ddp does not combine with --parallel.tp (DDP does not reduce DTensor "
                "gradients); use --parallel.strategy fsdp (or auto)"
            )
        return "fsdp"  # auto
    return strategy


def _join_group(device: torch.device, backend: str) -> None:
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend=backend,
        timeout=datetime.timedelta(minutes=30),
        device_id=device if device.type == "cuda" else None,
    )


def _mesh(device: torch.device, pp: int, dp: int, tp: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    if dp > 1 and tp > 1 and hasattr(mesh, "_flatten"):
        # A DTensor reduced over both dimensions (the gradient norm of the (dp, tp)-sharded blocks) then
        # takes one all-reduce over the flattened mesh instead of two in a row (DTensor warns otherwise).
        mesh["dp", "tp"]._flatten("dp_tp")
    return mesh


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def ddp_bucket_mb(model: nn.Module, asked: int = 0) -> int:
    """The DDP bucket size: ``asked``, or (0) a twentieth of the fp32 gradients, clamped to 25-250 MB (larger
    buckets than torch's 25 MB measured faster: ``docs/parallel.md``)."""
    if asked:
        return asked
    grad_mb = 4 * sum(p.numel() for p in model.parameters() if p.requires_grad) / 2**20
    return int(min(250, max(25, grad_mb / 20)))


def wrap_ddp(model: nn.Module, device: torch.device, info: DistInfo) -> nn.Module:
    """DDP over the data-parallel ranks (all of them, or the ``dp`` group of the mesh); the model itself when
    there is only one."""
    if info.dp_size == 1:
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    # gradient_as_bucket_view avoids a copy of every gradient into the all-reduce buckets. No static_graph: with
    # no_sync (gradient accumulation) its first backward fails an internal assertion, and past that it stops
    # all-reducing (pytorch/pytorch#143580, #187732); without find_unused_parameters it saves no search anyway.
    return DDP(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        gradient_as_bucket_view=True,
        process_group=info.dp_group,
        bucket_cap_mb=ddp_bucket_mb(model, info.ddp_bucket_mb),
    )


def wrap_fsdp(
    model: nn.Module,
    precision: str,
    mesh: Any = None,
    cpu_offload: bool = False,
    reshard_after_forward: bool = True,
    expert_mesh: Any = None,
) -> nn.Module:
    """FSDP2: shard each transformer block (the unit that is gathered just before it runs and freed after),
    then the root (embeddings, final norm, head). Compute in bf16/fp16 when training in it, gradients reduced in
    fp32. ``fully_shard`` works in place: parameter names, per-block compile and checkpointing are unchanged.

    One difference from DDP + autocast: the bf16 policy applies to every parameter, so the weights autocast
    would keep in fp32 (norm weights, DeepSeek's router) also compute from bf16 copies; routing can then differ
    slightly from a DDP run of the same config.

    ``mesh``: the data-parallel sub-mesh (under tensor parallelism the blocks' DTensors become 2-D; a pipeline
    stage is sharded over the ranks holding that stage), else the default group.

    ``cpu_offload``: the shards (fp32 weights, gradients, and so the optimizer state and its step) stay in pinned
    CPU memory; each block is copied to the GPU when it is gathered and its gradient copied back after the
    reduce-scatter.

    ``expert_mesh``: under expert parallelism, the ``efsdp`` dimension of :attr:`DistInfo.ep_mesh`; each
    expert-parallel module (DTensors on the ``ep`` dimension) is sharded over it first, so that the blocks'
    and the root's groups leave its parameters alone."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    # Pinned host memory makes the copies asynchronous; there is nothing to pin for on a machine without a GPU.
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    if expert_mesh is not None:
        from gptoughts.parallel.ep import expert_modules

        for experts in expert_modules(model):  # the MTP block's too, which the root group would take
            fully_shard(experts, mesh=expert_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    blocks = list(model.layers)
    for i, block in enumerate(blocks):
        # the last block's parameters are needed again at once by the backward: keep them gathered
        fully_shard(
            block,
            mesh=mesh,
            mp_policy=mp,
            reshard_after_forward=reshard_after_forward and i < len(blocks) - 1,
            offload_policy=offload,
        )
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload)
    return model


def reshard(model: nn.Module) -> None:
    """Put FSDP2's shards back on every module after forward-only passes made before training. A forward leaves
    the root's and the last block's gathered parameters registered (kept for a backward), and whatever collects
    ``model.parameters()`` then holds tensors FSDP2 frees later (the checkpoints' finite check read freed memory:
    a segfault). Other models: nothing to do."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def discard_failed_step(model: nn.Module) -> None:
    """Make an FSDP2 model whose forward or backward raised (out of memory) ready for a new step; other models
    need nothing. For one process: the out-of-memory retry and the batch-size probe.

    Only a backward that completes resets FSDP2's per-step state. An exception leaves gathered parameters
    registered on the modules (the model's parameters are then not the shards the optimizer holds), modules
    marked as in backward and the end-of-backward callback marked as queued though it never ran: later steps
    reduce no gradient into some or all shards, so the optimizer steps only some parameters and the sharded
    state dict fails (``KeyError`` in ``get_optimizer_state_dict``). The gradients that the failed step's
    completed micro-batches accumulated on gathered copies are dropped too, or the retry would add them in."""
    from torch.distributed.fsdp import FSDPModule

    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    # The outermost is fully_shard's root (a compile wrapper around it is no FSDPModule). It is set up by the
    # first forward: before that there is nothing to undo.
    root = modules[0] if modules else None
    if root is None or root._get_fsdp_state()._is_root is None:
        return
    if hasattr(root, "reset_iter_state"):  # torch >= 2.13
        root.reset_iter_state()
    else:
        _reset_iter_state(root._get_fsdp_state())
    for module in modules:
        group = module._get_fsdp_state()._fsdp_param_group
        for param in group.fsdp_params if group is not None else ():
            param.unsharded_accumulated_grad = None
            if hasattr(param, "_unsharded_param"):  # created at the module's first gather
                param._unsharded_param.grad = None


def _reset_iter_state(root: Any) -> None:
    """``FSDPModule.reset_iter_state`` for torch 2.11 and 2.12 (from their FSDP2 state): wait on and drop the
    collectives in flight, put every state back to idle with its parameters sharded, clear the step's marks.
    Not FSDP's end-of-backward callback: it would run the post-backward of modules the forward never reached."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    comm, ctx = root._comm_ctx, root._state_ctx
    in_flight = [comm.all_gather_state]
    if hasattr(comm, "reduce_scatter_states"):  # torch 2.12: a list
        in_flight += comm.reduce_scatter_states
        comm.reduce_scatter_states.clear()
    else:  # torch 2.11: one
        in_flight.append(comm.reduce_scatter_state)
        comm.reduce_scatter_state = None
    comm.all_gather_state = None
    for pending in in_flight:
        if pending is not None and pending.event is not None:
            comm.device_handle.current_stream().wait_event(pending.event)
    comm.post_forward_order.clear()
    for state in ctx.all_states:
        state._training_state = TrainingState.IDLE
        group = state._fsdp_param_group
        if group is not None:
            group.finalize_backward()  # waits on this module's own collectives and drops their buffers
            group._training_state = TrainingState.IDLE
            group.reshard()
    ctx.iter_forward_root = None
    ctx.post_backward_final_callback_queued = False


def wrap(model: nn.Module, device: torch.device, info: DistInfo, precision: str) -> nn.Module:
    """The data-parallel wrapper ``info.strategy`` asks for (the model itself when running alone, or when a
    tensor-parallel run has one data-parallel rank and did not ask for FSDP)."""
    if info.strategy == "fsdp":
        mesh = info.mesh["dp"] if info.mesh is not None else None
        if mesh is None and device.type == "cpu" and not info.cpu_offload:
            # FSDP2's default mesh is on the machine's accelerator when it has one: a CPU run on a host with
            # fewer GPUs than ranks would bind rank N to GPU N ("invalid device ordinal", seen on a 1-GPU host)
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (info.world_size,))
        experts = info.ep_mesh["efsdp"] if info.ep_mesh is not None else None
        return wrap_fsdp(model, precision, mesh, info.cpu_offload, info.reshard_after_forward, experts)
    if info.pp > 1:
        # DDP's reducer cannot follow a pipeline schedule's backward passes (several per step, in its own order:
        # the bucket rebuild after the first step fails an internal assertion, torch 2.13): the pipeline
        # all-reduces the gradients over the data-parallel group itself, after the step (parallel/pp.py).
        return model
    if (
        info.model_parallel
    ):  # tensor parallel, dp == 1 here (init refused DDP with several data-parallel ranks)
        return model
    return wrap_ddp(model, device, info)


def _options(**kw: bool) -> object:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a full state dict (every rank holds it) into a sharded model: each rank keeps its shard."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, state, options=_options(strict=True))


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, info: DistInfo) -> dict:
    """What a checkpoint stores: ``optimizer.state_dict()``, or under FSDP the full state keyed by parameter
    name, gathered to CPU on rank 0 (a collective)."""
    if not info.sharded:
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=_options(cpu_offload=True))


def load_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: dict, info: DistInfo
) -> None:
    """Inverse of :func:`optimizer_state`, across strategies: a state keyed by parameter index (one process or
    DDP) or by name (FSDP) loads into a plain, DDP or FSDP run."""
    by_name = any(isinstance(k, str) for k in state.get("state", {})) or any(
        isinstance(p, str) for g in state.get("param_groups", []) for p in g["params"]
    )
    if not info.sharded and not by_name:
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    if not by_name:  # index i = the i-th parameter of the saved param groups, in order
        order = _saved_order(model, optimizer, state)
        if order is None:
            raise UserError(
                "this checkpoint's optimizer state was written by a one-process or DDP run whose parameter "
                "groups do not match this run's; resume it on one process or under DDP/FSDP, then switch to "
                "--parallel.tp / --parallel.ep from that run's next (sharded) checkpoint"
            )
        state = {
            "state": {order[i]: v for i, v in state["state"].items()},
            "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in state["param_groups"]],
        }
    set_optimizer_state_dict(model, optimizer, state, options=_options())


def _saved_order(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> list[str] | None:
    """The parameter names of an index-keyed optimizer state (one process or DDP), in its index order; None when
    this run's groups cannot come from the saved ones. Tensor and expert parallelism split each saved group by
    layout (plain tensors, DTensors of each mesh) into consecutive groups, each keeping the model's parameter
    order: a saved group is the next run of live groups of the same total size, merged back in model order."""
    names = {id(p): n for n, p in model.named_parameters()}
    position = {id(p): i for i, (_, p) in enumerate(model.named_parameters())}
    live, order = list(optimizer.param_groups), []
    for saved in state.get("param_groups", []):
        run: list[torch.Tensor] = []
        split = -1  # live groups taken for this saved group, minus one
        while live and len(run) < len(saved["params"]):
            run += live.pop(0)["params"]
            split += 1
        if len(run) != len(saved["params"]) or any(id(p) not in names for p in run):
            return None
        if split:  # a group kept whole keeps its own order (Muon's need not be the model's)
            run = sorted(run, key=lambda p: position[id(p)])
        order += [names[id(p)] for p in run]
    return order if not live else None


def all_reduce_sum(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Sum over every rank (flags, counts of problems)."""
    if info.enabled:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_reduce_max(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Maximum over every rank (a signal number that only some ranks received)."""
    if info.enabled:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


def all_reduce_dp(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Sum over the data-parallel ranks only: per-rank data (losses, token counts) that the ranks of a tensor
    or pipeline group hold alike is counted once."""
    if info.enabled and info.dp_size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=info.dp_group)
    return t


def all_reduce_loss(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Sum of per-rank loss sums: over the data-parallel ranks and, under pipeline parallelism, over the stages
    (only the last holds a loss; the others add 0). Tensor and pipeline parallelism do not combine, so with
    ``pp > 1`` that is every rank."""
    if info.pp > 1:
        return all_reduce_sum(t, info)
    return all_reduce_dp(t, info)


def broadcast_object(obj: object, info: DistInfo, src: int = 0) -> object:
    if not info.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def on_main(fn: Callable[[], T], info: DistInfo) -> T:
    """``fn()`` on rank 0 alone (what one process must do: check or write the run's folder), its result on every
    rank; a :class:`UserError` it raises is raised on every rank. The other ranks wait in a collective meanwhile:
    had rank 0 left without a word, each would die there with the backend's traceback, rank 0's one line drowned.
    Any other error keeps its traceback on rank 0; the others stop with a line pointing at it."""
    if not info.enabled:  # one process: rank 0 (a stand-in for another rank, in a test, has no one to hear)
        return fn() if info.is_main else None  # type: ignore[return-value]
    if not info.is_main:
        kind, value = broadcast_object(None, info)  # type: ignore[misc]
        if kind == "ok":
            return value
        if kind == "refused":
            raise UserError(value)
        raise UserError(f"rank 0 stopped ({value}); its own output says why")
    try:
        result = fn()
    except BaseException as e:
        told = (
            ("refused", str(e))
            if isinstance(e, UserError)
            else ("failed", f"{type(e).__name__}: {first_line(e)}")
        )
        with contextlib.suppress(Exception):  # the others already gone: rank 0's own error is the one to show
            broadcast_object(told, info)
        raise
    broadcast_object(("ok", result), info)
    return result


def all_gather_object(obj: object, info: DistInfo) -> list[object]:
    """Every rank's ``obj``, in rank order (``[obj]`` alone)."""
    if not info.enabled:
        return [obj]
    out: list[object] = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def _error_key() -> str:
    """Where rank 0 posts its one-line error for the other ranks to compare theirs with: one per torchrun attempt."""
    return f"gptoughts/error/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def _error_store(wait_s: float) -> Any:
    """A client of the launch's store, hosted by torchrun's agent (so it is there before a process group is joined
    and after it is left); None where torchrun hosts none (a rank 0 hosts it then, and may be gone)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    return dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=wait_s),
    )


def post_error(message: str) -> None:
    """Rank 0, after printing ``message``: the other ranks that raise it too stay silent (:func:`is_rank0_error`)."""
    try:
        store = _error_store(5.0)
        if store is not None:
            store.set(_error_key(), message)
    except Exception:  # noqa: BLE001 - then each rank says its own, as without a store
        pass


def is_rank0_error(message: str, wait_s: float = 10.0) -> bool:
    """Whether rank 0 raised (and printed) this same error. Every rank checks the same config at about the same time;
    an error only this rank sees leaves rank 0 waiting in a collective: after ``wait_s`` this rank says it itself."""
    key = _error_key()
    try:
        store = _error_store(wait_s)
        if store is None:
            return False
        store.wait([key], datetime.timedelta(seconds=wait_s))
        return store.get(key).decode("utf-8") == message
    except Exception:  # noqa: BLE001 - not there in time (or no store): this rank's own error
        return False


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model under DDP / torch.compile wrappers (for state dicts and generation)."""
    while True:
        if hasattr(model, "module") and isinstance(model.module, nn.Module):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model
