"""Multi-head Latent Attention (DeepSeek-V2 sec. 2.1) and its latent KV cache.

Queries come from ``wq`` (or the low-rank ``wq_a -> q_norm -> wq_b`` when ``q_lora_rank`` is set); keys and
values from one compressed latent ``c = kv_norm(wkv_a(x)[:kv_lora_rank])`` expanded by ``wkv_b`` into per-head
``k_nope`` and ``v``; a single decoupled RoPE key ``k_pe = wkv_a(x)[kv_lora_rank:]`` is shared by all heads.
Head dims: ``qk_nope_head_dim + qk_rope_head_dim`` for q/k, ``v_head_dim`` for v. Decoding reads the cached
latents with ``wkv_b`` absorbed into the query and the output (``MLA._absorbed``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gptoughts.models.deepseek.args import DeepSeekArgs
from gptoughts.models.layers import RMSNorm, apply_rotary, cache_buffers

__all__ = ["MLA", "MLACache"]

# DeepSeek's latent norms (q_a_layernorm, kv_a_layernorm) use their class default eps, not rms_norm_eps.
_LATENT_NORM_EPS = 1e-6


class MLACache:
    """KV cache of MLA: per layer and token, the normed latent ``c`` and the rotated rope key, ``[B, max_len,
    kv_lora_rank + qk_rope_head_dim]`` (576 numbers per token for V2/V3 shapes, against 2 * heads * 128-192 for
    expanded keys and values). Attention over the cache uses the absorbed form (``wkv_b`` folded into the
    query and the output), so the expanded k/v are never materialised. Same interface as ``layers.KVCache``:
    ``length`` is a host int, ``update`` once per layer, ``advance`` once per forward; the buffers are allocated
    at the first ``update``, in its dtype and on its device unless ``dtype``/``device`` say otherwise.
    """

    def __init__(
        self,
        n_layers: int,
        batch_size: int,
        max_len: int,
        dim: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.n_layers = n_layers
        self.shape = (batch_size, max_len, dim)
        self.device, self.dtype = device, dtype
        self.latent: list[torch.Tensor] = []
        self.batch_size = batch_size
        self.max_len = max_len
        self.length = 0

    def update(self, layer_idx: int, latent: torch.Tensor) -> torch.Tensor:
        """Store ``latent [B, T, dim]`` at positions ``length .. length+T``; return all cached ``[B, length+T, dim]``."""
        start, end = self.length, self.length + latent.size(1)
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: {end} positions needed, cache holds {self.max_len}")
        if not self.latent:
            self.latent = cache_buffers(self.n_layers, self.shape, latent, self.device, self.dtype)
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
            out = _causal_sdpa(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.softmax_scale, doc_ids
            )
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
