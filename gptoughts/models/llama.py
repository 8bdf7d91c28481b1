"""Llama-style decoder (Llama 2/3, and Qwen2/Qwen3 through ``qkv_bias`` / ``qk_norm``).

Pre-norm blocks (RMSNorm -> GQA attention with RoPE -> residual, RMSNorm -> SwiGLU -> residual), a final
RMSNorm and an untied (or tied) LM head. Parameter counts of the size presets (vocab 32768, untied
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

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gptoughts.errors import ConfigError
from gptoughts.models.base import DecoderLM
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
    """Hidden width of the SwiGLU MLP (HF ``intermediate_size``)."""
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
    """RMSNorm over ``head_dim`` on q and k before RoPE (Qwen3 style); stabilises attention logits."""
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

    @property
    def hd(self) -> int:
        """The effective head dimension."""
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

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
        self.feed_forward = SwiGLU(args.d_model, args.ffn_dim)
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
    excludes the input embedding table only), ``flops_per_token`` and ``new_cache`` come from ``DecoderLM``.
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
