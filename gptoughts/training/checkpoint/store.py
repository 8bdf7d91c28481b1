"""The on-disk checkpoint: layout, atomic writes, verification, and reading without running code.

``RUN/checkpoints/step_N/`` holds the single-file format (``model.safetensors``, ``state.pt``, ``meta.json``) or
the sharded one (DCP shards, ``.metadata``, ``state.pt``, ``meta.json`` with ``"format": "dcp"``); ``best.json``
names the best step, never rotated away. A checkpoint is written into a hidden temp dir, fsynced, and renamed into
place by :func:`commit`, which writes ``meta.json`` (every file's sha256) last: :func:`verify` checks it, and
:func:`latest_valid` falls back past a checkpoint that does not verify. Re-saving a step moves the old dir aside
first; :func:`recover` renames it back after a crash. Only the process that holds the run's lock (the trainer:
``rundir.RunLock``) writes, rotates or recovers a checkpoints dir; a reader (sample, eval, export, ``gptoughts.load``,
a dry run, another run's ``--resume PATH``) never renames or removes anything in it: :func:`latest_valid` only reads,
and takes a ``.old-step_N-*`` dir that an interrupted replace left as a candidate of step N where ``step_N`` itself
is missing or unusable. DCP's ``.metadata`` is a pickle: it is read through an allow-list unpickler
(:func:`read_dcp_metadata`), never by plain ``pickle``.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
import stat
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file, save_model
from torch import nn

from gptoughts.errors import UserError, as_disk_full

STEP_DIR = re.compile(r"^step_(\d{6,})$")
_OLD_DIR = re.compile(r"^\.old-(step_(\d{6,}))-(\d+)$")
"""A ``step_N`` dir a replace moved aside (:func:`_replace`): its name, its step, the time it was moved."""
MODEL_FILE = "model.safetensors"
STATE_FILE = "state.pt"
META_FILE = "meta.json"
DCP_METADATA = ".metadata"
"""DCP's index file; its presence (and ``"format": "dcp"`` in meta.json) marks a sharded checkpoint."""
DCP_FORMAT = "dcp"


def _sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def step_of(path: Path) -> int:
    """The step of a checkpoint directory ``step_000123`` (or ``.old-step_000123-*``, moved aside by a replace;
    its meta.json's step when the name is neither)."""
    name = Path(path).name
    if m := STEP_DIR.match(name):
        return int(m.group(1))
    if m := _OLD_DIR.match(name):
        return int(m.group(2))
    return int(read_meta(Path(path))["step"])


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:06d}"


def save(
    root: str | Path,
    step: int,
    model: nn.Module | dict[str, torch.Tensor],
    state: dict[str, Any],
    *,
    val_loss: float | None = None,
    keep_last: int = 3,
    is_best: bool = False,
    meta: dict[str, Any] | None = None,
    weights_metadata: dict[str, str] | None = None,
) -> Path:
    """Write checkpoint ``step`` atomically, rotate old ones (never the best), return its directory.
    ``model`` is the module, or its full state dict (a sharded run gathers one; :func:`weights_for_file` makes
    one with its ``weights_metadata``); ``meta``: extra JSON fields for ``meta.json``."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    recover(root)
    final = step_dir(root, step)
    tmp = root / f".tmp-{final.name}-{os.getpid()}-{time.monotonic_ns()}"
    tmp.mkdir()
    try:
        if isinstance(model, nn.Module):
            save_model(model, str(tmp / MODEL_FILE))
        else:
            save_file(
                {k: v.contiguous() for k, v in model.items()},
                str(tmp / MODEL_FILE),
                metadata=weights_metadata,
            )
        # Through a Python file: torch writing to a path reports a full disk as "unexpected pos" and nothing
        # more, while Python's own write raises the OSError(ENOSPC) that says what happened.
        with open(tmp / STATE_FILE, "wb") as f:
            torch.save(state, f)
        files = {name: file_record(tmp / name) for name in (MODEL_FILE, STATE_FILE)}
        commit(root, tmp, step, files, val_loss=val_loss, meta=meta, is_best=is_best, keep_last=keep_last)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if interrupted(e):  # a second Ctrl-C mid-write: torch.save reports it as a RuntimeError of its own
            raise KeyboardInterrupt from None
        full = as_disk_full(e, final, folder=root)
        if full is not None:
            raise full from None
        raise
    return final


def interrupted(e: BaseException) -> bool:
    """Whether ``e`` is, or was raised while handling, a ``KeyboardInterrupt``: torch.save's zip writer, cut short
    by one inside its write, raises ``RuntimeError: ... unexpected pos`` from its ``__exit__`` instead."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, KeyboardInterrupt):
            return True
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return False


