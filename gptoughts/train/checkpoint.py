"""Atomic, verifiable checkpoints.

Layout of ``RUN/checkpoints/``::

    step_000120/
        model.safetensors   weights (safetensors: no pickle, loadable anywhere)
        state.pt            optimizer, step, RNG, loader and trainer state; torch.load(weights_only=True) reads it
        meta.json           step, val loss, sha256 of each file (written last), and what the trainer adds
                            (tokens seen, data steps skipped by rollbacks, rollbacks, learning-rate scale)
    best.json               {"step": ..., "val_loss": ...}: the best checkpoint, never rotated away

A checkpoint is written into a hidden temp dir, every file fsynced, then the dir is renamed into place, so
a crash mid-write never leaves a directory that looks complete. ``latest_valid`` re-hashes files and skips a
truncated or corrupted newest checkpoint with a warning, falling back to the previous one.

Re-saving a step that exists (a rollback records its decision in the checkpoint it returned to) moves the old
dir aside as ``.old-step_N-*`` before renaming the new one in; a crash between the two renames leaves only the
``.old`` dir, which :func:`recover` (run by ``save`` and ``latest_valid``) renames back, so a step dir is
never lost.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, load_model, save_file, save_model
from torch import nn

from gptoughts.errors import UserError

STEP_DIR = re.compile(r"^step_(\d{6,})$")
MODEL_FILE = "model.safetensors"
STATE_FILE = "state.pt"
META_FILE = "meta.json"


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
    """The step of a checkpoint directory ``step_000123`` (its meta.json's step when the name is not one)."""
    m = STEP_DIR.match(Path(path).name)
    return int(m.group(1)) if m else int(read_meta(Path(path))["step"])


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
) -> Path:
    """Write checkpoint ``step`` atomically, rotate old ones (never the best), return its directory.
    ``model`` is the module, or its full state dict (a sharded run gathers one); ``meta``: extra JSON fields
    for ``meta.json``."""
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
            save_file({k: v.contiguous() for k, v in model.items()}, str(tmp / MODEL_FILE))
        torch.save(state, tmp / STATE_FILE)
        files = {}
        for name in (MODEL_FILE, STATE_FILE):
            _fsync_file(tmp / name)
            files[name] = {"sha256": _sha256(tmp / name), "bytes": (tmp / name).stat().st_size}
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
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if is_best:
        write_json_atomic(root / "best.json", {"step": step, "val_loss": val_loss})
    rotate(root, keep_last)
    return final


def _replace(final: Path, tmp: Path, root: Path) -> None:
    """Swap the complete dir ``tmp`` in for ``final``. A crash between the two renames leaves only
    ``.old-<final>-*``, which :func:`recover` renames back."""
    old = root / f".old-{final.name}-{time.monotonic_ns()}"
    final.rename(old)
    _fsync_dir(root)
    tmp.rename(final)
    _fsync_dir(root)
    shutil.rmtree(old, ignore_errors=True)


_OLD_DIR = re.compile(r"^\.old-(step_\d{6,})-(\d+)$")


def recover(root: str | Path) -> None:
    """Finish a replace that a crash interrupted: a ``.old-step_N-*`` dir whose ``step_N`` is missing is renamed
    back (it was complete: it had been in place); one whose ``step_N`` exists is a leftover and is removed."""
    root = Path(root)
    if not root.is_dir():
        return
    olds = sorted(
        ((m, p) for p in root.iterdir() if p.is_dir() and (m := _OLD_DIR.match(p.name))),
        key=lambda mp: -int(mp[0].group(2)),
    )  # the newest first
    for m, p in olds:
        final = root / m.group(1)
        if final.exists():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.rename(final)
            _fsync_dir(root)


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2))
    _fsync_file(tmp)
    os.replace(tmp, path)


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


def rotate(root: Path, keep_last: int) -> None:
    steps = list_steps(root)
    keep = set(steps[-keep_last:]) if keep_last > 0 else set(steps[-1:])
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
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return "meta.json unreadable"
    # A meta.json that is valid JSON but lists no files (or not both files, or wrong fields) verifies nothing.
    if (
        not isinstance(files, dict)
        or set(files) != {MODEL_FILE, STATE_FILE}
        or not all(
            isinstance(i, dict) and isinstance(i.get("bytes"), int) and isinstance(i.get("sha256"), str)
            for i in files.values()
        )
    ):
        return "meta.json does not describe model.safetensors and state.pt"
    for name, info in files.items():
        f = path / name
        if not f.exists():
            return f"{name} missing"
        if f.stat().st_size != info["bytes"]:
            return f"{name} truncated ({f.stat().st_size} of {info['bytes']} bytes)"
        if _sha256(f) != info["sha256"]:
            return f"{name} checksum mismatch (corrupted)"
    return None


