"""Hugging Face interop: import a local ``transformers`` model folder, export ours back to one.

Native path: a family that sets ``Family.hf`` to an :class:`HFAdapter` maps ``config.json`` to its args and the
HF state dict to its own names (the mapping functions live in the family's file, e.g. ``llama_hf.py``), so a
fine-tuned Llama/Mistral/Qwen runs on our fast code. Generic path: any other ``AutoModelForCausalLM`` is wrapped
by :class:`HFCausalLM`, which obeys the model protocol of ``docs/internals.md``, so the same trainer (precision,
compile, checkpoints, LoRA) runs it; a one-line notice says the native fast path does not cover it.

Where from: a local folder, or a Hugging Face hub id (``ORG/NAME``) found in the Hugging Face cache and
downloaded into it when online (:func:`locate`, through ``huggingface_hub``).

Reading: ``config.json``; weights from ``model.safetensors``, sharded ``model.safetensors.index.json`` or, as a
last resort, ``pytorch_model.bin`` read with ``torch.load(weights_only=True)`` (never arbitrary pickles); the
tokenizer from the same folder. ``trust_remote_code`` stays off unless the caller passes it.

Writing (:func:`save_hf`): ``config.json`` (with ``torch_dtype``), ``model.safetensors`` or shards with an
index above ``max_shard_bytes``, the tokenizer files and ``generation_config.json``; ``transformers`` loads
the folder with ``AutoModelForCausalLM.from_pretrained`` and computes the same logits.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gptoughts.errors import ConfigError, UserError, did_you_mean

log = logging.getLogger("gptoughts.models.hf")

CONFIG_NAME = "config.json"
SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
BIN_WEIGHTS = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"
GENERATION_CONFIG = "generation_config.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
"""Shard size of exported weights (transformers' own default is of this order; hubs cap single files)."""

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def read_config(path: str | Path) -> dict[str, Any]:
    """The raw ``config.json`` of a model folder (UserError when it is not one)."""
    p = Path(path).expanduser()
    if not p.is_dir():
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


def load_tokenizer(path: str | Path) -> Any:
    from gptoughts.data.tokenizer import Tokenizer

    p = Path(path)
    if not any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise UserError(
            f"{p} has no tokenizer files (tokenizer.json / tokenizer_config.json); save the "
            "tokenizer next to the model (tokenizer.save_pretrained(folder))"
        )
    return Tokenizer.load(p)


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
    tokenizer = load_tokenizer(p)
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


# ------------------------------------------------------------------------------------------------ writing


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_size(text: str | int) -> int:
    """``5GB``, ``200MB``, ``500KB`` or a number of bytes -> bytes (decimal units, as transformers); > 0."""
    s = str(text).strip().upper().replace("IB", "B")
    unit, mult = next(((u, m) for u, m in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3), ("B", 1)) if s.endswith(u)),
                      ("", 1))  # fmt: skip
    try:
        size = int(float(s[: len(s) - len(unit)]) * mult)
    except (ValueError, OverflowError):
        size = 0
    if size < 1:
        raise ConfigError(
            f"--max_shard_size {text!r} is not a size of at least one byte; write e.g. 5GB, 200MB or a number "
            "of bytes"
        )
    return size


def save_state_dict(
    sd: dict[str, torch.Tensor],
    out_dir: Path,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> list[str]:
    """Write ``sd`` as ``model.safetensors``, or as ``model-0000k-of-0000n.safetensors`` shards plus
    ``model.safetensors.index.json`` when it is larger than ``max_shard_bytes``. Returns the file names."""
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    total = 0
    for name, t in sd.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
        total += nbytes
    meta = {"format": "pt"}  # transformers checks this key to know the tensors are PyTorch's
    if len(shards) == 1:
        save_file(shards[0], str(out_dir / SAFE_WEIGHTS), metadata=meta)
        return [SAFE_WEIGHTS]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for fname, shard in zip(names, shards):
        save_file(shard, str(out_dir / fname), metadata=meta)
        weight_map.update({k: fname for k in shard})
    (out_dir / SAFE_INDEX).write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n"
    )
    return names + [SAFE_INDEX]


def prepare_out_dir(out_dir: str | Path, overwrite: bool = False) -> Path:
    out = Path(out_dir).expanduser()
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise UserError(
                f"{out} exists and is not empty; choose another output folder or pass --overwrite"
            )
        for f in list(out.glob("*.safetensors")) + [out / SAFE_INDEX, out / BIN_WEIGHTS, out / BIN_INDEX]:
            if f.exists():
                f.unlink()  # stale shards of an earlier export would be picked up by the index-less reader
    out.mkdir(parents=True, exist_ok=True)
    return out


def _token_ids(tokenizer: Any) -> dict[str, int | None]:
    return {
        "bos_token_id": tokenizer.bos_id,
        "eos_token_id": tokenizer.eos_id,
        "pad_token_id": tokenizer.pad_id if tokenizer.pad_id is not None else None,
    }


