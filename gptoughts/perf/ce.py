"""Cross-entropy of the LM head without the ``[tokens, vocab]`` fp32 logits of the whole batch.

``plain``: ``F.linear`` then ``F.cross_entropy`` on fp32 logits. Simple, but at 16k tokens × 32k vocab it holds
~1 GiB of bf16 logits plus ~2 GiB of fp32 logits and the same again for their gradient at the peak.

``chunked``: a custom autograd function that walks the rows in chunks and, for each chunk, computes the
logits, the loss, and right away the gradients w.r.t. the hidden states and the head weight (the gradient of
cross-entropy w.r.t. logits, softmax − one-hot, is known in the forward pass). Only one chunk of logits ever
exists; backward just scales the stored gradients. Same FLOPs as plain (the three matmuls move from backward
into forward). The per-chunk body is compiled when compile is on, fusing the softmax/gather/subtract passes
into few kernels. This is the technique of Liger-Kernel's fused linear cross-entropy, written in PyTorch so
it runs (and is tested) on CPU too; bench measures it against ``liger`` where that package is installed.

``softcap`` (every kind): the logits are ``cap * tanh(logits / cap)`` (``models.layers.softcap``, the model's
``logit_softcap``); the chunked gradient is multiplied by the cap's derivative ``1 - (z / cap)²``, computed from
the capped logits in place, so the cap adds no ``[rows, vocab]`` buffer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from gptoughts.errors import UserError
from gptoughts.models.layers import softcap as apply_softcap

IGNORE_INDEX = -100


def plain_linear_ce(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, softcap: float | None = None
) -> torch.Tensor:
    logits = F.linear(hidden.reshape(-1, hidden.shape[-1]), weight)
    logits = apply_softcap(logits.float(), softcap)
    return F.cross_entropy(logits, targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")


def _chunk_grads(
    h: torch.Tensor,
    w: torch.Tensor,
    t: torch.Tensor,
    need_w: bool = True,
    token_weight: torch.Tensor | None = None,
    softcap: float | None = None,
    logit_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Loss sum, d loss / d h, and d loss / d w (fp32; None when the head is frozen) for one chunk of rows.

    ``token_weight`` (optional, per row, no gradient) scales each row's loss and gradient (LLaDA's 1/t).
    ``softcap``: the loss of ``cap * tanh(logits / cap)``.
    ``logit_grad``: the third value is d loss / d logits (in ``h``'s dtype) instead, for the caller to
    accumulate the weight gradient itself (:func:`accumulate_weight_grad`).
    """
    logits = (h @ w.t()).float()
    if softcap is not None:
        logits = apply_softcap(logits, softcap)
    valid = t != IGNORE_INDEX
    safe_t = torch.where(valid, t, 0)
    scale = valid.float() if token_weight is None else torch.where(valid, token_weight, 0.0)
    lse = torch.logsumexp(logits, dim=-1)
    target_logit = logits.gather(1, safe_t.unsqueeze(1)).squeeze(1)
    loss = ((lse - target_logit) * scale).sum()
    g = ce_logit_grad(logits, lse, safe_t, scale, fused=torch.compiler.is_compiling())
    grad_h, grad_w = head_input_grads(g, logits, h, w, softcap=softcap, need_w=need_w, logit_grad=logit_grad)
    return loss, grad_h, grad_w


