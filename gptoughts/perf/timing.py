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
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
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


def advice(t: dict[str, float], gpu: dict[str, float]) -> list[str]:
    """Concrete advice when the breakdown shows the GPU waiting."""
    tips = []
    if t.get("time/data_pct", 0.0) > 5.0:
        tips.append(f"data wait is {t['time/data_pct']:.0f}% of the step: prepare shards ahead with `gptoughts "
                    "prepare`, keep them on a local SSD, or raise the loader's prefetch")
    util = gpu.get("gpu/util_pct")
    if util is not None and util < 90.0:
        tips.append(f"GPU utilisation {util:.0f}% (<90%): raise --batch_size (or use auto), turn on --compile, and "
                    "check the data wait; small models are often launch-bound, where compile helps most")
    return tips
