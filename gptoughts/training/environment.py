"""The run's environment: device, process group, hardware profile, precision, and the compile cache."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, replace

import torch

from gptoughts.config import Config, TrainConfig
from gptoughts.errors import UserError
from gptoughts.parallel import dist as pdist
from gptoughts.perf import hardware
from gptoughts.training.resolve import reshard_rule, resolve_grad_sync


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
        ep=par.ep,
    )
    # rank 0 tells how the run goes (the data step's lines too); the other ranks speak only of problems
    if not info.is_main:
        logging.getLogger("gptoughts").setLevel(logging.WARNING)
    hw = hardware.detect(device)
    from gptoughts.training.resolve import check_attention

    # a missing kernel or optimizer package is said before anything is built or written (every Environment is made
    # here: the later steps that use them need not check again)
    check_attention(cfg.perf, device)
    check_optimizer_states(cfg.train, info)
    if cfg.perf.fp8 is True:  # asked: refused here, where a dry run checks it too, not as the model is built
        from gptoughts.perf.fp8 import check_fp8_supported

        check_fp8_supported(device, str(hw.recommended.get("precision", "")) or None)
    precision = hardware.resolve_precision(cfg.perf.precision, hw)
    why = {"precision": f"{precision} ({'asked' if cfg.perf.precision != 'auto' else 'auto: ' + hw.arch})"}
    if cfg.perf.gpu_memory_gib is not None and device.type == "cuda" and hw.memory_bytes:
        cap = min(hw.memory_bytes, int(cfg.perf.gpu_memory_gib * 2**30))
        torch.cuda.set_per_process_memory_fraction(cap / hw.memory_bytes, device)
        hw = replace(hw, memory_bytes=cap)
        why["gpu_memory"] = f"capped at {cap / 2**30:.1f} GiB (perf.gpu_memory_gib)"
    if info.strategy == "fsdp":
        info, why["grad_sync"] = resolve_grad_sync(cfg, info, hw)
    if info.strategy == "fsdp" and not info.cpu_offload:
        reshard, reason = reshard_rule(cfg, info, hw, device, precision)
        why["reshard_after_forward"] = f"{str(reshard).lower()} ({reason})"
        info = replace(info, reshard_after_forward=reshard)
    return Environment(device=device, dist=info, hw=hw, precision=precision, resolved=why)


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
