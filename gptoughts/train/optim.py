"""AdamW with the usual parameter groups, and learning-rate schedules as pure functions of the step.

The schedule has no state of its own: the learning rate of step ``s`` is ``lr_at(s)``, so resuming only needs
the step counter (exact resume for free).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay only matrices of linear layers: never norms, biases or embeddings."""
    decay, no_decay = [], []
    embedding_params = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for _name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim < 2 or id(p) in embedding_params:
            no_decay.append(p)
        else:
            decay.append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_adamw(
    model: nn.Module, *, lr: float, weight_decay: float, betas: tuple[float, float], eps: float, fused: bool
) -> torch.optim.AdamW:
    # The fused CUDA kernel updates all parameters in a few launches instead of one chain of kernels per tensor;
    # foreach (the default elsewhere) batches them at the Python level.
    kwargs = {"fused": True} if fused else {"foreach": True}
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=betas, eps=eps, **kwargs)


@dataclass(frozen=True)
class Schedule:
    kind: str
    peak_lr: float
    total_steps: int
    warmup_steps: int
    min_lr_ratio: float = 0.1
    decay_fraction: float = 0.2

    def lr_at(self, step: int) -> float:
        """Learning rate for optimizer step ``step`` (0-based)."""
        min_lr = self.peak_lr * self.min_lr_ratio
        if self.warmup_steps > 0 and step < self.warmup_steps:
            return self.peak_lr * (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return self.peak_lr
        if self.kind == "cosine":
            span = max(1, self.total_steps - self.warmup_steps)
            progress = min(1.0, (step - self.warmup_steps) / span)
            return min_lr + 0.5 * (self.peak_lr - min_lr) * (1.0 + math.cos(math.pi * progress))
        if self.kind == "wsd":
            decay_steps = max(1, int(round(self.total_steps * self.decay_fraction)))
            decay_start = self.total_steps - decay_steps
            if step < decay_start:
                return self.peak_lr
            progress = min(1.0, (step - decay_start) / decay_steps)
            return self.peak_lr + (min_lr - self.peak_lr) * progress
        raise ValueError(f"unknown schedule {self.kind}")


def default_warmup(total_steps: int) -> int:
    return max(1, min(2000, int(0.02 * total_steps)))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for g in optimizer.param_groups:
        g["lr"] = lr


def clip_and_step(
    optimizer: torch.optim.Optimizer,
    params: list[torch.Tensor],
    max_norm: float,
    loss_sum: torch.Tensor,
    *,
    fused: bool,
    scaler: object | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clip the gradients to ``max_norm`` (global L2 norm) and step, skipping a non-finite step, with no host sync
    on the fused path. Returns ``(grad_norm before clipping, found_inf)`` as device tensors.

    With a fused AdamW (and no loss scaler), clipping is folded into the optimizer kernel: it divides every
    gradient by ``grad_scale = max(1, norm / max_norm)`` as it reads it, instead of a separate read-and-write
    pass over all gradients (``clip_grad_norm_``'s ``_foreach_mul_``), and it reads ``found_inf`` on the device
    to leave parameters and state untouched when the step is not finite.
    """
    if fused and scaler is None:
        grads = [p.grad for p in params if p.grad is not None]
        grad_norm = _full(torch.nn.utils.get_total_norm(grads, foreach=True))
        found_inf = (~torch.isfinite(grad_norm) | ~torch.isfinite(loss_sum)).float()
        optimizer.grad_scale = (
            ((grad_norm + 1e-6) / max_norm).clamp(min=1.0) if math.isfinite(max_norm) else None
        )
        optimizer.found_inf = found_inf
        optimizer.step()
        return grad_norm, found_inf
    if scaler is not None:
        scaler.unscale_(optimizer)  # type: ignore[attr-defined]
    grad_norm = _full(torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True))
    found_inf = (~torch.isfinite(grad_norm) | ~torch.isfinite(loss_sum)).float()
    if scaler is not None:
        scaler.step(optimizer)  # type: ignore[attr-defined]  # skips on overflow; fused optimizers skip without a sync
        scaler.update()  # type: ignore[attr-defined]
    elif fused:
        optimizer.found_inf = found_inf
        optimizer.step()
    elif found_inf.item() == 0:  # free on CPU; a sync on CUDA only when fused AdamW is turned off
        optimizer.step()
    return grad_norm, found_inf


def _full(norm: torch.Tensor) -> torch.Tensor:
    """The global norm as a plain tensor: with sharded (FSDP, DTensor) gradients it is a partial DTensor, and
    ``full_tensor()`` sums the ranks' parts."""
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
