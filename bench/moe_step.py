"""Forward + backward time of one DeepSeek MoE layer (router, routed and shared experts) per speed switch.

Usage, on the GPU machine:

    python bench/moe_step.py --out $OUT/moe_step.jsonl            # deepseek-small shape, compiled layer
    python bench/moe_step.py --eager --only reference shared-stream  # the side stream works in eager only
    python bench/moe_step.py --device cpu --size debug --batch 2 --seq 64 --eager --iters 2   # smoke test

Shape: ``--size`` (small: d 1024, 64 experts of 320, top-6, 2 shared) with ``--batch`` x ``--seq`` (8 x 2048) tokens in bf16
autocast, fp32 weights (as training holds them), the layer compiled as a block is (``torch.compile`` of the
module) unless ``--eager``. Variants: the reference (``bmm``, ``index_put``, ``mask``, ``after``) and one row per
switch (``--only`` picks some), plus ``all`` (every switch that pays in theory) and a group-limited pair
(``groups-*``: 8 groups, 4 kept, as DeepSeek-V3 routes) for ``moe_router``. Each row: median ms of ``--iters``
timed forward+backward steps after ``--warmup`` (CUDA events), peak memory, the largest difference of the
output and of the input's gradient from the reference row of the same routing, and the config overrides
(``model.*``) that select the variant in a training run. A variant that fails is a row with its one-line reason.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without an install
from gptoughts.models.deepseek import DEEPSEEK_SIZES, DeepSeekArgs, MoE

ALL = dict(moe_combine="hidden", moe_permute="gather", moe_shared="before")
GROUPS = dict(n_expert_groups=8, n_limited_groups=4)
VARIANTS: dict[str, dict[str, Any]] = {
    "reference": {},
    "combine-sum": dict(moe_combine="sum"),
    "combine-hidden": dict(moe_combine="hidden"),
    "permute-gather-sum": dict(moe_combine="sum", moe_permute="gather"),
    "permute-gather-hidden": dict(moe_combine="hidden", moe_permute="gather"),
    "shared-before": dict(moe_shared="before"),
    "shared-stream": dict(moe_shared="stream"),
    "all": ALL,
    "default": dict(moe_combine="hidden", moe_permute="gather"),
    "default-w13": dict(moe_combine="hidden", moe_permute="gather", moe_w13="fused"),
    "groups-reference": GROUPS,
    "groups-router-gather": dict(GROUPS, moe_router="gather"),
    "groups-all": dict(GROUPS, moe_router="gather", **ALL),
}


def _one_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0][:300] if msg else ''}"


def _layer(size: str, switches: dict[str, Any], device: torch.device) -> tuple[MoE, dict[str, Any]]:
    torch.manual_seed(0)
    shape = dict(DEEPSEEK_SIZES[size])
    if "n_expert_groups" in switches and shape["n_routed_experts"] < 16:  # debug: 8 experts, 2 groups
        switches = dict(switches, n_expert_groups=2, n_limited_groups=1)
    layer = MoE(DeepSeekArgs(**{**shape, **switches})).to(device)
    layer.reset_parameters(0.02, 0.005)
    with torch.no_grad():
        layer.expert_bias.copy_(
            torch.randn(layer.n_experts, generator=torch.Generator().manual_seed(1)) * 0.01
        )
    return layer.train(), switches


def _timed(step: Any, device: torch.device) -> float:
    """Milliseconds of one ``step()``: CUDA events on a GPU, the wall clock elsewhere (a smoke test)."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        step()
        return (time.perf_counter() - t0) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def run_variant(args: argparse.Namespace, name: str, x: torch.Tensor, grad: torch.Tensor) -> dict[str, Any]:
    layer, switches = _layer(args.size, VARIANTS[name], x.device)
    mode = "max-autotune-no-cudagraphs" if args.max_autotune else None
    fn = layer if args.eager else torch.compile(layer, mode=mode)
    xi = x.detach().requires_grad_()

    def step() -> torch.Tensor:
        xi.grad = None
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            out = fn(xi)[0]
        out.backward(grad)
        return out

    for _ in range(args.warmup):
        step()
    layer.zero_grad(set_to_none=True)
    cuda = x.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = [_timed(step, x.device) for _ in range(args.iters)]
    out = step()
    return {
        "variant": name,
        "overrides": {f"model.{k}": v for k, v in switches.items()},
        "ms": round(statistics.median(times), 3),
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
        "_out": out.detach().float(),
        "_gx": xi.grad.detach().float(),
    }


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="small", choices=sorted(DEEPSEEK_SIZES))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (a smoke test)")
    p.add_argument("--eager", action="store_true", help="do not compile the layer")
    p.add_argument(
        "--max-autotune", action="store_true", help="compile with Triton GEMM templates tried (max-autotune)"
    )
    p.add_argument("--only", nargs="*", choices=list(VARIANTS), default=list(VARIANTS))
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", type=Path, default=None, help="append the JSON lines to this file")
    args = p.parse_args()
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    shape = (args.batch, args.seq, DEEPSEEK_SIZES[args.size]["d_model"])
    # The residual stream is bf16 on GPUs (perf.residual_dtype auto).
    x = torch.randn(shape, generator=gen).to(device, torch.bfloat16)
    grad = torch.randn(shape, generator=gen).to(device, torch.bfloat16)
    refs: dict[bool, dict[str, torch.Tensor]] = {}
    for name in args.only:
        try:
            row = run_variant(args, name, x, grad)
            ref = refs.setdefault(name.startswith("groups"), {"out": row["_out"], "gx": row["_gx"]})
            row["max_diff_out"] = float((row.pop("_out") - ref["out"]).abs().max())
            row["max_diff_grad_x"] = float((row.pop("_gx") - ref["gx"]).abs().max())
        except Exception as e:  # one row per failure, never a crash of the whole table
            row = {"variant": name, "error": _one_line(e)}
        row.update(
            size=args.size,
            batch=args.batch,
            seq=args.seq,
            compiled=not args.eager,
            max_autotune=args.max_autotune,
            device=_device_name(device),
        )
        line = json.dumps(row)
        print(line, flush=True)
        if args.out is not None:
            with args.out.open("a") as f:
                f.write(line + "\n")
        torch._dynamo.reset()


if __name__ == "__main__":
    main()