def write_generation_config(out: Path, tokenizer: Any, base: dict[str, Any] | None = None) -> None:
    """``generation_config.json``: the source model's sampling defaults (when there was one) with our token ids."""
    gen = dict(base or {})
    gen.update({k: v for k, v in _token_ids(tokenizer).items() if v is not None})
    gen.setdefault("do_sample", False)
    (out / GENERATION_CONFIG).write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")


def save_hf(
    model: nn.Module,
    family: str,
    args: Any,
    tokenizer: Any,
    out_dir: str | Path,
    *,
    base_config: dict[str, Any] | None = None,
    base_generation_config: dict[str, Any] | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
) -> Path:
    """Write a native model as a ``transformers`` folder (see the module docstring). ``dtype`` defaults to the
    parameters' own; ``base_config`` is the config of the model the run started from, if any."""
    from gptoughts import models

    fam = models.get_family(family)
    adapter: HFAdapter | None = getattr(fam, "hf", None)
    if adapter is None:
        exporting = ", ".join(
            name if types == (name,) else f"{name} (as {', '.join(types)})"
            for name, types in hf_families().items()
        )
        raise UserError(
            f"the {family} family has no transformers export (gptoughts sample and eval run it); the families "
            f"that export: {exporting}"
        )
    ours = {k: v for k, v in model.state_dict().items()}
    if dtype is None:
        dtype = next((v.dtype for v in ours.values() if v.is_floating_point()), torch.float32)
    hf_sd = {}
    for k, v in adapter.to_hf(ours, args).items():
        v = v.detach().to("cpu", dtype=dtype if v.is_floating_point() else v.dtype)
        hf_sd[k] = (
            v.contiguous().clone()
            if v.data_ptr() in {t.data_ptr() for t in hf_sd.values()}
            else v.contiguous()
        )
    takes_base = len(inspect.signature(adapter.hf_config).parameters) > 1
    cfg = adapter.hf_config(args, base_config) if takes_base else adapter.hf_config(args)
    cfg.update({k: v for k, v in _token_ids(tokenizer).items()})
    cfg["torch_dtype"] = cfg["dtype"] = _dtype_name(dtype)  # 4.x reads torch_dtype, 5.x dtype
    # Only now, with the weights mapped and the config accepted (a switch transformers cannot represent is
    # refused above), is the folder created or an old export cleared: a refusal leaves it as it was.
    out = prepare_out_dir(out_dir, overwrite)
    (out / CONFIG_NAME).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    save_state_dict(hf_sd, out, max_shard_bytes)
    tokenizer.save(out)
    write_generation_config(out, tokenizer, base_generation_config)
    return out


def save_generic(
    model: HFCausalLM,
    tokenizer: Any,
    out_dir: str | Path,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
) -> Path:
    """Write a generic (wrapped ``transformers``) model with transformers' own ``save_pretrained``."""
    out = prepare_out_dir(out_dir, overwrite)
    hf = model.hf
    if dtype is not None:
        hf = hf.to(dtype)
    hf.save_pretrained(str(out), max_shard_size=max_shard_bytes, safe_serialization=True)
    tokenizer.save(out)
    base = json.loads((out / GENERATION_CONFIG).read_text()) if (out / GENERATION_CONFIG).is_file() else None
    write_generation_config(out, tokenizer, base)
    return out


# -------------------------------------------------------------------------------------- generic wrapper


@dataclass
class HFArgs:
    """What the rest of gptoughts reads from a model's ``args`` (generation length, vocabulary, width)."""

    model_type: str
    vocab_size: int
    d_model: int
    n_layers: int
    max_seq_len: int


