"""The model registry: an explicit dict from family name to model class, args dataclass and size presets.

Nothing registers itself at import time: adding a family means adding one line to ``FAMILIES`` below.
The contract every model class obeys is in ``docs/internals.md`` (and ``tests/models/test_protocol.py``).

    args = model_args("llama", "125m", {"vocab_size": tok.vocab_size, "max_seq_len": 4096})
    model = build_model("llama", args, device="meta")   # then the transforms of training/setup.py
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gptoughts.coerce import coerce
from gptoughts.errors import ConfigError, did_you_mean
from gptoughts.models import deepseek, gpt2, llama_hf
from gptoughts.models.deepseek import DEEPSEEK_SIZES, DeepSeek, DeepSeekArgs
from gptoughts.models.gpt2 import GPT2, GPT2_SIZES, GPT2Args
from gptoughts.models.hf import HFAdapter
from gptoughts.models.inl import INL, INL_SIZES, INLArgs
from gptoughts.models.llada import LLADA_SIZES, LLaDA, LLaDAArgs
from gptoughts.models.llama import LLAMA_SIZES, Llama, LlamaArgs

__all__ = [
    "FAMILIES",
    "GENERIC_FAMILY",
    "VARIANTS",
    "Family",
    "build_model",
    "family_of",
    "get_family",
    "list_sizes",
    "model_args",
]


@dataclass(frozen=True)
class Family:
    """One model family: its class, the dataclass of its hyper-parameters and its size presets."""

    name: str
    model_cls: type[nn.Module]
    args_cls: type
    """A dataclass of the family's architecture hyper-parameters."""
    sizes: dict[str, dict[str, Any]]
    """Size name -> field overrides of ``args_cls``; ``"debug"`` always exists (tiny, runs on CPU)."""
    objective: str = "causal"
    """``"causal"`` (next-token) or ``"diffusion"`` (masked diffusion, LLaDA)."""
    hf: Any = None
    """An ``HFAdapter`` (models/hf.py) when the family imports from / exports to ``transformers``."""


def _hf(module: Any) -> HFAdapter:
    """The HF adapter a family's module defines (``HF_MODEL_TYPES, args_from_hf, hf_config, from_hf, to_hf``)."""
    return HFAdapter(
        module.HF_MODEL_TYPES, module.args_from_hf, module.hf_config, module.from_hf, module.to_hf
    )


FAMILIES: dict[str, Family] = {
    "llama": Family("llama", Llama, LlamaArgs, LLAMA_SIZES, objective="causal", hf=_hf(llama_hf)),
    "llada": Family("llada", LLaDA, LLaDAArgs, LLADA_SIZES, objective="diffusion"),
    "inl": Family("inl", INL, INLArgs, INL_SIZES, objective="causal"),
    "gpt2": Family("gpt2", GPT2, GPT2Args, GPT2_SIZES, objective="causal", hf=_hf(gpt2)),
    "deepseek": Family(
        "deepseek", DeepSeek, DeepSeekArgs, DEEPSEEK_SIZES, objective="causal", hf=_hf(deepseek)
    ),
}


# transformers architectures that are the Llama family with one switch: `--model qwen2` is a Llama with q/k/v
# biases, and so on. They train with the Llama code (its fast paths, parallelism and presets) and export to their
# own transformers class (llama_hf picks the class from the switches). Mistral's switch is the sliding window of
# Mistral 7B (a window as long as the block changes nothing: the attention skips it), without which a Mistral is a
# Llama. A switch the user sets on the command line wins over the variant's.
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "mistral": ("llama", {"sliding_window": 4096}),
    "qwen2": ("llama", {"qkv_bias": True}),
    "qwen3": ("llama", {"qk_norm": True}),
}


