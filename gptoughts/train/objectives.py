"""Training objectives: what a batch means and how its loss is computed.

An objective maps ``(model, batch)`` to ``(loss_sum, n_target_tokens)`` (both tensors on the device). The
trainer divides the sum by the number of target tokens of the whole optimizer step, over all micro-batches
and ranks, so gradient accumulation is exactly equivalent to one large batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of ``hidden @ weight.T`` against ``targets`` (IGNORE_INDEX entries skipped).

    The logits are produced in the autocast dtype and upcast inside the loss, so no fp32 copy of the
    ``[B*T, V]`` logits is kept for backward.
    """
    logits = F.linear(hidden.reshape(-1, hidden.shape[-1]), weight)
    return F.cross_entropy(logits.float(), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")


class CausalLM:
    """Next-token prediction. A batch is ``(x, y)`` or ``(x, y, position_ids)``; ``y`` may hold IGNORE_INDEX."""

    name = "causal"

    def __call__(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch[0], batch[1]
        position_ids = batch[2] if len(batch) > 2 else None
        hidden = model(x, position_ids=position_ids, return_hidden=True)
        weight = _output_weight(model)
        loss_sum = linear_cross_entropy(hidden, weight, y)
        n_tokens = (y != IGNORE_INDEX).sum()
        return loss_sum, n_tokens


def _output_weight(model: nn.Module) -> torch.Tensor:
    # DDP and torch.compile wrap the model; the weight lives on the inner module.
    inner = model
    while not hasattr(inner, "output_weight"):
        inner = getattr(inner, "module", None) or inner._orig_mod
    return inner.output_weight


OBJECTIVES = {"causal": CausalLM}


def build_objective(name: str) -> CausalLM:
    return OBJECTIVES[name]()
