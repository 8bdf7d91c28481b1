"""Direct preference optimisation (Rafailov et al., 2023) as an objective of the one trainer.

A batch of ``B`` pairs is ``(x [B, 2, T], ref_logratio [B], y [B, 2, T])`` (``data/prefs.py``); chosen and
rejected run in one forward pass of ``2B`` rows. Each row's log-probability is summed over its completion tokens;
the pair's loss is the sigmoid DPO loss with label smoothing ``e`` (cDPO):
``-(1 - e) log σ(β m) - e log σ(-β m)``, ``m = (log π(c) - log π(r)) - (log π_ref(c) - log π_ref(r))``.
The objective returns ``(sum of pair losses, B)``: the trainer's division by its static count (``batch[1].numel()``,
the pairs) makes the logged loss the mean over the step's pairs.

The reference: ``precomputed`` (full fine-tuning): one pass of the frozen starting model over all pairs before
training fills ``ref_logratio`` (:func:`precompute_reference`), so no second model is kept in memory;
``adapters_off`` (LoRA): the same model with its adapters disabled, in a no-grad forward each step (no second copy
of the weights). Reward margin ``β m`` and preference accuracy (share of pairs with ``m > 0``) accumulate on the
device and are read at log intervals (:func:`pair_metrics`). The LM head and the loss run as ``dpo.head`` says
(``dpo_head.py``; fused by default: no full logits, no head recompute).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from gptoughts.config import DpoConfig
from gptoughts.parallel import dist as pdist
from gptoughts.training.dpo_head import completion_logps, dpo_loss, fused_pair_loss
from gptoughts.training.objectives import _inner


def _tuner_layers(model: nn.Module) -> list[nn.Module]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


@contextlib.contextmanager
def adapters_disabled(layers: list[nn.Module]) -> Iterator[None]:
    """The LoRA layers run their frozen base only. The flag is set directly: PEFT's ``enable_adapters`` would
    also flip the adapters' ``requires_grad`` back and forth inside the step."""
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m in layers:
            m._disable_adapters = False


