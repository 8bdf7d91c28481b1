"""Reading a checkpoint back into a run: its weights (either format) into a model, its trainer state.

Nothing here unpickles code: ``state.pt`` is read with ``weights_only=True``, weights come from safetensors or
from DCP shards (whose index the store's allow-list reader checks first). Content that verifies but cannot be
read raises :class:`~.store.UnreadableCheckpoint`, so that a resume falls back to the previous checkpoint.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, load_model
from torch import nn

from gptoughts.errors import UserError
from gptoughts.training.checkpoint.sharded import load_dcp
from gptoughts.training.checkpoint.store import (
    DCP_FORMAT,
    MODEL_FILE,
    STATE_FILE,
    UnreadableCheckpoint,
    is_dcp,
)


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
        mismatch = [ln.strip() for ln in str(e).splitlines() if ln.strip().startswith("size mismatch for")]
        if mismatch:  # intact weights of another shape: another model, not a file to restore
            raise UserError(
                f"checkpoint {path} does not match the model ({mismatch[0][:160]}); was it trained with another "
                "--size, family or tokenizer than the one built here?"
            ) from None
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


def peek_state(path: Path) -> dict[str, Any] | None:
    """Checkpoint ``path``'s state.pt for a look at its entries (the trainer's counters, the optimizer's groups),
    or None where it does not read (the resume says why when it loads it). Memory-mapped: the optimizer's moments
    a single-file checkpoint keeps there are not read, only the pickle's structure."""
    try:
        state = torch.load(Path(path) / STATE_FILE, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - whatever the file holds, the answer is "cannot tell"
        return None
    return state if isinstance(state, dict) else None


def saved_optimizer(path: Path) -> str | None:
    """``"muon"`` or ``"adamw"``: the optimizer whose state checkpoint ``path`` holds, from its parameter groups
    (Muon marks its own); None where it cannot tell (a sharded checkpoint keeps them in its shards, or state.pt
    does not read)."""
    try:
        groups = (peek_state(path) or {})["optimizer"]["param_groups"]
        return "muon" if any(isinstance(g, dict) and g.get("muon") for g in groups) else "adamw"
    except (KeyError, TypeError):
        return None


def load_state(path: Path, device: torch.device | str = "cpu") -> dict[str, Any]:
    """The trainer state of a checkpoint, read with ``weights_only=True``: a pickle holding anything but
    tensors and plain containers (code) is refused, never executed, and reported as an unreadable checkpoint."""
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
