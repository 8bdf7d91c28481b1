"""Fused element-wise kernels (issue 13 item 3): Liger's Triton kernels against what torch.compile makes of our own
ops, forward + backward, on one GPU.

Part one, op by op at the 1b shape (8 x 2048 rows of d_model 2048, SwiGLU hidden 5632, bf16 activations, fp32
norm weights as in training): RMSNorm, residual add + RMSNorm, and SwiGLU's silu(a) * b, each as ``torch.compile``
of our layers' code (what per-block compile generates, in isolation) and as Liger's autograd function; CUDA-event
timing, median of ``--iters`` after warm-up, and the largest difference of outputs and gradients.

Part two (``--step``), the whole training step: ``gptoughts bench`` of the same shape run in this process with our
layers as they are, then with RMSNorm, the block's second residual add + RMSNorm and SwiGLU's activation replaced by
Liger's functions (a patch of the classes in this process only), per-block compile on in both.

    python3 bench/fused_ops.py --out r.jsonl [--step "--size 1b --block_size 2048 --batch_size 8"]

Needs a CUDA GPU and liger-kernel (``pip install liger-kernel``; carried as a wheel to the GPU machines).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from gptoughts.tools.measure import median_ms  # noqa: E402


def fwd_bwd(op, inputs: list[torch.Tensor], grads: list[torch.Tensor]):
    """A closure running ``op(*inputs)`` and its backward with fixed output gradients; returns outputs and
    input gradients of the last call."""

    def run():
        for t in inputs:
            t.grad = None
        outs = op(*inputs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        torch.autograd.backward(outs, grads[: len(outs)])
        return outs, [t.grad for t in inputs]

    return run


def max_diff(x: list[torch.Tensor], y: list[torch.Tensor]) -> float:
    return max(float((a.float() - b.float()).abs().max()) for a, b in zip(x, y) if a is not None)


def ops_table(rows: int, d: int, hidden: int, iters: int) -> list[dict]:
    from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    dev, bf = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)

    def leaf(*shape, dtype=bf):
        return torch.randn(*shape, device=dev, dtype=dtype, generator=g).requires_grad_()

    eps = 1e-5
    x, r = leaf(rows, d), leaf(rows, d)
    w = (1 + 0.1 * torch.randn(d, device=dev, generator=g)).requires_grad_()
    a, b = leaf(rows, hidden), leaf(rows, hidden)
    gy = [torch.randn(rows, d, device=dev, dtype=bf, generator=g) for _ in range(2)]
    gh = [torch.randn(rows, hidden, device=dev, dtype=bf, generator=g)]

    def ours_norm(x, w):
        return F.rms_norm(x, (d,), w, eps)

    def ours_add_norm(x, r, w):
        h = x + r
        return F.rms_norm(h, (d,), w, eps).to(bf), h

    def ours_swiglu(a, b):
        return F.silu(a) * b

    cases = [
        (
            "rmsnorm",
            ours_norm,
            lambda x, w: LigerRMSNormFunction.apply(x, w, eps, 0.0, "llama", False),
            [x, w],
            gy,
        ),
        (
            "add+rmsnorm",
            ours_add_norm,
            lambda x, r, w: LigerFusedAddRMSNormFunction.apply(x, r, w, eps, 0.0, "llama", False),
            [x, r, w],
            gy,
        ),
        ("swiglu", ours_swiglu, lambda a, b: LigerSiLUMulFunction.apply(a, b), [a, b], gh),
    ]
    out = []
    for name, ours, liger, inputs, grads in cases:
        compiled = fwd_bwd(torch.compile(ours, dynamic=False), inputs, grads)
        lig = fwd_bwd(liger, inputs, grads)
        (o1, g1), (o2, g2) = compiled(), lig()
        diff = max(max_diff(list(o1), list(o2)), max_diff(g1, g2))
        t_c, t_l = median_ms(compiled, iters, warmup=5), median_ms(lig, iters, warmup=5)
        row = {
            "op": name,
            "rows": rows,
            "compiled_ms": round(t_c, 4),
            "liger_ms": round(t_l, 4),
            "liger_speedup": round(t_c / t_l, 3),
            "max_abs_diff": diff,
        }
        print(
            f"{name:12s} compiled {t_c:7.3f} ms  liger {t_l:7.3f} ms  liger/compiled speed {t_c / t_l:5.2f}x"
            f"  max |diff| {diff:.3g}",
            flush=True,
        )
        out.append(row)
    return out


def patch_liger() -> None:
    """Our layers with Liger's kernels, in this process: RMSNorm, the block's second residual add + norm,
    SwiGLU's activation."""
    from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    from gptoughts.models import layers, llama

    def norm_forward(self, x):
        return LigerRMSNormFunction.apply(x, self.weight, self.eps, 0.0, "llama", False)

    def swiglu_forward(self, x):
        return self.w2(LigerSiLUMulFunction.apply(self.w1(x), self.w3(x)))

    orig = llama.TransformerBlock.forward

    def block_forward(self, x, cos, sin, cache=None, doc_ids=None):
        if cache is not None:
            return orig(self, x, cos, sin, cache, doc_ids)
        a = self.attention(self.attention_norm(x), cos, sin, cache, doc_ids)
        norm = self.ffn_norm
        n, h = LigerFusedAddRMSNormFunction.apply(a, x, norm.weight, norm.eps, 0.0, "llama", False)
        return h + self.feed_forward(n)

    layers.RMSNorm.forward = norm_forward
    layers.SwiGLU.forward = swiglu_forward
    llama.TransformerBlock.forward = block_forward


def step_rows(step_args: str, steps: int) -> list[dict]:
    from gptoughts.cli.options import parse_overrides
    from gptoughts.config import load_config
    from gptoughts.tools.bench import run_bench

    preset, overrides, _ = parse_overrides(shlex.split(step_args))
    out = []
    for name in ("ours", "liger"):
        if name == "liger":
            patch_liger()
            torch._dynamo.reset()
        r = run_bench(load_config(preset or "default", overrides), steps=steps, warmup=5)
        row = {"step": name, "args": step_args, "tokens_per_s": r["tokens_per_s"], "step_ms": r["step_ms"],
               "mfu": r.get("mfu"), "peak_memory_gib": r.get("peak_memory_gib")}  # fmt: skip
        print(f"step {name:6s} {r['tokens_per_s']:>10,.0f} tok/s  {r['step_ms']:7.1f} ms  MFU {r.get('mfu') or 0:.3f}",
              flush=True)  # fmt: skip
        out.append(row)
    print(f"step: liger/ours speed {out[1]['tokens_per_s'] / out[0]['tokens_per_s']:.3f}x", flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=8 * 2048)
    p.add_argument("--d_model", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=5632)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--step", default=None, help="gptoughts bench arguments of the whole-step comparison")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--out", default=None, help="a .jsonl file to append the rows to")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/fused_ops.py needs a CUDA GPU")
    rows = ops_table(a.rows, a.d_model, a.hidden, a.iters)
    if a.step:
        rows += step_rows(a.step, a.steps)
    if a.out:
        with open(a.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
