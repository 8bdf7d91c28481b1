"""Hugging Face interop, reading: import a local ``transformers`` model folder.

Native path: a family that sets ``Family.hf`` to an :class:`HFAdapter` maps ``config.json`` to its args and the
HF state dict to its own names (the mapping functions live in the family's file, e.g. ``llama_hf.py``), so a
fine-tuned Llama/Mistral/Qwen runs on our fast code. Generic path: any other ``AutoModelForCausalLM`` is wrapped
by ``hf_generic.HFCausalLM``, which obeys the model protocol of ``docs/internals.md``, so the same trainer
(precision, compile, checkpoints, LoRA) runs it; a one-line notice says the native fast path does not cover it.

Where from: a local folder, or a Hugging Face hub id (``ORG/NAME``) found in the Hugging Face cache and
downloaded into it when online (:func:`locate`, through ``huggingface_hub``).

Reading: ``config.json``; weights from ``model.safetensors``, sharded ``model.safetensors.index.json`` or, as a
last resort, ``pytorch_model.bin`` read with ``torch.load(weights_only=True)`` (never arbitrary pickles); the
tokenizer from the same folder. ``trust_remote_code`` stays off unless the caller passes it. Writing a folder
back: ``hf_export.py``.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gptoughts.errors import ConfigError, UserError, did_you_mean
from gptoughts.models.hf_generic import HFCausalLM

log = logging.getLogger("gptoughts.models.hf")

CONFIG_NAME = "config.json"
SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
BIN_WEIGHTS = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"


class UnsupportedHFConfig(Exception):
    """Raised by an adapter's ``args_from_hf`` for a config its native code would not reproduce exactly; the
    loader then takes the generic ``transformers`` path (this is not a user error)."""


@dataclass(frozen=True)
class HFAdapter:
    """How one family reads and writes ``transformers`` checkpoints (set as ``Family.hf``)."""

    model_types: tuple[str, ...]
    """``config.json`` ``model_type`` values this family imports natively."""
    args_from_hf: Callable[[dict[str, Any]], Any]
    """Resolved ``config.json`` dict -> the family's args; raises ``UnsupportedHFConfig`` when it cannot."""
    hf_config: Callable[..., dict[str, Any]]
    """``hf_config(args)`` or ``hf_config(args, base)`` -> a ``config.json`` dict; ``base`` is the config of the
    model the run started from (keeps its model_type and token ids)."""
    from_hf: Callable[[dict[str, torch.Tensor], Any], dict[str, torch.Tensor]]
    """HF state dict -> ours (names and layout)."""
    to_hf: Callable[[dict[str, torch.Tensor], Any], dict[str, torch.Tensor]]
    """Our state dict -> HF."""


# ------------------------------------------------------------------------------------------------ reading


def is_hf_folder(path: str | Path) -> bool:
    """A folder written by ``save_pretrained`` (a ``config.json``), not one of our run directories."""
    p = Path(path)
    return (p / CONFIG_NAME).is_file() and not (p / "config.toml").exists()


# A Hugging Face hub id as huggingface_hub accepts them: ORG/NAME of letters, digits, "-", "_" and ".".
_HUB_ID = re.compile(r"^[\w][\w.-]*/[\w][\w.-]*$")
# What a plan reads of a model (config, tokenizer, the folder's own code): its weights come when the run starts.
_LIGHT_FILES = ["*.json", "*.jinja", "*.model", "*.txt", "*.tiktoken", "*.py"]


# A hub model as the Hugging Face cache holds it: .../models--ORG--NAME/snapshots/COMMIT ("--" is never in a hub id).
_SNAPSHOT = re.compile(r"models--([\w.-]+?)--([\w.-]+)/snapshots/([0-9a-f]{40})/?$")


def is_hub_id(spec: str) -> bool:
    """``ORG/NAME``, which names a Hugging Face hub model when no local folder has that path."""
    return bool(_HUB_ID.match(spec)) and ".." not in spec and not Path(spec).expanduser().exists()


