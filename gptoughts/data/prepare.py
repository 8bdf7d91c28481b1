"""Turn sources into token shards: read and split -> tokenizer -> tokenise into shards -> manifest.

The steps and where they live: :mod:`.split` reads every source once and decides the train/val split
(collecting the BPE training text); the tokenizer is trained on that text, or loaded; :mod:`.shards`
tokenises in worker processes and writes the shards; :mod:`.manifest` describes the result; :mod:`.cache`
names the folder by the key of its inputs, reuses it when intact and installs a new one atomically.

Two streaming passes keep memory bounded whatever the corpus size. A build goes into ``.<out>.partial-<key>``
and survives a kill: ``plan.json`` records pass 1's decisions and ``progress.json`` the shards written so far,
so the same prepare run again resumes from its last checkpoint. Reasons and measurements: docs/data.md,
"Preparing a corpus".
"""

from __future__ import annotations

import datetime as _dt
import glob
import json
import logging
import os
import shutil
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gptoughts.data.cache import (
    cache_location,
    check_replaceable,
    dataset_key,
    held_out_docs,
    install,
    key_settings,
    locked,
    made_with,
    reusable,
    source_list,
    tokenizer_identity,
)
from gptoughts.data.manifest import CHECKSUM, FORMAT_VERSION, Manifest, SourceInfo, crc32_file, token_dtype
from gptoughts.data.shards import ShardWriter, shards_intact, write_source
from gptoughts.data.sources import (
    SourceStats,
    check_distinct,
    content_sha256,
    normalize_extensions,
    source_fingerprint,
    source_kind,
)
from gptoughts.data.split import (
    TOKENIZER_TRAIN_BYTES,
    Plan,
    Reader,
    SourceChanged,
    SplitRule,
    changed_while_prepared,
    scan,
)
from gptoughts.data.tokenizer import Tokenizer, build_tokenizer, parse_spec
from gptoughts.errors import ConfigError, DataError

log = logging.getLogger("gptoughts.data")

# Tokens per shard file (the last shard of a split holds the rest); recorded in the manifest.
SHARD_TOKENS = 100_000_000
# Files of a build in progress (removed before the folder is installed).
_PLAN_FILE = "plan.json"
_PROGRESS_FILE = "progress.json"
# The rules a build in progress was planned under, recorded in plan.json: a build planned under other rules is
# started over, never resumed (pass 2 would read the documents otherwise than pass 1 planned). Bump it whenever
# what pass 1 or pass 2 reads changes. 2: the document crossing data.max_bytes is cut there (1, unrecorded: whole).
# 3: a text file's UTF-8 byte order mark is not read.
_BUILD_RULES = 3


