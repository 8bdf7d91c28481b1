"""A faster LoRA linear layer for PEFT: the adapter folded into the frozen weight for each step.

PEFT computes ``y = x W^T + s * B(A(dropout(x)))``: besides the base matmul, two skinny matmuls, an
activation-sized adapter output and an add in the forward, and in the backward an activation-sized input
gradient from the adapter path plus another add. With no dropout on the adapter input (PEFT's default, and
eval mode) the same ``y`` is ``x (W + s B A)^T``: the merged weight ``W + s B A`` is one small matmul the size of
``W`` (much smaller than the activations at training batch sizes), and the forward is a single matmul. The
backward recomputes the merged weight for ``dx`` and gets the adapter gradients from four skinny matmuls:

    u = x A^T,  v = dy B,  dA = s v^T x,  dB = s dy^T u.

Measured on an H200 (bench/BENCHMARKS.md, 2026-11-22 session 3, LoRA 1b seq 2048 batch 4): 1.094x PEFT's
layer in the same trainer and process. The
class is a subclass of PEFT's own ``lora.Linear`` (registered through PEFT's custom-module dispatch), so the
parameters, their names, ``merge_and_unload`` and everything else stay PEFT's; only ``forward`` takes the
merged path when it computes the same thing (or, with dropout, the path below), and falls back to PEFT's otherwise
(several active adapters, DoRA and other variants, a mixed-adapter batch, a base layer that is not a plain
``nn.Linear`` such as a 4-bit one, a trainable base weight, or fewer than ``in*out/(in+out)`` tokens in the
call, where PEFT's side path is the cheaper one: decoding, tiny batches).

With dropout on the adapter input (training only) the adapter cannot be folded: ``y = x W^T + s (d A^T) B^T``
with ``d = dropout(x)``. PEFT computes it as three matmuls, a scale and an add, and its output keeps both the base's
and the adapter's ``[tokens, out]`` results for the backward when selective activation checkpointing (compiled)
recomputes the sum. Here the base's output is the ``C`` input of the adapter's skinny matmul
(``addmm(x W^T, d A^T, B^T, alpha=s)``: the add happens in that matmul's epilogue): one ``[tokens, out]`` tensor
leaves the layer, and the backward needs only ``d`` (recomputed from ``x`` and the dropout's saved RNG state under
selective checkpointing and torch.compile), ``u = d A^T`` and the weights. (Eager selective checkpointing caches
every matmul output, the intermediate ``x W^T`` too: the memory gain is the compiled path's.) The dropout is PEFT's
module applied to ``x`` in the compute dtype; PEFT applies it after casting ``x`` to the adapters' dtype (fp32),
so on CUDA the masks are other draws of the same distribution (equal where ``x`` already has the adapters' dtype).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from peft.tuners.lora.layer import Linear as PeftLoraLinear
from torch import nn


class _MergedLoraLinear(torch.autograd.Function):
    """``y = x (W + s B A)^T + bias`` with a frozen ``W`` (and bias); gradients for ``x``, ``A`` and ``B``.
    Every tensor arrives in the compute dtype; ``A``/``B`` gradients go back through the caller's cast."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        a: torch.Tensor,
        b: torch.Tensor,
        scaling: float,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight, a, b)
        ctx.scaling = scaling
        return F.linear(x, torch.addmm(weight, b, a, alpha=scaling), bias)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, a, b = ctx.saved_tensors
        s = ctx.scaling
        x2 = x.reshape(-1, x.shape[-1])
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = None
        if ctx.needs_input_grad[0]:
            dx = torch.mm(dy2, torch.addmm(weight, b, a, alpha=s)).view(x.shape)
        da = db = None
        if ctx.needs_input_grad[3]:
            da = torch.mm(torch.mm(dy2, b).t(), x2).mul_(s)  # (dy B)^T x: [r, in]
        if ctx.needs_input_grad[4]:
            db = torch.mm(dy2.t(), torch.mm(x2, a.t())).mul_(s)  # dy^T (x A^T): [out, r]
        return dx, None, None, da, db, None


