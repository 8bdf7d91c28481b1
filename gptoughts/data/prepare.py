"""Turn sources into token shards: read -> split train/val -> tokenizer -> ``*.bin`` + manifest.

Layout of a prepared folder::

    manifest.json            what is below, how it was made (cache key), token counts, checksums, stats
    tokenizer/               the tokenizer, loadable by Tokenizer.load and transformers.AutoTokenizer
    train_<src>_<k>.bin      raw numpy arrays of token ids (uint16 when the vocab fits, else uint32)
    val_<src>_<k>.bin

Key decisions (the reasons and measurements: docs/data.md, "Preparing a corpus"):

* documents are ``[bos] + tokens + [eos]`` (bos only when distinct from eos); shards hold at most
  :data:`SHARD_TOKENS` tokens and a document may straddle two;
* the train/val split is deterministic (in the cache key); long documents give their tail to val;
* two streaming passes (count and split, then tokenise) keep memory bounded whatever the corpus size;
* ``workers`` processes tokenise, results are written in order: output byte-identical for any worker count;
* builds go into ``.<out>.partial-<key>`` and resume from ``progress.json``; every shard carries a crc32;
* :func:`cache_key` hashes every input; the finished folder is renamed into place under a file lock.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime as _dt
import hashlib
import heapq
import json
import logging
import multiprocessing
import os
import re
import shutil
import threading
import time
import uuid
import zlib
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gptoughts.data.sources import (
    STDLIB_ALIAS,
    SourceStats,
    content_sha256,
    iter_documents,
    normalize_extensions,
    resolve_source,
    source_fingerprint,
    source_kind,
)
from gptoughts.data.tokenizer import Tokenizer, build_tokenizer, parse_spec
from gptoughts.errors import ConfigError, DataError

log = logging.getLogger("gptoughts.data")

# 2: long documents cut into train head + val tail; crc32 checksums of shards and tokenizer files.
FORMAT_VERSION = 2
SHARD_TOKENS = 100_000_000
# Checksum of shards and tokenizer files. Measured on the 2-core dev machine over a 200 MB in-memory array:
# zlib.crc32 6.7 GB/s (0.15 s per GB), sha1 2.1, sha256 1.9 (SHA-NI), blake2b 1.0 GB/s. Verifying a 400 MB
# shard from the page cache (_crc32_file) ran at 5.3 GB/s, 0.19 s per GB; from a cold disk, the disk's read
# speed bounds it. A checksum here detects damage (truncation, flipped bits, a partly copied file), not
# forgery (a forger rewrites the manifest too; the loader's id check guards the model), so the fastest
# adequate one is used.
CHECKSUM = "crc32"
_CHECKSUM_BLOCK = 1 << 22
# BPE training sees at most this much text (split evenly between sources): merges learnt on 50 MB are
# nearly those learnt on 10 GB, and training cost grows with the text.
TOKENIZER_TRAIN_BYTES = 50_000_000
# Text per batch (one worker's unit of work): large enough that sending it to a worker costs little next to
# tokenising it, small enough that the 2 * workers batches in flight (and the library's encodings of one in
# each worker) keep memory small.
_ENCODE_BATCH_BYTES = 4 << 20
_ENCODE_BATCH_DOCS = 8192
# An interrupted build redoes at most this much tokenising: a checkpoint is written every _CHECKPOINT_CHARS
# characters of text and whenever a shard fills.
_CHECKPOINT_CHARS = 64 << 20
# The split (module docstring): with min_val_docs > 0, val holds at least ~_MIN_VAL_CHARS characters of a
# small corpus, but never more than _SMALL_CORPUS_VAL_SHARE of it; a tail shorter than _MIN_TAIL_CHARS is
# not worth cutting (the document is then held out whole or not at all).
_MIN_VAL_CHARS = 1024
_SMALL_CORPUS_VAL_SHARE = 0.1
_MIN_TAIL_CHARS = 32
_SHARD_NAME = re.compile(r"(train|val)_(\d+)_(\d+)\.bin")


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (half the disk and memory bandwidth), else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 65535 else np.dtype(np.uint32)


def default_cache_dir() -> Path:
    """``$GPTOUGHTS_CACHE`` or ``~/.cache/gptoughts``."""
    env = os.environ.get("GPTOUGHTS_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "gptoughts"


# --------------------------------------------------------------------------------------------- manifest


@dataclass
class SourceInfo:
    """One source of a prepared dataset, as recorded in the manifest."""

    index: int
    given: str  # as the user wrote it (phases refer to sources this way), e.g. "@stdlib"
    path: str  # resolved absolute path
    kind: str  # text | folder | jsonl | parquet | hf_dataset
    bytes: int  # bytes of text read (after max_bytes)
    sha256: str
    hash_method: str  # "content": sha256 of the file; "stat": sha256 over sorted (relpath, size, mtime_ns)
    docs: int
    train_docs: int  # documents with text in train (whole, or the head of a cut one)
    val_docs: int  # documents held out whole
    train_tokens: int
    val_tokens: int
    train_shards: list[str]
    val_shards: list[str]
    train_checksums: list[str]  # crc32 (8 hex digits) of each shard, in the order of the shard lists
    val_checksums: list[str]
    truncated: bool  # max_bytes stopped the reading before the end of the source
    val_doc_indices: list[int] = field(default_factory=list)  # document indices (reading order) held out
    val_tail_doc_indices: list[int] = field(default_factory=list)  # long documents whose tail is val
    stats: dict[str, int] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.given


@dataclass
class Manifest:
    """The description of a prepared folder (``manifest.json``)."""

    dir: Path
    format_version: int
    created: str
    cache_key: str
    tokenizer_spec: str
    tokenizer_fingerprint: str
    tokenizer_files: dict[str, str]  # file name in tokenizer/ -> crc32
    vocab_size: int
    eos_id: int
    bos_id: int | None
    dtype: str
    shard_tokens: int  # tokens per shard file (the last shard of a split holds the rest)
    checksum: str  # algorithm of the checksums: "crc32"
    sources: list[SourceInfo]
    totals: dict[str, int]
    stats: dict[str, int]
    val_split: str  # how val was made (see the module docstring), in words
    settings: dict[str, Any]

    @property
    def train_tokens(self) -> int:
        return self.totals["train_tokens"]

    @property
    def val_tokens(self) -> int:
        return self.totals["val_tokens"]

    def tokenizer(self) -> Tokenizer:
        """The dataset's tokenizer; DataError when its files are damaged or do not match this manifest."""
        folder = self.dir / "tokenizer"
        fix = f"delete {self.dir} and run prepare again"
        try:
            tok = Tokenizer.load(folder, spec=self.tokenizer_spec)
        except (ConfigError, DataError) as e:
            problem = _one_line(str(e), limit=1000).rsplit("; ", 1)[0]  # the problem, without its generic fix
            raise DataError(f"{problem}; {fix}") from None
        if (tok.vocab_size, tok.eos_id) != (self.vocab_size, self.eos_id):
            raise DataError(
                f"{folder} has vocab size {tok.vocab_size} and eos id {tok.eos_id}, but {self.dir}/manifest.json "
                f"says {self.vocab_size} and {self.eos_id}; {fix}"
            )
        return tok

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("dir")
        return d

    @classmethod
    def load(cls, directory: str | Path) -> Manifest:
        """Read and validate ``directory/manifest.json``; DataError naming the field when it is corrupt."""
        d = Path(directory)
        path = d / "manifest.json"
        if not path.is_file():
            raise DataError(f"{d} has no manifest.json; run prepare on your sources first")
        corrupt = f"{path} is corrupt ({{}}); delete {d} and run prepare again"
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise DataError(corrupt.format(_one_line(str(e)))) from None
        except OSError as e:
            raise DataError(f"cannot read {path} ({e.strerror or e}); check its permissions") from None
        if not isinstance(data, dict):
            raise DataError(corrupt.format(f"a JSON {type(data).__name__}, not an object"))
        version = data.get("format_version")
        if type(version) is not int:
            raise DataError(corrupt.format("field format_version"))
        if version != FORMAT_VERSION:
            raise DataError(
                f"{d} was prepared in format {version}, this version reads {FORMAT_VERSION}; delete it and "
                f"prepare again"
            )
        problem = _manifest_problem(data)
        if problem is not None:
            raise DataError(corrupt.format(problem))
        data["sources"] = [SourceInfo(**s) for s in data["sources"]]
        return cls(dir=d, **data)

    def _damage(self, checksums: bool) -> tuple[Path, str] | None:
        """The first missing, mis-sized or (with ``checksums``) altered file, with what is wrong; else None."""
        item = np.dtype(self.dtype).itemsize
        for s in self.sources:
            for split in ("train", "val"):
                names = getattr(s, f"{split}_shards")
                sums = getattr(s, f"{split}_checksums")
                left = getattr(s, f"{split}_tokens")
                for name, want in zip(names, sums):
                    path = self.dir / name
                    expected = min(left, self.shard_tokens) * item
                    left -= expected // item
                    if not path.is_file():
                        return path, "is missing"
                    size = path.stat().st_size
                    if size != expected:
                        return (
                            path,
                            f"has {size} bytes where {self.dir}/manifest.json records {expected} (damaged)",
                        )
                    if checksums and _crc32_file(path) != want:
                        return path, f"does not match its checksum in {self.dir}/manifest.json (damaged)"
        tok_dir = self.dir / "tokenizer"
        for name, want in self.tokenizer_files.items():
            path = tok_dir / name
            if not path.is_file():
                return path, "is missing"
            if checksums and _crc32_file(path) != want:
                return path, f"does not match its checksum in {self.dir}/manifest.json (damaged)"
        return None

    def check_files(self) -> None:
        """DataError unless every shard and tokenizer file is present with its recorded size (cheap: stats)."""
        self._raise_damage(checksums=False)

    def verify(self) -> None:
        """:meth:`check_files`, then every file's checksum (reads them all: ~0.2 s per GB when cached)."""
        self._raise_damage(checksums=True)

    def _raise_damage(self, checksums: bool) -> None:
        try:
            damage = self._damage(checksums)
        except OSError as e:
            raise DataError(f"cannot read {e.filename} ({e.strerror}); check {self.dir}") from None
        if damage is not None:
            path, what = damage
            raise DataError(f"{path} {what}; delete {self.dir} and run prepare again")

    def _write(self, directory: Path) -> None:
        path = directory / "manifest.json"
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())


