"""Read documents (strings) out of the corpus formats users have on disk.

Sources (:func:`source_kind`): a text file (one document; cut at line boundaries into ~1 MB documents above
:data:`CHUNK_BYTES`), a folder (recursive, sorted, hidden folders and :data:`SKIPPED_DIRS` not entered, binary
files skipped and counted), ``.jsonl`` (and a ``.json`` source of JSON Lines) and ``.parquet`` (field
``text_field``), a ``datasets.save_to_disk`` folder (read with pyarrow: ``datasets`` is not a dependency), and
``@stdlib`` (the embedded default corpus).
Reads are streamed so memory stays bounded whatever the file or row-group size. Invalid UTF-8 is replaced and
counted in :class:`SourceStats`; an unreadable or corrupt file is a DataError naming it.
Formats, and the memory measurements behind the reader settings: ``docs/data.md``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shlex
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from gptoughts.errors import DataError

log = logging.getLogger("gptoughts.data")

DEFAULT_EXTENSIONS: tuple[str, ...] = (
    "txt", "md", "rst", "py", "json", "c", "h", "js", "ts", "java", "go", "rs", "toml", "yaml", "yml",
    "html", "css", "sh", "tex",
)  # fmt: skip

# Folders never entered when walking a directory: caches, VCS metadata and installed third-party packages
# (the stdlib folder contains site-packages, which would otherwise add GBs of other people's code).
SKIPPED_DIRS: frozenset[str] = frozenset(
    {"__pycache__", "site-packages", "dist-packages", "node_modules", ".git", ".hg", ".svn", ".venv", "venv"}
)

# Text files above this size are split into documents of about this size at line boundaries.
CHUNK_BYTES = 1 << 20
_UTF8_BOM = b"\xef\xbb\xbf"
# A NUL byte in the first BINARY_PROBE bytes marks a file as binary (the heuristic git and grep use).
BINARY_PROBE = 8192
STDLIB_ALIAS = "@stdlib"
# File extensions parsed structurally (not as plain text) when met inside a folder.
_STRUCTURED = ("jsonl", "parquet")
_PARQUET_BATCH_ROWS = 1024
_PARQUET_BUFFER_BYTES = 1 << 20
_COLUMN_SLICE_BYTES = 1 << 20

# Magic bytes of compressed files (read as binary: decompress them first) and the command that does it.
_COMPRESSED: tuple[tuple[bytes, str], ...] = (
    (b"\x1f\x8b", "gzip"), (b"BZh", "bzip2"), (b"\xfd7zXZ\x00", "xz"), (b"\x28\xb5\x2f\xfd", "zstd"),
    (b"PK\x03\x04", "zip"), (b"\xff\xfe", "utf-16"), (b"\xfe\xff", "utf-16"),
)  # fmt: skip
_PACKED_EXTENSIONS = frozenset({".gz", ".bz2", ".xz", ".zst", ".zip"})
_UNPACK = {"gzip": "gunzip -k", "bzip2": "bunzip2 -k", "xz": "unxz -k", "zstd": "unzstd", "zip": "unzip"}
_SURROGATE = re.compile("[\ud800-\udfff]")
_MISSING_MSG = "does not exist; pass a file, folder, .jsonl, .parquet or a saved HF dataset"
# Said of a saved dataset found inside a folder: not read (its text is in .arrow files), which surprises a user.
_SAVED_NOTE = ": pass it as its own --data"
# (root, skipped folders) already reported: a corpus is walked several times per command (size, key, reads)
_REPORTED: set[tuple[str, tuple[str, ...]]] = set()


@dataclass
class SourceStats:
    """Counters filled while reading a source (they add up across sources with :meth:`merge`)."""

    files_read: int = 0
    bytes_read: int = 0  # bytes of text consumed (file bytes for text/jsonl, UTF-8 bytes for columnar data)
    docs: int = 0
    skipped_binary: int = 0
    skipped_empty: int = 0  # empty documents (empty files, empty strings, nulls): nothing to learn from
    invalid_utf8_files: int = 0  # files (or jsonl lines / rows) that had invalid UTF-8
    replaced_chars: int = 0  # invalid UTF-8 sequences replaced by U+FFFD

    def merge(self, other: SourceStats) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def stdlib_path() -> Path:
    """The running interpreter's standard library source folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def resolve_source(path: str | os.PathLike[str]) -> Path:
    """The absolute path of a source, with ``@stdlib`` expanded; DataError when it does not exist."""
    if str(path) == STDLIB_ALIAS:
        return stdlib_path()
    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(f"{path} {_MISSING_MSG}")
    p = p.resolve()
    try:  # bytes that are not UTF-8 (Latin-1 from an old archive), which Python keeps as surrogates
        str(p).encode("utf-8")
    except UnicodeEncodeError:
        shown = os.fsencode(p).decode("utf-8", "replace")
        raise DataError(
            f"{shown}: its name is not UTF-8, and a run records its sources by name in config.toml (UTF-8); rename "
            f"it (convmv -f latin1 -t utf8 --notest converts Latin-1 names)"
        ) from None
    if p.is_dir():
        _refuse_gptoughts_output(p)
    return p