def prepare(
    sources: Sequence[str | os.PathLike[str]],
    out_dir: str | os.PathLike[str],
    tokenizer: str | Tokenizer = "bpe:8192",
    *,
    text_field: str = "text",
    extensions: Sequence[str] | None = None,
    val_fraction: float = 0.005,
    min_val_docs: int | None = None,
    max_bytes: int | None = None,
    seed: int = 0,
    cache: bool = True,
    progress: bool = True,
    tokenizer_train_bytes: int = TOKENIZER_TRAIN_BYTES,
    verify: bool = True,
    owned: bool = False,
    workers: int | None = None,
    overwrite: bool = False,
) -> Manifest:
    """Tokenise ``sources`` into ``out_dir`` (see the module docstring) and return its manifest.

    ``max_bytes`` caps the text read from *each* source (the document crossing it is cut there). With ``cache`` (the
    default) an ``out_dir`` already prepared from the same inputs is returned without work, after checking
    its files' checksums when ``verify`` (a damaged folder is rebuilt). ``owned``: ``out_dir`` is a folder
    only gptoughts writes to (the cache), rebuilt even when its manifest is unreadable; a folder the user
    named is replaced only when it holds a manifest gptoughts wrote, and one made of other sources, tokenizer or
    settings only with ``overwrite`` (it may be what a run or a bench reads): else a DataError names the difference.

    ``workers``: processes that tokenise (None: one per core this process may use). It does not change the
    output (the shards are byte-identical whatever it is), so it is not part of the cache key. An
    interrupted preparation (killed, Ctrl-C, disk full) keeps its work in a hidden sibling folder; running
    the same prepare again resumes it from its last checkpoint.
    """
    sources = source_list(sources)
    min_val_docs = held_out_docs(val_fraction, min_val_docs)
    _check_settings(val_fraction, min_val_docs, max_bytes, workers)
    exts = normalize_extensions(extensions)
    paths = check_distinct(sources)  # DataError for a missing path or one read twice, before any work
    fps = [source_fingerprint(p, exts) for p in paths]
    spec, ident = tokenizer_identity(tokenizer)
    settings = key_settings(
        text_field, exts, val_fraction, min_val_docs, max_bytes, seed, tokenizer_train_bytes
    )
    job = _Job(
        out=Path(out_dir).expanduser().resolve(),
        given=[str(s) for s in sources],
        paths=paths,
        tokenizer=tokenizer,
        spec=spec,
        key=dataset_key(fps, ident, settings),
        fingerprints=fps,
        settings=settings,
        exts=exts,
        progress=progress,
        workers=workers if workers is not None else _available_cores(),
    )
    if cache and (m := _reuse(job, verify)) is not None:
        return m
    wanted = None if owned or overwrite else made_with(job.paths, job.spec, job.settings)
    check_replaceable(job.out, owned, wanted)
    try:
        with locked(job.out):
            # Another process may have built it while we waited for the lock.
            if cache and (m := _reuse(job, verify)) is not None:
                return m
            check_replaceable(job.out, owned, wanted)
            manifest = _build_and_install(job)
    except OSError as e:  # reading errors are DataErrors already (sources.py): this one is about the output
        where = e.filename or job.out
        raise DataError(
            f"cannot write {where} ({e.strerror or e}); pass an output folder you can write to, on a disk "
            f"with free space (for the cache: set GPTOUGHTS_CACHE or data.cache_dir)"
        ) from None
    manifest.dir = job.out
    _log_prepared(manifest)
    return manifest


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
    sources, out, _ = cache_location(sources, tokenizer, cache_root, kwargs)
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
    _, out, key = cache_location(sources, tokenizer, cache_root, kwargs)
    return reusable(out.expanduser().resolve(), key, verify)


def _log_prepared(manifest: Manifest) -> None:
    t, st = manifest.totals, manifest.stats
    log.info(
        "prepared %s docs from %d source(s): %s train + %s val tokens, vocab %d (%s); skipped %d binary "
        "file(s), %d invalid UTF-8 replacement(s) -> %s",
        f"{t['docs']:,}", len(manifest.sources), f"{t['train_tokens']:,}", f"{t['val_tokens']:,}",
        manifest.vocab_size, manifest.dtype, st["skipped_binary"], st["replaced_chars"], manifest.dir,
    )  # fmt: skip


def _check_settings(
    val_fraction: float, min_val_docs: int, max_bytes: int | None, workers: int | None
) -> None:
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


def _available_cores() -> int:
    """Cores this process may run on (its affinity mask: a container or taskset limit, not the machine's)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


@dataclass(frozen=True)
class _Job:
    """One preparation's inputs, resolved and checked: what every step of the build reads."""

    out: Path
    given: list[str]  # the sources as the user wrote them
    paths: list[Path]
    tokenizer: str | Tokenizer
    spec: str
    key: str
    fingerprints: list[dict[str, Any]]  # the sources' identity when the preparation began (in the key)
    settings: dict[str, Any]
    exts: tuple[str, ...]
    progress: bool
    workers: int

    @property
    def tmp(self) -> Path:
        """The build folder, named by the key: a killed build of the same inputs is resumed from it."""
        return self.out.parent / f".{self.out.name}.partial-{self.key[:16]}"


def _reuse(job: _Job, verify: bool) -> Manifest | None:
    m = reusable(job.out, job.key, verify)
    if m is not None:
        log.info("reusing cached shards in %s (%s train tokens)", job.out, f"{m.train_tokens:,}")
    return m


