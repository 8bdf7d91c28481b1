"""The generic path of Hugging Face interop: any ``transformers`` causal LM without native code, wrapped behind our
model protocol (``docs/internals.md``) so the same trainer (precision, compile, checkpoints, LoRA) runs it."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gptoughts.errors import UserError


@dataclass
class HFArgs:
    """What the rest of gptoughts reads from a model's ``args`` (generation length, vocabulary, width)."""

    model_type: str
    vocab_size: int
    d_model: int
    n_layers: int
    max_seq_len: int


_HEAD_SCALES = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def _find_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks: the longest ModuleList of identical modules (``model.layers``, ``transformer.h``...)."""
    best = nn.ModuleList()
    for module in model.modules():
        if (
            isinstance(module, nn.ModuleList)
            and len(module) > len(best)
            and len({type(m) for m in module}) == 1
        ):
            best = module
    return best


class HFCausalLM(nn.Module):
    """Any ``transformers`` causal LM behind our model protocol (``docs/internals.md``).

    ``forward(..., return_hidden=True)`` runs the base model and returns its final (normed) hidden state, so the
    objective's chunked cross-entropy applies the head; a head bias is folded in as an extra input column of
    ones (exact). Heads that rescale or soft-cap logits are refused: the chunked loss cannot apply them.
    Generation goes through transformers' ``generate`` (:meth:`hf_generate`); there is no ``new_cache``.
    """

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        self.hf = hf_model
        cfg = hf_model.config
        head = hf_model.get_output_embeddings()
        if not isinstance(head, nn.Linear):
            raise UserError(
                f"{type(hf_model).__name__} has no linear LM head; the generic path cannot train it"
            )
        for name in _HEAD_SCALES:
            value = getattr(cfg, name, None)
            if value not in (None, 1, 1.0):
                raise UserError(
                    f"{type(hf_model).__name__} rescales its logits ({name} = {value}); the generic "
                    "path does not support that head yet"
                )
        text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        d = getattr(text_cfg, "hidden_size", None) or getattr(text_cfg, "n_embd", None) or head.in_features
        layers = _find_layers(hf_model)
        self.args = HFArgs(
            model_type=str(getattr(cfg, "model_type", "unknown")),
            vocab_size=int(head.out_features),
            d_model=int(d),
            n_layers=len(layers),
            max_seq_len=int(
                getattr(text_cfg, "max_position_embeddings", None)
                or getattr(text_cfg, "n_positions", None)
                or 2048
            ),
        )
        # Not registered as submodules: they are already under `hf`, and a second name would duplicate every
        # parameter in the state dict.
        self.__dict__["_layers"] = layers
        self.__dict__["_head"] = head

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        trust_remote_code: bool = False,
    ) -> HFCausalLM:
        from transformers import AutoModelForCausalLM

        try:
            hf = AutoModelForCausalLM.from_pretrained(
                str(path), trust_remote_code=trust_remote_code, dtype=dtype, attn_implementation="sdpa"
            )
        except ValueError as e:
            if "trust_remote_code" in str(e) and not trust_remote_code:
                raise UserError(
                    f"{path} needs its own Python code to load; pass --trust_remote_code if you trust "
                    "that code"
                ) from None
            try:  # some architectures have no SDPA implementation: their default attention then
                hf = AutoModelForCausalLM.from_pretrained(
                    str(path), trust_remote_code=trust_remote_code, dtype=dtype
                )
            except ValueError as e2:
                raise UserError(f"transformers cannot load {path} as a causal LM: {e2}") from None
        return cls(hf.to(device)).eval()

    @property
    def layers(self) -> nn.ModuleList:
        return self.__dict__["_layers"]

    @property
    def output_weight(self) -> torch.Tensor:
        head = self.__dict__["_head"]
        if head.bias is None:
            return head.weight
        return torch.cat([head.weight, head.bias[:, None].to(head.weight.dtype)], dim=1)

    def init_weights(self) -> None:
        """A no-op: the weights come from the model folder."""

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
        return_hidden: bool = False,
        doc_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if cache is not None:
            raise UserError(
                "generic transformers models decode through hf_generate, not a gptoughts KV cache"
            )
        if doc_ids is not None:
            raise UserError(
                "packed rows (doc_ids) need the native fast path; set data.packing = false for "
                f"{self.args.model_type} models"
            )
        out = self.hf.base_model(input_ids=input_ids, position_ids=position_ids, use_cache=False)
        h = out[0]
        head = self.__dict__["_head"]
        if not return_hidden:
            return head(h)
        if head.bias is not None:  # h @ [W | b]^T == h @ W^T + b with a column of ones appended to h
            h = torch.cat([h, h.new_ones(*h.shape[:-1], 1)], dim=-1)
        return h

    @torch.no_grad()
    def hf_generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_id: int | None = None,
        end_ids: Sequence[int] = (),
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """transformers' ``generate`` (its own KV cache) with our sampling arguments; ``[B, T + n]``. ``end_ids``
        finish a row as eos does (a chat template's end of turn)."""
        ends = [eos_id, *end_ids] if eos_id is not None and end_ids else eos_id
        kw: dict[str, Any] = dict(
            max_new_tokens=max_new_tokens, do_sample=temperature > 0, eos_token_id=ends, pad_token_id=eos_id
        )
        if temperature > 0:
            kw.update(temperature=temperature, top_k=top_k or 0, top_p=top_p if top_p is not None else 1.0)
        was_training = self.training
        self.eval()
        rng = (
            torch.random.fork_rng(devices=[input_ids.device] if input_ids.device.type == "cuda" else [])
            if generator is not None
            else contextlib.nullcontext()
        )
        try:
            with rng:
                if generator is not None:  # transformers samples from the global RNG: seed it from ours
                    torch.manual_seed(generator.initial_seed())
                return self.hf.generate(input_ids, attention_mask=torch.ones_like(input_ids), **kw)
        finally:
            self.train(was_training)

    def num_params(self, non_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.hf.get_input_embeddings().weight.numel()
        return n

    def flops_per_token(self, seq_len: int) -> int:
        """``6 * N + 12 * n_layers * d_model * seq_len`` (N counts the head even when tied)."""
        n = self.num_params(non_embedding=True)
        head = self.__dict__["_head"].weight
        if head.data_ptr() == self.hf.get_input_embeddings().weight.data_ptr():
            n += head.numel()
        return 6 * n + 12 * self.args.n_layers * self.args.d_model * seq_len
