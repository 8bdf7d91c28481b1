"""Host copies of a checkpoint's tensors, kept from one save to the next, so a background save blocks training
only for the copy.

:class:`HostStaging` holds one page-aligned buffer per local tensor (a DTensor's local shard, a plain tensor),
pinned for CUDA after the first write; :func:`stageable` says whether a state's tensors can be copied that way;
:func:`host_memory_available` whether the host has room for them.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

_PRIMITIVE = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device)


def _local(x: torch.Tensor) -> tuple[torch.Tensor, tuple[Any, ...]]:
    """The tensor a staging copies for ``x`` (a DTensor's local shard, else ``x``) and its key: views of the same
    memory share a copy (tied weights)."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():  # to_local() outside autograd: the local tensor itself
        t = (x.to_local() if isinstance(x, DTensor) else x).detach()
    if not t.numel():
        return t, ("empty", id(x))
    return t, (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())


def local_tensors(state: Any) -> tuple[list[torch.Tensor], dict[tuple[Any, ...], int]]:
    """The distinct local tensors of ``state`` (nested dicts, lists, tuples), in order, and their index by key."""
    sources: list[torch.Tensor] = []
    index: dict[tuple[Any, ...], int] = {}

    def collect(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            t, k = _local(x)
            if k not in index:
                index[k] = len(sources)
                sources.append(t)
        elif isinstance(x, dict):
            for v in x.values():
                collect(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                collect(v)

    collect(state)
    return sources, index


class HostStaging:
    """Host copies of a state's tensors, kept from one save to the next (both savers of :mod:`.savers`).

    Why our own, not DCP's: ``dcp.async_save``'s default staging copies the state to fresh, unpinned host memory
    at every save, blocking training for seconds each time (docs/checkpoints.md), and torch 2.11's reusable
    ``DefaultStager`` fails on its second use with our state (KeyError: <class 'type'> in its deepcopy).

    Each local tensor (a DTensor's local shard, a plain tensor) gets a buffer of its own, page-aligned inside one
    anonymous mapping, allocated at the first save and refilled by every later save whose tensors have the same
    shapes and dtypes (another layout: a new mapping). Its own buffer, not a view of a larger one: DCP's writer
    clones a tensor whose storage is larger than itself. After the first save has been written, the buffers are
    pinned (cudaHostRegister, tensor by tensor) from the checkpoint thread while training goes on, so the first
    save copies into pageable memory and the later ones copy at full PCIe speed with ``non_blocking`` copies and
    one wait on the stream. The price: one host copy of each rank's shards (weights and optimizer state) stays
    allocated for the whole run (the run's plan counts it); :meth:`close` frees it."""

    def __init__(self) -> None:
        self._layout: tuple[tuple[tuple[int, ...], torch.dtype], ...] | None = None
        self._buffers: list[torch.Tensor] = []
        self._pinned: list[int] = []  # data pointers registered with CUDA
        self.allocations = 0
        """How many times buffers were (re)allocated (for the tests)."""
        self.device: torch.device | None = None
        """The GPU the last staged tensors came from (None: none did)."""

    @property
    def nbytes(self) -> int:
        return sum(b.untyped_storage().nbytes() for b in self._buffers)

    @property
    def layout(self) -> tuple[tuple[tuple[int, ...], torch.dtype], ...] | None:
        """The shapes and dtypes the buffers hold (None: no buffers)."""
        return self._layout

    @property
    def pinned(self) -> bool:
        return bool(self._buffers) and len(self._pinned) == sum(1 for b in self._buffers if b.numel())

    def stage(self, state: Any) -> Any:
        """A copy of ``state`` whose tensors live in this staging's host buffers, complete on return: the caller
        may change the originals at once. Containers are rebuilt, other leaves deep-copied."""
        import copy

        from torch.distributed.tensor import DTensor

        sources, index = local_tensors(state)
        self._ensure([(tuple(t.shape), t.dtype) for t in sources])
        cuda = {t.device for t in sources if t.device.type == "cuda"}
        self.device = next(iter(cuda), None)
        with torch.no_grad():
            for src, buf in zip(sources, self._buffers):
                buf.copy_(src, non_blocking=src.device.type == "cuda")
        # One wait for every copy: they were queued on the stream that computed the weights (after the optimizer
        # step), so the host copy is complete when this returns and training may change the weights at once.
        for dev in cuda:
            torch.cuda.current_stream(dev).synchronize()

        def rebuild(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                host = self._buffers[index[_local(x)[1]]]
                # The same shard of the same global tensor, its local part on the host: what DCP's own stager
                # hands its writer. Not DTensor.from_local, which would move the host tensor to the mesh's device.
                return DTensor(host, x._spec, requires_grad=False) if isinstance(x, DTensor) else host
            if isinstance(x, dict):
                return type(x)((k, rebuild(v)) for k, v in x.items())
            if isinstance(x, list):
                return [rebuild(v) for v in x]
            if isinstance(x, tuple):
                return type(x)(*map(rebuild, x)) if hasattr(x, "_fields") else tuple(map(rebuild, x))
            return x if isinstance(x, _PRIMITIVE) else copy.deepcopy(x)

        return rebuild(state)

    @staticmethod
    def layout_of(state: Any) -> list[tuple[tuple[int, ...], torch.dtype]]:
        return [(tuple(t.shape), t.dtype) for t in local_tensors(state)[0]]

    def prepare(self, layout: list[tuple[tuple[int, ...], torch.dtype]], device: torch.device | None) -> None:
        """Allocate (and on CUDA pin) the buffers of ``layout`` (:meth:`layout_of` the state to save) ahead of the
        first save; :meth:`~.savers.ShardedSaver.prepare` runs it in a background thread while training goes on."""
        self._ensure(layout)
        self.pin(device)

    def _ensure(self, layout: list[tuple[tuple[int, ...], torch.dtype]]) -> None:
        """Buffers for ``layout``: the current ones when it is theirs, else new ones."""
        import mmap

        if tuple(layout) == self._layout:
            return
        self.close()
        page = mmap.PAGESIZE
        sizes = [math.prod(shape) * torch.empty((), dtype=dt).element_size() for shape, dt in layout]
        total = sum(-(-n // page) * page for n in sizes)
        region: Any = None
        if total:
            region = mmap.mmap(-1, total)  # anonymous, page-aligned, filled lazily by the first copy
            # Huge pages: fewer page faults at the first copy, faster pinning. DONTFORK: a process forked later
            # (a data worker) neither shares nor copies these pages (Linux copies pinned pages at fork).
            for advice in ("MADV_HUGEPAGE", "MADV_DONTFORK"):
                if hasattr(mmap, advice):
                    try:
                        region.madvise(getattr(mmap, advice))
                    except OSError:
                        pass
        buffers, offset = [], 0
        for (shape, dt), n in zip(layout, sizes):
            if n == 0:
                buffers.append(torch.empty(shape, dtype=dt))
                continue
            # Each buffer holds a reference to the mapping: it is unmapped when the last buffer goes.
            buffers.append(
                torch.frombuffer(region, dtype=dt, count=n // dt.itemsize, offset=offset).view(shape)
            )
            offset += -(-n // page) * page
        self._buffers, self._layout = buffers, tuple(layout)
        self.allocations += 1

    def pin(self, device: torch.device | None) -> None:
        """Page-lock the buffers for CUDA, one tensor at a time (each page-aligned: no two share a page), so that no
        call holds the driver long while training runs beside it. A failure leaves the rest pageable (slower
        copies, still correct)."""
        if device is None or not torch.cuda.is_available() or self.pinned:
            return
        torch.cuda.set_device(device)  # this thread's device, else the driver would open a context on GPU 0
        cudart = torch.cuda.cudart()
        done = set(self._pinned)
        for b in self._buffers:
            ptr = b.data_ptr()
            if not b.numel() or ptr in done:
                continue
            if int(cudart.cudaHostRegister(ptr, b.untyped_storage().nbytes(), 1)) != 0:
                return
            self._pinned.append(ptr)

    def close(self) -> None:
        """Unpin and drop the buffers (the caller makes sure no copy or write uses them)."""
        if self._pinned:
            cudart = torch.cuda.cudart()
            for ptr in self._pinned:
                cudart.cudaHostUnregister(ptr)
        self._pinned, self._buffers, self._layout = [], [], None


def host_memory_available() -> int | None:
    """Bytes of memory this process can still take without swapping or meeting its container's limit: Linux
    ``MemAvailable``, lowered to what the cgroup's limit leaves (v2 ``memory.max``, v1 ``memory.limit_in_bytes``:
    Slurm, Kubernetes and Docker jobs see the host's MemAvailable but are killed at their own limit); None where
    unknown."""
    free = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        return None
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            limit = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and free is not None:
            free = min(free, max(0, int(limit) - usage))
        break
    return free


def stageable(state: Any) -> bool:
    """Whether every tensor of ``state`` (a DTensor: its local shard) is a plain tensor that host staging can copy:
    not a wrapper subclass such as torchao's 8-bit optimizer states, whose values live in inner tensors (no
    storage of their own: a copy by data pointer would give every one of them the same buffer)."""
    return all_plain(local_tensors(state)[0])


def all_plain(tensors: list[torch.Tensor]) -> bool:
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    return not any(is_traceable_wrapper_subclass(t) for t in tensors)