def check_distinct(sources: Iterable[str | os.PathLike[str]]) -> list[Path]:
    """The sources resolved, refusing one given twice or inside another given one: its documents would be read
    twice, trained on twice, and a document held out of one copy trained on in the other."""
    given = list(sources)
    paths = [resolve_source(s) for s in given]
    for a in range(len(paths)):
        for b in range(len(paths)):
            if a == b:
                continue
            if paths[a] == paths[b] and a < b:
                raise DataError(
                    f"{given[b]} is given twice as a source (as {given[a]} too): it would be read twice; give "
                    f"each source once (a curriculum weights sources with data.phases)"
                )
            if paths[a] != paths[b] and paths[a].is_relative_to(paths[b]):
                raise DataError(
                    f"{given[a]} is inside {given[b]}, also a source: it would be read twice; give it once "
                    f"(a curriculum weights sources with data.phases)"
                )
    return paths


def read_json_dict(path: Path) -> dict | None:
    """A JSON file's object, None where it is missing, unreadable or not an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def prepared_manifest(folder: Path) -> dict | None:
    """The manifest.json of a folder ``prepare`` wrote (any format version), else None."""
    if not (folder / "manifest.json").is_file():
        return None
    data = read_json_dict(folder / "manifest.json")
    return data if data is not None and "cache_key" in data and "format_version" in data else None


def is_run_folder(folder: Path) -> bool:
    """A training run's folder: a run.json that gptoughts wrote, with family and args (``training/rundir.is_run``
    asks this too)."""
    if not (folder / "run.json").is_file():
        return False
    record = read_json_dict(folder / "run.json")
    return record is not None and "family" in record and "args" in record


def free_name(path: Path) -> Path:
    """``path`` when nothing is there, else ``path`` with ``-2``, ``-3``, ... before its suffix (a folder's name has
    none: ``run.v1`` gives ``run.v1-2``): the first name not taken."""
    stem, suffix = (path.name, "") if path.is_dir() else (path.stem, path.suffix)
    free, n = path, 2
    while free.exists():
        free, n = path.with_name(f"{stem}-{n}{suffix}"), n + 1
    return free


def made_from_flags(manifest: dict, tokenizer: bool = True) -> str:
    """The ``--data`` flags (and ``--tokenizer``) of the corpus a prepared dataset was made from, as a command takes
    them; ``--data CORPUS`` for a damaged manifest."""
    try:
        srcs = [
            STDLIB_ALIAS if s.get("given") == STDLIB_ALIAS else str(s["path"]) for s in manifest["sources"]
        ]
        flags = " ".join(f"--data {shlex.quote(s)}" for s in srcs)
        if tokenizer:
            flags += f" --tokenizer {shlex.quote(str(manifest['tokenizer_spec']))}"
    except (KeyError, TypeError, AttributeError):  # a damaged manifest: no sources to name
        flags = "--data CORPUS"
    return flags


def refuse_prepared(sources: Iterable[str | os.PathLike[str]], *, with_model_tokenizer: bool = False) -> None:
    """A prepared dataset given as a corpus is refused, naming the corpus it was made from: its files are token
    shards, not text. ``with_model_tokenizer``: said for eval, which tokenizes a corpus with the model's own tokenizer
    (so takes no --tokenizer); else for train, which tokenizes into a cache of its own."""
    for given in sources:
        p = Path(given).expanduser()
        m = prepared_manifest(p) if p.is_dir() else None
        if m is None:
            continue
        if with_model_tokenizer:
            why = "eval tokenizes a corpus with the model's own tokenizer"
        else:
            why = "train tokenizes into a cache of its own (`gptoughts prepare` without --out fills it ahead)"
        raise DataError(
            f"{given} is a prepared dataset (token shards from `gptoughts prepare --out`), not a corpus: {why}; pass "
            f"the corpus it was made from instead: {made_from_flags(m, tokenizer=not with_model_tokenizer)}"
        )


def _refuse_gptoughts_output(p: Path) -> None:
    """A prepared dataset or a run given as a source is refused: its files are gptoughts output, not text."""
    refuse_prepared([p])
    if is_run_folder(p):
        raise DataError(
            f"{p} is a gptoughts run, not a corpus; pass the corpus it trained on with --data (its "
            f"config.toml lists it under data.sources)"
        )


def normalize_extensions(extensions: Iterable[str] | None) -> tuple[str, ...]:
    """Lower-case extensions without the leading dot; None or empty means :data:`DEFAULT_EXTENSIONS`."""
    if not extensions:
        return DEFAULT_EXTENSIONS
    if isinstance(extensions, str):  # "py,md" from a command line
        extensions = extensions.split(",")
    out = tuple(dict.fromkeys(e.strip().lstrip(".").lower() for e in extensions if e.strip()))
    return out or DEFAULT_EXTENSIONS


def _is_hf_dataset(p: Path) -> bool:
    return (p / "dataset_dict.json").is_file() or (
        (p / "state.json").is_file() and ((p / "dataset_info.json").is_file() or any(p.glob("*.arrow")))
    )


def source_kind(path: str | os.PathLike[str]) -> str:
    """One of ``"text"``, ``"folder"``, ``"jsonl"`` (a .json file of JSON Lines too), ``"parquet"``, ``"hf_dataset"``."""
    p = resolve_source(path)
    if p.is_dir():
        return "hf_dataset" if _is_hf_dataset(p) else "folder"
    suffix = p.suffix.lower().lstrip(".")
    if suffix in ("jsonl", "parquet"):
        return suffix
    return "jsonl" if suffix == "json" and _json_lines(p) else "text"


def _json_lines(p: Path) -> bool:
    """Whether a .json file is JSON Lines (what datasets' ``to_json`` writes by default): its first line one whole
    object. Read as text, its records' syntax and escapes would be trained on, and its documents run together."""
    try:
        with open(p, "rb") as f:
            first = f.readline(CHUNK_BYTES).removeprefix(_UTF8_BOM).strip()
    except OSError:  # reading it says why
        return False
    if not (first.startswith(b"{") and first.endswith(b"}")):
        return False
    try:
        return isinstance(json.loads(first), dict)
    except (ValueError, RecursionError):
        return False


def walk_files(root: Path, extensions: tuple[str, ...], *, report: bool = False) -> Iterator[Path]:
    """Files under ``root`` with a listed extension, in a deterministic depth-first sorted order.

    Deterministic order matters: document indices feed the train/val split hash and the shard layout, so
    the same folder must give the same dataset on every machine (os.walk order is filesystem dependent).

    Prepared datasets and training runs below ``root`` (``prepare . --out ./data``, ``train --data .`` writing
    ``./runs/...``) are not entered: their JSON files are not text to learn from, and reading them would
    change the corpus (its cache key, its BPE) after every prepare or run, so a resume would never match. Nor are
    saved Hugging Face datasets: their text is in .arrow files, their JSON files are metadata (a warning says to pass
    them as sources of their own).
    What was skipped is logged once, in one line; with ``report`` (a walk that reads the corpus, not a probe for
    one kind of file), so are the files not read (other extensions) and the links not followed.
    """
    wanted = {"." + e for e in extensions}
    skipped: list[str] = []
    other: dict[str, int] = {}  # files not read, by extension
    links: list[str] = []  # symbolic links to folders (not followed) and broken ones
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        if here != root and (what := _not_corpus(here, filenames)):
            skipped.append(f"{here.relative_to(root).as_posix()} ({what})")
            dirnames[:] = []
            continue
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in SKIPPED_DIRS)
        if report:  # os.walk lists a link to a folder among the folders and does not enter it
            links += [(here / d).relative_to(root).as_posix() for d in dirnames if (here / d).is_symlink()]
        for name in sorted(filenames):
            if name.startswith("."):
                continue
            ext = os.path.splitext(name)[1].lower()
            if ext in wanted:
                path = here / name
                if _read_elsewhere(path, root, wanted):
                    continue
                if path.is_file():  # not a broken symbolic link, a socket or a fifo
                    yield path
                elif report and path.is_symlink():
                    links.append(path.relative_to(root).as_posix())
            elif report:
                other[ext] = other.get(ext, 0) + 1
    if skipped and (key := (str(Path(root).resolve()), tuple(skipped))) not in _REPORTED:
        _REPORTED.add(key)
        shown = ", ".join(skipped[:3]) + (f" and {len(skipped) - 3} more" if len(skipped) > 3 else "")
        level = logging.WARNING if any(_SAVED_NOTE in s for s in skipped) else logging.INFO
        log.log(
            level,
            "%s: skipped %d folder(s) gptoughts wrote or datasets saved, not corpus text: %s",
            key[0],
            len(skipped),
            shown,
        )
    if report and Path(root) != stdlib_path():  # the embedded default: its .so, .pem, ... are no news
        _report_unread(Path(root), extensions, other, links)


