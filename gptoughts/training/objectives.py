"""Training objectives: what a batch means and how its loss is computed.

An objective maps ``(model, batch)`` to ``(loss_sum, n_target_tokens)`` (both tensors on the device). The
trainer divides the sum by the number of target tokens of the whole optimizer step, over all micro-batches
and ranks, so gradient accumulation is exactly equivalent to one large batch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from gptoughts.perf.ce import IGNORE_INDEX, chunked_linear_ce, plain_linear_ce

LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class CausalLM:
    """Next-token prediction. A batch is ``(x, y)``, ``(x, y, position_ids)`` or, for packed SFT rows,
    ``(x, y, position_ids, doc_ids)`` (no attention across documents); ``y`` may hold IGNORE_INDEX."""

    name = "causal"

    def __init__(self, loss_fn: LossFn = plain_linear_ce):
        self.loss_fn = loss_fn

    def __call__(
        self, model: nn.Module, batch: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch[0], batch[1]
        position_ids = batch[2] if len(batch) > 2 else None
        # doc_ids is passed only when present, so families without packed-row support keep their signature.
        docs = {"doc_ids": batch[3]} if len(batch) > 3 else {}
        hidden = model(x, position_ids=position_ids, return_hidden=True, **docs)
        n_tokens = (y != IGNORE_INDEX).sum()
        return self.hidden_loss(_inner(model), hidden, y), n_tokens

    def hidden_loss(self, inner: nn.Module, hidden: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The summed token loss of the final hidden state ``hidden`` through ``inner``'s head (and its extra
        losses); also the loss function of a pipeline's last stage (``parallel/pp.py``)."""
        loss_fn = _capped(self.loss_fn, inner)
        loss_sum = loss_fn(hidden, inner.output_weight, y)
        if hasattr(inner, "extra_loss"):  # MoE balance, multi-token prediction: already summed over tokens
            extra = inner.extra_loss(y, loss_fn)
            if extra is not None:
                loss_sum = loss_sum + extra
        return loss_sum


def _inner(model: nn.Module) -> nn.Module:
    # DDP and torch.compile wrap the model; the protocol members live on the inner module.
    inner = model
    while not hasattr(inner, "output_weight"):
        inner = getattr(inner, "module", None) or inner._orig_mod
    return inner


def _capped(loss_fn: LossFn, inner: nn.Module) -> LossFn:
    """``loss_fn`` applying the model's logit soft-cap (``logit_softcap``, Llama's speedrun switch) when it has
    one: the loss then sees the logits ``forward`` returns. Uncapped models get ``loss_fn`` itself."""
    cap = getattr(inner, "logit_softcap", None)
    return loss_fn if cap is None else functools.partial(loss_fn, softcap=cap)


# ---------------------------------------------------------------------------------------- masked diffusion


