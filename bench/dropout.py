"""Dropout kernels (issue 13, LoRA with adapter dropout): torch.compile's dropout, eager PyTorch's, and our seeded
dropout (gptoughts/perf/dropout.py: a mask of bits drawn at eight elements per Philox call, applied by compiled
element-wise code), forward on LoRA-1b input shapes, bf16.

Each row: CUDA-event median of ``--iters`` calls, effective bandwidth (2 bytes read + 2 written per element / time),
and the measured drop rate. ``compiled`` rows are ``torch.compile`` of the op on its own; in a training step inductor
fuses the element-wise part into the neighbouring norm, so they are the cost of the draws and one pass over memory.
``bits only`` is our mask kernel alone (n/8 bytes written).

    python3 bench/dropout.py --out r.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from gptoughts.perf.dropout import dropout_bits, new_seed, seeded_dropout  # noqa: E402
from gptoughts.tools.measure import median_ms  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="8192x2048,8192x8192", help="rows x columns, comma-separated")
    ap.add_argument("--p", type=float, default=0.05)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default=None, help="a .jsonl file to append the rows to")
    args = ap.parse_args(argv)
    p = args.p
    compiled = torch.compile(lambda t: F.dropout(t, p, training=True))
    ours = torch.compile(lambda t, s: seeded_dropout(t, s, p))
    rows = []
    for shape in args.shapes.split(","):
        m, n = (int(v) for v in shape.split("x"))
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        seed = new_seed(x.device)
        variants = {
            "eager F.dropout": lambda x=x: F.dropout(x, p, training=True),
            "compiled F.dropout": lambda x=x: compiled(x),
            "compiled seeded (ours)": lambda x=x, seed=seed: ours(x, seed),
            "bits only (ours)": lambda x=x, seed=seed: dropout_bits(seed, x.numel(), p),
        }
        for name, fn in variants.items():
            ms = median_ms(fn, args.iters, warmup=5)
            out = fn()
            rate = None if out.dtype == torch.uint8 else round((out == 0).float().mean().item(), 5)
            row = {
                "shape": shape,
                "variant": name,
                "ms": round(ms, 4),
                "GB/s": round(4 * x.numel() / ms / 1e6, 1),
                "drop_rate": rate,
                "p": p,
                "device": torch.cuda.get_device_name(),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