def _read_elsewhere(path: Path, root: Path, wanted: set[str]) -> bool:
    """A symbolic link to a file this walk reads under its own name (``latest.txt -> v3.txt``): read twice, the
    document could be held out as val in one copy and trained on in the other."""
    if not path.is_symlink():
        return False
    target = path.resolve()
    if not (target.is_file() and target.is_relative_to(root.resolve()) and target.suffix.lower() in wanted):
        return False
    parts = target.relative_to(root.resolve()).parts
    return not any(p.startswith(".") or p in SKIPPED_DIRS for p in parts)


def _not_corpus(folder: Path, filenames: list[str]) -> str:
    """What a folder below a corpus is when it is not corpus text (a prepared dataset, a run, a saved dataset), else
    "". Asked only where a file that marks one is there: a walk stats nothing more."""
    if not {"manifest.json", "run.json", "state.json", "dataset_dict.json"} & set(filenames):
        return ""
    if prepared_manifest(folder) is not None:
        return "a prepared dataset"
    if is_run_folder(folder):
        return "a gptoughts run"
    if _is_hf_dataset(folder):  # walked, its JSON metadata would be read as text, and its text (.arrow) not
        return f"a saved Hugging Face dataset{_SAVED_NOTE}"
    return ""


def _report_unread(root: Path, extensions: tuple[str, ...], other: dict[str, int], links: list[str]) -> None:
    """One line, once per folder, naming what a walk did not read: files of other extensions (a warning when
    some are .jsonl/.parquet, which gptoughts reads when listed, or compressed), links to folders (not followed)
    and broken links."""
    if not other and not links:
        return
    key = (str(root.resolve()), tuple(extensions), tuple(sorted(other.items())), tuple(links))
    if key in _REPORTED:
        return
    _REPORTED.add(key)
    parts = []
    if other:
        counts = sorted(other.items(), key=lambda kv: (-kv[1], kv[0]))
        named = [f"{n} {ext}" if ext else f"{n} without extension" for ext, n in counts]
        shown = ", ".join(named[:8]) + (f" and {len(named) - 8} more kinds" if len(named) > 8 else "")
        readable = sorted(e.lstrip(".") for e in other if e.lstrip(".") in _STRUCTURED)
        packed = [e for e in other if e in _PACKED_EXTENSIONS]
        hints = [f"to read them too: --extensions {','.join((*extensions, *readable))}"] if readable else []
        hints += ["compressed files are never read: decompress them first"] if packed else []
        hint = "; ".join(hints) or "--extensions lists those read"
        parts.append(f"{sum(other.values())} file(s) of other extensions ({shown}; {hint})")
    if links:
        shown = ", ".join(links[:5]) + (f" and {len(links) - 5} more" if len(links) > 5 else "")
        parts.append(
            f"{len(links)} symbolic link(s) to folders (not followed: pass them as --data) or to nothing: {shown}"
        )
    likely_data = any(e.lstrip(".") in _STRUCTURED or e in _PACKED_EXTENSIONS for e in other)
    level = logging.WARNING if links or likely_data else logging.INFO
    log.log(level, "%s: not read: %s", key[0], "; ".join(parts))


