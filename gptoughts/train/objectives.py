"""Training objectives: what a batch means and how its loss is computed.

An objective maps ``(model, batch)`` to ``(loss_sum, n_target_tokens)`` (both tensors on the device). The
trainer divides the sum by the number of target tokens of the whole optimizer step, over all micro-batches
and ranks, so gradient accumulation is exactly equivalent to one large batch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from gptoughts.perf.ce import IGNORE_INDEX, plain_linear_ce

LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class CausalLM:
    """Next-token prediction. A batch is ``(x, y)`` or ``(x, y, position_ids)``; ``y`` may hold IGNORE_INDEX."""

    name = "causal"

    def __init__(self, loss_fn: LossFn = plain_linear_ce):
        self.loss_fn = loss_fn

    def __call__(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch[0], batch[1]
        position_ids = batch[2] if len(batch) > 2 else None
        hidden = model(x, position_ids=position_ids, return_hidden=True)
        weight = _output_weight(model)
        loss_sum = self.loss_fn(hidden, weight, y)
        inner = _inner(model)
        if hasattr(inner, "extra_loss"):  # MoE balance, multi-token prediction: already summed over tokens
            extra = inner.extra_loss(y, self.loss_fn)
            if extra is not None:
                loss_sum = loss_sum + extra
        n_tokens = (y != IGNORE_INDEX).sum()
        return loss_sum, n_tokens


def _inner(model: nn.Module) -> nn.Module:
    # DDP and torch.compile wrap the model; the protocol members live on the inner module.
    inner = model
    while not hasattr(inner, "output_weight"):
        inner = getattr(inner, "module", None) or inner._orig_mod
    return inner


def _output_weight(model: nn.Module) -> torch.Tensor:
    return _inner(model).output_weight


OBJECTIVES = {"causal": CausalLM}


def build_objective(name: str, loss_fn: LossFn = plain_linear_ce) -> CausalLM:
    return OBJECTIVES[name](loss_fn)
