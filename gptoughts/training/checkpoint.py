"""Atomic, verifiable checkpoints, in one of two formats.

``RUN/checkpoints/step_N/`` holds either the single-file format (one process or DDP: ``model.safetensors``,
``state.pt``, ``meta.json``) or the sharded format (FSDP: torch.distributed.checkpoint shards, ``.metadata``,
``state.pt``, ``meta.json``); ``best.json`` names the best step, never rotated away. Key decisions (layout,
reasons and measurements: docs/checkpoints.md):

* written into a hidden temp dir, fsynced, then renamed; ``meta.json`` (sha256 of every file) is written last,
  and ``latest_valid`` falls back past a checkpoint that does not verify;
* re-saving a step moves the old dir aside first; :func:`recover` renames it back after a crash;
* saves run in the background where that pays (:class:`FileSaver`, :class:`ShardedSaver`): training waits
  only for a copy into host buffers kept for the whole run (:class:`_HostStaging`);
* one process and DDP keep the single-file format: readable without torch.distributed, and DCP is no faster
  there;
* loading never unpickles code: ``weights_only=True`` everywhere, and DCP's ``.metadata`` through an
  allow-list unpickler (:func:`read_dcp_metadata`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import pickle
import re
import shutil
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, load_model, save_file, save_model
from torch import nn

from gptoughts.errors import UserError, as_disk_full

STEP_DIR = re.compile(r"^step_(\d{6,})$")
MODEL_FILE = "model.safetensors"
STATE_FILE = "state.pt"
META_FILE = "meta.json"
DCP_METADATA = ".metadata"
"""DCP's index file; its presence (and ``"format": "dcp"`` in meta.json) marks a sharded checkpoint."""
DCP_FORMAT = "dcp"
log = logging.getLogger("gptoughts.training")


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
        files = {}
        for name in (MODEL_FILE, STATE_FILE):
            _fsync_file(tmp / name)
            files[name] = {"sha256": _sha256(tmp / name), "bytes": (tmp / name).stat().st_size}
        _commit(root, tmp, step, files, val_loss=val_loss, meta=meta)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        full = as_disk_full(e, final)
        if full is not None:
            raise full from None
        raise
    if is_best:
        write_json_atomic(root / "best.json", {"step": step, "val_loss": val_loss})
    rotate(root, keep_last)
    return final


def _commit(
    root: Path,
    tmp: Path,
    step: int,
    files: dict[str, dict[str, Any]],
    *,
    val_loss: float | None,
    meta: dict[str, Any] | None,
) -> Path:
    """Write meta.json (the files' checksums) last into the complete temp dir ``tmp``, then rename it into
    place as ``step_N`` (atomically replacing an existing one)."""
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
    dcp_format = isinstance(meta, dict) and meta.get("format") == DCP_FORMAT
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
    for name, info in files.items():
        f = path / name
        if not f.exists():
            return f"{name} missing"
        if f.stat().st_size != info["bytes"]:
            return f"{name} truncated ({f.stat().st_size} of {info['bytes']} bytes)"
        if _sha256(f) != info["sha256"]:
            return f"{name} checksum mismatch (corrupted)"
    if dcp_format:
        # The cheap check of DCP's own index: it reads safely and every shard file it points to is listed.
        try:
            index = read_dcp_metadata(path)
        except UnreadableCheckpoint as e:
            return str(e)
        wanted = {str(getattr(i, "relative_path", "")) for i in (index.storage_data or {}).values()}
        if not wanted <= set(files):
            return f".metadata points to shards meta.json does not list ({sorted(wanted - set(files))[:3]})"
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


class UnreadableCheckpoint(UserError):
    """A checkpoint whose checksums verify but whose content cannot be read (forged or corrupt before hashing):
    a resume falls back to the previous checkpoint as for any other corruption."""


def read_model_file(path: Path) -> dict[str, torch.Tensor]:
    """A single-file checkpoint's weights, whole (for a pipeline run: each rank keeps its stages')."""
    try:
        return load_file(str(path / MODEL_FILE))
    except Exception as e:  # noqa: BLE001 - OSError, or safetensors' own error type
        raise UnreadableCheckpoint(f"{path / MODEL_FILE} cannot be read ({type(e).__name__})") from None


