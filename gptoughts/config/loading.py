"""Where a run's config comes from: TOML presets and files, the family's size defaults, a resumed run's own
config.toml and the dotted ``--section.key`` overrides, composed in one order (:func:`load_config`); and back
to TOML (:func:`to_toml`). Configs are data, never Python code.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from gptoughts.coerce import build_dataclass
from gptoughts.config.schema import MOVED, SECTIONS, Config, ModelConfig, bare_keys
from gptoughts.config.validation import validate
from gptoughts.errors import ConfigError, UserError, did_you_mean

PRESET_DIR = Path(__file__).parent.parent / "presets"
DEFAULT_PRESET = "quickstart"
SIZES_FILE = PRESET_DIR / "sizes.toml"
# Any of these makes a run "named": it starts from the defaults of the family and size asked, not from the
# quickstart preset (which only a bare `gptoughts train` trains).
NAMING_KEYS = ("data.sources", "model.family", "model.size", "model.init_from")
# Stopping rules: the one the user gives wins over a preset's; two given together are a conflict.
STOP_KEYS = ("train.max_steps", "train.epochs", "train.max_tokens")
# Keys holding paths: relative ones in a TOML file are resolved against that file's folder.
_PATH_KEYS = (
    ("data", "sources"),
    ("data", "cache_dir"),
    ("model", "init_from"),
    ("eval", "eval_tasks"),
    ("eval", "eval_task_dir"),
)

_MODEL_FIXED = {f.name for f in dataclasses.fields(ModelConfig)} - {"overrides"}


def _migrate(data: dict[str, Any]) -> dict[str, Any]:
    """Move the keys of an old ``[train]`` table to their sections (a TOML file written before the split)."""
    train = data.get("train")
    if isinstance(train, dict):
        for key in [k for k in train if f"train.{k}" in MOVED]:
            section = MOVED[f"train.{key}"].split(".")[0]
            data.setdefault(section, {}).setdefault(key, train.pop(key))
    return data


def from_dict(data: dict[str, Any]) -> Config:
    """Build and validate a Config from nested dicts (the parsed TOML). Its tables are the sections: a key outside
    them (``max_steps = 5`` above ``[train]``) is refused with the table it belongs in; Config's other fields
    (where values came from) are not the file's to set."""
    for key in data:
        if key not in SECTIONS:
            owner = bare_keys().get(key)
            raise ConfigError(
                f"unknown config key `{key}`"
                + (f": write it under [{owner.split('.')[0]}]" if owner else did_you_mean(key, SECTIONS))
            )
    return build_dataclass(Config, _migrate(data), "")


def _deep_update(base: dict[str, Any], upd: dict[str, Any]) -> dict[str, Any]:
    for k, v in upd.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _deep_update(base[k], v)
        else:
            base[k] = v
    return base


def is_task_file(spec: str) -> bool:
    """An entry of ``eval_tasks`` / ``eval --tasks`` naming a task file (JSONL) rather than lm-evaluation-harness
    task names (``hellaswag,arc_easy``)."""
    return spec.endswith(".jsonl") or "/" in spec or os.sep in spec or Path(spec).is_file()


def list_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.toml") if p != SIZES_FILE)


def _resolve_paths(data: dict[str, Any], folder: Path) -> None:
    """Relative paths of a user's TOML file are relative to the file, not to the current directory."""

    def fix(value: Any) -> Any:
        if isinstance(value, str) and value and not value.startswith("@") and not Path(value).is_absolute():
            return str((folder / value).resolve())
        return value

    for section, key in _PATH_KEYS:
        table = data.get(section)
        if isinstance(table, dict) and key in table:
            value = table[key]
            if key == "eval_tasks":  # harness task names stay names
                table[key] = [fix(v) if isinstance(v, str) and is_task_file(v) else v for v in value]
            elif key == "init_from" and _names_a_hub_model(value, folder):
                continue
            else:
                table[key] = [fix(v) for v in value] if isinstance(value, list) else fix(value)
    tok = data.get("data", {}).get("tokenizer") if isinstance(data.get("data"), dict) else None
    if isinstance(tok, str) and not tok.startswith(("bpe:", "bytes")) and (folder / tok).exists():
        data["data"]["tokenizer"] = str((folder / tok).resolve())
    phases = data.get("data", {}).get("phases") if isinstance(data.get("data"), dict) else None
    for phase in phases if isinstance(phases, list) else []:
        if isinstance(phase, dict) and isinstance(phase.get("sources"), list):
            phase["sources"] = [fix(v) for v in phase["sources"]]


