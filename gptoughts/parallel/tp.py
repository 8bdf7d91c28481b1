"""Tensor parallelism (+ sequence parallelism) of the native families, with DTensor ``parallelize_module``.

``--parallel.tp N`` splits each transformer block over the ``N`` ranks of the mesh's ``tp`` dimension
(Megatron-style): the projections that open a sub-layer are split by output features (``ColwiseParallel``:
attention ``wq``/``wk``/``wv`` by heads, the MLP's up/gate projections by hidden units), the projections that
close it by input features (``RowwiseParallel``: ``wo``, the MLP's down projection), so each sub-layer costs one
collective forward and one backward. Attention then sees its rank's heads only: the model code infers head
counts from the tensors (``view(..., -1, head_dim)``), so it runs unchanged.

Sequence parallelism: between sub-layers the residual stream is split along the sequence (each rank holds
``T / N`` positions, a plain local tensor), the norms run on their rank's positions (``SequenceParallel``: their
weights become replicated DTensors whose gradients are summed over the group), and the sub-layer's input is
all-gathered just before its first projection, its output reduce-scattered by the last one. Activation memory of
the norms and the residual stream is divided by ``N``. Entering the first block the (replicated) embedding output
is cut along the sequence (no communication); leaving the last block it is all-gathered.

What stays replicated (every rank of a group holds and computes it whole, with identical gradients): the token
embedding, the final norm and the LM head. The head's matmul is therefore not split (a vocabulary-parallel head
with a parallel loss is what remains to gain at large vocabularies), and the training losses, sampling and
evaluation code see plain tensors.

Where it applies: the Llama layout (Llama, Mistral and Qwen configs: GQA, q/k norms, biases, sliding windows,
ReLU² MLPs), LLaDA (the same blocks, bidirectional) and INL (whose integrator runs on its rank's positions with
replicated weights). :func:`check_tp` refuses, in one line and before anything is written, what it does not
cover: DeepSeek (MoE and MLA), GPT-2 (one fused q/k/v matrix), generic transformers models and LoRA, head counts
or widths that ``N`` does not divide, and a sequence length it does not divide.

Order (``train/setup.py``): after fp8 conversion, before activation checkpointing, compile and FSDP (which then
shards each block's DTensors over the ``dp`` dimension: a 2-D ``(dp, tp)`` layout).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from gptoughts.errors import ConfigError

# The families whose blocks have a plan here (family name -> the block's attention / MLP layout).
SUPPORTED = ("llama", "llada", "inl")

_WHY_NOT = {
    "deepseek": "DeepSeek's MoE experts and latent attention (MLA) have no tensor-parallel plan; use FSDP",
    "gpt2": "GPT-2's fused q/k/v projection (c_attn) does not split by heads; use FSDP",
}


def check_family(family: str | None, tp: int, *, generic: bool = False, lora: bool = False) -> None:
    """The refusals that need only the family (run before the data is prepared): one-line ConfigErrors."""
    if tp <= 1:
        return
    where = f"--parallel.tp {tp}"
    if generic:
        raise ConfigError(f"{where}: a generic transformers model has no tensor-parallel plan; use FSDP")
    if lora:
        raise ConfigError(f"{where}: LoRA adapters are not tensor-parallel; drop --lora or --parallel.tp")
    if family in _WHY_NOT:
        raise ConfigError(f"{where}: {_WHY_NOT[family]}")
    if family not in SUPPORTED:
        raise ConfigError(
            f"{where}: the {family} family has no tensor-parallel plan (supported: {', '.join(SUPPORTED)})"
        )


def check_tp(
    family: str | None, args: Any, tp: int, *, block_size: int, generic: bool = False, lora: bool = False
) -> None:
    """Refuse, with a one-line ConfigError, a model that ``tp``-way tensor parallelism cannot split: the family
    (:func:`check_family`), then head counts, MLP width and sequence length that ``tp`` must divide."""
    if tp <= 1:
        return
    check_family(family, tp, generic=generic, lora=lora)
    where = f"--parallel.tp {tp}"
    sizes = {"model.n_heads": args.n_heads, "the key/value heads": args.kv_heads}
    if family == "inl":
        sizes["the FFN width"] = args.ffn
    else:
        sizes["the MLP width"] = args.ffn_hidden
    for name, n in sizes.items():
        if n % tp:
            raise ConfigError(f"{where}: {name} ({n}) is not divisible by {tp}")
    if block_size % tp:
        raise ConfigError(
            f"{where}: --block_size {block_size} is not divisible by {tp} (sequence parallelism splits it)"
        )


def apply_tp(model: nn.Module, mesh: Any, family: str) -> None:
    """Parallelize ``model``'s blocks in place over the 1-D ``mesh`` (the ``tp`` dimension), see the module
    docstring. Parameters keep their names; block parameters become DTensors (sharded or replicated)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    if family not in SUPPORTED:  # check_tp ran before; this guards direct callers
        raise ConfigError(f"--parallel.tp: the {family} family has no tensor-parallel plan")
    blocks = list(model.layers)
    # Block arguments are (x, cos, sin, cache, doc_ids): only x changes layout; None leaves an argument alone.
    rest = (None, None, None, None)
    # Into a sub-layer: its sequence-sharded input all-gathered (local tensor out: the projections take it).
    gather_in = PrepareModuleInput(
        input_layouts=(Shard(1), *rest), desired_input_layouts=(Replicate(), *rest), use_local_output=True
    )
    mlp_in = PrepareModuleInput(
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
    )
    for block in blocks:
        plan: dict[str, Any] = {
            "attention_norm": SequenceParallel(),
            "attention": gather_in,
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": mlp_in,
        }
        if block.attention.q_norm is not None:
            # q/k norms act per head on [B, T, H, hd]: each rank holds its heads (dim 2); their shared weight's
            # gradient is summed over the group like a sequence-parallel norm's.
            plan["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
            plan["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        ff = block.feed_forward
        up = [n for n in ("w1", "w3", "fc1") if hasattr(ff, n)]
        down = next(n for n in ("w2", "fc2") if hasattr(ff, n))
        for n in up:
            plan[f"feed_forward.{n}"] = ColwiseParallel()
        plan[f"feed_forward.{down}"] = RowwiseParallel(output_layouts=Shard(1))
        if getattr(block, "integrator", None) is not None:
            # INL: a per-position refinement of the attention output; it runs on the rank's positions with
            # replicated weights (gradients summed over the group).
            plan["integrator"] = SequenceParallel(use_local_output=True)
        parallelize_module(block, mesh, plan)
    # The residual stream: cut along the sequence entering the first block, gathered entering the final norm
    # (an input hook there rather than an output hook on the last block: FSDP warns about blocks that return
    # views, which ``to_local()`` is).
    parallelize_module(
        blocks[0],
        mesh,
        PrepareModuleInput(
            input_layouts=(Replicate(), *rest), desired_input_layouts=(Shard(1), *rest), use_local_output=True
        ),
    )
    parallelize_module(
        model.final_norm,
        mesh,
        PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        ),
    )
