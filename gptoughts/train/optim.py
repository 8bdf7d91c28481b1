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


def build_adamw(model: nn.Module, *, lr: float, weight_decay: float, betas: tuple[float, float], eps: float,
                fused: bool) -> torch.optim.AdamW:
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