def source_fingerprint(path: str | os.PathLike[str], extensions: Iterable[str] | None = None) -> dict:
    """A cheap identity of a source's content, used in the prepare cache key.

    Like ``make``, it hashes file metadata rather than content: (relative path, size, mtime_ns) of every
    file that would be read. Hashing GBs of content on every ``train`` start would cost seconds to minutes;
    any edit changes size or mtime. (The manifest also records a content sha256 for single files.)
    """
    import hashlib

    p = resolve_source(path)
    exts = normalize_extensions(extensions)
    h = hashlib.sha256()
    if p.is_dir():
        # Streamed (a corpus of millions of files is never listed in memory). A saved dataset: the files read and
        # those naming them, not every file below (a prepare or a run written inside it would change its key).
        files = _hf_dataset_files(p) if _is_hf_dataset(p) else walk_files(p, exts, report=True)
        for f in files:
            st = _stat(f)
            # os.fsencode: a name that is not UTF-8 (Latin-1 from an old archive) is hashed as its own bytes
            h.update(os.fsencode(f"{f.relative_to(p).as_posix()}\0{st.st_size}\0{st.st_mtime_ns}\n"))
    else:
        st = _stat(p)
        h.update(os.fsencode(f"{p.name}\0{st.st_size}\0{st.st_mtime_ns}\n"))
    return {"path": str(p), "kind": source_kind(p), "stat_sha256": h.hexdigest()}


