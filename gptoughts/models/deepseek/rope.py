"""DeepSeek's RoPE: the rope-scaling schemes it accepts (``linear``, ``llama3``, DeepSeek's ``yarn`` with its
``mscale_all_dim`` softmax scale) and the precomputed tables, in the rotate_half layout shared with Llama."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from gptoughts.errors import ConfigError
from gptoughts.models.layers import rope_inv_freq

__all__ = ["DeepSeekRotary", "check_rope_scaling", "rope_kind", "yarn_inv_freq", "yarn_mscale"]


def rope_kind(scaling: dict[str, Any] | None) -> str | None:
    """The scaling scheme's name (``type``, or HF's ``rope_type``); None without scaling."""
    if not scaling:
        return None
    return scaling.get("type", scaling.get("rope_type", "default"))


def check_rope_scaling(scaling: dict[str, Any] | None) -> None:
    """``ConfigError`` unless ``scaling`` is None or a complete ``linear``, ``llama3`` or ``yarn`` dict."""
    kind = rope_kind(scaling)
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


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(scale) + 1`` (1 when not extending)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(dim: int, theta: float, s: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN inverse frequencies and cos/sin factor, as ``transformers.modeling_rope_utils`` computes them."""
    factor = float(s["factor"])
    orig = float(s["original_max_position_embeddings"])
    beta_fast = float(s.get("beta_fast") or 32)
    beta_slow = float(s.get("beta_slow") or 1)
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all = s.get("mscale"), s.get("mscale_all_dim")
        if mscale and mscale_all:
            attention_factor = yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all))
        else:
            attention_factor = yarn_mscale(factor)

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
        if rope_kind(self.scaling) == "yarn":
            inv_freq, factor = yarn_inv_freq(self.dim, self.theta, self.scaling)
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
