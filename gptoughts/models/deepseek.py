"""DeepSeek-V3-style decoder: Multi-head Latent Attention, DeepSeekMoE, aux-loss-free balancing, MTP.

Architecture (DeepSeek-V2/V3 papers; ``transformers.DeepseekV3ForCausalLM`` is the numerical reference):

* **MLA**: queries come from ``wq`` (or the low-rank ``wq_a -> q_norm -> wq_b`` when ``q_lora_rank`` is set);
  keys and values from one compressed latent ``c = kv_norm(wkv_a(x)[:kv_lora_rank])`` expanded by ``wkv_b``
  into per-head ``k_nope`` and ``v``; a single decoupled RoPE key ``k_pe = wkv_a(x)[kv_lora_rank:]`` is shared
  by all heads. Head dims: ``qk_nope_head_dim + qk_rope_head_dim`` for q/k, ``v_head_dim`` for v.
* **DeepSeekMoE** (every layer from ``n_dense_layers`` on): ``n_shared_experts`` always-on experts (one SwiGLU
  of width ``n_shared_experts * moe_inter_dim``) plus ``n_routed_experts`` fine-grained SwiGLU experts of which
  each token uses ``n_activated_experts``. Scores are ``sigmoid`` (V3) or ``softmax`` (V2) of the router
  ``gate``; the top-k is chosen on ``score + expert_bias`` (optionally restricted to the best
  ``n_limited_groups`` of ``n_expert_groups`` groups), the gates are the raw scores of the chosen experts,
  normalised to sum 1 when ``norm_topk_prob``, times ``route_scale``.
* **Auxiliary-loss-free balancing**: ``expert_bias`` only affects *which* experts are chosen, never the gate
  values, and gets no gradient. After each optimizer step ``after_optimizer_step`` moves it by
  ``bias_update_rate * sign(mean_load - load)`` from the loads of all of that step's forward passes.
  An optional sequence-wise balance loss (V3 eq. 17-20, ``seq_aux_loss_coef``) is returned by ``extra_loss``.
* **MTP** (``mtp_depth = 1``): one extra block predicts token ``t+2`` from ``[enorm(emb(t+1)); hnorm(h_t)]``
  (``h_t``: the main trunk's last hidden state before the final norm), through ``eh_proj``, the block, ``norm``
  and the shared LM head. Its loss, times ``mtp_loss_weight``, is added by ``extra_loss`` during training only
  (the validation loss stays the plain next-token loss). Generation ignores it.

Size presets (``vocab_size`` as listed; "active" = parameters one token runs through, see
``DeepSeek.num_active_params``; both columns include the input embedding and the LM head):

| size | d_model | layers (dense) | heads | routed experts (top-k) + shared | moe_inter | vocab | total | active |
| ---- | ------: | -------------: | ----: | ------------------------------: | --------: | ----: | ----: | -----: |
| debug | 64 | 3 (1) | 4 | 8 (2) + 1 | 32 | 512 | 252,960 | 179,232 |
| small | 1024 | 16 (1) | 8 | 64 (6) + 2 | 320 | 32768 | 1,118,151,680 (1.12B) | 262,906,880 (263M) |
| 16b | 2048 | 27 (1) | 16 | 64 (6) + 2 | 1408 | 102400 | 15,706,484,224 (15.7B) | 2,661,150,208 (2.66B) |

``16b`` is the DeepSeek-V2-Lite shape (DeepSeek quotes 15.7B total and 2.4B active; the latter excludes the
input embedding: 2,451,435,008 here). The presets use the V3 routing recipe (sigmoid scores, normalised top-k,
scale 2.5, bias balancing) rather than V2-Lite's softmax; ``score_func = "softmax"`` gives the V2 router.
``small`` and ``16b`` use MLA head dims 128 (nope) + 64 (rope) and 128 (v), kv_lora_rank 512, no q-LoRA.

Module names map 1:1 onto ``DeepseekV3ForCausalLM`` (see ``from_hf`` / ``to_hf``):

| ours | transformers |
| --- | --- |
| ``tok_embeddings`` / ``norm`` / ``output`` | ``model.embed_tokens`` / ``model.norm`` / ``lm_head`` |
| ``layers.{i}.attention_norm`` / ``ffn_norm`` | ``model.layers.{i}.input_layernorm`` / ``post_attention_layernorm`` |
| ``layers.{i}.attention.wq`` (or ``wq_a``, ``q_norm``, ``wq_b``) | ``self_attn.q_proj`` (``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``) |
| ``layers.{i}.attention.{wkv_a,kv_norm,wkv_b,wo}`` | ``self_attn.{kv_a_proj_with_mqa,kv_a_layernorm,kv_b_proj,o_proj}`` |
| ``layers.{i}.feed_forward.{w1,w3,w2}`` (dense layers) | ``mlp.{gate,up,down}_proj`` |
| ``layers.{i}.feed_forward.gate`` / ``expert_bias`` | ``mlp.gate.weight`` / ``mlp.gate.e_score_correction_bias`` |
| ``layers.{i}.feed_forward.experts.{w1,w3,w2}[e]`` | ``mlp.experts.{e}.{gate,up,down}_proj`` |
| ``layers.{i}.feed_forward.shared_experts.{w1,w3,w2}`` | ``mlp.shared_experts.{gate,up,down}_proj`` |
| ``mtp.{enorm,hnorm,eh_proj,norm}``, ``mtp.block.*`` | ``model.layers.{L}.{enorm,hnorm,eh_proj,shared_head.norm}``, ``model.layers.{L}.*`` |

RoPE: DeepSeek checkpoints lay the rotary dims out in interleaved pairs (``rope_interleave = true``). We
compute in the rotate_half layout shared with Llama (``layers.apply_rotary``) and permute the rope rows of
``wq``/``wq_b``/``wkv_a`` on import and back on export: the rotated values, hence the scores, are the same.
Rope scaling: ``linear``, ``llama3`` and DeepSeek's ``yarn`` (including its ``mscale_all_dim`` softmax scale).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gptoughts.errors import ConfigError, UserError
from gptoughts.models.hf import UnsupportedHFConfig
from gptoughts.models.layers import RMSNorm, SwiGLU, apply_rotary, cache_placement, rope_inv_freq

__all__ = [
    "DEEPSEEK_SIZES",
    "HF_MODEL_TYPES",
    "DeepSeek",
    "DeepSeekArgs",
    "MLACache",
    "args_from_hf",
    "from_hf",
    "hf_config",
    "to_hf",
]

IGNORE_INDEX = -100  # same value as gptoughts.perf.ce.IGNORE_INDEX (models never import perf/)
# DeepSeek's latent norms (q_a_layernorm, kv_a_layernorm) use their class default eps, not rms_norm_eps.
_LATENT_NORM_EPS = 1e-6
# Rows of each expert's token group are padded to a multiple of this (zero rows) before the grouped GEMM: the
# CUDA grouped-GEMM kernels need 16-byte aligned group starts in the weight-gradient GEMM (whose reduction
# dim is the token dim), and 16 rows also covers fp8. The padding costs at most n_experts * 15 rows.
EXPERT_ROW_ALIGN = 16


@dataclass
class DeepSeekArgs:
    """Architecture hyper-parameters of a DeepSeek-V3-style model (build one with ``models.model_args``)."""

    d_model: int = 1024
    """Width of the residual stream (HF ``hidden_size``)."""
    n_layers: int = 16
    """Number of transformer blocks (HF ``num_hidden_layers``), the MTP block not included."""
    n_heads: int = 8
    """Attention heads (HF ``num_attention_heads``). MLA has no GQA: every head has its own k and v."""
    vocab_size: int = 32768
    """Embedding rows and logits; normally set from the tokenizer."""
    max_seq_len: int = 4096
    """Longest sequence the model accepts; sizes the RoPE tables and bounds KV caches."""
    q_lora_rank: int | None = None
    """Rank of the low-rank query projection (``wq_a -> q_norm -> wq_b``); None: one full ``wq`` (V2-Lite)."""
    kv_lora_rank: int = 512
    """Width of the compressed key/value latent (what the KV cache stores per token, plus the rope key)."""
    qk_nope_head_dim: int = 128
    """Per-head query/key dims without position encoding (expanded from the latent by ``wkv_b``)."""
    qk_rope_head_dim: int = 64
    """Per-head query dims with RoPE; the matching key part is one shared head (the decoupled rope key)."""
    v_head_dim: int = 128
    """Per-head value width."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    rope_scaling: dict[str, Any] | None = None
    """Context extension: ``{"type": "linear", "factor"}``, the ``llama3`` scheme (see ``LlamaArgs``), or DeepSeek's
    ``{"type": "yarn", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
    "mscale_all_dim"}`` (HF ``rope_parameters``); None for none."""
    norm_eps: float = 1e-6
    """Epsilon of the block and final RMSNorms (HF ``rms_norm_eps``); the latent norms always use 1e-6."""
    n_routed_experts: int = 64
    """Routed (fine-grained) experts per MoE layer."""
    n_shared_experts: int = 2
    """Always-on experts per MoE layer, fused into one SwiGLU of width ``n_shared_experts * moe_inter_dim``."""
    n_activated_experts: int = 6
    """Routed experts per token (top-k; HF ``num_experts_per_tok``)."""
    moe_inter_dim: int = 320
    """Hidden width of each routed (and shared) expert (HF ``moe_intermediate_size``)."""
    dense_inter_dim: int = 2816
    """Hidden width of the SwiGLU of the dense layers (HF ``intermediate_size``)."""
    n_dense_layers: int = 1
    """The first this-many layers use a dense SwiGLU instead of MoE (HF ``first_k_dense_replace``)."""
    score_func: str = "sigmoid"
    """Router scores: ``"sigmoid"`` (V3; gates normalised over the chosen experts) or ``"softmax"`` (V2)."""
    route_scale: float = 2.5
    """Multiplies the routed gates (HF ``routed_scaling_factor``; 2.5 in DeepSeek-V3)."""
    norm_topk_prob: bool = True
    """Normalise the chosen experts' gates to sum to 1 (before ``route_scale``)."""
    n_expert_groups: int = 1
    """Group-limited routing (HF ``n_group``): experts are split in this many groups ..."""
    n_limited_groups: int = 1
    """... and each token picks its experts within the best this-many groups (HF ``topk_group``); a group's score
    is the sum of its two best biased scores (V3). 1/1 disables it."""
    bias_update_rate: float = 1e-3
    """Step of the aux-loss-free bias update per optimizer step (V3's gamma); 0 disables the update."""
    seq_aux_loss_coef: float = 1e-4
    """Weight of the sequence-wise balance loss (V3's alpha); 0 disables it (and skips its computation)."""
    mtp_depth: int = 0
    """Multi-token prediction modules: 0 (off) or 1 (one extra block predicting the token after next)."""
    mtp_loss_weight: float = 0.3
    """Weight of the MTP loss (V3's lambda: 0.3 for the first 10T tokens, then 0.1)."""
    tie_embeddings: bool = False
    """Use the token embedding matrix as the LM head."""
    init_std: float = 0.02
    """Std of the normal init; residual-branch outputs (``wo``, ``w2``) get ``init_std / sqrt(2 n_layers)``."""
    hf_rope_interleave: bool = True
    """Checkpoint layout only (HF ``rope_interleave``): whether HF weights store the rope dims as interleaved pairs.
    ``from_hf``/``to_hf`` permute accordingly; the model itself always computes in the rotate_half layout."""

    def __post_init__(self) -> None:
        for name in (
            "d_model", "n_layers", "n_heads", "vocab_size", "max_seq_len", "kv_lora_rank", "qk_nope_head_dim",
            "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "n_activated_experts", "moe_inter_dim",
            "dense_inter_dim", "n_expert_groups", "n_limited_groups",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model.{name} must be positive, got {getattr(self, name)}")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ConfigError(f"model.q_lora_rank must be positive or None, got {self.q_lora_rank}")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"model.qk_rope_head_dim must be even for RoPE, got {self.qk_rope_head_dim}")
        if self.n_shared_experts < 0:
            raise ConfigError(f"model.n_shared_experts must be >= 0, got {self.n_shared_experts}")
        if not 0 <= self.n_dense_layers <= self.n_layers:
            raise ConfigError(f"model.n_dense_layers must be in [0, n_layers={self.n_layers}], got {self.n_dense_layers}")
        if self.n_activated_experts > self.n_routed_experts:
            raise ConfigError(
                f"model.n_activated_experts ({self.n_activated_experts}) exceeds n_routed_experts ({self.n_routed_experts})"
            )
        if self.score_func not in ("sigmoid", "softmax"):
            raise ConfigError(f"model.score_func must be 'sigmoid' or 'softmax', got {self.score_func!r}")
        if self.mtp_depth not in (0, 1):
            raise ConfigError(f"model.mtp_depth must be 0 or 1, got {self.mtp_depth}")
        for name in ("bias_update_rate", "seq_aux_loss_coef", "mtp_loss_weight", "route_scale"):
            if getattr(self, name) < 0:
                raise ConfigError(f"model.{name} must be >= 0, got {getattr(self, name)}")
        g, tg = self.n_expert_groups, self.n_limited_groups
        if self.n_routed_experts % g:
            raise ConfigError(f"model.n_expert_groups ({g}) must divide n_routed_experts ({self.n_routed_experts})")
        if tg > g:
            raise ConfigError(f"model.n_limited_groups ({tg}) exceeds n_expert_groups ({g})")
        if g > 1 and self.n_routed_experts // g < 2:
            raise ConfigError("group-limited routing needs at least 2 experts per group (groups score their top 2)")
        if g > 1 and tg * (self.n_routed_experts // g) < self.n_activated_experts:
            raise ConfigError("n_limited_groups groups hold fewer experts than n_activated_experts")
        _check_rope_scaling(self.rope_scaling)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers - self.n_dense_layers

    @property
    def softmax_scale(self) -> float:
        """``1/sqrt(qk_head_dim)``, times yarn's ``mscale(factor, mscale_all_dim)**2`` when that is configured."""
        scale = self.qk_head_dim**-0.5
        s = self.rope_scaling or {}
        if _rope_kind(s) not in ("default", None) and s.get("mscale_all_dim"):
            m = _yarn_mscale(float(s["factor"]), float(s["mscale_all_dim"]))
            scale *= m * m
        return scale


# Size presets: field overrides of DeepSeekArgs.
DEEPSEEK_SIZES: dict[str, dict[str, Any]] = {
    "debug": dict(
        d_model=64, n_layers=3, n_heads=4, vocab_size=512, max_seq_len=256, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=1,
        n_activated_experts=2, moe_inter_dim=32, dense_inter_dim=128, n_dense_layers=1,
    ),
    # 1.12B total / 263M active with vocab 32768.
    "small": dict(
        d_model=1024, n_layers=16, n_heads=8, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, n_routed_experts=64, n_shared_experts=2, n_activated_experts=6, moe_inter_dim=320,
        dense_inter_dim=2816, n_dense_layers=1,
    ),
    # DeepSeek-V2-Lite shape: 15.7B total, 2.45B active without the input embedding (DeepSeek: 2.4B).
    "16b": dict(
        d_model=2048, n_layers=27, n_heads=16, vocab_size=102400, q_lora_rank=None, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64, n_shared_experts=2,
        n_activated_experts=6, moe_inter_dim=1408, dense_inter_dim=10944, n_dense_layers=1,
    ),
}


# --------------------------------------------------------------------------------------------- RoPE


def _rope_kind(scaling: dict[str, Any] | None) -> str | None:
    if not scaling:
        return None
    return scaling.get("type", scaling.get("rope_type", "default"))


def _check_rope_scaling(scaling: dict[str, Any] | None) -> None:
    kind = _rope_kind(scaling)
    if kind in (None, "default"):
        return
    needed = {
        "linear": ("factor",),
        "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
        "yarn": ("factor", "original_max_position_embeddings"),
    }
    if kind not in needed:
        raise ConfigError(f"model.rope_scaling.type must be 'linear', 'llama3' or 'yarn', got {kind!r}")
    missing = [k for k in needed[kind] if scaling.get(k) is None]
    if missing:
        raise ConfigError(f"model.rope_scaling of type {kind!r} lacks {', '.join(missing)}")


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(dim: int, theta: float, s: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN inverse frequencies and cos/sin factor, as ``transformers.modeling_rope_utils`` computes them."""
    factor = float(s["factor"])
    orig = float(s["original_max_position_embeddings"])
    beta_fast = float(s.get("beta_fast") or 32)
    beta_slow = float(s.get("beta_slow") or 1)
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all = s.get("mscale"), s.get("mscale_all_dim")
        if mscale and mscale_all:
            attention_factor = _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mscale_all))
        else:
            attention_factor = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


class DeepSeekRotary(nn.Module):
    """Precomputed RoPE tables ``[max_seq_len, rope_dim]`` (rotate_half layout), with yarn support.

    Same contract as ``layers.RotaryEmbedding`` (non-persistent buffers, recomputed by ``reset_parameters``); a
    separate class because yarn scales the tables themselves (``attention_factor``), which the shared one
    does not support.
    """

    def __init__(self, dim: int, max_seq_len: int, theta: float, scaling: dict[str, Any] | None) -> None:
        super().__init__()
        self.dim, self.max_seq_len, self.theta = dim, max_seq_len, theta
        self.scaling = dict(scaling) if scaling else None
        self.register_buffer("cos", torch.empty(max_seq_len, dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_seq_len, dim), persistent=False)
        if self.cos.device.type != "meta":
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        factor = 1.0
        if _rope_kind(self.scaling) == "yarn":
            inv_freq, factor = _yarn_inv_freq(self.dim, self.theta, self.scaling)
        else:
            inv_freq = rope_inv_freq(self.dim, self.theta, self.scaling)
        # fp32 positions * inv_freq, then cos/sin, exactly as transformers does (bit-comparable tables).
        pos = torch.arange(self.max_seq_len, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos.copy_(emb.cos() * factor)
        self.sin.copy_(emb.sin() * factor)

    def forward(
        self, seq_len: int, start: int = 0, position_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` broadcastable against ``[B, T, H, dim]`` (see ``layers.RotaryEmbedding.forward``)."""
        if position_ids is None:
            cos, sin = self.cos[start : start + seq_len], self.sin[start : start + seq_len]
        else:
            cos, sin = self.cos[position_ids], self.sin[position_ids]
        return cos.unsqueeze(-2), sin.unsqueeze(-2)


# --------------------------------------------------------------------------------------------- KV cache


class MLACache:
    """KV cache of MLA: per layer and token, the normed latent ``c`` and the rotated rope key, ``[B, max_len,
    kv_lora_rank + qk_rope_head_dim]`` (576 numbers per token for V2/V3 shapes, against 2 * heads * 128-192 for
    expanded keys and values). Attention over the cache uses the absorbed form (``wkv_b`` folded into the
    query and the output), so the expanded k/v are never materialised. Same interface as ``layers.KVCache``:
    ``length`` is a host int, ``update`` once per layer, ``advance`` once per forward.
    """

    def __init__(
        self,
        n_layers: int,
        batch_size: int,
        max_len: int,
        dim: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.latent = [torch.zeros(batch_size, max_len, dim, device=device, dtype=dtype) for _ in range(n_layers)]
        self.batch_size = batch_size
        self.max_len = max_len
        self.length = 0

    def update(self, layer_idx: int, latent: torch.Tensor) -> torch.Tensor:
        """Store ``latent [B, T, dim]`` at positions ``length .. length+T``; return all cached ``[B, length+T, dim]``."""
        start, end = self.length, self.length + latent.size(1)
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: {end} positions needed, cache holds {self.max_len}")
        self.latent[layer_idx][:, start:end] = latent
        return self.latent[layer_idx][:, :end]

    def advance(self, n: int) -> None:
        self.length += n

    def reset(self) -> None:
        self.length = 0


def _causal_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, doc_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """SDPA with the queries at the last ``Tq`` of ``Tk`` positions (as ``layers.sdpa``), with an explicit scale.

    ``doc_ids [B, T]`` (packed rows, ``Tq == Tk``): tokens attend only within their document; the explicit
    ``[B, 1, T, T]`` mask rules out the flash kernel, as in ``layers.sdpa``.
    """
    tq, tk = q.size(-2), k.size(-2)
    if doc_ids is not None:
        same = doc_ids[:, :, None] == doc_ids[:, None, :]
        mask = same & torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=scale)
    if tq == tk:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    if tq == 1:
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    mask = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(diagonal=tk - tq)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


# --------------------------------------------------------------------------------------------- attention


class MLA(nn.Module):
    """Multi-head Latent Attention. ``layer_idx`` selects this layer's slot in an ``MLACache``."""

    def __init__(self, args: DeepSeekArgs, layer_idx: int = 0) -> None:
        super().__init__()
        d, h = args.d_model, args.n_heads
        self.layer_idx = layer_idx
        self.nope, self.rope, self.v_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        self.kv_lora_rank = args.kv_lora_rank
        self.softmax_scale = args.softmax_scale
        self.q_lora = args.q_lora_rank is not None
        if not self.q_lora:
            self.wq = nn.Linear(d, h * args.qk_head_dim, bias=False)
        else:
            self.wq_a = nn.Linear(d, args.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(args.q_lora_rank, _LATENT_NORM_EPS)
            self.wq_b = nn.Linear(args.q_lora_rank, h * args.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(d, args.kv_lora_rank + args.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(args.kv_lora_rank, _LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(args.kv_lora_rank, h * (args.qk_nope_head_dim + args.v_head_dim), bias=False)
        self.wo = nn.Linear(h * args.v_head_dim, d, bias=False)

    def reset_parameters(self, std: float, out_std: float) -> None:
        for name in ("wq", "wq_a", "wq_b", "wkv_a", "wkv_b"):
            lin = getattr(self, name, None)
            if lin is not None:
                nn.init.normal_(lin.weight, mean=0.0, std=std)
        nn.init.normal_(self.wo.weight, mean=0.0, std=out_std)
        if self.q_lora:
            self.q_norm.reset_parameters()
        self.kv_norm.reset_parameters()

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: MLACache | None = None,
        doc_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q = self.wq_b(self.q_norm(self.wq_a(x))) if self.q_lora else self.wq(x)
        # Head counts inferred (-1): under tensor parallelism a rank holds only its shard of the heads.
        q = q.view(bsz, seqlen, -1, self.nope + self.rope)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        q_pe = apply_rotary(q_pe, cos, sin)
        c, k_pe = self.wkv_a(x).split([self.kv_lora_rank, self.rope], dim=-1)
        c = self.kv_norm(c)
        k_pe = apply_rotary(k_pe.unsqueeze(2), cos, sin)  # [B, T, 1, rope]: one rope key shared by all heads
        if cache is None:
            kv = self.wkv_b(c).view(bsz, seqlen, -1, self.nope + self.v_dim)
            k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
            q = torch.cat([q_nope, q_pe], dim=-1)
            k = torch.cat([k_nope, k_pe.expand(-1, -1, k_nope.size(2), -1)], dim=-1)
            # v_head_dim may differ from the q/k head dim: SDPA's cuDNN and memory-efficient kernels accept that.
            out = _causal_sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.softmax_scale, doc_ids)
            out = out.transpose(1, 2)
        else:
            if doc_ids is not None:
                raise ValueError("doc_ids needs the whole sequence in one forward (no KV cache)")
            out = self._absorbed(q_nope, q_pe, c, k_pe, cache)
        return self.wo(out.reshape(bsz, seqlen, -1))

    def _absorbed(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, c: torch.Tensor, k_pe: torch.Tensor, cache: MLACache
    ) -> torch.Tensor:
        """Attention over the cached latents with ``wkv_b`` absorbed (DeepSeek-V2 sec. 2.1.2).

        ``q_nope . (W_uk c) = (W_uk^T q_nope) . c`` and ``sum a_t W_uv c_t = W_uv sum a_t c_t``: the per-head
        queries move into latent space, attention runs as one-kv-head MQA over ``[c; k_pe]`` with value ``c``,
        and ``W_uv`` maps the result back. Per decoded token this reads the ``kv_lora + rope`` wide cache
        instead of expanding every cached position through ``wkv_b``.
        """
        latent = cache.update(self.layer_idx, torch.cat([c, k_pe.squeeze(2)], dim=-1))  # [B, Tk, r + rope]
        w = self.wkv_b.weight.view(-1, self.nope + self.v_dim, self.kv_lora_rank)
        w_uk, w_uv = w[:, : self.nope], w[:, self.nope :]
        q_lat = torch.einsum("bthn,hnr->bhtr", q_nope, w_uk.to(q_nope.dtype))
        q = torch.cat([q_lat, q_pe.transpose(1, 2)], dim=-1)
        n_heads = q.size(1)
        k = latent.unsqueeze(1).to(q.dtype).expand(-1, n_heads, -1, -1)
        v = k[..., : self.kv_lora_rank]
        o_lat = _causal_sdpa(q, k, v, self.softmax_scale)  # [B, H, T, r]
        return torch.einsum("bhtr,hvr->bthv", o_lat, w_uv.to(o_lat.dtype))


# --------------------------------------------------------------------------------------------- MoE


_GMM_SUPPORT: dict[tuple[str, torch.dtype], tuple[bool, bool]] = {}
_WARNED_LOOP: set[tuple[str, torch.dtype]] = set()


@torch.compiler.disable
def grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> tuple[bool, bool]:
    """Whether ``torch._grouped_mm`` works on ``device`` for ``dtype``: ``(eager, compiled)``, probed once per
    (device type, dtype). Eager: forward and backward give the reference result. Compiled: also its meta kernel,
    which ``torch.compile`` traces through, accepts the dtype (in torch 2.13 that kernel takes bf16 only, while
    the CPU kernel also runs fp32).

    The op exists on CUDA (bf16; Hopper+, with a fallback on some older GPUs in recent torch) and, in recent
    torch, on CPU. Probing a tiny call is more reliable than a table of versions and architectures. Runs at init
    (see ``GroupedExperts.reset_parameters``), so forward only reads the cached answer.
    """
    key = (device.type, dtype)
    if key not in _GMM_SUPPORT:
        eager = compiled = False
        fn = getattr(torch, "_grouped_mm", None)
        if fn is not None and device.type != "meta":
            try:
                with torch.inference_mode(False), torch.enable_grad(), torch.autocast(device.type, enabled=False):
                    g = torch.Generator(device="cpu").manual_seed(0)
                    x = torch.randn(32, 16, generator=g).to(device, dtype).requires_grad_()
                    w = torch.randn(2, 16, 16, generator=g).to(device, dtype).requires_grad_()
                    offs = torch.tensor([16, 32], dtype=torch.int32, device=device)
                    y = fn(x, w.transpose(-2, -1), offs=offs)
                    ref = torch.cat([x[:16] @ w[0].T, x[16:] @ w[1].T])
                    y.backward(torch.ones_like(y))
                    eager = bool(torch.allclose(y.float(), ref.float(), atol=0.1, rtol=0.05)) and w.grad is not None
            except Exception:  # any failure means "use the per-expert fallback"
                eager = False
            if eager:
                try:
                    fn(x.detach().to("meta"), w.detach().to("meta").transpose(-2, -1), offs=offs.to("meta"))
                    compiled = True
                except Exception:
                    compiled = False
        _GMM_SUPPORT[key] = (eager, compiled)
    return _GMM_SUPPORT[key]


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class GroupedExperts(nn.Module):
    """``n_experts`` SwiGLU experts stored as 3-D weights and run as grouped GEMMs over expert-sorted tokens.

    ``w1``/``w3``: ``[E, hidden, dim]``, ``w2``: ``[E, dim, hidden]`` (``nn.Linear`` layout per expert). These
    are plain parameters, not ``nn.Linear``: the fp8 converter leaves them alone (they stay bf16).
    """

    def __init__(self, dim: int, hidden_dim: int, n_experts: int) -> None:
        super().__init__()
        self.n_experts = n_experts
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))
        # "auto" (grouped GEMM where grouped_mm_supported, else "loop"), "grouped_mm" or "loop" (tests, debugging).
        self.impl = "auto"
        self._probe(self.w1.device)

    def _probe(self, device: torch.device) -> None:
        # Decided outside forward, so the compiled block only reads Python sets (guards, not graph breaks).
        support = {dt: grouped_mm_supported(device, dt) for dt in (torch.float32, torch.bfloat16, torch.float16)}
        self._gmm_device = device.type
        self._gmm_dtypes = frozenset(dt for dt, (eager, _) in support.items() if eager)
        self._gmm_compiled_dtypes = frozenset(dt for dt, (_, compiled) in support.items() if compiled)

    def reset_parameters(self, std: float, out_std: float) -> None:
        nn.init.normal_(self.w1, mean=0.0, std=std)
        nn.init.normal_(self.w3, mean=0.0, std=std)
        nn.init.normal_(self.w2, mean=0.0, std=out_std)
        self._probe(self.w1.device)

    def forward(self, x: torch.Tensor, idx: torch.Tensor, gates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [N, d]``, chosen experts ``idx [N, K]`` and their ``gates [N, K]`` -> (``sum_k gate * expert(x)``
        ``[N, d]``, tokens per expert ``[E]`` int64). No host sync on the grouped-GEMM path."""
        n, k = idx.shape
        e = self.n_experts
        dev = x.device
        flat = idx.reshape(-1)  # assignment a = token * K + slot
        order = torch.argsort(flat, stable=True)  # assignments grouped by expert
        sorted_e = flat[order]
        # First assignment of each expert in sorted order. searchsorted rather than bincount: bincount on CUDA
        # reads the max value to size its output (a host sync), and scatter_add counts are not deterministic.
        bounds = torch.searchsorted(sorted_e, torch.arange(e + 1, device=dev, dtype=sorted_e.dtype))
        counts = bounds[1:] - bounds[:-1]
        # Padded layout: expert g's rows start at a multiple of EXPERT_ROW_ALIGN. The total row count is a
        # static upper bound (shapes never depend on routing, so compiled graphs are reused); the slack rows go
        # to the last group as zero rows, so every row of every GEMM is defined.
        align = EXPERT_ROW_ALIGN
        rows = n * k + e * (align - 1)
        padded = (counts + align - 1) // align * align
        ends = torch.cumsum(padded, 0)
        starts = ends - padded
        ends[-1] = rows
        rank = torch.arange(n * k, device=dev) - bounds[sorted_e]
        dest_sorted = starts[sorted_e] + rank
        dest = torch.empty_like(dest_sorted).scatter_(0, order, dest_sorted)  # row of assignment a
        # Scatter each token's K copies to their rows. dest is injective, so both this and the gather below
        # have backward passes without colliding indices: no atomics, deterministic gradients on CUDA.
        copies = x.unsqueeze(1).expand(n, k, x.size(-1)).reshape(n * k, -1)
        xp = x.new_zeros(rows, x.size(-1)).index_put((dest,), copies)
        yp = self._run(xp, ends.to(torch.int32))
        y = yp[dest].view(n, k, -1)
        # Gate-weighted sum of the K outputs as one bmm: accumulates in fp32 inside the kernel under bf16 and
        # never materialises the [N, K, d] products.
        out = torch.bmm(gates.unsqueeze(1).to(y.dtype), y).squeeze(1)
        return out, counts

    def _run(self, xp: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        dtype = _compute_dtype(xp)
        if xp.device.type != self._gmm_device:  # moved after init: probe the new device (eager only)
            self._probe(xp.device)
        ok = self._gmm_compiled_dtypes if torch.compiler.is_compiling() else self._gmm_dtypes
        use_gmm = self.impl == "grouped_mm" or (self.impl == "auto" and dtype in ok)
        if use_gmm:
            xp = xp.to(dtype)
            w1, w3, w2 = (w.to(dtype).transpose(-2, -1) for w in (self.w1, self.w3, self.w2))
            h = F.silu(torch._grouped_mm(xp, w1, offs=offs)) * torch._grouped_mm(xp, w3, offs=offs)
            return torch._grouped_mm(h, w2, offs=offs)
        # Fallback: one GEMM per *expert* (never per token). Reading the group ends costs one host sync per
        # MoE layer and a graph break under compile; free on CPU, where this path is normally taken.
        if xp.is_cuda and (xp.device.type, dtype) not in _WARNED_LOOP:
            _WARNED_LOOP.add((xp.device.type, dtype))
            warnings.warn(
                f"torch._grouped_mm is unavailable for {dtype} on this GPU/torch: MoE experts run one GEMM per "
                "expert, with a host sync per MoE layer (slower; bf16 autocast on Hopper+ avoids it)",
                stacklevel=2,
            )
        ends = offs.tolist()
        outs, start = [], 0
        for g, end in enumerate(ends):
            xe = xp[start:end]
            outs.append(F.linear(F.silu(F.linear(xe, self.w1[g])) * F.linear(xe, self.w3[g]), self.w2[g]))
            start = end
        return torch.cat(outs)


class MoE(nn.Module):
    """DeepSeekMoE: shared experts + top-k routed experts with bias-adjusted selection."""

    def __init__(self, args: DeepSeekArgs) -> None:
        super().__init__()
        self.n_experts = args.n_routed_experts
        self.top_k = args.n_activated_experts
        self.score_func = args.score_func
        self.route_scale = args.route_scale
        self.norm_topk_prob = args.norm_topk_prob
        self.n_groups, self.topk_groups = args.n_expert_groups, args.n_limited_groups
        self.seq_aux = args.seq_aux_loss_coef > 0
        # Named `gate` (HF's name) so the fp8 converter skips it: the router stays in high precision.
        self.gate = nn.Linear(args.d_model, args.n_routed_experts, bias=False)
        # Persistent (checkpointed, exported as e_score_correction_bias) and fp32: updates of ~1e-3 would be lost
        # in bf16 next to values of order 0.1-1.
        self.register_buffer("expert_bias", torch.zeros(args.n_routed_experts, dtype=torch.float32))
        self.experts = GroupedExperts(args.d_model, args.moe_inter_dim, args.n_routed_experts)
        self.shared_experts = (
            SwiGLU(args.d_model, args.n_shared_experts * args.moe_inter_dim) if args.n_shared_experts else None
        )

    def reset_parameters(self, std: float, out_std: float) -> None:
        nn.init.normal_(self.gate.weight, mean=0.0, std=std)
        with torch.no_grad():
            self.expert_bias.zero_()
        self.experts.reset_parameters(std, out_std)
        if self.shared_experts is not None:
            self.shared_experts.reset_parameters(std, out_std)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [N, d]`` -> (gates ``[N, K]`` fp32, expert ids ``[N, K]``, scores ``[N, E]`` fp32)."""
        # Routing in fp32 even under autocast (as DeepSeek and transformers do): near-ties in bf16 would flip
        # expert choices between otherwise identical runs.
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), self.gate.weight.float())
        scores = logits.sigmoid() if self.score_func == "sigmoid" else logits.softmax(dim=-1)
        choice = scores + self.expert_bias  # the bias steers selection only; gates use the raw scores
        if self.n_groups > 1:
            n = choice.size(0)
            grouped = choice.view(n, self.n_groups, -1)
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [N, G]
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(self.topk_groups, dim=-1).indices, True)
            choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(n, -1)
        idx = choice.topk(self.top_k, dim=-1).indices
        gates = scores.gather(1, idx)
        if self.norm_topk_prob:
            gates = gates / (gates.sum(dim=-1, keepdim=True) + 1e-20)
        return gates * self.route_scale, idx, scores

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``x [B, T, d]`` -> (output ``[B, T, d]``, tokens per expert ``[E]``, sequence balance loss or None)."""
        bsz, seqlen, dim = x.shape
        flat = x.reshape(-1, dim)
        gates, idx, scores = self.route(flat)
        routed, counts = self.experts(flat, idx, gates)
        out = routed.view(bsz, seqlen, dim).to(x.dtype)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        aux = self._seq_balance_loss(scores, idx, bsz, seqlen) if (self.seq_aux and self.training) else None
        return out, counts, aux

    def _seq_balance_loss(self, scores: torch.Tensor, idx: torch.Tensor, bsz: int, seqlen: int) -> torch.Tensor:
        """DeepSeek-V3's sequence-wise balance loss ``sum_i f_i P_i``, averaged over the batch's sequences.

        ``f_i = E / (K T) * #{t: i chosen at t}`` (no gradient), ``P_i = mean_t s'_{i,t}`` with ``s'`` the scores
        normalised over all experts (a no-op for softmax). Equals 1 for perfectly uniform routing.
        """
        e, k = self.n_experts, self.top_k
        probs = scores / scores.sum(dim=-1, keepdim=True) if self.score_func == "sigmoid" else scores
        p = probs.view(bsz, seqlen, e).mean(dim=1)  # [B, E]
        # Counts by comparison rather than scatter_add (deterministic on CUDA); bool, so T*K*E bytes.
        chosen = idx.view(bsz, seqlen * k, 1) == torch.arange(e, device=idx.device)
        f = chosen.sum(dim=1).float() * (e / (k * seqlen))
        return (f * p).sum(dim=-1).mean()


# --------------------------------------------------------------------------------------------- blocks


class DeepSeekBlock(nn.Module):
    """Pre-norm block (MLA, then dense SwiGLU or MoE); the unit of checkpointing, per-block compile and FSDP.

    ``forward`` returns ``(h, expert_counts, balance_loss)`` (the last two None for dense blocks): the model
    accumulates the counts *outside* the block, so the block has no side effects (safe to recompute under
    activation checkpointing, and traceable as one graph by ``torch.compile``).
    """

    def __init__(self, args: DeepSeekArgs, layer_idx: int, moe: bool) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.d_model, args.norm_eps)
        self.attention = MLA(args, layer_idx)
        self.ffn_norm = RMSNorm(args.d_model, args.norm_eps)
        self.feed_forward: nn.Module = MoE(args) if moe else SwiGLU(args.d_model, args.dense_inter_dim)
        self.is_moe = moe

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
        cache: MLACache | None = None,
        doc_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        h = x + self.attention(self.attention_norm(x), cos, sin, cache, doc_ids)
        if not self.is_moe:
            return h + self.feed_forward(self.ffn_norm(h)), None, None
        y, counts, aux = self.feed_forward(self.ffn_norm(h))
        return h + y, counts, aux


class MultiTokenPrediction(nn.Module):
    """One MTP module (DeepSeek-V3 sec. 2.2): ``norm(block(eh_proj([enorm(emb(t+1)); hnorm(h_t)])))``."""

    def __init__(self, args: DeepSeekArgs) -> None:
        super().__init__()
        d = args.d_model
        self.enorm = RMSNorm(d, args.norm_eps)
        self.hnorm = RMSNorm(d, args.norm_eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        # Like V3's MTP layer: an MoE block, unless the model has no MoE layer at all.
        self.block = DeepSeekBlock(args, args.n_layers, moe=args.n_moe_layers > 0)
        self.norm = RMSNorm(d, args.norm_eps)

    def reset_parameters(self, std: float, out_std: float) -> None:
        self.enorm.reset_parameters()
        self.hnorm.reset_parameters()
        nn.init.normal_(self.eh_proj.weight, mean=0.0, std=std)
        self.block.reset_parameters(std, out_std)
        self.norm.reset_parameters()

    def forward(
        self,
        h: torch.Tensor,
        next_emb: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        x = self.eh_proj(torch.cat([self.enorm(next_emb), self.hnorm(h)], dim=-1))
        x, counts, aux = self.block(x, cos, sin, None, doc_ids)
        return self.norm(x), counts, aux


# --------------------------------------------------------------------------------------------- model


class DeepSeek(nn.Module):
    """DeepSeek-V3-style causal LM implementing the model protocol of ``docs/internals.md``, with the optional
    hooks ``extra_loss`` (balance loss + MTP), ``after_optimizer_step`` (bias balancing) and ``log_metrics``.

    Expert loads are accumulated on the device in two plain tensor attributes (not buffers: kept out of the
    state dict, and out of DDP's buffer broadcast, which would overwrite every rank's counts with rank 0's):
    ``moe_step_load [S, E]`` (this optimizer step, read and cleared by ``after_optimizer_step``) and
    ``moe_log_load [S, E]`` (since the last ``log_metrics``). ``S`` = MoE layers, plus 1 for an MoE MTP block
    (last row). Only forward passes in training mode count. Under data parallelism the trainer sums
    ``moe_step_load`` over ranks (``rank_summed_state``) before ``after_optimizer_step``, so every rank moves its
    biases from the global loads and they stay identical.
    """

    def __init__(self, args: DeepSeekArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.d_model)
        self.rope = DeepSeekRotary(args.qk_rope_head_dim, args.max_seq_len, args.rope_theta, args.rope_scaling)
        self.layers = nn.ModuleList(
            DeepSeekBlock(args, i, moe=i >= args.n_dense_layers) for i in range(args.n_layers)
        )
        self.norm = RMSNorm(args.d_model, args.norm_eps)
        self.output = None if args.tie_embeddings else nn.Linear(args.d_model, args.vocab_size, bias=False)
        self.mtp = MultiTokenPrediction(args) if args.mtp_depth else None
        self.n_load_slots = args.n_moe_layers + (1 if self.mtp is not None and self.mtp.block.is_moe else 0)
        self.moe_step_load: torch.Tensor | None = None
        self.moe_log_load: torch.Tensor | None = None
        self._seq_aux: torch.Tensor | None = None
        self._mtp_inputs: tuple[torch.Tensor, ...] | None = None
        if self.tok_embeddings.weight.device.type != "meta":
            self._new_accumulators(self.tok_embeddings.weight.device)

    @property
    def output_weight(self) -> torch.Tensor:
        """The ``[vocab_size, d_model]`` LM-head weight (the embedding matrix when tied)."""
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    def _new_accumulators(self, device: torch.device) -> None:
        shape = (self.n_load_slots, self.args.n_routed_experts)
        self.moe_step_load = torch.zeros(shape, device=device)
        self.moe_log_load = torch.zeros(shape, device=device)

    def moe_layers(self) -> list[MoE]:
        """The MoE modules in load-slot order (main layers, then the MTP block's)."""
        blocks = [_unwrap(layer) for layer in self.layers]
        if self.mtp is not None:
            blocks.append(_unwrap(self.mtp.block))
        return [b.feed_forward for b in blocks if b.is_moe]

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise every parameter and buffer from the current torch RNG (fixed draw order).

        Normal(0, init_std) for embeddings, linears, routers and experts; residual-branch outputs (``wo``, every
        ``w2``) get ``init_std / sqrt(2 n_layers)``; norms 1, expert biases 0, RoPE tables recomputed, load
        accumulators zeroed. Also re-probes the grouped-GEMM support for the device the model now lives on.
        """
        std = self.args.init_std
        out_std = std / math.sqrt(2 * self.args.n_layers)
        nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=std)
        self.rope.reset_parameters()
        for layer in self.layers:
            _unwrap(layer).reset_parameters(std, out_std)
        self.norm.reset_parameters()
        if self.output is not None:
            nn.init.normal_(self.output.weight, mean=0.0, std=std)
        if self.mtp is not None:
            self.mtp.reset_parameters(std, out_std)
        self._new_accumulators(self.tok_embeddings.weight.device)
        self._seq_aux = None
        self._mtp_inputs = None

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        position_ids: torch.Tensor | None = None,
        cache: MLACache | None = None,
        return_hidden: bool = False,
        doc_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``[B, T, V]``, or the final normed hidden state ``[B, T, d]`` when ``return_hidden``.

        With ``cache``, the tokens follow the ``cache.length`` cached ones and the cache advances by ``T``.
        ``doc_ids [B, T]`` (packed rows, no cache): attention stays within each document (pass ``position_ids``
        restarting per document too). In training mode, expert loads are accumulated and what ``extra_loss``
        needs is kept on ``self``.
        """
        _, seqlen = input_ids.shape
        start = 0 if cache is None else cache.length
        if position_ids is None and start + seqlen > self.args.max_seq_len:  # host ints: no sync
            raise ValueError(f"sequence of {start + seqlen} positions exceeds max_seq_len={self.args.max_seq_len}")
        cos, sin = self.rope(seqlen, start, position_ids)
        h = self.tok_embeddings(input_ids)
        counts, aux = [], []
        for layer in self.layers:
            h, c, a = layer(h, cos, sin, cache, doc_ids)
            if c is not None:
                counts.append(c)
            if a is not None:
                aux.append(a)
        if cache is not None:
            cache.advance(seqlen)
        if self.training:
            self._record(counts, first_slot=0)
            self._seq_aux = torch.stack(aux).sum() if aux else None
            self._mtp_inputs = (h, input_ids, position_ids, doc_ids) if self.mtp is not None else None
        h = self.norm(h)
        if return_hidden:
            return h
        return F.linear(h, self.output_weight)

    def _record(self, counts: list[torch.Tensor], first_slot: int) -> None:
        if not counts:
            return
        loads = torch.stack(counts).float()
        if self.moe_step_load is None or self.moe_step_load.device != loads.device:
            self._new_accumulators(loads.device)  # moved with .to() after init (eager-only situation)
        rows = slice(first_slot, first_slot + loads.size(0))
        self.moe_step_load[rows] += loads
        self.moe_log_load[rows] += loads

    def extra_loss(self, targets: torch.Tensor, loss_fn: Any) -> torch.Tensor | None:
        """Sequence-balance loss and MTP loss of the last training forward, **summed over tokens**.

        ``seq_aux_loss_coef * (sum over MoE layers of the balance loss) * n_target_tokens``, plus
        ``mtp_loss_weight * loss_fn(mtp_hidden, output_weight, mtp_targets)`` where position ``t`` predicts
        ``targets[t + 1]`` (the last position has no target: ``IGNORE_INDEX``). None in eval mode, so
        validation losses stay plain next-token losses. Consumes the state kept by ``forward``.
        """
        if not self.training:
            return None
        total: torch.Tensor | None = None
        aux = self._seq_aux
        if self._mtp_inputs is not None:
            h, input_ids, position_ids, doc_ids = self._mtp_inputs
            seqlen = input_ids.size(1)
            # Input at t is token t+1: input_ids[t+1], and for the last position the first target (inputs carry
            # real tokens where SFT targets are masked; a masked last target only feeds an ignored position).
            nxt = torch.cat([input_ids[:, 1:], targets[:, -1:].clamp_min(0)], dim=1)
            later = targets[:, 1:]  # later[t]: token t+2, what position t predicts
            if doc_ids is not None:
                # Packed rows: position t may only predict token t+2 of its own document (the last target's
                # token lies beyond the row: it counts as the last position's document, as in the main loss).
                doc_of_target = torch.cat([doc_ids[:, 2:], doc_ids[:, -1:]], dim=1)
                later = later.masked_fill(doc_of_target != doc_ids[:, :-1], IGNORE_INDEX)
            mtp_targets = F.pad(later, (0, 1), value=IGNORE_INDEX)
            cos, sin = self.rope(seqlen, 0, position_ids)
            hm, c, a = self.mtp(h, self.tok_embeddings(nxt), cos, sin, doc_ids)
            if c is not None:
                self._record([c], first_slot=self.n_load_slots - 1)
            if a is not None:
                aux = a if aux is None else aux + a
            total = self.args.mtp_loss_weight * loss_fn(hm, self.output_weight, mtp_targets)
        if aux is not None:
            n_tokens = (targets != IGNORE_INDEX).sum()
            bal = self.args.seq_aux_loss_coef * aux * n_tokens
            total = bal if total is None else total + bal
        self._seq_aux = None
        self._mtp_inputs = None
        return total

    def rank_summed_state(self) -> list[torch.Tensor]:
        """The step's expert loads, for the trainer to sum across data-parallel ranks (docs/internals.md)."""
        return [] if self.moe_step_load is None else [self.moe_step_load]

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        """Aux-loss-free balancing: ``expert_bias += bias_update_rate * sign(mean_load - load)`` per MoE layer,
        from the loads of the step's training forwards; then clears them. Device ops only (no sync)."""
        if self.moe_step_load is None or self.n_load_slots == 0:
            return
        biases = [m.expert_bias for m in self.moe_layers()]
        if self.moe_step_load.device != biases[0].device:  # moved with .to() and no training forward since
            self._new_accumulators(biases[0].device)
            return
        rate = self.args.bias_update_rate
        if rate > 0:
            load = self.moe_step_load
            delta = (load.mean(dim=-1, keepdim=True) - load).sign_().mul_(rate)
            # A slot with no tokens this step (e.g. MTP when extra_loss was not called) has delta 0.
            torch._foreach_add_(biases, list(delta.unbind(0)))
        self.moe_step_load.zero_()

    def log_metrics(self) -> dict[str, float]:
        """Expert-load statistics since the last call (one host sync), then resets them.

        ``moe/load_max`` / ``moe/load_min``: the largest / smallest fraction of a layer's tokens any expert got
        (uniform = 1/E); ``moe/load_cv``: coefficient of variation of the loads, mean over layers;
        ``moe/maxvio``: max load / mean load - 1, mean over layers (the aux-loss-free paper's MaxVio);
        ``moe/bias_absmax``: largest |expert_bias|; ``moe/l{i}_e{j}``: fraction of expert ``j`` of the first MoE
        layer ``i``. Empty when no training forward ran since the last call.
        """
        if self.moe_log_load is None or self.n_load_slots == 0:
            return {}
        bias_max = torch.stack([m.expert_bias.detach().abs().max() for m in self.moe_layers()]).max()
        packed = torch.cat([self.moe_log_load.flatten(), bias_max.view(1).to(self.moe_log_load.device)])
        packed = packed.to("cpu", torch.float64)  # the one host sync
        self.moe_log_load.zero_()
        load = packed[:-1].view(self.n_load_slots, -1)
        total = load.sum(dim=-1)
        seen = total > 0  # e.g. the MTP slot when extra_loss never ran
        if not bool(seen.any()):
            return {}
        frac = load[seen] / total[seen, None]
        mean = frac.mean(dim=-1)
        out = {
            "moe/load_max": frac.max().item(),
            "moe/load_min": frac.min().item(),
            "moe/load_cv": (frac.std(dim=-1, correction=0) / mean).mean().item(),
            "moe/maxvio": (frac.max(dim=-1).values / mean - 1).mean().item(),
            "moe/bias_absmax": packed[-1].item(),
        }
        if seen[0]:
            first = self.args.n_dense_layers
            out.update({f"moe/l{first}_e{j}": v for j, v in enumerate((load[0] / total[0]).tolist())})
        return out

    def new_cache(
        self,
        batch_size: int,
        max_len: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> MLACache:
        """An empty latent KV cache (see ``MLACache``) on the model's device and parameter dtype by default."""
        max_len, device, dtype = cache_placement(self.args, max_len, device, dtype, self.output_weight)
        return MLACache(
            self.args.n_layers,
            batch_size,
            max_len,
            self.args.kv_lora_rank + self.args.qk_rope_head_dim,
            device=device,
            dtype=dtype,
        )

    def num_params(self, non_embedding: bool = False) -> int:
        """Total parameter count (all experts, the MTP module included; a tied matrix counted once).

        ``non_embedding=True`` excludes the input embedding table only (the LM head is a matmul and stays).
        """
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.tok_embeddings.weight.numel()
        return n

    def num_active_params(self, non_embedding: bool = False, include_mtp: bool = False) -> int:
        """Parameters one token runs through: everything except the routed experts it does not use
        (``n_activated_experts`` of ``n_routed_experts`` per MoE layer). The LM head counts (once; tied or not).

        With tied embeddings and ``non_embedding=False`` the shared matrix is counted once.
        ``include_mtp`` adds the MTP module's active parameters and a second LM-head pass (training only).
        """
        a = self.args
        per_expert = 3 * a.d_model * a.moe_inter_dim
        idle = (a.n_routed_experts - a.n_activated_experts) * per_expert
        n = self.num_params() - a.n_moe_layers * idle
        if self.mtp is not None:
            mtp_total = sum(p.numel() for p in self.mtp.parameters())
            n -= mtp_total
            if include_mtp:
                n += mtp_total - (idle if self.mtp.block.is_moe else 0) + self.output_weight.numel()
        if non_embedding:
            n -= self.tok_embeddings.weight.numel()
            if self.output is None:
                n += self.output_weight.numel()  # tied: the lookup is free but the head matmul runs
        return n

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: ``6 * N_active + 6 * L_attn * n_heads * (qk_head_dim + v_head_dim) * T``.

        ``N_active`` = ``num_active_params(non_embedding=True, include_mtp=True)`` (routed experts a token does
        not use cost nothing; the MTP block and its extra LM-head pass do). The attention term is the PaLM
        ``12 L d T`` with MLA's head dims (QK^T over ``qk_head_dim``, AV over ``v_head_dim``), causal masking not
        discounted; ``L_attn`` counts the MTP block too.
        """
        a = self.args
        n = self.num_active_params(non_embedding=True, include_mtp=True)
        n_attn = a.n_layers + (1 if self.mtp is not None else 0)
        return 6 * n + 6 * n_attn * a.n_heads * (a.qk_head_dim + a.v_head_dim) * seq_len


def _unwrap(module: nn.Module) -> nn.Module:
    """The block under ``torch.compile`` (``_orig_mod``) or checkpoint wrappers (``_checkpoint_wrapped_module``)."""
    while True:
        inner = getattr(module, "_orig_mod", None)
        if inner is None:
            inner = getattr(module, "_checkpoint_wrapped_module", None)
        if inner is None:
            return module
        module = inner


# ------------------------------------------------------------------------------------------- HF interop

HF_MODEL_TYPES = ("deepseek_v3",)


def args_from_hf(config: dict[str, Any]) -> DeepSeekArgs:
    """``DeepSeekArgs`` from a (resolved) ``DeepseekV3`` ``config.json`` dict (transformers 4 or 5 rope keys).

    The router is sigmoid (what ``DeepseekV3ForCausalLM`` computes, whatever ``scoring_func`` says).
    ``mtp_depth`` is 0: MTP is a training aid; set ``model.mtp_depth = 1`` to train one (``from_hf`` then maps
    the checkpoint's ``model.layers.{n_layers}.*`` MTP weights when present). Raises ``UnsupportedHFConfig`` for
    what the native code would not reproduce exactly (the loader then falls back to transformers' own code).
    """
    if config.get("model_type") not in HF_MODEL_TYPES:
        raise UnsupportedHFConfig(f"model_type {config.get('model_type')!r}")
    if config.get("attention_bias"):
        raise UnsupportedHFConfig("attention_bias")
    if config.get("hidden_act", "silu") not in ("silu", "swish"):
        raise UnsupportedHFConfig(f"activation {config.get('hidden_act')!r}")
    rope = dict(config.get("rope_parameters") or {})
    theta = float(rope.pop("rope_theta", config.get("rope_theta", 10000.0)))
    if not rope and config.get("rope_scaling"):
        rope = dict(config["rope_scaling"])
    kind = rope.pop("rope_type", rope.pop("type", "default"))
    if float(rope.pop("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedHFConfig("partial rotary embeddings")
    scaling = None if kind == "default" else {"type": kind, **rope}
    if kind not in ("default", "linear", "llama3", "yarn"):
        raise UnsupportedHFConfig(f"rope type {kind!r}")
    n_heads = int(config["num_attention_heads"])
    if int(config.get("num_key_value_heads") or n_heads) != n_heads:
        raise UnsupportedHFConfig("num_key_value_heads != num_attention_heads")
    return DeepSeekArgs(
        d_model=int(config["hidden_size"]),
        n_layers=int(config["num_hidden_layers"]),
        n_heads=n_heads,
        vocab_size=int(config["vocab_size"]),
        max_seq_len=int(config.get("max_position_embeddings", 4096)),
        q_lora_rank=config.get("q_lora_rank"),
        kv_lora_rank=int(config["kv_lora_rank"]),
        qk_nope_head_dim=int(config["qk_nope_head_dim"]),
        qk_rope_head_dim=int(config["qk_rope_head_dim"]),
        v_head_dim=int(config["v_head_dim"]),
        rope_theta=theta,
        rope_scaling=scaling,
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        n_routed_experts=int(config["n_routed_experts"]),
        n_shared_experts=int(config.get("n_shared_experts") or 0),
        n_activated_experts=int(config["num_experts_per_tok"]),
        moe_inter_dim=int(config["moe_intermediate_size"]),
        dense_inter_dim=int(config["intermediate_size"]),
        n_dense_layers=min(int(config.get("first_k_dense_replace") or 0), int(config["num_hidden_layers"])),
        score_func="sigmoid",
        route_scale=float(config.get("routed_scaling_factor", 1.0)),
        norm_topk_prob=bool(config.get("norm_topk_prob", True)),
        n_expert_groups=int(config.get("n_group") or 1),
        n_limited_groups=int(config.get("topk_group") or 1),
        mtp_depth=0,
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        init_std=float(config.get("initializer_range", 0.02)),
        hf_rope_interleave=bool(config.get("rope_interleave", True)),
    )


def hf_config(args: DeepSeekArgs, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """A ``config.json`` dict for ``DeepseekV3ForCausalLM`` (transformers 5 ``rope_parameters`` plus the legacy
    ``rope_theta``/``rope_scaling`` keys that transformers 4, vLLM and SGLang read). ``base``: the config of the
    model the run started from, if any; its other keys (token ids, ...) are kept underneath ours."""
    if args.score_func != "sigmoid":
        raise ConfigError("DeepseekV3ForCausalLM routes with sigmoid scores; a softmax router cannot be exported")
    rope_params: dict[str, Any] = {"rope_type": "default", "rope_theta": args.rope_theta}
    legacy_scaling = None
    if args.rope_scaling:
        extra = {k: v for k, v in args.rope_scaling.items() if k not in ("type", "rope_type")}
        rope_params.update(extra, rope_type=_rope_kind(args.rope_scaling))
        legacy_scaling = {"type": _rope_kind(args.rope_scaling), **extra}
    cfg: dict[str, Any] = dict(base) if base and base.get("model_type") == "deepseek_v3" else {}
    for stale in ("auto_map", "torch_dtype", "dtype", "quantization_config"):
        cfg.pop(stale, None)
    cfg.update({
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": args.vocab_size,
        "hidden_size": args.d_model,
        "intermediate_size": args.dense_inter_dim,
        "moe_intermediate_size": args.moe_inter_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_heads,
        "n_shared_experts": args.n_shared_experts,
        "n_routed_experts": args.n_routed_experts,
        "num_experts_per_tok": args.n_activated_experts,
        "routed_scaling_factor": args.route_scale,
        "norm_topk_prob": args.norm_topk_prob,
        "n_group": args.n_expert_groups,
        "topk_group": args.n_limited_groups,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "first_k_dense_replace": args.n_dense_layers,
        "kv_lora_rank": args.kv_lora_rank,
        "q_lora_rank": args.q_lora_rank,
        "qk_nope_head_dim": args.qk_nope_head_dim,
        "qk_rope_head_dim": args.qk_rope_head_dim,
        "v_head_dim": args.v_head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "rope_parameters": rope_params,
        "rope_theta": args.rope_theta,
        "rope_scaling": legacy_scaling,
        "rope_interleave": args.hf_rope_interleave,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": args.tie_embeddings,
        "initializer_range": args.init_std,
        "num_nextn_predict_layers": args.mtp_depth,
        "use_cache": True,
    })
    return cfg


def _rope_perm(rope_dim: int) -> torch.Tensor:
    """Row order taking interleaved rope pairs ``(x0, x1), (x2, x3), ...`` to rotate_half's ``[evens; odds]``."""
    return torch.cat([torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)])


def _permute_q(w: torch.Tensor, args: DeepSeekArgs, perm: torch.Tensor) -> torch.Tensor:
    """Reorder the rope rows of each head of a ``[H * (nope + rope), in]`` query weight."""
    heads = w.reshape(-1, args.qk_head_dim, w.size(-1))
    rope = heads[:, args.qk_nope_head_dim :][:, perm]
    return torch.cat([heads[:, : args.qk_nope_head_dim], rope], dim=1).reshape(w.shape)


def _permute_kv_a(w: torch.Tensor, args: DeepSeekArgs, perm: torch.Tensor) -> torch.Tensor:
    """Reorder the rope rows (the last ``qk_rope_head_dim``) of ``wkv_a``."""
    return torch.cat([w[: args.kv_lora_rank], w[args.kv_lora_rank :][perm]], dim=0)


def _layer_names(args: DeepSeekArgs, moe: bool) -> list[tuple[str, str]]:
    """(ours, HF) name suffixes of one decoder layer's tensors, routed experts excepted (stacked per expert)."""
    names = [
        ("attention_norm.weight", "input_layernorm.weight"),
        ("ffn_norm.weight", "post_attention_layernorm.weight"),
        ("attention.wkv_a.weight", "self_attn.kv_a_proj_with_mqa.weight"),
        ("attention.kv_norm.weight", "self_attn.kv_a_layernorm.weight"),
        ("attention.wkv_b.weight", "self_attn.kv_b_proj.weight"),
        ("attention.wo.weight", "self_attn.o_proj.weight"),
    ]
    if args.q_lora_rank is None:
        names.append(("attention.wq.weight", "self_attn.q_proj.weight"))
    else:
        names += [
            ("attention.wq_a.weight", "self_attn.q_a_proj.weight"),
            ("attention.q_norm.weight", "self_attn.q_a_layernorm.weight"),
            ("attention.wq_b.weight", "self_attn.q_b_proj.weight"),
        ]
    if not moe:
        return names + [
            ("feed_forward.w1.weight", "mlp.gate_proj.weight"),
            ("feed_forward.w3.weight", "mlp.up_proj.weight"),
            ("feed_forward.w2.weight", "mlp.down_proj.weight"),
        ]
    names += [
        ("feed_forward.gate.weight", "mlp.gate.weight"),
        ("feed_forward.expert_bias", "mlp.gate.e_score_correction_bias"),
    ]
    if args.n_shared_experts:
        names += [
            ("feed_forward.shared_experts.w1.weight", "mlp.shared_experts.gate_proj.weight"),
            ("feed_forward.shared_experts.w3.weight", "mlp.shared_experts.up_proj.weight"),
            ("feed_forward.shared_experts.w2.weight", "mlp.shared_experts.down_proj.weight"),
        ]
    return names


_EXPERT_NAMES = (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))
_MTP_NAMES = [
    ("mtp.enorm.weight", "enorm.weight"),
    ("mtp.hnorm.weight", "hnorm.weight"),
    ("mtp.eh_proj.weight", "eh_proj.weight"),
    ("mtp.norm.weight", "shared_head.norm.weight"),
]


def _q_weight(args: DeepSeekArgs) -> tuple[str, str]:
    """(ours, HF) suffix of the projection whose rows hold the query rope dims."""
    if args.q_lora_rank is None:
        return "attention.wq.weight", "self_attn.q_proj.weight"
    return "attention.wq_b.weight", "self_attn.q_b_proj.weight"


def _block_plan(args: DeepSeekArgs) -> list[tuple[str, str, bool]]:
    """(our prefix, HF prefix, is MoE) for every block, the MTP block last."""
    plan = [(f"layers.{i}.", f"model.layers.{i}.", i >= args.n_dense_layers) for i in range(args.n_layers)]
    if args.mtp_depth:
        plan.append(("mtp.block.", f"model.layers.{args.n_layers}.", args.n_moe_layers > 0))
    return plan


def from_hf(state_dict: dict[str, torch.Tensor], args: DeepSeekArgs) -> dict[str, torch.Tensor]:
    """A ``DeepseekV3ForCausalLM`` state dict -> ours (for ``args``, e.g. from ``args_from_hf``).

    Accepts the on-disk layout (``mlp.experts.{e}.{gate,up,down}_proj.weight``) and transformers 5's in-memory
    fused one (``mlp.experts.gate_up_proj`` / ``down_proj``). MTP weights at ``model.layers.{n_layers}.*`` are
    mapped when ``args.mtp_depth`` is 1 and dropped otherwise (as are their copies of the embedding and head).
    Raises ``UserError`` on missing or unexpected tensors.
    """
    sd = dict(state_dict)
    out: dict[str, torch.Tensor] = {}
    perm = _rope_perm(args.qk_rope_head_dim) if args.hf_rope_interleave else None

    def take(name: str) -> torch.Tensor:
        if name not in sd:
            raise UserError(f"DeepSeek checkpoint lacks tensor {name!r} (does it match its config.json?)")
        return sd.pop(name)

    out["tok_embeddings.weight"] = take("model.embed_tokens.weight")
    out["norm.weight"] = take("model.norm.weight")
    if args.tie_embeddings:
        sd.pop("lm_head.weight", None)
    else:
        out["output.weight"] = take("lm_head.weight")
    for ours, hf, moe in _block_plan(args):
        for o, h in _layer_names(args, moe):
            out[ours + o] = take(hf + h)
        if perm is not None:
            q = ours + _q_weight(args)[0]
            out[q] = _permute_q(out[q], args, perm)
            kv = ours + "attention.wkv_a.weight"
            out[kv] = _permute_kv_a(out[kv], args, perm)
        if not moe:
            continue
        bias = ours + "feed_forward.expert_bias"
        out[bias] = out[bias].float()
        ex = ours + "feed_forward.experts."
        if hf + "mlp.experts.gate_up_proj" in sd:  # transformers 5 in-memory layout
            w13 = take(hf + "mlp.experts.gate_up_proj")
            out[ex + "w1"], out[ex + "w3"] = (t.contiguous() for t in w13.chunk(2, dim=1))
            out[ex + "w2"] = take(hf + "mlp.experts.down_proj")
        else:
            for o, h in _EXPERT_NAMES:
                out[ex + o] = torch.stack(
                    [take(f"{hf}mlp.experts.{e}.{h}.weight") for e in range(args.n_routed_experts)]
                )
    mtp_prefix = f"model.layers.{args.n_layers}."
    if args.mtp_depth:
        for o, h in _MTP_NAMES:
            out[o] = take(mtp_prefix + h)
    leftover = [
        k for k in sd
        if not k.startswith(mtp_prefix) and not k.endswith("rotary_emb.inv_freq")
    ]
    if leftover:
        raise UserError(f"DeepSeek checkpoint has {len(leftover)} unexpected tensors, e.g. {leftover[:3]}")
    return out


def to_hf(state_dict: dict[str, torch.Tensor], args: DeepSeekArgs) -> dict[str, torch.Tensor]:
    """Our state dict -> the on-disk ``DeepseekV3ForCausalLM`` layout (per-expert tensors, interleaved rope
    rows when ``hf_rope_interleave``), loadable by transformers 4/5 ``from_pretrained``, vLLM and SGLang.

    An MTP module goes to ``model.layers.{n_layers}.*`` (DeepSeek's layout; transformers' main model ignores
    it), without copies of the shared embedding and head.
    """
    sd = dict(state_dict)
    out: dict[str, torch.Tensor] = {}
    inv = torch.argsort(_rope_perm(args.qk_rope_head_dim)) if args.hf_rope_interleave else None
    out["model.embed_tokens.weight"] = sd.pop("tok_embeddings.weight")
    out["model.norm.weight"] = sd.pop("norm.weight")
    if not args.tie_embeddings:
        out["lm_head.weight"] = sd.pop("output.weight")
    for ours, hf, moe in _block_plan(args):
        for o, h in _layer_names(args, moe):
            out[hf + h] = sd.pop(ours + o)
        if inv is not None:
            q = hf + _q_weight(args)[1]
            out[q] = _permute_q(out[q], args, inv)
            kv = hf + "self_attn.kv_a_proj_with_mqa.weight"
            out[kv] = _permute_kv_a(out[kv], args, inv)
        if moe:
            ex = ours + "feed_forward.experts."
            for o, h in _EXPERT_NAMES:
                for e, w in enumerate(sd.pop(ex + o).unbind(0)):
                    out[f"{hf}mlp.experts.{e}.{h}.weight"] = w.contiguous()
    if args.mtp_depth:
        for o, h in _MTP_NAMES:
            out[f"model.layers.{args.n_layers}.{h}"] = sd.pop(o)
    if sd:
        raise ValueError(f"to_hf: unmapped tensors {sorted(sd)[:5]}")
    return out