def load_weights(model: nn.Module, path: Path, *, strict: bool = True, sharded: bool = False) -> None:
    """Load a checkpoint's weights; ``sharded``: into an FSDP model (every rank reads the file, keeps its shard).
    A sharded (DCP) checkpoint loads into any model: sharded (resharded to this run's ranks) or whole."""
    if is_dcp(path):
        load_dcp(path, model, strict=strict)
        return
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
        try:
            state = torch.load(path / STATE_FILE, map_location=device, weights_only=True)
        except pickle.UnpicklingError as e:
            if "torchao." not in str(e):
                raise
            # 8-bit optimizer states (train.optimizer_states = 8bit): torchao's tensor subclass, which its import
            # allows in weights_only loads. A run with other states has not imported it (the moments are
            # converted once loaded: training/optim.py).
            try:
                import torchao.optim  # noqa: F401
            except ImportError:
                raise UserError(
                    f"{path} holds 8-bit optimizer states (train.optimizer_states = 8bit): reading them needs "
                    "torchao (pip install torchao)"
                ) from None
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
    if is_dcp(path):
        # The optimizer state is in the shards: Trainer.load_state_dict reads it into the live optimizer.
        state["optimizer"] = None
        state[DCP_FORMAT] = str(path)
    return state


def read_meta(path: Path) -> dict[str, Any]:
    return json.loads((path / META_FILE).read_text())


# ------------------------------------------------------------------------------------- sharded (DCP) format
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


def _safe_reader(path: Path) -> Any:
    """DCP's file reader, with its ``.metadata`` checked by :func:`read_dcp_metadata` before DCP unpickles it."""
    from torch.distributed.checkpoint import FileSystemReader

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            rank = kwargs.get("rank")
            read_dcp_metadata(path, DCP_METADATA if rank is None else f"__{rank}{DCP_METADATA}")
            return super().read_metadata(*args, **kwargs)

    return SafeReader(str(path))


def _own_state_dict(model: nn.Module) -> bool:
    """A module that defines its own state dict (LoRA's TrainableWeights): read and written as it says."""
    return type(model).state_dict is not nn.Module.state_dict


def _options(**kw: bool) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=False, **kw)


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """What a sharded checkpoint holds: ``{"model": ..., "optimizer": ...}``, each rank only its own shards
    (DTensors under FSDP; plain tensors on one process), the optimizer keyed by parameter name. No gather,
    no copy: DCP reads the tensors where they are."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    out: dict[str, Any] = {
        "model": model.state_dict()
        if _own_state_dict(model)
        else get_model_state_dict(model, options=_options())
    }
    if optimizer is not None:
        out["optimizer"] = get_optimizer_state_dict(model, optimizer, options=_options())
    return out


def _first_failure(e: BaseException) -> BaseException:
    """A CheckpointException carries each failed rank's exception: the first of them (else ``e``)."""
    failures = list(getattr(e, "failures", {}).values())
    inner = failures[0] if failures else e
    inner = inner[0] if isinstance(inner, tuple) and inner else getattr(inner, "exc", inner)
    return inner if isinstance(inner, BaseException) else e


def _dcp_load(dest: dict[str, Any], path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message=".*single process.*")
            dcp.load(dest, storage_reader=_safe_reader(path))
    except UnreadableCheckpoint:
        raise
    except (CheckpointException, OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError) as e:
        inner = _first_failure(e)
        text = str(inner).replace("\n", " ")
        raise UnreadableCheckpoint(f"{path} cannot be read ({type(inner).__name__}: {text[:160]})") from None


_WRAPPER_NAMES = {"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"}


def _optimizer_dest(
    model: nn.Module, model_sd: dict[str, Any], optimizer: torch.optim.Optimizer, index: Any
) -> tuple[dict[str, Any], list[str]] | None:
    """Where DCP reads a checkpoint's optimizer state to, built from its index: each state tensor shaped (and,
    under FSDP, sharded) like its parameter. Avoids ``get_optimizer_state_dict``'s way of materialising the state
    (a zero-gradient optimizer step: seconds and a gradient's worth of memory on CPU at 125m). Returns the
    destination and the parameter names in the optimizer's order; None when names cannot be matched."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    names = {
        id(p): ".".join(c for c in n.split(".") if c not in _WRAPPER_NAMES)
        for n, p in model.named_parameters()
    }
    order = [p for g in optimizer.param_groups for p in g["params"]]
    if any(id(p) not in names for p in order):
        return None
    fqns = [names[id(p)] for p in order]
    if not set(fqns) <= set(model_sd):
        return None
    longest_first = sorted(fqns, key=len, reverse=True)
    state: dict[str, dict[str, Any]] = {}
    prefix = "optimizer.state."
    for key, md in index.state_dict_metadata.items():
        if not key.startswith(prefix):
            continue
        rest = key[len(prefix) :]
        fqn = next((f for f in longest_first if rest.startswith(f + ".")), None)
        if fqn is None:
            continue
        like = model_sd[fqn]
        if not isinstance(md, TensorStorageMetadata):
            value: Any = None  # a non-tensor entry: DCP replaces the placeholder
        elif len(md.size) and tuple(md.size) == tuple(like.shape):
            value = torch.empty_like(like, dtype=md.properties.dtype)  # the parameter's sharding
        else:
            value = torch.empty(md.size, dtype=md.properties.dtype)  # a scalar (step) or another shape: whole
        state.setdefault(fqn, {})[rest[len(fqn) + 1 :]] = value
    groups, start = [], 0
    for i, g in enumerate(optimizer.param_groups):
        keys = [k for k in g if f"optimizer.param_groups.{i}.{k}" in index.state_dict_metadata]
        # "params": placeholders (the saved names replace them), never the parameters themselves
        groups.append({k: fqns[start : start + len(g["params"])] if k == "params" else g[k] for k in keys})
        start += len(g["params"])
    return {"state": state, "param_groups": groups}, fqns


def _load_optimizer_by_index(
    optimizer: torch.optim.Optimizer, loaded: dict[str, Any], fqns: list[str]
) -> bool:
    """``optimizer.load_state_dict`` of a state keyed by name, when its groups hold the same parameters as the
    optimizer's (else False: the caller maps it the general way)."""
    groups, start = [], 0
    for g, saved in zip(optimizer.param_groups, loaded["param_groups"]):
        mine = fqns[start : start + len(g["params"])]
        if list(saved.get("params", [])) != mine:
            return False
        groups.append({**saved, "params": list(range(start, start + len(mine)))})
        start += len(mine)
    if len(loaded["param_groups"]) != len(optimizer.param_groups):
        return False
    state = {i: loaded["state"][f] for i, f in enumerate(fqns) if f in loaded["state"]}
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    return True