def locate(spec: str | Path, *, weights: bool = True) -> Path:
    """The local folder of a model: ``spec`` itself, or for a hub id (:func:`is_hub_id`) its snapshot in the
    Hugging Face cache, downloaded when online and not cached (``weights=False``: only the files a plan reads).
    Neither: a UserError saying how to get it."""
    if not is_hub_id(str(spec)):
        return Path(spec).expanduser()
    from huggingface_hub import constants, errors, snapshot_download

    repo = str(spec)
    try:
        return Path(snapshot_download(repo, allow_patterns=None if weights else _LIGHT_FILES))
    except errors.GatedRepoError:
        raise UserError(
            f"{repo} is gated on the Hugging Face hub: accept its terms on its page, log in with "
            "`hf auth login`, and run again"
        ) from None
    except errors.RepositoryNotFoundError:
        raise UserError(
            f"{repo} is neither a local folder nor a model on the Hugging Face hub (a private one needs "
            "`hf auth login`); check the name"
        ) from None
    except errors.LocalEntryNotFoundError as e:  # offline, or the hub unreachable, and not (fully) cached
        held = "holds only part of it" if "incomplete" in str(e) else "does not hold it"
        why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the hub could not be reached"
        raise UserError(
            f"{repo} is not a local folder, and the Hugging Face cache {held} ({why}): download it with "
            f"`hf download {repo}` on a machine with network, or pass the model's local folder"
        ) from None
    except errors.HfHubHTTPError as e:
        raise UserError(
            f"the Hugging Face hub refused {repo} ({str(e).splitlines()[0][:200]}); download it with "
            f"`hf download {repo}`, or pass the model's local folder"
        ) from None


def restore_hint(path: str | Path) -> str:
    """The fix for a model folder that is gone: a snapshot of the Hugging Face cache (what a run fine-tuned from a hub
    id records) is downloaded again at its revision, to the same path; any other folder is put back."""
    m = _SNAPSHOT.search(Path(path).as_posix())
    if m is None:
        return "put the base model folder back at that path"
    repo, commit = f"{m[1]}/{m[2]}", m[3]
    return (
        f"it is {repo} as the Hugging Face cache held it: download it again with "
        f"`hf download {repo} --revision {commit}`"
    )


def base_fingerprint(spec: str | Path) -> str | None:
    """16 hex digits naming a local model folder's files as they are: ``config.json``, and each weight file's name,
    size and first and last MiB (a new revision saved over the old one changes them; its sizes alone may not).
    None for a hub id (its cache keeps revisions apart) or a folder that is not there."""
    import hashlib

    p = Path(spec).expanduser()
    if is_hub_id(str(spec)) or not p.is_dir():
        return None
    h = hashlib.sha256()
    for f in sorted(p.iterdir()):
        if f.name != CONFIG_NAME and f.suffix not in (".safetensors", ".bin"):
            continue
        size = f.stat().st_size
        h.update(f"{f.name}\0{size}\0".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
            if size > 2 << 20:
                fh.seek(-(1 << 20), 2)
                h.update(fh.read())
    return h.hexdigest()[:16]


def check_base_unchanged(run_dir: str | Path, base: str, recorded: Any) -> None:
    """Refuse adapters trained on ``base`` as it was (``recorded``: run.json's ``base_fingerprint``) where its files
    have changed since: over other weights they compute another model, silently."""
    if not isinstance(recorded, str) or (now := base_fingerprint(base)) is None or now == recorded:
        return
    raise UserError(
        f"{run_dir} was trained on top of {base} as it was then, and its files have changed since (config.json or "
        "weights): what was trained over it fits only those weights; put that version of the model back"
    )


def read_config(path: str | Path) -> dict[str, Any]:
    """The raw ``config.json`` of a model folder (UserError when it is not one; a gptoughts run's is
    ``hf_export.run_config``)."""
    p = Path(path).expanduser()
    if not p.is_dir():
        if _SNAPSHOT.search(p.as_posix()):  # a hub model the cache held (a run's base), deleted since
            raise UserError(f"{p} is missing; {restore_hint(p)}")
        raise UserError(
            f"{p} is not a folder; pass a local Hugging Face model folder (what save_pretrained writes) or "
            "a Hugging Face hub id (ORG/NAME)"
        )
    if not (p / CONFIG_NAME).is_file():
        raise UserError(f"{p} has no config.json; pass the folder that transformers' save_pretrained wrote")
    try:
        cfg = json.loads((p / CONFIG_NAME).read_text(encoding="utf-8"))
    except ValueError as e:
        raise UserError(f"{p / CONFIG_NAME} is not valid JSON ({e}); re-save the model") from None
    if not isinstance(cfg, dict) or "model_type" not in cfg:
        raise UserError(f"{p / CONFIG_NAME} has no model_type; re-save the model with transformers")
    return cfg


def resolved_config(path: str | Path, trust_remote_code: bool = False) -> dict[str, Any]:
    """``config.json`` with every default filled in by transformers' own config class (``save_pretrained`` may
    omit values equal to a default, and the defaults differ by class); the raw file if transformers cannot."""
    raw = read_config(path)
    try:
        from transformers import AutoConfig

        resolved = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code).to_dict()
    except Exception:  # unknown model_type without remote code, old formats...: the raw file is what we have
        return raw
    return {**raw, **resolved}


