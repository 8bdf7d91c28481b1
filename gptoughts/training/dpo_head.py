"""The LM head of DPO: each row's summed completion log-probability and the pairs' sigmoid loss (``dpo.head``).

``plain``: the logits of every row at once (``[2B, T, V]`` fp32, and autograd keeps their log-softmax).
``chunked``: rows a chunk at a time under activation checkpointing: the backward recomputes the head matmul.
``fused`` (:func:`fused_pair_loss`): a pair's loss depends only on its two rows (and its constant reference
log-ratio), so a chunk of whole pairs gives the chunk's logits, log-probabilities, pair losses and
d loss / d log-prob (a scalar per row) at once, hence d loss / d logits, and right there the gradients w.r.t. the
chunk's hidden states (stored) and the head weight (accumulated). A frozen head (LoRA) needs no weight gradient,
so its chunks need not hold whole pairs: each stores d logp / d h, and the backward scales each row by its
d loss / d logp. No head recompute, one chunk of logits alive, the FLOPs of plain; the pieces are those of
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
    chunk_tokens: int = 0,
    compiled: bool = False,
) -> torch.Tensor:
    """Per row, the summed log-probability of its targets (``y != IGNORE_INDEX``) under ``hidden @ weight.T``.

    ``chunk_rows > 0``: only one chunk's fp32 logits exist at a time. With gradients, chunks of ``chunk_rows``
    rows run under activation checkpointing (the head matmul is recomputed in the backward). Without, the tokens
    are walked ``chunk_tokens`` at a time (0: ``chunk_rows`` rows' worth), across row boundaries, each chunk's
    logits dropped once its log-probabilities are taken (``compiled``: the chunk under torch.compile, which fuses
    the fp32 cast, the log-sum-exp and the gather into few passes over the matmul's output)."""
    n, t = y.shape
    if chunk_rows <= 0 or (chunk_rows >= n and not chunk_tokens):
        return _rows_logps(hidden, weight, y, softcap)
    if not torch.is_grad_enabled():
        fn, size = _logps_fn(compiled), chunk_tokens or chunk_rows * t
        h, per_token = hidden.reshape(n * t, -1), y.reshape(-1, 1)  # rows of one token: a log-prob per token
        parts = [fn(h[i : i + size], weight, per_token[i : i + size], softcap) for i in range(0, n * t, size)]
        return torch.cat(parts).view(n, t).sum(-1)
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


def pair_terms(
    logp: torch.Tensor, ref: torch.Tensor, beta: float, label_smoothing: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From the rows' log-probabilities ``[2k]`` (chosen, rejected, ...) and the reference log-ratios ``[k]``: the
    summed pair loss, the margins ``β m`` and d loss / d logp per row ``[2k]``."""
    pairs = logp.view(-1, 2)
    losses, margin = dpo_loss(pairs[:, 0] - pairs[:, 1], ref, beta, label_smoothing)
    # d loss / d m of -(1 - e) log σ(m) - e log σ(-m), m in units of β: the chosen row's log-prob enters with +β,
    # the rejected's with -β.
    dm = -(1.0 - label_smoothing) * torch.sigmoid(-margin) + label_smoothing * torch.sigmoid(margin)
    return losses.sum(), margin, torch.stack([beta * dm, -beta * dm], dim=1).reshape(-1)


def _chunk_grads(
    h: torch.Tensor,
    w: torch.Tensor,
    y: torch.Tensor,
    ref: torch.Tensor | None,
    hyper: tuple[float, float, float | None],
    need_w: bool,
    logit_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """One chunk of rows (``h`` ``[rows * T, d]``, ``y`` ``[rows, T]``): the rows' log-probabilities, and either
    (``ref`` given: whole pairs) the pairs' summed loss, margins, d loss / d ``h`` and d loss / d ``w`` (see
    ``perf.ce.head_input_grads``), or (``ref`` None: a frozen head) d logp / d ``h`` per token, for the caller
    to scale by each row's d loss / d logp once every row's log-probability is known."""
    beta, smoothing, softcap = hyper
    logits, lse, safe_t, valid, logp = _chunk_logps(h, w, y, softcap)
    loss = margin = None
    if ref is None:
        row_grad = torch.full_like(logp, -1.0)  # d logp / d logits = one-hot - softmax: -(CE's gradient)
    else:
        loss, margin, d_logp = pair_terms(logp, ref, beta, smoothing)
        row_grad = -d_logp
    scale = torch.where(valid, row_grad.repeat_interleave(y.shape[1]), 0.0)
    g = ce_logit_grad(logits, lse, safe_t, scale, fused=torch.compiler.is_compiling())
    grad_h, grad_w = head_input_grads(g, logits, h, w, softcap=softcap, need_w=need_w, logit_grad=logit_grad)
    return logp, grad_h, grad_w, loss, margin


def _chunk_fn(compiled: bool) -> Callable:
    if not compiled:
        return _chunk_grads
    if "grads" not in _compiled:  # need_w, logit_grad, ref None or not: a graph per case
        _compiled["grads"] = torch.compile(_chunk_grads, dynamic=False)
    return _compiled["grads"]


def _walk_pairs(
    fn: Callable,
    h_all: torch.Tensor,
    w: torch.Tensor,
    y: torch.Tensor,
    ref: torch.Tensor,
    hyper: tuple,
    rows: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A trained head, ``rows`` rows (whole pairs) a chunk: loss, margins, d loss / d h, d loss / d w (fp32)."""
    t = y.shape[1]
    grad_h = torch.empty_like(h_all)
    grad_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
    in_gemm = wgrad_in_gemm(grad_w, h_all)
    losses, margins = [], []
    for start in range(0, y.shape[0], rows):
        end = min(start + rows, y.shape[0])
        h_c = h_all[start * t : end * t]
        _, gh, gw, loss, margin = fn(h_c, w, y[start:end], ref[start // 2 : end // 2], hyper, True, in_gemm)
        grad_h[start * t : end * t] = gh
        if in_gemm:
            accumulate_weight_grad(grad_w, gw, h_c)
        else:
            grad_w += gw
        losses.append(loss)
        margins.append(margin)
    return torch.stack(losses).sum(), torch.cat(margins), grad_h, grad_w


def _walk_tokens(
    fn: Callable,
    h_all: torch.Tensor,
    w: torch.Tensor,
    y: torch.Tensor,
    ref: torch.Tensor,
    hyper: tuple,
    size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A frozen head, ``size`` tokens a chunk across rows: loss, margins, d logp / d h per token and each row's
    d loss / d logp (the backward's scale)."""
    grad_h = torch.empty_like(h_all)
    per_token = y.reshape(-1, 1)  # rows of one token: a log-prob per token
    logps = []
    for start in range(0, per_token.shape[0], size):
        end = min(start + size, per_token.shape[0])
        logp, gh, _, _, _ = fn(h_all[start:end], w, per_token[start:end], None, hyper, False, False)
        grad_h[start:end] = gh
        logps.append(logp)
    loss, margin, row_scale = pair_terms(torch.cat(logps).view(y.shape).sum(-1), ref, *hyper[:2])
    return loss, margin, grad_h, row_scale


class _FusedPairHead(torch.autograd.Function):
    """The walk over the chunks (:func:`fused_pair_loss`). A trained head is walked in whole pairs, whose loss
    gradient is known inside the chunk, so the chunk's weight gradient is accumulated right away. A frozen head
    is walked in any tokens: each chunk stores d logp / d h, scaled in the backward by its row's d loss / d logp."""

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        y: torch.Tensor,
        ref: torch.Tensor,
        hyper: tuple[float, float, float | None],
        chunk: tuple[int, int],
        compute_dtype: torch.dtype,
        compiled: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n, t = y.shape
        h_all = hidden.to(compute_dtype).reshape(n * t, -1)
        w = weight.to(compute_dtype)
        fn = _chunk_fn(compiled)
        chunk_rows, chunk_tokens = chunk
        grad_w = row_scale = None
        if ctx.needs_input_grad[1]:
            rows = 2 * max(1, chunk_rows // 2)
            loss, margin, grad_h, grad_w = _walk_pairs(fn, h_all, w, y, ref, hyper, rows)
        else:
            size = chunk_tokens or chunk_rows * t
            loss, margin, grad_h, row_scale = _walk_tokens(fn, h_all, w, y, ref, hyper, size)
        ctx.mark_non_differentiable(margin)
        ctx.save_for_backward(grad_h, grad_w, row_scale)
        ctx.meta = (hidden.shape, hidden.dtype, weight.dtype)
        return loss, margin

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, _grad_margin: torch.Tensor | None):
        grad_h, grad_w, row_scale = ctx.saved_tensors
        shape, h_dtype, w_dtype = ctx.meta
        if row_scale is None:
            gh = grad_h * grad_loss
        else:  # each row's d loss / d logp times the upstream scalar, in fp32 as the pair chunks scale
            gh = grad_h.view(shape[0], -1).float() * (row_scale * grad_loss).unsqueeze(1)
        gw = (grad_w * grad_loss).to(w_dtype) if grad_w is not None else None
        return gh.to(h_dtype).view(shape), gw, None, None, None, None, None, None


def fused_pair_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    y: torch.Tensor,
    ref_logratio: torch.Tensor,
    *,
    beta: float,
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    chunk_rows: int = 2,
    chunk_tokens: int = 0,
    compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed sigmoid DPO loss of the pairs of ``hidden`` ``[2B, T, d]`` (rows chosen, rejected, chosen, ...)
    under the head ``weight``, and the margins ``β m`` ``[B]`` (no gradient), one chunk of logits at a time
    (module docstring): a trained head ``chunk_rows`` rows (rounded down to whole pairs, at least one), a frozen
    one ``chunk_tokens`` tokens (0: ``chunk_rows`` rows' worth). The same values and gradients as
    :func:`completion_logps` then :func:`dpo_loss`."""
    if hidden.shape[0] % 2:
        raise ValueError(f"fused_pair_loss takes whole pairs (an even number of rows), got {hidden.shape[0]}")
    if torch.is_autocast_enabled(hidden.device.type):
        compute_dtype = torch.get_autocast_dtype(hidden.device.type)
    else:
        compute_dtype = hidden.dtype
    hyper = (beta, label_smoothing, softcap)
    ref = ref_logratio.detach().float()
    with torch.autocast(hidden.device.type, enabled=False):
        return _FusedPairHead.apply(
            hidden, weight, y, ref, hyper, (max(1, chunk_rows), chunk_tokens), compute_dtype, compiled
        )
