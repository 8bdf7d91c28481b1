"""Building blocks shared by the model families: RMSNorm, RoPE, SwiGLU, attention through SDPA, KV cache.

Only what at least two families use lives here; a family's own quirks stay in its file. Everything is
single-device code: no process groups, no ``torch.compile`` calls, no fp8 (see ``docs/internals.md``).

Layout conventions (chosen so Hugging Face Llama/Qwen weights load without any permutation):

* activations are ``[B, T, H, hd]`` until attention, where they are transposed to ``[B, H, T, hd]`` for SDPA;
* RoPE uses the HF "rotate_half" layout: the first half of each head's features pairs with the second half
  (Meta's original checkpoints interleave pairs instead and need a permutation of ``wq``/``wk``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# SDPA takes ``enable_gqa`` since torch 2.5; we require >= 2.11 but keep the fallback cheap and explicit.
_SDPA_HAS_GQA = torch.torch_version.TorchVersion(torch.__version__) >= (2, 5)
# The flash kernel handles GQA natively up to this head size; beyond it SDPA would fall back to the math
# kernel, so we expand k/v ourselves instead (same rule as transformers' ``use_gqa_in_sdpa``).
_GQA_MAX_HEAD_DIM = 256


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale (no bias, no mean subtraction).

    ``F.rms_norm`` dispatches to a fused kernel (and is understood by inductor), instead of the 4-5 separate
    elementwise kernels of the hand-written HF formula.
    """

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (self.dim,), self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


# --------------------------------------------------------------------------------------------- RoPE


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None = None) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` (fp32, CPU), optionally rescaled for context extension.

    ``scaling`` is None, ``{"type": "linear", "factor": f}`` (positions divided by ``f``) or the Llama-3.1
    scheme ``{"type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings"}``. The formulas match ``transformers.modeling_rope_utils`` so that
    HF checkpoints reproduce their logits. (``"rope_type"`` is accepted as an alias of ``"type"``.)
    """
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("type", scaling.get("rope_type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling["low_freq_factor"])
        high = float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unknown rope_scaling type {kind!r} (supported: 'linear', 'llama3')")


class RotaryEmbedding(nn.Module):
    """Precomputed RoPE tables ``cos``/``sin`` of shape ``[max_seq_len, head_dim]``.

    Precomputing turns RoPE into a slice (or a gather with explicit ``position_ids``) instead of an outer
    product and two transcendental kernels per forward. The buffers are non-persistent: they are not in the
    state dict (checkpoints stay HF-shaped), so after ``to_empty()`` they must be recomputed by
    ``reset_parameters()`` (the model's ``init_weights()`` does it) even when weights are loaded afterwards.
    """

    def __init__(
        self, head_dim: int, max_seq_len: int, theta: float = 10000.0, scaling: dict[str, Any] | None = None
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_seq_len = max_seq_len
        self.theta = theta
        self.scaling = dict(scaling) if scaling else None
        rope_inv_freq(head_dim, theta, self.scaling)  # validate the scaling dict at build time, even on meta
        self.register_buffer("cos", torch.empty(max_seq_len, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_seq_len, head_dim), persistent=False)
        if self.cos.device.type != "meta":
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        # Computed in fp32 exactly as transformers does (positions * inv_freq, then cos/sin), then stored in
        # the buffer's dtype: identical tables give bit-comparable logits against HF references.
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling).to(self.cos.device)
        pos = torch.arange(self.max_seq_len, device=self.cos.device, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos.copy_(emb.cos())
        self.sin.copy_(emb.sin())

    def forward(
        self, seq_len: int, start: int = 0, position_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` broadcastable against ``[B, T, H, hd]``: ``[T, 1, hd]``, or ``[B, T, 1, hd]``
        when ``position_ids [B, T]`` is given (out-of-range ids are not checked: that would sync)."""
        if position_ids is None:
            # A slice with host ints: no gather kernel, no sync, static shape when start == 0.
            cos = self.cos[start : start + seq_len]
            sin = self.sin[start : start + seq_len]
        else:
            cos = self.cos[position_ids]
            sin = self.sin[position_ids]
        return cos.unsqueeze(-2), sin.unsqueeze(-2)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_seq_len={self.max_seq_len}, theta={self.theta}, scaling={self.scaling}"


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the HF rotate_half layout; ``cos``/``sin`` must broadcast against ``x``.

    The tables are cast to ``x``'s dtype first (as transformers does): under bf16 autocast the projections
    are bf16, and mixing in fp32 tables would promote q/k to fp32 and double the traffic of this op.
    """
    cos = cos.to(x.dtype)
    sin = sin.to(x.dtype)
    return x * cos + rotate_half(x) * sin