def load_dcp(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    weights: bool = True,
    strict: bool = True,
) -> None:
    """Load a sharded checkpoint into ``model`` (and ``optimizer``), whatever their sharding: FSDP on any number
    of ranks (DCP reads each rank's part of every tensor), DDP or one process (whole tensors). Every rank of a
    process group calls it."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    path = Path(path)
    index = read_dcp_metadata(path)
    own = _own_state_dict(model)
    model_sd = model.state_dict() if own else get_model_state_dict(model, options=_options())
    dest: dict[str, Any] = {}
    if weights:
        saved = {k[len("model.") :] for k in index.state_dict_metadata if k.startswith("model.")}
        expected = set(model_sd)
        missing, unexpected = sorted(expected - saved), sorted(saved - expected)
        if strict and (missing or unexpected):
            raise UserError(
                f"checkpoint {path} does not match the model (missing {missing[:4]}, unexpected "
                f"{unexpected[:4]}); was it trained with another --size or family?"
            )
        dest["model"] = {k: v for k, v in model_sd.items() if k in saved}
    plan = None
    if optimizer is not None:
        if not any(k.startswith("optimizer.") for k in index.state_dict_metadata):
            raise UnreadableCheckpoint(f"{path} holds no optimizer state")
        plan = None if own else _optimizer_dest(model, model_sd, optimizer, index)
        dest["optimizer"] = (
            plan[0] if plan else get_optimizer_state_dict(model, optimizer, options=_options())
        )
    _dcp_load(dest, path)
    if weights:
        if own:
            model.load_state_dict(dest["model"], strict=strict)
        else:
            set_model_state_dict(model, dest["model"], options=_options(strict=strict))
    if optimizer is not None:
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        if plan is None or not _load_optimizer_by_index(optimizer, dest["optimizer"], plan[1]):
            set_optimizer_state_dict(model, optimizer, dest["optimizer"], options=_options())
        # A run saved with other parameter groups (tensor parallelism groups parameters by layout) leaves groups
        # without some hyperparameters (betas, ...): this run's own, which its config sets anyway, fill them.
        for g, own_values in zip(optimizer.param_groups, hyper):
            for k, v in own_values.items():
                g.setdefault(k, v)


def consolidated_weights(path: Path) -> dict[str, torch.Tensor]:
    """The full weights of a sharded checkpoint as one state dict on this process (no model needed: the shapes
    and dtypes come from DCP's index)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = Path(path)
    index = read_dcp_metadata(path)
    out = {
        k[len("model.") :]: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in index.state_dict_metadata.items()
        if k.startswith("model.") and isinstance(m, TensorStorageMetadata)
    }
    _dcp_load({"model": out}, path)
    return out


_PRIMITIVE = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device)