def _one_line(text: str, limit: int = 160) -> str:
    """An exception text reduced to one short line (Rust and JSON errors can span several)."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _crc32_file(path: Path, limit: int | None = None) -> str:
    """crc32 of a file's bytes (of its first ``limit`` bytes when given), as 8 hex digits."""
    crc = 0
    buf = bytearray(_CHECKSUM_BLOCK)
    view = memoryview(buf)
    left = limit
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            if left is not None:
                n = min(n, left)
                left -= n
            crc = zlib.crc32(view[:n], crc)  # releases the GIL on large buffers
            if left == 0:
                break
    return f"{crc:08x}"


# Validation of a manifest read from disk: each field's check, so that a damaged or hand-edited file gives
# "manifest.json is corrupt (field X)" instead of a KeyError or TypeError deep in the loader.
def _is_count(v: Any) -> bool:
    return type(v) is int and v >= 0


def _is_str(v: Any) -> bool:
    return isinstance(v, str)


def _is_crc(v: Any) -> bool:
    return isinstance(v, str) and re.fullmatch(r"[0-9a-f]{8}", v) is not None


def _list_of(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, list) and all(check(x) for x in v)


def _dict_of(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, dict) and all(isinstance(k, str) and check(x) for k, x in v.items())


_MANIFEST_FIELDS: dict[str, Callable[[Any], bool]] = {
    "format_version": _is_count,
    "created": _is_str,
    "cache_key": _is_str,
    "tokenizer_spec": _is_str,
    "tokenizer_fingerprint": _is_str,
    "tokenizer_files": lambda v: (
        _dict_of(_is_crc)(v)
        and "tokenizer.json" in v
        and all(re.fullmatch(r"[\w.-]+", k) and k not in (".", "..") for k in v)
    ),
    "vocab_size": lambda v: _is_count(v) and v > 0,
    "eos_id": _is_count,
    "bos_id": lambda v: v is None or _is_count(v),
    "dtype": lambda v: v in ("uint16", "uint32"),
    "shard_tokens": lambda v: _is_count(v) and v > 0,
    "checksum": lambda v: v == CHECKSUM,
    "sources": lambda v: isinstance(v, list) and len(v) > 0,
    "totals": _dict_of(_is_count),
    "stats": _dict_of(_is_count),
    "val_split": _is_str,
    "settings": lambda v: isinstance(v, dict),
}
_SOURCE_FIELDS: dict[str, Callable[[Any], bool]] = {
    "index": _is_count,
    "given": _is_str,
    "path": _is_str,
    "kind": _is_str,
    "bytes": _is_count,
    "sha256": _is_str,
    "hash_method": _is_str,
    "docs": _is_count,
    "train_docs": _is_count,
    "val_docs": _is_count,
    "train_tokens": _is_count,
    "val_tokens": _is_count,
    "train_shards": _list_of(_is_str),
    "val_shards": _list_of(_is_str),
    "train_checksums": _list_of(_is_crc),
    "val_checksums": _list_of(_is_crc),
    "truncated": lambda v: type(v) is bool,
    "val_doc_indices": _list_of(_is_count),
    "val_tail_doc_indices": _list_of(_is_count),
    "stats": _dict_of(_is_count),
}