def max_positions(path: str | Path) -> int | None:
    """The longest sequence a model folder is built for (its config's positions), None when it does not say."""
    cfg = resolved_config(path)
    for key in ("max_position_embeddings", "n_positions"):
        value = cfg.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """All weights of a model folder on the CPU, in their stored dtype."""
    from safetensors.torch import load_file

    p = Path(path)
    if (p / SAFE_INDEX).is_file():
        files = _index_files(p, SAFE_INDEX)
    elif (p / SAFE_WEIGHTS).is_file():
        files = [SAFE_WEIGHTS]
    elif (p / BIN_INDEX).is_file() or (p / BIN_WEIGHTS).is_file():
        bins = _index_files(p, BIN_INDEX) if (p / BIN_INDEX).is_file() else [BIN_WEIGHTS]
        sd: dict[str, torch.Tensor] = {}
        for name in bins:
            _need(p / name)
            try:  # weights_only: a pickle that holds code is refused instead of executed
                sd.update(torch.load(p / name, map_location="cpu", weights_only=True, mmap=True))
            except Exception as e:
                raise UserError(
                    f"{p / name} is not a plain tensor file ({type(e).__name__}); convert the model "
                    "to safetensors with transformers (save_pretrained) first"
                ) from None
        return sd
    else:
        raise UserError(
            f"{p} holds no weights (model.safetensors, model.safetensors.index.json or "
            "pytorch_model.bin); re-save the model with save_pretrained"
        )
    sd = {}
    for name in files:
        _need(p / name)
        sd.update(load_file(str(p / name)))
    return sd


def _index_files(folder: Path, index: str) -> list[str]:
    """The shard files a weight index names, each a file inside ``folder`` (an index is data from the folder:
    a name that points elsewhere, ``../x`` or an absolute path, is refused, never read)."""
    try:
        weight_map = json.loads((folder / index).read_text(encoding="utf-8"))["weight_map"]
        names = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise UserError(
            f"{folder / index} is not a valid weight index ({type(e).__name__}); re-save the model"
        ) from None
    root = folder.resolve()
    for name in names:
        target = (folder / str(name)).resolve()
        if not isinstance(name, str) or target.parent != root:
            raise UserError(
                f"{folder / index} names the shard {name!r}, outside the model folder; refusing to read "
                "it (re-save the model with save_pretrained)"
            )
    return names


def _need(file: Path) -> None:
    if not file.is_file():
        raise UserError(f"weight shard {file} is missing; copy the complete model folder")


def hf_families() -> dict[str, tuple[str, ...]]:
    """Family -> the ``model_type`` values it imports and exports natively: the families with an adapter."""
    from gptoughts import models

    return {name: fam.hf.model_types for name, fam in models.FAMILIES.items() if fam.hf is not None}


def find_adapter(model_type: str) -> tuple[str, HFAdapter] | None:
    """The registered family that imports ``model_type`` natively, with its adapter."""
    from gptoughts import models

    for name, fam in models.FAMILIES.items():
        adapter = getattr(fam, "hf", None)
        if adapter is not None and model_type in adapter.model_types:
            return name, adapter
    return None


@dataclass
class Pretrained:
    """What :func:`load_pretrained` returns."""

    family: str | None
    """The native family, or None on the generic path."""
    args: Any | None
    """The family's args (None on the generic path)."""
    model: nn.Module
    tokenizer: Any
    """A ``gptoughts.data.tokenizer.Tokenizer`` loaded from the same folder."""
    generic: bool
    config: dict[str, Any]
    """The folder's resolved ``config.json``."""
    path: Path
    notice: str | None = None
    """Why the generic path was taken (None on the native path)."""


def require_tokenizer(path: str | Path) -> None:
    """A UserError when a model folder holds no tokenizer files (a fine-tune reads its tokenizer from there)."""
    p = Path(path)
    if not any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise UserError(
            f"{p} has no tokenizer files (tokenizer.json / tokenizer_config.json); save the "
            "tokenizer next to the model (tokenizer.save_pretrained(folder))"
        )


def load_tokenizer(path: str | Path, trust_remote_code: bool = False) -> Any:
    from gptoughts.data.tokenizer import Tokenizer

    require_tokenizer(path)
    return Tokenizer.load(Path(path), trust_remote_code=trust_remote_code)


