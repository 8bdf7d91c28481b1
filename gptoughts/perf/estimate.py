"""``gptoughts estimate``: memory, time and cost of a run before it starts.

Memory at the peak of a training step (fp32 master weights, mixed precision):

* weights: 4 bytes/param (fp32 master copy)
* gradients: 4 bytes/param
* optimizer: 8 bytes/param (AdamW's two moments)
* autocast weight copies: 2 bytes per matmul param (the bf16 casts autocast keeps for backward)
* activations: per token and layer, the tensors autograd saves for backward, counted from the block's ops
  (see ``_layer_activation_bytes``) per activation-checkpointing mode; the peak holds either the activations
  (with the bf16 weight copies and logits) early in backward, or all gradients at the optimizer step
* logits: the LM-head working set (one chunk with the chunked loss, the whole batch with the plain loss)

Under FSDP (``strategy = "fsdp"``) weights, gradients and optimizer state are divided by the GPU count; the
"autocast copies" line becomes what FSDP holds gathered at a time: the bf16 parameters of two blocks (the one
running and the one prefetched) and of the root (embeddings, head), plus one block's unsharded gradient (bf16 and
its fp32 reduce copy).

Time: tokens × FLOPs/token / (peak FLOP/s × MFU). The default MFU is what ``bench`` measured for the size class
on Hopper (bench/BENCHMARKS.md); pass ``--mfu`` to use your own.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from gptoughts import models
from gptoughts.errors import ConfigError
from gptoughts.perf.hardware import _PEAK_BF16, peak_flops

GIB = 2**30

# $/hour, on-demand list prices seen at common GPU clouds (the INL guide's table, updated); override with --price.
DEFAULT_PRICE = {"H200": 3.5, "H100": 2.5, "A100": 1.5, "L40S": 1.0, "RTX 4090": 0.4, "RTX 3090": 0.3, "A10G": 1.0,
                 "L4": 0.7, "T4": 0.35, "V100": 0.8, "B200": 5.0}
GPU_MEMORY_GIB = {"H200": 141, "H100": 80, "A100": 80, "L40S": 48, "RTX 4090": 24, "RTX 3090": 24, "A10G": 24,
                  "L4": 24, "T4": 16, "V100": 32, "B200": 180}


@dataclass
class Estimate:
    params: int
    params_non_embedding: int
    weights_gib: float
    gradients_gib: float
    optimizer_gib: float
    autocast_copies_gib: float
    activations_gib: float
    logits_gib: float
    total_gib: float
    gpu: str
    gpu_memory_gib: float | None
    fits: bool | None
    flops_per_token: float
    mfu: float
    tokens_per_s: float | None
    tokens: int | None
    hours: float | None
    price_per_hour: float | None
    cost: float | None
    strategy: str = "ddp"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _layer_activation_bytes(args: Any, mode: str, residual_bytes: int = 4) -> float:
    """Bytes saved for backward per token per block (bf16 activations; the residual stream in fp32, r = 4
    bytes, or bf16, r = 2: ``perf.residual_dtype``).

    none: attention-norm input (r d) and output (2d), q/k/v after RoPE (2(d + 2 d_kv)), attention output and
    softmax stats (2d), FFN-norm input and output (r d + 2d), w1 and w3 outputs and their product (3 × 2f):
    (8 + 2r) d + 4 d_kv + 6f. Measured on an H200 with per-block compile (bench/BENCHMARKS.md): fp32 residual,
    26.9 KB per token and layer at 125m (formula 27.6 KB) and 81.5 KB at 1b (formula 84.0 KB); bf16 residual,
    77.4 KB at 1b (formula 75.8 KB). selective keeps matmul outputs and recomputes norms and activations; full
    keeps only the block input (r d).
    """
    r = residual_bytes
    d = args.d_model
    head_dim = getattr(args, "head_dim", None) or d // args.n_heads
    d_kv = getattr(args, "n_kv_heads", args.n_heads) * head_dim
    f = getattr(args, "ffn_dim", 4 * d)
    if mode == "none":
        return (8 + 2 * r) * d + 4 * d_kv + 6 * f
    if mode == "selective":  # measured 45.4 KB/token/layer at 3b (d 3072, ffn 8192, fp32 residual), per-block compile
        return r * d + 4 * f
    if mode == "full":
        return r * d
    raise ConfigError(f"activation checkpointing must be none, selective or full; got {mode!r}")


def estimate(family: str, size: str, overrides: dict | None = None, *, batch_size: int = 8, block_size: int = 2048,
             activation_checkpointing: str = "none", loss: str = "chunked", loss_chunk: int = 4096,
             gpu: str = "H100", tokens: int | None = None, mfu: float | None = None, price: float | None = None,
             num_gpus: int = 1, residual_dtype: str = "bf16", strategy: str = "ddp") -> Estimate:
    args = models.model_args(family, size, dict(overrides or {}))
    import torch

    with torch.device("meta"):
        model = models.build_model(family, args)
    n = model.num_params()
    n_ne = model.num_params(non_embedding=True)
    matmul_params = sum(p.numel() for name, p in model.named_parameters() if p.ndim == 2 and "embed" not in name)
    flops_tok = model.flops_per_token(block_size)
    tokens_step = batch_size * block_size
    L = args.n_layers
    if residual_dtype not in ("fp32", "bf16"):
        raise ConfigError(f"residual dtype must be fp32 or bf16; got {residual_dtype!r}")
    r = 4 if residual_dtype == "fp32" else 2
    act = _layer_activation_bytes(args, activation_checkpointing, r) * tokens_step * L
    if activation_checkpointing == "full":  # one block's activations are rebuilt during its backward
        act += _layer_activation_bytes(args, "none", r) * tokens_step
    vocab = args.vocab_size
    rows = min(loss_chunk, tokens_step) if loss == "chunked" else tokens_step
    # chunked: fp32 logits + their gradient for one chunk, plus the fp32 head-weight gradient accumulator;
    # plain: bf16 logits, their fp32 upcast and its gradient, for the whole batch.
    logits = rows * vocab * 8 + vocab * args.d_model * 4 if loss == "chunked" else rows * vocab * (2 + 4 + 4)
    if strategy not in ("ddp", "fsdp"):
        raise ConfigError(f"strategy must be ddp or fsdp; got {strategy!r}")
    weights, grads, optim = 4 * n, 4 * n, 8 * n
    copies = 2 * matmul_params
    if strategy == "fsdp" and num_gpus > 1:
        block = sum(p.numel() for p in model.layers[0].parameters())
        root = n - sum(p.numel() for p in model.layers.parameters())
        weights, grads, optim = weights / num_gpus, grads / num_gpus, optim / num_gpus
        copies = 2 * (2 * block + root) + 6 * block
        # Sharded gradients are small and fill up while activations are freed: counted in full (conservative).
        total = weights + optim + grads + copies + logits + act
    else:
        # Two candidate peaks on top of weights and optimizer state: early in backward (all activations, the
        # bf16 weight copies autocast saved, the logits working set) or at the optimizer step (all fp32
        # gradients, the rest freed). Measured on an H200 (bench/BENCHMARKS.md): 1b 35.6 GiB (this formula
        # 36.1), 3b 61.7 (62.4), 3b selective 50.3 (51.1), 3b full 45.7 (45.0).
        total = weights + optim + max(grads, copies + logits + act)
    peak = peak_flops(gpu)
    if peak is None:
        raise ConfigError(f"unknown GPU {gpu!r}; known: {', '.join(sorted(_PEAK_BF16))}")
    if mfu is None:
        mfu = 0.55 if args.d_model >= 2048 else 0.45
    tps = peak * mfu / flops_tok * num_gpus
    hours = tokens / tps / 3600 if tokens else None
    key = next((k for k in sorted(GPU_MEMORY_GIB, key=len, reverse=True) if k.lower() in gpu.lower()), None)
    mem = GPU_MEMORY_GIB.get(key) if key else None
    pph = price if price is not None else DEFAULT_PRICE.get(key) if key else None
    return Estimate(
        params=n, params_non_embedding=n_ne, weights_gib=weights / GIB, gradients_gib=grads / GIB,
        optimizer_gib=optim / GIB, autocast_copies_gib=copies / GIB, activations_gib=act / GIB,
        logits_gib=logits / GIB, total_gib=total / GIB, gpu=gpu, gpu_memory_gib=mem,
        fits=(total / GIB <= mem * 0.95) if mem else None, flops_per_token=flops_tok, mfu=mfu, tokens_per_s=tps,
        tokens=tokens, hours=hours, price_per_hour=pph,
        cost=(hours * pph * num_gpus) if (hours is not None and pph is not None) else None,
        strategy=strategy if num_gpus > 1 else "ddp",
    )


def format_estimate(e: Estimate) -> str:
    lines = [f"{e.params / 1e6:,.1f}M params ({e.params_non_embedding / 1e6:,.1f}M non-embedding), "
             f"{e.flops_per_token / 1e9:.2f} GFLOP/token",
             "memory at peak (GiB):"]
    for k in ("weights", "gradients", "optimizer", "autocast_copies", "activations", "logits"):
        label = "fsdp_gathered" if k == "autocast_copies" and e.strategy == "fsdp" else k
        lines.append(f"  {label:<16} {getattr(e, k + '_gib'):8.2f}")
    fit = "" if e.fits is None else ("  fits" if e.fits else "  DOES NOT FIT")
    mem = f" of {e.gpu_memory_gib} on {e.gpu}" if e.gpu_memory_gib else ""
    lines.append(f"  {'total':<16} {e.total_gib:8.2f}{mem}{fit}")
    lines.append(f"speed: {e.tokens_per_s:,.0f} tokens/s at MFU {e.mfu:.2f} on {e.gpu}")
    if e.hours is not None:
        cost = f", ${e.cost:,.0f} at ${e.price_per_hour}/h per GPU" if e.cost is not None else ""
        days = f" ({e.hours / 24:.1f} days)" if e.hours > 48 else ""
        lines.append(f"time for {e.tokens:,} tokens: {e.hours:,.1f} h{days}{cost}")
    return "\n".join(lines)