def _build_and_install(job: _Job) -> Manifest:
    """Build in ``job.tmp`` and rename it to ``job.out`` (the caller holds the lock)."""
    tmp = job.tmp
    # Any other build folder (another key, or the per-process folders of older versions) is stale.
    name = glob.escape(job.out.name)  # `data[12]` as a pattern matches data1 and data2
    for pattern in (f".{name}.tmp-*", f".{name}.partial-*"):
        for stale in job.out.parent.glob(pattern):
            if stale != tmp:
                shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir(exist_ok=True)
    try:
        manifest = _build(job)
        install(tmp, job.out)
    except BaseException as e:
        # a source edited meanwhile: its next key differs, there is nothing to resume
        if (tmp / _PLAN_FILE).is_file() and not isinstance(e, SourceChanged):
            log.warning("preparation interrupted: its work is kept in %s; the same prepare resumes it", tmp)
        else:  # failed while reading (bad input): nothing worth keeping
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _build(job: _Job) -> Manifest:
    """Pass 1 and the tokenizer (or what an interrupted build recorded of them), pass 2, the manifest."""
    reader = Reader(job.paths, job.settings, job.exts)
    resumed = _resumable(job)
    if resumed is not None:
        plan, tok, state = resumed
        cur = state["current"]
        log.info(
            "resuming the interrupted preparation in %s: %d of %d source(s) done%s",
            job.tmp, len(state["done"]), len(job.paths),
            f", source {cur['source']} from document {cur['next_doc']:,}" if cur else "",
        )  # fmt: skip
    else:
        plan, tok = _plan(job, reader)
        state = {"key": job.key, "done": [], "current": None}
    infos = _write_shards(job, reader, plan, tok, state)
    # The key names the sources as they were at the start (sizes, mtimes): a source edited since would be
    # installed under a key that does not describe its shards.
    for path, fp in zip(job.paths, job.fingerprints):
        if source_fingerprint(path, job.exts) != fp:
            raise changed_while_prepared(path)
    manifest = _manifest(job, plan, tok, infos)
    (job.tmp / _PLAN_FILE).unlink()
    (job.tmp / _PROGRESS_FILE).unlink()
    manifest.write(job.tmp)  # last: a folder with a manifest is a complete folder
    return manifest


def _plan(job: _Job, reader: Reader) -> tuple[Plan, Tokenizer]:
    """Pass 1 and the tokenizer, from scratch; recorded in ``plan.json`` and ``tokenizer/``."""
    for entry in job.tmp.iterdir():  # an unusable earlier attempt: start over
        shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    train_bpe = isinstance(job.tokenizer, str) and parse_spec(job.tokenizer)[0] == "bpe"
    with _Progress(job.progress) as bar:
        task = bar.task("reading", None)
        plan = scan(reader, job.settings, train_bpe, lambda n: bar.advance(task, n))
    if isinstance(job.tokenizer, Tokenizer):
        tok = job.tokenizer
    else:
        tok = _new_tokenizer(job.spec, plan.train_texts, train_bpe)
    plan.train_texts = []  # up to 50 MB: free it before tokenising
    tok.save(job.tmp / "tokenizer")
    _write_json(job.tmp / _PLAN_FILE, _plan_record(plan, job.key, tok))  # from here on, a kill is resumable
    return plan, tok


def _new_tokenizer(spec: str, texts: list[str], train_bpe: bool) -> Tokenizer:
    """The tokenizer of ``spec``: a bpe trained on ``texts`` when ``train_bpe``, else built or loaded."""
    tok = build_tokenizer(spec, (lambda: iter(texts)) if train_bpe else None)
    wanted = parse_spec(spec)[1]
    if wanted is not None and tok.vocab_size < wanted:
        log.warning(
            "the corpus is too small for %s: the trained vocabulary has %d tokens", spec, tok.vocab_size
        )
    return tok


def _write_shards(
    job: _Job, reader: Reader, plan: Plan, tok: Tokenizer, state: dict[str, Any]
) -> list[SourceInfo]:
    """Pass 2 over the sources not done in ``state``, checkpointing to ``progress.json``."""
    dtype = token_dtype(tok.vocab_size)
    infos = [SourceInfo(**d) for d in state["done"]]

    def checkpoint(current: dict[str, Any] | None) -> None:
        _write_json(
            job.tmp / _PROGRESS_FILE, {"key": job.key, "done": [asdict(s) for s in infos], "current": current}
        )

    with _Progress(job.progress) as bar:
        task = bar.task("tokenizing", plan.chars)
        for i in range(len(infos), len(job.paths)):
            resume = state["current"] if state["current"] and state["current"]["source"] == i else None
            writers, docs = write_source(
                i, reader, plan, tok, job.tmp, dtype, SHARD_TOKENS, job.workers, resume, checkpoint,
                lambda n: bar.advance(task, n),
            )  # fmt: skip
            infos.append(_source_info(job, i, plan, writers, docs))
            checkpoint(None)
    return infos


