"""fp8 with the casts fused into the producers (perf.fp8_recipe = fused_rowwise) against bf16 and torchao, on one GPU.

Part one, the linears of one Llama block at the 3b and 1b shapes (4 x 2048 rows): RMSNorm -> q/k/v -> o (o fed
with q, standing in for attention's output) + residual, then RMSNorm -> gate/up -> SwiGLU -> down + residual: all
of a block that fp8 changes, SDPA and RoPE left out. Forward + backward, torch.compile'd, CUDA-event timed (median
of ``--iters``) for bf16 (autocast, fp32 weights as in training), torchao tensorwise and rowwise, and fused_rowwise
(its weight gradients in bf16, and in fp8: ``perf.fp8_wgrad``),
with each variant's output error against bf16.

Part two (``--step "ARGS"``): whole training steps of ``gptoughts bench ARGS`` run in this process for bf16,
``--fp8 true`` (torchao tensorwise) and ``--fp8 true --perf.fp8_recipe fused_rowwise`` (``--perf.fp8_wgrad`` bf16 and fp8).

    python3 bench/fp8_fused.py --out r.jsonl --step "--size 3b --block_size 2048 --batch_size 4"
    python3 bench/fp8_fused.py --device cpu --dry      # tiny shapes, eager, no timing claims: a smoke test

Needs a CUDA GPU with fp8 tensor cores (Ada/Hopper+); torchao for its two variants (skipped without it).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from gptoughts.models.layers import RMSNorm, SwiGLU  # noqa: E402
from gptoughts.perf.fp8_fused import swap_linears  # noqa: E402
from gptoughts.tools.measure import median_ms  # noqa: E402

# d_model, SwiGLU hidden, heads, kv heads (head dim 128), rows = batch x tokens.
SHAPES = {
    "3b": dict(d=3072, ffn=8192, heads=24, kv=8, rows=4 * 2048),
    "1b": dict(d=2048, ffn=8192, heads=32, kv=8, rows=4 * 2048),
    "dry": dict(d=64, ffn=128, heads=4, kv=2, rows=32),
}
VARIANTS = ("bf16", "torchao_tensorwise", "torchao_rowwise", "fused_rowwise", "fused_rowwise_wgrad_fp8")


class BlockLinears(nn.Module):
    """The part of a Llama block that fp8 touches (module names as in ``TransformerBlock``)."""

    def __init__(self, d: int, ffn: int, heads: int, kv: int) -> None:
        super().__init__()
        hd = d // heads
        self.attention_norm, self.ffn_norm = RMSNorm(d), RMSNorm(d)
        self.wq, self.wo = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.wk, self.wv = nn.Linear(d, kv * hd, bias=False), nn.Linear(d, kv * hd, bias=False)
        self.feed_forward = SwiGLU(d, ffn)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = self.attention_norm(x)
        k, v = self.wk(h), self.wv(h)
        x = x + self.wo(self.wq(h))
        return x + self.feed_forward(self.ffn_norm(x)), k, v


def make(shape: dict, variant: str, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    m = BlockLinears(shape["d"], shape["ffn"], shape["heads"], shape["kv"]).to(device)
    for p in m.parameters():
        if p.dim() == 2:
            nn.init.normal_(p, std=0.02)
    if variant.startswith("fused_rowwise"):
        swap_linears(m, wgrad_fp8=variant.endswith("wgrad_fp8"))
    elif variant.startswith("torchao_"):
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig.from_recipe_name(variant.removeprefix("torchao_"))
        convert_to_float8_training(
            m, config=config, module_filter_fn=lambda mod, fqn: isinstance(mod, nn.Linear)
        )
    return m


def step_fn(model: nn.Module, x: torch.Tensor, grads: list[torch.Tensor]) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        x.grad = None
        for p in model.parameters():
            p.grad = None
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            outs = model(x)
        torch.autograd.backward(outs, grads)
        return (outs[0] - x).detach()  # the block's own contribution: the residual would hide its error

    return run


def sub_rows(shape_name: str, device: torch.device, iters: int, compile_: bool) -> list[dict]:
    shape = SHAPES[shape_name]
    cuda = device.type == "cuda"
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(shape["rows"], shape["d"], device=device, dtype=torch.bfloat16, generator=gen)
    x.requires_grad_()
    rows, ref = [], None
    for variant in VARIANTS:
        try:
            model = make(shape, variant, device)
        except ImportError:
            print(f"{shape_name} {variant:20s} skipped: torchao is not installed", flush=True)
            rows.append(
                {"part": "block_linears", "shape": shape_name, "variant": variant, "skipped": "no torchao"}
            )
            continue
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
            grads = [torch.randn_like(o, generator=gen) for o in model(x)]
        fn = step_fn(torch.compile(model) if compile_ else model, x, grads)
        out = fn()
        ref = out if variant == "bf16" else ref
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        ms = median_ms(fn, iters, cuda=cuda)
        rows.append({"part": "block_linears", "shape": shape_name, "variant": variant, "ms": round(ms, 3),
                     "rel_err_vs_bf16": round(err, 4), "device": _device_name(device)})  # fmt: skip
        print(f"{shape_name} {variant:20s} {ms:8.3f} ms  err vs bf16 {err:.4f}", flush=True)
        torch._dynamo.reset()
    base = rows[0]["ms"]
    for r in rows:
        if "ms" in r:
            r["speedup_vs_bf16"] = round(base / r["ms"], 3)
    return rows


def step_rows(step_args: str, steps: int) -> list[dict]:
    from gptoughts.cli.options import parse_overrides
    from gptoughts.config import load_config
    from gptoughts.tools.bench import run_bench

    preset, overrides, _ = parse_overrides(shlex.split(step_args))
    variants = {"bf16": {"perf.fp8": "false"}, "fp8_tensorwise": {"perf.fp8": "true"},
                "fp8_fused_rowwise": {"perf.fp8": "true", "perf.fp8_recipe": "fused_rowwise"},
                "fp8_fused_rowwise_wgrad_fp8": {"perf.fp8": "true", "perf.fp8_recipe": "fused_rowwise",
                                                "perf.fp8_wgrad": "fp8"}}  # fmt: skip
    out = []
    for name, extra in variants.items():
        torch._dynamo.reset()
        try:
            r = run_bench(load_config(preset or "default", {**overrides, **extra}), steps=steps, warmup=5)
        except Exception as e:  # noqa: BLE001 (one variant's failure, e.g. no torchao, must not hide the others)
            print(f"step {name:18s} failed: {type(e).__name__}: {e}", flush=True)
            out.append(
                {"part": "step", "variant": name, "args": step_args, "error": f"{type(e).__name__}: {e}"}
            )
            continue
        out.append({"part": "step", "variant": name, "args": step_args, "tokens_per_s": r["tokens_per_s"],
                    "step_ms": r["step_ms"], "mfu": r.get("mfu"), "peak_memory_gib": r.get("peak_memory_gib")})  # fmt: skip
        print(f"step {name:18s} {r['tokens_per_s']:>10,.0f} tok/s  {r['step_ms']:7.1f} ms", flush=True)
    base = out[0].get("tokens_per_s")
    for r in out:
        if base and r.get("tokens_per_s"):
            r["speedup_vs_bf16"] = round(r["tokens_per_s"] / base, 3)
    return out


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="3b,1b", help="comma-separated: 3b, 1b")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--step", default=None, help="gptoughts bench arguments of the whole-step comparison")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--device", default="cuda")
    p.add_argument(
        "--dry", action="store_true", help="tiny shapes, eager, 1 timed call: checks the code runs"
    )
    p.add_argument("--out", default=None, help="a .jsonl file to append the rows to")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            "bench/fp8_fused.py needs a CUDA GPU with fp8 (Ada/Hopper+); --device cpu --dry checks it"
        )
    if not a.dry and device.type != "cuda":
        raise SystemExit(
            "bench/fp8_fused.py times fp8 on a CUDA GPU only; on a CPU pass --dry (a smoke test)"
        )
    shapes = ["dry"] if a.dry else a.shapes.split(",")
    rows = [r for s in shapes for r in sub_rows(s, device, 1 if a.dry else a.iters, compile_=not a.dry)]
    if a.step and not a.dry:
        rows += step_rows(a.step, a.steps)
    if a.out:
        with open(a.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