def head_input_grads(
    g: torch.Tensor,
    logits: torch.Tensor,
    h: torch.Tensor,
    w: torch.Tensor,
    *,
    softcap: float | None,
    need_w: bool,
    logit_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """From ``g`` = d loss / d (capped) ``logits`` (fp32, ``[rows, vocab]``): d loss / d ``h`` and d loss / d ``w``
    (fp32; None when ``need_w`` is false), or with ``logit_grad`` d loss / d logits in ``h``'s dtype as the second
    value. ``logits`` (the capped ones when ``softcap``) are overwritten."""
    if softcap is not None:
        # Chain rule through the cap: d z / d logits = 1 - (z / cap)². The capped logits are dead past this
        # point, so they become the factor in place (eager: no extra [rows, vocab] buffer).
        g = g * logits.div_(softcap).square_().neg_().add_(1.0)
    g = g.to(h.dtype)
    grad_h = g @ w
    if logit_grad:
        return grad_h, g
    # A frozen head (LoRA with tied embeddings) needs no weight gradient: skipping it saves a third of the
    # head's matmuls and the [V, d] fp32 accumulator.
    grad_w = (g.t() @ h).float() if need_w else None
    return grad_h, grad_w


def ce_logit_grad(
    logits: torch.Tensor, lse: torch.Tensor, safe_t: torch.Tensor, scale: torch.Tensor, *, fused: bool
) -> torch.Tensor:
    """d CE / d logits = (softmax - one-hot) * scale, fp32, for ``[rows, vocab]`` logits.

    ``fused`` (under compile): one element-wise expression (the one-hot as ``iota == target``) that inductor
    turns into a single pass reading the logits and writing the gradient in the compute dtype. The eager form
    (in-place scatter and scale) allocates less outside compile, but under compile its scatter forces the
    fp32 softmax out to memory and back: at 4096 rows x 128k vocab that is 4 GB of extra traffic per chunk.
    """
    if fused:
        onehot = torch.arange(logits.shape[1], device=logits.device) == safe_t.unsqueeze(1)
        return (torch.exp(logits - lse.unsqueeze(1)) - onehot.float()) * scale.unsqueeze(1)
    g = torch.exp(logits - lse.unsqueeze(1))
    g.scatter_add_(1, safe_t.unsqueeze(1), torch.full_like(lse, -1.0).unsqueeze(1))
    return g.mul_(scale.unsqueeze(1))


def accumulate_weight_grad(grad_w: torch.Tensor, g: torch.Tensor, h: torch.Tensor) -> None:
    """``grad_w += g.T @ h`` with ``grad_w`` fp32 and ``g``, ``h`` bf16/fp16: the matmul accumulates into the fp32
    buffer in its epilogue (cuBLAS with an fp32 C and D), instead of writing a bf16 product, casting it to fp32
    and adding it in two more passes over the ``[vocab, d]`` buffer. Per chunk that is 8 bytes of traffic per
    weight instead of 20 (2 written, 6 to widen, 12 to add), and one bf16 rounding fewer (measured faster:
    ``docs/performance.md``)."""
    torch.addmm(grad_w, g.t(), h, out_dtype=torch.float32, out=grad_w)


_IN_GEMM: dict[tuple[str, torch.dtype], bool] = {}


def wgrad_in_gemm(grad_w: torch.Tensor, h: torch.Tensor) -> bool:
    """Whether :func:`accumulate_weight_grad` runs here: CUDA, a 16-bit compute dtype and a torch whose
    ``addmm`` takes an fp32 accumulator with 16-bit inputs (checked once per device type and dtype on a tiny
    product, against the two-pass result)."""
    if not grad_w.is_cuda or h.dtype not in (torch.bfloat16, torch.float16):
        return False
    key = (str(grad_w.device), h.dtype)
    if key not in _IN_GEMM:
        # The check reads its result on the host: not inside a graph being captured.
        if torch.cuda.is_current_stream_capturing():
            return False
        a = torch.arange(64, device=h.device, dtype=h.dtype).reshape(16, 4) / 8
        b = torch.arange(48, device=h.device, dtype=h.dtype).reshape(16, 3) / 8
        acc = torch.ones(4, 3, device=h.device)
        try:
            accumulate_weight_grad(acc, a, b)
            ok = bool(torch.allclose(acc, 1 + a.float().t() @ b.float()))
        except (RuntimeError, TypeError):  # an older torch: no out_dtype, or no fp32 accumulator
            ok = False
        _IN_GEMM[key] = ok
    return _IN_GEMM[key]


_compiled_chunk: Callable | None = None


def _chunk_fn(compiled: bool) -> Callable:
    global _compiled_chunk
    if not compiled:
        return _chunk_grads
    # need_w, logit_grad: Python bools, dynamo specialises on them (a graph per value)
    if _compiled_chunk is None:
        _compiled_chunk = torch.compile(_chunk_grads, dynamic=False)
    return _compiled_chunk


class _ChunkedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        chunk_size: int,
        compute_dtype: torch.dtype,
        compiled: bool,
        token_weight: torch.Tensor | None,
        softcap: float | None,
    ) -> torch.Tensor:
        h_all = hidden.to(compute_dtype)
        w = weight.to(compute_dtype)
        fn = _chunk_fn(compiled)
        need_w = bool(ctx.needs_input_grad[1])
        n = h_all.shape[0]
        grad_h = torch.empty_like(h_all)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        in_gemm = grad_w is not None and wgrad_in_gemm(grad_w, h_all)
        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            tw = token_weight[start:end] if token_weight is not None else None
            h_c = h_all[start:end]
            l_c, gh, gw = fn(h_c, w, targets[start:end], need_w, tw, softcap, in_gemm)
            loss += l_c
            grad_h[start:end] = gh
            if in_gemm:
                accumulate_weight_grad(grad_w, gw, h_c)
            elif grad_w is not None:
                grad_w += gw
        ctx.save_for_backward(grad_h, grad_w)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_h, grad_w = ctx.saved_tensors
        h_dtype, w_dtype = ctx.dtypes
        gw = (grad_w * grad_out).to(w_dtype) if grad_w is not None else None
        return (grad_h * grad_out).to(h_dtype), gw, None, None, None, None, None, None


