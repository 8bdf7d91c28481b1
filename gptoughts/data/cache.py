"""Where a prepared folder lives and when it is reused: the cache key, the lock, the atomic install.

* :func:`cache_key` hashes every input a prepared folder depends on: the sources (by file metadata), the
  tokenizer (its spec, or a loaded one's content fingerprint), the reading and split settings, the format
  version. The number of workers is not in it: the output does not depend on it.
* A folder is reused only when its manifest has the key and its files are intact (:func:`reusable`).
* A build is made in a hidden sibling folder and renamed into place under a file lock (:func:`locked`,
  :func:`install`); a folder that is not a dataset is never replaced (:func:`check_replaceable`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from gptoughts.data.manifest import FORMAT_VERSION, SHARD_NAME, Manifest
from gptoughts.data.sources import (
    STDLIB_ALIAS,
    check_distinct,
    normalize_extensions,
    prepared_manifest,
    source_fingerprint,
)
from gptoughts.data.split import TOKENIZER_TRAIN_BYTES
from gptoughts.data.tokenizer import Tokenizer, parse_spec
from gptoughts.errors import ConfigError, DataError

log = logging.getLogger("gptoughts.data")


def default_cache_dir() -> Path:
    """``$GPTOUGHTS_CACHE`` or ``~/.cache/gptoughts``."""
    env = os.environ.get("GPTOUGHTS_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "gptoughts"


def tokenizer_identity(tokenizer: str | Tokenizer) -> tuple[str, str]:
    """(spec to record, identity for the cache key). A trained bpe is identified by its spec (it is a
    function of the data, already in the key); a loaded one by its content fingerprint."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer.spec or "custom", "fingerprint:" + tokenizer.fingerprint()
    spec = str(tokenizer).strip()
    kind, _ = parse_spec(spec)
    if kind == "folder":
        return spec, "fingerprint:" + Tokenizer.load(spec).fingerprint()
    return spec, spec


def held_out_docs(val_fraction: float, min_val_docs: int | None) -> int:
    """The fewest documents held out: ``min_val_docs``, or where not given one, none when ``val_fraction`` is 0 (the
    user asked for none)."""
    if min_val_docs is not None:
        return min_val_docs
    return 1 if val_fraction > 0 else 0


def key_settings(
    text_field: str,
    extensions: tuple[str, ...],
    val_fraction: float,
    min_val_docs: int | None,
    max_bytes: int | None,
    seed: int,
    tokenizer_train_bytes: int,
) -> dict[str, Any]:
    """The settings a prepared folder depends on, besides its sources and tokenizer (kept in its manifest)."""
    min_val_docs = held_out_docs(val_fraction, min_val_docs)
    return {
        "text_field": text_field,
        "extensions": list(extensions),
        "val_fraction": val_fraction,
        "min_val_docs": min_val_docs,
        "max_bytes": max_bytes,
        "seed": seed,
        "tokenizer_train_bytes": tokenizer_train_bytes,
    }


def dataset_key(fingerprints: list[dict], tok_identity: str, settings: dict[str, Any]) -> str:
    """The cache key of sources' fingerprints, a tokenizer's identity and :func:`key_settings`."""
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
    min_val_docs: int | None = None,
    max_bytes: int | None = None,
    seed: int = 0,
    tokenizer_train_bytes: int = TOKENIZER_TRAIN_BYTES,
) -> str:
    """sha256 over everything a prepared folder depends on (sources identified by file metadata)."""
    exts = normalize_extensions(extensions)
    fps = [source_fingerprint(s, exts) for s in sources]
    _, ident = tokenizer_identity(tokenizer)
    return dataset_key(
        fps,
        ident,
        key_settings(text_field, exts, val_fraction, min_val_docs, max_bytes, seed, tokenizer_train_bytes),
    )


def _slug(sources: Sequence[str | os.PathLike[str]], tokenizer: str | Tokenizer) -> str:
    first = str(sources[0])
    # resolved: `--data .` and the absolute path a run's config.toml records must name the same folder
    name = "stdlib" if first == STDLIB_ALIAS else Path(first).expanduser().resolve().name or "data"
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


def source_list(
    sources: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
) -> list[str | os.PathLike[str]]:
    """``sources`` as a list (one path given alone too); ConfigError when there is none."""
    if isinstance(sources, (str, os.PathLike)):
        sources = [sources]
    if not sources:
        raise ConfigError(
            "no data sources given; pass at least one file, folder, .jsonl, .parquet or dataset"
        )
    return list(sources)


def cache_location(
    sources: Sequence[str | os.PathLike[str]],
    tokenizer: str | Tokenizer,
    cache_root: str | os.PathLike[str] | None,
    kwargs: dict[str, Any],
) -> tuple[list[str | os.PathLike[str]], Path, str]:
    """(sources as a list, the cache folder, its key) for ``cached_prepare``'s arguments."""
    sources = source_list(sources)
    check_distinct(sources)
    key = cache_key(sources, tokenizer, **{k: kwargs[k] for k in _KEY_ARGS if k in kwargs})
    root = Path(cache_root).expanduser() if cache_root is not None else default_cache_dir() / "datasets"
    return sources, root / f"{_slug(sources, tokenizer)}-{key[:16]}", key


