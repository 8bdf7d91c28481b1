"""The LM head of DPO: each row's summed completion log-probability and the pairs' sigmoid loss (``dpo.head``).

``plain``: the logits of every row at once (``[2B, T, V]`` fp32, and autograd keeps their log-softmax).
``chunked``: rows a chunk at a time under activation checkpointing: the backward recomputes the head matmul.
``fused`` (:func:`fused_pair_loss`): a pair's loss depends only on its two rows (and its constant reference
log-ratio), so a chunk of whole pairs gives the chunk's logits, log-probabilities, pair losses and
d loss / d log-prob (a scalar per row) at once, hence d loss / d logits, and right there the gradients w.r.t. the
chunk's hidden states (stored) and the head weight (accumulated; none for a frozen head). The backward only
scales them: no head recompute, one chunk of logits alive, the FLOPs of plain. It reuses the pieces of
``perf/ce.py``'s chunked cross-entropy (the same technique for pretraining).

Without gradients (the reference pass, evaluations), ``chunked`` and ``fused`` walk the rows in chunks too
(:func:`completion_logps`), so no step ever holds the whole batch's logits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from gptoughts.models.layers import softcap as apply_softcap
from gptoughts.perf.ce import (
    IGNORE_INDEX,
    accumulate_weight_grad,
    ce_logit_grad,
    head_input_grads,
    wgrad_in_gemm,
)


def dpo_loss(
    policy_logratio: torch.Tensor, ref_logratio: torch.Tensor, beta: float, label_smoothing: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-pair losses and reward margins ``β m`` (no gradient) of the sigmoid DPO loss."""
    margin = beta * (policy_logratio.float() - ref_logratio.float())
    losses = -(1.0 - label_smoothing) * F.logsigmoid(margin) - label_smoothing * F.logsigmoid(-margin)
    return losses, margin.detach()


def _rows_logps(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, softcap: float | None) -> torch.Tensor:
    logits = apply_softcap(F.linear(h, w).float(), softcap)
    ce = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
    return -ce.view(y.shape).sum(-1)  # ignored targets count 0


