"""FP8 training through torchao's float8 linear layers (Hopper/Ada/Blackwell only).

The matmuls of the transformer blocks run in float8 with dynamic scaling (``tensorwise``: one scale per
tensor, fastest; ``rowwise``: one scale per row, more robust to outliers). Master weights, optimizer state,
norms and the residual stream stay as they were. Left in bf16: the LM head and embeddings (precision of the
output distribution), MoE routers (tiny, and their softmax decides routing), and any linear whose dims are
not multiples of 16 (the fp8 tensor-core kernels need them).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from gptoughts.errors import HardwareError, UserError

RECIPES = ("tensorwise", "rowwise")


def check_fp8_supported(device: torch.device, recommended: str | None = None) -> None:
    """Refuse ``--fp8`` where it cannot run, naming the precision to use instead: ``recommended``, the hardware
    profile's (what ``gptoughts env`` recommends: fp32 on a CPU, bf16 or fp16 on a GPU)."""
    if device.type != "cuda":
        use = recommended or "fp32"
        raise HardwareError(
            f"--fp8 needs an NVIDIA GPU with fp8 tensor cores (Ada, Hopper or newer); this run is on "
            f"{device.type}: drop --fp8 ({use} is the recommended precision here, as `gptoughts env` says)"
        )
    cc = torch.cuda.get_device_capability(device)
    if cc < (8, 9):
        name = torch.cuda.get_device_name(device)
        use = recommended or "bf16"
        raise HardwareError(
            f"--fp8 needs compute capability 8.9+ (Ada, Hopper); {name} is {cc[0]}.{cc[1]}: drop --fp8 "
            f"(--precision {use} is the recommended precision here, as `gptoughts env` says)"
        )


def fp8_module_filter(module: nn.Module, fqn: str, n_layers: int = 0, bf16_end_layers: int = 0) -> bool:
    """Whether the linear at ``fqn`` runs in fp8. With ``bf16_end_layers = k``, the first and the last ``k``
    blocks (``layers.{i}``, of ``n_layers``) stay bf16: the layers nearest the embeddings and the head are the
    most sensitive to fp8 rounding."""
    if not isinstance(module, nn.Linear):
        return False
    leaf = fqn.rsplit(".", 1)[-1]
    if leaf in ("output", "lm_head", "router", "gate") or "embed" in fqn:
        return False
    if bf16_end_layers:
        parts = fqn.split(".")
        if "layers" in parts and parts.index("layers") + 1 < len(parts):
            i = parts[parts.index("layers") + 1]
            if i.isdigit() and (int(i) < bf16_end_layers or int(i) >= n_layers - bf16_end_layers):
                return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def convert_to_fp8(
    model: nn.Module,
    recipe: str = "tensorwise",
    bf16_end_layers: int = 0,
    fsdp_all_gather: bool = False,
    fast_accum: bool = False,
) -> int:
    """Swap eligible ``nn.Linear`` modules for torchao ``Float8Linear``; returns how many were converted.
    ``fsdp_all_gather``: FSDP2 all-gathers their weights in fp8 (tensorwise only; call
    :func:`precompute_scales` after each optimizer step). ``fast_accum``: the two backward matmuls use the fast
    accumulation mode too (torchao uses it for the forward's only)."""
    if recipe not in RECIPES:
        raise UserError(f"unknown fp8 recipe {recipe!r}; use one of {', '.join(RECIPES)}")
    if fsdp_all_gather and recipe != "tensorwise":
        raise UserError(
            "perf.fp8_all_gather needs --fp8_recipe tensorwise (torchao gathers one scale per tensor)"
        )
    try:
        from torchao.float8 import Float8GemmConfig, Float8LinearConfig, convert_to_float8_training
    except ImportError:
        raise UserError("--fp8 needs torchao: pip install 'gptoughts[fp8]' (torchao >= 0.9)") from None
    n_layers = len(model.layers)

    def keep(m: nn.Module, fqn: str) -> bool:
        return fp8_module_filter(m, fqn, n_layers, bf16_end_layers)

    count = sum(1 for fqn, m in model.named_modules() if keep(m, fqn))
    config = Float8LinearConfig.from_recipe_name(recipe)
    if fsdp_all_gather:
        config = replace(config, enable_fsdp_float8_all_gather=True)
    if fast_accum:
        fast = Float8GemmConfig(use_fast_accum=True)
        config = replace(config, gemm_config_grad_input=fast, gemm_config_grad_weight=fast)
    convert_to_float8_training(model, config=config, module_filter_fn=keep)
    return count


def precompute_scales(model: nn.Module) -> None:
    """The fp8 scales of every FSDP-sharded Float8Linear weight in one all-reduce of their amaxes (instead of one
    per weight at its all-gather); after each optimizer step, when the weights have changed."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)