def content_sha256(path: Path) -> str:
    """sha256 of a file's bytes (streamed)."""
    import hashlib

    h = hashlib.sha256()
    with _readable(path), open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def _unreadable(path: Path, e: OSError) -> DataError:
    return DataError(
        f"cannot read {e.filename or path} ({e.strerror or e}); fix its permissions or remove it from the corpus"
    )


def _stat(path: Path) -> os.stat_result:
    try:
        return path.stat()
    except OSError as e:
        raise _unreadable(path, e) from None


@contextlib.contextmanager
def _readable(path: Path) -> Iterator[None]:
    """``with _readable(path):`` turns an OSError raised while reading ``path`` into a one-line DataError."""
    try:
        yield
    except OSError as e:
        raise _unreadable(path, e) from None


def _guarded(batches: Iterable, p: Path, kind: str) -> Iterator:
    """Record batches from pyarrow, with a corrupt file reported as a one-line DataError naming it."""
    import pyarrow as pa

    it = iter(batches)
    while True:
        try:
            batch = next(it)
        except StopIteration:
            return
        except (pa.ArrowException, OSError) as e:
            reason = " ".join(str(e).split())[:160]
            raise DataError(f"{p} is not a readable {kind} file ({reason}); check or re-save it") from None
        yield batch


# --------------------------------------------------------------------------------------------- decoding


def _decode(raw: bytes, stats: SourceStats) -> str:
    """UTF-8 decode; invalid sequences become U+FFFD and are counted."""
    try:
        return raw.decode("utf-8")  # fast path: almost every file is valid
    except UnicodeDecodeError:
        text = raw.decode("utf-8", errors="replace")
        # Each invalid sequence became one U+FFFD; genuine U+FFFD already in the file (bytes EF BF BD) are
        # not replacements, so subtract them.
        replaced = text.count("\ufffd") - raw.count(b"\xef\xbf\xbd")
        stats.invalid_utf8_files += 1
        stats.replaced_chars += max(replaced, 1)
        return text


def _utf8_boundary(buf: bytes | bytearray, end: int) -> int:
    """Largest cut position <= end that does not split a UTF-8 sequence (continuation bytes are 10xxxxxx)."""
    cut = end
    while cut > 0 and end - cut < 4 and (buf[cut] & 0xC0) == 0x80:
        cut -= 1
    return cut if cut > 0 else end


# --------------------------------------------------------------------------------------------- readers


def _read_text_file(p: Path, stats: SourceStats, *, skip_binary: bool) -> Iterator[str]:
    with _readable(p), open(p, "rb") as f:
        head = f.read(CHUNK_BYTES + 1)
        if skip_binary and b"\0" in head[:BINARY_PROBE]:
            stats.skipped_binary += 1
            return
        stats.files_read += 1
        whole = len(head) <= CHUNK_BYTES
        if head.startswith(_UTF8_BOM):  # Windows editors' "UTF-8 with BOM": a mark, not text to learn from
            stats.bytes_read += len(_UTF8_BOM)
            head = head[len(_UTF8_BOM) :]
        if whole:  # the common case: one file, one document
            stats.bytes_read += len(head)
            yield from _emit(_decode(head, stats), stats)
            return
        # Large file: stream it in ~1 MB documents cut after a newline (a newline byte never occurs inside
        # a multi-byte UTF-8 sequence, so the byte-level cut is safe for decoding).
        buf = bytearray(head)
        while True:
            more = f.read(CHUNK_BYTES)
            buf += more
            while len(buf) > CHUNK_BYTES or (not more and buf):
                if not more and len(buf) <= CHUNK_BYTES:
                    cut = len(buf)
                else:
                    nl = buf.rfind(b"\n", 0, CHUNK_BYTES)
                    cut = nl + 1 if nl > CHUNK_BYTES // 2 else _utf8_boundary(buf, CHUNK_BYTES)
                piece = bytes(buf[:cut])
                del buf[:cut]
                stats.bytes_read += len(piece)
                yield from _emit(_decode(piece, stats), stats)
            if not more:
                return


def _emit(text: str, stats: SourceStats) -> Iterator[str]:
    if not text.strip():
        stats.skipped_empty += 1
        return
    stats.docs += 1
    yield text


