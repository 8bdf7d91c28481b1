"""INL-LLM, the user's "Integrator Language Model": a causal decoder whose blocks refine the attention output
with K steps of learned second-order (state + velocity) dynamics before adding it to the residual stream.
Why each choice, what was left out of the user's design, the K sweep and the size table: ``docs/models.md``.

Block (pre-norm)::

    a   = Attention(RMSNorm(r))                  # causal, RoPE, through SDPA
    x_K = Integrator(a)                          # K iterations, x_0 = a, v_0 = 0
    r   = r + x_K                                # a closed gate (-> 0) leaves a standard transformer block
    r   = r + W2 GELU(W1 RMSNorm(r))             # GELU FFN, 4 d wide

One integrator iteration (per token, per feature; ``h`` = ``a``, ``H`` = ``controller_hidden``)::

    [α̃, β̃, g̃, v_cand] = split_4(W_out GELU(W_in [h, x, v] + b_in) + b_out)   # W_in: 3d->H, W_out: H->4d
    α = sigmoid(α̃) · exp(-κ ⊙ |x - μ|)        # inertia, damped when far from equilibrium
    β = softplus(β̃)                            # restoring force
    v <- α v + (1 - α) v_cand - β (x - μ)
    x <- x + dt · sigmoid(g̃) · v               # uses the *new* v (semi-implicit Euler)

``μ`` and ``κ = softplus(κ̃)`` are learnt per feature (init 0 and 1); ``|x - μ|`` is per feature, not a norm
over features. The controller's output layer starts at zero weight, its biases giving α 0.8, β 0.5, gate 0.5.
The integrator reads only its own token's ``h``, so positions mix only through causal attention and the KV
cache holds attention keys and values only. K is a static loop (unrolled by compile); ``h``'s share of
``W_in`` is computed once; under bf16 autocast ``x`` and ``v`` accumulate in fp32 (``μ`` is fp32).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import nn

from gptoughts.errors import ConfigError
from gptoughts.models import inl_triton
from gptoughts.models.base import DecoderLM
from gptoughts.models.inl_fused import integrate
from gptoughts.models.layers import Attention, KVCache, RMSNorm, RotaryEmbedding

DEFAULT_K = 4
"""Integrator iterations per block unless configured (the best val loss of the K sweep: docs/models.md)."""

# Initial controller outputs (the user's defaults): inertia 0.8, restoring force 0.5, half-open gate.
_INIT_ALPHA = 0.8
_INIT_BETA = 0.5
_INIT_GATE = 0.5
_INIT_KAPPA = 1.0


@dataclass
class INLArgs:
    """Architecture hyper-parameters of an INL-LLM (build one with ``models.model_args``)."""

    KERNEL_FIELDS: ClassVar[frozenset[str]] = frozenset({"integrator_impl"})
    """The speed switches: other kernels, the same model and weights (a run resumes with them changed)."""

    d_model: int = 2048
    """Width of the residual stream."""
    n_layers: int = 40
    """Number of INL blocks."""
    n_heads: int = 16
    """Query heads per attention layer."""
    n_kv_heads: int | None = None
    """Key/value heads (grouped-query attention when fewer than ``n_heads``); None means ``n_heads``."""
    ffn_dim: int | None = None
    """Hidden width of the GELU FFN; None means ``4 * d_model``."""
    vocab_size: int = 32768
    """Embedding rows and logits; normally set from the tokenizer."""
    max_seq_len: int = 2048
    """Longest sequence the model accepts; sizes the RoPE tables and bounds KV caches."""
    n_iterations: int = DEFAULT_K
    """K, integrator iterations per block. 0 removes the integrator (a plain GELU transformer: the baseline)."""
    dt: float = 0.1
    """Time step of the integrator's state update ``x <- x + dt * gate * v``."""
    controller_hidden: int = 64
    """Hidden width of each block's controller MLP ``[h, x, v] (3d) -> H -> 4d``."""
    integrator_impl: Literal["reference", "fused", "triton"] = "reference"
    """How the integrator's K iterations run; both compute the same function with the same parameters (a
    checkpoint moves between them). ``reference``: the module's loop under autograd (~10 saved ``[B, T, d]``
    tensors per iteration). ``fused``: one autograd Function (``models/inl_fused.py``) that saves per iteration
    only x, v and the controller's H-wide pre-activation and recomputes the rest in a hand-written backward.
    ``triton``: the same saved state, each iteration's forward and backward one Triton kernel launch over tiles of
    tokens and features (``models/inl_triton.py``); where they cannot run (no CUDA or Triton, fp32 matmuls), the
    assembly records ``fused``, which runs."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    norm_eps: float = 1e-5
    """Epsilon of every RMSNorm."""
    init_std: float = 0.02
    """Std of the normal init; the residual-branch outputs get ``init_std / sqrt(2 n_layers)``."""

    def __post_init__(self) -> None:
        for name in ("d_model", "n_layers", "n_heads", "vocab_size", "max_seq_len", "controller_hidden"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model.{name} must be positive, got {getattr(self, name)}")
        if self.n_iterations < 0:
            raise ConfigError(
                f"model.n_iterations must be >= 0 (0 disables the integrator), got {self.n_iterations}"
            )
        if self.dt <= 0:
            raise ConfigError(f"model.dt must be positive, got {self.dt}")
        if self.integrator_impl not in ("reference", "fused", "triton"):
            raise ConfigError(
                f"model.integrator_impl must be reference, fused or triton, got {self.integrator_impl!r}"
            )
        if self.ffn_dim is not None and self.ffn_dim <= 0:
            raise ConfigError(f"model.ffn_dim must be positive, got {self.ffn_dim}")
        if self.d_model % self.n_heads:
            raise ConfigError(
                f"model.d_model ({self.d_model}) must be divisible by model.n_heads ({self.n_heads})"
            )
        if self.kv_heads <= 0 or self.n_heads % self.kv_heads:
            raise ConfigError(
                f"model.n_heads ({self.n_heads}) must be a multiple of model.n_kv_heads ({self.kv_heads})"
            )
        if self.hd % 2:
            raise ConfigError(f"the head dimension must be even for RoPE, got {self.hd}")

    @property
    def hd(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def ffn(self) -> int:
        return 4 * self.d_model if self.ffn_dim is None else self.ffn_dim


# Size presets: field overrides of INLArgs. d_model and n_layers are the user's; heads of 128 (the usual
# width at this scale, as in Llama; same FLOPs as the user's 32 heads of 64, half the softmax rows). The large
# sizes run the Triton integrator, faster and smaller than the reference there (bench/BENCHMARKS.md).
INL_SIZES: dict[str, dict[str, Any]] = {
    "debug": dict(d_model=64, n_layers=2, n_heads=4, vocab_size=512, max_seq_len=256),
    "3b": dict(d_model=2048, n_layers=40, n_heads=16, integrator_impl="triton"),
    "4b": dict(d_model=2304, n_layers=48, n_heads=18, integrator_impl="triton"),
}


class Integrator(nn.Module):
    """K iterations of the controlled state/velocity dynamics of the module docstring, per token.

    The controller weights are plain parameters (not ``nn.Linear``): ``W_in`` is used in two column slices
    (the ``h`` part once, the ``[x, v]`` part K times), and keeping them out of ``nn.Linear`` stops the fp8
    converter from wrapping matmuls whose reduction dim is 64 (memory bound: fp8 would only add casts).
    """

    def __init__(self, dim: int, n_iterations: int, dt: float, hidden: int, impl: str = "reference") -> None:
        super().__init__()
        self.dim = dim
        self.n_iterations = n_iterations
        self.dt = dt
        self.impl = impl  # "reference", "fused" or "triton" (INLArgs.integrator_impl)
        self.w_in = nn.Parameter(torch.empty(hidden, 3 * dim))  # columns: [h | x | v]
        self.b_in = nn.Parameter(torch.empty(hidden))
        self.w_out = nn.Parameter(torch.empty(4 * dim, hidden))  # rows: [α̃ | β̃ | g̃ | v_cand]
        self.b_out = nn.Parameter(torch.empty(4 * dim))
        self.mu = nn.Parameter(torch.empty(dim))
        self.kappa_raw = nn.Parameter(torch.empty(dim))  # κ = softplus(kappa_raw) > 0

    @torch.no_grad()
    def reset_parameters(self, std: float) -> None:
        d = self.dim
        nn.init.normal_(self.w_in, mean=0.0, std=std)
        self.b_in.zero_()
        self.w_out.zero_()
        self.b_out[:d] = math.log(_INIT_ALPHA / (1 - _INIT_ALPHA))
        self.b_out[d : 2 * d] = math.log(math.expm1(_INIT_BETA))
        self.b_out[2 * d : 3 * d] = math.log(_INIT_GATE / (1 - _INIT_GATE))
        self.b_out[3 * d :] = 0.0
        self.mu.zero_()
        self.kappa_raw.fill_(math.log(math.expm1(_INIT_KAPPA)))

    def _update(
        self, c: torch.Tensor, x: torch.Tensor, v: torch.Tensor, kappa: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The update equations, given the controller's pre-activation ``c = W_in [h, x, v] + b_in``."""
        a_logit, b_pre, g_logit, v_cand = F.linear(F.gelu(c), self.w_out, self.b_out).chunk(4, dim=-1)
        err = x - self.mu
        alpha = torch.sigmoid(a_logit) * torch.exp(-kappa * err.abs())
        v = alpha * v + (1 - alpha) * v_cand - F.softplus(b_pre) * err
        x = x + self.dt * torch.sigmoid(g_logit) * v
        return x, v

    def step(self, h: torch.Tensor, x: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One iteration from ``(x, v)`` given the context ``h`` (all ``[..., d]``): ``(x_next, v_next)``."""
        c = F.linear(torch.cat([h, x, v], dim=-1), self.w_in, self.b_in)
        return self._update(c, x, v, F.softplus(self.kappa_raw))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """``x_K`` after K iterations from ``x_0 = h``, ``v_0 = 0``."""
        d = self.dim
        kappa = F.softplus(self.kappa_raw)  # once, not K times
        # h does not change during the loop: its share of the controller's input layer is computed once (under
        # autocast in the autocast dtype: the controller's matmul dtype).
        c_h = F.linear(h, self.w_in[:, :d], self.b_in)
        w_xv = self.w_in[:, d:]
        if self.impl != "reference" and self.n_iterations > 0:
            args = (c_h, w_xv, self.w_out, self.b_out, self.mu, kappa, self.dt, self.n_iterations)
            if self.impl == "triton" and inl_triton.supported(h, self.w_in.size(0), c_h.dtype):
                return inl_triton.integrate(h, *args)
            return integrate(h, *args)
        x = h
        v = torch.zeros_like(h)  # v_0 = 0, so the first iteration also skips the v share of W_in
        for i in range(self.n_iterations):
            if i == 0:
                c = c_h + F.linear(x, w_xv[:, :d])
            else:
                c = c_h + F.linear(torch.cat([x, v], dim=-1), w_xv)
            x, v = self._update(c, x, v, kappa)
        return x

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, hidden={self.w_in.size(0)}, n_iterations={self.n_iterations}, dt={self.dt}, "
            f"impl={self.impl}"
        )


class GeluMLP(nn.Module):
    """``fc2(gelu(fc1 x))``, bias-free (exact erf GELU, as the user's ``nn.GELU()``)."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim, bias=False)
        self.fc2 = nn.Linear(hidden_dim, dim, bias=False)

    @torch.no_grad()
    def reset_parameters(self, std: float, out_std: float) -> None:
        nn.init.normal_(self.fc1.weight, mean=0.0, std=std)
        nn.init.normal_(self.fc2.weight, mean=0.0, std=out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class INLBlock(nn.Module):
    """Norm -> causal attention -> integrator -> residual, norm -> GELU FFN -> residual. The unit of
    activation checkpointing, per-block compile and FSDP sharding."""

    def __init__(self, args: INLArgs, layer_idx: int) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.d_model, args.norm_eps)
        self.attention = Attention(
            args.d_model, args.n_heads, args.kv_heads, args.hd, layer_idx=layer_idx, causal=True
        )
        # K = 0: no integrator parameters at all (unused parameters would trip DDP and waste optimizer state).
        self.integrator = (
            Integrator(args.d_model, args.n_iterations, args.dt, args.controller_hidden, args.integrator_impl)
            if args.n_iterations > 0
            else None
        )
        self.ffn_norm = RMSNorm(args.d_model, args.norm_eps)
        self.feed_forward = GeluMLP(args.d_model, args.ffn)

    def reset_parameters(self, std: float, out_std: float) -> None:
        self.attention_norm.reset_parameters()
        self.attention.reset_parameters(std, out_std)
        if self.integrator is not None:
            self.integrator.reset_parameters(std)
        self.ffn_norm.reset_parameters()
        self.feed_forward.reset_parameters(std, out_std)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache | None = None,
        doc_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = self.attention(self.attention_norm(x), cos, sin, cache, doc_ids)
        if self.integrator is not None:
            h = self.integrator(h)
        x = x + h
        return x + self.feed_forward(self.ffn_norm(x))


class INL(DecoderLM):
    """INL-LLM implementing the model protocol of ``docs/internals.md`` (tied embeddings).

    ``forward`` and ``init_weights`` come from ``DecoderLM``: Normal(0, init_std) for the embedding,
    attention/FFN input projections and the controller's input layer; ``init_std / sqrt(2 n_layers)`` for
    ``wo`` and ``fc2`` (residual-branch outputs); the controller's output layer as described in the module
    docstring; norms to 1; RoPE tables recomputed. With ``doc_ids`` (packed rows) attention stays within each
    document, and the integrator is per token, so nothing else crosses documents. The KV cache holds attention
    keys/values only: the integrator keeps no state across tokens.
    """

    def __init__(self, args: INLArgs) -> None:
        super().__init__(args)
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.d_model)
        self.rope = RotaryEmbedding(args.hd, args.max_seq_len, args.rope_theta)
        self.layers = nn.ModuleList(INLBlock(args, i) for i in range(args.n_layers))
        self.norm = RMSNorm(args.d_model, args.norm_eps)
        self.output = None  # tied: the LM head is the embedding matrix

    def matmul_params(self) -> int:
        """``N`` of ``flops_per_token``, counting each weight as many times as it is multiplied per token: the
        tied LM head once, the controller's ``W_in[:, :d]`` once and its ``W_in[:, d:]`` and ``W_out`` K times
        (see ``Integrator.forward``). Elementwise work of the integrator is not counted (it is memory bound).
        """
        a = self.args
        n = super().matmul_params()
        if a.n_iterations > 0:
            d, hid = a.d_model, a.controller_hidden
            once = 3 * d * hid + 4 * d * hid  # the controller's matrices as num_params counts them
            per_token = d * hid + a.n_iterations * (2 * d * hid + 4 * d * hid)
            n += a.n_layers * (per_token - once)
        return n