def resolve_variant(name: str, overrides: Mapping[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
    """(family, overrides) of a family name or a :data:`VARIANTS` name (its switches under ``overrides``)."""
    family, switches = VARIANTS.get(name, (name, {}))
    return family, {**switches, **(overrides or {})}


def _generic_family() -> Family:
    from gptoughts.models.hf_generic import HFArgs, HFCausalLM

    return Family("hf", HFCausalLM, HFArgs, {}, objective="causal")


# "A transformers model without native code" where the pipeline expects a Family (objective, name); not in
# FAMILIES: it cannot be built from args, only loaded from a folder (models/hf.py).
GENERIC_FAMILY = _generic_family()


def family_of(name: str | None) -> Family:
    """The registered family ``name``, or :data:`GENERIC_FAMILY` for None / "hf" (a generic transformers model)."""
    return FAMILIES[name] if name in FAMILIES else GENERIC_FAMILY


def get_family(name: str | Family) -> Family:
    """The registered family called ``name`` (a ``Family`` is returned as is; a :data:`VARIANTS` name gives the
    family it is a variant of)."""
    if isinstance(name, Family):
        return name
    try:
        return FAMILIES[resolve_variant(name)[0]]
    except (KeyError, TypeError):
        raise ConfigError(
            f"unknown model family {name!r}{did_you_mean(str(name), [*FAMILIES, *VARIANTS])}"
        ) from None


def list_sizes(family: str | Family) -> list[str]:
    """The size presets of ``family``, in definition order (smallest first)."""
    return list(get_family(family).sizes)


def model_args(family: str | Family, size: str, overrides: Mapping[str, Any] | None = None) -> Any:
    """The args dataclass of ``family`` at preset ``size``, then ``overrides`` applied field by field.

    Unknown sizes and fields raise ``ConfigError`` naming the closest valid one; a value of the wrong type
    raises ``ConfigError`` naming the field and the expected type. Ints are accepted for float fields (TOML
    writes ``rope_theta = 500000``); strings from the command line are converted. The dataclass's own ``__post_init__`` then checks consistency.
    A :data:`VARIANTS` name gives its family's args with the variant's switches (under ``overrides``).
    """
    if isinstance(family, str):
        family, overrides = resolve_variant(family, overrides)
    fam = get_family(family)
    key = size.lower() if isinstance(size, str) else size
    if key not in fam.sizes:
        raise ConfigError(
            f"unknown size {size!r} for model family {fam.name!r}{did_you_mean(str(size), fam.sizes)}"
        )
    fields = {f.name: f for f in dataclasses.fields(fam.args_cls) if f.init}
    hints = typing.get_type_hints(fam.args_cls)
    values: dict[str, Any] = {}
    for source in (fam.sizes[key], overrides or {}):
        for name, value in source.items():
            if name not in fields:
                raise ConfigError(
                    f"unknown field `{name}` for model family {fam.name!r}{did_you_mean(str(name), fields)}"
                )
            # The config's one type checker, strict: command-line strings are converted by config.validate.
            values[name] = coerce(value, hints[name], f"model field `{name}`", text=False)
    return fam.args_cls(**values)


def build_model(family: str | Family, args: Any, device: torch.device | str | None = None) -> nn.Module:
    """Build ``family``'s model from ``args`` on ``device`` (default: torch's default device).

    The modules are always created on ``meta`` first (no memory, no wasted default init), then, unless
    ``device`` is ``meta``, materialised with ``to_empty`` and initialised by ``init_weights()`` from the
    current torch RNG. A ``meta`` model must go through ``to_empty`` + ``init_weights()`` before use, even
    when a checkpoint is loaded afterwards (RoPE tables are non-persistent buffers).
    """
    fam = get_family(family)
    if not isinstance(args, fam.args_cls):
        raise TypeError(f"family {fam.name!r} expects {fam.args_cls.__name__}, got {type(args).__name__}")
    device = torch.device(device) if device is not None else torch.get_default_device()
    with torch.device("meta"):
        model = fam.model_cls(args)
    if device.type == "meta":
        return model
    model.to_empty(device=device)
    model.init_weights()
    return model


def hidden_matrices(model: nn.Module) -> set[int]:
    """ids of the parameters Muon trains: every trainable parameter of two or more dimensions (the blocks'
    projections, MoE experts, MLA's low-rank factors, INL's integrator matrices, a router) except embeddings
    and the output head (a linear layer onto the vocabulary; tied heads are the embedding)."""
    embedding = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    head = getattr(model, "output_weight", None)  # our families' protocol
    if head is None and hasattr(model, "get_output_embeddings"):  # a transformers model
        out = model.get_output_embeddings()
        head = None if out is None else out.weight
    if head is None:  # anything else: the linear layer onto the largest embedding table (the vocabulary)
        vocab = max((m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)), default=None)
        head = next(
            (m.weight for m in model.modules() if isinstance(m, nn.Linear) and m.out_features == vocab), None
        )
    embedding.add(id(head))
    return {id(p) for p in model.parameters() if p.requires_grad and p.ndim >= 2 and id(p) not in embedding}