def _read_jsonl(p: Path, text_field: str, stats: SourceStats) -> Iterator[str]:
    stats.files_read += 1
    seen_field = False
    with _readable(p), open(p, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            stats.bytes_read += len(raw)
            if lineno == 1 and raw.startswith(_UTF8_BOM):  # a UTF-8 byte order mark (Windows editors)
                raw = raw[len(_UTF8_BOM) :]
            if not raw.strip():
                continue
            line = _decode(raw, stats)
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{p}:{lineno} is not valid JSON ({e.msg}); fix or remove that line"
                ) from None
            if not isinstance(rec, dict):
                raise DataError(
                    f"{p}:{lineno} is a JSON {type(rec).__name__}, not an object; each line must be "
                    f'{{"{text_field}": "..."}}'
                )
            if text_field not in rec:
                keys = ", ".join(sorted(rec)) or "none"
                fix = (
                    "fix or remove that line (the lines before it have the field)"
                    if seen_field
                    else "pass --text_field with one of them"
                )
                raise DataError(f"{p}:{lineno} has no field '{text_field}' (available keys: {keys}); {fix}")
            seen_field = True
            value = rec[text_field]
            if value is None:
                stats.skipped_empty += 1
                continue
            if not isinstance(value, str):
                raise DataError(
                    f"{p}:{lineno} field '{text_field}' is a {type(value).__name__}, not a string; "
                    f"pass --text_field naming a text field"
                )
            if b"\\ud" in raw or b"\\uD" in raw:  # JSON escapes can encode lone surrogates
                value = _drop_surrogates(value, stats)
            yield from _emit(value, stats)


def _drop_surrogates(value: str, stats: SourceStats) -> str:
    """Replace lone surrogates (invalid in UTF-8, refused by the tokenizer) by U+FFFD, counted."""
    fixed, n = _SURROGATE.subn("\ufffd", value)
    if n:
        stats.invalid_utf8_files += 1
        stats.replaced_chars += n
    return fixed


