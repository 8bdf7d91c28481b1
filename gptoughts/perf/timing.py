"""Where the time of a training step goes: data wait, forward, backward, optimizer, other.

On CUDA the boundaries are CUDA events recorded on the compute stream, read only at log intervals (the loop
already syncs there), so timing adds no host-device synchronisation. Events measure the *GPU* timeline: if
the GPU finishes step N before the host has the data of step N+1 ready, the gap shows up as data wait, which
is exactly the idle time we want to expose. On CPU the same marks use the host clock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

PHASES = ("data", "forward", "backward", "optimizer", "other")


@dataclass
class _Step:
    marks: list[tuple[str, object]] = field(default_factory=list)


class StepTimer:
    """Record phase boundaries each step; ``summary()`` (at log time) returns mean ms per phase per step."""

    def __init__(self, device: torch.device, enabled: bool = True, max_pending: int = 256):
        self.device = device
        self.enabled = enabled
        self.cuda = device.type == "cuda"
        self.pending: list[_Step] = []
        self.max_pending = max_pending
        self._current: _Step | None = None

    def _stamp(self) -> object:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def start(self) -> None:
        if not self.enabled:
            return
        self._current = _Step()
        self._current.marks.append(("start", self._stamp()))

    def mark(self, phase: str) -> None:
        """The time since the previous mark belongs to ``phase``."""
        if self._current is not None:
            self._current.marks.append((phase, self._stamp()))

    def stop(self) -> None:
        if self._current is None:
            return
        self._current.marks.append(("other", self._stamp()))
        if len(self.pending) < self.max_pending:  # bounded memory if nobody reads the summary
            self.pending.append(self._current)
        self._current = None

    def summary(self) -> dict[str, float]:
        """Mean milliseconds per step for each phase, and each phase's share of the step (reads the events)."""
        if not self.pending:
            return {}
        if self.cuda:  # normally a no-op: callers read this right after the log-interval sync
            self.pending[-1].marks[-1][1].synchronize()  # type: ignore[union-attr]
        totals = dict.fromkeys(PHASES, 0.0)
        for step in self.pending:
            for (_, a), (phase, b) in zip(step.marks, step.marks[1:]):
                ms = a.elapsed_time(b) if self.cuda else (b - a) * 1e3  # type: ignore[union-attr,operator]
                totals[phase if phase in totals else "other"] += ms
        n = len(self.pending)
        self.pending.clear()
        step_ms = sum(totals.values()) / n
        out = {f"time/{k}_ms": v / n for k, v in totals.items()}
        out["time/step_ms"] = step_ms
        for k, v in totals.items():
            out[f"time/{k}_pct"] = 100.0 * v / n / step_ms if step_ms > 0 else 0.0
        return out


def nvml_index(index: int) -> int:
    """NVML's index of torch's CUDA device ``index``: NVML numbers every GPU of the machine, torch only those
    ``CUDA_VISIBLE_DEVICES`` shows (under ``CUDA_VISIBLE_DEVICES=2`` torch's 0 is NVML's 2: read by torch's index,
    the run reported another GPU's utilisation, 0% beside a busy GPU, and advised a larger batch)."""
    try:
        return torch.cuda._get_nvml_device_index(
            index
        )  # private, but the mapping torch.cuda.utilization uses
    except Exception:  # an unparsable CUDA_VISIBLE_DEVICES, UUIDs NVML cannot list: torch's own index
        return index


class GpuMonitor:
    """GPU utilisation and memory from NVML (nvidia-ml-py); silently absent where NVML is not available."""

    def __init__(self, device: torch.device):
        self.handle = None
        if device.type != "cuda":
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            index = device.index if device.index is not None else torch.cuda.current_device()
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(nvml_index(index))
            self.nvml = pynvml
        except Exception:  # no driver library, container without NVML, ...
            self.handle = None

    def read(self) -> dict[str, float]:
        if self.handle is None:
            return {}
        try:
            util = self.nvml.nvmlDeviceGetUtilizationRates(self.handle)
            mem = self.nvml.nvmlDeviceGetMemoryInfo(self.handle)
            return {"gpu/util_pct": float(util.gpu), "gpu/mem_used_gib": mem.used / 2**30}
        except Exception:
            return {}