def _fields_problem(obj: Any, spec: dict[str, Callable[[Any], bool]], where: str) -> str | None:
    if not isinstance(obj, dict):
        return f"{where.rstrip('.')} is not an object"
    for name, check in spec.items():
        if name not in obj:
            return f"field {where}{name} is missing"
        if not check(obj[name]):
            return f"field {where}{name} has a wrong type or value"
    extra = sorted(set(obj) - set(spec))
    return f"unknown field {where}{extra[0]}" if extra else None


def _manifest_problem(data: dict[str, Any]) -> str | None:
    """What is wrong with a manifest's fields (the first problem found), or None."""
    problem = _fields_problem(data, _MANIFEST_FIELDS, "")
    if problem is not None:
        return problem
    vocab = data["vocab_size"]
    if data["dtype"] != token_dtype(vocab).name:
        return f"field dtype is {data['dtype']} for a vocab of {vocab}"
    if data["eos_id"] >= vocab or (data["bos_id"] is not None and data["bos_id"] >= vocab):
        return "field eos_id or bos_id is not below vocab_size"
    sums = {"train_tokens": 0, "val_tokens": 0}
    for k, s in enumerate(data["sources"]):
        where = f"sources[{k}]."
        problem = _fields_problem(s, _SOURCE_FIELDS, where)
        if problem is not None:
            return problem
        if s["index"] != k:
            return f"field {where}index is {s['index']}"
        for split in ("train", "val"):
            names, checks, n = s[f"{split}_shards"], s[f"{split}_checksums"], s[f"{split}_tokens"]
            if len(names) != -(-n // data["shard_tokens"]):  # ceil: every shard but the last is full
                return f"field {where}{split}_shards has {len(names)} file(s) for {n} tokens"
            if len(checks) != len(names):
                return f"field {where}{split}_checksums has {len(checks)} entries for {len(names)} shard(s)"
            for name in names:
                m = _SHARD_NAME.fullmatch(name)
                if m is None or m.group(1) != split or int(m.group(2)) != k:
                    return f"field {where}{split}_shards names {name!r}"
            sums[f"{split}_tokens"] += n
    for name, total in sums.items():
        if data["totals"].get(name) != total:
            return f"field totals.{name} is not the sum over the sources"
    if sums["train_tokens"] == 0:
        return "field totals.train_tokens is 0"
    return None


# --------------------------------------------------------------------------------------------- cache key


def _tokenizer_identity(tokenizer: str | Tokenizer) -> tuple[str, str]:
    """(spec to record, identity for the cache key). A trained bpe is identified by its spec (it is a
    function of the data, already in the key); a loaded one by its content fingerprint."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer.spec or "custom", "fingerprint:" + tokenizer.fingerprint()
    spec = str(tokenizer).strip()
    kind, _ = parse_spec(spec)
    if kind == "folder":
        return spec, "fingerprint:" + Tokenizer.load(spec).fingerprint()
    return spec, spec


def _settings(
    text_field: str,
    extensions: tuple[str, ...],
    val_fraction: float,
    min_val_docs: int,
    max_bytes: int | None,
    seed: int,
    tokenizer_train_bytes: int,
) -> dict[str, Any]:
    return {
        "text_field": text_field,
        "extensions": list(extensions),
        "val_fraction": val_fraction,
        "min_val_docs": min_val_docs,
        "max_bytes": max_bytes,
        "seed": seed,
        "tokenizer_train_bytes": tokenizer_train_bytes,
    }


def _key(fingerprints: list[dict], tok_identity: str, settings: dict[str, Any]) -> str:
    payload = {
        "format_version": FORMAT_VERSION,
        "sources": fingerprints,
        "tokenizer": tok_identity,
        **settings,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def cache_key(
    sources: Sequence[str | os.PathLike[str]],
    tokenizer: str | Tokenizer = "bpe:8192",
    *,
    text_field: str = "text",
    extensions: Sequence[str] | None = None,
    val_fraction: float = 0.005,
    min_val_docs: int = 1,
    max_bytes: int | None = None,
    seed: int = 0,
    tokenizer_train_bytes: int = TOKENIZER_TRAIN_BYTES,
) -> str:
    """sha256 over everything a prepared folder depends on (sources identified by file metadata)."""
    exts = normalize_extensions(extensions)
    fps = [source_fingerprint(s, exts) for s in sources]
    _, ident = _tokenizer_identity(tokenizer)
    return _key(
        fps,
        ident,
        _settings(text_field, exts, val_fraction, min_val_docs, max_bytes, seed, tokenizer_train_bytes),
    )


# --------------------------------------------------------------------------------------------- helpers


def _doc_u(seed: int, src: int, idx: int, doc: str) -> float:
    """A uniform [0, 1) draw from (seed, source, index, content): the document's split lottery ticket."""
    h = hashlib.blake2b(f"{seed}\0{src}\0{idx}\0".encode(), digest_size=8)
    h.update(doc.encode("utf-8", "surrogatepass"))
    return int.from_bytes(h.digest(), "little") / 2.0**64


@dataclass(frozen=True)
class _SplitRule:
    """The train/val rule of the module docstring, as functions of the corpus size ``chars``."""

    val_fraction: float
    min_val_docs: int

    def share(self, chars: int) -> float:
        """``s``: the fraction of a long document held out as its tail (non-increasing in ``chars``)."""
        floor = min(_SMALL_CORPUS_VAL_SHARE, _MIN_VAL_CHARS / chars) if self.min_val_docs and chars else 0.0
        return max(self.val_fraction, floor)

    def cap(self, chars: int) -> float:
        """Longest document that may be held out whole (non-decreasing in ``chars``)."""
        return min(2.0 * self.share(chars), 0.5) * chars

    def tail(self, length: int, chars: int) -> int:
        """Characters of the val tail of a document of ``length`` in a corpus of ``chars``; 0: not cut."""
        t = round(self.share(chars) * length)
        return t if length > self.cap(chars) and _MIN_TAIL_CHARS <= t < length else 0

    def may_cut(self, length: int, chars_so_far: int) -> bool:
        """False only for documents that :meth:`tail` will not cut, whatever the final corpus size: cap only
        grows and share only shrinks as more text is read."""
        # One character of slack each way: float rounding must never settle a document pass 2 will cut.
        return (
            length + 1 > self.cap(chars_so_far) and self.share(chars_so_far) * length + 1 >= _MIN_TAIL_CHARS
        )


def _tail_start(doc: str, t: int) -> int:
    """Where the val tail of about ``t`` characters starts: the line start nearest to ``len - t`` within
    ``t/2`` (so the tail is t/2..3t/2, t on average), else exactly there."""
    n = len(doc)
    target = n - t
    lo, hi = max(1, target - t // 2), min(n - 1, target + t // 2)
    cut = target
    before = doc.rfind("\n", lo - 1, target)  # a newline at k: the next line starts at k + 1
    after = doc.find("\n", target, hi)
    if before >= 0:
        cut = before + 1
    if after >= 0 and (before < 0 or after + 1 - target < target - cut):
        cut = after + 1
    return min(max(cut, 1), n - 1)


class _ShardWriter:
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
        """Go on from ``state`` (checked by :func:`_intact`): the open file is cut back to its recorded size
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


def _intact(directory: Path, state: dict[str, Any], itemsize: int, shard_tokens: int) -> bool:
    """Whether the shard files of a writer's :meth:`_ShardWriter.state` (or of a finished source's shard list)
    are on disk as recorded: closed files with their size and crc32, the open one with at least its durable
    prefix, whose crc32 matches."""
    files, sums, left = state["files"], state["checksums"], state["tokens"]
    try:
        for k, name in enumerate(files):
            path = directory / name
            n = min(left, shard_tokens)
            left -= n
            if k < len(sums):
                if path.stat().st_size != n * itemsize or _crc32_file(path) != sums[k]:
                    return False
            elif (
                n != state["in_file"]
                or path.stat().st_size < n * itemsize
                or _crc32_file(path, n * itemsize) != state["crc"]
            ):
                return False
    except OSError:
        return False
    return left == 0


class _Progress:
    """A rich progress bar when enabled, else no-ops (tests, non-zero ranks)."""

    def __init__(self, enabled: bool) -> None:
        self._p: Any = None
        if enabled:
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            self._p = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
                transient=True,
            )

    def __enter__(self) -> _Progress:
        if self._p is not None:
            self._p.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._p is not None:
            self._p.__exit__(*exc)

    def task(self, description: str, total: float | None) -> int:
        return self._p.add_task(description, total=total) if self._p is not None else 0

    def advance(self, task: int, amount: float) -> None:
        if self._p is not None:
            self._p.advance(task, amount)


@contextlib.contextmanager
def _locked(out: Path) -> Iterator[None]:
    """An exclusive lock beside ``out`` so concurrent prepares of the same folder build it once."""
    out.parent.mkdir(parents=True, exist_ok=True)
    lock_path = out.parent / f".{out.name}.lock"
    with open(lock_path, "a+") as f:
        try:
            import fcntl

            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        except (ImportError, OSError):  # no flock (Windows, some network filesystems): best effort
            pass
        yield


def _cached(out: Path, key: str, verify: bool) -> Manifest | None:
    """The manifest at ``out`` when it has ``key`` and all its files are intact (with ``verify``, their
    checksums match), else None."""
    try:
        m = Manifest.load(out)
    except DataError:
        return None
    if m.cache_key != key:
        return None
    try:
        m.verify() if verify else m.check_files()
    except DataError as e:
        log.warning("rebuilding %s: %s", out, e)
        return None
    return m


def _looks_like_ours(manifest: Path) -> bool:
    """A manifest.json gptoughts wrote (any format version, even with damaged fields)."""
    try:
        data = json.loads(manifest.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return False
    return isinstance(data, dict) and "cache_key" in data and "format_version" in data


def _check_replaceable(out: Path, owned: bool) -> None:
    """Refuse to replace a folder that is not a dataset: prepare must never delete a user's files.

    Every entry must have a name prepare writes. A folder the user named must also hold a manifest.json
    that gptoughts wrote (a damaged one is rebuilt, a foreign one refused); an ``owned`` folder (the cache)
    is rebuilt whatever its manifest holds.
    """
    if not out.exists():
        return
    if not out.is_dir():
        raise DataError(f"{out} exists and is a file; pass a new or empty folder as the output")
    entries = list(out.iterdir())
    fix = f"move it out or delete {out}" if owned else "pass a new or empty folder"
    for entry in entries:
        if entry.name not in ("manifest.json", "tokenizer") and not _SHARD_NAME.fullmatch(entry.name):
            raise DataError(f"{out} exists and is not a prepared dataset (it holds {entry.name}); {fix}")
    if entries and not owned and not _looks_like_ours(out / "manifest.json"):
        raise DataError(
            f"{out} exists and is not a prepared dataset (no manifest.json written by gptoughts); delete it "
            f"if it is an old dataset, else pass a new or empty folder"
        )


def _install(tmp: Path, out: Path) -> None:
    """Rename the finished ``tmp`` into ``out`` (renames are atomic within a filesystem)."""
    if out.exists():
        old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out)


# --------------------------------------------------------------------------------------------- prepare


def prepare(
    sources: Sequence[str | os.PathLike[str]],
    out_dir: str | os.PathLike[str],
    tokenizer: str | Tokenizer = "bpe:8192",
    *,
    text_field: str = "text",
    extensions: Sequence[str] | None = None,
    val_fraction: float = 0.005,
    min_val_docs: int = 1,
    max_bytes: int | None = None,
    seed: int = 0,
    cache: bool = True,
    progress: bool = True,
    tokenizer_train_bytes: int = TOKENIZER_TRAIN_BYTES,
    verify: bool = True,
    owned: bool = False,
    workers: int | None = None,
) -> Manifest:
    """Tokenise ``sources`` into ``out_dir`` (see the module docstring) and return its manifest.

    ``max_bytes`` caps the text read from *each* source (at document granularity). With ``cache`` (the
    default) an ``out_dir`` already prepared from the same inputs is returned without work, after checking
    its files' checksums when ``verify`` (a damaged folder is rebuilt). ``owned``: ``out_dir`` is a folder
    only gptoughts writes to (the cache), rebuilt even when its manifest is unreadable; a folder the user
    named is replaced only when it holds a manifest gptoughts wrote.

    ``workers``: processes that tokenise (None: one per core this process may use). It does not change the
    output (the shards are byte-identical whatever it is), so it is not part of the cache key. An
    interrupted preparation (killed, Ctrl-C, disk full) keeps its work in a hidden sibling folder; running
    the same prepare again resumes it from its last checkpoint.
    """
    if isinstance(sources, (str, os.PathLike)):
        sources = [sources]
    if not sources:
        raise ConfigError(
            "no data sources given; pass at least one file, folder, .jsonl, .parquet or dataset"
        )
    if not 0.0 <= val_fraction < 1.0:
        raise ConfigError(f"val_fraction must be in [0, 1); got {val_fraction}")
    if min_val_docs < 0:
        raise ConfigError(f"min_val_docs must be >= 0; got {min_val_docs}")
    if max_bytes is not None and max_bytes <= 0:
        raise ConfigError(f"max_bytes must be positive or None; got {max_bytes}")
    if workers is not None and (type(workers) is not int or workers < 1):
        raise ConfigError(
            f"workers must be a number of processes >= 1, or None for all cores; got {workers!r}"
        )
    n_workers = workers if workers is not None else _available_cores()
    exts = normalize_extensions(extensions)
    given = [str(s) for s in sources]
    paths = [resolve_source(s) for s in sources]  # DataError for a missing path, before any work
    fps = [source_fingerprint(p, exts) for p in paths]
    spec, ident = _tokenizer_identity(tokenizer)
    settings = _settings(text_field, exts, val_fraction, min_val_docs, max_bytes, seed, tokenizer_train_bytes)
    key = _key(fps, ident, settings)
    out = Path(out_dir).expanduser().resolve()

    if cache and (m := _cached(out, key, verify)) is not None:
        log.info("reusing cached shards in %s (%s train tokens)", out, f"{m.train_tokens:,}")
        return m
    _check_replaceable(out, owned)
    try:
        with _locked(out):
            # Another process may have built it while we waited for the lock.
            if cache and (m := _cached(out, key, verify)) is not None:
                log.info("reusing cached shards in %s (%s train tokens)", out, f"{m.train_tokens:,}")
                return m
            # The build folder is named by the key: a killed build of the same inputs is resumed from it, any
            # other (another key, or the per-process folders of older versions) is stale (we hold the lock).
            tmp = out.parent / f".{out.name}.partial-{key[:16]}"
            for pattern in (f".{out.name}.tmp-*", f".{out.name}.partial-*"):
                for stale in out.parent.glob(pattern):
                    if stale != tmp:
                        shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir(exist_ok=True)
            try:
                manifest = _build(
                    tmp, given, paths, tokenizer, spec, key, settings, exts, progress, n_workers
                )
                _install(tmp, out)
            except BaseException:
                if (tmp / _PLAN_FILE).is_file():
                    log.warning(
                        "preparation interrupted: its work is kept in %s; the same prepare resumes it", tmp
                    )
                else:  # failed while reading (bad input): nothing worth keeping
                    shutil.rmtree(tmp, ignore_errors=True)
                raise
    except OSError as e:  # reading errors are DataErrors already (sources.py): this one is about the output
        where = e.filename or out
        raise DataError(
            f"cannot write {where} ({e.strerror or e}); pass an output folder you can write to, on a disk "
            f"with free space (for the cache: set GPTOUGHTS_CACHE or data.cache_dir)"
        ) from None
    manifest.dir = out
    t, st = manifest.totals, manifest.stats
    log.info(
        "prepared %s docs from %d source(s): %s train + %s val tokens, vocab %d (%s); skipped %d binary "
        "file(s), %d invalid UTF-8 replacement(s) -> %s",
        f"{t['docs']:,}", len(manifest.sources), f"{t['train_tokens']:,}", f"{t['val_tokens']:,}",
        manifest.vocab_size, manifest.dtype, st["skipped_binary"], st["replaced_chars"], out,
    )  # fmt: skip
    return manifest


@dataclass
class _Plan:
    """What pass 1 decided: documents per source, the split, and the BPE training text."""

    n_docs: list[int]
    stats: list[SourceStats]
    truncated: list[bool]
    chars: int
    rule: _SplitRule
    forced_val: set[tuple[int, int]]  # short documents promoted to val so that min_val_docs hold
    forced_train: set[tuple[int, int]]  # kept in train so that one training document remains
    n_cut: int  # long documents cut into a train head and a val tail
    train_texts: list[str]

    def label(self, i: int, j: int, doc: str, u: float) -> tuple[str, int]:
        """("cut", where the val tail starts) | ("val", 0) | ("train", 0) for document ``j`` of source ``i``
        whose lottery draw is ``u``: the one decision both passes share."""
        t = self.rule.tail(len(doc), self.chars)
        if t:
            return "cut", _tail_start(doc, t)
        if (i, j) in self.forced_train:
            return "train", 0
        if u < self.rule.val_fraction or (i, j) in self.forced_val:
            return "val", 0
        return "train", 0

    def describe(self) -> str:
        if not self.n_cut:
            return "documents"
        s = self.rule.share(self.chars)
        return (
            f"documents, and the last {s:.2%} of each of the {self.n_cut} document(s) longer than "
            f"{self.rule.cap(self.chars):,.0f} characters"
        )


class _Reader:
    def __init__(self, paths: list[Path], settings: dict[str, Any], exts: tuple[str, ...]) -> None:
        self.paths, self.exts = paths, exts
        self.text_field: str = settings["text_field"]
        self.seed: int = settings["seed"]

    def docs(self, i: int, stats: SourceStats | None = None) -> Iterator[str]:
        return iter_documents(self.paths[i], text_field=self.text_field, extensions=self.exts, stats=stats)

    def draw(self, i: int, j: int, doc: str) -> float:
        return _doc_u(self.seed, i, j, doc)


def _scan(reader: _Reader, settings: dict[str, Any], train_bpe: bool, bar: _Progress) -> _Plan:
    """Pass 1: count documents and characters (up to max_bytes), draw the split, collect BPE training text.

    The cut threshold depends on the corpus size, known only at the end; documents that cannot be cut
    whatever that size (:meth:`_SplitRule.may_cut` is False: nearly all of them) are settled on the fly,
    the few others are remembered and settled at the end. Memory stays O(min_val_docs + few long docs).
    """
    rule = _SplitRule(settings["val_fraction"], settings["min_val_docs"])
    min_val_docs: int = settings["min_val_docs"]
    max_bytes: int | None = settings["max_bytes"]
    per_source_train_chars = settings["tokenizer_train_bytes"] // len(reader.paths)
    n_docs: list[int] = []
    stats: list[SourceStats] = []
    truncated: list[bool] = []
    chars = 0
    n_val = 0  # short documents that drew val
    top_val: tuple[float, int, int] | None = None  # the one with the largest draw
    # The short train documents with the smallest draws, promoted to val when fewer than min_val_docs
    # documents gave val text: a max-heap (draws negated) of size min_val_docs keeps memory O(min_val_docs).
    smallest: list[tuple[float, int, int]] = []
    maybe_long: list[tuple[float, int, int, int]] = []  # (draw, source, index, length)
    texts: list[tuple[int, int, str]] = []

    def settle_short(u: float, i: int, j: int) -> None:
        nonlocal n_val, top_val
        if u < rule.val_fraction:
            n_val += 1
            if top_val is None or u > top_val[0]:
                top_val = (u, i, j)
        elif min_val_docs:
            item = (-u, i, j)
            if len(smallest) < min_val_docs:
                heapq.heappush(smallest, item)
            elif item > smallest[0]:
                heapq.heapreplace(smallest, item)

    task = bar.task("reading", None)
    for i in range(len(reader.paths)):
        st = SourceStats()
        n, collected, cut = 0, 0, False
        for doc in reader.docs(i, st):
            u = reader.draw(i, n, doc)
            chars += len(doc)
            if rule.may_cut(len(doc), chars):
                maybe_long.append((u, i, n, len(doc)))
            else:
                settle_short(u, i, n)
            if train_bpe and collected < per_source_train_chars:
                texts.append((i, n, doc))  # val text is filtered out below, once the split is known
                collected += len(doc)
            n += 1
            bar.advance(task, len(doc))
            if max_bytes is not None and st.bytes_read >= max_bytes:
                cut = True
                break
        n_docs.append(n)
        stats.append(st)
        truncated.append(cut)
    total = sum(n_docs)
    if total == 0:
        raise DataError("the corpus has no documents; pass a non-empty source")
    n_cut = 0
    for u, i, j, length in maybe_long:
        if rule.tail(length, chars):
            n_cut += 1
        else:
            settle_short(u, i, j)
    need = max(0, min_val_docs - n_val - n_cut)
    forced_val = {(i, j) for _, i, j in sorted(smallest, reverse=True)[:need]}  # smallest draws first
    forced_train: set[tuple[int, int]] = set()
    if not n_cut and n_val + len(forced_val) >= total:  # everything would be val: keep one for training
        if forced_val:
            forced_val.discard(next((i, j) for _, i, j in sorted(smallest)))  # the largest forced draw
        elif top_val is not None:
            forced_train.add(top_val[1:])
    plan = _Plan(n_docs, stats, truncated, chars, rule, forced_val, forced_train, n_cut, [])
    for i, j, doc in texts:
        kind, at = plan.label(i, j, doc, reader.draw(i, j, doc))
        if kind != "val":
            plan.train_texts.append(doc[:at] if kind == "cut" else doc)
    return plan


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


def _batches(i: int, reader: _Reader, plan: _Plan, start: int) -> Iterator[_Batch]:
    """Source ``i``'s documents from index ``start`` on (those before are read, not tokenised: they are in
    the shards of an interrupted build), labelled by the plan and grouped in batches."""
    it = reader.docs(i)
    try:
        for _ in range(start):
            next(it)
        b = _Batch(end=start)
        for j in range(start, plan.n_docs[i]):
            doc = next(it)
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


def _write_source(
    i: int,
    reader: _Reader,
    plan: _Plan,
    tok: Tokenizer,
    tmp: Path,
    dtype: np.dtype,
    workers: int,
    resume: dict[str, Any] | None,
    checkpoint: Callable[[dict[str, Any]], None],
    bar: _Progress,
    task: int,
) -> tuple[dict[str, _ShardWriter], dict[str, Any]]:
    """Pass 2 for one source: tokenise in batches and append to its shards, from ``resume`` (a checkpoint
    of an interrupted build) when given. ``checkpoint(state)`` is called, with every byte it counts durable,
    after each batch that filled a shard and every :data:`_CHECKPOINT_CHARS` characters."""
    writers = {split: _ShardWriter(tmp, f"{split}_{i}", dtype, SHARD_TOKENS) for split in ("train", "val")}
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
        bar.advance(task, b.chars)
        since += b.chars
        if filled or since >= _CHECKPOINT_CHARS:
            for w in writers.values():
                w.sync()
            checkpoint({**done, "writers": {split: w.state() for split, w in writers.items()}})
            since = 0
    for w in writers.values():
        w.close()
    return writers, done


def _file_checksums(folder: Path) -> dict[str, str]:
    return {f.name: _crc32_file(f) for f in sorted(folder.iterdir()) if f.is_file()}


# Files of a build in progress (removed before the folder is installed).
_PLAN_FILE = "plan.json"
_PROGRESS_FILE = "progress.json"


def _write_json(path: Path, data: Any) -> None:
    """Write ``data`` to ``path`` atomically and durably (a kill leaves the old file or the new one)."""
    part = path.with_name(path.name + ".part")
    with open(part, "w", encoding="utf-8") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)


def _plan_record(plan: _Plan, key: str, tok: Tokenizer) -> dict[str, Any]:
    return {
        "key": key,
        "shard_tokens": SHARD_TOKENS,
        "tokenizer_fingerprint": tok.fingerprint(),
        "n_docs": plan.n_docs,
        "stats": [st.as_dict() for st in plan.stats],
        "truncated": plan.truncated,
        "chars": plan.chars,
        "forced_val": sorted(plan.forced_val),
        "forced_train": sorted(plan.forced_train),
        "n_cut": plan.n_cut,
    }


def _resumable(
    tmp: Path, key: str, spec: str, tokenizer: str | Tokenizer, settings: dict[str, Any]
) -> tuple[_Plan, Tokenizer, dict[str, Any]] | None:
    """(plan, tokenizer, progress) of an interrupted build of the same key in ``tmp`` whose files are intact
    (sizes and checksums of every shard written), else None."""
    try:
        rec = json.loads((tmp / _PLAN_FILE).read_text(encoding="utf-8"))
        progress_path = tmp / _PROGRESS_FILE
        progress = (
            json.loads(progress_path.read_text(encoding="utf-8"))
            if progress_path.is_file()
            else {"key": key, "done": [], "current": None}
        )
        if rec["key"] != key or progress["key"] != key or rec["shard_tokens"] != SHARD_TOKENS:
            return None
        if isinstance(tokenizer, Tokenizer):
            tok = tokenizer
        elif parse_spec(spec)[0] == "bpe":
            tok = Tokenizer.load(tmp / "tokenizer", spec=spec)
        else:
            tok = build_tokenizer(spec)
        if tok.fingerprint() != rec["tokenizer_fingerprint"]:
            return None
        rule = _SplitRule(settings["val_fraction"], settings["min_val_docs"])
        plan = _Plan(
            rec["n_docs"],
            [SourceStats(**d) for d in rec["stats"]],
            rec["truncated"],
            rec["chars"],
            rule,
            {tuple(x) for x in rec["forced_val"]},
            {tuple(x) for x in rec["forced_train"]},
            rec["n_cut"],
            [],
        )
        item = token_dtype(tok.vocab_size).itemsize
        states = [
            {
                "files": d[f"{split}_shards"],
                "checksums": d[f"{split}_checksums"],
                "tokens": d[f"{split}_tokens"],
            }
            for d in progress["done"]
            for split in ("train", "val")
        ]
        if progress["current"] is not None:
            states += list(progress["current"]["writers"].values())
        if not all(_intact(tmp, st, item, SHARD_TOKENS) for st in states):
            return None
    except (OSError, ValueError, KeyError, TypeError, ConfigError, DataError):
        return None
    return plan, tok, progress


def _build(
    tmp: Path,
    given: list[str],
    paths: list[Path],
    tokenizer: str | Tokenizer,
    spec: str,
    key: str,
    settings: dict[str, Any],
    exts: tuple[str, ...],
    progress: bool,
    workers: int,
) -> Manifest:
    reader = _Reader(paths, settings, exts)
    resumed = _resumable(tmp, key, spec, tokenizer, settings)
    if resumed is not None:
        plan, tok, state = resumed
        cur = state["current"]
        log.info(
            "resuming the interrupted preparation in %s: %d of %d source(s) done%s",
            tmp, len(state["done"]), len(paths),
            f", source {cur['source']} from document {cur['next_doc']:,}" if cur else "",
        )  # fmt: skip
    else:
        for entry in tmp.iterdir():  # an unusable earlier attempt: start over
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        train_bpe = isinstance(tokenizer, str) and parse_spec(tokenizer)[0] == "bpe"
        with _Progress(progress) as bar:
            plan = _scan(reader, settings, train_bpe, bar)
        if isinstance(tokenizer, Tokenizer):
            tok = tokenizer
        else:
            texts = plan.train_texts
            tok = build_tokenizer(spec, (lambda: iter(texts)) if train_bpe else None)
            wanted = parse_spec(spec)[1]
            if wanted is not None and tok.vocab_size < wanted:
                log.warning(
                    "the corpus is too small for %s: the trained vocabulary has %d tokens",
                    spec,
                    tok.vocab_size,
                )
        plan.train_texts = []  # up to 50 MB: free it before tokenising
        tok.save(tmp / "tokenizer")
        _write_json(tmp / _PLAN_FILE, _plan_record(plan, key, tok))  # from here on, a kill is resumable
        state = {"key": key, "done": [], "current": None}
    dtype = token_dtype(tok.vocab_size)

    infos = [SourceInfo(**d) for d in state["done"]]

    def checkpoint(current: dict[str, Any] | None) -> None:
        _write_json(
            tmp / _PROGRESS_FILE, {"key": key, "done": [asdict(s) for s in infos], "current": current}
        )

    with _Progress(progress) as bar:
        task = bar.task("tokenizing", plan.chars)
        for i in range(len(infos), len(paths)):
            path = paths[i]
            resume = state["current"] if state["current"] and state["current"]["source"] == i else None
            writers, docs = _write_source(
                i, reader, plan, tok, tmp, dtype, workers, resume, checkpoint, bar, task
            )
            single_file = path.is_file()
            infos.append(
                SourceInfo(
                    index=i,
                    given=given[i],
                    path=str(path),
                    kind=source_kind(path),
                    bytes=plan.stats[i].bytes_read,
                    sha256=content_sha256(path)
                    if single_file
                    else source_fingerprint(path, exts)["stat_sha256"],
                    hash_method="content" if single_file else "stat",
                    docs=plan.n_docs[i],
                    train_docs=docs["train_docs"],
                    val_docs=len(docs["val_docs"]),
                    train_tokens=writers["train"].tokens,
                    val_tokens=writers["val"].tokens,
                    train_shards=writers["train"].files,
                    val_shards=writers["val"].files,
                    train_checksums=writers["train"].checksums,
                    val_checksums=writers["val"].checksums,
                    truncated=plan.truncated[i],
                    val_doc_indices=docs["val_docs"],
                    val_tail_doc_indices=docs["cut_docs"],
                    stats=plan.stats[i].as_dict(),
                )
            )
            checkpoint(None)

    totals = {
        "docs": sum(plan.n_docs),
        "train_docs": sum(s.train_docs for s in infos),
        "val_docs": sum(s.val_docs for s in infos),
        "val_tails": sum(len(s.val_tail_doc_indices) for s in infos),
        "train_tokens": sum(s.train_tokens for s in infos),
        "val_tokens": sum(s.val_tokens for s in infos),
        "bytes": sum(s.bytes for s in infos),
    }
    if totals["train_tokens"] == 0:
        raise DataError("the corpus produced no training tokens; pass a non-empty source")
    all_stats = SourceStats()
    for st in plan.stats:
        all_stats.merge(st)
    manifest = Manifest(
        dir=tmp,
        format_version=FORMAT_VERSION,
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        cache_key=key,
        tokenizer_spec=spec,
        tokenizer_fingerprint=tok.fingerprint(),
        tokenizer_files=_file_checksums(tmp / "tokenizer"),
        vocab_size=tok.vocab_size,
        eos_id=tok.eos_id,
        bos_id=tok.bos_id if tok.bos_id is not None and tok.bos_id != tok.eos_id else None,
        dtype=dtype.name,
        shard_tokens=SHARD_TOKENS,
        checksum=CHECKSUM,
        sources=infos,
        totals=totals,
        stats=all_stats.as_dict(),
        val_split=plan.describe(),
        settings=settings,
    )
    (tmp / _PLAN_FILE).unlink()
    (tmp / _PROGRESS_FILE).unlink()
    manifest._write(tmp)  # last: a folder with a manifest is a complete folder
    return manifest


def _available_cores() -> int:
    """Cores this process may run on (its affinity mask: a container or taskset limit, not the machine's)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def _slug(sources: Sequence[str | os.PathLike[str]], tokenizer: str | Tokenizer) -> str:
    first = str(sources[0])
    name = "stdlib" if first == STDLIB_ALIAS else Path(first).name or "data"
    tok = tokenizer.spec if isinstance(tokenizer, Tokenizer) else str(tokenizer)
    tok = Path(tok).name if "/" in tok else tok
    return re.sub(r"[^A-Za-z0-9._-]+", "", f"{name}-{tok}")[:60] or "data"


_KEY_ARGS = (
    "text_field",
    "extensions",
    "val_fraction",
    "min_val_docs",
    "max_bytes",
    "seed",
    "tokenizer_train_bytes",
)


def _cache_location(
    sources: Sequence[str | os.PathLike[str]],
    tokenizer: str | Tokenizer,
    cache_root: str | os.PathLike[str] | None,
    kwargs: dict[str, Any],
) -> tuple[list[str | os.PathLike[str]], Path, str]:
    """(sources as a list, the cache folder, its key) for :func:`cached_prepare`'s arguments."""
    if isinstance(sources, (str, os.PathLike)):
        sources = [sources]
    if not sources:
        raise ConfigError(
            "no data sources given; pass at least one file, folder, .jsonl, .parquet or dataset"
        )
    key = cache_key(sources, tokenizer, **{k: kwargs[k] for k in _KEY_ARGS if k in kwargs})
    root = Path(cache_root).expanduser() if cache_root is not None else default_cache_dir() / "datasets"
    return list(sources), root / f"{_slug(sources, tokenizer)}-{key[:16]}", key


def cached_prepare(
    sources: Sequence[str | os.PathLike[str]],
    tokenizer: str | Tokenizer = "bpe:8192",
    *,
    cache_root: str | os.PathLike[str] | None = None,
    **kwargs: Any,
) -> Manifest:
    """:func:`prepare` into ``cache_root/<name>-<key>`` (default root: ``default_cache_dir()/datasets``).

    What ``train`` calls: the first run prepares, later runs with the same inputs reuse the shards (after
    verifying their checksums; ``verify=False`` skips that, e.g. on ranks after the first). ``kwargs`` are
    those of :func:`prepare` (``cache`` is always on; the folder is ``owned``: a damaged one is rebuilt).
    """
    kwargs.pop("cache", None)
    kwargs.pop("owned", None)
    sources, out, _ = _cache_location(sources, tokenizer, cache_root, kwargs)
    return prepare(sources, out, tokenizer, cache=True, owned=True, **kwargs)


def lookup_cached(
    sources: Sequence[str | os.PathLike[str]],
    tokenizer: str | Tokenizer = "bpe:8192",
    *,
    cache_root: str | os.PathLike[str] | None = None,
    verify: bool = False,
    **kwargs: Any,
) -> Manifest | None:
    """The manifest :func:`cached_prepare` would return if it needs no work, else None; builds nothing.

    For dry runs: by default only the files' presence and sizes are checked (``verify=True`` reads them to
    check their checksums too). ``kwargs`` are those of :func:`cached_prepare`; those not in the cache key
    are ignored.
    """
    _, out, key = _cache_location(sources, tokenizer, cache_root, kwargs)
    return _cached(out.expanduser().resolve(), key, verify)