def _column_batches(batches: Iterable, p: Path, text_field: str, stats: SourceStats) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.compute as pc

    for batch in batches:
        col = batch.column(text_field)
        if pa.types.is_dictionary(col.type) and (
            pa.types.is_string(col.type.value_type) or pa.types.is_large_string(col.type.value_type)
        ):  # a categorical text column (pandas' category): its strings decoded
            col = col.cast(col.type.value_type)
        if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
            raise DataError(
                f"{p}: column '{text_field}' has type {col.type}, not string; pass --text_field naming a "
                f"text column"
            )
        lengths = pc.binary_length(col)
        nbytes = int(pc.sum(lengths).as_py() or 0)
        # Python strings for ~_COLUMN_SLICE_BYTES of the batch at a time, not for all of it (a writer's batch
        # of 1000 rows of 20 KB documents is 20 MB).
        step = max(1, len(col) * _COLUMN_SLICE_BYTES // max(nbytes, 1))
        for start in range(0, len(col), step):
            sizes = lengths.slice(start, step).to_pylist()
            for value, size in zip(col.slice(start, step).to_pylist(), sizes):
                # counted row by row, as consumed: a reader that stops at data.max_bytes stops at its row
                stats.bytes_read += size or 0
                if value is None:
                    stats.skipped_empty += 1
                    continue
                yield from _emit(value, stats)


def _check_column(schema_names: list[str], p: Path, text_field: str) -> None:
    if text_field not in schema_names:
        raise DataError(
            f"{p} has no column '{text_field}' (columns: {', '.join(schema_names)}); "
            f"pass --text_field with one of them"
        )


def _read_parquet(p: Path, text_field: str, stats: SourceStats) -> Iterator[str]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(p, buffer_size=_PARQUET_BUFFER_BYTES, pre_buffer=False)
    except Exception as e:  # pyarrow raises ArrowInvalid & co. for a corrupt or non-parquet file
        raise DataError(f"{p} is not a readable parquet file ({e}); check the file") from None
    _check_column(pf.schema_arrow.names, p, text_field)
    stats.files_read += 1
    # Only the text column is read, a batch of ~_COLUMN_SLICE_BYTES at a time, from a buffered stream
    # without pre-buffering or reader threads: memory is bounded by the file's page size, whatever the size
    # of its row groups (pyarrow's defaults read a whole row group at once: measured, docs/data.md).
    rows = _parquet_batch_rows(pf, text_field)
    batches = pf.iter_batches(batch_size=rows, columns=[text_field], use_threads=False)
    yield from _column_batches(_guarded(batches, p, "parquet"), p, text_field, stats)


def _parquet_batch_rows(pf: object, text_field: str) -> int:
    """Rows per batch for ~_COLUMN_SLICE_BYTES of text, from the file's metadata (at most 1024)."""
    md = pf.metadata  # type: ignore[attr-defined]
    size = rows = 0
    for g in range(md.num_row_groups):
        rg = md.row_group(g)
        rows += rg.num_rows
        for k in range(rg.num_columns):
            if rg.column(k).path_in_schema == text_field:
                size += rg.column(k).total_uncompressed_size
    return max(1, min(_PARQUET_BATCH_ROWS, _COLUMN_SLICE_BYTES * rows // max(size, 1)))


def _arrow_batches(f: Path) -> Iterator:
    import pyarrow as pa
    import pyarrow.ipc as ipc

    # datasets.save_to_disk writes the IPC *stream* format; accept the file format too. Plain reads, not
    # a memory map: mapped pages stay resident until the file is closed, so memory would grow with the file
    # (measured: docs/data.md).
    with pa.OSFile(str(f), "r") as source:
        try:
            reader = ipc.open_stream(source)
        except pa.ArrowInvalid:
            source.seek(0)
            reader = ipc.open_file(source)
            for i in range(reader.num_record_batches):
                yield reader.get_batch(i)
            return
        yield from reader


def _hf_arrow_files(p: Path) -> list[Path]:
    if (p / "dataset_dict.json").is_file():
        try:
            splits = json.loads((p / "dataset_dict.json").read_text()).get("splits", [])
        except (json.JSONDecodeError, AttributeError):
            splits = []
        splits = splits or sorted(d.name for d in p.iterdir() if d.is_dir())
        if "train" not in splits:
            raise DataError(
                f"{p} is a DatasetDict without a 'train' split (splits: {', '.join(splits)}); "
                f"pass the split folder itself, e.g. {p / splits[0]}"
                if splits
                else f"{p} is a DatasetDict with no splits; pass a folder holding *.arrow files"
            )
        p = p / "train"
    files: list[Path] = []
    state = p / "state.json"
    if state.is_file():
        try:
            files = [p / d["filename"] for d in json.loads(state.read_text()).get("_data_files", [])]
        except (json.JSONDecodeError, KeyError, TypeError):
            files = []
        # a name read from a file stays inside its folder: the dataset is that folder (what its key covers, what
        # is copied or moved with it), never a file elsewhere on the machine
        inside = Path(os.path.normpath(p))
        outside = next((f for f in files if not Path(os.path.normpath(f)).is_relative_to(inside)), None)
        if outside is not None:
            raise DataError(
                f"{state} lists {os.path.normpath(outside)}, outside {p}; copy that file into {p} and list it by "
                f"its name, or re-save the dataset with datasets' save_to_disk"
            )
    if not files:
        files = sorted(p.glob("*.arrow"))
    missing = [f for f in files if not f.is_file()]
    if missing:
        raise DataError(f"{missing[0]} listed in {state} is missing; re-save the dataset")
    if not files:
        raise DataError(f"{p} holds no *.arrow files; pass a folder written by datasets.save_to_disk")
    return files


def _hf_dataset_files(p: Path) -> list[Path]:
    """The files a saved dataset's documents depend on: the arrow files read and the JSON files that list them."""
    listing = [p / "dataset_dict.json", p / "state.json", p / "train" / "state.json"]
    return sorted({*(f for f in listing if f.is_file()), *_hf_arrow_files(p)})


def files_read(path: Path, extensions: tuple[str, ...]) -> Iterator[Path]:
    """The files reading source ``path`` opens (a folder's files of ``extensions``, a DatasetDict's train
    split), without opening them: what the plan counts."""
    kind = source_kind(path)
    if kind == "folder":
        yield from walk_files(path, extensions)
    elif kind == "hf_dataset":
        yield from _hf_arrow_files(path)
    else:
        yield path


def text_bytes_estimate(f: Path, text_field: str, sample: int = 1 << 20) -> int:
    """About how many bytes of text reading file ``f`` gives: its size; for JSONL, its size times the share of text
    in its first ``sample`` bytes (JSON's syntax and escapes: a French corpus's were planned as 1.6x its text);
    for Parquet (compressed) the uncompressed size of its text column, from the file's footer (no data read)."""
    size = _stat(f).st_size
    if f.suffix.lower() == ".jsonl":
        stats, text = SourceStats(), 0
        docs = _read_jsonl(f, text_field, stats)
        try:
            for doc in docs:
                text += len(doc.encode("utf-8", "surrogatepass"))
                if stats.bytes_read >= sample:
                    break
        except DataError:  # a bad line: reading the file says which
            return size
        finally:
            docs.close()
        return round(size * text / stats.bytes_read) if stats.bytes_read else size
    if f.suffix.lower() != ".parquet":
        return size
    import pyarrow.parquet as pq

    try:
        md = pq.ParquetFile(f).metadata
        cols = [
            md.row_group(g).column(k)
            for g in range(md.num_row_groups)
            for k in range(md.row_group(g).num_columns)
        ]
        text = sum(c.total_uncompressed_size for c in cols if c.path_in_schema == text_field)
    except Exception:  # a corrupt file: reading it says so; here, its size
        return size
    return text or size


def _read_hf_dataset(p: Path, text_field: str, stats: SourceStats) -> Iterator[str]:
    for f in _hf_arrow_files(p):
        batches = _guarded(_arrow_batches(f), f, "arrow")
        first = next(batches, None)
        if first is None:
            continue
        _check_column(first.schema.names, f, text_field)
        stats.files_read += 1

        def chain(first=first, batches=batches) -> Iterator:
            yield first
            yield from batches

        yield from _column_batches(chain(), f, text_field, stats)


def _read_folder(p: Path, text_field: str, exts: tuple[str, ...], stats: SourceStats) -> Iterator[str]:
    for f in walk_files(p, exts, report=True):
        suffix = f.suffix.lower().lstrip(".")
        if suffix == "jsonl":
            yield from _read_jsonl(f, text_field, stats)
        elif suffix == "parquet":
            yield from _read_parquet(f, text_field, stats)
        else:
            yield from _read_text_file(f, stats, skip_binary=True)


def _compression(p: Path) -> str | None:
    """The compression format of a file by its magic bytes (gzip, bzip2, xz, zstd, zip; or utf-16 by its byte
    order mark), else None."""
    try:
        with open(p, "rb") as f:
            head = f.read(6)
    except OSError:
        return None
    return next((name for magic, name in _COMPRESSED if head.startswith(magic)), None)


def _nothing_found(p: Path, kind: str, exts: tuple[str, ...], stats: SourceStats) -> DataError:
    if kind == "text" and stats.skipped_binary:  # one file given: --extensions (for folders) cannot help
        packed = _compression(p)
        if packed == "utf-16":  # Windows' "Unicode" text: NUL bytes between ASCII letters
            q = shlex.quote(str(p))
            return DataError(
                f"{p} is UTF-16 text, not UTF-8; convert it first (iconv -f UTF-16 -t UTF-8 {q} > {q}.utf8.txt) "
                f"and pass the result"
            )
        if packed is not None:
            return DataError(
                f"{p} is a {packed}-compressed file, not text; decompress it first "
                f"({_UNPACK[packed]} {shlex.quote(str(p))}) and pass the result"
            )
        return DataError(
            f"{p} is a binary file (NUL bytes in its first {BINARY_PROBE:,} bytes), not text; pass a text "
            f"file, a folder, .jsonl, .parquet or a saved HF dataset"
        )
    if stats.skipped_binary:
        return DataError(
            f"{p}: all {stats.skipped_binary} candidate file(s) are binary (NUL bytes) and were skipped; "
            f"pass text files or set --extensions"
        )
    if kind == "folder" and stats.files_read == 0:
        others = sorted(
            {f.suffix.lower().lstrip(".") for f in p.rglob("*.*") if f.is_file()} & set(_STRUCTURED)
        )
        hint = f" (found .{others[0]} files: add {others[0]} to --extensions)" if others else ""
        return DataError(
            f"{p} has no files with extensions {', '.join(exts)}{hint}; pass --extensions or another folder"
        )
    return DataError(f"{p} contains no text (all documents are empty); pass a non-empty corpus")


def iter_documents(
    path: str | os.PathLike[str],
    *,
    text_field: str = "text",
    extensions: Iterable[str] | None = DEFAULT_EXTENSIONS,
    stats: SourceStats | None = None,
) -> Iterator[str]:
    """Yield the documents of one source, in a deterministic order, updating ``stats`` as it goes.

    Empty documents are skipped. Raises DataError when the path is missing, a record lacks ``text_field``,
    or the source holds no document at all (saying how many binary files were skipped).
    """
    p = resolve_source(path)
    exts = normalize_extensions(extensions)
    kind = source_kind(p)
    total = SourceStats()  # this source alone (the readers write into it)
    if kind == "folder":
        gen = _read_folder(p, text_field, exts, total)
    elif kind == "hf_dataset":
        gen = _read_hf_dataset(p, text_field, total)
    elif kind == "jsonl":
        gen = _read_jsonl(p, text_field, total)
    elif kind == "parquet":
        gen = _read_parquet(p, text_field, total)
    else:
        gen = _read_text_file(p, total, skip_binary=True)
    published = SourceStats()
    yielded = 0

    def publish() -> None:
        # Push the counters gathered since the last publish into the caller's stats.
        if stats is not None:
            for f in fields(total):
                delta = getattr(total, f.name) - getattr(published, f.name)
                if delta:
                    setattr(stats, f.name, getattr(stats, f.name) + delta)
                    setattr(published, f.name, getattr(total, f.name))

    try:
        for doc in gen:
            # Publish before each yield so a consumer that stops early (max_bytes) has exact counters.
            publish()
            yielded += 1
            yield doc
    finally:
        publish()
    if yielded == 0:
        raise _nothing_found(p, kind, exts, total)