def latest_valid(root: str | Path, *, before: int | None = None) -> Path | None:
    """The newest intact checkpoint dir under ``root`` (with ``before``: of a step < ``before``); corrupted
    newer ones are skipped with a warning."""
    root = Path(root)
    recover(root)
    for s in reversed(list_steps(root)):
        if before is not None and s >= before:
            continue
        path = step_dir(root, s)
        problem = verify(path)
        if problem is None:
            return path
        warnings.warn(
            f"checkpoint {path} is unusable ({problem}); falling back to the previous one", stacklevel=2
        )
    return None


def resolve(path_or_run: str | Path) -> Path:
    """A checkpoint dir from a checkpoint dir, a run dir or a checkpoints dir (newest valid)."""
    p = Path(path_or_run)
    if not p.exists():
        raise UserError(f"{p} does not exist; pass a run directory or a checkpoint directory")
    if (p / META_FILE).exists() or (p / MODEL_FILE).exists():
        problem = verify(p)
        if problem:
            raise UserError(f"checkpoint {p} is unusable: {problem}")
        return p
    for root in (p / "checkpoints", p):
        found = latest_valid(root)
        if found is not None:
            return found
    raise UserError(f"no valid checkpoint under {p}; train first or pass a checkpoint directory")


class UnreadableCheckpoint(UserError):
    """A checkpoint whose checksums verify but whose content cannot be read (forged or corrupt before hashing):
    a resume falls back to the previous checkpoint as for any other corruption."""


def load_weights(model: nn.Module, path: Path, *, strict: bool = True, sharded: bool = False) -> None:
    """Load a checkpoint's weights; ``sharded``: into an FSDP model (every rank reads the file, keeps its shard)."""
    try:
        if sharded:
            from gptoughts.parallel.dist import load_full_state_dict

            state = load_file(str(path / MODEL_FILE))
            expected = set(model.state_dict())
            missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
            if not missing and not unexpected:
                load_full_state_dict(model, state)
        else:
            missing, unexpected = load_model(model, str(path / MODEL_FILE), strict=False)
    except (OSError, ValueError, RuntimeError) as e:  # SafetensorError is an Exception: see below
        raise UnreadableCheckpoint(
            f"{path / MODEL_FILE} cannot be read ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
        ) from None
    except Exception as e:  # noqa: BLE001 - safetensors' own error type: the file is not a valid safetensors file
        if type(e).__name__ != "SafetensorError":
            raise
        raise UnreadableCheckpoint(f"{path / MODEL_FILE} is not a valid safetensors file ({e})") from None
    if strict and (missing or unexpected):
        raise UserError(
            f"checkpoint {path} does not match the model (missing {sorted(missing)[:4]}, "
            f"unexpected {sorted(unexpected)[:4]}); was it trained with another --size or family?"
        )


def load_state(path: Path, device: torch.device | str = "cpu") -> dict[str, Any]:
    """The trainer state of a checkpoint, read with ``weights_only=True``: a pickle holding anything but
    tensors and plain containers (code) is refused, never executed, and reported as an unreadable checkpoint."""
    import pickle

    try:
        state = torch.load(path / STATE_FILE, map_location=device, weights_only=True)
    except (
        pickle.UnpicklingError,
        OSError,
        RuntimeError,
        EOFError,
        ValueError,
        AttributeError,
        ImportError,
    ) as e:
        raise UnreadableCheckpoint(
            f"{path / STATE_FILE} cannot be read safely ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
        ) from None
    if (
        not isinstance(state, dict)
        or not isinstance(state.get("trainer"), dict)
        or "step" not in state["trainer"]
    ):
        raise UnreadableCheckpoint(f"{path / STATE_FILE} is not a gptoughts trainer state")
    return state


def read_meta(path: Path) -> dict[str, Any]:
    return json.loads((path / META_FILE).read_text())
