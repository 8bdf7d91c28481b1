"""Tensor parallelism (+ sequence parallelism) of the native families, with DTensor ``parallelize_module``.

``--parallel.tp N`` splits each block over the ``N`` ranks of the mesh's ``tp`` dimension, Megatron-style:
the projections opening a sub-layer by output features (``ColwiseParallel``: ``wq``/``wk``/``wv`` by heads,
the MLP's up/gate), those closing it by input features (``RowwiseParallel``: ``wo``, the MLP's down), so a
sub-layer costs one collective forward and one backward; attention infers its head count from the tensors and
runs unchanged. Between sub-layers the residual stream and the norms are split along the sequence
(``SequenceParallel``; uneven when ``N`` does not divide it). The embedding, final norm and LM head stay
replicated.

Covers :data:`SUPPORTED` (the Llama layout, LLaDA, INL); :func:`check_tp` refuses the rest in one line.
Applied in ``training/setup.py`` after fp8, before activation checkpointing, compile and FSDP (2-D ``(dp, tp)``
parameters). The whole design: ``docs/parallel.md``.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from torch import nn

from gptoughts.errors import ConfigError
from gptoughts.models.layers import KVCache

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


def check_tp(family: str | None, args: Any, tp: int, *, generic: bool = False, lora: bool = False) -> None:
    """Refuse, with a one-line ConfigError, a model that ``tp``-way tensor parallelism cannot split: the family
    (:func:`check_family`), then head counts and MLP width that ``tp`` must divide (the sequence length need not
    be divisible: the sequence-parallel split is uneven then)."""
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


def apply_tp(model: nn.Module, mesh: Any, family: str) -> None:
    """Parallelize ``model``'s blocks in place over the 1-D ``mesh`` (the ``tp`` dimension), see the module
    docstring and ``docs/parallel.md``. Parameters keep their names; block parameters become DTensors (sharded
    or replicated)."""
    from torch.distributed.tensor.parallel import parallelize_module

    if family not in SUPPORTED:  # check_tp ran before; this guards direct callers
        raise ConfigError(f"--parallel.tp: the {family} family has no tensor-parallel plan")
    blocks = list(model.layers)
    for block in blocks:
        parallelize_module(block, mesh, _block_plan(block))
        block.attention.wo.register_forward_hook(_local_if_even)
        getattr(block.feed_forward, _mlp_names(block.feed_forward)[1]).register_forward_hook(_local_if_even)
        if getattr(block, "integrator", None) is not None:
            _replicate_integrator(block.integrator, mesh)
    _split_residual_stream(model, blocks[0], mesh)
    # Decoding: each rank caches the keys and values of its own heads (the model's cache is sized for all).
    if hasattr(model, "make_cache"):
        model.make_cache = partial(_local_cache, model.args, mesh.size())


# Block arguments are (x, cos, sin, cache, doc_ids): only x changes layout; None leaves an argument alone.
_REST = (None, None, None, None)


def _mlp_names(ff: nn.Module) -> tuple[list[str], str]:
    """The MLP's projections opening it (w1/w3, or fc1) and the one closing it (w2, or fc2)."""
    return [n for n in ("w1", "w3", "fc1") if hasattr(ff, n)], next(
        n for n in ("w2", "fc2") if hasattr(ff, n)
    )


def _block_plan(block: nn.Module) -> dict[str, Any]:
    """One block's ``parallelize_module`` plan: norms sequence-parallel, projections opening a sub-layer split by
    output features, those closing it by input features (their output cut along the sequence again)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    # Into a sub-layer: its sequence-sharded input all-gathered (local tensor out: the projections take it).
    gather_in = PrepareModuleInput(
        input_layouts=(Shard(1), *_REST), desired_input_layouts=(Replicate(), *_REST), use_local_output=True
    )
    mlp_in = PrepareModuleInput(
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
    )
    plan: dict[str, Any] = {
        "attention_norm": SequenceParallel(),
        "attention": gather_in,
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "ffn_norm": SequenceParallel(),
        "feed_forward": mlp_in,
    }
    if block.attention.q_norm is not None:
        # q/k norms act per head on [B, T, H, hd]: each rank holds its heads (dim 2); their shared weight's
        # gradient is summed over the group like a sequence-parallel norm's.
        plan["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    up, down = _mlp_names(block.feed_forward)
    for n in up:
        plan[f"feed_forward.{n}"] = ColwiseParallel()
    plan[f"feed_forward.{down}"] = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
    return plan


def _replicate_integrator(integrator: nn.Module, mesh: Any) -> None:
    """INL: a per-position refinement of the attention output with small replicated weights. It runs on the whole
    (gathered) sequence on every rank of the group, then each keeps its positions: its weights and their gradients
    stay plain tensors, identical on every rank. (Run on the rank's positions only, its weights would need DTensor
    matmuls over an uneven sequence split.) The integrator's activations are therefore not divided by the group
    size."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, PrepareModuleOutput, parallelize_module

    parallelize_module(
        integrator,
        mesh,
        PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        ),
    )
    parallelize_module(
        integrator,
        mesh,
        PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=False
        ),
    )
    integrator.register_forward_hook(_local_if_even)


def _split_residual_stream(model: nn.Module, first: nn.Module, mesh: Any) -> None:
    """The residual stream: cut along the sequence entering the first block, gathered into a plain tensor entering
    the final norm (see _local_if_even for its type in between)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, parallelize_module

    parallelize_module(
        first,
        mesh,
        PrepareModuleInput(
            input_layouts=(Replicate(), *_REST),
            desired_input_layouts=(Shard(1), *_REST),
            use_local_output=False,
        ),
    )
    first.register_forward_pre_hook(_first_input_local_if_even)
    parallelize_module(
        model.final_norm,
        mesh,
        PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        ),
    )


def _local_if_even(module: nn.Module, args: Any, out: Any) -> Any:
    """The residual stream's type between blocks: this rank's positions as a plain tensor when the group size
    divides the sequence (training: the path torch.compile and activation checkpointing handle, as in
    torchtitan), else a DTensor sharded on dim 1 that knows its global length (an uneven split: decoding one
    token, prompts of any length, a --block_size the group size does not divide; run eagerly). Every producer
    of the stream applies the same rule, so the residual additions never mix the two."""
    return out.to_local() if out.shape[1] % out.device_mesh.size() == 0 else out


def _first_input_local_if_even(module: nn.Module, args: tuple) -> tuple:
    return (_local_if_even(module, args, args[0]), *args[1:])


def _local_cache(args: Any, tp: int, batch_size: int, max_len: int, device: Any, dtype: Any) -> KVCache:
    return KVCache(
        args.n_layers, batch_size, args.kv_heads // tp, max_len, args.hd, device=device, dtype=dtype
    )
