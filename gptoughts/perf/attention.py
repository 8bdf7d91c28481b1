"""Attention kernels beside SDPA: FlashAttention-4 and FlexAttention for packed rows.

``models/layers.sdpa`` routes each attention call; this module makes the kernels it may route to (model code
neither imports nor compiles them, DESIGN principle 1) and says which ones this machine can run:

* ``FA4``: FlashAttention-4 (``flash-attn-4``, module ``flash_attn.cute``, CuTe-DSL kernels for Hopper and
  Blackwell) for the mask-free causal or bidirectional case and sliding windows, GQA included. Called
  directly, not through torch's ``activate_flash_attention_impl("FA4")`` prototype (docs/performance.md).
* ``FlexDocAttention``: packed rows (``doc_ids``) through ``torch.nn.attention.flex_attention`` with a
  ``BlockMask`` (same document, causal, optional window): whole blocks outside the documents are skipped and
  k/v heads are shared (GQA), where the dense-mask path materialises a ``[B, 1, T, T]`` mask, runs the
  memory-efficient kernel over every block and repeats k/v ``n_heads / n_kv_heads`` times.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

FA4_INSTALL = "pip install flash-attn-4 (or 'gptoughts[fa4]')"


# --------------------------------------------------------------------------------------------- availability


def fa4_unavailable(device: torch.device) -> str | None:
    """Why FlashAttention-4 cannot run on ``device`` (one line), or None when it can."""
    if device.type != "cuda":
        return f"FlashAttention-4 needs an NVIDIA Hopper or Blackwell GPU, this run is on {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        return f"FlashAttention-4 needs a Hopper or Blackwell GPU (sm90+), this one is sm{major}{minor}"
    try:
        import flash_attn.cute  # noqa: F401
    except Exception as e:  # ImportError, or a CUDA/CuTe-DSL library that does not load
        return f"flash_attn.cute does not import ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}): {FA4_INSTALL}"
    return None


def flex_unavailable(device: torch.device) -> str | None:
    """Why FlexAttention cannot train on ``device`` (one line), or None when it can."""
    if device.type != "cuda":
        # torch raises "FlexAttention does not support backward on CPU" (and MPS): forward only there
        return f"FlexAttention has no backward on {device.type} (forward only)"
    try:
        import triton  # noqa: F401
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401
    except ImportError as e:
        return f"FlexAttention needs torch.compile with Triton ({e})"
    return None


def available(device: torch.device) -> dict[str, str]:
    """Each attention backend on ``device``: "available" or why not (``gptoughts env``)."""
    out = {"sdpa": "available"}
    for name, why in (("fa4", fa4_unavailable(device)), ("flex", flex_unavailable(device))):
        out[name] = "available" if why is None else f"unavailable: {why}"
    return out


# --------------------------------------------------------------------------------------------- FlashAttention-4


@functools.cache
def _fa4_op() -> Any:
    """``gptoughts::fa4_fwd``, a ``torch.library`` custom op with a fake (meta) implementation and a backward
    (``gptoughts::fa4_bwd``), so torch.compile keeps it as one opaque node in the block's graph instead of
    tracing into CuTe-DSL's Python (flash_attn.cute's own ``FlashAttnFunc`` is a plain autograd.Function, which
    dynamo cannot trace). Defined on first use: nothing is registered at import time. Calls flash_attn.cute's
    ``_flash_attn_fwd`` / ``_flash_attn_bwd`` (what torch's own FA4 routing calls), checked against 4.0.0b36."""
    fa4_fwd = _define_fa4_fwd()
    fa4_bwd = _define_fa4_bwd()

    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        q, k, v, ctx.causal, ctx.window_left, ctx.window_right = inputs
        ctx.save_for_backward(q, k, v, *output)

    def backward(ctx: Any, dout: torch.Tensor, dlse: torch.Tensor | None) -> tuple:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = fa4_bwd(dout, q, k, v, out, lse, ctx.causal, ctx.window_left, ctx.window_right)
        return dq, dk, dv, None, None, None

    fa4_fwd.register_autograd(backward, setup_context=setup_context)
    return torch.ops.gptoughts.fa4_fwd.default


def _define_fa4_fwd() -> Any:
    """``gptoughts::fa4_fwd``: (out, lse) of ``_flash_attn_fwd``, and its fake implementation. Once only
    (:func:`_fa4_op` is cached): a second registration of the name is an error."""

    @torch.library.custom_op("gptoughts::fa4_fwd", mutates_args=())
    def fa4_fwd(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool,
        window_left: int | None,
        window_right: int | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from flash_attn.cute.interface import _flash_attn_fwd

        res = _flash_attn_fwd(
            q,
            k,
            v,
            causal=causal,
            window_size_left=window_left,
            window_size_right=window_right,
            return_lse=True,
        )
        # (out, lse, ...): the extra outputs of later versions serve MLA only. Contiguous, as the fake says:
        # inductor plans the buffers from the fake implementation's strides.
        return res[0].contiguous(), res[1].contiguous()

    @fa4_fwd.register_fake
    def _(q, k, v, causal, window_left, window_right):
        b, t, h, _ = q.shape
        return q.new_empty(b, t, h, v.size(-1)), q.new_empty(b, h, t, dtype=torch.float32)

    return fa4_fwd


def _define_fa4_bwd() -> Any:
    """``gptoughts::fa4_bwd``: (dq, dk, dv) of ``_flash_attn_bwd``, and its fake implementation (once only, as
    :func:`_define_fa4_fwd`)."""

    @torch.library.custom_op("gptoughts::fa4_bwd", mutates_args=())
    def fa4_bwd(
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        causal: bool,
        window_left: int | None,
        window_right: int | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        from flash_attn.cute.interface import _flash_attn_bwd

        res = _flash_attn_bwd(
            q,
            k,
            v,
            out,
            dout,
            lse,
            causal=causal,
            window_size_left=window_left,
            window_size_right=window_right,
            deterministic=torch.are_deterministic_algorithms_enabled(),
        )
        return res[0].contiguous(), res[1].contiguous(), res[2].contiguous()

    @fa4_bwd.register_fake
    def _(dout, q, k, v, out, lse, causal, window_left, window_right):
        return (
            q.new_empty(q.shape),
            k.new_empty(k.shape),
            v.new_empty(v.shape),
        )  # contiguous, as the real ones

    return fa4_bwd


class FA4:
    """FlashAttention-4 for ``layers.sdpa``: ``q [B, T, H, hd]``, ``k``/``v [B, T, Hkv, hd]`` -> ``[B, T, H, hd]``.

    ``accepts`` says which calls it takes; every other one (CPU, fp32, odd head sizes) stays on SDPA.
    """

    def __init__(self) -> None:
        self.op = _fa4_op()  # registered here, at setup: dynamo cannot trace a registration

    def accepts(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
        hd, hd_v = q.size(-1), v.size(-1)
        return (
            q.is_cuda
            and q.dtype in (torch.bfloat16, torch.float16)
            and k.dtype == q.dtype
            and v.dtype == q.dtype
            # FA4's SM90 kernels: head sizes 8..256 in steps of 8 (SM100: up to 128, plus 192/128 and 256)
            and 8 <= hd <= 256
            and 8 <= hd_v <= 256
            and hd % 8 == 0
            and hd_v % 8 == 0
        )

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, window: int | None
    ) -> torch.Tensor:
        # Our window: a query at i sees keys j with |i - j| < window (j <= i when causal); FA4's window sizes
        # count the keys on each side of the diagonal, the diagonal excluded.
        left = None if window is None else window - 1
        right = None if window is None or causal else window - 1
        return self.op(q, k, v, causal, left, right)[0]


# --------------------------------------------------------------------------------------------- FlexAttention


def doc_block_mask(doc_ids: torch.Tensor, *, causal: bool, window: int | None, block_size: int = 128) -> Any:
    """The ``BlockMask`` of packed rows: query ``i`` sees key ``j`` of the same document (``doc_ids [B, T]``),
    ``j <= i`` when causal, ``|i - j| < window`` with a window; the same rule as ``layers.attention_mask``."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b: torch.Tensor, h: torch.Tensor, qi: torch.Tensor, ki: torch.Tensor) -> torch.Tensor:
        ok = doc_ids[b, qi] == doc_ids[b, ki]
        if causal:
            ok = ok & (qi >= ki)
        if window is not None:
            ok = ok & ((qi - ki < window) if causal else ((qi - ki).abs() < window))
        return ok

    bsz, t = doc_ids.shape
    return create_block_mask(mask_mod, bsz, None, t, t, device=doc_ids.device, BLOCK_SIZE=block_size)


class FlexDocAttention:
    """Packed rows for ``layers.sdpa``: ``q [B, H, T, hd]``, ``k``/``v [B, Hkv, T, hd]``, ``doc_ids [B, T]``.

    ``compiled``: run ``torch.compile(flex_attention)`` (on CUDA flex is only fast compiled; uncompiled it is
    a reference that materialises the scores). Inside a compiled block dynamo inlines it either way.
    """

    def __init__(self, compiled: bool = True) -> None:
        from torch.nn.attention.flex_attention import flex_attention

        self.flex = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention
        self._last: tuple[torch.Tensor, int, bool, int | None, Any] | None = None

    def block_mask(self, doc_ids: torch.Tensor, *, causal: bool, window: int | None) -> Any:
        if torch.compiler.is_compiling():
            # In a compiled block the mask is part of the graph (inductor fuses it into a few small kernels)
            return doc_block_mask(doc_ids, causal=causal, window=window)
        # Eager: every layer of one forward gets the same doc_ids tensor; build its mask once, not per layer
        # (a strong reference to one [B, T] tensor; _version catches an in-place change of it).
        last = self._last
        if (
            last is not None
            and last[0] is doc_ids
            and last[1] == doc_ids._version
            and last[2:4] == (causal, window)
        ):
            return last[4]
        mask = doc_block_mask(doc_ids, causal=causal, window=window)
        self._last = (doc_ids, doc_ids._version, causal, window, mask)
        return mask

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        doc_ids: torch.Tensor,
        *,
        causal: bool,
        window: int | None,
    ) -> torch.Tensor:
        mask = self.block_mask(doc_ids, causal=causal, window=window)
        return self.flex(q, k, v, block_mask=mask, enable_gqa=q.size(1) != k.size(1))
