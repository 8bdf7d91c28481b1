"""The DeepSeek model: pre-norm blocks (MLA, then a dense SwiGLU or the MoE), multi-token prediction, and the
model with its training hooks (expert-load accounting, aux-loss-free bias updates, ``extra_loss``).

**MTP** (``mtp_depth = 1``): one extra block predicts token ``t+2`` from ``[enorm(emb(t+1)); hnorm(h_t)]``
(``h_t``: the main trunk's last hidden state before the final norm), through ``eh_proj``, the block, ``norm``
and the shared LM head. Its loss, times ``mtp_loss_weight``, is added by ``extra_loss`` during training only
(the validation loss stays the plain next-token loss). Generation ignores it.

**Bias balancing**: after each optimizer step ``after_optimizer_step`` moves every MoE layer's ``expert_bias`` by
``bias_update_rate * sign(mean_load - load)`` from the loads of all of that step's forward passes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gptoughts.models.base import DecoderLM, unwrap
from gptoughts.models.deepseek.args import DeepSeekArgs
from gptoughts.models.deepseek.mla import MLA, MLACache
from gptoughts.models.deepseek.moe import MoE
from gptoughts.models.deepseek.rope import DeepSeekRotary
from gptoughts.models.layers import RMSNorm, SwiGLU

__all__ = ["IGNORE_INDEX", "DeepSeek", "DeepSeekBlock", "MultiTokenPrediction"]

IGNORE_INDEX = -100  # same value as gptoughts.perf.ce.IGNORE_INDEX (models never import perf/)


class DeepSeekBlock(nn.Module):
    """Pre-norm block (MLA, then dense SwiGLU or MoE); the unit of checkpointing, per-block compile and FSDP.

    ``forward`` returns ``(h, expert_counts, balance_loss)`` (the last two None for dense blocks): the model
    accumulates the counts *outside* the block, so the block has no side effects (safe to recompute under
    activation checkpointing, and traceable as one graph by ``torch.compile``).
    """

    def __init__(self, args: DeepSeekArgs, layer_idx: int, moe: bool) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.d_model, args.norm_eps)
        self.attention = MLA(args, layer_idx)
        self.ffn_norm = RMSNorm(args.d_model, args.norm_eps)
        self.feed_forward: nn.Module = MoE(args) if moe else SwiGLU(args.d_model, args.dense_inter_dim)
        self.is_moe = moe

    def reset_parameters(self, std: float, out_std: float) -> None:
        self.attention_norm.reset_parameters()
        self.attention.reset_parameters(std, out_std)
        self.ffn_norm.reset_parameters()
        self.feed_forward.reset_parameters(std, out_std)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: MLACache | None = None,
        doc_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        h = x + self.attention(self.attention_norm(x), cos, sin, cache, doc_ids)
        if not self.is_moe:
            return h + self.feed_forward(self.ffn_norm(h)), None, None
        y, counts, aux = self.feed_forward(self.ffn_norm(h))
        return h + y, counts, aux


class MultiTokenPrediction(nn.Module):
    """One MTP module (DeepSeek-V3 sec. 2.2): ``norm(block(eh_proj([enorm(emb(t+1)); hnorm(h_t)])))``."""

    def __init__(self, args: DeepSeekArgs) -> None:
        super().__init__()
        d = args.d_model
        self.enorm = RMSNorm(d, args.norm_eps)
        self.hnorm = RMSNorm(d, args.norm_eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        # Like V3's MTP layer: an MoE block, unless the model has no MoE layer at all.
        self.block = DeepSeekBlock(args, args.n_layers, moe=args.n_moe_layers > 0)
        self.norm = RMSNorm(d, args.norm_eps)

    def reset_parameters(self, std: float, out_std: float) -> None:
        self.enorm.reset_parameters()
        self.hnorm.reset_parameters()
        nn.init.normal_(self.eh_proj.weight, mean=0.0, std=std)
        self.block.reset_parameters(std, out_std)
        self.norm.reset_parameters()

    def forward(
        self,
        h: torch.Tensor,
        next_emb: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        x = self.eh_proj(torch.cat([self.enorm(next_emb), self.hnorm(h)], dim=-1))
        x, counts, aux = self.block(x, cos, sin, None, doc_ids)
        return self.norm(x), counts, aux


class DeepSeek(DecoderLM):
    """DeepSeek-V3-style causal LM implementing the model protocol of ``docs/internals.md``, with the optional
    hooks ``extra_loss`` (balance loss + MTP), ``after_optimizer_step`` (bias balancing) and ``log_metrics``.

    Expert loads are accumulated on the device in two plain tensor attributes (not buffers: kept out of the
    state dict, and out of DDP's buffer broadcast, which would overwrite every rank's counts with rank 0's):
    ``moe_step_load [S, E]`` (this optimizer step, read and cleared by ``after_optimizer_step``) and
    ``moe_log_load [S, E]`` (since the last ``log_metrics``). ``S`` = MoE layers, plus 1 for an MoE MTP block
    (last row). Only forward passes in training mode count. Under data parallelism the trainer sums
    ``moe_step_load`` over ranks (``rank_summed_state``) before ``after_optimizer_step``, so every rank moves its
    biases from the global loads and they stay identical.
    """

    def __init__(self, args: DeepSeekArgs) -> None:
        super().__init__(args)
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.d_model)
        self.rope = DeepSeekRotary(
            args.qk_rope_head_dim, args.max_seq_len, args.rope_theta, args.rope_scaling
        )
        self.layers = nn.ModuleList(
            DeepSeekBlock(args, i, moe=i >= args.n_dense_layers) for i in range(args.n_layers)
        )
        self.norm = RMSNorm(args.d_model, args.norm_eps)
        self.output = None if args.tie_embeddings else nn.Linear(args.d_model, args.vocab_size, bias=False)
        self.mtp = MultiTokenPrediction(args) if args.mtp_depth else None
        self.n_load_slots = args.n_moe_layers + (1 if self.mtp is not None and self.mtp.block.is_moe else 0)
        self.moe_step_load: torch.Tensor | None = None
        self.moe_log_load: torch.Tensor | None = None
        self._seq_aux: torch.Tensor | None = None
        self._mtp_inputs: tuple[torch.Tensor, ...] | None = None
        if self.tok_embeddings.weight.device.type != "meta":
            self._new_accumulators(self.tok_embeddings.weight.device)

    def _new_accumulators(self, device: torch.device) -> None:
        shape = (self.n_load_slots, self.args.n_routed_experts)
        self.moe_step_load = torch.zeros(shape, device=device)
        self.moe_log_load = torch.zeros(shape, device=device)

    def moe_layers(self) -> list[MoE]:
        """The MoE modules in load-slot order (main layers, then the MTP block's)."""
        blocks = [unwrap(layer) for layer in self.layers]
        if self.mtp is not None:
            blocks.append(unwrap(self.mtp.block))
        return [b.feed_forward for b in blocks if b.is_moe]

    @torch.no_grad()
    def init_weights(self) -> None:
        """``DecoderLM.init_weights`` (fixed draw order: Normal(0, init_std) for embeddings, linears, routers and
        experts; ``init_std / sqrt(2 n_layers)`` for the residual-branch outputs ``wo`` and every ``w2``; norms 1,
        expert biases 0, RoPE tables recomputed), then the MTP module; load accumulators zeroed. Also re-probes
        the grouped-GEMM support for the device the model now lives on.
        """
        super().init_weights()
        if self.mtp is not None:
            self.mtp.reset_parameters(*self.init_stds())
        self._new_accumulators(self.tok_embeddings.weight.device)
        self._seq_aux = None
        self._mtp_inputs = None

    def trunk(
        self,
        input_ids: torch.Tensor,
        start: int,
        position_ids: torch.Tensor | None,
        cache: MLACache | None,
        doc_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        """Embedding, then the blocks (``DecoderLM.forward`` adds the final norm and the head). In training
        mode, expert loads are accumulated and what ``extra_loss`` needs is kept on ``self``."""
        cos, sin = self.rope(input_ids.size(1), start, position_ids)
        h = self.tok_embeddings(input_ids)
        counts, aux = [], []
        for layer in self.layers:
            h, c, a = layer(h, cos, sin, cache, doc_ids)
            if c is not None:
                counts.append(c)
            if a is not None:
                aux.append(a)
        if self.training:
            self._record(counts, first_slot=0)
            self._seq_aux = torch.stack(aux).sum() if aux else None
            self._mtp_inputs = (h, input_ids, position_ids, doc_ids) if self.mtp is not None else None
        return h

    def _record(self, counts: list[torch.Tensor], first_slot: int) -> None:
        if not counts:
            return
        loads = torch.stack(counts).float()
        if self.moe_step_load is None or self.moe_step_load.device != loads.device:
            self._new_accumulators(loads.device)  # moved with .to() after init (eager-only situation)
        rows = slice(first_slot, first_slot + loads.size(0))
        self.moe_step_load[rows] += loads
        self.moe_log_load[rows] += loads

    def extra_loss(self, targets: torch.Tensor, loss_fn: Any) -> torch.Tensor | None:
        """Sequence-balance loss and MTP loss of the last training forward, **summed over tokens**.

        ``seq_aux_loss_coef * (sum over MoE layers of the balance loss) * n_target_tokens``, plus
        ``mtp_loss_weight * loss_fn(mtp_hidden, output_weight, mtp_targets)`` where position ``t`` predicts
        ``targets[t + 1]`` (the last position has no target: ``IGNORE_INDEX``). None in eval mode, so
        validation losses stay plain next-token losses. Consumes the state kept by ``forward``.
        """
        if not self.training:
            return None
        total: torch.Tensor | None = None
        aux = self._seq_aux
        if self._mtp_inputs is not None:
            h, input_ids, position_ids, doc_ids = self._mtp_inputs
            seqlen = input_ids.size(1)
            # Input at t is token t+1: input_ids[t+1], and for the last position the first target (inputs carry
            # real tokens where SFT targets are masked; a masked last target only feeds an ignored position).
            nxt = torch.cat([input_ids[:, 1:], targets[:, -1:].clamp_min(0)], dim=1)
            later = targets[:, 1:]  # later[t]: token t+2, what position t predicts
            if doc_ids is not None:
                # Packed rows: position t may only predict token t+2 of its own document (the last target's
                # token lies beyond the row: it counts as the last position's document, as in the main loss).
                doc_of_target = torch.cat([doc_ids[:, 2:], doc_ids[:, -1:]], dim=1)
                later = later.masked_fill(doc_of_target != doc_ids[:, :-1], IGNORE_INDEX)
            mtp_targets = F.pad(later, (0, 1), value=IGNORE_INDEX)
            cos, sin = self.rope(seqlen, 0, position_ids)
            hm, c, a = self.mtp(h, self.tok_embeddings(nxt), cos, sin, doc_ids)
            if c is not None:
                self._record([c], first_slot=self.n_load_slots - 1)
            if a is not None:
                aux = a if aux is None else aux + a
            total = self.args.mtp_loss_weight * loss_fn(hm, self.output_weight, mtp_targets)
        if aux is not None:
            n_tokens = (targets != IGNORE_INDEX).sum()
            bal = self.args.seq_aux_loss_coef * aux * n_tokens
            total = bal if total is None else total + bal
        self._seq_aux = None
        self._mtp_inputs = None
        return total

    def rank_summed_state(self) -> list[torch.Tensor]:
        """The step's expert loads, for the trainer to sum across data-parallel ranks (docs/internals.md)."""
        return [] if self.moe_step_load is None else [self.moe_step_load]

    def rank_summed_log_state(self) -> list[torch.Tensor]:
        """The loads since the last ``log_metrics``, for the trainer to sum across data-parallel ranks just before
        it calls ``log_metrics`` (so the logged loads are those of all ranks' tokens, expert parallel or not)."""
        return [] if self.moe_log_load is None else [self.moe_log_load]

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        """Aux-loss-free balancing: ``expert_bias += bias_update_rate * sign(mean_load - load)`` per MoE layer,
        from the loads of the step's training forwards; then clears them. Device ops only (no sync)."""
        if self.moe_step_load is None or self.n_load_slots == 0:
            return
        biases = [m.expert_bias for m in self.moe_layers()]
        if self.moe_step_load.device != biases[0].device:  # moved with .to() and no training forward since
            self._new_accumulators(biases[0].device)
            return
        rate = self.args.bias_update_rate
        if rate > 0:
            load = self.moe_step_load
            delta = (load.mean(dim=-1, keepdim=True) - load).sign_().mul_(rate)
            # A slot with no tokens this step (e.g. MTP when extra_loss was not called) has delta 0.
            torch._foreach_add_(biases, list(delta.unbind(0)))
        self.moe_step_load.zero_()

    def log_metrics(self) -> dict[str, float]:
        """Expert-load statistics since the last call (one host sync), then resets them.

        ``moe/load_max`` / ``moe/load_min``: the largest / smallest fraction of a layer's tokens any expert got
        (uniform = 1/E); ``moe/load_cv``: coefficient of variation of the loads, mean over layers;
        ``moe/maxvio``: max load / mean load - 1, mean over layers (the aux-loss-free paper's MaxVio);
        ``moe/bias_absmax``: largest |expert_bias|; ``moe/l{i}_e{j}``: fraction of expert ``j`` of the first MoE
        layer ``i``. Empty when no training forward ran since the last call.
        """
        if self.moe_log_load is None or self.n_load_slots == 0:
            return {}
        bias_max = torch.stack([m.expert_bias.detach().abs().max() for m in self.moe_layers()]).max()
        packed = torch.cat([self.moe_log_load.flatten(), bias_max.view(1).to(self.moe_log_load.device)])
        packed = packed.to("cpu", torch.float64)  # the one host sync
        self.moe_log_load.zero_()
        load = packed[:-1].view(self.n_load_slots, -1)
        total = load.sum(dim=-1)
        seen = total > 0  # e.g. the MTP slot when extra_loss never ran
        if not bool(seen.any()):
            return {}
        frac = load[seen] / total[seen, None]
        mean = frac.mean(dim=-1)
        out = {
            "moe/load_max": frac.max().item(),
            "moe/load_min": frac.min().item(),
            "moe/load_cv": (frac.std(dim=-1, correction=0) / mean).mean().item(),
            "moe/maxvio": (frac.max(dim=-1).values / mean - 1).mean().item(),
            "moe/bias_absmax": packed[-1].item(),
        }
        if seen[0]:
            first = self.args.n_dense_layers
            out.update({f"moe/l{first}_e{j}": v for j, v in enumerate((load[0] / total[0]).tolist())})
        return out

    def make_cache(
        self, batch_size: int, max_len: int, device: torch.device | str | None, dtype: torch.dtype | None
    ) -> MLACache:
        """An empty latent KV cache (see ``MLACache``); ``DecoderLM.new_cache`` picks length, device and dtype."""
        a = self.args
        return MLACache(
            a.n_layers, batch_size, max_len, a.kv_lora_rank + a.qk_rope_head_dim, device=device, dtype=dtype
        )

    def num_active_params(self, non_embedding: bool = False, include_mtp: bool = False) -> int:
        """Parameters one token runs through: everything except the routed experts it does not use
        (``n_activated_experts`` of ``n_routed_experts`` per MoE layer). The LM head counts (once; tied or not).

        With tied embeddings and ``non_embedding=False`` the shared matrix is counted once.
        ``include_mtp`` adds the MTP module's active parameters and a second LM-head pass (training only).
        """
        a = self.args
        per_expert = 3 * a.d_model * a.moe_inter_dim
        idle = (a.n_routed_experts - a.n_activated_experts) * per_expert
        n = self.num_params() - a.n_moe_layers * idle
        if self.mtp is not None:
            mtp_total = sum(p.numel() for p in self.mtp.parameters())
            n -= mtp_total
            if include_mtp:
                n += mtp_total - (idle if self.mtp.block.is_moe else 0) + self.output_weight.numel()
        if non_embedding:
            n -= self.tok_embeddings.weight.numel()
            if self.output is None:
                n += self.output_weight.numel()  # tied: the lookup is free but the head matmul runs
        return n

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: ``6 * N_active + 6 * L_attn * n_heads * (qk_head_dim + v_head_dim) * T``.

        ``N_active`` = ``num_active_params(non_embedding=True, include_mtp=True)`` (routed experts a token does
        not use cost nothing; the MTP block and its extra LM-head pass do). The attention term is the PaLM
        ``12 L d T`` with MLA's head dims (QK^T over ``qk_head_dim``, AV over ``v_head_dim``), causal masking not
        discounted; ``L_attn`` counts the MTP block too.
        """
        a = self.args
        n = self.num_active_params(non_embedding=True, include_mtp=True)
        n_attn = a.n_layers + (1 if self.mtp is not None else 0)
        return 6 * n + 6 * n_attn * a.n_heads * (a.qk_head_dim + a.v_head_dim) * seq_len
