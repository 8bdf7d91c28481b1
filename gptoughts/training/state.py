"""What the training loop and its components (checkpointer, recovery, evaluator) share: the run's state, which
every checkpoint keeps, and the few helpers each of them needs alike (RNG snapshots, mixed precision around a
forward, an event line on rank 0)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from gptoughts.parallel import dist as pdist
from gptoughts.training.metrics import console

Batch = tuple[torch.Tensor, ...]
RngState = tuple[torch.Tensor, torch.Tensor | None]


@dataclass
class TrainState:
    step: int = 0
    """Optimizer steps applied to the current weights (goes back to the checkpoint's step on a rollback)."""
    tokens_seen: int = 0
    """Tokens of those steps (``step * tokens_per_step``)."""
    best_val_loss: float = math.inf
    evals_without_improvement: int = 0
    lr_scale: float = 1.0
    """Product of the rollbacks' learning-rate factors."""
    bad_steps: int = 0
    """Non-finite steps in a row, up to ``step``."""
    rollbacks: int = 0
    history: list[dict[str, float]] = field(default_factory=list)
    data_steps_skipped: int = 0
    """Steps' worth of batches that rollbacks jumped over: the loader has consumed ``step + data_steps_skipped``
    steps of batches."""
    loss_mean: float = 0.0
    """Running mean of the per-step training loss (spike detector)."""
    loss_var: float = 0.0
    """Running variance of the per-step training loss (spike detector)."""
    loss_count: int = 0
    """Steps fed into the running statistics."""
    phase: str | None = None
    """The curriculum phase of the last batch drawn (None: none drawn yet): a resumed run tells the phase it goes on
    in from one it begins, whatever batch size it resumes at (the loader only knows where it is)."""

    def load(self, saved: dict[str, Any]) -> None:
        """Become the state ``saved`` (a checkpoint's ``trainer`` entry; fields it lacks take their defaults), in
        place: the loop and its components hold this one object."""
        known = {f.name for f in fields(TrainState)}
        new = TrainState(**{k: v for k, v in saved.items() if k in known})
        for f in fields(TrainState):
            setattr(self, f.name, getattr(new, f.name))


def rng_state(device: torch.device) -> RngState:
    # Host copies: the CUDA generator's state is its seed and offset, kept on the host (no sync).
    return (
        torch.get_rng_state(),
        torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
    )


def set_rng_state(rng: RngState | None, device: torch.device) -> None:
    if rng is None:
        return
    torch.set_rng_state(rng[0])
    if rng[1] is not None:
        torch.cuda.set_rng_state(rng[1], device)


def autocast(
    device: torch.device,
    precision: str,
    forward_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> contextlib.AbstractContextManager:
    """Mixed precision (and the SDPA backend choice of ``forward_context``) around forward passes."""
    stack = contextlib.ExitStack()
    if precision in ("bf16", "fp16"):
        dtype = torch.bfloat16 if precision == "bf16" else torch.float16
        stack.enter_context(torch.autocast(device.type, dtype=dtype))
    stack.enter_context(forward_context())
    return stack


def log_line(text: str, dist: pdist.DistInfo) -> None:
    """An event line on rank 0, printed whether or not a progress bar shows (rich prints it above a live bar):
    rollbacks, spikes and skipped steps must not vanish with --no_progress."""
    if dist.is_main:
        console.print(text, highlight=False, soft_wrap=True)
