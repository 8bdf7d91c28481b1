"""Forward + backward time of our attention (``layers.sdpa``) per backend, at the shapes of our presets.

Usage, on the GPU machine (FlashAttention-4 from a ``pip install --no-deps --target`` folder of its wheels):

    PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages python bench/attention.py --out $OUT/attention.jsonl

Shapes (``--only`` picks some): 1b (B8 T2048 H32 KV8 hd64, causal), 8b (Llama-3 3b/8b head size: B4 T4096 H32
KV8 hd128, causal), llada (LLaDA-medium: B8 T2048 H32 KV4 hd64, bidirectional) and packed (B8 T4096 H32 KV8 hd64,
~8 random-length documents per row, causal within each). Backends: SDPA as ``auto`` picks and restricted to
flash / cudnn / efficient (``perf.sdpa_backend``), fa4 (``perf.sdpa_backend fa4``: our FlashAttention-4 op),
flex (compiled FlexAttention with a causal or document block mask; on packed rows this is
``perf.doc_mask_attention flex``), fa4-varlen (packed rows as FA4 variable-length sequences; not a training path,
a comparison) and flash-torch-fa4 (torch's own ``activate_flash_attention_impl("FA4")`` routing, where the
running torch has it). Each row: median ms of ``--iters`` timed forward+backward calls after ``--warmup`` (CUDA
events), attention TFLOP/s (4·hd FLOPs per attended query-key pair forward, 2.5x that backward), peak memory above
the inputs, the first call's wall time (FA4's JIT and flex's compile) and the largest output difference from the
shape's first row (SDPA: the reference). A backend that is unavailable or fails is a row with its one-line
reason, never a crash. JSON lines to ``--out``, a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without an install
from gptoughts.models.layers import AttentionKernels, attention_mask, sdpa, use_attention_kernels
from gptoughts.perf import attention

SHAPES: dict[str, dict[str, Any]] = {
    "1b": dict(b=8, t=2048, h=32, kv=8, hd=64, causal=True),
    "8b": dict(b=4, t=4096, h=32, kv=8, hd=128, causal=True),
    "llada": dict(b=8, t=2048, h=32, kv=4, hd=64, causal=False),
    "packed": dict(b=8, t=4096, h=32, kv=8, hd=64, causal=True, docs=8),
}
DENSE_BACKENDS = ("sdpa", "flash", "cudnn", "efficient", "fa4", "flex", "flash-torch-fa4")
PACKED_BACKENDS = ("sdpa", "flex", "fa4-varlen")


def _one_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0][:300] if msg else ''}"


def random_docs(b: int, t: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """``doc_ids [B, T]``: each row cut at ``n - 1`` random places into ``n`` documents of random lengths."""
    cuts = torch.stack([torch.randperm(t - 1, generator=gen)[: n - 1] + 1 for _ in range(b)])
    return torch.cumsum(torch.zeros(b, t, dtype=torch.long).scatter_(1, cuts, 1), dim=1)


def time_fwd_bwd(fn: Callable[[], torch.Tensor], inputs: tuple, warmup: int, iters: int) -> dict[str, Any]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    dout = torch.randn_like(out)
    torch.autograd.grad(out, inputs, dout)
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    for _ in range(warmup):
        torch.autograd.grad(fn(), inputs, dout)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends, strict=True):
        s.record()
        torch.autograd.grad(fn(), inputs, dout)
        e.record()
    torch.cuda.synchronize()
    ms = statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    return {"ms": ms, "first_call_s": first_s, "peak_extra_gib": peak, "out": out.detach()}


def _sdpa_only(kind: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([{"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                         "efficient": SDPBackend.EFFICIENT_ATTENTION}[kind]])  # fmt: skip


def make_call(backend: str, shape: dict[str, Any], q, k, v, doc) -> Callable[[], torch.Tensor]:
    """The timed call of ``backend``: ``[B, H, T, hd]`` in and out, as ``layers.sdpa``. Raises with the reason
    when the backend cannot run here."""
    causal = shape["causal"]
    dev = q.device
    if backend == "sdpa":
        return lambda: sdpa(q, k, v, causal=causal, doc_ids=doc)
    if backend in ("flash", "cudnn", "efficient"):

        def call() -> torch.Tensor:
            with _sdpa_only(backend):
                return sdpa(q, k, v, causal=causal, doc_ids=doc)

        return call
    if backend == "fa4":
        why = attention.fa4_unavailable(dev)
        if why:
            raise RuntimeError(why)
        kernels = AttentionKernels(fa4=attention.FA4())

        def call() -> torch.Tensor:
            with use_attention_kernels(kernels):
                return sdpa(q, k, v, causal=causal)

        return call
    if backend == "flex":
        why = attention.flex_unavailable(dev)
        if why:
            raise RuntimeError(why)
        flex = attention.FlexDocAttention()
        if doc is not None:  # the training path: block mask built once per batch (timed separately)
            kernels = AttentionKernels(doc=flex)

            def call() -> torch.Tensor:
                with use_attention_kernels(kernels):
                    return sdpa(q, k, v, causal=causal, doc_ids=doc)

            return call
        from torch.nn.attention.flex_attention import create_block_mask

        b, _, t, _ = q.shape
        mask = create_block_mask(
            (lambda b_, h_, i, j: i >= j) if causal else (lambda b_, h_, i, j: i >= 0),
            None,
            None,
            t,
            t,
            device=dev,
        )
        return lambda: flex.flex(q, k, v, block_mask=mask, enable_gqa=q.size(1) != k.size(1))
    if backend == "fa4-varlen":
        why = attention.fa4_unavailable(dev)
        if why:
            raise RuntimeError(why)
        from flash_attn.cute import flash_attn_varlen_func

        b, h, t, hd = q.shape
        # Each (row, document) is one sequence of the flattened batch; computed once, outside the timing
        # (in training it is a host sync per batch: the number of documents sets the shapes).
        flat = (doc + torch.arange(b, device=dev)[:, None] * (int(doc.max()) + 1)).flatten()
        starts = torch.nonzero(torch.diff(flat, prepend=flat[:1] - 1)).flatten()
        cu = torch.cat([starts, starts.new_tensor([flat.numel()])]).to(torch.int32)
        max_len = int((cu[1:] - cu[:-1]).max())

        def call() -> torch.Tensor:
            qf, kf, vf = (x.transpose(1, 2).reshape(b * t, x.size(1), hd) for x in (q, k, v))
            out = flash_attn_varlen_func(
                qf, kf, vf, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len, max_seqlen_k=max_len,
                causal=causal,
            )  # fmt: skip
            out = out[0] if isinstance(out, tuple) else out
            return out.view(b, t, h, hd).transpose(1, 2)

        return call
    if backend == "flash-torch-fa4":
        from torch.nn import attention as nn_attention

        if "FA4" not in getattr(nn_attention, "list_flash_attention_impls", list)():
            raise RuntimeError(f"torch {torch.__version__} has no FA4 routing for SDPA's flash backend")
        why = attention.fa4_unavailable(dev)
        if why:
            raise RuntimeError(why)

        def call() -> torch.Tensor:
            with _sdpa_only("flash"):
                return sdpa(q, k, v, causal=causal)

        return call
    raise ValueError(backend)


def attended_pairs(shape: dict[str, Any], doc: torch.Tensor | None) -> int:
    t = shape["t"]
    if doc is None:
        return shape["b"] * (t * (t + 1) // 2 if shape["causal"] else t * t)
    return int(attention_mask(t, t, causal=shape["causal"], doc_ids=doc, device=doc.device).sum())


def run_shape(name: str, shape: dict[str, Any], backends: list[str], warmup: int, iters: int) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    b, t, h, kv, hd = (shape[x] for x in ("b", "t", "h", "kv", "hd"))
    # [B, T, H, hd] projections viewed as [B, H, T, hd], as Attention.forward hands them to sdpa
    q, k, v = (
        torch.randn(b, t, n, hd, device="cuda", dtype=torch.bfloat16, generator=gen).transpose(1, 2).requires_grad_()
        for n in (h, kv, kv)
    )  # fmt: skip
    doc = None
    if shape.get("docs"):
        doc = random_docs(b, t, shape["docs"], torch.Generator().manual_seed(0)).cuda()
    flops = 4 * hd * attended_pairs(shape, doc) * h * 3.5  # forward 1x, backward 2.5x
    rows, ref = [], None
    for backend in backends:
        row: dict[str, Any] = {"shape": name, **{k_: v_ for k_, v_ in shape.items()}, "backend": backend}
        try:
            fn = make_call(backend, shape, q, k, v, doc)
            if backend == "flash-torch-fa4":
                from torch.nn import attention as nn_attention

                nn_attention.activate_flash_attention_impl("FA4")
            try:
                r = time_fwd_bwd(fn, (q, k, v), warmup, iters)
            finally:
                if backend == "flash-torch-fa4":
                    nn_attention.restore_flash_attention_impl()
            out = r.pop("out")
            if ref is None:
                ref = out
            row.update({k_: round(v_, 4) for k_, v_ in r.items()})
            row["tflops"] = round(flops / (r["ms"] * 1e-3) / 1e12, 1)
            row["max_err"] = float((out.float() - ref.float()).abs().max())
        except Exception as e:  # one line per failing backend; the others still run
            row["error"] = _one_line(e)
        torch.cuda.empty_cache()
        rows.append(row)
    if (
        doc is not None
        and "flex" in backends
        and "error" not in next(r for r in rows if r["backend"] == "flex")
    ):
        # the per-batch cost the flex rows leave out: one block mask per batch, shared by every layer
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            attention.doc_block_mask(doc.clone(), causal=shape["causal"], window=None)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        rows.append(
            {
                "shape": name,
                "backend": "flex block mask build (per batch)",
                "ms": round(statistics.median(times[1:]) * 1e3, 4),
            }
        )
    return rows


def _table(rows: list[dict]) -> str:
    head = f"{'shape':8} {'backend':34} {'ms':>9} {'TFLOP/s':>8} {'peak GiB':>9} {'1st call s':>10} {'max err':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['shape']:8} {r['backend']:34} {'-':>9}  {r['error']}")
            continue
        cells = [
            format(r[key], spec) if r.get(key) is not None else format("-", ">" + spec.split(".")[0])
            for key, spec in (
                ("ms", "9.3f"), ("tflops", "8.1f"), ("peak_extra_gib", "9.2f"), ("first_call_s", "10.1f"),
                ("max_err", "8.4f"),
            )
        ]  # fmt: skip
        lines.append(f"{r['shape']:8} {r['backend']:34} " + " ".join(cells))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="JSON lines file")
    p.add_argument("--only", default=",".join(SHAPES), help=f"shapes, comma-separated: {','.join(SHAPES)}")
    p.add_argument("--backends", default=None, help="comma-separated subset (default: all that apply)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/attention.py needs a CUDA GPU")
    env = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    env.update(attention.available(torch.device("cuda")))
    print(json.dumps(env))
    rows: list[dict] = []
    for name in a.only.split(","):
        shape = SHAPES[name]
        backends = list(PACKED_BACKENDS if shape.get("docs") else DENSE_BACKENDS)
        if a.backends:
            backends = [x for x in backends if x in a.backends.split(",")]
        t0 = time.perf_counter()
        rows += run_shape(name, shape, backends, a.warmup, a.iters)
        print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)
    for r in rows:
        r.update({"device": env["device"], "torch": env["torch"]})
    print(_table(rows))
    if a.out:
        with open(a.out, "w") as fh:
            for r in rows:
                fh.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
