"""fp8 linears fed by the op that makes their input (``perf.fp8_recipe = fused_rowwise``), without torchao.

Each activation is quantized per row (e4m3, one fp32 power-of-2 scale per row) by plain torch ops written right
after its producer (RMSNorm before q/k/v and gate/up, SwiGLU's ``silu(a) * b`` before down): under per-block
torch.compile the row amax and the cast land in the producer's own kernel, and the three identical quantizations
of q/k/v's input are merged by AOTAutograd's common-subexpression pass. torchao's tensorwise scaling needs a
whole-tensor amax instead, which no row kernel can produce: separate reduction, cast and transpose passes.

:class:`_Fp8Linear` runs the linear with ``torch._scaled_mm``: forward and input gradient in fp8 (weights
quantized per output row and per input column), weight gradient in bf16 from the bf16 input (torchao's
``rowwise_with_gw_hp``: an accurate weight gradient, and no transposed fp8 copy of the activation), or in fp8 too
(``perf.fp8_wgrad = fp8``: dy and the input quantized per channel over the tokens, two transposed casts that
compile fuses into one pass each). Off CUDA (CPU tests) or at row counts the fp8 kernels refuse, the same quantized
operands are multiplied in fp32 instead.

Scope: the dense blocks of the llama family; master weights, optimizer, norms' weights and the LM head as they were.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from gptoughts.errors import UserError
from gptoughts.models.layers import SwiGLU

E4M3 = torch.float8_e4m3fn
_FMAX = torch.finfo(E4M3).max
_AMAX_FLOOR = 1e-12  # an all-zero row gets a tiny scale instead of 0/0


def quantize_rowwise(x: torch.Tensor, dtype: torch.dtype = E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: ``x ≈ q.float() * scale``, one scale per row of the last dim, ``scale [..., 1]`` fp32.

    The scale is a power of two (as torchao's rowwise recipe): dividing by it is exact, so the only rounding is
    the fp8 cast. Plain ops over the last dim, so that inductor fuses them with whatever produced ``x``."""
    fmax = torch.finfo(dtype).max
    xf = x.detach().float()
    amax = xf.abs().amax(dim=-1, keepdim=True).clamp(min=_AMAX_FLOOR)
    scale = torch.exp2(torch.ceil(torch.log2(amax / fmax)))
    return (xf / scale).clamp(-fmax, fmax).to(dtype), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale


