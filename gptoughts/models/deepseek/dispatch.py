"""Token dispatch of the routed experts: the padded expert-sorted row layout, and the moves to it and back.

``plan`` lays assignment ``a = token * K + slot`` on row ``dest[a]`` of a ``[rows, d]`` buffer in which each
expert's rows start at a multiple of ``align`` (the grouped GEMMs' alignment); ``rows`` is a static bound, so
shapes never depend on routing and no host sync is needed. Rows no assignment lands on are padding.

Two ways to move the tokens (``DeepSeekArgs.moe_permute``):

* ``index_put``: the token's K copies ``[N*K, d]`` are materialised and scattered into zeros; the way back is
  an indexing ``yp[dest]`` (backward: a generic accumulating ``index_put``).
* ``gather``: ``PermuteRows`` / ``UnpermuteRows``, one pass each way. Forward: the rows gather their token;
  the way back gathers each token's K rows and sums them (gate-weighted or not). Backward: the inverse
  gather(-sum), with only index tensors saved (plus the expert outputs when the gates need a gradient).
  Padding rows gather token 0 instead of zeros: their outputs are never read and their output gradients are
  zero, so they add nothing to any gradient (and cost the same GEMM rows as zeros would).

``permute_tokens`` and ``combine_rows`` are the two moves, used by the one-process experts and, with a layout
of ``align = 1`` (no padding), by the expert-parallel dispatch around its all-to-alls (``parallel/ep.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "Layout",
    "PermuteRows",
    "UnpermuteRows",
    "combine_rows",
    "gather_sources",
    "permute_tokens",
    "plan",
    "row_sources",
    "row_values",
]


@dataclass
class Layout:
    """Where every assignment of one routing goes in the padded expert-sorted buffer."""

    dest: torch.Tensor
    """``[N*K]`` int64: the row of assignment ``token * K + slot`` (injective)."""
    ends: torch.Tensor
    """``[E]`` int32: the end row of each expert's group (``offs`` of ``torch._grouped_mm``); the last is ``rows``."""
    counts: torch.Tensor
    """``[E]`` int64: assignments (tokens) per expert."""
    rows: int
    """Rows of the buffer: ``N*K + E*(align-1)``, a bound that does not depend on the routing."""


def plan(idx: torch.Tensor, n_experts: int, align: int) -> Layout:
    """The layout of chosen experts ``idx [N, K]``. Sort, search and cumulative sums only: no host sync."""
    n, k = idx.shape
    e, dev = n_experts, idx.device
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)  # assignments grouped by expert
    sorted_e = flat[order]
    # First assignment of each expert in sorted order. searchsorted rather than bincount: bincount on CUDA
    # reads the max value to size its output (a host sync), and scatter_add counts are not deterministic.
    bounds = torch.searchsorted(sorted_e, torch.arange(e + 1, device=dev, dtype=sorted_e.dtype))
    counts = bounds[1:] - bounds[:-1]
    # The slack rows of the static bound go to the last group, so every row of every GEMM is defined.
    rows = n * k + e * (align - 1)
    padded = (counts + align - 1) // align * align
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    ends[-1:].fill_(rows)  # a fill kernel: `ends[-1] = rows` copies a host scalar (a sync under CUDA)
    rank = torch.arange(n * k, device=dev) - bounds[sorted_e]
    dest = torch.empty_like(order).scatter_(0, order, starts[sorted_e] + rank)
    return Layout(dest=dest, ends=ends.to(torch.int32), counts=counts, rows=rows)


def row_values(layout: Layout, values: torch.Tensor) -> torch.Tensor:
    """``values [N*K]`` (one per assignment) laid on the rows ``[rows]``, zero on padding rows. Differentiable
    in ``values``; its backward is a gather (``dest`` is injective)."""
    return values.new_zeros(layout.rows).index_put((layout.dest,), values)


def row_sources(layout: Layout, k: int) -> torch.Tensor:
    """``[rows]`` int64: the token each row holds (0 on padding rows)."""
    tokens = torch.arange(layout.dest.numel(), device=layout.dest.device) // k
    return tokens.new_zeros(layout.rows).index_put((layout.dest,), tokens)