class DPO:
    """The DPO objective (module docstring). ``reference``: precomputed or adapters_off; ``head``: how the LM head
    and the loss run (``dpo_head.py``: fused, chunked or plain); ``logp_chunk``: rows per chunk of the head
    (0: one pair; fused with a trained head rounds down to whole pairs); ``logp_chunk_tokens``: tokens per chunk
    of a frozen fused head and of the no-gradient passes (0: ``logp_chunk`` rows' worth); ``compiled``: the
    chunks under torch.compile."""

    name = "dpo"

    def __init__(
        self,
        *,
        beta: float = 0.1,
        label_smoothing: float = 0.0,
        reference: str = "precomputed",
        head: str = "fused",
        logp_chunk: int = 0,
        logp_chunk_tokens: int = 0,
        compiled: bool = False,
    ) -> None:
        if reference not in ("precomputed", "adapters_off"):
            raise ValueError(f"reference must be precomputed or adapters_off, got {reference!r}")
        if head not in ("fused", "chunked", "plain"):
            raise ValueError(f"head must be fused, chunked or plain, got {head!r}")
        self.beta, self.label_smoothing = beta, label_smoothing
        self.reference, self.head, self.compiled = reference, head, compiled
        self.chunk_rows = 0 if head == "plain" else logp_chunk if logp_chunk > 0 else 2
        self.chunk_tokens = 0 if head == "plain" else logp_chunk_tokens
        self._sums: dict[bool, torch.Tensor | None] = {True: None, False: None}  # by model.training
        self._layers: tuple[int, list[nn.Module]] | None = None

    def _hidden(self, model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float | None]:
        b, _, t = x.shape
        hidden = model(x.reshape(2 * b, t), return_hidden=True)
        inner = _inner(model)
        return hidden, inner.output_weight, getattr(inner, "logit_softcap", None)

    def pair_logps(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Summed completion log-probabilities ``[B, 2]`` (chosen, rejected), both rows of every pair in one
        forward pass."""
        b, _, t = x.shape
        hidden, weight, cap = self._hidden(model, x)
        logps = completion_logps(
            hidden,
            weight,
            y.reshape(2 * b, t),
            softcap=cap,
            chunk_rows=self.chunk_rows,
            chunk_tokens=self.chunk_tokens,
            compiled=self.compiled,
        )
        return logps.view(b, 2)

    def logratio(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``log π(chosen) - log π(rejected)`` per pair."""
        logps = self.pair_logps(model, x, y)
        return logps[:, 0] - logps[:, 1]

    def reference_logps(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """:meth:`pair_logps` of the LoRA reference: the same model with its adapters disabled, without gradient."""
        if self._layers is None or self._layers[0] != id(model):
            self._layers = (id(model), _tuner_layers(model))
        with torch.no_grad(), adapters_disabled(self._layers[1]):
            return self.pair_logps(model, x, y)

    def _reference(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logps = self.reference_logps(model, x, y)
        return logps[:, 0] - logps[:, 1]

    def __call__(
        self, model: nn.Module, batch: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if len(batch) == 2:  # a text batch of the assembly's probes (CPU threads): see _probe_pairs
            x, ref, y = _probe_pairs(batch[0], batch[1])
        else:
            x, ref, y = batch[0], batch[1], batch[2]
        if self.reference == "adapters_off":
            ref = self._reference(model, x, y)
        loss, margin = self.loss(model, x, y, ref)
        if len(batch) == 2:
            return loss, torch.full((), float(x.shape[0]), device=x.device)
        # Summed on the device, read at the next log or evaluation (no sync here).
        sums = torch.stack([margin.sum(), (margin > 0).float().sum(), torch.ones_like(margin).sum()])
        key = model.training
        self._sums[key] = sums if self._sums[key] is None else self._sums[key] + sums
        return loss, torch.full((), float(x.shape[0]), device=x.device)

    def loss(
        self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, ref: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The summed pair losses of the policy ``model`` against the reference log-ratios ``ref`` ``[B]``, and the
        margins ``β m`` ``[B]``. The fused head computes both with the head's gradients in one walk over the
        pairs; without gradients (evaluations) every head computes the log-probabilities, then the loss."""
        if self.head != "fused" or not torch.is_grad_enabled():
            losses, margin = dpo_loss(self.logratio(model, x, y), ref, self.beta, self.label_smoothing)
            return losses.sum(), margin
        b, _, t = x.shape
        hidden, weight, cap = self._hidden(model, x)
        return fused_pair_loss(
            hidden,
            weight,
            y.reshape(2 * b, t),
            ref,
            beta=self.beta,
            label_smoothing=self.label_smoothing,
            softcap=cap,
            chunk_rows=self.chunk_rows,
            chunk_tokens=self.chunk_tokens,
            compiled=self.compiled,
        )

    def pop_pair_sums(self, training: bool) -> torch.Tensor | None:
        """(margin sum, pairs preferred, pairs) since the last call, of training or of evaluation forwards."""
        out, self._sums[training] = self._sums[training], None
        return out


def _probe_pairs(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A ``(x, y)`` text batch (the CPU thread-count probe times one step of the real objective on random rows)
    as pairs of consecutive rows, with a zero reference; its pairs count in no metric."""
    if x.shape[0] % 2:
        x, y = torch.cat([x, x]), torch.cat([y, y])
    b, t = x.shape[0] // 2, x.shape[1]
    return x.view(b, 2, t), torch.zeros(b, device=x.device), y.view(b, 2, t)


def build_dpo(d: DpoConfig, *, lora: bool, compiled: bool = False) -> DPO:
    """The objective of ``[dpo]``: ``reference = auto`` is adapters_off with LoRA, precomputed otherwise;
    ``compiled``: the run compiles (the fused head's chunk is compiled too)."""
    return DPO(
        beta=d.beta,
        label_smoothing=d.label_smoothing,
        reference=d.resolved_reference(lora),
        head=d.head,
        logp_chunk=d.logp_chunk,
        logp_chunk_tokens=d.logp_chunk_tokens,
        compiled=compiled,
    )


def pair_metrics(objective: Any, training: bool, dist: pdist.DistInfo, prefix: str) -> dict[str, float]:
    """``PREFIX reward_margin`` and ``PREFIX accuracy`` over every rank's pairs since the last read ({} for
    objectives without pairs). Every data-parallel rank must call it (an all-reduce)."""
    return pair_row(pop_pairs(objective, training), dist, prefix)


def pop_pairs(objective: Any, training: bool) -> torch.Tensor | None:
    """The objective's pair sums since the last pop (None for objectives without pairs)."""
    pop = getattr(objective, "pop_pair_sums", None)
    return pop(training) if pop is not None else None


def pair_row(sums: torch.Tensor | None, dist: pdist.DistInfo, prefix: str) -> dict[str, float]:
    """``sums`` (margin sum, pairs preferred, pairs) over every data-parallel rank as metrics ({} for None)."""
    if sums is None:
        return {}
    margin, right, pairs = pdist.all_reduce_dp(sums.detach().clone(), dist).tolist()
    n = max(pairs, 1.0)
    return {f"{prefix}reward_margin": margin / n, f"{prefix}accuracy": right / n}


@torch.no_grad()
def precompute_reference(
    objective: DPO,
    model: nn.Module,
    data: Any,
    *,
    batch_size: int,
    device: torch.device,
    autocast: Callable[[], contextlib.AbstractContextManager],
) -> None:
    """Fill ``data.ref_logratio`` with the log-ratios of ``model`` as it is now (the starting weights), in eval
    mode, over every pair of both splits. Every rank computes all of them (the same forwards on every rank, as
    sharded models need)."""
    was_training = model.training
    model.eval()
    out = []
    try:
        for x, _, y in data.batches(np.arange(len(data)), batch_size, device):
            with autocast():
                out.append(objective.logratio(model, x, y).double().cpu())
    finally:
        model.train(was_training)
    data.ref_logratio[:] = torch.cat(out).numpy()