def weights_for_file(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str] | None]:
    """``model``'s state dict as ``safetensors.torch.save_model`` writes it: a tensor shared under several names
    (tied embeddings) kept once, the other names in the file's metadata, so that ``load_model`` restores them.
    Passing the result to :func:`save` writes the same file as passing the module."""
    from safetensors.torch import _remove_duplicate_names

    state = model.state_dict()
    metadata: dict[str, str] = {}
    for kept, removed in _remove_duplicate_names(state).items():
        for name in removed:
            metadata.setdefault(name, kept)
            del state[name]
    return state, metadata or None


def file_record(path: Path, *, fsync: bool = True) -> dict[str, Any]:
    """``meta.json``'s entry for a written file: its sha256 and size, after flushing it to disk (``fsync``
    off: the writer flushed it itself, as DCP's does its shards)."""
    if fsync:
        _fsync_file(path)
    return {"sha256": _sha256(path), "bytes": path.stat().st_size}


def commit(
    root: Path,
    tmp: Path,
    step: int,
    files: dict[str, dict[str, Any]],
    *,
    val_loss: float | None,
    meta: dict[str, Any] | None,
    is_best: bool,
    keep_last: int,
) -> Path:
    """Write meta.json (the files' checksums) last into the complete temp dir ``tmp``, then rename it into
    place as ``step_N`` (atomically replacing an existing one); then name it the best (``is_best``) and rotate the
    older ones (:func:`rotate`)."""
    final = step_dir(root, step)
    info = {
        **(meta or {}),
        "step": step,
        "val_loss": val_loss,
        "files": files,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    (tmp / META_FILE).write_text(json.dumps(info, indent=2))
    _fsync_file(tmp / META_FILE)
    _fsync_dir(tmp)
    if final.exists():  # re-saving the same step (end of run right after a periodic save, a rollback)
        _replace(final, tmp, root)
    else:
        tmp.rename(final)
    _fsync_dir(root)
    if is_best:
        mark_best(root, step, val_loss)
    rotate(root, keep_last, step)
    return final


def _replace(final: Path, tmp: Path, root: Path) -> None:
    """Swap the complete dir ``tmp`` in for ``final``. A crash between the two renames leaves only
    ``.old-<final>-*``, which :func:`recover` renames back (and which :func:`latest_valid` reads meanwhile)."""
    old = root / f".old-{final.name}-{time.monotonic_ns()}"
    final.rename(old)
    _fsync_dir(root)
    tmp.rename(final)
    _fsync_dir(root)
    shutil.rmtree(old, ignore_errors=True)


def recover(root: str | Path) -> None:
    """Finish a replace that a crash interrupted: a ``.old-step_N-*`` dir whose ``step_N`` is missing is renamed
    back (it was complete: it had been in place); one whose ``step_N`` exists is a leftover and is removed.

    Only for the process that holds the run's lock (the trainer: when it takes it, and before each save): run by
    anyone else, it could land between the two renames of the trainer's own :func:`_replace`, put the old dir
    back and make the trainer's save fail. Readers use :func:`latest_valid`, which reads a leftover in place."""
    root = Path(root)
    if not root.is_dir():
        return
    olds = sorted(
        ((m, p) for p in root.iterdir() if p.is_dir() and (m := _OLD_DIR.match(p.name))),
        key=lambda mp: -int(mp[0].group(3)),
    )  # the newest first
    for m, p in olds:
        final = root / m.group(1)
        if final.exists():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.rename(final)
            _fsync_dir(root)


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to a temp file beside ``path``, fsync, rename: a reader sees the old or the new file."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def mark_best(root: Path, step: int, val_loss: float | None) -> None:
    """Name ``step`` the best checkpoint (``best.json``): :func:`rotate` never removes it."""
    write_text_atomic(root / "best.json", json.dumps({"step": step, "val_loss": val_loss}, indent=2))


def best_step(root: Path) -> int | None:
    try:
        return int(json.loads((root / "best.json").read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def list_steps(root: str | Path) -> list[int]:
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name)))


