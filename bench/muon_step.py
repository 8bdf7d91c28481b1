"""The optimizer step alone, AdamW against Muon's variants, on random gradients (no forward or backward): Llama
shapes 47M (d 512, 12 layers, ffn 1408), 125m and 1b, fp32 master weights on one GPU. Each step is taken as the
trainer takes it (grad_scale and found_inf set on the device, fused AdamW). One JSON line per shape and variant:
milliseconds per step (median of ``--reps`` timed with CUDA events after warm-up), the first step's seconds
(compilation), Newton-Schulz TFLOP per step and the TFLOP/s it reached.

Variants: adamw; muon (eager buckets: today's default); muon_compile (perf.muon_compile); muon_graph
(perf.muon_compile with the whole step recorded as one CUDA graph: perf.muon_graph).

Usage (GPU machine, repo root):  python3 bench/muon_step.py [--shapes 47m,125m,1b] [--out muon_step.jsonl]
On a CPU (smoke test):           python3 bench/muon_step.py --shapes debug --device cpu --reps 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from gptoughts.models import build_model, model_args
from gptoughts.perf.estimate import newton_schulz_flops
from gptoughts.tools.measure import call_ms
from gptoughts.training.optim import build_adamw, build_muon

SHAPES = {
    "debug": ("debug", {}),
    "47m": ("125m", dict(d_model=512, n_layers=12, n_heads=8, n_kv_heads=8, ffn_dim=1408, vocab_size=8192)),
    "125m": ("125m", {}),
    "1b": ("1b", {}),
}
VARIANTS = ("adamw", "muon", "muon_compile", "muon_graph")
HYPER = dict(lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, fused=True)


def make(variant: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if variant == "adamw":
        return build_adamw(model, **HYPER)
    return build_muon(model, compile=variant != "muon", graph=variant == "muon_graph", **HYPER)


def time_steps(opt: torch.optim.Optimizer, dev: torch.device, reps: int) -> tuple[float, list[float]]:
    def step() -> None:
        opt.grad_scale = torch.ones((), device=dev)
        opt.found_inf = torch.zeros((), device=dev)
        opt.step()

    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    step()
    sync()
    first = time.perf_counter() - t0
    for _ in range(3):
        step()
    sync()
    times = call_ms(step, reps, cuda=dev.type == "cuda")
    return first, times


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="47m,125m,1b")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=None, help="also append the JSON lines to this file")
    a = p.parse_args()
    dev = torch.device(a.device)
    for shape in a.shapes.split(","):
        size, overrides = SHAPES[shape]
        torch.manual_seed(0)
        model = build_model("llama", model_args("llama", size, overrides), device=dev)
        for p_ in model.parameters():
            p_.grad = torch.randn_like(p_)
        flop = newton_schulz_flops(model)
        for variant in a.variants.split(","):
            opt = make(variant, model)
            first, times = time_steps(opt, dev, a.reps)
            ms = statistics.median(times)
            row = {
                "shape": shape, "variant": variant, "step_ms": round(ms, 3), "min_ms": round(min(times), 3),
                "first_step_s": round(first, 2), "params_m": round(sum(q.numel() for q in model.parameters()) / 1e6, 1),
                "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            }  # fmt: skip
            if variant != "adamw":
                row["ns_tflop"] = round(flop / 1e12, 3)
                row["ns_tflops_reached"] = round(flop / 1e12 / (ms / 1e3), 1)
            line = json.dumps(row)
            print(line, flush=True)
            if a.out:
                with open(a.out, "a") as f:
                    f.write(line + "\n")
            del opt
            if dev.type == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
