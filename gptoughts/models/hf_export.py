"""Hugging Face interop, writing: a model as a ``transformers`` folder (``gptoughts export``).

:func:`save_hf` writes a native family through its ``HFAdapter``: ``config.json`` (with ``torch_dtype``),
``model.safetensors`` or shards with an index above ``max_shard_bytes``, the tokenizer files and
``generation_config.json``; ``transformers`` loads the folder with ``AutoModelForCausalLM.from_pretrained`` and
computes the same logits. :func:`save_generic` writes a wrapped ``transformers`` model with its own
``save_pretrained``.
"""

from __future__ import annotations

import inspect
import json
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gptoughts.data.sft import turn_end_id
from gptoughts.data.sources import free_name, is_run_folder, prepared_manifest
from gptoughts.errors import ConfigError, UserError
from gptoughts.models.hf import (
    BIN_INDEX,
    BIN_WEIGHTS,
    CONFIG_NAME,
    SAFE_INDEX,
    SAFE_WEIGHTS,
    HFAdapter,
    hf_families,
)
from gptoughts.models.hf_generic import HFCausalLM

GENERATION_CONFIG = "generation_config.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
"""Shard size of exported weights (transformers' own default is of this order; hubs cap single files)."""

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


# A checkpoint folder (training/checkpoint/store.py's names; this layer does not import training): meta.json
# beside its weights, its state or a sharded checkpoint's index.
_CHECKPOINT_META = "meta.json"
_CHECKPOINT_WEIGHTS = ("model.safetensors", "state.pt", ".metadata")


def _gptoughts_folder(out: Path) -> tuple[Path, str] | None:
    """(the folder, what it is) where ``out`` is, or lies inside, a folder gptoughts wrote and reads back: a
    training run (its checkpoints, tokenizer, plots), a prepared dataset, or a checkpoint moved out of its run."""
    here = out.expanduser().resolve()
    for folder in (here, *here.parents):
        if is_run_folder(folder):
            return folder, "a training run" if folder == here else f"inside the training run {_shown(folder)}"
        if prepared_manifest(folder) is not None:
            what = "a prepared dataset" if folder == here else f"inside the prepared dataset {_shown(folder)}"
            return folder, what
    if (here / _CHECKPOINT_META).is_file() and any((here / n).exists() for n in _CHECKPOINT_WEIGHTS):
        return here, "a checkpoint"
    return None


def _shown(path: Path) -> Path:
    """A resolved path as the user would type it: relative to the working directory when inside it."""
    try:
        return path.relative_to(Path.cwd().resolve())
    except ValueError:
        return path


def check_out_dir(out_dir: str | Path, overwrite: bool = False) -> Path:
    """Refuse, by reading only, an output folder an export must not write into: one that gptoughts wrote (a run,
    what lies inside one, a prepared dataset, a checkpoint), whatever ``overwrite`` says, since its files would
    mix with the export's and an export clears old weight files; and a non-empty folder without ``overwrite``."""
    out = Path(out_dir).expanduser()
    found = _gptoughts_folder(out)
    if found is not None:
        folder, what = found
        beside = free_name(folder.with_name(f"{folder.name}-hf"))
        raise UserError(
            f"{out} is {what}, not a folder for an export (its files and the Hugging Face files would mix, "
            f"--overwrite or not); pass another OUT, e.g. {_shown(beside)}"
        )
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} exists and is a file; pass a new or empty folder as OUT")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise UserError(f"{out} exists and is not empty; choose another output folder or pass --overwrite")
    return out


def prepare_out_dir(out_dir: str | Path, overwrite: bool = False) -> Path:
    out = check_out_dir(out_dir, overwrite)
    if out.exists() and any(out.iterdir()):
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
    ours = {k: v for k, v in _token_ids(tokenizer).items() if v is not None}
    # The source's stop tokens stay beside ours, and the chat template's end of an answer joins them: an instruct
    # model ends its answers there, and without it transformers generates past the end of every answer.
    kept = gen.get("eos_token_id")
    kept = [e for e in (kept if isinstance(kept, list) else [kept]) if isinstance(e, int)]
    for stop in (ours["eos_token_id"], turn_end_id(tokenizer)):
        if stop is not None and stop not in kept:
            kept.append(stop)
    gen.update(ours, eos_token_id=kept if len(kept) > 1 else kept[0])
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
    adapter = _adapter(family)
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
    cfg = export_config(family, args, base_config)
    for key, value in _token_ids(tokenizer).items():
        # The base's id stays where the tokenizer has no such token (a Qwen config's bos_token_id beside a tokenizer
        # without bos); otherwise null is written, since transformers' config classes default to ids of their own.
        if value is not None or cfg.get(key) is None:
            cfg[key] = value
    cfg["torch_dtype"] = cfg["dtype"] = _dtype_name(dtype)  # 4.x reads torch_dtype, 5.x dtype
    # Only now, with the weights mapped and the config accepted (a switch transformers cannot represent is
    # refused above), is the folder created or an old export cleared: a refusal leaves it as it was.
    out = prepare_out_dir(out_dir, overwrite)
    (out / CONFIG_NAME).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    save_state_dict(hf_sd, out, max_shard_bytes)
    tokenizer.save(out)
    write_generation_config(out, tokenizer, base_generation_config)
    return out