def _names_a_hub_model(value: Any, folder: Path) -> bool:
    """``ORG/NAME`` with no such folder beside the file: a Hugging Face hub id, not a relative path."""
    from gptoughts.models.hf import is_hub_id

    return isinstance(value, str) and is_hub_id(value) and not (folder / value).exists()


def _preset_path(name_or_path: str | Path) -> tuple[Path, bool]:
    """(path, is a user file) of a preset name or a TOML path."""
    path = Path(name_or_path).expanduser()
    if path.suffix == ".toml" and path.is_file():
        return path.resolve(), path.resolve().parent != PRESET_DIR.resolve()
    candidate = PRESET_DIR / f"{name_or_path}.toml"
    if candidate.is_file() and candidate != SIZES_FILE:
        return candidate, False
    if str(name_or_path).endswith(".toml"):
        raise ConfigError(
            f"config file {name_or_path} does not exist; pass a preset name or an existing .toml"
        )
    raise ConfigError(f"unknown preset `{name_or_path}`{did_you_mean(str(name_or_path), list_presets())}")


def read_toml(name_or_path: str | Path, _chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read a preset by name or a TOML file by path, following ``base = "other"`` chains (a relative ``base``
    path is relative to the file that names it; a chain that comes back to a file is an error)."""
    path, user_file = _preset_path(name_or_path)
    if path in _chain:
        loop = " -> ".join(p.name for p in (*_chain, path))
        raise ConfigError(f"{_chain[0]}: `base` chain loops back ({loop}); remove the loop")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path} is not valid TOML: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from None
    if user_file:
        _resolve_paths(data, path.parent)
    _migrate(data)
    base = data.pop("base", None)
    if base is not None:
        if not isinstance(base, str):
            raise ConfigError(f"{path}: `base` must be a preset name or a .toml path, got {base!r}")
        ref = base
        if base.endswith(".toml") and not Path(base).expanduser().is_absolute():
            ref = str(path.parent / base)
        data = _deep_update(read_toml(ref, (*_chain, path)), data)
    return data


def size_defaults(family: str, size: str) -> dict[str, Any]:
    """The training defaults of ``family``/``size`` (``presets/sizes.toml``) as nested dicts ({} if none); a
    variant (``qwen2``: a Llama with q/k/v biases) trains with its family's."""
    from gptoughts.models import resolve_variant

    family = resolve_variant(family)[0]
    table = tomllib.loads(SIZES_FILE.read_text(encoding="utf-8")).get(family, {}).get(str(size).lower(), {})
    out: dict[str, Any] = {}
    for key, value in table.items():
        set_dotted(out, MOVED.get(key, key), value)
    return out


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    """Apply ``a.b.c = value`` to nested dicts (validation happens later, in :func:`from_dict`)."""
    parts = key.split(".")
    node = data
    for p in parts[:-1]:
        nxt = node.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"`{key}`: `{p}` is a value, not a section")
        node = nxt
    node[parts[-1]] = value


def starting_preset(preset: str | Path | None, overrides: dict[str, Any]) -> str | Path:
    """Where a run starts: the preset it names; else the quickstart for a bare run; else ``default``."""
    if preset is not None:
        return preset
    return "default" if any(k in overrides for k in NAMING_KEYS) else DEFAULT_PRESET


def _run_config_file(data: dict[str, Any], overrides: dict[str, Any]) -> Path | None:
    """The ``config.toml`` of the run being resumed: with ``run.resume = auto``, the one in ``--out`` (None when
    there is none yet); with ``--resume PATH``, the one of the run that saved PATH, where it sits in it (a
    checkpoint moved out of its run starts from the config given)."""
    resume = overrides.get("run.resume", data.get("run", {}).get("resume"))
    if resume is None:
        return None
    if resume != "auto":
        path = Path(str(resume)).expanduser()
        for folder in (path, path.parent, path.parent.parent):  # a run, its checkpoints/, one checkpoint
            if (folder / "config.toml").is_file() and (folder / "checkpoints").is_dir():
                return folder / "config.toml"
        return None
    out = overrides.get("run.out", data.get("run", {}).get("out"))
    if out is None:
        out = default_out(data, overrides)
    f = Path(str(out)).expanduser() / "config.toml"
    return f if f.is_file() else None


