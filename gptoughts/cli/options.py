"""The options of the config commands (train, finetune, config, prepare, bench, estimate, tune): ``[PRESET]
--key VALUE ...`` into a preset and dotted config overrides, the spellings they accept, and their ``--help``.

Any dotted config key works (``--train.learning_rate 1e-3``), so does the bare name of any field
(``--learning_rate``); the aliases are the spellings of the user's own scripts and of the API.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gptoughts.coerce import coerce
from gptoughts.config.schema import bare_keys
from gptoughts.errors import ConfigError, closest

# alias -> dotted key: the spellings of the user's own scripts and of the API (num_epochs, save_dir). Besides
# these, the bare name of any config field is accepted (--weight_decay = --train.weight_decay): see bare_keys.
ALIASES: dict[str, str] = {
    "model": "model.family",
    "model_type": "model.family",
    "model_name": "model.init_from",  # the user's first command: `run_train.py --model_name huggyllama/llama-7b`
    "size": "model.size",
    "data": "data.sources",
    "data_path": "data.sources",
    "out": "run.out",
    "save_dir": "run.out",
    "epochs": "train.epochs",
    "num_epochs": "train.epochs",
    "gradient_accumulation_steps": "train.grad_accum",
    "lr": "train.learning_rate",
    "fp8": "perf.fp8",
    "use_fp8": "perf.fp8",
    "no_progress": "run.progress",
    "auto_batch": "train.batch_size",
    "recover_nan": "recovery.nan_policy",
}
# Names other tools use (transformers' Trainer, torchrun, nanoGPT, litgpt) for what is spelt otherwise here: an
# unknown option among them is answered with our spelling, where the closest name would mislead (--save_steps is
# not --max_steps, --gpus not --eps). Hints only: the options themselves stay one spelling each.
FOREIGN: dict[str, str] = {
    **dict.fromkeys(
        ("gpus", "num_gpus", "n_gpu", "nproc_per_node", "devices", "num_processes", "world_size"),
        "several GPUs run under torchrun with the same options: "
        "`torchrun --nproc_per_node N -m gptoughts COMMAND ...` (one GPU needs nothing)",
    ),
    **dict.fromkeys(
        ("bf16", "fp16", "mixed_precision", "dtype"), "the precision is --precision auto|bf16|fp16|fp32"
    ),
    **dict.fromkeys(("output_dir", "out_dir", "run_dir", "checkpoint_dir"), "the run folder is --out DIR"),
    **dict.fromkeys(
        ("max_seq_length", "max_seq_len", "seq_len", "seq_length", "context_length", "max_length", "ctx_len"),
        "the sequence length is --block_size N",
    ),
    **dict.fromkeys(
        ("save_steps", "save_every", "checkpoint_interval"),
        "checkpoints are saved every --save_interval N steps",
    ),
    **dict.fromkeys(
        ("eval_steps", "eval_every", "eval_iters"),
        "evaluation runs every --eval_interval N steps (--eval_batches: how many)",
    ),
    **dict.fromkeys(("logging_steps", "log_every"), "the log line comes every --log_interval N steps"),
    **dict.fromkeys(
        ("resume_from_checkpoint", "resume_from", "init_from_checkpoint"),
        "a run continues with --resume auto|PATH",
    ),
    **dict.fromkeys(
        ("report_to", "logger", "loggers"),
        "TensorBoard is --tensorboard true|false, Weights & Biases --wandb",
    ),
    **dict.fromkeys(
        ("num_train_epochs", "n_epochs", "train_epochs"), "the number of passes over the data is --epochs N"
    ),
    **dict.fromkeys(
        ("max_iters", "num_steps", "train_steps", "total_steps"), "the number of steps is --max_steps N"
    ),
    **dict.fromkeys(
        ("per_device_train_batch_size", "micro_batch_size", "train_batch_size", "micro_batch"),
        "the micro-batch (rows per GPU per step) is --batch_size N|auto; the global batch --global_batch_tokens",
    ),
    **dict.fromkeys(
        ("gradient_checkpointing", "grad_checkpointing", "activation_checkpointing_enabled"),
        "checkpointing is --activation_checkpointing none|selective|full|auto",
    ),
    **dict.fromkeys(
        ("dataset", "dataset_name", "train_file", "train_data", "dataset_path"),
        "the corpus is --data PATH (files, folders, .jsonl, .parquet, a saved HF dataset)",
    ),
    **dict.fromkeys(
        ("lr_scheduler_type", "lr_scheduler", "scheduler", "lr_schedule"),
        "the learning-rate schedule is --schedule cosine|wsd|constant",
    ),
    **dict.fromkeys(
        ("model_name_or_path", "base_model", "pretrained_model"),
        "a pretrained model is `gptoughts finetune --model HF_DIR|ORG/NAME` (train: --init_from)",
    ),
    **dict.fromkeys(("warmup_ratio", "warmup_iters"), "warmup is --warmup_steps N"),
    **dict.fromkeys(
        ("max_grad_norm", "clip_grad_norm", "gradient_clipping"), "gradient clipping is --grad_clip X"
    ),
}
REPEATABLE = {"data.sources"}
# Flags that take no value, and the value they set.
FLAGS: dict[str, Any] = {
    "overwrite": True,
    "wandb": True,
    "no_progress": False,
    "auto_batch": "auto",
    "recover_nan": "rollback",
    "ignore_memory_estimate": True,
}
# Options whose value may be left out, and the value they then take.
OPTIONAL_VALUE: dict[str, Any] = {"resume": "auto", "compile": True, "fp8": True, "use_fp8": True}
_BOOL_WORDS = {"true", "false", "auto", "1", "0"}
OPTIONAL_CHOICES: dict[str, set[str]] = {"compile": _BOOL_WORDS, "fp8": _BOOL_WORDS, "use_fp8": _BOOL_WORDS}
# Options of the train command itself (not config keys).
TRAIN_SWITCHES = ("interactive", "dry_run", "print_config")
# The config sections whose options train (and the commands that take its options) accept.
TRAIN_SECTIONS = ("model", "data", "train", "eval", "checkpoint", "recovery", "perf", "parallel", "run")
# The sections only `finetune` takes besides them, and its spellings: there --model names the pretrained folder.
FINETUNE_SECTIONS = ("lora", "dpo")
FINETUNE_ALIASES: dict[str, str] = {
    **ALIASES,
    "model": "model.init_from",
    "lora": "lora.enabled",
    "lora_r": "lora.r",
    "lora_alpha": "lora.alpha",
    "lora_dropout": "lora.dropout",
    "target_modules": "lora.target_modules",
    "qlora": "lora.quantize",
}
FINETUNE_FLAGS: dict[str, Any] = {**FLAGS, "lora": True, "trust_remote_code": True, "qlora": "4bit"}


def parse_overrides(
    argv: Sequence[str],
    aliases: dict[str, str] | None = None,
    flags: dict[str, Any] | None = None,
    sections: tuple[str, ...] = TRAIN_SECTIONS,
    switches: Sequence[str] = TRAIN_SWITCHES,
    own: Sequence[str] = (),
) -> tuple[str | None, dict[str, Any], set[str]]:
    """Split ``[PRESET] --k v ...`` into (preset, {dotted key: value}, switches given).

    ``aliases``/``flags`` replace :data:`ALIASES`/:data:`FLAGS` (``finetune`` maps ``--model`` elsewhere).
    An option that is not an alias, a field name of ``sections``, a dotted key or a switch is an error that
    suggests only options this command accepts: first the command's ``own`` options (taken out of ``argv``
    before), then a name of :data:`FOREIGN`, then the closest option."""
    aliases = {**bare_keys(sections), **(ALIASES if aliases is None else aliases)}
    flags = FLAGS if flags is None else flags
    preset: str | None = None
    out: dict[str, Any] = {}
    seen: set[str] = set()
    i = 0
    args = list(argv)
    while i < len(args):
        tok = args[i]
        i += 1
        if not tok.startswith("--") or tok == "--":
            if preset is None and not out and not tok.startswith("-"):
                preset = tok
                continue
            raise ConfigError(f"unexpected argument {tok!r}; options are written --key VALUE")
        name, eq, value = tok[2:].partition("=")
        if name == "config":  # --config FILE.toml: the spelling of other tools for the preset's place
            if not eq:
                value, i = _option_value(name, args, i)
            if preset is not None:
                raise ConfigError(f"two configs given ({preset} and {value}); name one preset or TOML file")
            preset = value
            continue
        if "." in name:
            name = key = _dotted_key(name, sections)
        else:
            name = name.replace("-", "_")
            if name in switches:
                seen.add(name)
                continue
            key = _alias_key(name, aliases, [*switches, *own], sections, own)
        if not eq and flags.get(name, True) is True and _is_bool(key):
            # A yes/no option alone is yes (--run.tensorboard, as --overwrite), or takes its word (--overwrite false)
            value, i = (True, i) if i >= len(args) or args[i].startswith("--") else (args[i], i + 1)
        elif name in flags and not eq:
            out[key] = flags[name]
            continue
        elif not eq:
            value, i = _option_value(name, args, i)
        if key in REPEATABLE:
            out.setdefault(key, []).append(value)
        elif key in out and out[key] != value:
            raise ConfigError(f"--{name} is given twice ({out[key]!r} and {value!r}); give it once")
        else:
            out[key] = value
    return preset, out, seen


def _dotted_key(name: str, sections: tuple[str, ...]) -> str:
    """``--section.field``: the key it names (keys that moved are read at their new place), or an error with the
    closest section or field of this command."""
    from gptoughts.config import MOVED, SECTIONS

    name = MOVED.get(name, name)  # train.eval_interval -> eval.eval_interval (keys that moved)
    section, _, field_name = name.partition(".")
    if section in FINETUNE_SECTIONS and section not in sections:
        raise _finetune_only(name)
    if section not in sections:
        near = closest(section, sections)
        raise ConfigError(
            f"unknown option --{name}: no section `{section}`"
            + (f" (did you mean --{near}.{field_name}?)" if near else f"; sections are {', '.join(sections)}")
        )
    if section != "model" and field_name not in SECTIONS[section].__dataclass_fields__:
        near = closest(field_name, list(SECTIONS[section].__dataclass_fields__))
        if near is None and ALIASES.get(field_name, "").startswith(f"{section}."):  # --train.lr
            near = ALIASES[field_name].split(".", 1)[1]
        raise ConfigError(
            f"unknown option --{name}"
            + (f" (did you mean --{section}.{near}?)" if near else "; `gptoughts train --help` lists them")
        )
    return name


def _is_bool(key: str) -> bool:
    """Whether the dotted ``key`` is a field of type bool (a model family's own fields are read later, as text)."""
    from gptoughts.config import SECTIONS

    section, _, field_name = key.partition(".")
    f = SECTIONS[section].__dataclass_fields__.get(field_name) if section in SECTIONS else None
    return f is not None and f.type in (bool, "bool")


def _alias_key(
    name: str,
    aliases: dict[str, str],
    switches: Sequence[str],
    sections: tuple[str, ...],
    own: Sequence[str] = (),
) -> str:
    key = aliases.get(name)
    if key is None and name in sections:
        raise ConfigError(
            f"--{name} is a section; its options are written --{name}.KEY VALUE (--help lists them)"
        )
    if key is None and not set(FINETUNE_SECTIONS) <= set(sections):
        there = {**bare_keys(FINETUNE_SECTIONS), **FINETUNE_ALIASES}.get(name, "")
        if there.split(".")[0] in FINETUNE_SECTIONS:  # --lora, --lora_r, --beta: not a misspelt train option
            raise _finetune_only(f"{name} ({there})")
    if key is None and name in FOREIGN and closest(name, own) is None:
        raise ConfigError(f"unknown option --{name}: {FOREIGN[name]}")
    if key is None:
        near = closest(name, [*aliases, *switches])
        raise ConfigError(
            f"unknown option --{name}"
            + (f" (did you mean --{near}?)" if near else "; `--help` lists the options")
        )
    return key


def _finetune_only(option: str) -> ConfigError:
    return ConfigError(
        f"--{option} is an option of `gptoughts finetune`, which tunes a pretrained model "
        "(gptoughts finetune --model HF_DIR --data PATH ...); this command does not take it"
    )


def _option_value(name: str, args: list[str], i: int) -> tuple[str, int]:
    """The value of ``--name`` written as a separate argument (``args[i]``), and the index after it. An option of
    :data:`OPTIONAL_VALUE` takes its default when the next argument is another option or not one of its words."""
    nxt = args[i] if i < len(args) else None
    if name in OPTIONAL_VALUE:
        choices = OPTIONAL_CHOICES.get(name)
        if nxt is None or nxt.startswith("--") or (choices is not None and nxt.lower() not in choices):
            return OPTIONAL_VALUE[name], i
        return nxt, i + 1
    if nxt is None or (nxt.startswith("--") and len(nxt) > 2):
        raise ConfigError(f"--{name} needs a value")
    return nxt, i + 1


_BOOL_WORDS = ("true", "false", "yes", "no", "on", "off", "1", "0")


def pop_options(argv: Sequence[str], flags: set[str], valued: set[str]) -> tuple[list[str], dict[str, Any]]:
    """Take command-specific options out of argv; the rest are config overrides."""
    rest: list[str] = []
    found: dict[str, Any] = {}
    args = list(argv)
    i = 0
    while i < len(args):
        name, eq, value = args[i][2:].partition("=") if args[i].startswith("--") else ("", "", "")
        if name in flags:  # alone (yes), or with its word, as train's yes/no options
            word = (
                value
                if eq
                else (args[i + 1] if i + 1 < len(args) and args[i + 1].lower() in _BOOL_WORDS else None)
            )
            if word is not None and not eq:
                i += 1
            if word is None or coerce(word, bool, f"--{name}"):
                found[name] = True
        elif name in valued:
            if not eq:
                if i + 1 >= len(args):
                    raise ConfigError(f"--{name} needs a value")
                i += 1
                value = args[i]
            found[name] = value
        else:
            rest.append(args[i])
        i += 1
    return rest, found


def options_help(sections: tuple[str, ...], aliases: dict[str, str], flags: dict[str, Any]) -> list[str]:
    """Every option of ``sections`` with its type, default and the docstring of its field."""
    import textwrap

    from gptoughts.config import describe_fields

    by_key: dict[str, list[str]] = {}
    for alias, key in aliases.items():
        by_key.setdefault(key, []).append(alias)
    lines = []
    current = None
    for key, tp, default, doc in describe_fields(sections):
        section, name = key.split(".")
        if section != current:
            lines.append(f"\n[{section}]")
            current = section
        other = [a for a in by_key.get(key, []) if a != name]
        spelled = f"--{name}" + "".join(f", --{a}" for a in other if a not in flags)
        spelled += "".join(f", --{a} (flag)" for a in other if a in flags)
        default = "none" if default == "null" else default
        lines.append(f"  {spelled}  ({tp}, default {default})")
        if doc:
            lines += textwrap.wrap(doc, 108, initial_indent="      ", subsequent_indent="      ")
    return lines