def _source_info(
    job: _Job, i: int, plan: Plan, writers: dict[str, ShardWriter], docs: dict[str, Any]
) -> SourceInfo:
    path = job.paths[i]
    single_file = path.is_file()
    return SourceInfo(
        index=i,
        given=job.given[i],
        path=str(path),
        kind=source_kind(path),
        bytes=plan.stats[i].bytes_read,
        sha256=content_sha256(path) if single_file else source_fingerprint(path, job.exts)["stat_sha256"],
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


def _manifest(job: _Job, plan: Plan, tok: Tokenizer, infos: list[SourceInfo]) -> Manifest:
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
    return Manifest(
        dir=job.tmp,
        format_version=FORMAT_VERSION,
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        cache_key=job.key,
        tokenizer_spec=job.spec,
        tokenizer_fingerprint=tok.fingerprint(),
        tokenizer_files=_file_checksums(job.tmp / "tokenizer"),
        vocab_size=tok.vocab_size,
        eos_id=tok.eos_id,
        bos_id=tok.bos_id if tok.bos_id is not None and tok.bos_id != tok.eos_id else None,
        dtype=token_dtype(tok.vocab_size).name,
        shard_tokens=SHARD_TOKENS,
        checksum=CHECKSUM,
        sources=infos,
        totals=totals,
        stats=all_stats.as_dict(),
        val_split=plan.describe(),
        settings=job.settings,
    )


def _file_checksums(folder: Path) -> dict[str, str]:
    return {f.name: crc32_file(f) for f in sorted(folder.iterdir()) if f.is_file()}


def _write_json(path: Path, data: Any) -> None:
    """Write ``data`` to ``path`` atomically and durably (a kill leaves the old file or the new one)."""
    part = path.with_name(path.name + ".part")
    with open(part, "w", encoding="utf-8") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)


def _plan_record(plan: Plan, key: str, tok: Tokenizer) -> dict[str, Any]:
    return {
        "key": key,
        "rules": _BUILD_RULES,
        "shard_tokens": SHARD_TOKENS,
        "tokenizer_fingerprint": tok.fingerprint(),
        **plan.record(),
    }


def _resumable(job: _Job) -> tuple[Plan, Tokenizer, dict[str, Any]] | None:
    """(plan, tokenizer, progress) of an interrupted build of the same key in ``job.tmp`` whose files are
    intact (sizes and checksums of every shard written), else None."""
    try:
        rec = json.loads((job.tmp / _PLAN_FILE).read_text(encoding="utf-8"))
        progress_path = job.tmp / _PROGRESS_FILE
        progress = (
            json.loads(progress_path.read_text(encoding="utf-8"))
            if progress_path.is_file()
            else {"key": job.key, "done": [], "current": None}
        )
        if rec.get("rules") != _BUILD_RULES:
            log.info("%s was planned by another version of gptoughts: starting it over", job.tmp)
            return None
        if rec["key"] != job.key or progress["key"] != job.key or rec["shard_tokens"] != SHARD_TOKENS:
            return None
        tok = _recorded_tokenizer(job)
        if tok.fingerprint() != rec["tokenizer_fingerprint"]:
            return None
        plan = Plan.from_record(rec, SplitRule(job.settings["val_fraction"], job.settings["min_val_docs"]))
        if not _progress_intact(job.tmp, progress, token_dtype(tok.vocab_size).itemsize):
            return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError, ConfigError, DataError):
        return None
    return plan, tok, progress


def _recorded_tokenizer(job: _Job) -> Tokenizer:
    """The tokenizer of an interrupted build: the one given, the bpe it trained, or the spec's."""
    if isinstance(job.tokenizer, Tokenizer):
        return job.tokenizer
    if parse_spec(job.spec)[0] == "bpe":
        return Tokenizer.load(job.tmp / "tokenizer", spec=job.spec)
    return build_tokenizer(job.spec)


def _progress_intact(tmp: Path, progress: dict[str, Any], itemsize: int) -> bool:
    """Whether every shard ``progress`` records (finished sources, and the current one's writers) is intact."""
    states = [
        {"files": d[f"{split}_shards"], "checksums": d[f"{split}_checksums"], "tokens": d[f"{split}_tokens"]}
        for d in progress["done"]
        for split in ("train", "val")
    ]
    if progress["current"] is not None:
        states += list(progress["current"]["writers"].values())
    return all(shards_intact(tmp, st, itemsize, SHARD_TOKENS) for st in states)


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
