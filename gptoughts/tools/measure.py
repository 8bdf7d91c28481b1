"""Measuring a training step: random token batches already on the device, seconds per step with warm-up excluded,
peak GPU memory and GPU time by kernel category. ``bench`` times our step with them, and the peers it compares
against (``transformers``, torchtitan) with the same clock."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch


class SyntheticBatches:
    """Random token windows generated once on the device: the data never waits (pure model speed)."""

    def __init__(
        self,
        vocab_size: int,
        batch_size: int,
        block_size: int,
        device: torch.device,
        seed: int = 0,
        pool: int = 8,
    ):
        g = torch.Generator(device="cpu").manual_seed(seed)
        data = torch.randint(0, vocab_size, (pool, batch_size, block_size + 1), generator=g)
        self.batches = [(d[:, :-1].to(device), d[:, 1:].to(device)) for d in data]
        self.i = 0

    def __iter__(self) -> Iterator:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        b = self.batches[self.i % len(self.batches)]
        self.i += 1
        return b

    def state_dict(self) -> dict:
        return {"i": self.i}

    def close(self) -> None:
        pass


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> float | None:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return None


def time_steps(step_fn, device: torch.device, warmup: int, steps: int) -> float:
    """Seconds per step: warm-up (compilation, allocator growth) excluded, one sync around the timed steps."""
    for _ in range(warmup):
        step_fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step_fn()
    _sync(device)
    return (time.perf_counter() - t0) / steps


def median_ms(fn: Any, iters: int, warmup: int = 3, cuda: bool | None = None) -> float:
    """Median milliseconds of ``fn()`` over ``iters`` calls after ``warmup`` (:func:`call_ms`)."""
    for _ in range(warmup):
        fn()
    return statistics.median(call_ms(fn, iters, cuda))


def call_ms(fn: Any, iters: int, cuda: bool | None = None) -> list[float]:
    """Milliseconds of each of ``iters`` calls of ``fn()``: CUDA events around each call on a GPU (what the bench
    scripts time kernels with), the host clock elsewhere (their CPU smoke runs). ``cuda`` None: a GPU where CUDA is
    in use."""
    if cuda is None:
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    times = []
    for _ in range(iters):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def profile_steps(step_fn, device: torch.device, steps: int) -> dict[str, Any] | None:
    """GPU time per step by kernel category over ``steps`` profiled steps (None off CUDA)."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    from gptoughts.perf.timing import summarize_profile

    _sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step_fn()
        _sync(device)
        wall = time.perf_counter() - t0
    out = summarize_profile(prof, steps)
    out["step_ms_profiled"] = wall * 1e3 / steps
    return out
