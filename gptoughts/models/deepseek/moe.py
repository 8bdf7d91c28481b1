"""DeepSeekMoE: the router, the routed experts as grouped GEMMs, the shared experts, the balancing hooks.

Every layer from ``n_dense_layers`` on has ``n_shared_experts`` always-on experts (one SwiGLU of width
``n_shared_experts * moe_inter_dim``) plus ``n_routed_experts`` fine-grained SwiGLU experts of which each
token uses ``n_activated_experts``. Scores are ``sigmoid`` (V3) or ``softmax`` (V2) of the router ``gate``; the
top-k is chosen on ``score + expert_bias`` (optionally restricted to the best ``n_limited_groups`` of
``n_expert_groups`` groups), the gates are the raw scores of the chosen experts, normalised to sum 1 when
``norm_topk_prob``, times ``route_scale``.

**Auxiliary-loss-free balancing**: ``expert_bias`` only affects *which* experts are chosen, never the gate
values, and gets no gradient; the model moves it after each optimizer step from the expert loads that
``MoE.forward`` returns (``DeepSeek.after_optimizer_step``). An optional sequence-wise balance loss (V3 eq.
17-20, ``seq_aux_loss_coef``) is computed here in training mode (``MoE._seq_balance_loss``).

Speed switches (``DeepSeekArgs.moe_combine``, ``moe_permute``, ``moe_router``, ``moe_shared``; the model's defaults
are the pair measured fastest, ``GroupedExperts``'s own defaults the reference path) change the kernels, never the
model: tests/models/test_moe_levers.py holds them to the reference.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from gptoughts.models.deepseek.args import DeepSeekArgs
from gptoughts.models.deepseek.dispatch import (
    Layout,
    combine_rows,
    gather_sources,
    permute_tokens,
    plan,
    row_values,
)
from gptoughts.models.layers import SwiGLU

__all__ = ["EXPERT_ROW_ALIGN", "GroupedExperts", "MoE", "grouped_mm_supported", "probe_experts"]

# Rows of each expert's token group are padded to a multiple of this (zero rows) before the grouped GEMM: the
# CUDA grouped-GEMM kernels need 16-byte aligned group starts in the weight-gradient GEMM (whose reduction
# dim is the token dim), and 16 rows also covers fp8. The padding costs at most n_experts * 15 rows.
EXPERT_ROW_ALIGN = 16

_GMM_SUPPORT: dict[tuple[str, torch.dtype], tuple[bool, bool]] = {}
_WARNED_LOOP: set[tuple[str, torch.dtype]] = set()


def grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> tuple[bool, bool]:
    """Whether ``torch._grouped_mm`` works on ``device`` for ``dtype``: ``(eager, compiled)``, probed once per
    (device type, dtype). Eager: forward and backward give the reference result. Compiled: also its meta kernel,
    which ``torch.compile`` traces through, accepts the dtype (in torch 2.13 that kernel takes bf16 only, while
    the CPU kernel also runs fp32).

    The op exists on CUDA (bf16; Hopper+, with a fallback on some older GPUs in recent torch) and, in recent
    torch, on CPU. Probing a tiny call is more reliable than a table of versions and architectures. Runs at init
    (see ``GroupedExperts.reset_parameters``), so forward only reads the cached answer.
    """
    key = (device.type, dtype)
    if key not in _GMM_SUPPORT:
        # Never traced. Disabled here, not with a decorator: that would import torch._dynamo (a second or more)
        # with this module, in every command that imports the models, whether or not it builds one.
        with _invisible_to_saved_tensor_hooks():
            _GMM_SUPPORT[key] = torch.compiler.disable(_probe_grouped_mm)(device, dtype)
    return _GMM_SUPPORT[key]


@contextlib.contextmanager
def _invisible_to_saved_tensor_hooks() -> Iterator[None]:
    """The probe's own forward and backward must not reach saved-tensor hooks active around it: activation
    checkpointing's would count the probe's tensors in a block's original forward and not in its recomputation
    (where the cached answer is read), and fail the backward ("a different number of tensors was saved"). Only
    the innermost pair of hooks applies, so identity hooks pushed here hide the outer ones."""
    try:
        hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        hooks.__enter__()
    except RuntimeError:  # hooks disabled in this region: none is active either
        yield
        return
    try:
        yield
    finally:
        hooks.__exit__(None, None, None)


def _probe_grouped_mm(device: torch.device, dtype: torch.dtype) -> tuple[bool, bool]:
    eager = compiled = False
    fn = getattr(torch, "_grouped_mm", None)
    if fn is not None and device.type != "meta":
        try:
            with (
                torch.inference_mode(False),
                torch.enable_grad(),
                torch.autocast(device.type, enabled=False),
            ):
                g = torch.Generator(device="cpu").manual_seed(0)
                x = torch.randn(32, 16, generator=g).to(device, dtype).requires_grad_()
                w = torch.randn(2, 16, 16, generator=g).to(device, dtype).requires_grad_()
                offs = torch.tensor([16, 32], dtype=torch.int32, device=device)
                y = fn(x, w.transpose(-2, -1), offs=offs)
                ref = torch.cat([x[:16] @ w[0].T, x[16:] @ w[1].T])
                y.backward(torch.ones_like(y))
                eager = (
                    bool(torch.allclose(y.float(), ref.float(), atol=0.1, rtol=0.05)) and w.grad is not None
                )
        except Exception:  # any failure means "use the per-expert fallback"
            eager = False
        if eager:
            try:
                fn(x.detach().to("meta"), w.detach().to("meta").transpose(-2, -1), offs=offs.to("meta"))
                compiled = True
            except Exception:
                compiled = False
    return eager, compiled


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class GroupedExperts(nn.Module):
    """``n_experts`` SwiGLU experts stored as 3-D weights and run as grouped GEMMs over expert-sorted tokens.

    ``w1``/``w3``: ``[E, hidden, dim]``, ``w2``: ``[E, dim, hidden]`` (``nn.Linear`` layout per expert). These
    are plain parameters, not ``nn.Linear``: the fp8 converter leaves them alone (they stay bf16).
    """

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        n_experts: int,
        *,
        combine: str = "bmm",
        permute: str = "index_put",
        w13: str = "separate",
    ) -> None:
        super().__init__()
        if (
            combine not in ("bmm", "sum", "hidden")
            or permute not in ("index_put", "gather")
            or w13 not in ("separate", "fused")
        ):
            raise ValueError(f"unknown combine {combine!r}, permute {permute!r} or w13 {w13!r}")
        if permute == "gather" and combine == "bmm":
            raise ValueError("permute='gather' sums the K outputs itself: use combine='sum' or 'hidden'")
        self.n_experts = n_experts
        # DeepSeekArgs.moe_combine / moe_permute / moe_w13
        self.combine, self.permute, self.w13 = combine, permute, w13
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))
        # "auto" (grouped GEMM where grouped_mm_supported, else "loop"), "grouped_mm" or "loop" (tests, debugging).
        self.impl = "auto"
        self.probe(self.w1.device)

    def probe(self, device: torch.device) -> None:
        """Decide the grouped-GEMM support for inputs on ``device``. Called at init for the weights' device and by
        the run's assembly for the compute device (they differ under CPU offload: weights on the CPU, inputs on
        the GPU), so that forward only reads the answer: the compiled block reads Python sets (guards, not graph
        breaks), and no probe runs inside a checkpointed forward."""
        support = {
            dt: grouped_mm_supported(device, dt) for dt in (torch.float32, torch.bfloat16, torch.float16)
        }
        self._gmm_device = device.type
        self._gmm_dtypes = frozenset(dt for dt, (eager, _) in support.items() if eager)
        self._gmm_compiled_dtypes = frozenset(dt for dt, (_, compiled) in support.items() if compiled)

    def reset_parameters(self, std: float, out_std: float) -> None:
        nn.init.normal_(self.w1, mean=0.0, std=std)
        nn.init.normal_(self.w3, mean=0.0, std=std)
        nn.init.normal_(self.w2, mean=0.0, std=out_std)
        self.probe(self.w1.device)

    def forward(
        self, x: torch.Tensor, idx: torch.Tensor, gates: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [N, d]``, chosen experts ``idx [N, K]`` and their ``gates [N, K]`` -> (``sum_k gate * expert(x)``
        ``[N, d]``, tokens per expert ``[E]`` int64). No host sync on the grouped-GEMM path."""
        return self.compute(x, idx, gates, self.n_experts)

    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(w1, w3, w2)`` as the GEMMs read them (a parallel wrapper may hand out its local experts)."""
        return self.w1, self.w3, self.w2

    def compute(
        self, x: torch.Tensor, idx: torch.Tensor, gates: torch.Tensor | None, n_experts: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward` over the ``n_experts`` experts of :meth:`expert_weights` (ids ``0..n_experts-1``).
        ``gates`` None: every gate is 1 (the expert-parallel dispatch, which weights the sum on the token's rank)."""
        k = idx.size(1)
        layout = plan(idx, n_experts, EXPERT_ROW_ALIGN)
        hidden = self.combine == "hidden" and gates is not None
        row_gate = row_values(layout, gates.reshape(-1)) if hidden else None
        xp, src = self.to_rows(x, layout, k)
        yp = self._run(xp, layout.ends, row_gate)
        out = self.from_rows(yp, layout, k, gates, src)
        return out, layout.counts

    def to_rows(self, x: torch.Tensor, layout: Layout, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The K copies of each token of ``x [N, d]`` on ``layout``'s rows, moved as ``permute`` says; with the
        rows' sources (None under ``index_put``), which :meth:`from_rows` takes back."""
        src = gather_sources(layout, k, self.permute)
        # Under gather, cast before the permutation: N rows converted instead of N*K (+ padding).
        return permute_tokens(x if src is None else x.to(_compute_dtype(x)), layout, k, src), src

    def from_rows(
        self,
        yp: torch.Tensor,
        layout: Layout,
        k: int,
        gates: torch.Tensor | None,
        src: torch.Tensor | None,
    ) -> torch.Tensor:
        """Each token's K expert outputs ``yp`` summed back into ``[N, d]``: weighted by ``gates`` under ``sum`` /
        ``bmm`` (their gradient computed there); under ``hidden`` the gates already scaled the rows."""
        weights = None if self.combine == "hidden" else gates
        return combine_rows(yp, layout, k, weights, src, bmm=self.combine == "bmm")

    def _run(
        self, xp: torch.Tensor, offs: torch.Tensor, row_gate: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The experts on the padded rows ``xp`` (groups ending at ``offs``); ``row_gate [rows]``, when given,
        scales each row's hidden activation before ``w2`` (``combine = hidden``)."""
        dtype = _compute_dtype(xp)
        if xp.device.type != self._gmm_device:  # moved after init and not told: probe it (eager only)
            self.probe(xp.device)
        ok = self._gmm_compiled_dtypes if torch.compiler.is_compiling() else self._gmm_dtypes
        use_gmm = self.impl == "grouped_mm" or (self.impl == "auto" and dtype in ok)
        weights = self.expert_weights()
        if use_gmm:
            xp = xp.to(dtype)
            # A transposed view, not a copy: the cast keeps the weights' layout and the grouped GEMM reads
            # the column-major operand as it is.
            w1, w3, w2 = weights
            if self.w13 == "fused":
                # One GEMM [E, dim, 2 * hidden]; cast, then concatenated (one fused kernel under compile), so the
                # backward casts each half's gradient into a tensor of its own, laid out as its parameter.
                w13 = torch.cat([w1.to(dtype), w3.to(dtype)], dim=1).transpose(-2, -1)
                gate, up = torch._grouped_mm(xp, w13, offs=offs).chunk(2, dim=-1)
            else:
                gate = torch._grouped_mm(xp, w1.to(dtype).transpose(-2, -1), offs=offs)
                up = torch._grouped_mm(xp, w3.to(dtype).transpose(-2, -1), offs=offs)
            h = F.silu(gate) * up
            if row_gate is not None:
                h = h * row_gate.unsqueeze(-1).to(h.dtype)
            return torch._grouped_mm(h, w2.to(dtype).transpose(-2, -1), offs=offs)
        # Fallback: one GEMM per *expert* (never per token). Reading the group ends costs one host sync per
        # MoE layer and a graph break under compile; free on CPU, where this path is normally taken.
        if xp.is_cuda and (xp.device.type, dtype) not in _WARNED_LOOP:
            _WARNED_LOOP.add((xp.device.type, dtype))
            warnings.warn(
                f"torch._grouped_mm is unavailable for {dtype} on this GPU/torch: MoE experts run one GEMM per "
                "expert, with a host sync per MoE layer (slower; bf16 autocast on Hopper+ avoids it)",
                stacklevel=2,
            )
        ends = offs.tolist()
        outs, start = [], 0
        w1, w3, w2 = weights
        for g, end in enumerate(ends):
            xe = xp[start:end]
            h = F.silu(F.linear(xe, w1[g])) * F.linear(xe, w3[g])
            if row_gate is not None:
                h = h * row_gate[start:end].unsqueeze(-1).to(h.dtype)
            outs.append(F.linear(h, w2[g]))
            start = end
        return torch.cat(outs)


def probe_experts(model: nn.Module, device: torch.device) -> int:
    """Tell every :class:`GroupedExperts` of ``model`` the device its inputs will be on (see
    ``GroupedExperts.probe``); returns how many there are."""
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    for m in experts:
        m.probe(device)
    return len(experts)


class MoE(nn.Module):
    """DeepSeekMoE: shared experts + top-k routed experts with bias-adjusted selection."""

    def __init__(self, args: DeepSeekArgs) -> None:
        super().__init__()
        self.n_experts = args.n_routed_experts
        self.top_k = args.n_activated_experts
        self.score_func = args.score_func
        self.route_scale = args.route_scale
        self.norm_topk_prob = args.norm_topk_prob
        self.n_groups, self.topk_groups = args.n_expert_groups, args.n_limited_groups
        self.seq_aux = args.seq_aux_loss_coef > 0
        # Named `gate` (HF's name) so the fp8 converter skips it: the router stays in high precision.
        self.gate = nn.Linear(args.d_model, args.n_routed_experts, bias=False)
        # Persistent (checkpointed, exported as e_score_correction_bias) and fp32: updates of ~1e-3 would be lost
        # in bf16 next to values of order 0.1-1.
        self.register_buffer("expert_bias", torch.zeros(args.n_routed_experts, dtype=torch.float32))
        self.experts = GroupedExperts(
            args.d_model,
            args.moe_inter_dim,
            args.n_routed_experts,
            combine=args.moe_combine,
            permute=args.moe_permute,
            w13=args.moe_w13,
        )
        self.router, self.shared_mode = args.moe_router, args.moe_shared
        self._side_stream: torch.cuda.Stream | None = None  # moe_shared = stream, created on first use
        self.shared_experts = (
            SwiGLU(args.d_model, args.n_shared_experts * args.moe_inter_dim)
            if args.n_shared_experts
            else None
        )

    def reset_parameters(self, std: float, out_std: float) -> None:
        nn.init.normal_(self.gate.weight, mean=0.0, std=std)
        with torch.no_grad():
            self.expert_bias.zero_()
        self.experts.reset_parameters(std, out_std)
        if self.shared_experts is not None:
            self.shared_experts.reset_parameters(std, out_std)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [N, d]`` -> (gates ``[N, K]`` fp32, expert ids ``[N, K]``, scores ``[N, E]`` fp32)."""
        # Routing in fp32 even under autocast (as DeepSeek and transformers do): near-ties in bf16 would flip
        # expert choices between otherwise identical runs.
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), self.gate.weight.float())
        scores = logits.sigmoid() if self.score_func == "sigmoid" else logits.softmax(dim=-1)
        choice = scores + self.expert_bias  # the bias steers selection only; gates use the raw scores
        if self.n_groups > 1:
            idx = self._group_limited_topk(choice)
        else:
            idx = choice.topk(self.top_k, dim=-1).indices
        gates = scores.gather(1, idx)
        if self.norm_topk_prob:
            gates = gates / (gates.sum(dim=-1, keepdim=True) + 1e-20)
        return gates * self.route_scale, idx, scores

    def _group_limited_topk(self, choice: torch.Tensor) -> torch.Tensor:
        """Top-k experts of the biased scores ``choice [N, E]`` within each token's best ``topk_groups`` groups
        (a group's score: the sum of its two best)."""
        n = choice.size(0)
        grouped = choice.view(n, self.n_groups, -1)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [N, G]
        kept = group_scores.topk(self.topk_groups, dim=-1).indices
        if self.router == "gather":
            # Kept groups in ascending order: the candidates are the masked row without its -inf entries, in the
            # same order, so top-k picks the same experts (ties included) from a row G/topk_groups shorter.
            kept = kept.sort(dim=-1).values
            per = grouped.size(-1)
            cand = grouped.gather(1, kept.unsqueeze(-1).expand(-1, -1, per)).view(n, -1)
            local = cand.topk(self.top_k, dim=-1).indices
            return kept.gather(1, local // per) * per + local % per
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, kept, True)
        return (
            grouped.masked_fill(~keep.unsqueeze(-1), float("-inf"))
            .view(n, -1)
            .topk(self.top_k, dim=-1)
            .indices
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``x [B, T, d]`` -> (output ``[B, T, d]``, tokens per expert ``[E]``, sequence balance loss or None)."""
        bsz, seqlen, dim = x.shape
        shared, side = (None, None) if self.shared_mode == "after" else self._shared_first(x)
        flat = x.reshape(-1, dim)
        gates, idx, scores = self.route(flat)
        routed, counts = self.experts(flat, idx, gates)
        out = routed.view(bsz, seqlen, dim).to(x.dtype)
        if self.shared_experts is not None:
            if side is not None:  # the side stream's shared output must be complete before the sum reads it
                torch.cuda.current_stream(x.device).wait_stream(side)
            out = out + (self.shared_experts(x) if shared is None else shared)
        aux = self._seq_balance_loss(scores, idx, bsz, seqlen) if (self.seq_aux and self.training) else None
        return out, counts, aux

    def _shared_first(self, x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Stream | None]:
        """The shared experts' output computed before the routed path, on a side CUDA stream for ``stream``
        (eager CUDA: the router and the dispatch's small kernels leave the GPU room). Autograd runs their
        backward on the same side stream. Under compile, where streams are not scheduled, in order."""
        if self.shared_experts is None:
            return None, None
        if self.shared_mode == "stream" and x.is_cuda and not torch.compiler.is_compiling():
            if self._side_stream is None or self._side_stream.device != x.device:
                self._side_stream = torch.cuda.Stream(x.device)
            side = self._side_stream
            side.wait_stream(torch.cuda.current_stream(x.device))  # x is ready
            with torch.cuda.stream(side):
                return self.shared_experts(x), side
        return self.shared_experts(x), None

    def _seq_balance_loss(
        self, scores: torch.Tensor, idx: torch.Tensor, bsz: int, seqlen: int
    ) -> torch.Tensor:
        """DeepSeek-V3's sequence-wise balance loss ``sum_i f_i P_i``, averaged over the batch's sequences.

        ``f_i = E / (K T) * #{t: i chosen at t}`` (no gradient), ``P_i = mean_t s'_{i,t}`` with ``s'`` the scores
        normalised over all experts (a no-op for softmax). Equals 1 for perfectly uniform routing.
        """
        e, k = self.n_experts, self.top_k
        probs = scores / scores.sum(dim=-1, keepdim=True) if self.score_func == "sigmoid" else scores
        p = probs.view(bsz, seqlen, e).mean(dim=1)  # [B, E]
        # Counts by comparison rather than scatter_add (deterministic on CUDA); bool, so T*K*E bytes.
        chosen = idx.view(bsz, seqlen * k, 1) == torch.arange(e, device=idx.device)
        f = chosen.sum(dim=1).float() * (e / (k * seqlen))
        return (f * p).sum(dim=-1).mean()