def advice(
    t: dict[str, float], gpu: dict[str, float], previous_gpu: dict[str, float] | None = None
) -> list[str]:
    """Concrete advice when the breakdown shows the GPU waiting. NVML's utilisation covers the last fraction of a
    second before it is read (a compile or an evaluation just before a log line reads low): with ``previous_gpu``
    (the reading of the log line before) it counts only when both are low."""
    tips = []
    if t.get("time/data_pct", 0.0) > 5.0:
        tips.append(
            f"data wait is {t['time/data_pct']:.0f}% of the step: prepare shards ahead with `gptoughts "
            "prepare`, keep them on a local SSD, or raise the loader's prefetch"
        )
    util = gpu.get("gpu/util_pct")
    before = util if previous_gpu is None else previous_gpu.get("gpu/util_pct")
    if util is not None and util < 90.0 and before is not None and before < 90.0:
        tips.append(
            f"GPU utilisation {util:.0f}% (<90%): raise --batch_size (or use auto), turn on --compile, and "
            "check the data wait; small models are often launch-bound, where compile helps most"
        )
    return tips


# ------------------------------------------------------------------------------------ kernels of a profile
# What each CUDA kernel of a torch.profiler run is, from its name (first match wins). cuBLAS names its Hopper
# GEMMs nvjet_* / sm90_xmma_*; Triton matmul templates (max-autotune) are triton_tem_*; cuDNN and
# flash attention kernels name "fmha"/"flash"/"sdpa"; multi_tensor_apply is fused AdamW and the grad norm.
KERNEL_CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("communication", ("nccl",)),
    ("optimizer", ("multi_tensor", "fused_adam", "adamw", "foreach")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "attn", "cudnn")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "splitk", "_tem_")),
    ("memcpy", ("memcpy", "memset")),
    (
        "elementwise",
        (
            "triton",
            "elementwise",
            "reduce",
            "softmax",
            "norm",
            "cat",
            "index",
            "scatter",
            "gather",
            "fill",
            "copy",
            "dropout",
            "embedding",
        ),
    ),
)


def kernel_category(name: str) -> str:
    low = name.lower()
    for category, keys in KERNEL_CATEGORIES:
        if any(k in low for k in keys):
            return category
    return "other"


def summarize_kernels(kernel_us: dict[str, float], steps: int, top: int = 40) -> dict[str, object]:
    """Per-step GPU milliseconds by kernel category (and each category's share of GPU busy time), plus the
    ``top`` kernels by time, from ``{kernel name: total microseconds}`` over ``steps`` steps."""
    steps = max(1, steps)
    by_cat: dict[str, float] = {}
    for name, us in kernel_us.items():
        cat = kernel_category(name)
        by_cat[cat] = by_cat.get(cat, 0.0) + us
    busy = sum(by_cat.values())
    cats = {
        c: {"ms_per_step": us / 1e3 / steps, "pct": 100.0 * us / busy if busy else 0.0}
        for c, us in sorted(by_cat.items(), key=lambda kv: -kv[1])
    }
    heavy = sorted(kernel_us.items(), key=lambda kv: -kv[1])[:top]
    return {
        "gpu_busy_ms_per_step": busy / 1e3 / steps,
        "categories": cats,
        "top_kernels": [
            {"name": n[:240], "category": kernel_category(n), "ms_per_step": us / 1e3 / steps}
            for n, us in heavy
        ],
    }