def _given_at_start(run_file: Path, data: dict[str, Any]) -> tuple[set[str], set[str]]:
    """The settings the resumed run's user gave, and of those the ones its shipped preset set (run.json ``given``
    and ``shipped``). A run recorded before run.json kept them counts every value of its config.toml as given."""
    try:
        record = json.loads((run_file.parent / "run.json").read_text(encoding="utf-8"))
        given, shipped = record.get("given"), record.get("shipped")
    except (OSError, ValueError, AttributeError):
        given = shipped = None
    if not isinstance(given, list):
        return dotted_keys(data), set()
    return {str(k) for k in given}, {str(k) for k in shipped} if isinstance(shipped, list) else set()


def _read_run_config(run_file: Path) -> dict[str, Any]:
    """The tables of a run's ``config.toml``. A run writes every section: one without ``[model]`` or ``[data]``
    (an emptied file) is refused by name, rather than resumed as the defaults with no data."""
    try:
        data = _migrate(tomllib.loads(run_file.read_text(encoding="utf-8")))
    except (tomllib.TOMLDecodeError, OSError, UnicodeDecodeError) as e:
        raise ConfigError(
            f"{run_file} is corrupt ({str(e).splitlines()[0]}); restore it, or start a new run with another --out"
        ) from None
    missing = [t for t in ("model", "data") if not isinstance(data.get(t), dict)]
    if missing:
        what = "is empty" if not data else f"has no [{'] or ['.join(missing)}] table"
        raise ConfigError(
            f"{run_file} {what}, so it is not the config the run was started with (a run writes every section); "
            "restore it from a copy, or start over with --overwrite"
        )
    return data


def default_out(data: dict[str, Any], overrides: dict[str, Any]) -> str:
    model = data.get("model", {})
    family = overrides.get("model.family", model.get("family", ModelConfig.family))
    size = overrides.get("model.size", model.get("size", ModelConfig.size))
    if overrides.get("model.init_from") or model.get("init_from"):
        src = Path(str(overrides.get("model.init_from") or model.get("init_from"))).name or "model"
        return f"runs/{src}-finetune"
    return f"runs/{family}-{size}"


def branch_out(resume: Any, run_dir: Path | None) -> str:
    """The default ``--out`` of ``--resume PATH``: beside the run it branches from, named after it and the
    checkpoint (``runs/a/checkpoints/step_000004`` -> ``runs/a-from-step_000004``; the run or its checkpoints/
    folder, whose newest checkpoint is resumed -> ``runs/a-branch``); a checkpoint moved out of its run (no
    ``run_dir``) -> ``runs/NAME-branch``. A second branch from the same place finds the first there and is
    refused with the fix (continue it with --resume auto, or name another --out)."""
    path = Path(str(resume)).expanduser()
    if run_dir is None:
        return f"runs/{path.resolve().name or 'checkpoint'}-branch"
    suffix = f"from-{path.name}" if path.parent.name == "checkpoints" and run_dir != path else "branch"
    if run_dir.name in ("", ".", ".."):  # `--resume .` inside the run: name it by its real folder
        run_dir = run_dir.resolve()
    return str(run_dir.with_name(f"{run_dir.name}-{suffix}"))


