"""A faster LoRA linear layer for PEFT: the adapter folded into the frozen weight for each step.

PEFT computes ``y = x W^T + s * B(A(dropout(x)))``. Without adapter dropout that is ``x (W + s B A)^T``: one
matmul forward; the backward recomputes the merged weight for ``dx`` and takes the adapter gradients from four
skinny matmuls (``u = x A^T, v = dy B, dA = s v^T x, dB = s dy^T u``). With dropout (training only) the
adapter's matmul accumulates into the base's output in its epilogue (:func:`_linear_add_lowrank`), with our
seeded dropout (``perf/dropout.py``) kept as bits for the backward: one ``[tokens, out]`` tensor leaves the
layer.

:class:`MergedLoraLinear` subclasses PEFT's ``lora.Linear`` (parameters, names, ``merge_and_unload`` stay
PEFT's) and falls back to PEFT's forward where ours would not compute the same thing or would cost more:
several active adapters, DoRA and other variants, mixed-adapter batches, a base that is not a plain
``nn.Linear``, a trainable base, or fewer than ``in*out/(in+out)`` tokens. Why, and the measurements:
``docs/performance.md``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from peft.tuners.lora.layer import Linear as PeftLoraLinear
from torch import nn

from gptoughts.perf.dropout import apply_bits, dropout_bits, new_seed


# An op of its own rather than an autograd.Function: compiled under full activation checkpointing, torch before
# pytorch/pytorch#177396 (2.11) saved a Function's outputs rather than recomputing them (every layer's projections:
# 7.7 GiB at 1b LoRA-DPO, bench/BENCHMARKS.md); an op node is recomputed like any other in the region.
@torch.library.custom_op("gptoughts::merged_lora_linear", mutates_args=())
def _merged_lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    a: torch.Tensor,
    b: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """``y = x (W + s B A)^T + bias`` with a frozen ``W`` (and bias); gradients for ``x``, ``A`` and ``B``.
    Every tensor arrives in the compute dtype; ``A``/``B`` gradients go back through the caller's cast."""
    return F.linear(x, torch.addmm(weight, b, a, alpha=scaling), bias)


@_merged_lora_linear.register_fake
def _(x, weight, bias, a, b, scaling):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _merged_setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    x, weight, _, a, b, scaling = inputs
    ctx.save_for_backward(x, weight, a, b)
    ctx.scaling = scaling


def _merged_backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    x, weight, a, b = ctx.saved_tensors
    s = ctx.scaling
    x2 = x.reshape(-1, x.shape[-1])
    dy2 = dy.reshape(-1, dy.shape[-1])
    dx = da = db = None
    if ctx.needs_input_grad[0]:
        dx = torch.mm(dy2, torch.addmm(weight, b, a, alpha=s)).view(x.shape)
    if ctx.needs_input_grad[3]:
        da = torch.mm(torch.mm(dy2, b).t(), x2).mul_(s)  # (dy B)^T x: [r, in]
    if ctx.needs_input_grad[4]:
        db = torch.mm(dy2.t(), torch.mm(x2, a.t())).mul_(s)  # dy^T (x A^T): [out, r]
    return dx, None, None, da, db, None


_merged_lora_linear.register_autograd(_merged_backward, setup_context=_merged_setup)


@torch.library.custom_op("gptoughts::linear_add_lowrank", mutates_args=())
def _linear_add_lowrank(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    u: torch.Tensor,
    b: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """``x W^T + bias + s u B^T`` as two cuBLAS calls, the second accumulating into the first's output. An op of its
    own because torch.compile lowers ``addmm(y, u, B^T)`` to an out-of-place call that first copies ``y`` (a
    device-to-device copy of every LoRA layer's output; measured: ``docs/performance.md``)."""
    return F.linear(x, weight, bias).addmm_(u, b.t(), alpha=scaling)


@_linear_add_lowrank.register_fake
def _(x, weight, bias, u, b, scaling):
    return x.new_empty(x.shape[0], weight.shape[0])


class _LoraLinear(torch.autograd.Function):
    """``y = x W^T + bias + s (drop(x) A^T) B^T`` with ``drop`` the seeded dropout of rate ``p`` and a frozen ``W``
    (and bias); gradients for ``x``, ``A`` and ``B``. The mask is kept as bits (one per element) for the backward.
    Every tensor arrives in the compute dtype."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        seed: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        a: torch.Tensor,
        b: torch.Tensor,
        scaling: float,
        p: float,
    ) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        bits = dropout_bits(seed, x2.numel(), p)
        u = torch.mm(apply_bits(x2, bits, p), a.t())  # [tokens, r]
        ctx.save_for_backward(x, bits, weight, a, b, u)
        ctx.scaling, ctx.p = scaling, p
        return _linear_add_lowrank(x2, weight, bias, u, b, scaling).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, bits, weight, a, b, u = ctx.saved_tensors
        s, p = ctx.scaling, ctx.p
        dy2 = dy.reshape(-1, dy.shape[-1])
        g = torch.mm(dy2, b).mul_(s)  # s dy B: [tokens, r]
        dx = da = db = None
        if ctx.needs_input_grad[0]:
            # dy W + drop(g A): the add fuses with the mask and the neighbours' kernels
            dx = (torch.mm(dy2, weight) + apply_bits(torch.mm(g, a), bits, p)).view(x.shape)
        if ctx.needs_input_grad[4]:
            da = torch.mm(g.t(), apply_bits(x.reshape(-1, x.shape[-1]), bits, p))
        if ctx.needs_input_grad[5]:
            db = torch.mm(dy2.t(), u).mul_(s)
        return dx, None, None, None, da, db, None, None


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
            # no fold: the fused adapter add costs what PEFT's side path costs at any size; our layer draws the
            # mask itself, so a dropout module other than nn.Dropout (replaced by the user) keeps PEFT's forward
            return name if type(self.lora_dropout[name]) is nn.Dropout else None
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
            p, seed = float(self.lora_dropout[name].p), new_seed(x.device)
            with torch.autocast(x.device.type, enabled=False):
                return _LoraLinear.apply(x.to(dt), seed, base.weight.to(dt), bias, a, b, scaling, p)
        with torch.autocast(x.device.type, enabled=False):
            return _merged_lora_linear(x.to(dt), base.weight.to(dt), bias, a, b, scaling)
