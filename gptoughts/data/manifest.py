"""The description of a prepared folder (``manifest.json``): what it holds, how to load and check it.

Layout of a prepared folder::

    manifest.json            what is below, how it was made (cache key), token counts, checksums, stats
    tokenizer/               the tokenizer, loadable by Tokenizer.load and transformers.AutoTokenizer
    train_<src>_<k>.bin      raw numpy arrays of token ids (uint16 when the vocab fits, else uint32)
    val_<src>_<k>.bin

Every shard and tokenizer file carries a crc32 in the manifest; :meth:`Manifest.load` refuses a manifest with a
missing or wrong field, naming it, and :meth:`Manifest.verify` checks every file against its checksum.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gptoughts.data.tokenizer import Tokenizer
from gptoughts.errors import ConfigError, DataError

# 2: long documents cut into train head + val tail; crc32 checksums of shards and tokenizer files.
FORMAT_VERSION = 2
# Checksum of shards and tokenizer files. It detects damage (truncation, flipped bits, a partly copied file),
# not forgery (a forger rewrites the manifest too; the loader's id check guards the model), so the fastest
# adequate one is used (speeds measured: docs/data.md, "Integrity").
CHECKSUM = "crc32"
_CHECKSUM_BLOCK = 1 << 22
SHARD_NAME = re.compile(r"(train|val)_(\d+)_(\d+)\.bin")


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (half the disk and memory bandwidth), else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 65535 else np.dtype(np.uint32)


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
                    if checksums and crc32_file(path) != want:
                        return path, f"does not match its checksum in {self.dir}/manifest.json (damaged)"
        tok_dir = self.dir / "tokenizer"
        for name, want in self.tokenizer_files.items():
            path = tok_dir / name
            if not path.is_file():
                return path, "is missing"
            if checksums and crc32_file(path) != want:
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

    def write(self, directory: Path) -> None:
        """Write ``directory/manifest.json`` durably (the last file of a build: it marks the folder complete)."""
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


def crc32_file(path: Path, limit: int | None = None) -> str:
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
    for k, s in enumerate(data["sources"]):
        problem = _source_problem(s, k, data["shard_tokens"])
        if problem is not None:
            return problem
    for name in ("train_tokens", "val_tokens"):
        if data["totals"].get(name) != sum(s[name] for s in data["sources"]):
            return f"field totals.{name} is not the sum over the sources"
    if data["totals"]["train_tokens"] == 0:
        return "field totals.train_tokens is 0"
    return None


def _source_problem(s: Any, k: int, shard_tokens: int) -> str | None:
    """What is wrong with ``sources[k]`` of a manifest (the first problem found), or None."""
    where = f"sources[{k}]."
    problem = _fields_problem(s, _SOURCE_FIELDS, where)
    if problem is not None:
        return problem
    if s["index"] != k:
        return f"field {where}index is {s['index']}"
    for split in ("train", "val"):
        names, checks, n = s[f"{split}_shards"], s[f"{split}_checksums"], s[f"{split}_tokens"]
        if len(names) != -(-n // shard_tokens):  # ceil: every shard but the last is full
            return f"field {where}{split}_shards has {len(names)} file(s) for {n} tokens"
        if len(checks) != len(names):
            return f"field {where}{split}_checksums has {len(checks)} entries for {len(names)} shard(s)"
        for name in names:
            m = SHARD_NAME.fullmatch(name)
            if m is None or m.group(1) != split or int(m.group(2)) != k:
                return f"field {where}{split}_shards names {name!r}"
    return None