def format_kernels(summary: dict[str, object]) -> str:
    cats = summary["categories"]  # type: ignore[index]
    parts = [f"{c} {v['ms_per_step']:.1f} ms ({v['pct']:.0f}%)" for c, v in cats.items()]  # type: ignore[union-attr]
    return f"GPU busy {summary['gpu_busy_ms_per_step']:.1f} ms/step: " + ", ".join(parts)


def summarize_profile(prof: object, steps: int) -> dict[str, object]:
    """Kernel categories (:func:`summarize_kernels`) and idle gaps (:func:`summarize_gaps`) of a finished
    torch.profiler run over ``steps`` steps; empty when it recorded no CUDA kernel (a CPU run)."""
    intervals = profile_intervals(prof)
    if not intervals:
        return {}
    totals: dict[str, float] = {}
    for start, end, name in intervals:
        totals[name] = totals.get(name, 0.0) + (end - start)
    out = summarize_kernels(totals, steps)
    out["gaps"] = summarize_gaps(intervals, steps)
    return out


def profile_intervals(prof: object) -> list[tuple[float, float, str]]:
    """``(start_us, end_us, name)`` of every CUDA kernel a finished torch.profiler recorded, in start order.

    With CPU activity on, the profiler also projects user annotations (``## Call CompiledFxGraph ... ##``,
    ``Optimizer.step#AdamW.step``, ``ProfilerStep#N``) onto the GPU timeline; they span kernels and are skipped.
    """
    from torch.autograd import DeviceType

    out = []
    for e in prof.events():  # type: ignore[attr-defined]
        if getattr(e, "device_type", None) != DeviceType.CUDA or e.time_range.end <= e.time_range.start:
            continue
        if getattr(e, "is_user_annotation", False) or e.name.startswith("## ") or "#" in e.name.split("(")[0]:
            continue
        out.append((float(e.time_range.start), float(e.time_range.end), e.name))
    out.sort()
    return out


def summarize_gaps(
    intervals: list[tuple[float, float, str]], steps: int, min_us: float = 20.0, top: int = 10
) -> dict[str, object]:
    """Idle GPU time between kernels (``intervals`` as from :func:`profile_intervals`, one stream or several):
    total idle ms per step, the gaps of at least ``min_us`` and the largest ones with the kernels around them,
    which says what the GPU was waiting for (a host sync, a slow launch, the data)."""
    steps = max(1, steps)
    gaps: list[tuple[float, str, str]] = []
    idle = 0.0
    busy_until, last_name = None, ""
    for start, end, name in intervals:
        if busy_until is not None and start > busy_until:
            gap = start - busy_until
            idle += gap
            if gap >= min_us:
                gaps.append((gap, last_name, name))
        if busy_until is None or end >= busy_until:
            busy_until, last_name = end, name
    gaps.sort(key=lambda g: -g[0])
    return {
        "idle_ms_per_step": idle / 1e3 / steps,
        "gaps_over_min": len(gaps),
        "min_gap_us": min_us,
        "idle_in_gaps_over_min_ms_per_step": sum(g[0] for g in gaps) / 1e3 / steps,
        "largest": [{"us": round(g, 1), "after": a[:90], "before": b[:90]} for g, a, b in gaps[:top]],
    }


def format_gaps(g: dict[str, object]) -> str:
    largest = g["largest"]
    head = f"GPU idle {g['idle_ms_per_step']:.2f} ms/step ({g['gaps_over_min']} gaps >= {g['min_gap_us']:.0f} us)"
    if largest:
        x = largest[0]  # type: ignore[index]
        head += f"; largest {x['us']:.0f} us after {x['after'][:40]} before {x['before'][:40]}"
    return head


def format_profile(summary: dict[str, object]) -> list[str]:
    """The lines that report a :func:`summarize_profile` result: kernel categories, then idle gaps."""
    lines = ["kernels: " + format_kernels(summary)]
    if summary.get("gaps"):
        lines.append(format_gaps(summary["gaps"]))  # type: ignore[arg-type]
    return lines
