"""Sharded (DCP) checkpoints of a live model and optimizer, on any world size.

:func:`sharded_state` is what a sharded checkpoint holds, each rank only its own shards (no gather, no copy);
:func:`load_dcp` reads one back into a model and optimizer of any sharding (FSDP on any number of ranks, DDP or
one process), resharding as it goes; :func:`consolidated_weights` gives the full weights without a model. DCP
reads ``.metadata`` with plain pickle: every load checks it first through the store's allow-list reader.
"""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gptoughts.errors import UserError
from gptoughts.training.checkpoint.store import DCP_METADATA, UnreadableCheckpoint, read_dcp_metadata


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


def first_failure(e: BaseException) -> BaseException:
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
        inner = first_failure(e)
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