def _chunk_logps(
    h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, softcap: float | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For ``rows`` rows (``h`` ``[rows * T, d]``, ``y`` ``[rows, T]``): the fp32 (capped) logits, their
    log-sum-exp, the targets with ignored ones as 0, the valid mask and each row's summed log-probability."""
    logits = (h @ w.t()).float()
    if softcap is not None:
        logits = apply_softcap(logits, softcap)
    t = y.reshape(-1)
    valid = t != IGNORE_INDEX
    safe_t = torch.where(valid, t, 0)
    lse = torch.logsumexp(logits, dim=-1)
    target = logits.gather(1, safe_t.unsqueeze(1)).squeeze(1)
    logp = torch.where(valid, target - lse, 0.0).view(y.shape).sum(-1)
    return logits, lse, safe_t, valid, logp


def _logps_only(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return _chunk_logps(h, w, y, softcap)[-1]


_compiled: dict[str, Callable] = {}


def _logps_fn(compiled: bool) -> Callable:
    if not compiled:
        return _logps_only
    if "logps" not in _compiled:
        _compiled["logps"] = torch.compile(_logps_only, dynamic=False)
    return _compiled["logps"]


def completion_logps(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    y: torch.Tensor,
    *,
    softcap: float | None = None,
    chunk_rows: int = 0,
    compiled: bool = False,
) -> torch.Tensor:
    """Per row, the summed log-probability of its targets (``y != IGNORE_INDEX``) under ``hidden @ weight.T``.

    ``chunk_rows > 0``: the rows are walked in chunks so that only one chunk's fp32 logits exist at a time: with
    gradients each chunk runs under activation checkpointing (its head matmul is recomputed in the backward);
    without, each chunk's logits are dropped as soon as its log-probabilities are summed (``compiled``: that
    chunk under torch.compile, which fuses the fp32 cast, the log-sum-exp and the gather into few passes over
    the matmul's output)."""
    n = hidden.shape[0]
    if chunk_rows <= 0 or chunk_rows >= n:
        return _rows_logps(hidden, weight, y, softcap)
    if not torch.is_grad_enabled():
        fn, starts = _logps_fn(compiled), range(0, n, chunk_rows)
        parts = [
            fn(hidden[i : i + chunk_rows].flatten(0, 1), weight, y[i : i + chunk_rows], softcap)
            for i in starts
        ]
        return torch.cat(parts)
    parts = [
        checkpoint(
            _rows_logps,
            hidden[i : i + chunk_rows],
            weight,
            y[i : i + chunk_rows],
            softcap,
            use_reentrant=False,
        )
        for i in range(0, n, chunk_rows)
    ]
    return torch.cat(parts)


def _pair_chunk(
    h: torch.Tensor,
    w: torch.Tensor,
    y: torch.Tensor,
    ref: torch.Tensor,
    beta: float,
    label_smoothing: float,
    softcap: float | None,
    need_w: bool,
    logit_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Summed pair loss, margins ``β m``, d loss / d ``h`` and d loss / d ``w`` (see ``perf.ce.head_input_grads``)
    of the ``k`` pairs of one chunk: ``h`` ``[2k * T, d]``, ``y`` ``[2k, T]`` (chosen, rejected, ...), ``ref``
    ``[k]``."""
    logits, lse, safe_t, valid, logp = _chunk_logps(h, w, y, softcap)
    pairs = logp.view(-1, 2)
    losses, margin = dpo_loss(pairs[:, 0] - pairs[:, 1], ref, beta, label_smoothing)
    # d loss / d m for -(1 - e) log σ(m) - e log σ(-m); the chosen row's log-prob enters m with +β, the
    # rejected's with -β. d logp / d logits = one-hot - softmax, the negative of cross-entropy's gradient.
    dm = -(1.0 - label_smoothing) * torch.sigmoid(-margin) + label_smoothing * torch.sigmoid(margin)
    d_logp = torch.stack([beta * dm, -beta * dm], dim=1).reshape(-1)
    scale = torch.where(valid, -d_logp.repeat_interleave(y.shape[1]), 0.0)
    g = ce_logit_grad(logits, lse, safe_t, scale, fused=torch.compiler.is_compiling())
    grad_h, grad_w = head_input_grads(g, logits, h, w, softcap=softcap, need_w=need_w, logit_grad=logit_grad)
    return losses.sum(), margin, grad_h, grad_w


def _pair_chunk_fn(compiled: bool) -> Callable:
    if not compiled:
        return _pair_chunk
    if "pair" not in _compiled:  # need_w, logit_grad: Python bools, a graph per value
        _compiled["pair"] = torch.compile(_pair_chunk, dynamic=False)
    return _compiled["pair"]


class _FusedPairHead(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        y: torch.Tensor,
        ref: torch.Tensor,
        hyper: tuple[float, float, float | None],
        chunk_rows: int,
        compute_dtype: torch.dtype,
        compiled: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        beta, smoothing, softcap = hyper
        n, t = y.shape
        h_all = hidden.to(compute_dtype).reshape(n * t, -1)
        w = weight.to(compute_dtype)
        need_w = bool(ctx.needs_input_grad[1])
        grad_h = torch.empty_like(h_all)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        in_gemm = grad_w is not None and wgrad_in_gemm(grad_w, h_all)
        fn = _pair_chunk_fn(compiled)
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        margins = []
        for start in range(0, n, chunk_rows):
            end = min(start + chunk_rows, n)
            h_c = h_all[start * t : end * t]
            args = (y[start:end], ref[start // 2 : end // 2], beta, smoothing, softcap, need_w, in_gemm)
            l_c, m_c, gh, gw = fn(h_c, w, *args)
            loss += l_c
            margins.append(m_c)
            grad_h[start * t : end * t] = gh
            if in_gemm:
                accumulate_weight_grad(grad_w, gw, h_c)
            elif grad_w is not None:
                grad_w += gw
        margin = torch.cat(margins)
        ctx.mark_non_differentiable(margin)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.meta = (hidden.shape, hidden.dtype, weight.dtype)
        return loss, margin

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, _grad_margin: torch.Tensor | None):
        grad_h, grad_w = ctx.saved_tensors
        shape, h_dtype, w_dtype = ctx.meta
        gh = (grad_h * grad_loss).to(h_dtype).view(shape)
        gw = (grad_w * grad_loss).to(w_dtype) if grad_w is not None else None
        return gh, gw, None, None, None, None, None, None


def fused_pair_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    y: torch.Tensor,
    ref_logratio: torch.Tensor,
    *,
    beta: float,
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    chunk_pairs: int = 1,
    compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed sigmoid DPO loss of the pairs of ``hidden`` ``[2B, T, d]`` (rows chosen, rejected, chosen, ...)
    under the head ``weight``, and the margins ``β m`` ``[B]`` (no gradient), ``chunk_pairs`` pairs' logits at a
    time (module docstring). The same values and gradients as :func:`completion_logps` then :func:`dpo_loss`."""
    if hidden.shape[0] % 2:
        raise ValueError(f"fused_pair_loss takes whole pairs (an even number of rows), got {hidden.shape[0]}")
    if torch.is_autocast_enabled(hidden.device.type):
        compute_dtype = torch.get_autocast_dtype(hidden.device.type)
    else:
        compute_dtype = hidden.dtype
    hyper = (beta, label_smoothing, softcap)
    ref = ref_logratio.detach().float()
    with torch.autocast(hidden.device.type, enabled=False):
        return _FusedPairHead.apply(hidden, weight, y, ref, hyper, 2 * chunk_pairs, compute_dtype, compiled)
