"""Llama-style decoder (Llama 2/3, and Qwen2/Qwen3 through ``qkv_bias`` / ``qk_norm``).

Pre-norm blocks (RMSNorm -> GQA attention with RoPE -> residual, RMSNorm -> SwiGLU -> residual), a final
RMSNorm and an untied (or tied) LM head. The speedrun switches of modded-nanogpt are fields of ``LlamaArgs``, all
off by default: ``qk_norm``, ``mlp = "relu2"``, ``zero_init_output``, ``zero_init_proj`` and ``logit_softcap``
(preset ``llama-125m-speedrun``). Parameter counts of the size presets (vocab 32768, untied
embeddings; "non-embedding" excludes only the input embedding table, see ``Llama.num_params``):

| size | d_model | layers | heads | kv heads | ffn_dim | parameters | non-embedding |
| ---- | ------: | -----: | ----: | -------: | ------: | ---------: | ------------: |
| 125m | 768 | 12 | 12 | 12 | 2048 | 135,285,504 (135.3M) | 110,119,680 (110.1M) |
| 350m | 1024 | 24 | 16 | 8 | 2816 | 350,274,560 (350.3M) | 316,720,128 (316.7M) |
| 760m | 1536 | 24 | 16 | 8 | 4096 | 723,592,704 (723.6M) | 673,261,056 (673.3M) |
| 1b | 2048 | 16 | 32 | 8 | 8192 | 1,107,363,840 (1.11B) | 1,040,254,976 (1.04B) |
| 3b | 3072 | 28 | 24 | 8 | 8192 | 3,020,073,984 (3.02B) | 2,919,410,688 (2.92B) |
| 8b | 4096 | 32 | 32 | 8 | 14336 | 7,248,023,552 (7.25B) | 7,113,805,824 (7.11B) |

(``debug``: d_model 64, 2 layers, vocab 512, 139,584 parameters; for tests only. ``8b`` also sets
``rope_theta=500000``. Size names are labels: ``760m`` has 724M parameters.)

Module names follow Meta/torchtitan and map 1:1 onto Hugging Face ``LlamaForCausalLM`` names, with the
same RoPE layout (rotate_half), so HF weights load by renaming only:

| ours | transformers |
| --- | --- |
| ``tok_embeddings`` | ``model.embed_tokens`` |
| ``layers.{i}.attention.{wq,wk,wv,wo}`` | ``model.layers.{i}.self_attn.{q,k,v,o}_proj`` |
| ``layers.{i}.attention.{q_norm,k_norm}`` | ``model.layers.{i}.self_attn.{q_norm,k_norm}`` |
| ``layers.{i}.attention_norm`` | ``model.layers.{i}.input_layernorm`` |
| ``layers.{i}.feed_forward.{w1,w3,w2}`` | ``model.layers.{i}.mlp.{gate,up,down}_proj`` |
| ``layers.{i}.ffn_norm`` | ``model.layers.{i}.post_attention_layernorm`` |
| ``norm`` | ``model.norm`` |
| ``output`` (absent when tied) | ``lm_head`` |
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from gptoughts.errors import ConfigError
from gptoughts.models.base import DecoderLM, unwrap
from gptoughts.models.layers import Attention, KVCache, RMSNorm, RotaryEmbedding, SwiGLU


@dataclass
class LlamaArgs:
    """Architecture hyper-parameters of a Llama-style model (build one with ``models.model_args``)."""

    d_model: int = 768
    """Width of the residual stream (HF ``hidden_size``)."""
    n_layers: int = 12
    """Number of transformer blocks (HF ``num_hidden_layers``)."""
    n_heads: int = 12
    """Query heads per attention layer (HF ``num_attention_heads``)."""
    n_kv_heads: int = 12
    """Key/value heads; fewer than ``n_heads`` gives grouped-query attention. Must divide ``n_heads``."""
    ffn_dim: int = 2048
    """Hidden width of the SwiGLU MLP (HF ``intermediate_size``); with ``mlp = "relu2"``, the width of the SwiGLU
    whose parameter count the ReLU² MLP matches (see ``mlp``)."""
    vocab_size: int = 32768
    """Embedding rows and logits; normally set from the tokenizer. Multiples of 64/128 keep matmuls fast."""
    max_seq_len: int = 2048
    """Longest sequence the model accepts; sizes the RoPE tables and bounds KV caches."""
    rope_theta: float = 10000.0
    """RoPE base frequency (Llama 3 uses 500000 for long contexts)."""
    rope_scaling: dict[str, Any] | None = None
    """Context-extension scaling of RoPE: ``{"type": "linear", "factor": f}`` or ``{"type": "llama3",
    "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}``; None for none."""
    norm_eps: float = 1e-5
    """Epsilon of every RMSNorm (HF ``rms_norm_eps``)."""
    tie_embeddings: bool = False
    """Use the token embedding matrix as the LM head (saves ``vocab_size * d_model`` parameters)."""
    qkv_bias: bool = False
    """Bias on the q/k/v projections (Qwen2 style)."""
    qk_norm: bool = False
    """RMSNorm over ``head_dim`` on q and k, per head, before RoPE (Qwen3 style: a learned ``head_dim`` scale
    shared by the heads, initialised to 1); bounds the attention logits, so higher learning rates stay stable.
    Exported to transformers as Qwen3."""
    init_std: float = 0.02
    """Std of the normal init of embeddings and linears; ``wo``/``w2`` get ``init_std / sqrt(2 n_layers)``."""
    head_dim: int | None = None
    """Per-head width; None means ``d_model // n_heads``."""
    sliding_window: int | None = None
    """Sliding-window attention (Mistral, Qwen2): a token attends to at most this many positions, itself
    included; None means full causal attention."""
    full_attention_layers: int = 0
    """With ``sliding_window``: the first this-many layers keep full attention (HF Qwen2/Qwen3
    ``max_window_layers``); 0 windows every layer (Mistral)."""
    mlp: Literal["swiglu", "relu2"] = "swiglu"
    """MLP of each block: ``swiglu`` (``w2(silu(w1 x) * w3 x)``, Llama) or ``relu2`` (``w2(relu(w3 x)²)``: two
    matrices, So et al. 2021, modded-nanogpt). relu2's hidden width is ``3 * ffn_dim // 2`` (``ffn_hidden``), so a
    size keeps its parameter count (125m: 3072 = 4 d_model). Exported to transformers as Arcee (without
    ``qk_norm``/``qkv_bias``)."""
    zero_init_output: bool = False
    """Initialise the LM head to zero: every logit is 0 at step 0 (uniform predictions, loss ln(vocab)), and the
    head learns from the first step. Needs an untied head (``tie_embeddings = false``)."""
    zero_init_proj: bool = False
    """Initialise each block's output projections (``wo`` and the MLP's ``w2``) to zero: every block starts as
    the identity of the residual stream (modded-nanogpt). Init only: the model computes the same function."""
    logit_softcap: float | None = None
    """Soft-cap the logits to ``(-cap, cap)``: ``cap * tanh(logits / cap)`` (Gemma 2; modded-nanogpt uses 15).
    Applied wherever logits are made: ``forward``, the plain and chunked training losses, evaluation and
    sampling. transformers' Llama has no such cap: a model with it cannot be exported. None: off."""

    def __post_init__(self) -> None:
        for name in ("d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model.{name} must be positive, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"model.n_heads ({self.n_heads}) must be a multiple of model.n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ConfigError(
                f"model.d_model ({self.d_model}) must be divisible by model.n_heads ({self.n_heads}), "
                "or set model.head_dim explicitly"
            )
        if self.hd % 2:
            raise ConfigError(f"the head dimension must be even for RoPE, got {self.hd}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ConfigError(f"model.sliding_window must be >= 1 or None, got {self.sliding_window}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("type", self.rope_scaling.get("rope_type"))
            needed = {
                "linear": ("factor",),
                "llama3": (
                    "factor",
                    "low_freq_factor",
                    "high_freq_factor",
                    "original_max_position_embeddings",
                ),
            }
            if kind not in needed:
                raise ConfigError(f"model.rope_scaling.type must be 'linear' or 'llama3', got {kind!r}")
            missing = [k for k in needed[kind] if k not in self.rope_scaling]
            if missing:
                raise ConfigError(f"model.rope_scaling of type {kind!r} lacks {', '.join(missing)}")
        if self.mlp not in ("swiglu", "relu2"):
            raise ConfigError(f"model.mlp must be swiglu or relu2, got {self.mlp!r}")
        if self.zero_init_output and self.tie_embeddings:
            raise ConfigError(
                "model.zero_init_output needs an untied head: with model.tie_embeddings the head is the "
                "token embedding, which cannot start at zero"
            )
        if self.logit_softcap is not None:
            if not (math.isfinite(self.logit_softcap) and self.logit_softcap > 0):
                raise ConfigError(
                    f"model.logit_softcap must be a positive number or None, got {self.logit_softcap}"
                )
            if type(self) is not LlamaArgs:
                # A family built on LlamaArgs (LLaDA) has LM-head paths of its own (its likelihood estimate) that
                # do not apply the cap: refused rather than computed inconsistently.
                raise ConfigError("model.logit_softcap is supported by the llama family only")

    @property
    def hd(self) -> int:
        """The effective head dimension."""
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    @property
    def ffn_hidden(self) -> int:
        """The MLP's hidden width: ``ffn_dim`` (SwiGLU), or ``3 * ffn_dim // 2`` (ReLU², same parameters)."""
        return self.ffn_dim if self.mlp == "swiglu" else 3 * self.ffn_dim // 2

    @property
    def kv_heads(self) -> int:
        """Key/value heads (what a KV cache holds per layer)."""
        return self.n_kv_heads


# Size presets: field overrides of LlamaArgs. `125m`, `1b` and `3b` are fixed by the benchmark spec.
LLAMA_SIZES: dict[str, dict[str, Any]] = {
    "debug": dict(
        d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=512, max_seq_len=256
    ),
    "125m": dict(d_model=768, n_layers=12, n_heads=12, n_kv_heads=12, ffn_dim=2048),
    "350m": dict(d_model=1024, n_layers=24, n_heads=16, n_kv_heads=8, ffn_dim=2816),
    "760m": dict(d_model=1536, n_layers=24, n_heads=16, n_kv_heads=8, ffn_dim=4096),
    "1b": dict(d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192),
    "3b": dict(d_model=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim=8192),
    "8b": dict(d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, rope_theta=500000.0),
}


class ReLU2MLP(nn.Module):
    """``w2(relu(w3 x)²)``: one up- and one down-projection (modded-nanogpt's MLP; transformers' Arcee).

    The up-projection is called ``w3`` because it maps onto HF's ``up_proj``, like SwiGLU's ``w3``: the renaming
    table of ``llama_hf.py`` serves both MLPs unchanged.
    """

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)

    def reset_parameters(self, std: float, out_std: float) -> None:
        nn.init.normal_(self.w3.weight, mean=0.0, std=std)
        nn.init.normal_(self.w2.weight, mean=0.0, std=out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.relu(self.w3(x)).square())


class TransformerBlock(nn.Module):
    """Pre-norm block; the unit of activation checkpointing, per-block compile and FSDP sharding."""

    def __init__(self, args: LlamaArgs, layer_idx: int) -> None:
        super().__init__()
        self.attention = Attention(
            args.d_model,
            args.n_heads,
            args.n_kv_heads,
            args.hd,
            layer_idx=layer_idx,
            qkv_bias=args.qkv_bias,
            qk_norm=args.qk_norm,
            norm_eps=args.norm_eps,
            causal=True,
            sliding_window=args.sliding_window if layer_idx >= args.full_attention_layers else None,
        )
        self.feed_forward = (
            SwiGLU(args.d_model, args.ffn_dim)
            if args.mlp == "swiglu"
            else ReLU2MLP(args.d_model, args.ffn_hidden)
        )
        self.attention_norm = RMSNorm(args.d_model, args.norm_eps)
        self.ffn_norm = RMSNorm(args.d_model, args.norm_eps)

    def reset_parameters(self, std: float, out_std: float) -> None:
        self.attention_norm.reset_parameters()
        self.attention.reset_parameters(std, out_std)
        self.ffn_norm.reset_parameters()
        self.feed_forward.reset_parameters(std, out_std)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache | None = None,
        doc_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, cache, doc_ids)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(DecoderLM):
    """Llama-style causal LM implementing the model protocol of ``docs/internals.md``.

    ``forward``, ``init_weights`` (Normal(0, init_std) for embeddings and linears, ``init_std / sqrt(2 n_layers)``
    for ``wo``/``w2``, norms to 1, biases to 0, RoPE tables recomputed), ``num_params`` (``non_embedding``
    excludes the input embedding table only), ``flops_per_token``, ``new_cache`` and ``logit_softcap`` come from
    ``DecoderLM``; ``init_weights`` then zeroes what ``zero_init_output`` / ``zero_init_proj`` ask for.
    """

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__(args)
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.d_model)
        self.rope = RotaryEmbedding(args.hd, args.max_seq_len, args.rope_theta, args.rope_scaling)
        self.layers = nn.ModuleList(TransformerBlock(args, i) for i in range(args.n_layers))
        self.norm = RMSNorm(args.d_model, args.norm_eps)
        # Tied: no `output` module at all, so the state dict holds the matrix once (safetensors refuses
        # aliased tensors) and FSDP sees a single parameter.
        self.output = None if args.tie_embeddings else nn.Linear(args.d_model, args.vocab_size, bias=False)

    @torch.no_grad()
    def init_weights(self) -> None:
        # The same RNG draws as without the switches (then zeroed): the other weights do not change with them.
        super().init_weights()
        if self.args.zero_init_output and self.output is not None:
            self.output.weight.zero_()
        if self.args.zero_init_proj:
            for layer in self.layers:
                block = unwrap(layer)
                block.attention.wo.weight.zero_()
                block.feed_forward.w2.weight.zero_()