class _LoraLinear(torch.autograd.Function):
    """``y = x W^T + bias + s (d A^T) B^T`` with ``d`` the adapter's (dropped-out) input and a frozen ``W`` (and
    bias); gradients for ``x`` (base path), ``d`` (adapter path; autograd takes it back through the dropout), ``A``
    and ``B``. Every tensor arrives in the compute dtype."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        d: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        a: torch.Tensor,
        b: torch.Tensor,
        scaling: float,
    ) -> torch.Tensor:
        u = torch.mm(d.reshape(-1, d.shape[-1]), a.t())  # [tokens, r]
        y = F.linear(x, weight, bias).reshape(-1, weight.shape[0])
        ctx.save_for_backward(d, weight, a, b, u)
        ctx.scaling = scaling
        return torch.addmm(y, u, b.t(), alpha=scaling).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        d, weight, a, b, u = ctx.saved_tensors
        s = ctx.scaling
        dy2 = dy.reshape(-1, dy.shape[-1])
        g = torch.mm(dy2, b).mul_(s)  # s dy B: [tokens, r]
        dx = torch.mm(dy2, weight).view(*dy.shape[:-1], weight.shape[1]) if ctx.needs_input_grad[0] else None
        dd = torch.mm(g, a).view(d.shape) if ctx.needs_input_grad[1] else None
        da = torch.mm(g.t(), d.reshape(-1, d.shape[-1])) if ctx.needs_input_grad[4] else None
        db = torch.mm(dy2.t(), u).mul_(s) if ctx.needs_input_grad[5] else None
        return dx, dd, None, None, da, db, None


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class MergedLoraLinear(PeftLoraLinear):
    """PEFT's LoRA ``Linear`` whose forward folds the adapter into the frozen weight when that is exact (see the
    module docstring); registered for ``nn.Linear`` through ``peft.LoraConfig._register_custom_module``."""

    def _dropout_active(self, name: str) -> bool:
        dropout = self.lora_dropout[name]
        return self.training and not isinstance(dropout, nn.Identity) and getattr(dropout, "p", 1.0) > 0

    def _merged_path_ok(self, x: torch.Tensor, kwargs: dict[str, Any]) -> str | None:
        """The one active adapter when our forward (merged, or with dropout the fused adapter add) computes what
        PEFT's forward would, else None."""
        if self.disable_adapters or self.merged or kwargs or type(self.base_layer) is not nn.Linear:
            return None
        active = [a for a in self.active_adapters if a in self.lora_A]
        if len(active) != 1:
            return None
        name = active[0]
        base = self.base_layer
        if name in self.lora_variant or self.lora_bias.get(name, False) or base.weight.requires_grad:
            return None
        if base.bias is not None and base.bias.requires_grad:
            return None
        if self._dropout_active(name):
            return name  # no fold: the fused adapter add costs what PEFT's side path costs at any size
        # Folding costs ~in*out*r FLOPs and a weight-sized write per call, PEFT's side path ~tokens*(in+out)*r:
        # below in*out/(in+out) tokens (decoding, tiny batches) PEFT's forward is the cheaper one.
        if (
            x.numel() // max(1, x.shape[-1]) * (base.in_features + base.out_features)
            < base.in_features * base.out_features
        ):
            return None
        return name

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        name = None if args else self._merged_path_ok(x, kwargs)
        if name is None:
            return super().forward(x, *args, **kwargs)
        base = self.base_layer
        dt = _compute_dtype(x)
        a = self.lora_A[name].weight.to(dt)
        b = self.lora_B[name].weight.to(dt)
        bias = None if base.bias is None else base.bias.to(dt)
        scaling = float(self.scaling[name])
        if self._dropout_active(name):
            x = x.to(dt)
            d = self.lora_dropout[name](x)
            with torch.autocast(x.device.type, enabled=False):
                return _LoraLinear.apply(x, d, base.weight.to(dt), bias, a, b, scaling)
        with torch.autocast(x.device.type, enabled=False):
            return _MergedLoraLinear.apply(x.to(dt), base.weight.to(dt), bias, a, b, scaling)