def rotate(root: Path, keep_last: int, written: int) -> None:
    """Remove the checkpoints of steps up to ``written`` (the one just written) but the ``keep_last`` newest (that
    one at least) and the best. Higher steps are those a resume fell back from as unusable: they never take a good
    one's place, and the run replaces them as it reaches their steps again."""
    steps = [s for s in list_steps(root) if s <= written]
    keep = set(steps[-max(1, keep_last) :])
    best = best_step(root)
    if best is not None:
        keep.add(best)
    for s in steps:
        if s not in keep:
            shutil.rmtree(step_dir(root, s), ignore_errors=True)
    for p in root.glob(".tmp-step_*"):  # leftovers of a crash mid-write
        shutil.rmtree(p, ignore_errors=True)


def verify(path: Path) -> str | None:
    """None when the checkpoint dir is complete and intact, else the reason it is not."""
    meta_path = path / META_FILE
    if not meta_path.exists():
        return "meta.json missing (interrupted write)"
    try:
        meta = json.loads(meta_path.read_text())
        files = meta["files"]
    except FileNotFoundError:  # deleted since: rotated away by a run still training
        return "meta.json missing (deleted while it was read)"
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError):
        return "meta.json unreadable"
    dcp_format = isinstance(meta, dict) and meta.get("format") == DCP_FORMAT
    problem = _listing_problem(files, dcp_format) or _files_problem(path, files)
    if problem is None and dcp_format:
        problem = _dcp_index_problem(path, files)
    return problem


def _listing_problem(files: Any, dcp_format: bool) -> str | None:
    """What is wrong with meta.json's list of files: one that is valid JSON but lists no files (or not both
    files, or wrong fields, or a shard name that points elsewhere) verifies nothing."""
    if (
        not isinstance(files, dict)
        or not all(
            isinstance(i, dict) and isinstance(i.get("bytes"), int) and isinstance(i.get("sha256"), str)
            for i in files.values()
        )
        or (not dcp_format and set(files) != {MODEL_FILE, STATE_FILE})
        or (dcp_format and not {DCP_METADATA, STATE_FILE} <= set(files))
    ):
        if dcp_format:
            return "meta.json does not describe .metadata, state.pt and the shards"
        return "meta.json does not describe model.safetensors and state.pt"
    if dcp_format:
        names = [n for n in files if n not in (DCP_METADATA, STATE_FILE)]
        if any("/" in n or "\\" in n or n.startswith(".") or not n.endswith(".distcp") for n in names):
            return "meta.json lists a file that is not a shard"
    return None


def _files_problem(path: Path, files: dict[str, dict[str, Any]]) -> str | None:
    """The first listed file that is missing, truncated or corrupted."""
    for name, info in files.items():
        f = path / name
        # FileNotFoundError: never written, or deleted while it was read (rotated away by a run still training)
        try:
            size = f.stat().st_size
            if size != info["bytes"]:
                return f"{name} truncated ({size} of {info['bytes']} bytes)"
            if _sha256(f) != info["sha256"]:
                return f"{name} checksum mismatch (corrupted)"
        except FileNotFoundError:
            return f"{name} missing"
        except OSError as e:
            return f"{name} unreadable ({e.strerror or type(e).__name__})"
    return None


def _dcp_index_problem(path: Path, files: dict[str, dict[str, Any]]) -> str | None:
    """The cheap check of DCP's own index: it reads safely and every shard file it points to is listed."""
    try:
        index = read_dcp_metadata(path)
    except UnreadableCheckpoint as e:
        return str(e)
    wanted = {str(getattr(i, "relative_path", "")) for i in (index.storage_data or {}).values()}
    if not wanted <= set(files):
        return f".metadata points to shards meta.json does not list ({sorted(wanted - set(files))[:3]})"
    return None


RELISTS = 5
"""How many times :func:`latest_valid` lists a checkpoints dir that changes while it is read, and
:func:`read_newest` reads a run's newest checkpoint again after one was rotated away under it."""