class MaskedDiffusion:
    """LLaDA's masked-diffusion loss (Nie et al., 2025), for pretraining and SFT.

    The model reads the *clean* window ``x = batch[0]`` (``[B, L]``; no shift is involved, ``batch[1]`` only
    gives the count the trainer divides by) with each token replaced by the mask token independently with
    probability ``p = (1 - eps) t + eps``, ``t ~ U(0, 1)`` per sequence; the loss is the cross-entropy of the
    masked tokens, each weighted by ``1 / p``, summed, and divided by ``batch * length`` (the paper's
    normalisation). The trainer divides by its own count (``static_token_count``: the summed
    ``batch[1].numel()``), so the objective returns ``(loss_sum * batch[1].numel() / (batch * length),
    batch[1].numel())``: the trainer's division then yields the paper's loss, accumulation over micro-batches
    averages the micro-batches' losses, and no trainer change is needed.

    Batches: ``(x, y)`` (pretraining), ``(x, y, prompt_mask)`` (SFT, below), and for packed rows
    ``(x, y, position_ids, doc_ids[, prompt_mask])``: the ids are passed to the model, whose document mask
    keeps the bidirectional attention inside each document.

    * **Random length.** In training, with probability ``cut_prob`` (1%) a batch is cut to a random length
      ``l`` uniform on ``1..L``, rounded up to a multiple of ``cut_multiple`` (64): the rounding bounds the
      shapes a compiled model sees and keeps ``B * l`` a multiple of 16 as fp8 matmuls require (pass
      ``cut_multiple=1`` for the paper's exact draw). The normaliser is then ``B * l`` as in the paper, while
      the trainer still divides by the uncut ``B * L``: the rescaling above covers it.
    * **SFT.** A batch whose last element is a bool ``[B, L]`` tensor (True on prompt tokens) selects the SFT
      variant: prompt tokens are never masked and each sequence's loss is divided by its answer length (every
      non-prompt token; LLaDA pads answers with EOS and counts the padding as answer), then averaged over
      sequences (normaliser ``B``). This needs the trainer's ``static_token_count=True``: with a dynamic count
      of ``y != -100`` the rescaling would not cancel. No random-length cut in SFT. The causal SFT rows of
      ``data/sft.py`` (shifted ``(x, y)``) do not carry this layout: LLaDA needs unshifted sequences.
    * **Randomness.** In training, ``t``, the masks and the cut are drawn from torch's global RNG (the cut on
      the CPU, so deciding it costs no device sync), so ``torch.manual_seed`` reproduces them and the
      trainer's saved RNG state resumes them exactly. In eval mode (``model.training`` False) they come from a
      private generator seeded with ``eval_seed`` and ``t`` is stratified over the rows: every evaluation sees
      the same masks, so successive val losses differ by the model only, and the training RNG is untouched.
    * **Cost.** Logits are computed for all ``B * L`` positions (targets of unmasked ones ignored): selecting
      only the masked rows would need their count on the host (a sync) and give dynamic shapes. This is the
      LM-head cost of the causal objective, so a step costs what a Llama step costs at equal shape, except
      that bidirectional attention cannot skip the upper triangle (about twice the causal attention FLOPs).
      The per-sequence ``1 / p`` weights need a per-token-weighted CE, which the objective's summed
      ``loss_fn`` cannot express: ``weighted_linear_ce`` below is used instead, chunked like
      ``perf.ce.chunked_linear_ce`` unless ``loss_fn`` is the plain one.
    """

    name = "diffusion"

    def __init__(
        self,
        loss_fn: LossFn = plain_linear_ce,
        *,
        eps: float = 1e-3,
        cut_prob: float = 0.01,
        cut_multiple: int = 64,
        chunk_size: int = 4096,
        eval_seed: int = 0,
    ):
        self.loss_fn = loss_fn
        self.chunk_size = None if loss_fn is plain_linear_ce else chunk_size
        self.eps = eps
        self.cut_prob = cut_prob
        self.cut_multiple = max(1, cut_multiple)
        self.eval_seed = eval_seed

    def __call__(
        self, model: nn.Module, batch: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = batch[0]
        extras = list(batch[2:])
        prompt_mask = extras.pop() if extras and extras[-1].dtype == torch.bool else None
        # Passed only when present, so the model is called as CausalLM calls it.
        ids = dict(zip(("position_ids", "doc_ids"), extras))
        trainer_norm = batch[1].numel()
        # torch.full, not torch.tensor(host int, device=cuda): the latter is a blocking host-to-device copy.
        n_tokens = torch.full((), float(trainer_norm), device=x.device)
        inner = _inner(model)
        bsz, full_len = x.shape
        gen = None
        if model.training:
            if (
                prompt_mask is None
                and self.cut_prob > 0
                and float(torch.rand((), device="cpu")) < self.cut_prob
            ):
                length = int(torch.randint(1, full_len + 1, (), device="cpu"))
                length = min(full_len, -(-length // self.cut_multiple) * self.cut_multiple)
                x = x[:, :length]
                ids = {k: v[:, :length] for k, v in ids.items()}
            t = torch.rand(bsz, device=x.device)
        else:
            gen = torch.Generator(device=x.device).manual_seed(self.eval_seed)
            t = (torch.arange(bsz, device=x.device) + torch.rand((), device=x.device, generator=gen)) / bsz
        p_mask = (1 - self.eps) * t + self.eps
        masked = torch.rand(x.shape, device=x.device, generator=gen) < p_mask[:, None]
        row_weight = 1.0 / p_mask
        if prompt_mask is None:
            paper_norm = x.numel()
        else:
            masked &= ~prompt_mask
            row_weight = row_weight / (~prompt_mask).sum(dim=1).clamp_min(1)
            paper_norm = bsz
        noisy = torch.where(masked, inner.args.mask_token_id, x)
        targets = torch.where(masked, x, IGNORE_INDEX)
        hidden = model(noisy, return_hidden=True, **ids)
        loss_sum = weighted_linear_ce(
            hidden,
            inner.output_weight,
            targets,
            row_weight[:, None].expand(x.shape),
            chunk_size=self.chunk_size,
        )
        return loss_sum * (trainer_norm / paper_norm), n_tokens


def weighted_linear_ce(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    token_weight: torch.Tensor,
    *,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """``sum_k token_weight_k * CE(hidden_k @ weight.T, targets_k)`` over tokens whose target is not
    IGNORE_INDEX (``token_weight`` carries no gradient).

    ``chunk_size=None``: plain fp32 logits of all rows. Otherwise the rows are walked in chunks and each chunk's
    gradients are computed in the forward pass (the scheme of ``perf.ce.chunked_linear_ce``, with the
    softmax-minus-one-hot gradient scaled per token), so only one chunk of logits ever exists.
    """
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1)
    w_tok = token_weight.reshape(-1).float()
    if chunk_size is None:
        ce = F.cross_entropy(F.linear(h, weight).float(), t, ignore_index=IGNORE_INDEX, reduction="none")
        return (ce * w_tok).sum()
    return chunked_linear_ce(h, weight, t, chunk_size=chunk_size, token_weight=w_tok)


OBJECTIVES = {"causal": CausalLM, "diffusion": MaskedDiffusion}


def build_objective(name: str, loss_fn: LossFn = plain_linear_ce) -> CausalLM:
    return OBJECTIVES[name](loss_fn)