def rms_norm_fp8(
    x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RMSNorm and its fp8 rows: ``(y, y_fp8, row_scale)``; ``y`` (differentiable) feeds the weight gradient."""
    y = F.rms_norm(x, (x.shape[-1],), weight, eps)
    return (y, *quantize_rowwise(y))


def swiglu_fp8(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``silu(a) * b`` and its fp8 rows: ``(h, h_fp8, row_scale)``."""
    h = F.silu(a) * b
    return (h, *quantize_rowwise(h))


def _mm(
    a: torch.Tensor, sa: torch.Tensor, b_t: torch.Tensor, sb: torch.Tensor, scaled_mm: bool, fast: bool
) -> torch.Tensor:
    """``(a * sa) @ (b_t * sb).T`` in bf16 for row-major fp8 ``a [M, K]``, ``b_t [N, K]``, scales ``[M, 1]``,
    ``[N, 1]``. ``_scaled_mm`` wants its second operand column-major: ``b_t.t()`` is exactly that (no copy).
    ``fast``: the tensor cores' fast, less precise accumulation."""
    if scaled_mm:
        # Layouts the CUDA kernel insists on: `a` row-major, the second operand column-major. A quantized W.T
        # (backward) comes out in W.T's strides, and dy can arrive strided: a copy then (no-op otherwise).
        return torch._scaled_mm(
            a.contiguous(),
            b_t.contiguous().t(),
            scale_a=sa,
            scale_b=sb.t(),
            out_dtype=torch.bfloat16,
            use_fast_accum=fast,
        )
    return (dequantize(a, sa) @ dequantize(b_t, sb).t()).to(torch.bfloat16)


def _use_scaled_mm(x: torch.Tensor, force: bool | None) -> bool:
    # The fp8 tensor-core kernels need every dim a multiple of 16; K and N are checked at conversion, M
    # (batch x tokens) varies at evaluation and sampling, where the fp32 path serves those odd shapes.
    if force is not None:
        return force
    return x.device.type == "cuda" and x.shape[0] % 16 == 0


class _Fp8Linear(torch.autograd.Function):
    """``y = x @ W.T`` from an already-quantized ``x`` (``x_fp8 [M, K]``, ``x_scale [M, 1]``); ``x_hp`` is the same
    activation in bf16, kept for the weight gradient (it is also where the input gradient goes)."""

    @staticmethod
    def forward(ctx, x_fp8, x_scale, x_hp, weight, scaled_mm, fast_accum_bwd, wgrad_fp8):  # type: ignore[override]
        w_fp8, w_scale = quantize_rowwise(weight)  # per output row: scale [N, 1]
        ctx.save_for_backward(x_hp, weight)
        ctx.scaled_mm, ctx.fast, ctx.wgrad_fp8 = scaled_mm, fast_accum_bwd, wgrad_fp8
        # Fast accumulation in the forward, as torchao's recipes do; the backward's is perf.fp8_fast_accum.
        return _mm(x_fp8, x_scale, w_fp8, w_scale, scaled_mm, True)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x_hp, weight = ctx.saved_tensors
        dy_fp8, dy_scale = quantize_rowwise(dy)
        # dx = dy @ W: W quantized per input column (rows of W.T), so its scales broadcast along dx's columns.
        wt_fp8, wt_scale = quantize_rowwise(weight.t())
        dx = _mm(dy_fp8, dy_scale, wt_fp8, wt_scale, ctx.scaled_mm, ctx.fast).to(x_hp.dtype)
        dw = None
        if ctx.needs_input_grad[3] and ctx.wgrad_fp8:
            # dW = dy^T x, the tokens reduced: each operand's rows are channels, scaled over the tokens.
            dyt_fp8, dyt_scale = quantize_rowwise(dy.t())
            xt_fp8, xt_scale = quantize_rowwise(x_hp.t())
            dw = _mm(dyt_fp8, dyt_scale, xt_fp8, xt_scale, ctx.scaled_mm, ctx.fast).to(weight.dtype)
        elif ctx.needs_input_grad[
            3
        ]:  # a frozen weight (LoRA's base) would discard it: a third of the matmuls
            dw = (dy.to(torch.bfloat16).t() @ x_hp.to(torch.bfloat16)).to(weight.dtype)
        return None, None, dx, dw, None, None, None


def fp8_linear(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    x_hp: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    scaled_mm: bool | None = None,
    fast_accum_bwd: bool = False,
    wgrad_fp8: bool = False,
) -> torch.Tensor:
    """``F.linear(x_hp, weight, bias)`` computed from the quantized ``x_fp8``/``x_scale`` (leading dims kept); the
    output is in the autocast dtype when autocast is on, else in ``x_hp``'s. ``scaled_mm``: None picks
    ``torch._scaled_mm`` on CUDA, True/False force it (tests) or the fp32 reference; ``fast_accum_bwd``: the input
    gradient's matmul accumulates in the fast mode too (``perf.fp8_fast_accum``); ``wgrad_fp8``: the weight gradient
    in fp8 too (``perf.fp8_wgrad``)."""
    lead, k = x_hp.shape[:-1], x_hp.shape[-1]
    dtype = _out_dtype(x_hp)
    with torch.autocast(x_hp.device.type, enabled=False):
        x2 = x_hp.reshape(-1, k)
        use = _use_scaled_mm(x2, scaled_mm)
        y = _Fp8Linear.apply(
            x_fp8.reshape(-1, k), x_scale.reshape(-1, 1), x2, weight, use, fast_accum_bwd, wgrad_fp8
        )
    y = y.to(dtype).reshape(*lead, weight.shape[0])
    return y if bias is None else y + bias.to(dtype)


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


class FusedFp8Linear(nn.Linear):
    """An ``nn.Linear`` (same parameters and state dict) whose matmul runs in fp8 through :func:`fp8_linear`; it
    quantizes its input itself, next to the input's producer in the compiled block graph."""

    scaled_mm: bool | None = None  # None: torch._scaled_mm on CUDA (see fp8_linear)
    fast_accum_bwd: bool = False
    wgrad_fp8: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_hp = x.to(_out_dtype(x))
        q, s = quantize_rowwise(x_hp)
        opts = (self.scaled_mm, self.fast_accum_bwd, self.wgrad_fp8)
        return fp8_linear(q, s, x_hp, self.weight, self.bias, *opts)


class FusedFp8SwiGLU(SwiGLU):
    """SwiGLU (same ``w1``/``w2``/``w3`` parameters) with its input quantized once for gate and up, and the
    down projection fed by :func:`swiglu_fp8`'s own fp8 output. Its linears are :class:`FusedFp8Linear` too, which
    serve on their own where adapters wrap them."""

    scaled_mm: bool | None = None
    fast_accum_bwd: bool = False
    wgrad_fp8: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not all(type(lin) is FusedFp8Linear for lin in (self.w1, self.w2, self.w3)):
            # LoRA (applied after fp8) wrapped the linears: reading their weights here would skip the adapters.
            # Each wrapped FusedFp8Linear quantizes its own input instead (the same values, no shared cast).
            return super().forward(x)
        x_hp = x.to(_out_dtype(x))
        q, s = quantize_rowwise(x_hp)
        opts = (self.scaled_mm, self.fast_accum_bwd, self.wgrad_fp8)
        a = fp8_linear(q, s, x_hp, self.w1.weight, self.w1.bias, *opts)
        b = fp8_linear(q, s, x_hp, self.w3.weight, self.w3.bias, *opts)
        h, h_fp8, h_scale = swiglu_fp8(a, b)
        return fp8_linear(h_fp8, h_scale, h, self.w2.weight, self.w2.bias, *opts)


def convert_to_fused_fp8(
    model: nn.Module, bf16_end_layers: int = 0, fast_accum_bwd: bool = False, wgrad_fp8: bool = False
) -> int:
    """Swap the linears of a llama-family model's blocks for their fused-fp8 forms, in place (parameters, their
    names and the state dict unchanged); returns how many linears run in fp8. Same exclusions as torchao's path
    (:func:`gptoughts.perf.fp8.fp8_module_filter`: LM head, embeddings, dims not multiples of 16, end layers).
    ``fast_accum_bwd``: the input gradients' fp8 matmuls accumulate in the fast mode too; ``wgrad_fp8``: the weight
    gradients run in fp8 too."""
    from gptoughts.models.llama import Llama, TransformerBlock
    from gptoughts.perf.fp8 import fp8_module_filter

    if not isinstance(model, Llama) or not all(isinstance(b, TransformerBlock) for b in model.layers):
        raise UserError(
            f"perf.fp8_recipe = fused_rowwise supports the llama family's dense blocks, not "
            f"{type(model).__name__}; use perf.fp8_recipe = tensorwise or rowwise"
        )
    n_layers = len(model.layers)

    def keep(m: nn.Module, fqn: str) -> bool:
        return fp8_module_filter(m, fqn, n_layers, bf16_end_layers)

    return sum(
        swap_linears(block, lambda m, name, i=i: keep(m, f"layers.{i}.{name}"), fast_accum_bwd, wgrad_fp8)
        for i, block in enumerate(model.layers)
    )


def swap_linears(
    root: nn.Module,
    keep: Callable[[nn.Module, str], bool] | None = None,
    fast_accum_bwd: bool = False,
    wgrad_fp8: bool = False,
) -> int:
    """In ``root`` (a block, or a lone sub-block in bench/fp8_fused.py): each ``SwiGLU`` whose three linears
    ``keep`` accepts becomes a :class:`FusedFp8SwiGLU`, each other accepted ``nn.Linear`` a :class:`FusedFp8Linear`
    (``keep(module, name)``, names relative to ``root``; None: all). How many linears now run in fp8."""
    keep = keep or (lambda m, name: True)
    count = 0
    for name, ff in list(root.named_modules()):
        pre = f"{name}." if name else ""
        if type(ff) is SwiGLU and all(keep(lin, f"{pre}{n}") for n, lin in _mlp(ff)):
            ff.__class__ = FusedFp8SwiGLU  # a subclass: only forward changes
            ff.fast_accum_bwd, ff.wgrad_fp8 = fast_accum_bwd, wgrad_fp8
            for _, lin in _mlp(ff):  # counted with their SwiGLU (see FusedFp8SwiGLU)
                lin.__class__ = FusedFp8Linear
                lin.fast_accum_bwd, lin.wgrad_fp8 = fast_accum_bwd, wgrad_fp8
            count += 3
    for name, module in list(root.named_modules()):
        if type(module) is nn.Linear and keep(module, name):
            module.__class__ = FusedFp8Linear  # a subclass: parameters, hooks, state dict stay
            module.fast_accum_bwd, module.wgrad_fp8 = fast_accum_bwd, wgrad_fp8
            count += 1
    return count


def _mlp(ff: nn.Module) -> list[tuple[str, nn.Linear]]:
    return [("w1", ff.w1), ("w2", ff.w2), ("w3", ff.w3)]