def _cast_params(model: nn.Module, dtype: torch.dtype) -> None:
    # Parameters only: buffers such as RoPE tables stay fp32 (they are cast per use, like transformers does).
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)


def load_pretrained(
    path: str | Path,
    *,
    device: torch.device | str = "cpu",
    trust_remote_code: bool = False,
    dtype: torch.dtype = torch.float32,
    overrides: dict[str, Any] | None = None,
) -> Pretrained:
    """Load a local HF model folder: the native family when an adapter matches its ``model_type``, the generic
    ``transformers`` wrapper otherwise. Parameters end up in ``dtype`` (fp32 master weights by default).

    ``overrides``: fields of the native family's args that do not change the architecture (every parameter
    keeps its name and shape, e.g. DeepSeek's ``bias_update_rate``); anything else is a ConfigError.
    ``device`` meta builds the native model without reading its weights (a dry run's parameter count)."""
    p = Path(path).expanduser()
    raw = read_config(p)
    model_type = str(raw["model_type"])
    tokenizer = load_tokenizer(p, trust_remote_code)
    device = torch.device(device)
    found = find_adapter(model_type)
    reason = f"model_type {model_type!r} has no native implementation"
    if found is not None:
        family, adapter = found
        config = resolved_config(p)
        try:
            args = adapter.args_from_hf(config)
        except UnsupportedHFConfig as e:
            reason = f"its config uses {e}, which the native {family} code does not implement"
        else:
            args = _with_overrides(family, args, overrides or {}, p)
            if device.type == "meta":
                from gptoughts import models

                model = models.build_model(family, args, device="meta")
            else:
                model = _load_native(p, family, adapter, args, device, dtype)
            return Pretrained(
                family=family,
                args=args,
                model=model,
                tokenizer=tokenizer,
                generic=False,
                config=config,
                path=p,
            )
    if overrides:
        raise ConfigError(
            f"model.{next(iter(overrides))}: {p} runs on the generic transformers path ({reason}), whose "
            "config cannot be overridden; drop the override"
        )
    native = ", ".join(t for types in hf_families().values() for t in types)
    notice = (
        f"note: {p.name} ({model_type}): {reason}; training the transformers implementation through the "
        f"same trainer (the native fast path covers {native})"
    )
    log.debug(notice)  # the caller shows it (the training run prints it once, on rank 0)
    model = HFCausalLM.from_pretrained(p, device=device, dtype=dtype, trust_remote_code=trust_remote_code)
    return Pretrained(
        family=None,
        args=None,
        model=model,
        tokenizer=tokenizer,
        generic=True,
        config=resolved_config(p, trust_remote_code),
        path=p,
        notice=notice,
    )


def _with_overrides(family: str, args: Any, overrides: dict[str, Any], path: Path) -> Any:
    """``args`` with the fine-tuning run's ``model.*`` overrides, refused when they change a parameter."""
    if not overrides:
        return args
    import dataclasses

    from gptoughts import models

    fields = {f.name for f in dataclasses.fields(args)}
    for key in overrides:
        if key not in fields:
            raise ConfigError(
                f"unknown field `{key}` for model family {family!r} ({path} is a {family} model)"
                f"{did_you_mean(key, fields)}"
            )
    new = models.model_args(family, "debug", {**dataclasses.asdict(args), **overrides})
    shapes = [
        {k: tuple(v.shape) for k, v in models.build_model(family, a, device="meta").state_dict().items()}
        for a in (args, new)
    ]
    if shapes[0] != shapes[1]:
        changed = ", ".join(f"model.{k}" for k in overrides)
        raise ConfigError(f"{changed} changes the architecture of {path}, which fine-tuning keeps; drop it")
    return new


def _load_native(
    path: Path, family: str, adapter: HFAdapter, args: Any, device: torch.device, dtype: torch.dtype
) -> nn.Module:
    from gptoughts import models

    sd = adapter.from_hf(read_state_dict(path), args)
    with torch.device("meta"):
        model = models.build_model(family, args, device="meta")
    _cast_params(model, dtype)  # on meta: the fp32 copy of a bf16 base is never allocated
    model.to_empty(device=device)
    # init_weights fills the non-persistent buffers (RoPE tables); the random weights it draws are overwritten
    # below. A forked RNG keeps the caller's random stream as if nothing had been drawn.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        model.init_weights()
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise UserError(
            f"the weights in {path} do not match its config.json as a {family} model (missing "
            f"{sorted(missing)[:4]}, unexpected {sorted(unexpected)[:4]}); is the folder complete?"
        )
    return model.eval()