def chunked_linear_ce(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk_size: int = 4096,
    compiled: bool = False,
    token_weight: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Summed CE of ``hidden @ weight.T`` (soft-capped when ``softcap``) against ``targets`` with one chunk of
    logits alive at a time; with ``token_weight``, each token's term is multiplied by its weight."""
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1)
    tw = token_weight.reshape(-1).float().detach() if token_weight is not None else None
    if torch.is_autocast_enabled(h.device.type):
        compute_dtype = torch.get_autocast_dtype(h.device.type)
    else:
        compute_dtype = h.dtype
    with torch.autocast(h.device.type, enabled=False):
        return _ChunkedLinearCE.apply(h, weight, t, chunk_size, compute_dtype, compiled, tw, softcap)


def liger_linear_ce(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, softcap: float | None = None
) -> torch.Tensor:
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    h, w = hidden.reshape(-1, hidden.shape[-1]), weight
    if torch.is_autocast_enabled(h.device.type):
        dtype = torch.get_autocast_dtype(h.device.type)
        h, w = h.to(dtype), weight.to(dtype)
    # Liger's kernel applies the same tanh cap (its ``softcap`` argument) inside its fused pass; the argument is
    # passed only when set, so versions without it still run uncapped models.
    cap = {} if softcap is None else {"softcap": softcap}
    return liger_fused_linear_cross_entropy(
        h, w, targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum", **cap
    )


def make_loss(kind: str, *, compiled: bool = False, chunk_size: int = 4096) -> Callable:
    """``plain``, ``chunked`` or ``liger`` -> fn(hidden, weight, targets, *, softcap=None) returning the summed
    loss (the objective passes the model's ``logit_softcap``)."""
    if kind == "plain":
        return plain_linear_ce
    if kind == "chunked":
        return lambda h, w, t, *, softcap=None: chunked_linear_ce(
            h, w, t, chunk_size=chunk_size, compiled=compiled, softcap=softcap
        )
    if kind == "liger":
        return liger_linear_ce
    raise ValueError(kind)


def loss_rule(loss: str, device: torch.device) -> str:
    """The loss kernel ``perf.loss`` asks for on ``device`` (auto: chunked on CUDA, plain elsewhere): what a run
    computes and what its memory estimate counts."""
    if loss != "auto":
        if loss == "liger":
            try:
                import liger_kernel  # noqa: F401
            except ImportError:
                raise UserError("perf.loss = liger needs liger-kernel: pip install liger-kernel") from None
        return loss
    return "chunked" if device.type == "cuda" else "plain"
