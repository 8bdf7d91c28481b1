"""Pass 2 of prepare: tokenise each source's documents in batches and append them to its shard files.

* Each document is written as ``[bos] + tokens + [eos]`` (bos only when distinct from eos); a shard holds at
  most ``shard_tokens`` tokens and a document may straddle two.
* ``workers`` processes tokenise while the parent reads, labels (by the pass-1 :class:`Plan`) and writes;
  results are written in submission order, so the shards are byte-identical for any worker count.
* Each shard's crc32 is computed on its bytes as they are written; a checkpoint (every
  :data:`_CHECKPOINT_CHARS` characters, and whenever a shard fills) records what is durable, so an
  interrupted build goes on from it (:func:`shards_intact` checks the files first).
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gptoughts.data.manifest import crc32_file
from gptoughts.data.split import Plan, Reader, changed_while_prepared
from gptoughts.data.tokenizer import Tokenizer
from gptoughts.errors import DataError

# Text per batch (one worker's unit of work): large enough that sending it to a worker costs little next to
# tokenising it, small enough that the 2 * workers batches in flight (and the library's encodings of one in
# each worker) keep memory small.
_ENCODE_BATCH_BYTES = 4 << 20
_ENCODE_BATCH_DOCS = 8192
# An interrupted build redoes at most this much tokenising: a checkpoint is written every _CHECKPOINT_CHARS
# characters of text and whenever a shard fills.
_CHECKPOINT_CHARS = 64 << 20


class ShardWriter:
    """Appends token arrays to ``<prefix>_<k>.bin`` files of at most ``max_tokens`` tokens each, computing
    each file's crc32 on the bytes as they are written (no second pass over the shards).

    :meth:`state` is what a resumed build needs to go on writing (:meth:`restore`): the closed files with
    their checksums, and how many tokens of the open one (and their running crc) are durable."""

    def __init__(self, directory: Path, prefix: str, dtype: np.dtype, max_tokens: int) -> None:
        self.directory, self.prefix, self.dtype, self.max_tokens = directory, prefix, dtype, max_tokens
        self.files: list[str] = []
        self.checksums: list[str] = []
        self.tokens = 0
        self._f: Any = None
        self._in_file = 0
        self._crc = 0

    def write(self, arr: np.ndarray) -> int:
        """Append ``arr``; returns how many files it filled (and closed)."""
        arr = np.ascontiguousarray(arr, dtype=self.dtype)
        closed = 0
        while arr.size:
            if self._f is None:
                name = f"{self.prefix}_{len(self.files)}.bin"
                self.files.append(name)
                self._f = open(self.directory / name, "wb")
                self._in_file = 0
                self._crc = 0
            part = arr[: self.max_tokens - self._in_file]
            part.tofile(self._f)
            self._crc = zlib.crc32(part, self._crc)
            self._in_file += part.size
            self.tokens += part.size
            arr = arr[part.size :]
            if self._in_file >= self.max_tokens:
                self._close_file()
                closed += 1
        return closed

    def sync(self) -> None:
        """Make what was written so far durable (before a checkpoint records it)."""
        if self._f is not None:
            self._f.flush()
            os.fsync(self._f.fileno())

    def state(self) -> dict[str, Any]:
        return {
            "files": list(self.files),
            "checksums": list(self.checksums),
            "tokens": self.tokens,
            "in_file": self._in_file if self._f is not None else 0,
            "crc": f"{self._crc:08x}" if self._f is not None else "00000000",
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Go on from ``state`` (checked by :func:`shards_intact`): the open file is cut back to its recorded size
        (a killed build may have written past its last checkpoint)."""
        self.files, self.checksums = list(state["files"]), list(state["checksums"])
        self.tokens = state["tokens"]
        if len(self.files) > len(self.checksums):
            self._in_file = state["in_file"]
            self._crc = int(state["crc"], 16)
            self._f = open(self.directory / self.files[-1], "r+b")
            self._f.truncate(self._in_file * self.dtype.itemsize)
            self._f.seek(0, os.SEEK_END)

    def _close_file(self) -> None:
        if self._f is not None:
            self._f.flush()
            os.fsync(self._f.fileno())  # durable before the folder is renamed into place
            self._f.close()
            self._f = None
            self.checksums.append(f"{self._crc:08x}")

    def close(self) -> None:
        self._close_file()


