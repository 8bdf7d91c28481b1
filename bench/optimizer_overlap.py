"""Can a memory-bound AdamW pass on a side stream overlap compute-bound matmuls? (issue 13 item 4: the idea of
stepping the optimizer beside the next forward or the backward.) Twelve 1b-shaped MLP matmuls (16384 x 2048 x 5632,
bf16) and one fused AdamW over 60M fp32 parameters (about one 1b block), each alone, one after the other, and on
two streams; prints the share of the AdamW time the matmuls hide.

Usage (GPU machine):  python3 bench/optimizer_overlap.py
"""

from __future__ import annotations

import json
from collections.abc import Callable

import torch


def main() -> None:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    x = torch.randn(16384, 2048, device=dev, dtype=torch.bfloat16)
    w = torch.randn(5632, 2048, device=dev, dtype=torch.bfloat16)
    n = 60_000_000
    ps = [torch.randn(n // 6, device=dev) for _ in range(6)]
    gs = [torch.randn_like(p) for p in ps]
    ms = [torch.zeros_like(p) for p in ps]
    vs = [torch.zeros_like(p) for p in ps]
    steps = [torch.zeros((), device=dev) for _ in ps]
    side = torch.cuda.Stream()

    def gemms(k: int = 12) -> None:
        for _ in range(k):
            x @ w.t()

    def adam() -> None:
        torch._fused_adamw_(
            ps, gs, ms, vs, [], steps, lr=1e-4, beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8,
            amsgrad=False, maximize=False,
        )  # fmt: skip

    def sequential() -> None:
        gemms()
        adam()

    def two_streams(first: int) -> None:
        side.wait_stream(torch.cuda.current_stream())
        gemms(first)
        with torch.cuda.stream(side):
            adam()
        gemms(12 - first)
        torch.cuda.current_stream().wait_stream(side)

    def timed(fn: Callable[[], None], reps: int = 20) -> float:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        out = []
        for _ in range(reps):
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            out.append(a.elapsed_time(b))
        return sorted(out)[len(out) // 2]

    r = {
        "gemms_ms": timed(gemms),
        "adamw_ms": timed(adam),
        "sequential_ms": timed(sequential),
        "side_stream_ms": timed(lambda: two_streams(0)),
        "side_stream_after_first_gemm_ms": timed(lambda: two_streams(1)),
    }
    r["hidden_fraction_of_adamw"] = (r["sequential_ms"] - r["side_stream_ms"]) / r["adamw_ms"]
    r["hidden_fraction_after_first"] = (r["sequential_ms"] - r["side_stream_after_first_gemm_ms"]) / r[
        "adamw_ms"
    ]
    print(json.dumps(r))


if __name__ == "__main__":
    main()