def _adapter(family: str) -> HFAdapter:
    """The family's HF adapter, or a UserError naming the families that export."""
    from gptoughts import models

    adapter: HFAdapter | None = getattr(models.get_family(family), "hf", None)
    if adapter is None:
        exporting = ", ".join(
            name if types == (name,) else f"{name} (as {', '.join(types)})"
            for name, types in hf_families().items()
        )
        raise UserError(
            f"the {family} family has no transformers export (gptoughts sample and eval run it); the families "
            f"that export: {exporting}"
        )
    return adapter


def export_config(family: str, args: Any, base_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``config.json`` of ``family``/``args`` as :func:`save_hf` writes it, before the token ids and dtype."""
    adapter = _adapter(family)
    takes_base = len(inspect.signature(adapter.hf_config).parameters) > 1
    return adapter.hf_config(args, base_config) if takes_base else adapter.hf_config(args)


def run_of_model(path: str | Path) -> Path | None:
    """The training run ``path`` is, or holds a checkpoint of (``RUN/checkpoints/step_N``), else None."""
    p = Path(path).expanduser()
    if is_run_folder(p):
        return p
    if p.parent.name == "checkpoints" and is_run_folder(p.parent.parent):
        return p.parent.parent
    return None


def run_config(path: str | Path) -> dict[str, Any]:
    """The ``config.json`` that ``gptoughts export`` writes of a run (``path``: the run or one of its checkpoints),
    from its run.json and its base's config alone (no weights read), before the token ids and dtype: what a
    fine-tune that names the run as its model validates (family, positions) before the run is exported. A family
    without export is refused here, as the export would refuse it."""
    from gptoughts import models
    from gptoughts.data.sources import read_json_dict
    from gptoughts.models.hf import read_config, restore_hint

    run = run_of_model(path)
    record = read_json_dict(run / "run.json") if run is not None else None
    if run is None or record is None:
        raise UserError(f"{path} is not a gptoughts run or a checkpoint of one")
    base = record.get("init_from")
    if isinstance(base, str) and base and not Path(base).is_dir():  # (its export reads the base's config too)
        raise UserError(f"{run} was fine-tuned from {base}, which is missing; {restore_hint(base)}")
    base_config = read_config(base) if isinstance(base, str) and base else None
    if base_config is not None and record.get("generic"):  # saved by transformers: the base's architecture
        return base_config
    family = models.get_family(str(record["family"]))
    try:
        args = family.args_cls(**record["args"])
    except (TypeError, ValueError) as e:
        raise UserError(f"{run / 'run.json'} is corrupt (args: {e}); restore it from a copy") from None
    return export_config(family.name, args, base_config)


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


def model_dtype(config: dict[str, Any]) -> torch.dtype:
    """The dtype a model folder stores (``torch_dtype``/``dtype`` of its config), fp32 when unknown."""
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    return _DTYPES.get(str(name).removeprefix("torch."), torch.float32)


def copy_tokenizer_files(src: str | Path, out: str | Path) -> None:
    """Copy the original tokenizer files of a model folder over ours: same vocabulary, but the folder's own
    tokenizer class and settings (``model_max_length``, ``add_bos_token``...) survive the round trip."""
    src, out = Path(src), Path(out)
    names = [
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "tokenizer.model",
        "chat_template.jinja",
        "chat_template.json",
    ]
    # A tokenizer class of the folder's own (auto_map) is Python beside it, which may import more of the folder's
    # modules: without them the export's tokenizer_config.json names code that is not there.
    config = src / "tokenizer_config.json"
    if config.is_file() and '"auto_map"' in config.read_text(encoding="utf-8", errors="replace"):
        names += sorted(f.name for f in src.glob("*.py"))
    for name in names:
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)
