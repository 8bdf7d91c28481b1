"""Batches of token windows from prepared shards: deterministic, resumable, rank-aware, prefetched.

* One global stream of ``block_size + 1`` windows, a function of the seed: row ``g`` picks its source by a
  hash of ``(seed, g)`` and the next window of that source's per-epoch permutation; rank ``r`` keeps rows
  ``[r*B, (r+1)*B)`` of each global batch, so any world size reads the single-process stream.
* ``state_dict()``: plain-int counters of the batches the caller received (not those prefetched): exact
  resume, also under another batch size or world size.
* Each batch's largest id is checked against the vocabulary on the host: a damaged shard is a DataError.
* A daemon thread gathers rows into pinned memory ``prefetch`` batches ahead; one ``non_blocking`` copy each.

The stream, the state and the threading in full: ``docs/data.md``. SFT data has its own loader with this
interface: :class:`gptoughts.data.sft.SFTLoader`.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import queue
import threading
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gptoughts.data.manifest import Manifest, SourceInfo
from gptoughts.errors import ConfigError, DataError, did_you_mean

log = logging.getLogger("gptoughts.data")
_WARNED: set[tuple[str, int, int]] = set()  # (dataset, source, block) already warned of: once per process

STATE_VERSION = 1
_U64 = np.uint64


# --------------------------------------------------------------------------------------------- dataset


class TokenDataset:
    """A prepared folder, with every shard memory-mapped read-only (nothing is loaded up front).

    Opening checks that every shard is present with the size the manifest records (stats only). Checksums
    are not read here (that reads every shard, on every start): ``prepare``/``cached_prepare`` verify them
    before reusing a folder, :meth:`Manifest.verify` does on demand, and the loaders check every batch's ids
    against the vocabulary.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.dir = Path(directory)
        self.manifest = Manifest.load(self.dir)
        self.manifest.check_files()
        self.dtype = np.dtype(self.manifest.dtype)
        self._shards: dict[tuple[str, int], list[np.ndarray]] = {}
        self._paths: dict[tuple[str, int], list[Path]] = {}
        for s in self.manifest.sources:
            for split in ("train", "val"):
                paths = [self.dir / name for name in getattr(s, f"{split}_shards")]
                self._paths[(split, s.index)] = paths
                self._shards[(split, s.index)] = [np.memmap(p, dtype=self.dtype, mode="r") for p in paths]

    @property
    def sources(self) -> list[SourceInfo]:
        return self.manifest.sources

    @property
    def vocab_size(self) -> int:
        return self.manifest.vocab_size

    @property
    def eos_id(self) -> int:
        return self.manifest.eos_id

    def shards(self, split: str, source: int) -> list[np.ndarray]:
        if split not in ("train", "val"):
            raise ConfigError(f"split must be 'train' or 'val'; got {split!r}")
        return self._shards[(split, source)]

    def shard_paths(self, split: str, source: int) -> list[Path]:
        """The files behind :meth:`shards`, in the same order."""
        self.shards(split, source)
        return self._paths[(split, source)]

    def check_ids(self, batch: np.ndarray, where: list[Path]) -> None:
        """DataError when ``batch`` (rows of ids, ``where[r]`` the shard of row ``r``) holds an id outside
        the vocabulary: a damaged or foreign shard, caught on the host before it indexes the embedding."""
        if batch.size == 0 or int(batch.max()) < self.vocab_size:
            return
        row = int(np.flatnonzero(batch.reshape(len(where), -1).max(axis=1) >= self.vocab_size)[0])
        bad = int(batch.reshape(len(where), -1)[row].max())
        raise DataError(
            f"{where[row]} holds token id {bad}, outside the vocabulary of {self.vocab_size} (a damaged or "
            f"foreign shard); delete the prepared folder {self.dir} and prepare again"
        )

    def num_tokens(self, split: str, source: int | None = None) -> int:
        """Tokens of a split, in one source or all."""
        idx = range(len(self.sources)) if source is None else [source]
        return sum(a.size for i in idx for a in self.shards(split, i))

    def longest_window(self, split: str, block_size: int) -> int:
        """The longest window of at most ``block_size`` tokens (plus its shifted target) that the split holds:
        ``block_size`` unless every shard is shorter (windows never cross shard files); 0 when none."""
        longest = max((a.size for i in range(len(self.sources)) for a in self.shards(split, i)), default=0)
        return max(0, min(block_size, longest - 1))

    def source_index(self, ref: str | int) -> int:
        """A source by index, by the path as given to prepare, by its resolved path or by its file name."""
        n = len(self.sources)
        if isinstance(ref, (int, np.integer)) and not isinstance(ref, bool):
            if 0 <= ref < n:
                return int(ref)
            raise ConfigError(f"source index {ref} is out of range; the dataset has {n} source(s)")
        ref_s = str(ref)
        for s in self.sources:
            if ref_s in (s.given, s.path):
                return s.index
        try:
            resolved = str(Path(ref_s).expanduser().resolve())
        except OSError:
            resolved = ref_s
        for s in self.sources:
            if resolved == s.path or ref_s == Path(s.path).name:
                return s.index
        raise ConfigError(
            f"unknown data source {ref_s!r}{did_you_mean(ref_s, [s.given for s in self.sources])}"
        )