_HEAD_SCALES = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def _find_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks: the longest ModuleList of identical modules (``model.layers``, ``transformer.h``...)."""
    best = nn.ModuleList()
    for module in model.modules():
        if (
            isinstance(module, nn.ModuleList)
            and len(module) > len(best)
            and len({type(m) for m in module}) == 1
        ):
            best = module
    return best


class HFCausalLM(nn.Module):
    """Any ``transformers`` causal LM behind our model protocol (``docs/internals.md``).

    ``forward(..., return_hidden=True)`` runs the base model and returns its final (normed) hidden state, so the
    objective's chunked cross-entropy applies the head; a head bias is folded in as an extra input column of
    ones (exact). Heads that rescale or soft-cap logits are refused: the chunked loss cannot apply them.
    Generation goes through transformers' ``generate`` (:meth:`hf_generate`); there is no ``new_cache``.
    """

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        self.hf = hf_model
        cfg = hf_model.config
        head = hf_model.get_output_embeddings()
        if not isinstance(head, nn.Linear):
            raise UserError(
                f"{type(hf_model).__name__} has no linear LM head; the generic path cannot train it"
            )
        for name in _HEAD_SCALES:
            value = getattr(cfg, name, None)
            if value not in (None, 1, 1.0):
                raise UserError(
                    f"{type(hf_model).__name__} rescales its logits ({name} = {value}); the generic "
                    "path does not support that head yet"
                )
        text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        d = getattr(text_cfg, "hidden_size", None) or getattr(text_cfg, "n_embd", None) or head.in_features
        layers = _find_layers(hf_model)
        self.args = HFArgs(
            model_type=str(getattr(cfg, "model_type", "unknown")),
            vocab_size=int(head.out_features),
            d_model=int(d),
            n_layers=len(layers),
            max_seq_len=int(
                getattr(text_cfg, "max_position_embeddings", None)
                or getattr(text_cfg, "n_positions", None)
                or 2048
            ),
        )
        # Not registered as submodules: they are already under `hf`, and a second name would duplicate every
        # parameter in the state dict.
        self.__dict__["_layers"] = layers
        self.__dict__["_head"] = head

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        trust_remote_code: bool = False,
    ) -> HFCausalLM:
        from transformers import AutoModelForCausalLM

        try:
            hf = AutoModelForCausalLM.from_pretrained(
                str(path), trust_remote_code=trust_remote_code, dtype=dtype, attn_implementation="sdpa"
            )
        except ValueError as e:
            if "trust_remote_code" in str(e) and not trust_remote_code:
                raise UserError(
                    f"{path} needs its own Python code to load; pass --trust_remote_code if you trust "
                    "that code"
                ) from None
            try:  # some architectures have no SDPA implementation: their default attention then
                hf = AutoModelForCausalLM.from_pretrained(
                    str(path), trust_remote_code=trust_remote_code, dtype=dtype
                )
            except ValueError as e2:
                raise UserError(f"transformers cannot load {path} as a causal LM: {e2}") from None
        return cls(hf.to(device)).eval()

    @property
    def layers(self) -> nn.ModuleList:
        return self.__dict__["_layers"]

    @property
    def output_weight(self) -> torch.Tensor:
        head = self.__dict__["_head"]
        if head.bias is None:
            return head.weight
        return torch.cat([head.weight, head.bias[:, None].to(head.weight.dtype)], dim=1)

    def init_weights(self) -> None:
        """A no-op: the weights come from the model folder."""

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
        return_hidden: bool = False,
        doc_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if cache is not None:
            raise UserError(
                "generic transformers models decode through hf_generate, not a gptoughts KV cache"
            )
        if doc_ids is not None:
            raise UserError(
                "packed rows (doc_ids) need the native fast path; set data.packing = false for "
                f"{self.args.model_type} models"
            )
        out = self.hf.base_model(input_ids=input_ids, position_ids=position_ids, use_cache=False)
        h = out[0]
        head = self.__dict__["_head"]
        if not return_hidden:
            return head(h)
        if head.bias is not None:  # h @ [W | b]^T == h @ W^T + b with a column of ones appended to h
            h = torch.cat([h, h.new_ones(*h.shape[:-1], 1)], dim=-1)
        return h

    @torch.no_grad()
    def hf_generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_id: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """transformers' ``generate`` (its own KV cache) with our sampling arguments; ``[B, T + n]``."""
        kw: dict[str, Any] = dict(
            max_new_tokens=max_new_tokens, do_sample=temperature > 0, eos_token_id=eos_id, pad_token_id=eos_id
        )
        if temperature > 0:
            kw.update(temperature=temperature, top_k=top_k or 0, top_p=top_p if top_p is not None else 1.0)
        was_training = self.training
        self.eval()
        rng = (
            torch.random.fork_rng(devices=[input_ids.device] if input_ids.device.type == "cuda" else [])
            if generator is not None
            else contextlib.nullcontext()
        )
        try:
            with rng:
                if generator is not None:  # transformers samples from the global RNG: seed it from ours
                    torch.manual_seed(generator.initial_seed())
                return self.hf.generate(input_ids, attention_mask=torch.ones_like(input_ids), **kw)
        finally:
            self.train(was_training)

    def num_params(self, non_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.hf.get_input_embeddings().weight.numel()
        return n

    def flops_per_token(self, seq_len: int) -> int:
        """``6 * N + 12 * n_layers * d_model * seq_len`` (N counts the head even when tied)."""
        n = self.num_params(non_embedding=True)
        head = self.__dict__["_head"].weight
        if head.data_ptr() == self.hf.get_input_embeddings().weight.data_ptr():
            n += head.numel()
        return 6 * n + 12 * self.args.n_layers * self.args.d_model * seq_len


def model_dtype(config: dict[str, Any]) -> torch.dtype:
    """The dtype a model folder stores (``torch_dtype``/``dtype`` of its config), fp32 when unknown."""
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    return _DTYPES.get(str(name).removeprefix("torch."), torch.float32)


def copy_tokenizer_files(src: str | Path, out: str | Path) -> None:
    """Copy the original tokenizer files of a model folder over ours: same vocabulary, but the folder's own
    tokenizer class and settings (``model_max_length``, ``add_bos_token``...) survive the round trip."""
    src, out = Path(src), Path(out)
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "tokenizer.model",
        "chat_template.jinja",
        "chat_template.json",
    ):
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)
