"""``DecoderLM``: the part of the model protocol (``docs/internals.md``) that every native family shares.

A family (``llama.py``, ``inl.py``, ``gpt2.py``, ``deepseek/model.py``) subclasses ``DecoderLM`` and keeps in its
own file its blocks and what is genuinely its own. Written once here:

* ``forward``: the ``max_seq_len`` check, the family's ``trunk`` (embeddings and blocks), advancing the KV cache,
  then the forward tail: the final norm, and the LM head unless ``return_hidden``;
* ``output_weight`` and ``logit_softcap`` (the head); ``init_weights`` (its fixed order of RNG draws and the
  residual-branch std);
* ``num_params``, ``flops_per_token`` (the MFU formula), ``new_cache`` (a ``layers.KVCache`` by default);
* ``unwrap``: the block under compile / activation-checkpointing wrappers.

Module names stay the family's (they are the state-dict keys, mapped onto Hugging Face names by the HF
adapters): the base reaches them through ``token_embedding``, ``final_norm`` and ``output``, which a family
overrides where its names differ (GPT-2: ``wte``, ``ln_f``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gptoughts.models.layers import KVCache, softcap

__all__ = ["DecoderLM", "unwrap"]


def unwrap(module: nn.Module) -> nn.Module:
    """The block under ``torch.compile`` (``_orig_mod``) or checkpoint wrappers (``_checkpoint_wrapped_module``)."""
    while True:
        inner = getattr(module, "_orig_mod", None)
        if inner is None:
            inner = getattr(module, "_checkpoint_wrapped_module", None)
        if inner is None:
            return module
        module = inner


class DecoderLM(nn.Module):
    """Base class of the native decoder families (see the module docstring).

    A subclass calls ``super().__init__(args)``, then builds ``layers`` (the ``nn.ModuleList`` of blocks), its
    token embedding (``tok_embeddings``, else override ``token_embedding``), its final norm (``norm``, else
    override ``final_norm``) and ``output``: the untied LM head, or None when the head is the embedding.
    The constructor only builds modules (PyTorch's default init, meaningless here): call ``init_weights()``, or
    use ``models.build_model``, which builds on ``meta`` and initialises once.

    ``args`` provides ``n_layers``, ``max_seq_len`` and ``init_std``; the defaults of ``trunk``/``init_inputs``
    use ``self.rope`` (a ``layers.RotaryEmbedding``-like table), those of ``flops_per_token`` and ``make_cache``
    ``args.n_heads``, ``args.kv_heads`` and ``args.hd`` (the head dim). A family overrides what it does otherwise.
    """

    layers: nn.ModuleList
    output: nn.Linear | None

    def __init__(self, args: Any) -> None:
        super().__init__()
        self.args = args

    @property
    def token_embedding(self) -> nn.Embedding:
        """The input token embedding (``[vocab_size, d_model]``)."""
        return self.tok_embeddings

    @property
    def final_norm(self) -> nn.Module:
        """The norm applied after the last block."""
        return self.norm

    @property
    def output_weight(self) -> torch.Tensor:
        """The ``[vocab_size, d_model]`` LM-head weight (the embedding matrix when tied)."""
        return self.token_embedding.weight if self.output is None else self.output.weight

    @property
    def logit_softcap(self) -> float | None:
        """The cap of ``layers.softcap`` applied to the logits (``args.logit_softcap``), or None. Code that applies
        ``output_weight`` itself (the objectives' losses, sampling) reads it here."""
        return getattr(self.args, "logit_softcap", None)

    # ------------------------------------------------------------------------------------------ forward

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
        return_hidden: bool = False,
        doc_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``[B, T, V]`` (in the head's compute dtype; soft-capped when ``logit_softcap``), or the final
        normed hidden state ``[B, T, d]`` when ``return_hidden`` (the objective then applies ``output_weight``, and
        the cap, in chunks).

        With ``cache`` (from ``new_cache``), the tokens are placed after the ``cache.length`` tokens already
        cached and the cache is advanced by ``T``. ``position_ids [B, T]`` overrides the positions (not the
        causal mask). ``doc_ids [B, T]`` (packed rows, no cache): tokens attend only within their own document;
        pass ``position_ids`` restarting at 0 per document too, so each document sees the positions it would
        alone.
        """
        seqlen = input_ids.shape[1]
        start = 0 if cache is None else cache.length
        # Host-side ints only: this check costs no device sync.
        if position_ids is None and start + seqlen > self.args.max_seq_len:
            raise ValueError(
                f"sequence of {start + seqlen} positions exceeds max_seq_len={self.args.max_seq_len}"
            )
        h = self.trunk(input_ids, start, position_ids, cache, doc_ids)
        if cache is not None:
            cache.advance(seqlen)
        if (
            self.final_norm is None
        ):  # a pipeline stage before the last: the next stage takes the blocks' output
            return h
        h = self.final_norm(h)
        if return_hidden:
            return h
        return softcap(F.linear(h, self.output_weight), self.logit_softcap)

    def trunk(
        self,
        input_ids: torch.Tensor,
        start: int,
        position_ids: torch.Tensor | None,
        cache: Any,
        doc_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        """The last block's output ``[B, T, d]`` (before the final norm) for tokens at positions ``start ...``
        (or ``position_ids``); ``forward`` checked the length and advances the cache afterwards.

        Default, shared by the RoPE families (Llama, LLaDA, INL): RoPE tables from ``self.rope``, the token
        embedding, then every block as ``layer(h, cos, sin, cache, doc_ids)``.

        A pipeline stage (``parallel/pp.py``) is this module with the parts it does not hold set to None: without
        the token embedding ``input_ids`` is the previous stage's hidden state ``[B, T, d]``, and without the final
        norm ``forward`` returns the blocks' output.
        """
        cos, sin = self.rope(input_ids.size(1), start, position_ids)
        h = input_ids if self.token_embedding is None else self.token_embedding(input_ids)
        for layer in self.layers:
            h = layer(h, cos, sin, cache, doc_ids)
        return h

    # -------------------------------------------------------------------------------------------- init

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise every parameter and buffer from the current torch RNG (used after ``to_empty()``).

        The order of RNG draws is fixed, so the same seed gives the same model whether built directly or on
        ``meta`` then ``to_empty()``: the inputs (``init_inputs``), each block's ``reset_parameters(std,
        out_std)``, the final norm, the untied LM head (Normal(0, ``init_std``)). ``std`` is ``init_std``; the
        blocks give their residual-branch outputs ``out_std = init_std / sqrt(2 * n_layers)`` so the residual
        stream's variance does not grow with depth (GPT-2 / Megatron).
        """
        std, out_std = self.init_stds()
        self.init_inputs(std)
        for layer in self.layers:
            # Wrappers (activation checkpointing, compile) keep the original block reachable.
            unwrap(layer).reset_parameters(std, out_std)
        self.final_norm.reset_parameters()
        if self.output is not None:
            nn.init.normal_(self.output.weight, mean=0.0, std=std)

    def init_stds(self) -> tuple[float, float]:
        """``(init_std, init_std / sqrt(2 * n_layers))``: the stds of ``init_weights``."""
        std = self.args.init_std
        return std, std / math.sqrt(2 * self.args.n_layers)

    def init_inputs(self, std: float) -> None:
        """Initialise what comes before the blocks (under ``no_grad``): by default the token embedding
        Normal(0, ``std``), then the RoPE tables of ``self.rope`` recomputed (non-persistent buffers)."""
        nn.init.normal_(self.token_embedding.weight, mean=0.0, std=std)
        self.rope.reset_parameters()

    # ----------------------------------------------------------------------------------- counts, cache

    def num_params(self, non_embedding: bool = False) -> int:
        """Number of parameters (a tied matrix counted once: ``parameters()`` de-duplicates shared tensors).

        ``non_embedding=True`` excludes the input embedding table (the MFU convention: a lookup costs no FLOPs,
        while the LM head is a real matmul and stays counted). With tied embeddings the shared matrix is
        therefore excluded; ``flops_per_token`` still counts its matmul.
        """
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.token_embedding.weight.numel()
        return n

    def matmul_params(self) -> int:
        """The ``N`` of ``flops_per_token``: non-embedding parameters, plus the LM head when tied (its lookup is
        free but its matmul runs)."""
        n = self.num_params(non_embedding=True)
        if self.output is None:
            n += self.output_weight.numel()
        return n

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: ``6 * N + 12 * n_layers * (n_heads * head_dim) * seq_len``.

        ``N`` = ``matmul_params()``; ``n_heads * head_dim`` is ``d_model`` unless a family sets its head dim
        apart. The attention term is the PaLM convention (full ``T x T`` score matrix, causal masking not
        discounted).
        """
        a = self.args
        return 6 * self.matmul_params() + 12 * a.n_layers * a.n_heads * a.hd * seq_len

    def new_cache(
        self,
        batch_size: int,
        max_len: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> Any:
        """An empty cache for ``batch_size`` rows and up to ``max_len`` (default and upper bound
        ``max_seq_len``) positions. Its buffers take the dtype and device of the first keys stored (what the
        forward computes in: see ``layers.KVCache``) unless ``device``/``dtype`` say otherwise."""
        max_len = self.args.max_seq_len if max_len is None else max_len
        if max_len > self.args.max_seq_len:
            raise ValueError(f"cache of {max_len} positions exceeds max_seq_len={self.args.max_seq_len}")
        return self.make_cache(batch_size, max_len, device, dtype)

    def make_cache(
        self, batch_size: int, max_len: int, device: torch.device | str | None, dtype: torch.dtype | None
    ) -> Any:
        """The family's cache object; by default a ``layers.KVCache`` of ``args.kv_heads`` key/value heads of
        ``args.hd`` per layer."""
        a = self.args
        return KVCache(a.n_layers, batch_size, a.kv_heads, max_len, a.hd, device=device, dtype=dtype)
