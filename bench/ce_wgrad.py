"""The chunked loss's LM-head weight gradient, accumulated by the matmul into its fp32 buffer (the default on CUDA,
``perf.ce.accumulate_weight_grad``) against the earlier two passes (a bf16 product per chunk, cast to fp32 and
added), side by side in one process: ``gptoughts bench`` rows alternating the two, at 125m (b128, seq 1024) and
1b (b8, seq 2048), the first round with a kernel table.

Usage (GPU machine, repo root):  python3 bench/ce_wgrad.py --out results.jsonl
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from gptoughts.config import load_config
from gptoughts.perf import ce
from gptoughts.tools.bench import run_bench

SHAPES = [("125m", 1024, 128), ("1b", 2048, 8)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    in_gemm = ce.wgrad_in_gemm
    for size, block, batch in SHAPES:
        for rnd in range(a.rounds):
            for variant in ("in_gemm", "two_pass"):
                ce.wgrad_in_gemm = in_gemm if variant == "in_gemm" else (lambda grad_w, h: False)
                overrides = {
                    "model.size": size, "train.block_size": block, "train.batch_size": batch,
                    "perf.precision": "bf16", "perf.compile": True, "run.progress": False,
                    "perf.compile_mode": "blocks",
                }  # fmt: skip
                t0 = time.time()
                r = run_bench(
                    load_config("default", overrides), steps=10, warmup=4, kernel_steps=2 if rnd == 0 else 0
                )
                r.update(variant=variant, round=rnd, wall_s=time.time() - t0)
                k = r.get("kernels") or {}
                adds = sum(
                    x["ms_per_step"]
                    for x in k.get("top_kernels", [])
                    if "CUDAFunctor_add<float>" in x["name"]
                )
                extra = (
                    f"  fp32 add kernels {adds:.2f} ms/step, elementwise "
                    f"{k['categories']['elementwise']['ms_per_step']:.1f} ms"
                    if k
                    else ""
                )
                print(
                    f"{size} b{batch} {variant:9s} round {rnd}: {r['tokens_per_s']:,.0f} tok/s  {r['step_ms']:.1f} ms  "
                    f"MFU {r['mfu']:.3f}  peak {r['peak_memory_gib']:.2f} GiB{extra}",
                    flush=True,
                )
                with open(a.out, "a") as f:
                    f.write(json.dumps(r, default=str) + "\n")
                torch.cuda.empty_cache()
    ce.wgrad_in_gemm = in_gemm


if __name__ == "__main__":
    main()