def latest_valid(root: str | Path, *, before: int | None = None) -> Path | None:
    """The newest intact checkpoint dir under ``root`` (with ``before``: of a step < ``before``); corrupted
    newer ones are skipped with a warning. A run still training may save, rotate and re-save a step while this
    reads (another process sampling from it): a listing that changed while it was read (a dir added, removed or
    replaced) past a newer dir that did not verify is read again, and a checkpoint deleted or replaced meanwhile
    is passed over without a warning (it was not corrupt, only rotated away or re-saved).

    Reading only: nothing under ``root`` is renamed or removed (the run may belong to a trainer still writing
    it; only the holder of its lock calls :func:`recover`). A step whose ``step_N`` is missing or unusable is
    read from a ``.old-step_N-*`` dir a replace moved aside (the trainer between its two renames, or a crash
    there): it was complete, it had been in place; one that does not verify (being removed) is passed over
    without a warning."""
    root = Path(root)
    unusable: dict[Path, tuple[str, tuple[int, int]]] = {}
    found = None
    for _ in range(RELISTS):
        listed = _checkpoint_dirs(root)
        unusable = {}
        found = _newest_intact(listed, before, unusable)
        relisted = _checkpoint_dirs(root)
        if relisted == listed:
            break
        # Changed meanwhile: the answer stands if nothing newer was passed over (it was not corrupt, perhaps
        # replaced) nor is listed now (a listing read while a dir is renamed may miss it under either name).
        newest = step_of(found) if found is not None else None
        if (
            newest is not None
            and not unusable
            and all(s <= newest for s, _, _ in relisted if _before(s, before))
        ):
            break
    for path, (problem, ident) in unusable.items():
        if (
            STEP_DIR.match(path.name)
            and _identity(path) == ident  # (not removed nor replaced since it was read)
            and (found is None or step_of(path) >= step_of(found))
        ):
            warnings.warn(
                f"checkpoint {path} is unusable ({problem}); falling back to the previous one", stacklevel=2
            )
    return found


def _before(step: int, before: int | None) -> bool:
    return before is None or step < before


def _identity(path: Path) -> tuple[int, int] | None:
    """What tells a dir from another put in its place (a re-saved step): its inode and its change time; None
    when it is gone (or not a dir)."""
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_ino, st.st_ctime_ns) if stat.S_ISDIR(st.st_mode) else None


def _checkpoint_dirs(root: Path) -> list[tuple[int, Path, tuple[int, int]]]:
    """``(step, dir, identity)`` of the checkpoint dirs under ``root``, the newest first: each step's ``step_N``,
    then the ``.old-step_N-*`` dirs a replace moved aside (the newest first)."""
    try:
        children = list(root.iterdir())
    except OSError:  # no such dir (yet), or unreadable: nothing to read
        return []
    keyed = []
    for p in children:
        if m := STEP_DIR.match(p.name):
            key = (int(m.group(1)), 1, 0)
        elif m := _OLD_DIR.match(p.name):
            key = (int(m.group(2)), 0, int(m.group(3)))
        else:
            continue
        if (ident := _identity(p)) is not None:
            keyed.append((key, p, ident))
    keyed.sort(key=lambda kpi: kpi[0], reverse=True)
    return [(key[0], p, ident) for key, p, ident in keyed]


def _newest_intact(
    listed: list[tuple[int, Path, tuple[int, int]]],
    before: int | None,
    unusable: dict[Path, tuple[str, tuple[int, int]]],
) -> Path | None:
    """The newest of ``listed`` (:func:`_checkpoint_dirs`) that verifies; those passed over, with their problem
    and their identity as listed, into ``unusable``."""
    for s, path, ident in listed:
        if not _before(s, before):
            continue
        problem = verify(path)
        if problem is None:
            return path
        unusable[path] = (problem, ident)
    return None


def resolve(path_or_run: str | Path) -> Path:
    """A checkpoint dir from a checkpoint dir, a run dir or a checkpoints dir (newest valid)."""
    p = Path(path_or_run)
    if not p.exists():
        raise UserError(f"{p} does not exist; pass a run directory or a checkpoint directory")
    if (p / META_FILE).exists() or (p / MODEL_FILE).exists() or (p / DCP_METADATA).exists():
        problem = verify(p)
        if problem:
            raise UserError(f"checkpoint {p} is unusable: {problem}")
        return p
    for root in (p / "checkpoints", p):
        found = latest_valid(root)
        if found is not None:
            return found
    raise UserError(f"no valid checkpoint under {p}; train first or pass a checkpoint directory")