# --------------------------------------------------------------------------------------------- MLP


class SwiGLU(nn.Module):
    """``w2(silu(w1 x) * w3 x)``. Names follow Meta/torchtitan; HF: w1=gate_proj, w3=up_proj, w2=down_proj.

    The three projections stay separate (no fused gate/up matrix) so weights map 1:1 onto HF checkpoints and
    tensor parallelism can shard them column-/row-wise without re-splitting.
    """

    def __init__(self, dim: int, hidden_dim: int, bias: bool = False) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=bias)
        self.w2 = nn.Linear(hidden_dim, dim, bias=bias)
        self.w3 = nn.Linear(dim, hidden_dim, bias=bias)

    def reset_parameters(self, std: float, out_std: float) -> None:
        _init_linear(self.w1, std)
        _init_linear(self.w3, std)
        _init_linear(self.w2, out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def _init_linear(linear: nn.Linear, std: float) -> None:
    nn.init.normal_(linear.weight, mean=0.0, std=std)
    if linear.bias is not None:
        nn.init.zeros_(linear.bias)


# --------------------------------------------------------------------------------------------- logits


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(logits / cap)`` (Gemma 2's logit soft-capping), or ``logits`` unchanged when ``cap`` is None.

    The one formula of every path that makes logits from hidden states: the model's forward, the losses of
    ``perf/ce.py`` (whose chunked gradient uses its derivative ``1 - (z / cap)²``) and sampling.
    """
    if cap is None:
        return logits
    return torch.tanh(logits / cap) * cap


# --------------------------------------------------------------------------------------------- KV cache


class KVCache:
    """Preallocated keys and values for incremental decoding.

    One ``[B, n_kv_heads, max_len, head_dim]`` tensor pair per layer, written in place, so decoding allocates
    nothing per token. ``length`` (tokens already stored, the same for every layer) is a host int: reading
    it never syncs with the device. The model calls ``update`` once per layer, then ``advance`` once per
    forward.

    The buffers are allocated at the first ``update``, in the dtype and on the device of its keys unless
    ``dtype``/``device`` say otherwise: what attention computes in is decided outside the model (autocast,
    FSDP's mixed-precision policy, CPU offload bringing host shards to the GPU for each forward), so the
    stored parameters cannot tell it, and a cache in their fp32 would meet bf16 queries.
    """

    def __init__(
        self,
        n_layers: int,
        batch_size: int,
        n_kv_heads: int,
        max_len: int,
        head_dim: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.n_layers = n_layers
        self.shape = (batch_size, n_kv_heads, max_len, head_dim)
        self.device, self.dtype = device, dtype
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.batch_size = batch_size
        self.max_len = max_len
        self.length = 0

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``/``v`` ``[B, n_kv, T, hd]`` at positions ``length .. length+T`` of layer ``layer_idx``
        and return views of everything cached so far for that layer, ``[B, n_kv, length+T, hd]``."""
        start, end = self.length, self.length + k.size(2)
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: {end} positions needed, cache holds {self.max_len}")
        if not self.k:
            self.k = cache_buffers(self.n_layers, self.shape, k, self.device, self.dtype)
            self.v = cache_buffers(self.n_layers, self.shape, v, self.device, self.dtype)
        self.k[layer_idx][:, :, start:end] = k
        self.v[layer_idx][:, :, start:end] = v
        return self.k[layer_idx][:, :, :end], self.v[layer_idx][:, :, :end]

    def advance(self, n: int) -> None:
        self.length += n

    def reset(self) -> None:
        """Forget the cached tokens (the buffers are reused, not zeroed: stale entries are never read)."""
        self.length = 0


def cache_buffers(
    n_layers: int,
    shape: tuple[int, ...],
    like: torch.Tensor,
    device: torch.device | str | None,
    dtype: torch.dtype | None,
) -> list[torch.Tensor]:
    """One zeroed ``shape`` buffer per layer, on ``device`` in ``dtype``, each defaulting to ``like``'s (the first
    entries stored: see ``KVCache``)."""
    device = like.device if device is None else device
    dtype = like.dtype if dtype is None else dtype
    return [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]


# --------------------------------------------------------------------------------------------- attention


def attention_mask(
    tq: int,
    tk: int,
    *,
    causal: bool,
    window: int | None = None,
    doc_ids: torch.Tensor | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Boolean mask (True = may attend) of ``tq`` queries, the *last* ``tq`` of ``tk`` positions.

    ``window``: a query at position ``i`` sees keys ``j`` with ``i - j < window`` (itself included), the
    sliding window of Mistral/Qwen2 (same rule as transformers' ``sliding_window_overlay``).
    ``doc_ids [B, T]`` (``tq == tk``): tokens see only tokens of the same document (packed rows); the result
    is then ``[B, 1, T, T]``, else ``[tq, tk]``. The diagonal is always allowed, so no row is empty (an
    all-False row would make softmax NaN).
    """
    qpos = torch.arange(tk - tq, tk, device=device)
    kpos = torch.arange(tk, device=device)
    diff = qpos[:, None] - kpos[None, :]
    mask = diff >= 0 if causal else torch.ones(tq, tk, dtype=torch.bool, device=device)
    if window is not None:
        mask = mask & ((diff < window) if causal else (diff.abs() < window))
    if doc_ids is not None:
        if tq != tk:
            raise ValueError("doc_ids needs the whole sequence in one forward (no KV cache)")
        same = doc_ids[:, :, None] == doc_ids[:, None, :]
        mask = (mask & same)[:, None]
    return mask


@dataclass(frozen=True)
class AttentionKernels:
    """Kernels :func:`sdpa` may use instead of ``F.scaled_dot_product_attention`` (None: SDPA).

    Made by the training setup (``gptoughts/perf/attention.py``) and set around forwards with
    :func:`use_attention_kernels`, so that model code neither imports nor compiles them.

    * ``fa4``: mask-free attention with ``Tq == Tk`` (causal or not, sliding windows): an object with
      ``accepts(q, k, v)`` and ``__call__(q, k, v, causal=, window=)`` on ``[B, T, H, hd]`` tensors;
    * ``doc``: packed rows, ``__call__(q, k, v, doc_ids, causal=, window=)`` on ``[B, H, T, hd]`` tensors.
    """

    fa4: Any = None
    doc: Any = None


_kernels = AttentionKernels()


@contextlib.contextmanager
def use_attention_kernels(kernels: AttentionKernels) -> Iterator[None]:
    """Route :func:`sdpa`'s calls to ``kernels`` inside the block. A module-level setting, not an argument:
    it would otherwise travel through every family's forward; torch.compile guards on it like on any global."""
    global _kernels
    old, _kernels = _kernels, kernels
    try:
        yield
    finally:
        _kernels = old


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    window: int | None = None,
    doc_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention for ``q [B, H, Tq, hd]`` and ``k``/``v [B, Hkv, Tk, hd]``, ``H % Hkv == 0``.

    When ``Tk > Tq`` the queries are the *last* ``Tq`` positions (a KV-cache prefix precedes them):

    * ``Tq == Tk``: ``is_causal=True``, the flash kernel's fast path, no mask tensor;
    * ``Tq == 1``: one decoded token sees the whole prefix, so no mask at all (``is_causal=False``);
    * otherwise (prefill after a non-empty cache): an explicit bottom-right-aligned boolean mask, because
      SDPA's ``is_causal`` aligns the triangle top-left, which would hide the prefix.

    ``window`` (sliding-window attention) and ``doc_ids [B, T]`` (packed rows: no attention across
    documents) add an explicit mask from :func:`attention_mask`, but only when they change something: a
    window at least as long as the keys is ignored, so the mask-free fast path above stays the common case.
    With a mask SDPA uses the memory-efficient kernel (flash takes no mask): packed SFT rows trade some
    attention speed for not wasting the padding of one-example-per-row batches.

    The kernels set by :func:`use_attention_kernels` take what they can: ``doc`` the packed rows (``Tq ==
    Tk``), ``fa4`` the mask-free ``Tq == Tk`` calls it accepts (device, dtype, head size); the rest (cached
    prefills, decoding, CPU, fp32) stays on SDPA.
    """
    tq, tk = q.size(-2), k.size(-2)
    if window is not None and tk <= window:
        window = None  # host ints only: no sync
    kernels = _kernels
    if tq == tk:
        if doc_ids is not None and kernels.doc is not None:
            return kernels.doc(q, k, v, doc_ids, causal=causal, window=window)
        if doc_ids is None and kernels.fa4 is not None and kernels.fa4.accepts(q, k, v):
            # [B, H, T, hd] here is a transposed view of the projections' [B, T, H, hd]: FA4's layout, no copy
            out = kernels.fa4(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal, window=window
            )
            return out.transpose(1, 2)
    mask = None
    is_causal = False
    if doc_ids is not None or window is not None:
        mask = attention_mask(tq, tk, causal=causal, window=window, doc_ids=doc_ids, device=q.device)
    elif causal and tq > 1:
        if tq == tk:
            is_causal = True
        else:
            mask = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(diagonal=tk - tq)
    n_rep = q.size(1) // k.size(1)
    if n_rep == 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)
    if _SDPA_HAS_GQA and mask is None and q.size(-1) <= _GQA_MAX_HEAD_DIM:
        # Flash reads the shared k/v heads directly: no n_rep-times larger copy of k and v in memory.
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True)
    # With a mask SDPA on CUDA would pick the memory-efficient kernel, which has no GQA support, and fall back
    # to the math kernel; expanding k/v keeps the fused kernel (this path runs only with a mask: cached
    # prefills, sliding windows shorter than the keys, packed rows).
    k = k.repeat_interleave(n_rep, dim=1)
    v = v.repeat_interleave(n_rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)


class Attention(nn.Module):
    """Multi-head attention with GQA, RoPE, optional q/k bias (Qwen2) and q/k RMSNorm (Qwen3).

    ``causal=False`` gives bidirectional attention (masked-diffusion families). ``layer_idx`` selects this
    layer's slot in a ``KVCache``. ``sliding_window``: each query sees at most that many positions (itself
    included). ``forward(..., doc_ids=[B, T])``: no attention across documents of a packed row.
    """

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        *,
        layer_idx: int = 0,
        qkv_bias: bool = False,
        out_bias: bool = False,
        qk_norm: bool = False,
        norm_eps: float = 1e-5,
        causal: bool = True,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.layer_idx = layer_idx
        self.causal = causal
        self.sliding_window = sliding_window
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=qkv_bias)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=qkv_bias)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=qkv_bias)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=out_bias)
        self.q_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None

    def reset_parameters(self, std: float, out_std: float) -> None:
        for lin in (self.wq, self.wk, self.wv):
            _init_linear(lin, std)
        _init_linear(self.wo, out_std)
        if self.q_norm is not None:
            self.q_norm.reset_parameters()
            self.k_norm.reset_parameters()

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache | None = None,
        doc_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        # Head counts are inferred (-1), not taken from the config: under tensor parallelism each rank holds
        # only its shard of the heads, and this code runs unchanged.
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        # [B, T, H, hd] -> [B, H, T, hd]: a strided view; SDPA only needs the last dim contiguous.
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)
        out = sdpa(q, k, v, causal=self.causal, window=self.sliding_window, doc_ids=doc_ids)
        out = out.transpose(1, 2).reshape(bsz, seqlen, -1)
        return self.wo(out)
