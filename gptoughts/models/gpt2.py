"""GPT-2 (Radford et al., 2019): learned absolute positions, pre-LayerNorm blocks with biases, tanh-GELU MLP
4·d wide, tied LM head, no dropout. Weights import from / export to ``transformers.GPT2LMHeadModel``.

The size presets keep GPT-2's vocab of 50257 so that OpenAI's checkpoints load as they are; a run sets
``vocab_size`` from its tokenizer. Sizes, parameter counts and why no dropout: ``docs/models.md``.

Module names follow Hugging Face, with ``transformer.h`` as ``layers`` (the protocol's name for the
repeated blocks). HF's ``Conv1D`` stores weights as ``[in, out]``; ours are ``nn.Linear`` ``[out, in]``, so
the four matrices of each block are transposed on import and export:

| ours | transformers (``GPT2LMHeadModel``) |
| --- | --- |
| ``wte``, ``wpe`` | ``transformer.wte``, ``transformer.wpe`` |
| ``layers.{i}.ln_1``, ``layers.{i}.ln_2`` | ``transformer.h.{i}.ln_1``, ``transformer.h.{i}.ln_2`` |
| ``layers.{i}.attn.c_attn`` (q, k, v stacked) | ``transformer.h.{i}.attn.c_attn`` (transposed) |
| ``layers.{i}.attn.c_proj`` | ``transformer.h.{i}.attn.c_proj`` (transposed) |
| ``layers.{i}.mlp.c_fc``, ``layers.{i}.mlp.c_proj`` | ``transformer.h.{i}.mlp.c_fc``, ``.c_proj`` (transposed) |
| ``ln_f`` | ``transformer.ln_f`` |
| (tied: none) | ``lm_head`` (tied to ``wte``; not written, as ``save_pretrained`` does) |
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gptoughts.errors import ConfigError
from gptoughts.models.base import DecoderLM
from gptoughts.models.hf import UnsupportedHFConfig
from gptoughts.models.layers import KVCache, sdpa

HF_MODEL_TYPES = ("gpt2",)


@dataclass
class GPT2Args:
    """Architecture hyper-parameters of a GPT-2 model (build one with ``models.model_args``)."""

    d_model: int = 768
    """Width of the residual stream (HF ``n_embd``)."""
    n_layers: int = 12
    """Number of blocks (HF ``n_layer``)."""
    n_heads: int = 12
    """Attention heads (HF ``n_head``); must divide ``d_model``."""
    ffn_dim: int | None = None
    """Hidden width of the MLP (HF ``n_inner``); None means ``4 * d_model``."""
    vocab_size: int = 50257
    """Embedding rows and logits; normally set from the tokenizer."""
    max_seq_len: int = 1024
    """Rows of the learned position table (HF ``n_positions``): the longest sequence the model accepts."""
    norm_eps: float = 1e-5
    """Epsilon of every LayerNorm (HF ``layer_norm_epsilon``)."""
    gelu_approximate: str = "tanh"
    """``"tanh"`` (GPT-2's ``gelu_new``) or ``"none"`` (exact erf GELU, HF ``"gelu"``)."""
    init_std: float = 0.02
    """Std of the normal init (HF ``initializer_range``); ``c_proj`` weights get ``init_std / sqrt(2 n_layers)``."""

    def __post_init__(self) -> None:
        for name in ("d_model", "n_layers", "n_heads", "vocab_size", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model.{name} must be positive, got {getattr(self, name)}")
        if self.ffn_dim is not None and self.ffn_dim <= 0:
            raise ConfigError(f"model.ffn_dim must be positive, got {self.ffn_dim}")
        if self.d_model % self.n_heads:
            raise ConfigError(
                f"model.d_model ({self.d_model}) must be divisible by model.n_heads ({self.n_heads})"
            )
        if self.gelu_approximate not in ("tanh", "none"):
            raise ConfigError(
                f"model.gelu_approximate must be 'tanh' or 'none', got {self.gelu_approximate!r}"
            )

    @property
    def hd(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_heads

    @property
    def ffn(self) -> int:
        return 4 * self.d_model if self.ffn_dim is None else self.ffn_dim


GPT2_SIZES: dict[str, dict[str, Any]] = {
    "debug": dict(d_model=64, n_layers=2, n_heads=4, vocab_size=512, max_seq_len=256),
    "small": dict(d_model=768, n_layers=12, n_heads=12),
    "medium": dict(d_model=1024, n_layers=24, n_heads=16),
    "large": dict(d_model=1280, n_layers=36, n_heads=20),
    "xl": dict(d_model=1600, n_layers=48, n_heads=25),
}


class GPT2Attention(nn.Module):
    """Causal multi-head attention with one fused q/k/v projection (HF's ``c_attn`` layout) through SDPA."""

    def __init__(self, dim: int, n_heads: int, layer_idx: int) -> None:
        super().__init__()
        self.head_dim = dim // n_heads
        self.layer_idx = layer_idx
        # One [3d, d] matmul instead of three: a single larger GEMM, and the HF layout maps by a transpose.
        self.c_attn = nn.Linear(dim, 3 * dim, bias=True)
        self.c_proj = nn.Linear(dim, dim, bias=True)

    def forward(
        self, x: torch.Tensor, cache: KVCache | None = None, doc_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        # [B, T, 3, H, hd]: rows of c_attn are [q | k | v], each head-major, as in HF. Heads inferred (-1).
        q, k, v = self.c_attn(x).view(bsz, seqlen, 3, -1, self.head_dim).unbind(2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)
        out = sdpa(q, k, v, causal=True, doc_ids=doc_ids)
        return self.c_proj(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class GPT2MLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, approximate: str) -> None:
        super().__init__()
        self.c_fc = nn.Linear(dim, hidden_dim, bias=True)
        self.c_proj = nn.Linear(hidden_dim, dim, bias=True)
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate=self.approximate))


class GPT2Block(nn.Module):
    """Pre-LayerNorm block; the unit of activation checkpointing, per-block compile and FSDP sharding."""

    def __init__(self, args: GPT2Args, layer_idx: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(args.d_model, eps=args.norm_eps)
        self.attn = GPT2Attention(args.d_model, args.n_heads, layer_idx)
        self.ln_2 = nn.LayerNorm(args.d_model, eps=args.norm_eps)
        self.mlp = GPT2MLP(args.d_model, args.ffn, args.gelu_approximate)

    @torch.no_grad()
    def reset_parameters(self, std: float, out_std: float) -> None:
        for ln in (self.ln_1, self.ln_2):
            ln.reset_parameters()
        for lin, s in (
            (self.attn.c_attn, std),
            (self.attn.c_proj, out_std),
            (self.mlp.c_fc, std),
            (self.mlp.c_proj, out_std),
        ):
            nn.init.normal_(lin.weight, mean=0.0, std=s)
            nn.init.zeros_(lin.bias)

    def forward(
        self, x: torch.Tensor, cache: KVCache | None = None, doc_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cache, doc_ids)
        return x + self.mlp(self.ln_2(x))


class GPT2(DecoderLM):
    """GPT-2 implementing the model protocol of ``docs/internals.md`` (tied LM head), with ``DecoderLM``'s
    ``forward``, ``init_weights``, ``flops_per_token`` and ``new_cache``.
    """

    def __init__(self, args: GPT2Args) -> None:
        super().__init__(args)
        self.wte = nn.Embedding(args.vocab_size, args.d_model)
        self.wpe = nn.Embedding(args.max_seq_len, args.d_model)
        self.layers = nn.ModuleList(GPT2Block(args, i) for i in range(args.n_layers))
        self.ln_f = nn.LayerNorm(args.d_model, eps=args.norm_eps)
        self.output = None  # tied: the LM head is ``wte``

    @property
    def token_embedding(self) -> nn.Embedding:
        return self.wte

    @property
    def final_norm(self) -> nn.Module:
        return self.ln_f

    def init_inputs(self, std: float) -> None:
        """Normal(0, init_std) for both tables, as OpenAI / HF GPT-2 (whose blocks then get ``init_std`` for
        ``c_attn``/``c_fc``, ``init_std / sqrt(2 n_layers)`` for ``c_proj``, biases 0, LayerNorms (1, 0))."""
        nn.init.normal_(self.wte.weight, mean=0.0, std=std)
        nn.init.normal_(self.wpe.weight, mean=0.0, std=std)

    def trunk(
        self,
        input_ids: torch.Tensor,
        start: int,
        position_ids: torch.Tensor | None,
        cache: KVCache | None,
        doc_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        """Token plus learned position embeddings, then the blocks. ``position_ids [B, T]`` index the position
        table directly (out-of-range ids are not checked: a check would sync with the device; the embedding
        lookup fails on them instead)."""
        if position_ids is None:
            pos = self.wpe.weight[start : start + input_ids.size(1)]  # a slice, not a gather
        else:
            pos = self.wpe(position_ids)
        h = self.wte(input_ids) + pos
        for layer in self.layers:
            h = layer(h, cache, doc_ids)
        return h

    def num_params(self, non_embedding: bool = False) -> int:
        """Number of parameters (the tied matrix once). ``non_embedding=True`` excludes both lookup tables,
        ``wte`` and ``wpe`` (GPT-2's and nanoGPT's convention; ``flops_per_token`` adds the head matmul back)."""
        n = super().num_params(non_embedding)
        return n - self.wpe.weight.numel() if non_embedding else n


# ------------------------------------------------------------------------------------- Hugging Face interop

_GELU = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none"}
# HF Conv1D matrices ([in, out]); every other tensor keeps its layout.
_CONV1D = re.compile(r"\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight$")
# Buffers that old checkpoints (OpenAI's `gpt2` on the Hub) carry: the causal mask and its fill value.
_HF_BUFFERS = re.compile(r"\.attn\.(bias|masked_bias)$")


def args_from_hf(config: dict) -> GPT2Args:
    """``GPT2Args`` from a GPT-2 ``config.json`` (as a dict).

    Variants this code would not reproduce exactly raise ``UnsupportedHFConfig``: the loader of
    ``models/hf.py`` then runs the checkpoint through the generic ``transformers`` wrapper instead.
    """
    act = config.get("activation_function", "gelu_new")
    if act not in _GELU:
        raise UnsupportedHFConfig(f"activation_function {act!r}")
    unsupported = {
        "scale_attn_by_inverse_layer_idx": True,
        "scale_attn_weights": False,
        "add_cross_attention": True,
        "tie_word_embeddings": False,
    }
    for key, bad in unsupported.items():
        if key in config and config[key] == bad:
            raise UnsupportedHFConfig(f"{key}={bad}")
    return GPT2Args(
        d_model=config.get("n_embd", config.get("hidden_size", 768)),
        n_layers=config.get("n_layer", config.get("num_hidden_layers", 12)),
        n_heads=config.get("n_head", config.get("num_attention_heads", 12)),
        ffn_dim=config.get("n_inner"),
        vocab_size=config.get("vocab_size", 50257),
        max_seq_len=config.get("n_positions", config.get("max_position_embeddings", 1024)),
        norm_eps=float(config.get("layer_norm_epsilon", 1e-5)),
        gelu_approximate=_GELU[act],
        init_std=float(config.get("initializer_range", 0.02)),
    )


def hf_config(args: GPT2Args, base: dict[str, Any] | None = None) -> dict:
    """The ``config.json`` of ``GPT2LMHeadModel`` for ``args``.

    ``base`` (the config of the GPT-2 checkpoint a run started from) is kept for every key not set here
    (e.g. ``task_specific_params``). Dropouts are 0 (the model was trained without). Token ids are None
    unless ``base`` has them: ``GPT2Config`` would otherwise default them to 50256, GPT-2's own
    ``<|endoftext|>``; ``models.hf_export.save_hf`` sets them from the run's tokenizer.
    """
    cfg = dict(base) if base and base.get("model_type") == "gpt2" else {}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        cfg.setdefault(key, None)
    return cfg | {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": args.vocab_size,
        "n_positions": args.max_seq_len,
        "n_embd": args.d_model,
        "n_layer": args.n_layers,
        "n_head": args.n_heads,
        "n_inner": args.ffn_dim,
        "activation_function": "gelu_new" if args.gelu_approximate == "tanh" else "gelu",
        "layer_norm_epsilon": args.norm_eps,
        "initializer_range": args.init_std,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True,
        "use_cache": True,
    }


def from_hf(state_dict: dict[str, torch.Tensor], args: GPT2Args) -> dict[str, torch.Tensor]:
    """HF GPT-2 tensors (``GPT2LMHeadModel`` or bare ``GPT2Model`` names) -> our state dict.

    ``lm_head.weight`` is dropped (tied; a checkpoint whose head differs from ``wte`` is refused, since we
    cannot represent it), as are the mask buffers of old checkpoints. Unknown names raise ``ValueError``
    rather than being dropped silently.
    """
    out: dict[str, torch.Tensor] = {}
    head = None
    for name, tensor in state_dict.items():
        if name == "lm_head.weight":
            head = tensor
            continue
        key = name.removeprefix("transformer.")
        if _HF_BUFFERS.search(key):
            continue
        if key.startswith("h."):
            key = "layers." + key[2:]
        elif key.split(".")[0] not in ("wte", "wpe", "ln_f"):
            raise ValueError(f"unexpected tensor {name!r} in a GPT-2 checkpoint")
        if _CONV1D.search(key):
            tensor = tensor.t().contiguous()
        out[key] = tensor
    if head is not None and "wte.weight" in out and not torch.equal(head, out["wte.weight"]):
        raise ValueError("this GPT-2 checkpoint has an untied lm_head; only tied heads are supported")
    return out


def to_hf(state_dict: dict[str, torch.Tensor], args: GPT2Args) -> dict[str, torch.Tensor]:
    """Our state dict -> ``GPT2LMHeadModel`` tensor names and layouts (``lm_head`` omitted: it is tied, and
    ``save_pretrained`` omits it too; safetensors refuses a tensor stored twice)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        key = "h." + name[len("layers.") :] if name.startswith("layers.") else name
        if _CONV1D.search(key):
            tensor = tensor.t()
        out["transformer." + key] = tensor.contiguous()
    return out