def read_newest(
    path_or_run: str | Path,
    read: Callable[[Path], object],
    *,
    first: Path | None = None,
    attempts: int = RELISTS,
) -> Path:
    """``read(checkpoint)`` of :func:`resolve` (``path_or_run``) (``first``: that checkpoint, resolved already);
    the checkpoint read. A run still training rotates its checkpoints away (``--keep_last``), possibly between
    resolving its newest and reading it (``gptoughts sample RUN`` while it trains): a read that fails because the
    checkpoint was deleted (or half-deleted) under it reads the run's newest complete checkpoint instead, up to
    ``attempts`` reads in all; only then it is refused in one line. A read that fails on a checkpoint still intact
    (a mismatched model, unreadable content) is the checkpoint's own error, raised as it was."""
    ck = first if first is not None else resolve(path_or_run)
    for attempt in range(attempts):
        try:
            read(ck)
            return ck
        except Exception:  # noqa: BLE001 - whatever the read raised: intact, it is the checkpoint's own error
            if verify(ck) is None:
                raise
        if Path(path_or_run) == ck:  # the user named this very checkpoint: no other one to fall back to
            home = run_of(ck)
            raise UserError(
                f"checkpoint {ck} was deleted while it was read (a run still training rotates its checkpoints "
                f"away, --keep_last); pass {'the run folder ' + str(home) if home else 'its run folder'} to "
                "read its newest checkpoint"
            )
        if attempt + 1 < attempts:
            ck = resolve(path_or_run)
    raise UserError(
        f"the newest checkpoint of {path_or_run} was deleted while it was read, {attempts} times in a row (the "
        "run is still training and rotates its checkpoints away); run the command again, or train with a larger "
        "--keep_last"
    )


def run_of(checkpoint: Path) -> Path | None:
    """The run folder a checkpoint sits in (``RUN/checkpoints/step_N``), None for one moved out of a run."""
    return checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else None


class UnreadableCheckpoint(UserError):
    """A checkpoint whose checksums verify but whose content cannot be read (forged or corrupt before hashing):
    a resume falls back to the previous checkpoint as for any other corruption."""


def read_meta(path: Path) -> dict[str, Any]:
    return json.loads((path / META_FILE).read_text())


# ----------------------------------------------------------------------------------- DCP's index, read safely
def is_dcp(path: Path) -> bool:
    """Whether ``path`` is a sharded (DCP) checkpoint."""
    return (Path(path) / DCP_METADATA).exists()


# What DCP's .metadata pickle may name (torch 2.11-2.13): its own dataclasses, torch.Size, dtypes, a layout
# helper, the checkpoint's path. Anything else (a forged file naming os.system, say) is refused unread.
_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "StorageMeta",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


def _dcp_data_class(module: str, name: str) -> bool:
    """A dataclass or enum of DCP's own modules (another torch version may pickle one we have not listed):
    rebuilt from its fields, never by calling code."""
    import dataclasses
    import enum
    import sys

    if not module.startswith("torch.distributed.checkpoint.") or "." in name:
        return False
    obj = getattr(sys.modules.get(module), name, None)
    return isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum))


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = (
            name in _DCP_CLASSES.get(module, ())
            or (
                module == "torch"
                and isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format))
            )
            or _dcp_data_class(module, name)
        )
        if not allowed:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint index")
        return super().find_class(module, name)


def read_dcp_metadata(path: Path, name: str = DCP_METADATA) -> Any:
    """DCP's index of a sharded checkpoint, read with the allow-list above (never running code)."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        with open(Path(path) / name, "rb") as f:
            index = _MetadataUnpickler(f).load()
    except (
        pickle.UnpicklingError,
        OSError,
        EOFError,
        AttributeError,
        ValueError,
        TypeError,
        IndexError,
    ) as e:
        raise UnreadableCheckpoint(
            f"{Path(path) / name} cannot be read safely ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
        ) from None
    if not isinstance(index, Metadata):
        raise UnreadableCheckpoint(f"{Path(path) / name} is not a DCP checkpoint index")
    return index