def shards_intact(directory: Path, state: dict[str, Any], itemsize: int, shard_tokens: int) -> bool:
    """Whether the shard files of a writer's :meth:`ShardWriter.state` (or of a finished source's shard list)
    are on disk as recorded: closed files with their size and crc32, the open one with at least its durable
    prefix, whose crc32 matches."""
    files, sums, left = state["files"], state["checksums"], state["tokens"]
    try:
        for k, name in enumerate(files):
            path = directory / name
            n = min(left, shard_tokens)
            left -= n
            if k < len(sums):
                if path.stat().st_size != n * itemsize or crc32_file(path) != sums[k]:
                    return False
            elif (
                n != state["in_file"]
                or path.stat().st_size < n * itemsize
                or crc32_file(path, n * itemsize) != state["crc"]
            ):
                return False
    except OSError:
        return False
    return left == 0


@dataclass
class _Batch:
    """Whole documents of one source, tokenised together: the unit of parallel work and of checkpoints."""

    texts: list[str] = field(default_factory=list)
    splits: list[str] = field(default_factory=list)  # "train" | "val", one per text
    end: int = 0  # index of the source's next document after this batch
    chars: int = 0
    train_docs: int = 0  # documents with text in train (whole, or the head of a cut one)
    val_docs: list[int] = field(default_factory=list)  # indices of documents held out whole
    cut_docs: list[int] = field(default_factory=list)  # indices of documents cut into head and tail


def _batches(i: int, reader: Reader, plan: Plan, start: int) -> Iterator[_Batch]:
    """Source ``i``'s documents from index ``start`` on (those before are read, not tokenised: they are in
    the shards of an interrupted build), labelled by the plan and grouped in batches."""
    it = reader.docs(i)
    try:
        for _ in range(start):
            if next(it, None) is None:
                raise changed_while_prepared(reader.paths[i])
        b = _Batch(end=start)
        for j in range(start, plan.n_docs[i]):
            doc = next(it, None)
            if doc is None:  # fewer documents than pass 1 counted: the source was edited meanwhile
                raise changed_while_prepared(reader.paths[i])
            kind, at = plan.label(i, j, doc, reader.draw(i, j, doc))
            if kind == "cut":
                b.cut_docs.append(j)
                b.train_docs += 1
                b.texts += [doc[:at], doc[at:]]
                b.splits += ["train", "val"]
            else:
                if kind == "val":
                    b.val_docs.append(j)
                else:
                    b.train_docs += 1
                b.texts.append(doc)
                b.splits.append(kind)
            b.chars += len(doc)
            b.end = j + 1
            if b.chars >= _ENCODE_BATCH_BYTES or len(b.texts) >= _ENCODE_BATCH_DOCS:
                yield b
                b = _Batch(end=j + 1)
        if b.texts:
            yield b
    finally:
        it.close()


def _encode(tok: Tokenizer, texts: list[str], splits: list[str], dtype: np.dtype) -> dict[str, np.ndarray]:
    """The token stream of each split for a batch: ``[bos] + ids + [eos]`` per text, in order."""
    has_bos = tok.bos_id is not None and tok.bos_id != tok.eos_id
    bos = np.array([tok.bos_id] if has_bos else [], dtype=dtype)
    eos = np.array([tok.eos_id], dtype=dtype)
    encoded = tok.encode_batch_numpy(texts, dtype=dtype)
    out = {}
    for split in ("train", "val"):
        parts = [p for ids, s in zip(encoded, splits) if s == split for p in (bos, ids, eos)]
        out[split] = np.concatenate(parts) if parts else np.empty(0, dtype=dtype)
    return out


_worker_tokenizer: Tokenizer | None = None


def _worker_init(tok: Tokenizer) -> None:
    global _worker_tokenizer
    # One process per core, each encoding serially. (Rust's thread pool also does not survive a fork: a
    # forked child that used it would deadlock.)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker_tokenizer = tok
    # A parent killed outright (SIGKILL, OOM killer) cannot stop its workers, and they would wait forever on a
    # queue whose write end they inherited: each exits once it is orphaned.
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def _worker_encode(texts: list[str], splits: list[str], dtype: np.dtype) -> dict[str, np.ndarray]:
    assert _worker_tokenizer is not None
    return _encode(_worker_tokenizer, texts, splits, dtype)


