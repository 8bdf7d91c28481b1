"""Activation checkpointing of the model's repeated blocks.

``full``: each block keeps only its input; everything inside is recomputed in backward (~1/3 more compute,
activation memory roughly divided by the number of tensors a block saves).
``selective``: per-op policy inside each block: outputs of matmuls and attention are saved (expensive to
recompute), cheap element-wise ops (norms, activations, RoPE, residual adds) are recomputed. Saves a good
part of the memory for a few percent of compute.

Blocks are wrapped with PyTorch's checkpoint wrapper, whose state-dict hooks keep checkpoint keys unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

if TYPE_CHECKING:
    from gptoughts.config import LoraConfig

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


# FlashAttention-4's op (perf/attention.py) is registered on first use, hence matched by its name; so are LoRA's
# matmuls (the merged one, and the one with the adapter's add: perf/lora.py) and its dropout bits
# (perf/dropout.py, 1/16 of a bf16 activation, kept rather than drawn again)
_SAVE_OP_NAMES = {
    "gptoughts.fa4_fwd.default",
    "gptoughts.merged_lora_linear.default",
    "gptoughts.linear_add_lowrank.default",
    "gptoughts.dropout_bits.default",
}


def _policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    save = op in _SAVE_OPS or str(op) in _SAVE_OP_NAMES
    return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE


_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def _draws_randomness(model: nn.Module) -> bool:
    """Blocks that may draw random numbers: an active dropout module in them (LoRA's adapter dropout), or blocks
    that are not ours (a transformers model's own code may use functional dropout); our families' draw none."""
    blocks = list(model.layers.children())
    active = any(isinstance(m, _DROPOUTS) and m.p > 0 for b in blocks for m in b.modules())
    return active or any(not type(b).__module__.startswith("gptoughts.") for b in blocks)


# Ops that selective checkpointing runs without counting them for its replay. FSDP2's hooks open profiler ranges
# (record_function ops), and where an FSDP2 unit sits inside a checkpointed block (expert parallelism's experts,
# parallel/ep.py) its hooks run a different number of them in the recomputation than in the forward: counted, they
# shift the replay's indices and the backward fails ("... invocation index N encountered during backward but not
# found in storage"; pytorch/torchtitan#3427). They return no tensor to save, so leaving them out changes nothing.
_PROFILER_OPS = (
    torch.ops.profiler._record_function_enter.default,
    torch.ops.profiler._record_function_enter_new.default,
    torch.ops.profiler._record_function_exit.default,
    torch.ops.profiler._record_function_exit._RecordFunction,
)


def _selective_context():
    from torch.utils import checkpoint

    checkpoint.SAC_IGNORED_OPS.update(_PROFILER_OPS)  # a set: adding again is a no-op
    return create_selective_checkpoint_contexts(_policy)


def compile_recomputes_functions() -> bool:
    """Whether torch.compile's full activation checkpointing recomputes the ops inside an ``autograd.Function``.
    Before pytorch/pytorch#177396 (torch 2.11 has the fault) they got no checkpoint tags, and a compiled block kept
    what the Function saves or returns (tests/perf/test_full_checkpointing_keeps_inputs.py). Detected by the
    recompute-everything policy the fix added."""
    import importlib

    return hasattr(importlib.import_module("torch._higher_order_ops.wrap"), "_always_prefer_recompute")


def resolve(mode: str, lora: LoraConfig | None) -> tuple[str, str]:
    """What ``perf.activation_checkpointing`` becomes, and why. ``auto``: selective when training LoRA adapters on
    a base that is not quantized (their inputs are saved besides the base's activations: less memory for a
    few percent of speed, measured in ``docs/performance.md``), none otherwise (QLoRA's 4-bit matmuls are not
    saved by the selective policy: it would recompute them; pretraining's auto batch uses the memory)."""
    if mode != "auto":
        return mode, "asked"
    if lora is not None and lora.enabled and lora.quantize == "none":
        return "selective", "auto: LoRA (19% less memory for 2-5% of the speed at 1b)"
    return "none", "auto"


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """Wrap each of ``model.layers`` in a checkpoint wrapper (state-dict keys are unchanged by the wrapper)."""
    if mode == "none":
        return
    if mode not in MODES:
        raise ValueError(mode)
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    # A wrapper module (rather than swapping `forward`) is what torch.compile traces through: compiling the
    # wrapped block puts the recomputation inside the compiled graph. Its state-dict hooks strip the wrapper's
    # prefix, so checkpoints written with and without activation checkpointing are interchangeable.
    extra = {} if mode == "full" else {"context_fn": _selective_context}
    # A recomputation draws the forward's random numbers again (LoRA's dropout masks) only with the block's RNG
    # state restored (a copy of the RNG states per block and step; torch.compile replays them itself): done where
    # the blocks draw random numbers, else gradients would follow other masks than the loss.
    preserve = _draws_randomness(model)
    # By child name: ``layers`` is a ModuleList, or a pipeline stage's ModuleDict keyed by block index.
    for name, block in list(model.layers.named_children()):
        setattr(model.layers, name, checkpoint_wrapper(block, preserve_rng_state=preserve, **extra))
