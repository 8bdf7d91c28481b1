"""Building the model that the trainer runs: the one place where transforms are applied, in one order.

Order (each step only if configured): build on the meta device → materialise on the target device and
initialise (or load) weights → fp8 conversion → tensor parallel → activation checkpointing → compile →
FSDP / DDP → optimizer. Model code stays single-device; everything here wraps or converts it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from gptoughts import models
from gptoughts.config import PerfConfig
from gptoughts.errors import HardwareError
from gptoughts.parallel import dist as pdist
from gptoughts.perf.hardware import HardwareProfile


@dataclass
class Built:
    model: nn.Module
    """What the trainer calls (possibly compiled and/or DDP-wrapped)."""
    raw: nn.Module
    """The plain module (for state dicts, generation and export)."""


def build_raw_model(family: str, args: object, device: torch.device, seed: int) -> nn.Module:
    """Meta-device build, then allocate on ``device`` and initialise from ``seed`` (no wasted CPU init)."""
    with torch.device("meta"):
        model = models.build_model(family, args)
    model.to_empty(device=device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        model.init_weights()
    return model


def resolve_compile(perf: PerfConfig, hw: HardwareProfile) -> bool:
    if perf.compile == "auto":
        return bool(hw.recommended.get("compile")) and hw.arch not in ("cpu", "mps")
    if perf.compile and not hw.compile:
        raise HardwareError("--compile needs a working torch.compile backend (a C compiler on CPU, Triton on GPU);"
                            " install one or drop --compile")
    return bool(perf.compile)


def apply_transforms(raw: nn.Module, *, perf: PerfConfig, hw: HardwareProfile, device: torch.device,
                     dist: pdist.DistInfo) -> Built:
    model: nn.Module = raw
    if resolve_compile(perf, hw):
        # Compiling each block (not the whole model) keeps compile time flat in depth and lets activation
        # checkpointing and FSDP wrap the same units; the blocks are identical, so one graph is reused.
        # Module.compile() compiles in place, so parameter names (and checkpoints) are unchanged.
        for block in raw.layers:
            block.compile()
    model = pdist.wrap_ddp(model, device, dist)
    return Built(model=model, raw=raw)
