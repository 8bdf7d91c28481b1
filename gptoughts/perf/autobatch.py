"""Automatic micro-batch size: the largest that fits, found with real training steps.

The search runs real forward + backward + optimizer steps at the real sequence length (so activation memory,
optimizer state, allocator fragmentation and compiled kernels' workspaces are all real), frees memory between
tries, and keeps a safety margin under the device's capacity. The result is cached per (model, sequence
length, GPU, precision, speed settings), so a restarted run does not search again.
"""

from __future__ import annotations

import gc
import hashlib
import json
import math
import os
from collections.abc import Callable
from pathlib import Path

import torch

from gptoughts.errors import UserError


def is_oom(e: BaseException) -> bool:
    """A failed allocation: CUDA's OutOfMemoryError, or the CPU allocator's RuntimeError ("can't allocate")."""
    if isinstance(e, torch.OutOfMemoryError):
        return True
    text = str(e).lower()
    return isinstance(e, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


def free_memory(device: torch.device) -> None:
    if device.type == "cuda":  # a full gc pass costs ~1 s in a big process: only worth it to free GPU memory
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def search(fits: Callable[[int], bool], *, max_batch: int = 1024) -> int:
    """Largest ``b`` in [1, max_batch] with ``fits(b)``: doubling, then bisection. 0 when even 1 does not fit.

    Assumes monotonicity (if b fits, every smaller batch fits), which holds for memory.
    """
    if not fits(1):
        return 0
    good, bad = 1, None
    while bad is None:
        nxt = min(good * 2, max_batch)
        if nxt == good:
            return good
        if fits(nxt):
            good = nxt
        else:
            bad = nxt
    while bad - good > 1:
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good


def make_fits(
    try_step: Callable[[int], None],
    device: torch.device,
    *,
    safety: float = 0.9,
    capacity: int | None = None,
    peak: Callable[[], int] | None = None,
) -> Callable[[int], bool]:
    """Wrap ``try_step(batch)`` (one or two real training steps) into a fits() predicate for :func:`search`.

    A try fits when it raises no OOM and its peak memory stays under ``safety`` × capacity: the margin leaves
    room for evaluation, generation and allocator fragmentation later in the run.
    """
    if capacity is None and device.type == "cuda":
        capacity = torch.cuda.get_device_properties(device).total_memory
    if peak is None:
        peak = (lambda: torch.cuda.max_memory_reserved(device)) if device.type == "cuda" else (lambda: 0)

    def fits(batch: int) -> bool:
        free_memory(device)
        try:
            try_step(batch)
        except BaseException as e:  # noqa: BLE001 - only OOM is expected; anything else is re-raised
            if not is_oom(e):
                raise
            ok = False
        else:
            ok = capacity is None or peak() <= safety * capacity
        free_memory(device)
        return ok

    return fits


def accumulation_for(
    global_batch_tokens: int | None, micro_batch: int, block_size: int, world_size: int
) -> int:
    """Gradient-accumulation steps so that one optimizer step sees about ``global_batch_tokens`` tokens."""
    if not global_batch_tokens:
        return 1
    return max(1, math.ceil(global_batch_tokens / (micro_batch * block_size * world_size)))


def global_batch_shape(
    global_batch_tokens: int, micro_batch: int, block_size: int, world_size: int
) -> tuple[int, int]:
    """(micro-batch, accumulation) of an automatic batch that reaches ``global_batch_tokens``, from the largest
    micro-batch that fits: capped at the global batch (beyond it one step would overshoot), then the fewest
    accumulation steps, then the smallest micro-batch that reaches the target with them (115 x 3 x 2048 would
    overshoot 0.5M by 35%; 86 x 3 is within 1%). What train plans and ``gptoughts estimate`` prints."""
    micro = max(1, min(micro_batch, global_batch_tokens // (block_size * world_size)))
    accum = accumulation_for(global_batch_tokens, micro, block_size, world_size)
    return min(micro, -(-global_batch_tokens // (accum * block_size * world_size))), accum


def cache_key(parts: dict[str, object]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


class BatchCache:
    """JSON file of key -> micro-batch, under the gptoughts cache dir."""

    def __init__(self, path: str | Path | None = None):
        if path is None:
            root = Path(os.environ.get("GPTOUGHTS_CACHE", Path.home() / ".cache" / "gptoughts"))
            path = root / "autobatch.json"
        self.path = Path(path)

    def _read(self) -> dict[str, dict]:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}

    def get(self, key: str) -> int | None:
        entry = self._read().get(key)
        return int(entry["batch_size"]) if entry else None

    def put(self, key: str, batch_size: int, parts: dict[str, object]) -> None:
        data = self._read()
        data[key] = {"batch_size": batch_size, **{k: str(v) for k, v in parts.items()}}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2))
        os.replace(tmp, self.path)


class NothingFits(UserError):
    """Not even one row fits in real training steps. The run's assembly, which has its memory estimates, says what
    each way out would need (``training/build.py``); this message is for the others."""

    def __init__(self, message: str = "") -> None:
        super().__init__(
            message
            or "not even one row fits in memory in real training steps: lower --block_size, use "
            "--activation_checkpointing full, --train.optimizer_states bf16 or --parallel.cpu_offload true, a "
            "smaller --size, or more GPUs (FSDP)"
        )


def find_batch_size(
    try_step: Callable[[int], None],
    device: torch.device,
    *,
    parts: dict[str, object],
    cache: BatchCache | None = None,
    max_batch: int = 256,
    safety: float = 0.9,
    capacity: int | None = None,
    peak: Callable[[], int] | None = None,
) -> tuple[int, bool]:
    """(micro-batch, from_cache). Raises :class:`NothingFits` when not even one row fits."""
    cache = cache or BatchCache()
    key = cache_key(parts)
    hit = cache.get(key)
    if hit is not None:
        return hit, True
    best = search(
        make_fits(try_step, device, safety=safety, capacity=capacity, peak=peak), max_batch=max_batch
    )
    if best == 0:
        raise NothingFits()
    cache.put(key, best, parts)
    return best, False