@contextlib.contextmanager
def locked(out: Path) -> Iterator[None]:
    """An exclusive lock beside ``out`` so concurrent prepares of the same folder build it once.

    The lock file ``.OUT.lock`` is removed when the holder is done, while it still holds the lock: a process
    that was waiting then holds a lock on a file no longer at that path, sees it (the path names another file,
    or none) and locks afresh, so two processes never both believe they hold it. A file left by a killed
    holder is locked and removed like any other. The folders above ``out`` it creates are removed again when they
    are left empty (a refused corpus leaves nothing behind)."""
    made = [d for d in (out.parent, *out.parent.parents) if not d.exists()]
    lock_path = out.parent / f".{out.name}.lock"
    try:
        import fcntl
    except ImportError:  # no flock (Windows): best effort
        fcntl = None  # type: ignore[assignment]
    while True:
        # (in the loop: a holder that was done may have just removed it, left empty)
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:
            continue
        try:
            if fcntl is not None:
                fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # no flock on some network filesystems: best effort
            break
        except BaseException:
            os.close(fd)
            raise
        try:
            current = os.stat(lock_path)
        except FileNotFoundError:
            current = None
        held = os.fstat(fd)
        if current is not None and (current.st_dev, current.st_ino) == (held.st_dev, held.st_ino):
            break
        os.close(fd)  # the holder before us removed (and maybe someone re-created) the file: lock the new one
    try:
        yield
    finally:
        # unlinked before the lock is released (closing the file releases it): see the docstring
        with contextlib.suppress(OSError):
            os.unlink(lock_path)
        os.close(fd)
        for d in made:  # deepest first; a folder that holds something (the output, a kept build) stays
            with contextlib.suppress(OSError):
                d.rmdir()


def reusable(out: Path, key: str, verify: bool) -> Manifest | None:
    """The manifest at ``out`` when it has ``key`` and all its files are intact (with ``verify``, their
    checksums match), else None."""
    try:
        m = Manifest.load(out)
    except DataError:
        return None
    if m.cache_key != key:
        return None
    cap = m.settings.get("max_bytes")
    if isinstance(cap, int) and any(s.truncated and s.bytes > cap for s in m.sources):
        # Prepared when data.max_bytes kept the document crossing it whole, under the key a prepare cutting at the
        # cap has now: its shards hold more text than asked for (a whole small file for a cap of a few KB). A
        # source cut now records at most the cap (one not cut may count blank text past it: not this case).
        log.warning("rebuilding %s: prepared before data.max_bytes cut the document crossing it", out)
        return None
    try:
        m.verify() if verify else m.check_files()
    except DataError as e:
        log.warning("rebuilding %s: %s", out, e)
        return None
    return m


def made_with(
    sources: Sequence[str | os.PathLike[str]], tokenizer_spec: str, settings: dict[str, Any]
) -> dict:
    """What a prepared folder was made of, in words a user gives: its sources, its tokenizer and
    :func:`key_settings` (the same for a manifest, by :func:`_manifest_made_with`, and for a prepare about to run)."""
    made = {"sources": [str(s) for s in sources], "tokenizer": tokenizer_spec, **settings}
    if isinstance(made.get("extensions"), list):  # their order changes no file read
        made["extensions"] = sorted(map(str, made["extensions"]))
    return made


def _manifest_made_with(manifest: dict) -> dict | None:
    """:func:`made_with` of a manifest.json's fields, None where they are damaged."""
    try:
        return made_with(
            [s["path"] for s in manifest["sources"]], manifest["tokenizer_spec"], manifest["settings"]
        )
    except (KeyError, TypeError):
        return None


def _shown(value: Any) -> str:
    if value is None:
        return "none"
    return ", ".join(map(str, value)) if isinstance(value, list) else str(value)


def check_replaceable(out: Path, owned: bool, wanted: dict | None = None) -> None:
    """Refuse to replace a folder that is not a dataset: prepare must never delete a user's files.

    Every entry must have a name prepare writes. A folder the user named must also hold a manifest.json
    that gptoughts wrote (a damaged one is rebuilt, a foreign one refused); an ``owned`` folder (the cache)
    is rebuilt whatever its manifest holds. ``wanted`` (:func:`made_with` of the prepare about to run; None with
    overwrite): a dataset made of other sources, tokenizer or settings is refused, naming the difference, since a
    run or a bench may read it; one made of the same (its files edited since, or damaged) is rebuilt.
    """
    if not out.exists():
        return
    if not out.is_dir():
        raise DataError(f"{out} exists and is a file; pass a new or empty folder as the output")
    entries = list(out.iterdir())
    fix = f"move it out or delete {out}" if owned else "pass a new or empty folder"
    for entry in entries:
        if entry.name not in ("manifest.json", "tokenizer") and not SHARD_NAME.fullmatch(entry.name):
            raise DataError(f"{out} exists and is not a prepared dataset (it holds {entry.name}); {fix}")
    if not entries or owned:
        return
    manifest = prepared_manifest(out)
    if manifest is None:
        raise DataError(
            f"{out} exists and is not a prepared dataset (no manifest.json written by gptoughts); delete it "
            f"if it is an old dataset, else pass a new or empty folder"
        )
    there = _manifest_made_with(manifest)
    if wanted is None or there is None:
        return
    # a key an older version did not record is not a difference
    diffs = [k for k, v in wanted.items() if k in there and there[k] != v]
    if diffs:
        said = ", ".join(f"{k} {_shown(there[k])} (this prepare: {_shown(wanted[k])})" for k in diffs[:3])
        raise DataError(
            f"{out} already holds a dataset prepared with other settings: {said}; pass --overwrite to replace "
            f"it (overwrite=True from Python), or choose another --out"
        )


def install(tmp: Path, out: Path) -> None:
    """Rename the finished ``tmp`` into ``out`` (renames are atomic within a filesystem)."""
    if out.exists():
        old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out)
