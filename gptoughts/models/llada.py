"""LLaDA: a masked-diffusion language model (Nie et al., 2025, "Large Language Diffusion Models").

``LLaDA`` *is* ``Llama`` (same modules, parameter names and kernels) with every attention layer switched to
bidirectional after construction; its vocabulary holds a mask token. What makes it a diffusion model lives
elsewhere:

* the objective ``train.objectives.MaskedDiffusion`` (registered as ``"diffusion"``): mask each token with
  probability ``t ~ U(eps, 1)``, predict the masked tokens, weight by ``1/t``;
* the sampler ``sampling.diffusion_generate``: start from all-mask, commit tokens over a number of steps,
  block by block (semi-autoregressive);
* ``diffusion_log_likelihood`` below: the Monte-Carlo estimate of the NLL used by ``gptoughts eval``.

No KV cache: with bidirectional attention every position's keys change whenever any token changes, so each
sampling step recomputes the whole sequence (``new_cache`` raises). Size presets: ``docs/models.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gptoughts.errors import ConfigError, UserError
from gptoughts.models.layers import KVCache
from gptoughts.models.llama import Llama, LlamaArgs

__all__ = ["LLADA_SIZES", "LLaDA", "LLaDAArgs", "diffusion_log_likelihood"]


@dataclass
class LLaDAArgs(LlamaArgs):
    """Hyper-parameters of a LLaDA model: ``LlamaArgs`` plus the id of the mask token."""

    mask_token_id: int = 2
    """Id of the mask token (our tokenizers reserve ``<|mask|>`` at 2); set from the tokenizer by a run."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(
                f"model.mask_token_id ({self.mask_token_id}) must be a token id below model.vocab_size "
                f"({self.vocab_size})"
            )


LLADA_SIZES: dict[str, dict[str, Any]] = {
    "debug": dict(
        d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=512, max_seq_len=256
    ),
    "medium": dict(
        d_model=2048, n_layers=22, n_heads=32, n_kv_heads=4, ffn_dim=5632, vocab_size=32768, max_seq_len=4096
    ),
    "8b": dict(
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=32,
        ffn_dim=12288,
        vocab_size=126464,
        max_seq_len=4096,
        rope_theta=500000.0,
    ),
}


class LLaDA(Llama):
    """Bidirectional Llama used as a mask predictor; implements the model protocol of ``docs/internals.md``.

    ``forward(input_ids)`` returns logits for every position; the objective and the sampler read them only at
    positions holding ``args.mask_token_id``.
    """

    def __init__(self, args: LLaDAArgs) -> None:
        super().__init__(args)
        # Flipping the flag after construction (rather than a causal field in LlamaArgs) keeps llama.py
        # untouched and the modules identical to Llama's, so every transform (fp8, compile, FSDP, checkpoint
        # names) treats both families alike. Attention reads `causal` at every forward.
        for layer in self.layers:
            layer.attention.causal = False

    def forward(
        self, input_ids: torch.Tensor, *, cache: KVCache | None = None, **kwargs: Any
    ) -> torch.Tensor:
        """``Llama.forward`` (``position_ids``, ``return_hidden``, ``doc_ids`` of packed rows), without a cache."""
        if cache is not None:
            raise UserError(_NO_CACHE)
        return super().forward(input_ids, **kwargs)

    def new_cache(self, *args: Any, **kwargs: Any) -> KVCache:
        raise UserError(_NO_CACHE)


_NO_CACHE = (
    "LLaDA attends bidirectionally, so it has no KV cache and cannot decode token by token; "
    "sample with gptoughts.sampling.diffusion_generate"
)


@torch.no_grad()
def diffusion_log_likelihood(
    model: nn.Module,
    ids: torch.Tensor,
    *,
    prompt_len: int = 0,
    n_samples: int = 32,
    mask_id: int | None = None,
    batch_size: int = 16,
    chunk_size: int = 4096,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Monte-Carlo estimate of the negative log-likelihood per answer token, in nats.

    ``ids`` is ``[T]`` or ``[B, T]``; the first ``prompt_len`` tokens of each row are the condition (never
    masked, not scored) and the remaining ``A = T - prompt_len`` the answer. Returns a scalar for ``[T]``, else
    ``[B]``. The estimator is LLaDA's low-variance one (their ``get_log_likelihood``): for each of
    ``n_samples`` draws, exactly ``l`` answer tokens are masked, ``l`` uniform on ``1..A`` and stratified
    across the draws (one random offset, then evenly spaced), positions uniform; the draw scores
    ``(A / l) * sum of the masked tokens' CE``, an unbiased estimate of the diffusion ELBO bound
    ``-log p(answer | prompt) <= E[...]``. Per token this is the mean over draws of the *mean* CE of each draw's
    masked tokens. The bound, like the training loss, is an upper bound on the true NLL.

    ``batch_size`` sequences (rows x draws) go through the model at a time. Logits are computed only for the
    masked positions, ``chunk_size`` rows of logits at a time (gathering them costs a host sync, harmless
    outside training). Pass a seeded ``generator`` (on ``ids``' device) for a reproducible estimate.
    """
    squeeze = ids.ndim == 1
    if squeeze:
        ids = ids[None]
    if ids.ndim != 2:
        raise UserError(f"ids must be [T] or [B, T], got shape {tuple(ids.shape)}")
    if n_samples < 1:
        raise UserError(f"n_samples must be >= 1, got {n_samples}")
    bsz, seqlen = ids.shape
    answer = seqlen - prompt_len
    if prompt_len < 0 or answer < 1:
        raise UserError(f"prompt_len={prompt_len} leaves no answer token in a sequence of {seqlen}")
    if mask_id is None:
        mask_id = model.args.mask_token_id
    dev = ids.device

    # Stratified mask counts l in 1..A: one offset per row, then steps of A / n_samples (wrapping around).
    start = torch.randint(1, answer + 1, (bsz, 1), device=dev, generator=generator).double()
    spread = torch.arange(n_samples, device=dev, dtype=torch.float64) * (answer / n_samples)
    n_masked = (torch.round(start + spread).long() - 1) % answer + 1  # [B, n]
    # The rank of each position in a random order: the l lowest ranks are an exactly-l uniform subset.
    keys = torch.rand(bsz, n_samples, answer, device=dev, generator=generator)
    ranks = keys.argsort(dim=-1).argsort(dim=-1)
    is_mask = torch.zeros(bsz, n_samples, seqlen, dtype=torch.bool, device=dev)
    is_mask[..., prompt_len:] = ranks < n_masked[..., None]

    clean = ids[:, None, :].expand(bsz, n_samples, seqlen).reshape(-1, seqlen)
    is_mask = is_mask.reshape(-1, seqlen)
    noisy = torch.where(is_mask, mask_id, clean)
    ce_sum = torch.zeros(bsz * n_samples, dtype=torch.float64, device=dev)
    head = model.output_weight
    for s in range(0, noisy.size(0), batch_size):
        m = is_mask[s : s + batch_size]
        hidden = model(noisy[s : s + batch_size], return_hidden=True)[m]  # [N_masked, d]
        targets = clean[s : s + batch_size][m]
        row = m.nonzero()[:, 0] + s
        for c in range(0, hidden.size(0), chunk_size):
            logits = F.linear(hidden[c : c + chunk_size], head).float()
            ce = F.cross_entropy(logits, targets[c : c + chunk_size], reduction="none")
            ce_sum.index_add_(0, row[c : c + chunk_size], ce.double())
    nll = (ce_sum.view(bsz, n_samples) / n_masked).mean(dim=1)
    return nll[0] if squeeze else nll
