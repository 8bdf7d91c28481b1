"""Activation checkpointing of the model's repeated blocks.

``full``: each block keeps only its input; everything inside is recomputed in backward (~1/3 more compute,
activation memory roughly divided by the number of tensors a block saves).
``selective``: per-op policy inside each block: outputs of matmuls and attention are saved (expensive to
recompute), cheap element-wise ops (norms, activations, RoPE, residual adds) are recomputed. Saves a good
part of the memory for a few percent of compute.

The block's ``forward`` is replaced on the instance, so parameter names (and checkpoints) do not change.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

MODES = ("none", "selective", "full")

_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_mm.default,
}


def _policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(_policy)


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    if mode == "none":
        return
    if mode not in MODES:
        raise ValueError(mode)
    for block in model.layers:
        inner = block.forward
        if mode == "full":
            block.forward = functools.partial(checkpoint, inner, use_reentrant=False)
        else:
            block.forward = functools.partial(checkpoint, inner, use_reentrant=False,
                                              context_fn=_selective_context)