def windows_in(sizes: Sequence[int], block_size: int) -> np.ndarray:
    """Windows of ``block_size + 1`` tokens, at a stride of ``block_size``, in each shard of these sizes: what the
    loader draws (windows never cross shard files, so each shard's tail shorter than a window is never drawn)."""
    return np.maximum(0, (np.asarray(sizes, dtype=np.int64) - 1) // block_size)


def epoch_windows(
    dataset: TokenDataset | str | os.PathLike[str], block_size: int, split: str = "train"
) -> int:
    """Windows in one pass over every source of ``split``: :attr:`BatchLoader.windows_per_epoch` before a loader is
    made (what a plan counts its epochs in)."""
    ds = dataset if isinstance(dataset, TokenDataset) else TokenDataset(dataset)
    return sum(
        int(windows_in([a.size for a in ds.shards(split, s.index)], block_size).sum()) for s in ds.sources
    )


class _Windows:
    """Window ``w`` of one (split, source) -> (shard, offset): windows never cross shard files."""

    def __init__(self, shards: list[np.ndarray], block_size: int, paths: list[Path]) -> None:
        self.shards = shards
        self.paths = paths
        self.block_size = block_size
        counts = windows_in([a.size for a in shards], block_size)
        self.count = int(counts.sum())
        self._starts = np.concatenate([[0], np.cumsum(counts)])  # first window index of each shard

    def locate(self, windows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        shard = np.searchsorted(self._starts, windows, side="right") - 1
        return shard, (windows - self._starts[shard]) * self.block_size


def fewer_than_a_block(
    n_tokens: int, split: str, block_size: int, name: str | None = None, *, at_most: bool = False
) -> DataError:
    """The refusal of a corpus (or source ``name``) of fewer tokens than one block (``at_most``: a dry run's bound
    on the tokens, not their count)."""
    what = f"source {name}" if name else "corpus"
    return DataError(
        f"{what} has {'at most ' if at_most else ''}{n_tokens} {split} tokens, fewer than one block of "
        f"block_size+1 = {block_size + 1}; use a smaller --block_size or more data"
    )


def no_block(
    phase: str | None,
    block_size: int,
    tokens: list[tuple[str, int]],
    split: str = "train",
    *,
    at_most: bool = False,
) -> DataError:
    """The refusal of a curriculum phase (None: the whole corpus) none of whose sources holds one block: a block
    never spans two sources, so the phase has nothing to draw (``at_most``: a dry run's bound on the tokens)."""
    what = "the corpus" if phase is None else f"curriculum phase {phase!r}"
    counts = ", ".join(f"{name} {'at most ' if at_most else ''}{n:,}" for name, n in tokens)
    return DataError(
        f"{what} has no source of one block of block_size+1 = {block_size + 1} tokens (a block never spans two "
        f"sources; {split} tokens: {counts}); use a smaller --block_size, or join the sources"
    )


def _warn_never_drawn(ds: TokenDataset, windows: list[_Windows], ids: list[int]) -> None:
    """A warning naming the sources too short for one block: weighted by their windows, they are never drawn."""
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return  # every rank finds the same: said once, by rank 0
    for i in ids:
        if (key := (str(ds.dir), i, windows[i].block_size)) in _WARNED:
            continue
        _WARNED.add(key)
        log.warning(
            "source %s has %d train tokens, fewer than one block of block_size+1 = %d: it is never drawn; use a "
            "smaller --block_size, or join it to another source",
            ds.sources[i].given, ds.num_tokens("train", i), windows[i].block_size + 1,
        )  # fmt: skip


# --------------------------------------------------------------------------------------------- phases


@dataclass
class Phase:
    """A curriculum phase: which sources, with which weights, for how many (global) tokens.

    ``sources`` holds ``(source, weight)`` pairs, or bare sources meaning "proportional to their train
    tokens"; a source is an index or a path as given to prepare. ``tokens=None``: until training ends
    (only the last phase may say so; the last phase also continues past its budget).
    """

    name: str
    sources: Sequence[tuple[str | int, float] | str | int]
    tokens: int | None = None


@dataclass
class _ResolvedPhase:
    name: str
    source_ids: np.ndarray  # int64 [k]
    cum_weights: np.ndarray  # float64 [k], last == 1.0
    end_tokens: float  # cumulative budget end (inf for the last phase)


def check_drawable(
    dataset: str | Path | TokenDataset, phases: Sequence[Phase] | None, block_size: int, split: str = "train"
) -> None:
    """What a :class:`BatchLoader` of ``dataset`` refuses (no block to draw from the corpus, a phase or a source it
    weights), said before a run writes anything: by its plan, a dry run's included."""
    _drawable(
        dataset if isinstance(dataset, TokenDataset) else TokenDataset(dataset), split, block_size, phases
    )


def _drawable(
    ds: TokenDataset, split: str, block_size: int, phases: Sequence[Phase] | None
) -> tuple[list[_Windows], list[_ResolvedPhase]]:
    windows = [
        _Windows(ds.shards(split, s.index), block_size, ds.shard_paths(split, s.index)) for s in ds.sources
    ]
    if ds.num_tokens(split) < block_size + 1:  # (sources of fewer tokens each: said by the phase, below)
        raise fewer_than_a_block(ds.num_tokens(split), split, block_size)
    return windows, _resolve_phases(phases, ds, windows, split)


def _resolve_phases(
    phases: Sequence[Phase] | None, ds: TokenDataset, windows: list[_Windows], split: str
) -> list[_ResolvedPhase]:
    whole = not phases
    if not phases:
        phases = [Phase("all", list(range(len(ds.sources))))]
    out: list[_ResolvedPhase] = []
    end = 0.0
    for k, ph in enumerate(phases):
        if not ph.sources:
            raise ConfigError(f"phase {ph.name!r} lists no sources; give it at least one")
        pairs = [p if isinstance(p, tuple) else (p, None) for p in ph.sources]
        if len({w is None for _, w in pairs}) > 1:
            raise ConfigError(f"phase {ph.name!r} gives weights to some sources only; weight all or none")
        ids = [ds.source_index(ref) for ref, _ in pairs]
        if len(set(ids)) != len(ids):
            raise ConfigError(f"phase {ph.name!r} lists a source twice; list each source once")
        if pairs[0][1] is None:  # proportional to the tokens each source can give
            weights = [float(windows[i].count) for i in ids]
            if not sum(weights):  # nothing to draw from: its batches would divide by zero
                raise no_block(
                    None if whole else ph.name,
                    windows[ids[0]].block_size,
                    [(ds.sources[i].given, ds.num_tokens(split, i)) for i in ids],
                    split,
                )
            if split == "train":
                _warn_never_drawn(
                    ds, windows, [i for i in ids if not windows[i].count and ds.num_tokens(split, i)]
                )
        else:
            weights = [float(w) for _, w in pairs]  # type: ignore[arg-type]
            if any(not math.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
                raise ConfigError(
                    f"phase {ph.name!r} weights must be >= 0 with a positive sum; got {weights}"
                )
        for i, w in zip(ids, weights):
            if w > 0 and windows[i].count == 0:
                s = ds.sources[i]
                n = ds.num_tokens(split, i)
                raise fewer_than_a_block(
                    n, split, windows[i].block_size, None if len(ds.sources) == 1 else s.given
                )
        if ph.tokens is None and k != len(phases) - 1:
            raise ConfigError(f"phase {ph.name!r} has no token budget but is not the last; give it tokens=N")
        if ph.tokens is not None and ph.tokens <= 0:
            raise ConfigError(f"phase {ph.name!r} token budget must be positive; got {ph.tokens}")
        end = math.inf if ph.tokens is None or k == len(phases) - 1 else end + ph.tokens
        w = np.asarray(weights, dtype=np.float64)
        cum = np.cumsum(w / w.sum())
        cum[-1] = 1.0  # exact, so a draw in [0, 1) always lands in a bucket
        out.append(_ResolvedPhase(ph.name, np.asarray(ids, dtype=np.int64), cum, end))
    return out


# --------------------------------------------------------------------------------------------- sampling


def _seed64(*parts: int | str) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little")


def _uniform(key: int, rows: np.ndarray) -> np.ndarray:
    """splitmix64 of (key, row) -> uniform [0, 1): a counter-based RNG, so the state is just the row."""
    with np.errstate(over="ignore"):
        z = rows.astype(_U64) * _U64(0x9E3779B97F4A7C15) + _U64(key)
        z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
        z = z ^ (z >> _U64(31))
    return (z >> _U64(11)).astype(np.float64) * (1.0 / (1 << 53))


@dataclass
class _State:
    rows: int  # global rows consumed (all ranks)
    source_rows: list[int]  # windows consumed per source (all ranks)


class _Producer:
    """Builds batch after batch from a state; holds no reference to the BatchLoader (so it can be freed)."""

    def __init__(
        self,
        dataset: TokenDataset,
        windows: list[_Windows],
        phases: list[_ResolvedPhase],
        *,
        seed: int,
        batch_size: int,
        block_size: int,
        rank: int,
        world_size: int,
        pin: bool,
    ) -> None:
        self.dataset, self.windows, self.phases = dataset, windows, phases
        self.seed, self.B, self.T = seed, batch_size, block_size
        self.rank, self.W = rank, world_size
        self.pin = pin
        self._row_key = _seed64("rows", seed)
        self._perms: dict[int, tuple[int, np.ndarray]] = {}  # source -> (epoch, permutation)

    def phase_at(self, rows: int) -> _ResolvedPhase:
        tokens = rows * self.T
        return next((p for p in self.phases if tokens < p.end_tokens), self.phases[-1])

    def _perm(self, source: int, epoch: int) -> np.ndarray:
        cached = self._perms.get(source)
        if cached is None or cached[0] != epoch:
            rng = np.random.default_rng([self.seed, source, epoch])
            cached = (epoch, rng.permutation(self.windows[source].count))
            self._perms[source] = cached
        return cached[1]

    def plan(self, state: _State) -> tuple[list[tuple[int, int]], _State]:
        """(source, window) of this rank's rows of the next global batch, and the state after it."""
        gb = self.B * self.W
        phase = self.phase_at(state.rows)
        if len(phase.source_ids) == 1:
            src = np.full(gb, phase.source_ids[0], dtype=np.int64)
        else:
            u = _uniform(self._row_key, np.arange(state.rows, state.rows + gb, dtype=np.int64))
            src = phase.source_ids[np.searchsorted(phase.cum_weights, u, side="right")]
        # k-th row of a source in this batch takes that source's (counter + k)-th window of the stream.
        counter = np.empty(gb, dtype=np.int64)
        new_rows = list(state.source_rows)
        for s in np.unique(src):
            idx = np.flatnonzero(src == s)
            counter[idx] = state.source_rows[s] + np.arange(idx.size)
            new_rows[s] += idx.size
        lo, hi = self.rank * self.B, (self.rank + 1) * self.B
        out = []
        for s, c in zip(src[lo:hi].tolist(), counter[lo:hi].tolist()):
            n = self.windows[s].count
            out.append((s, int(self._perm(s, c // n)[c % n])))
        return out, _State(state.rows + gb, new_rows)

    def make(self, state: _State) -> tuple[torch.Tensor, _State]:
        rows, nxt = self.plan(state)
        T = self.T
        # x and y packed in one [2, B, T] buffer: one pinned allocation and one host-to-device copy, and both
        # halves are contiguous views on the device.
        buf = torch.empty((2, self.B, T), dtype=torch.int64, pin_memory=self.pin)
        view = buf.numpy()
        where: list[Path] = []
        for i, (s, w) in enumerate(rows):
            win = self.windows[s]
            shard, off = win.locate(np.array([w]))
            k, o = int(shard[0]), int(off[0])
            seq = win.shards[k][o : o + T + 1]  # memmap slice: reads from disk
            view[0, i] = seq[:-1]  # the uint16 -> int64 cast happens inside this copy
            view[1, i] = seq[1:]
            where.append(win.paths[k])
        # x holds every id of a row but its last target: check x and y's last column (y[:, :-1] == x[:, 1:]).
        self.dataset.check_ids(view[0], where)
        self.dataset.check_ids(view[1][:, -1:], where)
        return buf, nxt


# --------------------------------------------------------------------------------------------- thread


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def _produce_loop(
    producer: _Producer, state: _State, q: queue.Queue, stop: threading.Event, device: torch.device
) -> None:
    try:
        if device.type == "cuda":
            # A new thread starts on cuda:0; pinned allocations would create a context (and ~500 MB) on
            # GPU 0 for every rank. Bind the thread to this rank's device first.
            torch.cuda.set_device(device)
        while not stop.is_set():
            item = producer.make(state)
            state = item[1]
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.1)  # bounded wait: close() is honoured within 0.1 s
                    break
                except queue.Full:
                    continue
    except BaseException as e:  # propagated to the consumer, which re-raises it
        while not stop.is_set():
            try:
                q.put(_Failure(e), timeout=0.1)
                break
            except queue.Full:
                continue


def _shutdown(stop: threading.Event, q: queue.Queue, thread: threading.Thread) -> None:
    stop.set()
    while True:  # unblock a producer waiting on a full queue
        try:
            q.get_nowait()
        except queue.Empty:
            break
    if thread.is_alive() and thread is not threading.current_thread():
        thread.join(timeout=5.0)


# --------------------------------------------------------------------------------------------- loader


class BatchLoader:
    """An endless iterator of ``(x, y)`` int64 ``[batch_size, block_size]`` batches (``y`` = ``x`` shifted).

    The stream, the state and the threading: the module docstring and ``docs/data.md``. Use as a context
    manager or call :meth:`close`; the prefetch thread is a daemon and is also stopped at interpreter exit.
    """

    def __init__(
        self,
        dataset: TokenDataset | str | os.PathLike[str],
        *,
        split: str = "train",
        batch_size: int,
        block_size: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        phases: Sequence[Phase] | None = None,
        device: str | torch.device = "cpu",
        prefetch: int = 4,
        pin_memory: bool | None = None,
    ) -> None:
        ds = dataset if isinstance(dataset, TokenDataset) else TokenDataset(dataset)
        if batch_size < 1 or block_size < 1:
            raise ConfigError(f"batch_size and block_size must be >= 1; got {batch_size} and {block_size}")
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank must be in [0, world_size={world_size}); got {rank}")
        if seed < 0:
            raise ConfigError(f"the data seed must be >= 0; got {seed}")
        if prefetch < 0:
            raise ConfigError(f"prefetch must be >= 0; got {prefetch}")
        self.dataset = ds
        self.split = split
        self.batch_size, self.block_size, self.seed = batch_size, block_size, seed
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            # Resolve "cuda" here: in the prefetch thread it would mean cuda:0, whatever this rank uses.
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.prefetch = prefetch
        self.pin_memory = self.device.type == "cuda" if pin_memory is None else pin_memory
        self._windows, self._phases = _drawable(ds, split, block_size, phases)
        self._producer = _Producer(
            ds,
            self._windows,
            self._phases,
            seed=seed,
            batch_size=batch_size,
            block_size=block_size,
            rank=rank,
            world_size=world_size,
            pin=self.pin_memory,
        )
        self._state = _State(0, [0] * len(ds.sources))  # what the caller has consumed
        self._thread: threading.Thread | None = None
        self._queue: queue.Queue | None = None
        self._stop: threading.Event | None = None
        self._finalizer: Any = None

    # ------------------------------------------------------------------------------------- iteration

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.prefetch == 0:
            buf, state = self._producer.make(self._state)
        else:
            if self._thread is None:
                self._start()
            assert self._queue is not None and self._thread is not None
            while True:
                try:
                    item = self._queue.get(timeout=1.0)
                    break
                except queue.Empty:
                    if not self._thread.is_alive():  # died without reporting: never wait forever
                        self.close()
                        raise RuntimeError("the batch prefetch thread stopped unexpectedly") from None
            if isinstance(item, _Failure):
                self.close()
                raise item.exc
            buf, state = item
        self._state = state
        if self.device.type != "cpu":
            # Asynchronous copy from pinned memory; ordered on the current stream before the model reads it.
            buf = buf.to(self.device, non_blocking=True)
        return buf[0], buf[1]

    def _start(self) -> None:
        self._queue = queue.Queue(maxsize=self.prefetch)
        self._stop = threading.Event()
        state = _State(self._state.rows, list(self._state.source_rows))
        self._thread = threading.Thread(
            target=_produce_loop,
            args=(self._producer, state, self._queue, self._stop, self.device),
            name="gptoughts-batch-prefetch",
            daemon=True,
        )
        self._thread.start()
        # Stops the thread when the loader is garbage-collected or at interpreter exit, whichever first.
        self._finalizer = weakref.finalize(self, _shutdown, self._stop, self._queue, self._thread)

    def close(self) -> None:
        """Stop the prefetch thread (a later ``next()`` restarts it from the consumed state)."""
        if self._finalizer is not None:
            self._finalizer()
        self._thread = self._queue = self._stop = self._finalizer = None

    def __enter__(self) -> BatchLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        """Plain ints/strings/lists describing the batches consumed so far (``weights_only``-loadable)."""
        return {
            "version": STATE_VERSION,
            "split": self.split,
            "seed": int(self.seed),
            "block_size": int(self.block_size),
            "batch_size": int(self.batch_size),
            "world_size": int(self.world_size),
            "rows": int(self._state.rows),
            "source_rows": [int(c) for c in self._state.source_rows],
            "sources": [s.given for s in self.dataset.sources],
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Continue exactly after the batches described by ``sd`` (from :meth:`state_dict`)."""
        if sd.get("version") != STATE_VERSION:
            raise ConfigError(
                f"loader state version {sd.get('version')} is not {STATE_VERSION}; start the data anew"
            )
        for key in ("seed", "block_size", "split"):
            if sd[key] != getattr(self, key):
                raise ConfigError(
                    f"the checkpoint's data loader used {key}={sd[key]!r}, this run {getattr(self, key)!r}; "
                    f"resume with the same {key}"
                )
        if len(sd["source_rows"]) != len(self.dataset.sources):
            raise ConfigError(
                f"the checkpoint's data had {len(sd['source_rows'])} source(s), this run "
                f"{len(self.dataset.sources)}; resume with the same data sources"
            )
        self.close()  # drop batches prefetched from the old position
        self._state = _State(int(sd["rows"]), [int(c) for c in sd["source_rows"]])

    # ------------------------------------------------------------------------------------- progress

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.world_size

    @property
    def tokens_consumed(self) -> int:
        """Tokens consumed by all ranks together (rows x block_size)."""
        return self._state.rows * self.block_size

    @property
    def windows_per_epoch(self) -> int:
        """Windows in one pass over every source (all ranks together)."""
        return sum(w.count for w in self._windows)

    @property
    def epoch(self) -> float:
        """Windows consumed / windows per epoch (per source: ``source_epochs``)."""
        return sum(self._state.source_rows) / self.windows_per_epoch

    @property
    def source_epochs(self) -> list[float]:
        return [c / w.count if w.count else 0.0 for c, w in zip(self._state.source_rows, self._windows)]

    @property
    def phase_name(self) -> str:
        """The phase the next batch is drawn from."""
        return self._producer.phase_at(self._state.rows).name


# --------------------------------------------------------------------------------------------- eval


def eval_batches(
    dataset: TokenDataset | str | os.PathLike[str],
    *,
    split: str = "val",
    batch_size: int,
    block_size: int,
    max_batches: int | None,
    device: str | torch.device = "cpu",
    source: str | int | None = None,
    rank: int = 0,
    world_size: int = 1,
    whole: bool = False,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The same fixed batches on every call: windows evenly spread over the split (all sources, or one).

    Full batches only (static shapes for compiled models), unless the split holds fewer windows than
    ``batch_size`` (then one smaller batch). With ``world_size > 1`` the batches are dealt round-robin and
    their number is rounded down to a multiple of ``world_size`` so every rank runs the same count. ``whole``
    (one process, no ``max_batches``): every window, the last batch holding what is left (`gptoughts eval`).
    """
    ds = dataset if isinstance(dataset, TokenDataset) else TokenDataset(dataset)
    ids = [s.index for s in ds.sources] if source is None else [ds.source_index(source)]
    wins = [_Windows(ds.shards(split, i), block_size, ds.shard_paths(split, i)) for i in ids]
    per_shard = [(w, k, c) for w in wins for k, c in enumerate(np.diff(w._starts).tolist()) if c]
    total = sum(c for _, _, c in per_shard)
    if total == 0:
        n_tok = sum(ds.num_tokens(split, i) for i in ids)
        raise fewer_than_a_block(n_tok, split, block_size)
    if whole and max_batches is None and world_size == 1:
        n_batches, rows_per = -(-total // batch_size), batch_size
    elif total < batch_size:
        n_batches, rows_per = 1, total
    else:
        n_batches = total // batch_size if max_batches is None else min(max_batches, total // batch_size)
        if world_size > 1 and n_batches >= world_size:
            n_batches -= n_batches % world_size
        rows_per = batch_size
    n = min(n_batches * rows_per, total)
    picks = (np.arange(n, dtype=np.int64) * total) // n  # evenly spread, distinct since total >= n
    starts = np.cumsum([0] + [c for _, _, c in per_shard])
    dev = torch.device(device)
    pin = dev.type == "cuda"
    for b in range(rank, n_batches, world_size):
        rows = picks[b * rows_per : (b + 1) * rows_per].tolist()
        buf = torch.empty((2, len(rows), block_size), dtype=torch.int64, pin_memory=pin)
        view = buf.numpy()
        where: list[Path] = []
        for i, g in enumerate(rows):
            k = int(np.searchsorted(starts, g, side="right") - 1)
            w, shard, _ = per_shard[k]
            off = (g - int(starts[k])) * block_size
            seq = w.shards[shard][off : off + block_size + 1]
            view[0, i] = seq[:-1]
            view[1, i] = seq[1:]
            where.append(w.paths[shard])
        ds.check_ids(view[0], where)
        ds.check_ids(view[1][:, -1:], where)
        if dev.type != "cpu":
            buf = buf.to(dev, non_blocking=True)
        yield buf[0], buf[1]