def _encoded(
    batches: Iterator[_Batch], tok: Tokenizer, dtype: np.dtype, workers: int
) -> Iterator[tuple[_Batch, dict[str, np.ndarray]]]:
    """``(batch, its token streams)`` in the order of ``batches``, tokenised by ``workers`` processes.

    The parent reads, labels and writes; the workers only tokenise. At most ``2 * workers`` batches are in
    flight (memory stays bounded; ``Pool.imap`` would read the whole corpus ahead), and results are taken in
    submission order, so the shards are byte-identical whatever ``workers`` is. Processes rather than the
    tokenizers library's own parallel ``encode_batch`` (Rust threads, which ``workers=1`` uses): they also
    spread the Python side (ids to numpy, concatenation), and measured faster (docs/data.md, "Preparing a
    corpus"). The bytes tokenizer runs at memory speed in the parent.
    """
    if workers <= 1 or tok.is_bytes:
        for b in batches:
            streams = _encode(tok, b.texts, b.splits, dtype)
            b.texts, b.splits = [], []
            yield b, streams
        return
    # fork: the workers start at once, without re-importing gptoughts (which imports torch: ~3 s and ~300 MB
    # per process under spawn). They touch no lock of the parent's threads: they only tokenise.
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    pending: deque[tuple[_Batch, concurrent.futures.Future]] = deque()
    with concurrent.futures.ProcessPoolExecutor(
        workers, mp_context=multiprocessing.get_context(method), initializer=_worker_init, initargs=(tok,)
    ) as pool:
        try:
            for b in batches:
                pending.append((b, pool.submit(_worker_encode, b.texts, b.splits, dtype)))
                b.texts, b.splits = [], []  # the pool holds them until they are sent
                if len(pending) >= 2 * workers:
                    done, fut = pending.popleft()
                    yield done, fut.result()
            while pending:
                done, fut = pending.popleft()
                yield done, fut.result()
        except concurrent.futures.process.BrokenProcessPool:
            raise DataError(
                "a tokenizing worker process died (killed, or out of memory); run prepare again (it resumes) "
                "with fewer workers"
            ) from None
        finally:
            for _, fut in pending:
                fut.cancel()


def write_source(
    i: int,
    reader: Reader,
    plan: Plan,
    tok: Tokenizer,
    tmp: Path,
    dtype: np.dtype,
    shard_tokens: int,
    workers: int,
    resume: dict[str, Any] | None,
    checkpoint: Callable[[dict[str, Any]], None],
    advance: Callable[[int], None],
) -> tuple[dict[str, ShardWriter], dict[str, Any]]:
    """Pass 2 for one source: tokenise in batches and append to its shards, from ``resume`` (a checkpoint
    of an interrupted build) when given. ``checkpoint(state)`` is called, with every byte it counts durable,
    after each batch that filled a shard and every :data:`_CHECKPOINT_CHARS` characters; ``advance(chars)``
    after each batch (a progress bar)."""
    writers = {split: ShardWriter(tmp, f"{split}_{i}", dtype, shard_tokens) for split in ("train", "val")}
    done: dict[str, Any] = {"source": i, "next_doc": 0, "train_docs": 0, "val_docs": [], "cut_docs": []}
    if resume is not None:
        for split, w in writers.items():
            w.restore(resume["writers"][split])
        done = {k: resume[k] for k in done}
    since = 0
    for b, streams in _encoded(_batches(i, reader, plan, done["next_doc"]), tok, dtype, workers):
        filled = sum(w.write(streams[split]) for split, w in writers.items())
        del streams  # before the next batch is read: one batch's tokens in memory, not two
        done["next_doc"] = b.end
        done["train_docs"] += b.train_docs
        done["val_docs"] += b.val_docs
        done["cut_docs"] += b.cut_docs
        advance(b.chars)
        since += b.chars
        if filled or since >= _CHECKPOINT_CHARS:
            for w in writers.values():
                w.sync()
            checkpoint({**done, "writers": {split: w.state() for split, w in writers.items()}})
            since = 0
    for w in writers.values():
        w.close()
    return writers, done