def _local(x: torch.Tensor) -> tuple[torch.Tensor, tuple[Any, ...]]:
    """The tensor a staging copies for ``x`` (a DTensor's local shard, else ``x``) and its key: views of the same
    memory share a copy (tied weights)."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():  # to_local() outside autograd: the local tensor itself
        t = (x.to_local() if isinstance(x, DTensor) else x).detach()
    if not t.numel():
        return t, ("empty", id(x))
    return t, (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())


def _local_tensors(state: Any) -> tuple[list[torch.Tensor], dict[tuple[Any, ...], int]]:
    """The distinct local tensors of ``state`` (nested dicts, lists, tuples), in order, and their index by key."""
    sources: list[torch.Tensor] = []
    index: dict[tuple[Any, ...], int] = {}

    def collect(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            t, k = _local(x)
            if k not in index:
                index[k] = len(sources)
                sources.append(t)
        elif isinstance(x, dict):
            for v in x.values():
                collect(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                collect(v)

    collect(state)
    return sources, index


class _HostStaging:
    """Host copies of a sharded state's tensors, kept from one save to the next (:class:`ShardedSaver`).

    Why our own, not DCP's: ``dcp.async_save``'s default staging copies the state to fresh, unpinned host memory
    at every save (1b FSDP2 on 2 H200s, 5.5 GB a rank: training blocked 3.7 s per save), and torch 2.11's reusable
    ``DefaultStager`` fails on its second use with our state (KeyError: <class 'type'> in its deepcopy).

    Each local tensor (a DTensor's local shard, a plain tensor) gets a buffer of its own, page-aligned inside one
    anonymous mapping, allocated at the first save and refilled by every later save whose tensors have the same
    shapes and dtypes (another layout: a new mapping). Its own buffer, not a view of a larger one: DCP's writer
    clones a tensor whose storage is larger than itself. After the first save has been written, the buffers are
    pinned (cudaHostRegister, tensor by tensor) from the checkpoint thread while training goes on, so the first
    save copies into pageable memory and the later ones copy at full PCIe speed with ``non_blocking`` copies and
    one wait on the stream. The price: one host copy of each rank's shards (weights and optimizer state) stays
    allocated for the whole run (the run's plan counts it); :meth:`close` frees it."""

    def __init__(self) -> None:
        self._layout: tuple[tuple[tuple[int, ...], torch.dtype], ...] | None = None
        self._buffers: list[torch.Tensor] = []
        self._pinned: list[int] = []  # data pointers registered with CUDA
        self.allocations = 0
        """How many times buffers were (re)allocated (for the tests)."""
        self.device: torch.device | None = None
        """The GPU the last staged tensors came from (None: none did)."""

    @property
    def nbytes(self) -> int:
        return sum(b.untyped_storage().nbytes() for b in self._buffers)

    @property
    def layout(self) -> tuple[tuple[tuple[int, ...], torch.dtype], ...] | None:
        """The shapes and dtypes the buffers hold (None: no buffers)."""
        return self._layout

    @property
    def pinned(self) -> bool:
        return bool(self._buffers) and len(self._pinned) == sum(1 for b in self._buffers if b.numel())

    def stage(self, state: Any) -> Any:
        """A copy of ``state`` whose tensors live in this staging's host buffers, complete on return: the caller
        may change the originals at once. Containers are rebuilt, other leaves deep-copied."""
        import copy

        from torch.distributed.tensor import DTensor

        sources, index = _local_tensors(state)
        self._ensure([(tuple(t.shape), t.dtype) for t in sources])
        cuda = {t.device for t in sources if t.device.type == "cuda"}
        self.device = next(iter(cuda), None)
        with torch.no_grad():
            for src, buf in zip(sources, self._buffers):
                buf.copy_(src, non_blocking=src.device.type == "cuda")
        # One wait for every copy: they were queued on the stream that computed the weights (after the optimizer
        # step), so the host copy is complete when this returns and training may change the weights at once.
        for dev in cuda:
            torch.cuda.current_stream(dev).synchronize()

        def rebuild(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                host = self._buffers[index[_local(x)[1]]]
                # The same shard of the same global tensor, its local part on the host: what DCP's own stager
                # hands its writer. Not DTensor.from_local, which would move the host tensor to the mesh's device.
                return DTensor(host, x._spec, requires_grad=False) if isinstance(x, DTensor) else host
            if isinstance(x, dict):
                return type(x)((k, rebuild(v)) for k, v in x.items())
            if isinstance(x, list):
                return [rebuild(v) for v in x]
            if isinstance(x, tuple):
                return type(x)(*map(rebuild, x)) if hasattr(x, "_fields") else tuple(map(rebuild, x))
            return x if isinstance(x, _PRIMITIVE) else copy.deepcopy(x)

        return rebuild(state)

    @staticmethod
    def layout_of(state: Any) -> list[tuple[tuple[int, ...], torch.dtype]]:
        return [(tuple(t.shape), t.dtype) for t in _local_tensors(state)[0]]

    def prepare(self, layout: list[tuple[tuple[int, ...], torch.dtype]], device: torch.device | None) -> None:
        """Allocate (and on CUDA pin) the buffers of ``layout`` (:meth:`layout_of` the state to save) ahead of the
        first save; :meth:`ShardedSaver.prepare` runs it in a background thread while training goes on."""
        self._ensure(layout)
        self.pin(device)

    def _ensure(self, layout: list[tuple[tuple[int, ...], torch.dtype]]) -> None:
        """Buffers for ``layout``: the current ones when it is theirs, else new ones."""
        import mmap

        if tuple(layout) == self._layout:
            return
        self.close()
        page = mmap.PAGESIZE
        sizes = [math.prod(shape) * torch.empty((), dtype=dt).element_size() for shape, dt in layout]
        total = sum(-(-n // page) * page for n in sizes)
        region: Any = None
        if total:
            region = mmap.mmap(-1, total)  # anonymous, page-aligned, filled lazily by the first copy
            # Huge pages: fewer page faults at the first copy, faster pinning. DONTFORK: a process forked later
            # (a data worker) neither shares nor copies these pages (Linux copies pinned pages at fork).
            for advice in ("MADV_HUGEPAGE", "MADV_DONTFORK"):
                if hasattr(mmap, advice):
                    try:
                        region.madvise(getattr(mmap, advice))
                    except OSError:
                        pass
        buffers, offset = [], 0
        for (shape, dt), n in zip(layout, sizes):
            if n == 0:
                buffers.append(torch.empty(shape, dtype=dt))
                continue
            # Each buffer holds a reference to the mapping: it is unmapped when the last buffer goes.
            buffers.append(
                torch.frombuffer(region, dtype=dt, count=n // dt.itemsize, offset=offset).view(shape)
            )
            offset += -(-n // page) * page
        self._buffers, self._layout = buffers, tuple(layout)
        self.allocations += 1

    def pin(self, device: torch.device | None) -> None:
        """Page-lock the buffers for CUDA, one tensor at a time (each page-aligned: no two share a page), so that no
        call holds the driver long while training runs beside it. A failure leaves the rest pageable (slower
        copies, still correct)."""
        if device is None or not torch.cuda.is_available() or self.pinned:
            return
        torch.cuda.set_device(device)  # this thread's device, else the driver would open a context on GPU 0
        cudart = torch.cuda.cudart()
        done = set(self._pinned)
        for b in self._buffers:
            ptr = b.data_ptr()
            if not b.numel() or ptr in done:
                continue
            if int(cudart.cudaHostRegister(ptr, b.untyped_storage().nbytes(), 1)) != 0:
                return
            self._pinned.append(ptr)

    def close(self) -> None:
        """Unpin and drop the buffers (the caller makes sure no copy or write uses them)."""
        if self._pinned:
            cudart = torch.cuda.cudart()
            for ptr in self._pinned:
                cudart.cudaHostUnregister(ptr)
        self._pinned, self._buffers, self._layout = [], [], None


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


def host_memory_available() -> int | None:
    """Bytes of memory this process can still take without swapping or meeting its container's limit: Linux
    ``MemAvailable``, lowered to what the cgroup's limit leaves (v2 ``memory.max``, v1 ``memory.limit_in_bytes``:
    Slurm, Kubernetes and Docker jobs see the host's MemAvailable but are killed at their own limit); None where
    unknown."""
    free = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        return None
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            limit = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and free is not None:
            free = min(free, max(0, int(limit) - usage))
        break
    return free


def stageable(state: Any) -> bool:
    """Whether every tensor of ``state`` (a DTensor: its local shard) is a plain tensor that host staging can copy:
    not a wrapper subclass such as torchao's 8-bit optimizer states, whose values live in inner tensors (no
    storage of their own: a copy by data pointer would give every one of them the same buffer)."""
    return _plain(_local_tensors(state)[0])


def _plain(tensors: list[torch.Tensor]) -> bool:
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    return not any(is_traceable_wrapper_subclass(t) for t in tensors)


class _BackgroundWriter:
    """What both savers share: host staging buffers kept across saves, one background thread (a pending write or
    the buffers' preparation) and its error, raised by :meth:`wait` in the caller's thread."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.staging = _HostStaging()
        self.prepared = False
        """Whether ``prepare`` was called (the trainer calls it once, after the first step)."""
        self.blocked_s = 0.0
        """Seconds the caller was blocked by the last ``save`` (for the log and the benchmarks)."""

    @property
    def pending(self) -> bool:
        return self._thread is not None

    def wait(self) -> None:
        """Block until the pending write (if any) is on disk; raise its error as a :class:`UserError` (a full disk
        as an ``OSError(ENOSPC)``, which the caller reports with the last good checkpoint)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            full = as_disk_full(err)
            if full is not None:  # the same full disk as a synchronous save's, reported alike
                raise full from None
            raise UserError(str(err)) from None

    def _prepare_staging(self, layout: list[tuple[tuple[int, ...], torch.dtype]], gpu: int | None) -> None:
        """Allocate (and pin for ``gpu``) the buffers of ``layout`` in the background; a failure is ignored: the
        next save allocates (and reports a real error) itself. That save waits for it, as for a pending write."""

        def work() -> None:
            try:
                self.staging.prepare(layout, torch.device("cuda", gpu) if gpu is not None else None)
            except Exception:  # noqa: BLE001 - see the docstring
                pass

        self._thread = threading.Thread(target=work, name="checkpoint-staging")
        self._thread.start()

    def _write_in_background(self, step: int, write: Callable[[], None], source: torch.device | None) -> None:
        """Run ``write`` (which records its own error in ``_error``) in the saver's thread, then pin the staging
        buffers for ``source`` (after the first write, while training goes on: later saves copy at full speed)."""

        def work() -> None:
            write()
            try:
                self.staging.pin(source)
            except Exception:  # noqa: BLE001 - unpinned buffers are slower, not wrong
                pass

        # Not a daemon: the interpreter waits for it at exit, so a process never ends with a save in flight.
        self._thread = threading.Thread(target=work, name=f"checkpoint-step-{step}")
        self._thread.start()

    def close(self) -> None:
        """Wait for the pending write, then free the host staging buffers (a later save makes new ones)."""
        try:
            self.wait()
        finally:
            self.staging.close()


class FileSaver(_BackgroundWriter):
    """Writes single-file checkpoints (one process, or rank 0 of DDP) under ``root``, in the background where that
    pays: the state's tensors live on a GPU, ``background`` is on and the host has room for a copy.

    Training stops only while the state is copied to host buffers that the saver keeps from one save to the next
    (:class:`_HostStaging`, pinned after the first write); a thread then writes, hashes and renames the checkpoint
    (:func:`save`, the same files as a synchronous save): a synchronous save of a 1b model with its AdamW state
    (13 GB) stops training for the whole write (docs/checkpoints.md). The next save, a rollback and the end of
    the run wait for a pending write (:meth:`wait`). Elsewhere (CPU runs, whose write would compete with
    training for the same cores; a host without the memory for one more copy of the state) it writes
    synchronously."""

    def __init__(self, root: str | Path, *, keep_last: int = 3, background: bool = True):
        super().__init__()
        self.root = Path(root)
        self.keep_last = keep_last
        self.background = background
        self.last_in_background = False
        """Whether the last :meth:`save` was written by the thread."""

    def _worth_it(self, weights: dict[str, torch.Tensor], state: Any) -> bool:
        """The background path: on, tensors on a GPU, all of them plain (:func:`stageable`), and host memory for
        the staging copy plus one more copy of the weights (older safetensors copy them while writing), with 2 GiB
        to spare: a run killed by the OOM killer at a save would lose more than the write costs. Checked again
        whenever the state's layout changes (the buffers are then made anew)."""
        if not self.background:
            return False
        tensors = _local_tensors((weights, state))[0]
        if not any(t.device.type == "cuda" for t in tensors) or not _plain(tensors):
            return False
        if tuple((tuple(t.shape), t.dtype) for t in tensors) == self.staging.layout:
            return True  # the buffers of an earlier save or of prepare(): the room was there

        def nbytes(ts: list[torch.Tensor]) -> int:
            return sum(t.numel() * t.element_size() for t in ts)

        need = nbytes(tensors) + nbytes(_local_tensors(weights)[0]) + 2 * 2**30
        free = host_memory_available()
        return free is not None and free + self.staging.nbytes >= need

    def prepare(self, weights: dict[str, torch.Tensor], state: dict[str, Any]) -> None:
        """Allocate and pin the host buffers of the saves of ``(weights, state)`` in a background thread, now
        rather than at the first save (whose copy would otherwise page-fault fresh memory at ~1 GB/s). A failure
        is ignored: that save allocates (and reports a real error) itself."""
        self.prepared = True
        if self._thread is None and self._worth_it(weights, state):
            gpu = next((t.device.index for t in _local_tensors((weights, state))[0] if t.is_cuda), None)
            self._prepare_staging(_HostStaging.layout_of((weights, state)), gpu)

    def _save_kwargs(
        self, weights_metadata: dict[str, str] | None, val_loss: float | None, is_best: bool, meta: Any
    ) -> dict[str, Any]:
        return dict(
            weights_metadata=weights_metadata, val_loss=val_loss, keep_last=self.keep_last, is_best=is_best,
            meta=meta,
        )  # fmt: skip

    def failed(self) -> bool:
        """Whether a background write has ended in an error not yet reported (cheap: no wait)."""
        thread = self._thread
        return self._error is not None and (thread is None or not thread.is_alive())

    def save(
        self,
        step: int,
        weights: dict[str, torch.Tensor],
        state: dict[str, Any],
        *,
        weights_metadata: dict[str, str] | None = None,
        val_loss: float | None = None,
        is_best: bool = False,
        meta: dict[str, Any] | None = None,
    ) -> None:
        """Write checkpoint ``step`` (``weights`` from :func:`weights_for_file`, ``state`` the trainer's). Waits
        for a pending write first; on return the caller may change every tensor of ``weights`` and ``state``."""
        t0 = time.perf_counter()
        try:
            self.wait()  # the previous write still reads the host buffers that this save refills
        except (UserError, OSError) as e:
            # That checkpoint is missing: this one is written now, here, so that nothing more is at risk (a disk
            # still full raises from it, as a synchronous save always did); training goes on if it succeeds.
            save(
                self.root,
                step,
                weights,
                state,
                **self._save_kwargs(weights_metadata, val_loss, is_best, meta),
            )
            log.warning("%s; step %d was written instead, without the background thread", e, step)
            self.blocked_s = time.perf_counter() - t0
            self.last_in_background = False
            return
        kwargs = self._save_kwargs(weights_metadata, val_loss, is_best, meta)
        staged = None
        if self._worth_it(weights, state):
            try:
                staged = self.staging.stage((weights, state))
            except Exception as e:  # noqa: BLE001 - the host ran short (or a leaf would not copy): write it here
                self.staging.close()
                self.background = False
                log.warning(
                    "checkpoints are written synchronously from now on: copy to host memory failed (%s)", e
                )
        self.last_in_background = staged is not None
        if staged is None:
            save(self.root, step, weights, state, **kwargs)
            self.blocked_s = time.perf_counter() - t0
            return
        host_weights, host_state = staged
        source = self.staging.device
        self.blocked_s = time.perf_counter() - t0

        def write() -> None:
            try:
                save(self.root, step, host_weights, host_state, **kwargs)
            except BaseException as e:  # noqa: BLE001 - reported by wait() in the caller's thread
                self._error = as_disk_full(e) or RuntimeError(
                    f"checkpoint step {step} could not be written: {type(e).__name__}: {e}"
                )

        self._write_in_background(step, write, source)


class ShardedSaver(_BackgroundWriter):
    """Writes sharded checkpoints (every rank calls :meth:`save` with its own shards) under ``root``.

    ``async_save``: :meth:`save` returns once this rank's shards are copied to host buffers that the saver keeps
    from one save to the next (:class:`_HostStaging`); a background thread writes them (``dcp.save`` of the host
    copy), then finishes the checkpoint (hashes, meta.json, rename, best.json, rotation: see the module
    docstring). Its collectives run over a gloo group of this saver's own, made at construction (a collective:
    every rank constructs it; collectives from a second thread need a CPU-capable group, which is also what
    ``dcp.async_save`` asks for). :meth:`wait` joins a pending save and raises its error, if any; :meth:`close`
    also frees the host buffers."""

    def __init__(self, root: str | Path, *, rank: int = 0, async_save: bool = True, keep_last: int = 3):
        import torch.distributed as dist

        super().__init__()
        self.root = Path(root)
        self.rank = rank
        self.async_save = async_save
        self.keep_last = keep_last
        self.group = dist.new_group(backend="gloo") if dist.is_available() and dist.is_initialized() else None
        # One process: DCP says so from its writer thread too, where no catch_warnings holds.
        if self.group is None:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninit")

    def prepare(self, state: dict[str, Any]) -> None:
        """Allocate and pin the host buffers the saves of ``state`` (:func:`sharded_state`) will use, in a background
        thread, now rather than at the first save: with allocation at the save, the first save blocked training
        4.2 s at 1b and 41 s at 8b (2 H200s, FSDP2, torch 2.11: ~1 GB/s into fresh pageable pages); into pinned
        buffers the copy runs at PCIe speed. The next :meth:`save` waits for it (as for a pending write). A failure
        is ignored: that save allocates (and reports a real error) itself."""
        self.prepared = True
        if not self.async_save or self._thread is not None:
            return
        gpu = (
            torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        )
        self._prepare_staging(_HostStaging.layout_of(state), gpu)

    def _broadcast(self, obj: Any) -> Any:
        if self.group is None:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        return box[0]

    def _gather(self, obj: Any) -> list[Any]:
        if self.group is None:
            return [obj]
        import torch.distributed as dist

        out = [None] * dist.get_world_size(self.group) if self.rank == 0 else None
        dist.gather_object(obj, out, dst=dist.get_global_rank(self.group, 0), group=self.group)
        return out or []

    def save(
        self,
        step: int,
        state: dict[str, Any],
        trainer_state: dict[str, Any] | None,
        *,
        val_loss: float | None = None,
        is_best: bool = False,
        meta: dict[str, Any] | None = None,
    ) -> None:
        """Write checkpoint ``step``: ``state`` from :func:`sharded_state` (each rank its own), ``trainer_state``
        (rank 0's; saved as state.pt). Waits for a pending save first."""
        import torch.distributed.checkpoint as dcp

        t0 = time.perf_counter()
        self.wait()  # the previous write still reads the host buffers that this save refills
        staged, error = None, None
        # torchao's 8-bit optimizer states are wrapper tensors host staging cannot copy: written synchronously
        background = self.async_save and stageable(state)
        if background:
            try:
                staged = self.staging.stage(state)
            except Exception as e:  # noqa: BLE001 - every rank must learn of it, or the others wait in dcp.save
                error = f"rank {self.rank}: copy to host memory failed: {type(e).__name__}: {e}"
        errors = [e for e in self._gather(error) if e]
        tmp_name = None
        if self.rank == 0:
            try:
                if errors:
                    raise OSError("; ".join(errors))
                self.root.mkdir(parents=True, exist_ok=True)
                recover(self.root)
                tmp_name = f".tmp-step_{step:06d}-{os.getpid()}-{time.monotonic_ns()}"
                (self.root / tmp_name).mkdir()
                torch.save(trainer_state, self.root / tmp_name / STATE_FILE)
            except Exception as e:  # noqa: BLE001 - every rank must learn of it, not only rank 0
                error = f"checkpoint step {step} could not be written: {type(e).__name__}: {e}"
                if tmp_name is not None:
                    shutil.rmtree(self.root / tmp_name, ignore_errors=True)
        tmp_name, error = self._broadcast((tmp_name, error))
        if error is not None:
            raise UserError(error)
        tmp = self.root / tmp_name
        done = functools.partial(self._finish, tmp, step, val_loss=val_loss, is_best=is_best, meta=meta)
        if not background:
            try:
                with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
                    warnings.filterwarnings("ignore", message=".*single process.*")
                    dcp.save(state, checkpoint_id=str(tmp), process_group=self.group)
            except BaseException as e:  # noqa: BLE001 - CheckpointException is a BaseException
                self._error = e
            done()
            self.blocked_s = time.perf_counter() - t0
            self.wait()
            return
        source = self.staging.device  # the GPU the shards came from (None: host tensors, nothing to pin for)
        gpu = (
            torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        )
        self.blocked_s = time.perf_counter() - t0

        def write() -> None:
            if gpu is not None:  # DCP's writer uses the current stream: this rank's GPU, not GPU 0
                torch.cuda.set_device(gpu)
            try:  # what dcp.async_save's thread does, on our host copy (async_save would copy it once more)
                dcp.save(staged, checkpoint_id=str(tmp), process_group=self.group)
            except BaseException as e:  # noqa: BLE001 - reported by wait() in the caller's thread
                self._error = e
            done()

        self._write_in_background(step, write, source)

    def _finish(
        self,
        tmp: Path,
        step: int,
        *,
        val_loss: float | None,
        is_best: bool,
        meta: dict[str, Any] | None,
    ) -> None:
        """Every rank hashes the shard files it wrote; rank 0 gathers the hashes, writes meta.json last and
        renames the dir into place, and every rank learns the outcome."""
        mine: dict[str, Any] | str
        if self._error is not None:
            err = _first_failure(self._error)
            mine = f"rank {self.rank}: {type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]}"
        else:
            try:
                mine = {
                    f.name: {"sha256": _sha256(f), "bytes": f.stat().st_size}
                    for f in sorted(tmp.glob(f"__{self.rank}_*.distcp"))
                }
            except OSError as e:
                mine = f"rank {self.rank}: {e}"
        gathered = self._gather(mine)
        status = None
        if self.rank == 0:
            problems = [g for g in gathered if isinstance(g, str)]
            try:
                if problems:
                    raise OSError("; ".join(problems))
                files: dict[str, Any] = {}
                for g in gathered:
                    files.update(g)
                for name in (DCP_METADATA, STATE_FILE):
                    _fsync_file(tmp / name)
                    files[name] = {"sha256": _sha256(tmp / name), "bytes": (tmp / name).stat().st_size}
                world = len(gathered)
                _commit(
                    self.root,
                    tmp,
                    step,
                    files,
                    val_loss=val_loss,
                    meta={**(meta or {}), "format": DCP_FORMAT, "world_size": world},
                )
                if is_best:
                    write_json_atomic(self.root / "best.json", {"step": step, "val_loss": val_loss})
                rotate(self.root, self.keep_last)
            except BaseException as e:  # noqa: BLE001 - every rank must learn of it
                shutil.rmtree(tmp, ignore_errors=True)
                status = f"checkpoint step {step} could not be written: {type(e).__name__}: {e}"
        status = self._broadcast(status)
        self._error = RuntimeError(status) if status is not None else None
