"""How fast can AdamW step a model's fp32 parameters? The fused multi-tensor kernel we use against torch.compile's
foreach step and against one flat tensor (the bound a contiguous layout would reach), on the parameter shapes of real
models (built on the meta device). Prints, per model and form, the median ms of a step and the bytes it moves per
second (28 bytes per parameter: the parameter read and written, the gradient read, two moments read and written).

Usage (GPU machine):  python3 bench/adamw_step.py [--models llama:3b,deepseek:small,llama:1b] [--iters 20] [--out F]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without an install
from gptoughts.perf.estimate import _meta_model  # noqa: E402
from gptoughts.tools.measure import median_ms  # noqa: E402


def forms(shapes: list[torch.Size], dev: torch.device):
    """(name, make) pairs; make() returns a step function over fresh parameters with gradients."""

    def params(flat: bool) -> list[torch.Tensor]:
        if flat:
            n = sum(s.numel() for s in shapes)
            ps = [torch.zeros(n, device=dev, requires_grad=True)]
        else:
            ps = [torch.zeros(s, device=dev, requires_grad=True) for s in shapes]
        for p in ps:
            p.grad = torch.randn_like(p) * 1e-3
        return ps

    def fused(flat: bool):
        opt = torch.optim.AdamW(params(flat), lr=1e-4, fused=True)
        return opt.step

    def compiled():
        lr = torch.tensor(1e-4, device=dev)
        opt = torch.optim.AdamW(params(False), lr=lr, foreach=True, capturable=True)
        return torch.compile(opt.step)

    def foreach():
        return torch.optim.AdamW(params(False), lr=1e-4, foreach=True).step

    return [
        ("fused (ours)", lambda: fused(False)),
        ("fused, one flat tensor", lambda: fused(True)),
        ("foreach, eager", foreach),
        ("foreach, compiled", compiled),
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="llama:3b,deepseek:small,llama:1b")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for spec in a.models.split(","):
        family, size = spec.split(":")
        shapes = [p.shape for p in _meta_model(family, size, None)[1].parameters()]
        n = sum(s.numel() for s in shapes)
        for name, make in forms(shapes, dev):
            try:
                ms = median_ms(make(), a.iters)
                row = {"model": spec, "form": name, "params": n, "tensors": len(shapes), "ms": round(ms, 3),
                       "tb_per_s": round(28 * n / ms / 1e9, 2)}  # fmt: skip
            except Exception as e:  # noqa: BLE001 - a form that fails is a row
                row = {"model": spec, "form": name, "error": f"{type(e).__name__}: {str(e)[:200]}"}
            rows.append(row)
            print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()
    if a.out:
        Path(a.out).write_text("\n".join(json.dumps(r) for r in rows) + "\n")


if __name__ == "__main__":
    main()
