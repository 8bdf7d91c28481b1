"""The run's environment: device, process group, hardware profile, precision, and the compile cache."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from gptoughts.config import Config, TrainConfig
from gptoughts.errors import UserError
from gptoughts.parallel import dist as pdist
from gptoughts.perf import checkpointing, hardware


@dataclass
class Environment:
    device: torch.device
    dist: pdist.DistInfo
    hw: hardware.HardwareProfile
    precision: str
    """fp32, bf16 or fp16 (``perf.precision = auto`` resolved by the hardware profile)."""
    resolved: dict[str, str] = field(default_factory=dict)
    """Each ``auto`` of the environment and why it became what it is."""


def use_our_compile_cache() -> None:
    """Point torch.compile's caches beside the token cache (not for a dry run: importing dynamo creates the
    folder, and a dry run writes nothing)."""
    # torch.compile's caches (inductor's FX graphs, AOTAutograd's graphs, autotuning results) default to /tmp,
    # which a reboot or a cluster's job cleanup empties; beside the token cache they last, so a second run of
    # the same config compiles from cache (its start-up is printed after the first step). A user's own wins.
    # (torch writes its /tmp default into the variable the first time it looks, so that value counts as unset.)
    # (Only a set variable is compared with it: reading torch's default imports the inductor package.)
    user_cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if user_cache is None or user_cache == _torch_inductor_default():
        from gptoughts.data.cache import default_cache_dir

        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(default_cache_dir() / "inductor")


def setup_environment(cfg: Config) -> Environment:
    """Device, process group (torchrun), hardware profile and precision. Call :func:`pdist.shutdown` after."""
    import warnings

    # torch's RMSNorm says it cannot use its fused kernel when a bf16 residual meets an fp32 weight: expected
    # (perf.residual_dtype), and compiled blocks fuse the norm anyway. Not a thing for the user to act on.
    warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
    # FlashAttention-4's CuTe DSL says, at each kernel's first compile, that an argument of its own is passed as a
    # runtime value (flash-attn-4 4.0.0b36); two "warning:" lines per run for the user, nothing to act on.
    warnings.filterwarnings("ignore", message=r"Argument aux_data .* cannot be converted to a JitArgument")
    device = hardware.resolve_device(cfg.perf.device)
    # Before anything touches CUDA: the allocator reads its settings when it starts.
    hardware.apply_runtime_settings(
        device, tf32=cfg.perf.tf32, expandable_segments=cfg.perf.expandable_segments
    )
    par = cfg.parallel
    info = pdist.init(
        device,
        par.backend,
        par.strategy,
        par.tp,
        par.pp,
        par.cpu_offload,
        ddp_bucket_mb=par.ddp_bucket_mb,
    )
    hw = hardware.detect(device)
    from gptoughts.training.resolve import check_attention

    # a missing kernel or optimizer package is said before anything is built or written (every Environment is made
    # here: the later steps that use them need not check again)
    check_attention(cfg.perf, device)
    check_optimizer_states(cfg.train, info)
    precision = hardware.resolve_precision(cfg.perf.precision, hw)
    why = {"precision": f"{precision} ({'asked' if cfg.perf.precision != 'auto' else 'auto: ' + hw.arch})"}
    if cfg.perf.gpu_memory_gib is not None and device.type == "cuda" and hw.memory_bytes:
        cap = min(hw.memory_bytes, int(cfg.perf.gpu_memory_gib * 2**30))
        torch.cuda.set_per_process_memory_fraction(cap / hw.memory_bytes, device)
        hw = replace(hw, memory_bytes=cap)
        why["gpu_memory"] = f"capped at {cap / 2**30:.1f} GiB (perf.gpu_memory_gib)"
    if info.strategy == "fsdp" and not info.cpu_offload:
        reshard, reason = _fsdp_reshard(cfg, info, hw, device, precision)
        why["reshard_after_forward"] = f"{str(reshard).lower()} ({reason})"
        info = replace(info, reshard_after_forward=reshard)
    return Environment(device=device, dist=info, hw=hw, precision=precision, resolved=why)


def _fsdp_reshard(
    cfg: Config, info: Any, hw: Any, device: torch.device, precision: str = "bf16"
) -> tuple[bool, str]:
    """``parallel.reshard_after_forward`` resolved, and why. auto keeps every block gathered from its forward to
    its backward (no second all-gather: 1b scaled 97.1% instead of 95.4% on 2 x H200, bench/BENCHMARKS.md) when
    the memory estimate with them kept stays under 80% of the GPU at the asked micro-batch; it frees them when
    the estimate does not fit, or cannot be made (an HF model, batch_size auto, a CPU)."""
    asked = cfg.parallel.reshard_after_forward
    if asked is not True and asked is not False:
        asked = "auto"
    if asked != "auto":
        return bool(asked), "asked"
    t = cfg.train
    mem = (hw.memory_bytes or 0) / 2**30
    if device.type != "cuda" or not mem or not isinstance(t.batch_size, int) or cfg.model.init_from:
        return True, "auto: no estimate to check the kept weights against"
    if precision not in ("bf16", "fp16"):  # fp32 training gathers fp32 weights: kept, they would cost twice
        return True, f"auto: {precision} weights are resharded (kept gathered only in bf16/fp16)"
    from gptoughts.perf.estimate import estimate

    try:
        e = estimate(
            cfg.model.family,
            cfg.model.size,
            cfg.model.overrides,
            batch_size=t.batch_size,
            block_size=t.block_size,
            activation_checkpointing=checkpointing.resolve(cfg.perf.activation_checkpointing, cfg.lora)[0],
            num_gpus=info.world_size,
            strategy="fsdp",
            optimizer=t.optimizer,
            optimizer_states=t.optimizer_states,
            tp=info.tp,
            reshard_after_forward=False,
            residual_dtype="bf16" if precision == "bf16" and cfg.perf.residual_dtype != "fp32" else "fp32",
        )
    except Exception:  # noqa: BLE001 - an estimate must never stop a run
        return True, "auto: no estimate to check the kept weights against"
    if e.total_gib <= 0.8 * mem:
        return (
            False,
            f"auto: blocks kept gathered until backward (~{e.total_gib:.0f} GiB of {mem:.0f} estimated)",
        )
    return True, f"auto: blocks resharded after forward (kept, ~{e.total_gib:.0f} GiB > 80% of {mem:.0f})"


def _torch_inductor_default() -> str | None:
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir as torch_default
    except ImportError:  # a torch without it: only an unset variable is ours to set
        return None
    return os.path.abspath(torch_default())


def check_optimizer_states(t: TrainConfig, dist: pdist.DistInfo) -> None:
    """``train.optimizer_states = 8bit`` where torchao's AdamW8bit is missing or not known to work: refused in one
    line. Its states are tensor subclasses that our sharded (DCP) checkpoints do not read back, and that tensor
    parallelism's mix of plain tensors and DTensors was never tried with."""
    if t.optimizer_states != "8bit":
        return
    import importlib.util

    from gptoughts.training.optim import TORCHAO_MISSING

    if importlib.util.find_spec("torchao") is None:  # said here, before the data is prepared
        raise UserError(TORCHAO_MISSING)
    if dist.sharded or dist.tp > 1 or dist.pp > 1:
        raise UserError(
            "train.optimizer_states = 8bit runs on one GPU or under DDP; under FSDP, tensor or pipeline "
            "parallelism use --train.optimizer_states bf16"
        )
