"""Turn sources into token shards: read -> split train/val by document -> tokenizer -> ``*.bin`` + manifest.

Layout of a prepared folder::

    manifest.json            what is below, how it was made (cache key), token counts, stats
    tokenizer/               the tokenizer, loadable by Tokenizer.load and transformers.AutoTokenizer
    train_<src>_<k>.bin      raw numpy arrays of token ids (uint16 when the vocab fits, else uint32)
    val_<src>_<k>.bin

Each document is written as ``[bos] + tokens + [eos]`` (bos only for tokenizers that have one distinct from
eos, e.g. Llama's; ours and GPT-2's join documents with eos alone). Shards hold at most
:data:`SHARD_TOKENS` tokens; a document may straddle two shards.

The split holds out whole documents: a document goes to val when a hash of (seed, source, index, content)
falls under ``val_fraction``; at least ``min_val_docs`` documents are held out when there are two or more.
A corpus of a single document is cut in two at a line boundary (its tail is val) and the manifest says so.

Two passes over the sources: the first counts documents and decides the split (and collects the BPE
training text), the second tokenises. Reading is cheap next to tokenising (measured ~60 MB/s vs ~3.5 MB/s
on 2 cores), and the two passes keep memory bounded whatever the corpus size.

Caching: :func:`cache_key` hashes everything the output depends on. ``prepare`` returns an existing folder
with the same key untouched; otherwise it builds into a temporary sibling and renames it into place, under
a file lock, so a half-written folder never looks valid and concurrent callers (all ranks of a node) build
once and share.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import heapq
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Iterator, Sequence
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

FORMAT_VERSION = 1
SHARD_TOKENS = 100_000_000
# BPE training sees at most this much text (split evenly between sources): merges learnt on 50 MB are
# nearly those learnt on 10 GB, and training cost grows with the text.
TOKENIZER_TRAIN_BYTES = 50_000_000
# Text per encode_batch call: enough documents to keep every core busy, little enough to bound memory.
_ENCODE_BATCH_BYTES = 8 << 20
_ENCODE_BATCH_DOCS = 8192
# A single-document corpus keeps at least this fraction of its text for validation.
_SINGLE_DOC_VAL_FRACTION = 0.1


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
    train_docs: int
    val_docs: int
    train_tokens: int
    val_tokens: int
    train_shards: list[str]
    val_shards: list[str]
    truncated: bool  # max_bytes stopped the reading before the end of the source
    val_doc_indices: list[int] = field(default_factory=list)  # document indices (reading order) held out
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
    vocab_size: int
    eos_id: int
    bos_id: int | None
    dtype: str
    sources: list[SourceInfo]
    totals: dict[str, int]
    stats: dict[str, int]
    val_split: str  # how val was made: "documents" or "tail of the single document"
    settings: dict[str, Any]

    @property
    def train_tokens(self) -> int:
        return self.totals["train_tokens"]

    @property
    def val_tokens(self) -> int:
        return self.totals["val_tokens"]

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.load(self.dir / "tokenizer", spec=self.tokenizer_spec)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("dir")
        return d

    @classmethod
    def load(cls, directory: str | Path) -> Manifest:
        d = Path(directory)
        path = d / "manifest.json"
        if not path.is_file():
            raise DataError(f"{d} has no manifest.json; run prepare on your sources first")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise DataError(f"{path} is corrupt ({e}); delete {d} and prepare again") from None
        if data.get("format_version") != FORMAT_VERSION:
            raise DataError(
                f"{d} was prepared in format {data.get('format_version')}, this version reads "
                f"{FORMAT_VERSION}; delete it and prepare again"
            )
        data["sources"] = [SourceInfo(**s) for s in data["sources"]]
        return cls(dir=d, **data)

    def _write(self, directory: Path) -> None:
        path = directory / "manifest.json"
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())


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


def _split_single(doc: str, fraction: float) -> tuple[str, str]:
    """Cut one document into (train head, val tail), at a newline near the cut point when there is one."""
    cut = int(len(doc) * (1.0 - fraction))
    nl = doc.rfind("\n", 0, cut)
    if nl > len(doc) // 2:
        cut = nl + 1
    cut = min(max(cut, 1), len(doc) - 1)
    return doc[:cut], doc[cut:]


class _ShardWriter:
    """Appends token arrays to ``<prefix>_<k>.bin`` files of at most ``max_tokens`` tokens each."""

    def __init__(self, directory: Path, prefix: str, dtype: np.dtype, max_tokens: int) -> None:
        self.directory, self.prefix, self.dtype, self.max_tokens = directory, prefix, dtype, max_tokens
        self.files: list[str] = []
        self.tokens = 0
        self._f: Any = None
        self._in_file = 0

    def write(self, arr: np.ndarray) -> None:
        arr = np.ascontiguousarray(arr, dtype=self.dtype)
        while arr.size:
            if self._f is None:
                name = f"{self.prefix}_{len(self.files)}.bin"
                self.files.append(name)
                self._f = open(self.directory / name, "wb")
                self._in_file = 0
            part = arr[: self.max_tokens - self._in_file]
            part.tofile(self._f)
            self._in_file += part.size
            self.tokens += part.size
            arr = arr[part.size :]
            if self._in_file >= self.max_tokens:
                self._close_file()

    def _close_file(self) -> None:
        if self._f is not None:
            self._f.flush()
            os.fsync(self._f.fileno())  # durable before the folder is renamed into place
            self._f.close()
            self._f = None

    def close(self) -> None:
        self._close_file()


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


def _cached(out: Path, key: str) -> Manifest | None:
    """The manifest at ``out`` when it has ``key`` and all its shards are intact, else None."""
    try:
        m = Manifest.load(out)
    except DataError:
        return None
    if m.cache_key != key:
        return None
    item = np.dtype(m.dtype).itemsize
    for s in m.sources:
        for split, n in (("train", s.train_tokens), ("val", s.val_tokens)):
            shards = getattr(s, f"{split}_shards")
            size = sum((out / f).stat().st_size if (out / f).is_file() else -1 for f in shards)
            if size != n * item:
                return None
    if not (out / "tokenizer" / "tokenizer.json").is_file():
        return None
    return m


def _check_replaceable(out: Path) -> None:
    """Refuse to replace a folder that is not a dataset: prepare must never delete a user's files."""
    if not out.exists():
        return
    if not out.is_dir():
        raise DataError(f"{out} exists and is a file; pass a new or empty folder as the output")
    ours = {"manifest.json", "tokenizer"}
    for entry in out.iterdir():
        if entry.name not in ours and not re.fullmatch(r"(train|val)_\d+_\d+\.bin", entry.name):
            raise DataError(
                f"{out} exists and is not a prepared dataset (it holds {entry.name}); pass a new or empty folder"
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
) -> Manifest:
    """Tokenise ``sources`` into ``out_dir`` (see the module docstring) and return its manifest.

    ``max_bytes`` caps the text read from *each* source (at document granularity). With ``cache`` (the
    default) an ``out_dir`` already prepared from the same inputs is returned without work.
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
    exts = normalize_extensions(extensions)
    given = [str(s) for s in sources]
    paths = [resolve_source(s) for s in sources]  # DataError for a missing path, before any work
    fps = [source_fingerprint(p, exts) for p in paths]
    spec, ident = _tokenizer_identity(tokenizer)
    settings = _settings(text_field, exts, val_fraction, min_val_docs, max_bytes, seed, tokenizer_train_bytes)
    key = _key(fps, ident, settings)
    out = Path(out_dir).expanduser().resolve()

    if cache and (m := _cached(out, key)) is not None:
        log.info("reusing cached shards in %s (%s train tokens)", out, f"{m.train_tokens:,}")
        return m
    _check_replaceable(out)
    with _locked(out):
        # Another process may have built it while we waited for the lock.
        if cache and (m := _cached(out, key)) is not None:
            log.info("reusing cached shards in %s (%s train tokens)", out, f"{m.train_tokens:,}")
            return m
        for stale in out.parent.glob(f".{out.name}.tmp-*"):  # left by a killed build (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            manifest = _build(tmp, given, paths, tokenizer, spec, key, settings, exts, progress)
            _install(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
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
    forced_val: set[tuple[int, int]]  # promoted to val so that min_val_docs hold
    forced_train: set[tuple[int, int]]  # demoted to train so that one training document remains
    single_doc: tuple[str, str] | None  # (train head, val tail) of a one-document corpus
    val_split: str
    train_texts: list[str]


class _Reader:
    def __init__(self, paths: list[Path], settings: dict[str, Any], exts: tuple[str, ...]) -> None:
        self.paths, self.exts = paths, exts
        self.text_field: str = settings["text_field"]
        self.val_fraction: float = settings["val_fraction"]
        self.seed: int = settings["seed"]

    def docs(self, i: int, stats: SourceStats | None = None) -> Iterator[str]:
        return iter_documents(self.paths[i], text_field=self.text_field, extensions=self.exts, stats=stats)

    def draw(self, i: int, j: int, doc: str) -> float:
        return _doc_u(self.seed, i, j, doc)


def _scan(
    reader: _Reader, settings: dict[str, Any], given: list[str], train_bpe: bool, bar: _Progress
) -> _Plan:
    """Pass 1: count documents (up to max_bytes), draw the split, collect BPE training text."""
    val_fraction: float = settings["val_fraction"]
    min_val_docs: int = settings["min_val_docs"]
    max_bytes: int | None = settings["max_bytes"]
    per_source_train_chars = settings["tokenizer_train_bytes"] // len(reader.paths)
    n_docs: list[int] = []
    stats: list[SourceStats] = []
    truncated: list[bool] = []
    chars = 0
    n_val = 0
    # The train candidates with the smallest draws, promoted to val when fewer than min_val_docs drew val:
    # a max-heap (draws negated) of size min_val_docs keeps memory O(min_val_docs).
    smallest: list[tuple[float, int, int]] = []
    largest_val: tuple[float, int, int] | None = None
    texts: list[tuple[int, int, str]] = []
    task = bar.task("reading", None)
    for i in range(len(reader.paths)):
        st = SourceStats()
        n, collected, cut = 0, 0, False
        for doc in reader.docs(i, st):
            u = reader.draw(i, n, doc)
            if u < val_fraction:
                n_val += 1
                if largest_val is None or u > largest_val[0]:
                    largest_val = (u, i, n)
            else:
                if min_val_docs:
                    item = (-u, i, n)
                    if len(smallest) < min_val_docs:
                        heapq.heappush(smallest, item)
                    elif item > smallest[0]:
                        heapq.heapreplace(smallest, item)
                if train_bpe and collected < per_source_train_chars:
                    texts.append((i, n, doc))
                    collected += len(doc)
            n += 1
            chars += len(doc)
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
    if total == 1:
        frac = max(val_fraction, _SINGLE_DOC_VAL_FRACTION)
        only = next(i for i, n in enumerate(n_docs) if n)
        doc = next(reader.docs(only))
        if len(doc) < 2:
            raise DataError(
                f"{given[only]} holds a single document of {len(doc)} character(s); add more text"
            )
        head, tail = _split_single(doc, frac)
        return _Plan(
            n_docs, stats, truncated, chars, set(), set(), (head, tail),
            f"tail of the single document (last {frac:.0%} of its text)", [head] if train_bpe else [],
        )  # fmt: skip
    need = max(0, min_val_docs - n_val)
    forced_val = {(i, j) for _, i, j in sorted(smallest, reverse=True)[:need]}  # smallest draws first
    forced_train: set[tuple[int, int]] = set()
    if n_val + len(forced_val) >= total and largest_val is not None:
        forced_train.add(largest_val[1:])  # every document drew val: keep one for training
    train_texts = [t for i, j, t in texts if (i, j) not in forced_val]
    return _Plan(n_docs, stats, truncated, chars, forced_val, forced_train, None, "documents", train_texts)


def _write_source(
    i: int,
    reader: _Reader,
    plan: _Plan,
    tok: Tokenizer,
    tmp: Path,
    dtype: np.dtype,
    bar: _Progress,
    task: int,
) -> tuple[dict[str, _ShardWriter], dict[str, int], list[int]]:
    """Pass 2 for one source: tokenise in batches (parallel in Rust) and append to its shards."""
    writers = {split: _ShardWriter(tmp, f"{split}_{i}", dtype, SHARD_TOKENS) for split in ("train", "val")}
    counts = {"train": 0, "val": 0}
    val_indices: list[int] = []
    bos = np.array([tok.bos_id] if tok.bos_id is not None and tok.bos_id != tok.eos_id else [], dtype=dtype)
    eos = np.array([tok.eos_id], dtype=dtype)

    def labelled() -> Iterator[tuple[int, str, str]]:
        if plan.single_doc is not None:
            yield 0, plan.single_doc[0], "train"
            yield 0, plan.single_doc[1], "val"
            return
        it = reader.docs(i)
        for j in range(plan.n_docs[i]):
            doc = next(it)
            is_val = reader.draw(i, j, doc) < reader.val_fraction and (i, j) not in plan.forced_train
            yield j, doc, "val" if is_val or (i, j) in plan.forced_val else "train"
        it.close()

    def flush(batch: list[str], splits: list[str]) -> None:
        encoded = tok.encode_batch_numpy(batch, dtype=dtype)
        for split in ("train", "val"):
            parts = [p for ids, s in zip(encoded, splits) if s == split for p in (bos, ids, eos)]
            if parts:
                writers[split].write(np.concatenate(parts))
        bar.advance(task, sum(len(t) for t in batch))

    batch: list[str] = []
    splits: list[str] = []
    size = 0
    for j, doc, split in labelled():
        batch.append(doc)
        splits.append(split)
        counts[split] += 1
        if split == "val" and plan.single_doc is None:
            val_indices.append(j)
        size += len(doc)
        if size >= _ENCODE_BATCH_BYTES or len(batch) >= _ENCODE_BATCH_DOCS:
            flush(batch, splits)
            batch, splits, size = [], [], 0
    if batch:
        flush(batch, splits)
    for w in writers.values():
        w.close()
    if plan.single_doc is not None:
        counts = {"train": 1, "val": 0}  # one document: its tail is val tokens, not a val document
    return writers, counts, val_indices


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
) -> Manifest:
    reader = _Reader(paths, settings, exts)
    train_bpe = isinstance(tokenizer, str) and parse_spec(tokenizer)[0] == "bpe"
    with _Progress(progress) as bar:
        plan = _scan(reader, settings, given, train_bpe, bar)

    if isinstance(tokenizer, Tokenizer):
        tok = tokenizer
    else:
        texts = plan.train_texts
        tok = build_tokenizer(spec, (lambda: iter(texts)) if train_bpe else None)
        wanted = parse_spec(spec)[1]
        if wanted is not None and tok.vocab_size < wanted:
            log.warning(
                "the corpus is too small for %s: the trained vocabulary has %d tokens", spec, tok.vocab_size
            )
    plan.train_texts = []  # up to 50 MB: free it before tokenising
    tok.save(tmp / "tokenizer")
    dtype = token_dtype(tok.vocab_size)

    infos: list[SourceInfo] = []
    with _Progress(progress) as bar:
        task = bar.task("tokenizing", plan.chars)
        for i, path in enumerate(paths):
            writers, counts, val_indices = _write_source(i, reader, plan, tok, tmp, dtype, bar, task)
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
                    train_docs=counts["train"],
                    val_docs=counts["val"],
                    train_tokens=writers["train"].tokens,
                    val_tokens=writers["val"].tokens,
                    train_shards=writers["train"].files,
                    val_shards=writers["val"].files,
                    truncated=plan.truncated[i],
                    val_doc_indices=val_indices,
                    stats=plan.stats[i].as_dict(),
                )
            )

    totals = {
        "docs": sum(plan.n_docs),
        "train_docs": sum(s.train_docs for s in infos),
        "val_docs": sum(s.val_docs for s in infos),
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
        vocab_size=tok.vocab_size,
        eos_id=tok.eos_id,
        bos_id=tok.bos_id if tok.bos_id is not None and tok.bos_id != tok.eos_id else None,
        dtype=dtype.name,
        sources=infos,
        totals=totals,
        stats=all_stats.as_dict(),
        val_split=plan.val_split,
        settings=settings,
    )
    manifest._write(tmp)  # last: a folder with a manifest is a complete folder
    return manifest


def _slug(sources: Sequence[str | os.PathLike[str]], tokenizer: str | Tokenizer) -> str:
    first = str(sources[0])
    name = "stdlib" if first == STDLIB_ALIAS else Path(first).name or "data"
    tok = tokenizer.spec if isinstance(tokenizer, Tokenizer) else str(tokenizer)
    tok = Path(tok).name if "/" in tok else tok
    return re.sub(r"[^A-Za-z0-9._-]+", "", f"{name}-{tok}")[:60] or "data"


def cached_prepare(
    sources: Sequence[str | os.PathLike[str]],
    tokenizer: str | Tokenizer = "bpe:8192",
    *,
    cache_root: str | os.PathLike[str] | None = None,
    **kwargs: Any,
) -> Manifest:
    """:func:`prepare` into ``cache_root/<name>-<key>`` (default root: ``default_cache_dir()/datasets``).

    What ``train`` calls: the first run prepares, later runs with the same inputs reuse the shards.
    ``kwargs`` are those of :func:`prepare` (``cache`` is always on).
    """
    if isinstance(sources, (str, os.PathLike)):
        sources = [sources]
    if not sources:
        raise ConfigError(
            "no data sources given; pass at least one file, folder, .jsonl, .parquet or dataset"
        )
    kwargs.pop("cache", None)
    key_args = {
        k: kwargs[k]
        for k in (
            "text_field", "extensions", "val_fraction", "min_val_docs", "max_bytes", "seed",
            "tokenizer_train_bytes",
        )
        if k in kwargs
    }  # fmt: skip
    key = cache_key(sources, tokenizer, **key_args)
    root = Path(cache_root).expanduser() if cache_root is not None else default_cache_dir() / "datasets"
    return prepare(sources, root / f"{_slug(sources, tokenizer)}-{key[:16]}", tokenizer, cache=True, **kwargs)
