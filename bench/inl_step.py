"""One INL block, forward + backward, with each integrator implementation (``model.integrator_impl``).

At the inl-3b shape by default (d 2048, 16 heads, K 4, H 64; batch 2 x 2048; bf16 autocast; the block compiled
as training compiles it), for each implementation and activation-checkpointing mode: median milliseconds of a
forward + backward and of the forward alone, the peak memory above the block's weights, and the largest difference of the
block's output and gradients from the reference. One JSON line per variant, on stdout and appended to ``--out``.

    python3 bench/inl_step.py --out r.jsonl [--ac none,selective] [--no-compile] [--part integrator] [--profile 3]
    python3 bench/inl_step.py --impls triton --tiles 32,32,256,4,1/16,16,512,4,2+64,16,256,4,2   # BM,BD,BDB,warps,stages
    python3 bench/inl_step.py --device cpu --size debug --batch 2 --seq 64 --iters 2   # smoke run on CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from gptoughts import models  # noqa: E402
from gptoughts.models import inl_triton  # noqa: E402
from gptoughts.models.inl import INLBlock  # noqa: E402
from gptoughts.perf.checkpointing import apply_activation_checkpointing  # noqa: E402
from gptoughts.tools.measure import profile_steps  # noqa: E402


class _Stack(torch.nn.Module):
    """One block in a ``layers`` list, as apply_activation_checkpointing expects."""

    def __init__(self, block: INLBlock, rope: torch.nn.Module) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([block])
        self.rope = rope


def _variant(a: argparse.Namespace, impl: str, ac: str, x: torch.Tensor, dy: torch.Tensor) -> dict:
    torch._dynamo.reset()  # tiles are read when a graph is traced
    dev = x.device
    args = models.model_args("inl", a.size, {"integrator_impl": impl, "n_layers": 1, "max_seq_len": a.seq})
    model = models.build_model("inl", args, device=dev)
    torch.manual_seed(0)
    model.init_weights()
    with torch.no_grad():  # the controller's output layer starts at zero: give the dynamics something to do
        model.layers[0].integrator.w_out.normal_(0, 0.02)
    stack = _Stack(model.layers[0], model.rope)
    apply_activation_checkpointing(stack, ac)
    block = stack.layers[0].integrator if a.part == "integrator" else stack.layers[0]
    if a.compile:
        block.compile()
    cos, sin = model.rope(a.seq, 0, None)
    xin = (
        (x.to(torch.bfloat16) if a.part == "integrator" else x).detach().requires_grad_()
    )  # attention's output

    def forward() -> torch.Tensor:
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            return block(xin) if a.part == "integrator" else block(xin, cos, sin)

    def step() -> None:
        xin.grad = None
        for p in block.parameters():
            p.grad = None
        forward().backward(dy)

    def median_ms(fn) -> float:
        times = []
        for _ in range(a.iters):
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    for _ in range(3):
        step()
    ms = median_ms(step)
    fwd_ms = median_ms(forward)  # with autograd recording, as in training
    kernels = profile_steps(step, dev, a.profile) if a.profile else None
    peak = None
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    grads = [xin.grad] + [p.grad for p in block.parameters()]
    row = {"impl": impl, "ac": ac, "ms": ms, "fwd_ms": fwd_ms, "peak_gib": peak, "grads": grads}
    return {**row, "kernels": kernels} if kernels else row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="3b")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--ac", default="none,selective", help="activation-checkpointing modes, comma-separated")
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--device", default="cuda")
    p.add_argument(
        "--impls", default="reference,fused,triton", help="integrator_impl values, comma-separated"
    )
    p.add_argument(
        "--tiles",
        default="",
        help="the triton kernels' BM,BD,BDB,num_warps,num_stages (forward+backward, or one for both); several joined by /",
    )
    p.add_argument(
        "--part", choices=["block", "integrator"], default="block", help="time the block or its integrator"
    )
    p.add_argument(
        "--profile", type=int, default=0, help="profile this many steps per variant (kernel table)"
    )
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    dev = torch.device(a.device)
    d = models.model_args("inl", a.size).d_model
    g = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(a.batch, a.seq, d, device=dev, generator=g)
    dy = torch.randn(a.batch, a.seq, d, device=dev, generator=g)
    for ac in a.ac.split(","):
        ref = None
        runs = []
        for impl in a.impls.split(","):
            for tiles in a.tiles.split("/") if impl == "triton" and a.tiles else [""]:
                runs.append((impl, tiles))
        for impl, tiles in runs:
            if tiles:  # one tuple for both passes, or forward+backward
                fwd, bwd = (tiles.split("+") * 2)[:2]
                for which, spec in (("forward", fwd), ("backward", bwd)):
                    bm, bd, bdb, warps, stages = (int(t) for t in spec.split(","))
                    inl_triton.TILES[which] = dict(BM=bm, BD=bd, BDB=bdb, num_warps=warps, num_stages=stages)
            r = _variant(a, impl, ac, x, dy)
            r["tiles"] = {k: dict(v) for k, v in inl_triton.TILES.items()} if impl == "triton" else None
            grads = r.pop("grads")
            ref = ref or grads
            diff = max(
                ((g1.float() - g0.float()).abs().max() / g0.float().abs().max()).item()
                for g0, g1 in zip(ref, grads)
            )
            row = {"bench": "inl_step", "part": a.part, "size": a.size, "batch": a.batch, "seq": a.seq, "compile": a.compile,
                   "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
                   **r, "max_rel_grad_diff": diff}  # fmt: skip
            line = json.dumps(row)
            print(line, flush=True)
            if a.out:
                with a.out.open("a") as f:
                    f.write(line + "\n")


if __name__ == "__main__":
    main()