class PermuteRows(torch.autograd.Function):
    """``x [N, d]`` -> ``xp [rows, d]``, row ``r`` = ``x[src[r]]``; backward: ``gx[t] = sum_k gxp[dest[t, k]]``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, src: torch.Tensor, dest: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(dest)
        ctx.n = x.size(0)
        return x.index_select(0, src)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (dest,) = ctx.saved_tensors
        return grad.index_select(0, dest).view(ctx.n, -1, grad.size(-1)).sum(1), None, None


class UnpermuteRows(torch.autograd.Function):
    """``yp [rows, d]`` -> ``out [N, d]`` = ``sum_k w[t, k] * yp[dest[t, k]]`` summed in fp32, with ``w`` the
    gates ``[N, K]`` (fp32) or 1 when ``gates`` is None (``k``: experts per token). ``row_w [rows]`` is ``w`` laid on the rows (0 on
    padding rows): the backward is ``gyp = gout[src] * row_w`` and, for the gates, ``<gout[t], yp[dest]>``."""

    @staticmethod
    def forward(
        ctx: Any,
        yp: torch.Tensor,
        dest: torch.Tensor,
        src: torch.Tensor,
        row_w: torch.Tensor,
        gates: torch.Tensor | None,
        k: int,
    ) -> torch.Tensor:
        n = dest.numel() // k
        y = yp.index_select(0, dest).view(n, -1, yp.size(-1))
        if gates is None:
            out = y.sum(1, dtype=torch.float32)
        else:
            out = (y.float() * gates.unsqueeze(-1)).sum(1)
        ctx.with_gates = gates is not None and ctx.needs_input_grad[4]
        # yp is saved only when the gates need their gradient (the bmm it replaces saved the [N*K, d] gather).
        ctx.save_for_backward(dest, src, row_w, yp if ctx.with_gates else None)
        ctx.n = n
        return out.to(yp.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        dest, src, row_w, yp = ctx.saved_tensors
        gyp = (grad.index_select(0, src).float() * row_w.unsqueeze(-1)).to(grad.dtype)
        ggates = None
        if ctx.with_gates:
            y = yp.index_select(0, dest).view(ctx.n, -1, yp.size(-1))
            ggates = (y.float() * grad.float().unsqueeze(1)).sum(-1)
        return gyp, None, None, None, ggates, None


def gather_sources(layout: Layout, k: int, permute: str) -> torch.Tensor | None:
    """``row_sources`` when the tokens move by ``gather``, else None (``index_put``, or no token: the gather
    path's padding rows read token 0)."""
    if permute == "gather" and layout.dest.numel() > 0:
        return row_sources(layout, k)
    return None


def permute_tokens(x: torch.Tensor, layout: Layout, k: int, src: torch.Tensor | None) -> torch.Tensor:
    """``x [N, d]`` -> ``[rows, d]``, row ``dest[t*K + j]`` holding ``x[t]``: by :class:`PermuteRows` with the
    rows' sources ``src`` (:func:`gather_sources`), or by scattering the K copies into zeros when ``src`` is None."""
    if src is not None:
        return PermuteRows.apply(x, src, layout.dest)
    # dest is injective, so this scatter and the indexing in combine_rows have backward passes without
    # colliding indices: no atomics, deterministic gradients on CUDA. (Explicit widths, not -1: a rank of an
    # expert-parallel group may receive no rows.)
    n, d = x.size(0), x.size(-1)
    copies = x.unsqueeze(1).expand(n, k, d).reshape(n * k, d)
    return x.new_zeros(layout.rows, d).index_put((layout.dest,), copies)


def combine_rows(
    yp: torch.Tensor,
    layout: Layout,
    k: int,
    gates: torch.Tensor | None,
    src: torch.Tensor | None,
    *,
    bmm: bool = False,
) -> torch.Tensor:
    """The way back of :func:`permute_tokens`: ``out[t] = sum_j w[t, j] * yp[dest[t*K + j]]`` ``[N, d]`` in
    ``yp``'s dtype, ``w`` the ``gates [N, K]`` or 1 when None (the gates already scaled the rows). ``src`` as
    given to :func:`permute_tokens`; ``bmm`` (index_put only): the weighted sum as one batched GEMV."""
    if src is not None:
        if gates is None:
            row_w = row_values(layout, torch.ones_like(layout.dest, dtype=torch.float32))
        else:
            row_w = row_values(layout, gates.detach().reshape(-1))
        return UnpermuteRows.apply(yp, layout.dest, src, row_w, gates, k)
    n = layout.dest.numel() // k
    y = yp[layout.dest].view(n, k, yp.size(-1))
    if gates is None:
        return y.sum(1, dtype=torch.float32).to(y.dtype)
    if bmm:
        # One bmm: accumulates in fp32 inside the kernel under bf16, never materialises [N, K, d] products.
        return torch.bmm(gates.unsqueeze(1).to(y.dtype), y).squeeze(1)
    return (y.float() * gates.unsqueeze(-1)).sum(1).to(y.dtype)
