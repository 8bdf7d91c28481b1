"""The background checkpoint writers: a save blocks training only while the state is copied to host buffers.

:class:`FileSaver` writes the single-file format (one process, or rank 0 of DDP); :class:`ShardedSaver` the
sharded one (every rank its own shards, through DCP). Both keep their host buffers for the whole run
(:class:`~.staging.HostStaging`), write from one thread of their own, and report that thread's error from
:meth:`~_BackgroundWriter.wait`, in the caller's thread, the next time training waits for them. Where a background
write does not pay (CPU runs, a host without the memory, tensor subclasses) they write synchronously, the same
files as :func:`~.store.save`.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gptoughts.errors import UserError, as_disk_full
from gptoughts.training.checkpoint import store
from gptoughts.training.checkpoint.sharded import first_failure
from gptoughts.training.checkpoint.staging import (
    HostStaging,
    all_plain,
    host_memory_available,
    local_tensors,
    stageable,
)

log = logging.getLogger("gptoughts.training")


class _BackgroundWriter:
    """What both savers share: host staging buffers kept across saves, one background thread (a pending write or
    the buffers' preparation) and its error, raised by :meth:`wait` in the caller's thread."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.staging = HostStaging()
        self.prepared = False
        """Whether ``prepare`` was called (the trainer calls it once, after the first step)."""
        self.blocked_s = 0.0
        """Seconds the caller was blocked by the last ``save`` (for the log and the benchmarks)."""

    @property
    def pending(self) -> bool:
        return self._thread is not None

    def wait(self) -> None:
        """Block until the pending write (if any) is on disk; raise its error as a :class:`UserError` (a full disk
        as an ``OSError(ENOSPC)``, which the caller reports with the last good checkpoint)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            full = as_disk_full(err)
            if full is not None:  # the same full disk as a synchronous save's, reported alike
                raise full from None
            raise UserError(str(err)) from None

    def _prepare_staging(self, layout: list[tuple[tuple[int, ...], torch.dtype]], gpu: int | None) -> None:
        """Allocate (and pin for ``gpu``) the buffers of ``layout`` in the background; a failure is ignored: the
        next save allocates (and reports a real error) itself. That save waits for it, as for a pending write."""

        def work() -> None:
            try:
                self.staging.prepare(layout, torch.device("cuda", gpu) if gpu is not None else None)
            except Exception:  # noqa: BLE001 - see the docstring
                pass

        self._thread = threading.Thread(target=work, name="checkpoint-staging")
        self._thread.start()

    def _write_in_background(self, step: int, write: Callable[[], None], source: torch.device | None) -> None:
        """Run ``write`` (which records its own error in ``_error``) in the saver's thread, then pin the staging
        buffers for ``source`` (after the first write, while training goes on: later saves copy at full speed)."""

        def work() -> None:
            write()
            try:
                self.staging.pin(source)
            except Exception:  # noqa: BLE001 - unpinned buffers are slower, not wrong
                pass

        # Not a daemon: the interpreter waits for it at exit, so a process never ends with a save in flight.
        self._thread = threading.Thread(target=work, name=f"checkpoint-step-{step}")
        self._thread.start()

    def close(self) -> None:
        """Wait for the pending write, then free the host staging buffers (a later save makes new ones)."""
        try:
            self.wait()
        finally:
            self.staging.close()


class FileSaver(_BackgroundWriter):
    """Writes single-file checkpoints (one process, or rank 0 of DDP) under ``root``, in the background where that
    pays: the state's tensors live on a GPU, ``background`` is on and the host has room for a copy.

    Training stops only while the state is copied to host buffers that the saver keeps from one save to the next
    (:class:`~.staging.HostStaging`, pinned after the first write); a thread then writes, hashes and renames the
    checkpoint (:func:`~.store.save`, the same files as a synchronous save), which would otherwise stop training
    for the whole write (docs/checkpoints.md). The next save, a rollback and the end of the run wait for a pending
    write (:meth:`wait`). Elsewhere (CPU runs, whose write would compete with
    training for the same cores; a host without the memory for one more copy of the state) it writes
    synchronously."""

    def __init__(self, root: str | Path, *, keep_last: int = 3, background: bool = True):
        super().__init__()
        self.root = Path(root)
        self.keep_last = keep_last
        self.background = background
        self.last_in_background = False
        """Whether the last :meth:`save` was written by the thread."""

    def _worth_it(self, weights: dict[str, torch.Tensor], state: Any) -> bool:
        """The background path: on, tensors on a GPU, all of them plain (:func:`~.staging.stageable`), and host
        memory for the staging copy plus one more copy of the weights (older safetensors copy them while writing),
        with 2 GiB to spare: a run killed by the OOM killer at a save would lose more than the write costs. Checked
        again whenever the state's layout changes (the buffers are then made anew)."""
        if not self.background:
            return False
        tensors = local_tensors((weights, state))[0]
        if not any(t.device.type == "cuda" for t in tensors) or not all_plain(tensors):
            return False
        if tuple((tuple(t.shape), t.dtype) for t in tensors) == self.staging.layout:
            return True  # the buffers of an earlier save or of prepare(): the room was there

        def nbytes(ts: list[torch.Tensor]) -> int:
            return sum(t.numel() * t.element_size() for t in ts)

        need = nbytes(tensors) + nbytes(local_tensors(weights)[0]) + 2 * 2**30
        free = host_memory_available()
        return free is not None and free + self.staging.nbytes >= need

    def prepare(self, weights: dict[str, torch.Tensor], state: dict[str, Any]) -> None:
        """Allocate and pin the host buffers of the saves of ``(weights, state)`` in a background thread, now
        rather than at the first save (whose copy would otherwise page-fault fresh memory at ~1 GB/s). A failure
        is ignored: that save allocates (and reports a real error) itself."""
        self.prepared = True
        if self._thread is None and self._worth_it(weights, state):
            gpu = next((t.device.index for t in local_tensors((weights, state))[0] if t.is_cuda), None)
            self._prepare_staging(HostStaging.layout_of((weights, state)), gpu)

    def _save_kwargs(
        self, weights_metadata: dict[str, str] | None, val_loss: float | None, is_best: bool, meta: Any
    ) -> dict[str, Any]:
        return dict(
            weights_metadata=weights_metadata, val_loss=val_loss, keep_last=self.keep_last, is_best=is_best,
            meta=meta,
        )  # fmt: skip

    def failed(self) -> bool:
        """Whether a background write has ended in an error not yet reported (cheap: no wait)."""
        thread = self._thread
        return self._error is not None and (thread is None or not thread.is_alive())

    def save(
        self,
        step: int,
        weights: dict[str, torch.Tensor],
        state: dict[str, Any],
        *,
        weights_metadata: dict[str, str] | None = None,
        val_loss: float | None = None,
        is_best: bool = False,
        meta: dict[str, Any] | None = None,
    ) -> None:
        """Write checkpoint ``step`` (``weights`` from :func:`~.store.weights_for_file`, ``state`` the trainer's).
        Waits for a pending write first; on return the caller may change every tensor of ``weights`` and
        ``state``."""
        t0 = time.perf_counter()
        try:
            self.wait()  # the previous write still reads the host buffers that this save refills
        except (UserError, OSError) as e:
            # That checkpoint is missing: this one is written now, here, so that nothing more is at risk (a disk
            # still full raises from it, as a synchronous save always did); training goes on if it succeeds.
            store.save(
                self.root,
                step,
                weights,
                state,
                **self._save_kwargs(weights_metadata, val_loss, is_best, meta),
            )
            log.warning("%s; step %d was written instead, without the background thread", e, step)
            self.blocked_s = time.perf_counter() - t0
            self.last_in_background = False
            return
        kwargs = self._save_kwargs(weights_metadata, val_loss, is_best, meta)
        staged = None
        if self._worth_it(weights, state):
            try:
                staged = self.staging.stage((weights, state))
            except Exception as e:  # noqa: BLE001 - the host ran short (or a leaf would not copy): write it here
                self.staging.close()
                self.background = False
                log.warning(
                    "checkpoints are written synchronously from now on: copy to host memory failed (%s)", e
                )
        self.last_in_background = staged is not None
        if staged is None:
            store.save(self.root, step, weights, state, **kwargs)
            self.blocked_s = time.perf_counter() - t0
            return
        host_weights, host_state = staged
        source = self.staging.device
        self.blocked_s = time.perf_counter() - t0

        def write() -> None:
            try:
                store.save(self.root, step, host_weights, host_state, **kwargs)
            except BaseException as e:  # noqa: BLE001 - reported by wait() in the caller's thread
                self._error = as_disk_full(e, folder=self.root) or RuntimeError(
                    f"checkpoint step {step} could not be written: {type(e).__name__}: {e}"
                )

        self._write_in_background(step, write, source)


class ShardedSaver(_BackgroundWriter):
    """Writes sharded checkpoints (every rank calls :meth:`save` with its own shards) under ``root``.

    ``async_save``: :meth:`save` returns once this rank's shards are copied to host buffers that the saver keeps
    from one save to the next (:class:`~.staging.HostStaging`); a background thread writes them (``dcp.save`` of
    the host copy), then finishes the checkpoint (hashes, meta.json, rename, best.json, rotation: see
    :mod:`.store`). Its collectives run over a gloo group of this saver's own, made at construction (a collective:
    every rank constructs it; collectives from a second thread need a CPU-capable group, which is also what
    ``dcp.async_save`` asks for). :meth:`wait` joins a pending save and raises its error, if any; :meth:`close`
    also frees the host buffers."""

    def __init__(self, root: str | Path, *, rank: int = 0, async_save: bool = True, keep_last: int = 3):
        import torch.distributed as dist

        super().__init__()
        self.root = Path(root)
        self.rank = rank
        self.async_save = async_save
        self.keep_last = keep_last
        self.group = dist.new_group(backend="gloo") if dist.is_available() and dist.is_initialized() else None
        # One process: DCP says so from its writer thread too, where no catch_warnings holds.
        if self.group is None:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninit")

    def prepare(self, state: dict[str, Any]) -> None:
        """Allocate and pin the host buffers the saves of ``state`` (:func:`~.sharded.sharded_state`) will use,
        in a background thread, now rather than at the first save, whose copy would otherwise page-fault fresh
        memory at ~1 GB/s while training waits (docs/checkpoints.md); into pinned buffers the copy runs at PCIe
        speed. The next :meth:`save` waits for it (as for a pending write). A failure is ignored: that save
        allocates (and reports a real error) itself."""
        self.prepared = True
        if not self.async_save or self._thread is not None:
            return
        gpu = (
            torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        )
        self._prepare_staging(HostStaging.layout_of(state), gpu)

    def _broadcast(self, obj: Any) -> Any:
        if self.group is None:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        return box[0]

    def _gather(self, obj: Any) -> list[Any]:
        if self.group is None:
            return [obj]
        import torch.distributed as dist

        out = [None] * dist.get_world_size(self.group) if self.rank == 0 else None
        dist.gather_object(obj, out, dst=dist.get_global_rank(self.group, 0), group=self.group)
        return out or []

    def save(
        self,
        step: int,
        state: dict[str, Any],
        trainer_state: dict[str, Any] | None,
        *,
        val_loss: float | None = None,
        is_best: bool = False,
        meta: dict[str, Any] | None = None,
    ) -> None:
        """Write checkpoint ``step``: ``state`` from :func:`~.sharded.sharded_state` (each rank its own),
        ``trainer_state`` (rank 0's; saved as state.pt). Waits for a pending save first."""
        import torch.distributed.checkpoint as dcp

        t0 = time.perf_counter()
        self.wait()  # the previous write still reads the host buffers that this save refills
        staged, error = None, None
        # torchao's 8-bit optimizer states are wrapper tensors host staging cannot copy: written synchronously
        background = self.async_save and stageable(state)
        if background:
            try:
                staged = self.staging.stage(state)
            except Exception as e:  # noqa: BLE001 - every rank must learn of it, or the others wait in dcp.save
                error = f"rank {self.rank}: copy to host memory failed: {type(e).__name__}: {e}"
        errors = [e for e in self._gather(error) if e]
        tmp_name = None
        if self.rank == 0:
            tmp_name, error = self._make_tmp(step, trainer_state, errors)
        tmp_name, error = self._broadcast((tmp_name, error))
        if error is not None:  # a full disk as an OSError(ENOSPC), as the other writers report it
            raise as_disk_full(RuntimeError(error)) or UserError(error)
        tmp = self.root / tmp_name
        done = functools.partial(self._finish, tmp, step, val_loss=val_loss, is_best=is_best, meta=meta)
        if not background:
            try:
                with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
                    warnings.filterwarnings("ignore", message=".*single process.*")
                    dcp.save(state, checkpoint_id=str(tmp), process_group=self.group)
            except BaseException as e:  # noqa: BLE001 - CheckpointException is a BaseException
                self._error = e
            done()
            self.blocked_s = time.perf_counter() - t0
            self.wait()
            return
        source = self.staging.device  # the GPU the shards came from (None: host tensors, nothing to pin for)
        gpu = (
            torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        )
        self.blocked_s = time.perf_counter() - t0

        def write() -> None:
            if gpu is not None:  # DCP's writer uses the current stream: this rank's GPU, not GPU 0
                torch.cuda.set_device(gpu)
            try:  # what dcp.async_save's thread does, on our host copy (async_save would copy it once more)
                dcp.save(staged, checkpoint_id=str(tmp), process_group=self.group)
            except BaseException as e:  # noqa: BLE001 - reported by wait() in the caller's thread
                self._error = e
            done()

        self._write_in_background(step, write, source)

    def _make_tmp(
        self, step: int, trainer_state: dict[str, Any] | None, errors: list[str]
    ) -> tuple[str | None, str | None]:
        """Rank 0's start of a save: the checkpoint's temp dir under ``root``, holding ``state.pt``. Returns its
        name, or the error (``errors``: the ranks' staging failures) that every rank then raises."""
        tmp_name = None
        try:
            if errors:
                raise OSError("; ".join(errors))
            self.root.mkdir(parents=True, exist_ok=True)
            store.recover(self.root)
            tmp_name = f".tmp-step_{step:06d}-{os.getpid()}-{time.monotonic_ns()}"
            (self.root / tmp_name).mkdir()
            torch.save(trainer_state, self.root / tmp_name / store.STATE_FILE)
        except Exception as e:  # noqa: BLE001 - every rank must learn of it, not only rank 0
            if tmp_name is not None:
                shutil.rmtree(self.root / tmp_name, ignore_errors=True)
            if store.interrupted(e):  # a second Ctrl-C inside torch.save (see store.save): the run stops here
                raise KeyboardInterrupt from None
            return None, f"checkpoint step {step} could not be written: {_failure(e, self.root)}"
        return tmp_name, None

    def _finish(
        self,
        tmp: Path,
        step: int,
        *,
        val_loss: float | None,
        is_best: bool,
        meta: dict[str, Any] | None,
    ) -> None:
        """Every rank hashes the shard files it wrote; rank 0 gathers the hashes, writes meta.json last and
        renames the dir into place, and every rank learns the outcome."""
        mine: dict[str, Any] | str
        if self._error is not None:
            mine = f"rank {self.rank}: {_failure(first_failure(self._error), tmp)}"
        else:
            try:
                mine = {
                    f.name: store.file_record(f, fsync=False)
                    for f in sorted(tmp.glob(f"__{self.rank}_*.distcp"))
                }
            except OSError as e:
                mine = f"rank {self.rank}: {e}"
        gathered = self._gather(mine)
        status = None
        if self.rank == 0:
            problems = [g for g in gathered if isinstance(g, str)]
            try:
                if problems:
                    raise OSError("; ".join(problems))
                files: dict[str, Any] = {}
                for g in gathered:
                    files.update(g)
                for name in (store.DCP_METADATA, store.STATE_FILE):
                    files[name] = store.file_record(tmp / name)
                world = len(gathered)
                store.commit(
                    self.root,
                    tmp,
                    step,
                    files,
                    val_loss=val_loss,
                    meta={**(meta or {}), "format": store.DCP_FORMAT, "world_size": world},
                    is_best=is_best,
                    keep_last=self.keep_last,
                )
            except BaseException as e:  # noqa: BLE001 - every rank must learn of it
                status = f"checkpoint step {step} could not be written: {_failure(e, tmp)}"
                shutil.rmtree(tmp, ignore_errors=True)
        status = self._broadcast(status)
        self._error = RuntimeError(status) if status is not None else None


def _failure(e: BaseException, folder: Path) -> str:
    """``e`` as one line of text that crosses ranks: a full disk as Python's "[Errno 28] ..." (which
    :func:`~gptoughts.errors.as_disk_full` reads back), else its type and first line."""
    full = as_disk_full(e, folder=folder)
    if full is not None:
        return str(full)
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