def load_config(preset: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """The config of a run, composed in one order (README "Where a run starts"):

    1. the dataclass defaults;
    2. the training defaults of the run's family and size (``presets/sizes.toml``);
    3. the preset or TOML file named (none named: the quickstart for a bare run, else ``default``);
       with ``run.resume``, the resumed run's own ``config.toml`` instead of 2 and 3;
    4. the dotted ``overrides`` (the command line's flags).

    A preset's architecture fields are dropped when the overrides change its family or size; a stopping rule
    given in the overrides replaces the preset's; two stopping rules given together are an error.
    """
    overrides = {MOVED.get(k, k): v for k, v in (overrides or {}).items()}
    if isinstance(
        overrides.get("model.size"), str
    ):  # sizes are lower case: --size DEBUG made runs/llama-DEBUG
        overrides["model.size"] = overrides["model.size"].lower()
    given_stops = _check_overrides(overrides)
    start = starting_preset(preset, overrides)
    data = read_toml(start)
    run_file = _run_config_file(data, overrides)
    resume = overrides.get("run.resume", data.get("run", {}).get("resume"))
    auto = resume == "auto"
    shipped: set[str] = set()
    if run_file is not None:
        # (a preset named beside --resume is where the run started: its config.toml already holds it all)
        data = _read_run_config(run_file)
        # --resume PATH branches into --out, by default a folder named after the run and checkpoint it comes
        # from (never into that run, nor into the family-size folder, which may hold an unrelated run)
        data.setdefault("run", {})["out"] = (
            str(run_file.parent) if auto else branch_out(resume, run_file.parent)
        )
        # How a run is launched is not part of it: a run saved under FSDP on 2 GPUs resumes on one.
        data.pop("parallel", None)
        _check_base_is_there(run_file.parent, data.get("model", {}).get("init_from"), overrides)
        given, shipped = _given_at_start(run_file, data)
        shipped -= set(overrides)
    else:
        file_stops = [k for k in STOP_KEYS if data.get("train", {}).get(k.split(".")[1]) is not None]
        if len(file_stops) > 1 and not given_stops:
            raise ConfigError(
                f"{start}: {' and '.join(file_stops)} are two stopping rules; keep one (steps, epochs or a "
                "token budget), or give one on the command line, which replaces the file's"
            )
        data, given = _under_size_defaults(data, overrides)
        if not _preset_path(start)[1]:
            shipped = given - set(overrides)
    if given_stops:
        for key in STOP_KEYS:
            data.get("train", {}).pop(key.split(".")[1], None)
        given -= set(STOP_KEYS)
    for key, value in overrides.items():
        set_dotted(data, key, value)
    cfg = from_dict(data)
    cfg.given = frozenset(given | set(overrides))
    cfg.shipped = frozenset(shipped & cfg.given)
    cfg.flags = frozenset(overrides)
    cfg.origin = str(run_file if run_file is not None else start)
    if cfg.run.out is None:
        # a checkpoint moved out of its run (no config.toml beside it) branches into a folder named after it too
        cfg.run.out = branch_out(resume, None) if resume and not auto else default_out(data, {})
    validate(cfg)
    if cfg.model.init_from is not None:
        finetune_defaults(cfg)
    return cfg


def _check_base_is_there(run_dir: Path, base: Any, overrides: dict[str, Any]) -> None:
    """A fine-tune resumed after its base model's folder went away, or (LoRA) was replaced: said as such (checking the
    base as a new model would advise passing another folder, which a resume refuses: another --model is another
    base)."""
    from gptoughts.models.hf import check_base_unchanged, is_hub_id

    given = overrides.get("model.init_from")
    if not base or is_hub_id(str(base)):
        return
    if given and Path(str(given)).expanduser().resolve() != Path(str(base)).expanduser().resolve():
        return  # another base: the resume's own check refuses it as such
    if not Path(str(base)).expanduser().exists():
        raise UserError(
            f"{run_dir} was fine-tuned from {base}, which is missing; put the base model folder back at that "
            "path, then resume again"
        )
    from gptoughts.data.sources import read_json_dict

    record = read_json_dict(run_dir / "run.json") or {}
    # (a full fine-tune's checkpoint holds the whole model: its base was only where it started)
    if record.get("lora"):
        check_base_unchanged(run_dir, str(base), record.get("base_fingerprint"))


def _check_overrides(overrides: dict[str, Any]) -> list[str]:
    """Refuse an override outside the sections, and two stopping rules; return the stopping rule given (if any)."""
    top = list(SECTIONS)
    for key in overrides:
        section = key.split(".")[0]
        if section not in top:
            raise ConfigError(
                f"unknown config key `{key}`: sections are {', '.join(top)}{did_you_mean(section, top)}"
            )
    given_stops = [k for k in STOP_KEYS if overrides.get(k) is not None]
    if len(given_stops) > 1:
        flags = " and ".join(f"--{k.split('.')[1]}" for k in given_stops)
        raise ConfigError(f"{flags} are two stopping rules; give one (steps, epochs or a token budget)")
    return given_stops


def _under_size_defaults(data: dict[str, Any], overrides: dict[str, Any]) -> tuple[dict[str, Any], set[str]]:
    """The preset's or file's tables over the training defaults of the family and size the run asks for, and the
    keys the preset or file set (the size's defaults are not the user's)."""
    preset_model = data.get("model", {})
    family = overrides.get("model.family", preset_model.get("family", ModelConfig.family))
    size = overrides.get("model.size", preset_model.get("size", ModelConfig.size))
    if (family, size) != (
        preset_model.get("family", ModelConfig.family),
        preset_model.get("size", ModelConfig.size),
    ):
        # The preset's architecture fields describe its own shape (the quickstart's d_model, n_kv_heads, ...):
        # another family or size starts from its size preset, not from them.
        data["model"] = {k: v for k, v in preset_model.items() if k in _MODEL_FIXED}
    given = dotted_keys(data)
    if isinstance(family, str) and isinstance(size, str):
        data = _deep_update(size_defaults(family, size), data)
    return data, given


def dotted_keys(data: dict[str, Any]) -> set[str]:
    """The ``section.key`` names a TOML table's sections set."""
    return {f"{sec}.{k}" for sec, table in data.items() if isinstance(table, dict) for k in table}


# The block and peak learning rate of a fine-tuning run that gives none. The block is the model's positions up to
# this; the rate depends on the method: full fine-tuning stays close to the pretrained weights, LoRA's adapters
# start from zero and want about 10x more (the rates of PEFT's and the Llama recipes' examples).
FINETUNE_BLOCK_SIZE = 1024
FINETUNE_LEARNING_RATE = {"full": 2e-5, "lora": 2e-4}


def finetune_defaults(cfg: Config) -> None:
    """Set the block and the learning rate where the user did not (:meth:`Config.is_given`), and say why in
    ``cfg.resolved``."""
    t = cfg.train
    if not cfg.is_given("train.learning_rate"):
        method, other = ("lora", "full") if cfg.lora.enabled else ("full", "lora")
        t.learning_rate = FINETUNE_LEARNING_RATE[method]
        names = {"lora": "LoRA's", "full": "full fine-tuning's"}
        cfg.resolved["learning_rate"] = (
            f"{names[method]} default; {names[other]} is {FINETUNE_LEARNING_RATE[other]:g}"
        )
    if not cfg.is_given("train.block_size"):
        from gptoughts.models.hf import locate, max_positions

        positions = max_positions(locate(cfg.model.init_from, weights=False))
        t.block_size = min(FINETUNE_BLOCK_SIZE, positions or FINETUNE_BLOCK_SIZE)
        cfg.resolved["block_size"] = (
            f"the model's {positions:,} positions; finetune's default is {FINETUNE_BLOCK_SIZE:,}"
            if positions and positions < FINETUNE_BLOCK_SIZE
            else f"finetune's default; the model has {positions:,} positions"
            if positions
            else "finetune's default"
        )
    if t.objective == "dpo":
        _dpo_defaults(cfg)


def _dpo_defaults(cfg: Config) -> None:
    """Preference tuning's plan line (``cfg.resolved["objective"]``), and the spike check off unless asked for:
    its thresholds (a multiple of the running mean and deviation) fit a mean over a step's thousands of tokens,
    while DPO's loss is a mean over a few pairs, and one mislabeled or hard pair is a reproducible "spike" that
    would be dropped."""
    d = cfg.dpo
    reference = d.resolved_reference(cfg.lora.enabled)
    how = {
        "precomputed": "the starting model's log-probabilities, one pass over every pair before training",
        "adapters_off": "the base with the adapters disabled, one extra no-grad forward a step",
    }[reference]
    head = {
        "fused": "a chunk of pairs at a time, its gradients in the same pass",
        "chunked": "rows a chunk at a time, recomputed in the backward",
        "plain": "every row's logits at once",
    }[d.head]
    cfg.resolved["objective"] = (
        f"dpo, beta {d.beta:g}, label smoothing {d.label_smoothing:g}; reference: {reference} ({how}); "
        f"head: {d.head} ({head})"
    )
    if not cfg.is_given("recovery.spike_detection"):
        cfg.recovery.spike_detection = False
        cfg.resolved["spike_detection"] = (
            "off: DPO's loss is a mean over a few pairs per step, not over tokens; one hard pair would pass "
            "for a spike (--recovery.spike_detection true turns it on)"
        )


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return (
            "{"
            + ", ".join(f"{json.dumps(k)} = {_toml_value(x)}" for k, x in v.items() if x is not None)
            + "}"
        )
    raise TypeError(f"cannot write {v!r} to TOML")


def to_toml(cfg: Config) -> str:
    """The fully resolved config as TOML (None values are omitted: they are the defaults)."""
    out: list[str] = [
        "# Fully resolved gptoughts config (written by the run; edit a copy to start a new one)."
    ]
    for section, values in cfg.to_dict().items():
        out.append(f"\n[{section}]")
        tables = []
        for k, v in values.items():
            if v is None:
                continue
            if isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
                tables.append((k, v))
                continue
            out.append(f"{k} = {_toml_value(v)}")
        for k, rows in tables:
            for row in rows:
                out.append(f"\n[[{section}.{k}]]")
                out.extend(f"{rk} = {_toml_value(rv)}" for rk, rv in row.items() if rv is not None)
    return "\n".join(out) + "\n"


def config_from_toml_text(text: str) -> Config:
    return from_dict(tomllib.loads(text))
