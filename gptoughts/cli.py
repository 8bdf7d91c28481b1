"""The ``gptoughts`` command. Thin: parse argv, build a config, call :mod:`gptoughts.api`.

``gptoughts train [PRESET|FILE.toml] [--section.key VALUE ...] [--alias VALUE ...]``: any dotted config key
works; the aliases below are the spellings of the user's own scripts.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gptoughts.errors import ConfigError, UserError, closest

# alias -> dotted key: the spellings of the user's own scripts and of the API (num_epochs, save_dir). Besides
# these, the bare name of any config field is accepted (--weight_decay = --train.weight_decay): see _bare_keys.
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


def _bare_keys(sections: tuple[str, ...]) -> dict[str, str]:
    """field name -> dotted key for every field of ``sections`` (no two sections share a field name)."""
    from gptoughts.config import SECTIONS

    return {
        f: f"{sec}.{f}" for sec in sections for f in SECTIONS[sec].__dataclass_fields__ if f != "overrides"
    }


TRAIN_SECTIONS = ("model", "data", "train", "eval", "checkpoint", "recovery", "perf", "parallel", "run")


def parse_overrides(
    argv: Sequence[str],
    aliases: dict[str, str] | None = None,
    flags: dict[str, Any] | None = None,
    sections: tuple[str, ...] = TRAIN_SECTIONS,
    switches: Sequence[str] = TRAIN_SWITCHES,
) -> tuple[str | None, dict[str, Any], set[str]]:
    """Split ``[PRESET] --k v ...`` into (preset, {dotted key: value}, switches given).

    ``aliases``/``flags`` replace :data:`ALIASES`/:data:`FLAGS` (``finetune`` maps ``--model`` elsewhere).
    An option that is not an alias, a field name of ``sections``, a dotted key or a switch is an error that
    suggests only options this command accepts."""
    from gptoughts.config import MOVED, SECTIONS

    aliases = {**_bare_keys(sections), **(ALIASES if aliases is None else aliases)}
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
        if "." in name:
            name = MOVED.get(name, name)  # train.eval_interval -> eval.eval_interval (keys that moved)
            section, _, field_name = name.partition(".")
            if section not in sections:
                near = closest(section, sections)
                raise ConfigError(
                    f"unknown option --{name}: no section `{section}`"
                    + (
                        f" (did you mean --{near}.{field_name}?)"
                        if near
                        else f"; sections are {', '.join(sections)}"
                    )
                )
            if section != "model" and field_name not in SECTIONS[section].__dataclass_fields__:
                fields = [f for f in SECTIONS[section].__dataclass_fields__]
                near = closest(field_name, fields)
                raise ConfigError(
                    f"unknown option --{name}"
                    + (
                        f" (did you mean --{section}.{near}?)"
                        if near
                        else f"; `gptoughts {'train'} --help` lists them"
                    )
                )
            key = name
        else:
            name = name.replace("-", "_")
            if name in switches:
                seen.add(name)
                continue
            key = aliases.get(name)
            if key is None:
                near = closest(name, [*aliases, *switches])
                raise ConfigError(
                    f"unknown option --{name}"
                    + (f" (did you mean --{near}?)" if near else "; `--help` lists the options")
                )
        if name in flags and not eq:
            out[key] = flags[name]
            continue
        if not eq:
            nxt = args[i] if i < len(args) else None
            if name in OPTIONAL_VALUE:
                choices = OPTIONAL_CHOICES.get(name)
                if (
                    nxt is None
                    or nxt.startswith("--")
                    or (choices is not None and nxt.lower() not in choices)
                ):
                    value = OPTIONAL_VALUE[name]
                else:
                    value, i = nxt, i + 1
            else:
                if nxt is None or (nxt.startswith("--") and len(nxt) > 2):
                    raise ConfigError(f"--{name} needs a value")
                value, i = nxt, i + 1
        if key in REPEATABLE:
            out.setdefault(key, []).append(value)
        elif key in out and out[key] != value:
            raise ConfigError(f"--{name} is given twice ({out[key]!r} and {value!r}); give it once")
        else:
            out[key] = value
    return preset, out, seen


def ask_interactive(
    overrides: dict[str, Any], ask: Callable[[str, str], str] | None = None
) -> dict[str, Any]:
    """The INL guide's four questions (size, corpus, epochs, batch size), each with a default; an answer that cannot
    work is said at once, and the question asked again."""
    from gptoughts import models

    ask = ask or _ask_stdin
    family = overrides.get("model.family", "llama")
    sizes = models.list_sizes(family)

    def until_valid(question: str, default: Any, check: Callable[[str], Any]) -> Any:
        while True:
            try:
                return check(ask(question, str(default)))
            except ConfigError as e:
                print(f"  {e}")

    out = dict(overrides)
    out["model.size"] = until_valid(
        f"Model size ({', '.join(sizes)})",
        overrides.get("model.size", "debug"),
        lambda a: _size_answer(a, family, sizes),
    )
    out["data.sources"] = until_valid(
        "Training corpus (file, folder, .jsonl, .parquet; @stdlib = Python's standard library)",
        ",".join(overrides.get("data.sources", ["@stdlib"])),
        _corpus_answer,
    )
    out["train.epochs"] = until_valid("Epochs", overrides.get("train.epochs", 1), _epochs_answer)
    out["train.batch_size"] = until_valid("Batch size", overrides.get("train.batch_size", 8), _batch_answer)
    return out


def _ask_stdin(question: str, default: str) -> str:
    try:
        answer = input(f"{question} [{default}]: ").strip()
    except EOFError:
        raise UserError(
            "--interactive reads its answers from the terminal, which has closed; pass them as options "
            "(--size, --data, --epochs, --batch_size)"
        ) from None
    return answer or default


def _size_answer(answer: str, family: str, sizes: list[str]) -> str:
    if answer not in sizes:
        raise ConfigError(f"{answer!r} is not a size of {family}; one of {', '.join(sizes)}")
    return answer


def _corpus_answer(answer: str) -> list[str]:
    from gptoughts.data.sources import STDLIB_ALIAS

    found = [c.strip() for c in answer.split(",") if c.strip()]
    missing = [c for c in found if c != STDLIB_ALIAS and not Path(c).expanduser().exists()]
    if not found or missing:
        raise ConfigError(f"no file or folder {', '.join(missing) or repr(answer)}; give a path that exists")
    return found


def _epochs_answer(answer: str) -> str:
    try:
        ok = 0 < float(answer) < float("inf")
    except ValueError:
        ok = False
    if not ok:
        raise ConfigError(f"{answer!r} is not a number of epochs; a number > 0 (e.g. 1 or 0.5)")
    return answer


def _batch_answer(answer: str) -> str:
    if answer != "auto" and not (answer.isdigit() and int(answer) > 0):
        raise ConfigError(f"{answer!r} is not a batch size; a whole number >= 1, or auto")
    return answer


WHERE_A_RUN_STARTS = """Where a run starts: a bare `gptoughts train` trains the quickstart preset (a ~10M-parameter Llama on
6 MB of the Python standard library, 250 steps). A run that names --data, --model, --size or a preset starts
from the defaults of its family and size (gptoughts/presets/sizes.toml: sequence length, learning rate, batch,
vocabulary), then the preset or TOML file it names, then its flags; nothing of the quickstart leaks into it.
With --resume the run's own config.toml is the start, and flags beside it override what they name. Before the
first step a run prints its plan (model, parameters, corpus read, tokens, steps, epochs, memory, time)."""


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


def train_help() -> str:
    from gptoughts import models
    from gptoughts.config import list_presets

    lines = [
        "usage: gptoughts train [PRESET|FILE.toml] [--option VALUE ...] [--section.key VALUE ...]",
        "",
        WHERE_A_RUN_STARTS,
        "",
        "examples:",
        "  gptoughts train                                       # the quickstart",
        "  gptoughts train --data corpus.txt --size 125m         # a 125m Llama on your corpus",
        "  gptoughts train --data data/ --model inl --size 3b --dry_run   # its plan, nothing run",
        "  gptoughts train --resume auto --out runs/llama-125m   # continue a run exactly",
        "",
        "families and sizes (--model FAMILY --size SIZE):",
    ]
    lines += [f"  {name:<9} {', '.join(models.list_sizes(name))}" for name in models.FAMILIES]
    lines += [
        f"  {name:<9} the {family} sizes with {', '.join(f'--model.{k} {str(v).lower()}' for k, v in switches.items())} "
        f"(exports as {name})"
        for name, (family, switches) in models.VARIANTS.items()
    ]
    lines += [
        f"presets: {', '.join(list_presets())}",
        "",
        "switches:",
        "  --dry_run        print the run plan (and its warnings) and exit; writes nothing",
        "  --print_config   print the fully resolved config as TOML and exit",
        "  --interactive    ask the INL guide's four questions (size, corpus, epochs, batch size)",
        "",
        "options: --NAME VALUE or --SECTION.NAME VALUE; a few take no value (flags):",
    ]
    lines += options_help(TRAIN_SECTIONS, {**_bare_keys(TRAIN_SECTIONS), **ALIASES}, FLAGS)
    lines += [
        "",
        "model architecture fields (--model.NAME VALUE, e.g. --model.n_layers 8) depend on the family: "
        "see docs/internals.md and gptoughts/models/FAMILY.py.",
    ]
    return "\n".join(lines)


def _run(
    preset: str | None, overrides: dict[str, Any], switches: set[str], default_preset: str | None = None
) -> int:
    from gptoughts.config import load_config, to_toml

    cfg = load_config(preset or default_preset, overrides)
    if "print_config" in switches:
        print(to_toml(cfg), end="")
        return 0
    from gptoughts.api import run_training

    _, _, history = run_training(cfg, dry_run="dry_run" in switches)
    if history.interrupted:  # schedulers tell an interrupted run from a finished one by this
        return 128 + history.interrupted
    return 0


def cmd_train(argv: Sequence[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(train_help())
        return 0
    preset, overrides, switches = parse_overrides(argv)
    if "interactive" in switches:
        overrides = ask_interactive(overrides)
    return _run(preset, overrides, switches)


# `finetune` reads the same options as `train`, except that --model names the pretrained folder.
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

FINETUNE_USAGE = """usage: gptoughts finetune [PRESET|FILE.toml] --model HF_DIR|ORG/NAME --data PATH [--lora] [options]

Fine-tunes a Hugging Face model: a local folder (config.json, safetensors, tokenizer files) or a hub id, read from
the Hugging Face cache and downloaded into it when online (`hf download ORG/NAME` fetches it ahead).
Llama, Mistral, Qwen2, Qwen3, GPT-2 and DeepSeek-V3 layouts run on the native fast path; other causal LMs train
through transformers (a notice says so). Default preset: finetune; unless given, the block is the model's positions
up to 1024 and the learning rate 2e-5 (2e-4 with --lora), and the plan says so.

data (--data, repeatable):
  .jsonl of {"prompt": ..., "response": ...} or {"messages": [{"role": ..., "content": ...}, ...]}: loss on the
  responses only, the tokenizer's chat template when it has one; examples packed per row (--packing false: one
  per row); longer than a row: --truncation right (cut) or drop. Anything else: continued pretraining.

options (besides every `gptoughts train` option and any --section.key VALUE):
  --model HF_DIR|ORG/NAME model.init_from (--model_name)  --trust_remote_code  run the folder's own code
  --lora                  train LoRA adapters (PEFT)      --lora_r R / --lora_alpha A / --lora_dropout P
  --target_modules a,b    lora.target_modules (default: every linear layer of the blocks)
  --qlora                 4-bit base (bitsandbytes, CUDA only)   --lora.base_dtype {auto,fp32,bf16,fp16}
  --format {auto,text,sft}   --packing {true,false}   --truncation {right,drop}

then: gptoughts sample RUN --prompt "..." (chat template applied) and gptoughts export RUN --format hf OUT.
presets: {presets}
"""


def cmd_finetune(argv: Sequence[str]) -> int:
    from gptoughts.config import list_presets

    if any(a in ("-h", "--help") for a in argv):
        print(FINETUNE_USAGE.replace("{presets}", ", ".join(list_presets())))
        lines = options_help(("lora",), {**_bare_keys(("lora",)), **FINETUNE_ALIASES}, FINETUNE_FLAGS)
        print("\n".join(["LoRA options:", *lines[1:]]))
        return 0
    preset, overrides, switches = parse_overrides(
        argv, FINETUNE_ALIASES, FINETUNE_FLAGS, sections=(*TRAIN_SECTIONS, "lora")
    )
    if overrides.get("lora.quantize") == "4bit":
        overrides.setdefault("lora.enabled", True)
    if "model.init_from" not in overrides and preset is None:
        raise ConfigError(
            "finetune needs a pretrained model: pass --model HF_DIR (a local Hugging Face folder) or "
            "--model ORG/NAME (a Hugging Face hub id)"
        )
    return _run(preset, overrides, switches, default_preset="finetune")


def cmd_export(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(
        prog="gptoughts export",
        description="Write a run as a Hugging Face transformers model folder (LoRA merged).",
    )
    p.add_argument("path", help="run directory, checkpoint directory (or an HF folder)")
    p.add_argument("out_pos", nargs="?", metavar="OUT", help="output folder (or --out)")
    p.add_argument("--out", default=None, help="output folder")
    p.add_argument("--format", default="hf", choices=["hf"], help="hf: config.json + safetensors + tokenizer")
    p.add_argument("--max_shard_size", default="5GB", help="split weights above this size (e.g. 5GB, 500MB)")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "fp32", "bf16", "fp16"],
        help="auto: the base model's dtype (fp32 for models trained from scratch)",
    )
    p.add_argument("--overwrite", action="store_true", help="write into a non-empty OUT")
    p.add_argument("--device", default="cpu", help="where LoRA is merged (cpu needs no GPU memory)")
    p.add_argument(
        "--trust_remote_code", action="store_true", help="let transformers run an HF folder's own code"
    )
    a = p.parse_intermixed_args(argv)
    out = a.out or a.out_pos
    if out is None:
        raise ConfigError("export needs an output folder: gptoughts export RUN --format hf OUT")
    from gptoughts.api import export

    written = export(
        a.path,
        out,
        format=a.format,
        max_shard_size=a.max_shard_size,
        dtype=a.dtype,
        overwrite=a.overwrite,
        device=a.device,
        trust_remote_code=a.trust_remote_code,
    )
    print(f"wrote {written} (load it with transformers.AutoModelForCausalLM.from_pretrained)")
    return 0


def cmd_prepare(argv: Sequence[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(
            "usage: gptoughts prepare --data PATH [--data PATH ...] --out DIR [--size S | --tokenizer SPEC]\n"
            "                         [--text_field F --extensions a,b --val_fraction X --max_bytes N --seed N\n"
            "                          --workers N]\n"
            "Tokenize a corpus into token shards in DIR (manifest.json, tokenizer/, *.bin): the same keys and\n"
            "defaults as `gptoughts train` (with --size, the tokenizer that size trains with), so\n"
            "`gptoughts bench --shards DIR` and a train of the same settings read the same tokens."
        )
        print("\n".join(options_help(("data",), {**_bare_keys(("data",)), **ALIASES}, FLAGS)))
        return 0
    rest, opts = _pop_options(argv, set(), {"out"})
    if "out" not in opts:
        raise ConfigError("prepare needs an output folder: --out DIR")
    preset, overrides, _ = parse_overrides(rest, sections=("model", "data", "train"), switches=())
    from gptoughts.config import load_config
    from gptoughts.data.prepare import prepare
    from gptoughts.training.build import resolve_sources

    cfg = load_config(preset, overrides)
    d = cfg.data
    m = prepare(
        resolve_sources(d.sources),
        opts["out"],
        d.tokenizer,
        text_field=d.text_field,
        extensions=d.extensions or None,
        val_fraction=d.val_fraction,
        max_bytes=d.max_bytes,
        seed=cfg.train.seed,
        workers=d.workers,
    )
    print(
        f"{opts['out']}: {m.train_tokens:,} train tokens, {m.val_tokens:,} val tokens (vocab {m.vocab_size:,})"
    )
    return 0


def cmd_sample(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="gptoughts sample", description="Generate text from a trained model.")
    p.add_argument("path", help="run directory, checkpoint directory or Hugging Face model folder")
    p.add_argument("--prompt", default="", help="text to continue (with --chat: the user's message)")
    p.add_argument(
        "--chat",
        default="auto",
        choices=["auto", "on", "off"],
        help="render the prompt with the chat template and print only the answer; auto: on for SFT runs "
        "and for HF folders whose tokenizer has a chat template",
    )
    p.add_argument("--max_new_tokens", type=int, default=128, help="tokens to generate (>= 1)")
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    p.add_argument("--top_k", type=int, default=50, help="0: no top-k filtering")
    p.add_argument("--top_p", type=float, default=None, help="in (0, 1]; default: no nucleus filtering")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--device", default="auto")
    p.add_argument(
        "--trust_remote_code", action="store_true", help="let transformers run an HF folder's own code"
    )
    a = p.parse_args(argv)
    # checked before the model is loaded (which can take minutes)
    if a.max_new_tokens < 1:
        raise UserError(f"--max_new_tokens must be >= 1, got {a.max_new_tokens}")
    if not a.temperature >= 0 or math.isinf(a.temperature):
        raise UserError(f"--temperature must be a number >= 0 (0: greedy), got {a.temperature}")
    if a.top_k < 0:
        raise UserError(f"--top_k must be >= 0 (0: no top-k filtering), got {a.top_k}")
    if a.top_p is not None and not 0 < a.top_p <= 1:
        raise UserError(f"--top_p must be in (0, 1], got {a.top_p}")
    from gptoughts.api import generate_text, load

    loaded = load(a.path, device=a.device, trust_remote_code=a.trust_remote_code)
    chat = None if a.chat == "auto" else a.chat == "on"
    print(
        generate_text(
            loaded,
            a.prompt,
            max_new_tokens=a.max_new_tokens,
            temperature=a.temperature,
            top_k=a.top_k or None,
            top_p=a.top_p,
            seed=a.seed,
            chat=chat,
        )
    )
    return 0


def _save_task_scores(run: Path, scores: dict[str, Any]) -> None:
    """``RUN/eval_tasks.json``: this evaluation's scores over the earlier ones (tasks scored before and not now
    stay). A run folder that cannot be written is a warning after the table, not a lost evaluation."""
    path = run / "eval_tasks.json"
    try:
        old = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        old = {}
    from gptoughts.training.rundir import write_text_atomic

    try:
        write_text_atomic(
            path, json.dumps({**(old if isinstance(old, dict) else {}), **scores}, indent=2) + "\n"
        )
    except OSError as e:
        print(
            f"warning: could not write {path} ({e.strerror or e}); the scores are printed only",
            file=sys.stderr,
        )


def cmd_eval(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(
        prog="gptoughts eval",
        description="Loss and perplexity of a run (or HF folder) on all of a corpus; multiple-choice accuracy and "
        "generation exact match on task files and lm-evaluation-harness tasks (--tasks). Several runs: one table "
        "comparing them.",
    )
    p.add_argument(
        "path",
        nargs="+",
        metavar="RUN",
        help="run directory, checkpoint directory or Hugging Face model folder (several: compared side by side)",
    )
    p.add_argument(
        "--data", action="append", default=None, help="file, folder, .jsonl, .parquet (repeatable)"
    )
    p.add_argument(
        "--tasks",
        action="append",
        default=None,
        help='task file (repeatable), JSONL of one kind: multiple choice, {"context": str, "choices": [str, ...], '
        '"answer": int} per line, scored by log-likelihood (acc, acc_norm); or generation, {"prompt": str, '
        '"expected": str, "until": [str, ...]} per line, scored by greedy decoding (exact_match); or '
        "lm-evaluation-harness task names, comma-separated (hellaswag,arc_easy; needs gptoughts[eval])",
    )
    p.add_argument(
        "--task_dir",
        default=None,
        help="a folder of lm-evaluation-harness task YAML files (e.g. reading local data: dataset_path: json)",
    )
    p.add_argument(
        "--download",
        action="store_true",
        help="harness tasks: let datasets download missing task data (default: offline, missing data is an error)",
    )
    p.add_argument(
        "--limit",
        type=int,
        default=None,
        help="score the first N examples of each task (files and harness tasks)",
    )
    p.add_argument(
        "--num_fewshot", type=int, default=None, help="harness tasks: few-shot examples per prompt"
    )
    p.add_argument(
        "--batch_size",
        type=int,
        default=8,
        help="sequences per forward pass (LLaDA choices: Monte-Carlo copies of one choice per pass)",
    )
    p.add_argument("--block_size", type=int, default=None, help="default: the run's train.block_size")
    p.add_argument(
        "--max_batches",
        type=int,
        default=None,
        help="score only this many batches, spread evenly over the corpus (default: all of it)",
    )
    p.add_argument(
        "--max_new_tokens",
        type=int,
        default=64,
        help="generation task files: most tokens generated per prompt (harness tasks: their max_gen_toks)",
    )
    p.add_argument(
        "--mc_samples",
        type=int,
        default=None,
        help="masked-diffusion models (LLaDA): Monte-Carlo draws per choice of a multiple-choice task "
        "(default 32; more is less noisy and proportionally slower)",
    )
    p.add_argument("--device", default="auto")
    p.add_argument("--json", action="store_true", help="print one JSON object (several runs: {run: results})")
    p.add_argument(
        "--trust_remote_code", action="store_true", help="let transformers run an HF folder's own code"
    )
    a = p.parse_args(argv)
    if not a.data and not a.tasks:
        raise UserError(
            "gptoughts eval needs --data PATH (loss, perplexity) or --tasks FILE.jsonl (accuracy, exact match)"
        )
    for flag, value in (
        ("--batch_size", a.batch_size),
        ("--max_new_tokens", a.max_new_tokens),
        ("--mc_samples", a.mc_samples),
        ("--limit", a.limit),
        ("--max_batches", a.max_batches),
        ("--block_size", a.block_size),
    ):
        if value is not None and value < 1:
            raise UserError(f"{flag} must be >= 1, got {value}")
    repeated = sorted({r for r in a.path if a.path.count(r) > 1})
    if repeated:
        raise UserError(f"{', '.join(repeated)} is given more than once; name each run once")
    from gptoughts.api import evaluate, load
    from gptoughts.tools.harness import check_names, split_specs
    from gptoughts.tools.tasks import (
        MC_SAMPLES,
        evaluate_tasks,
        format_comparison,
        format_table,
        read_tasks,
    )

    if a.num_fewshot is not None and a.num_fewshot < 0:
        raise UserError(f"--num_fewshot must be >= 0, got {a.num_fewshot}")
    # Everything a user can get wrong is checked before the first (possibly long) model load and scoring.
    files, names = split_specs(a.tasks) if a.tasks else ([], [])
    if a.task_dir and not names:
        raise UserError("--task_dir holds harness tasks: name them with --tasks NAME[,NAME...]")
    tasks = read_tasks(files)
    if a.limit is not None:  # the first N examples of every task, files as harness tasks (as in training)
        from dataclasses import replace

        tasks = [replace(t, examples=t.examples[: a.limit]) for t in tasks]
    check_names([t.name for t in tasks], names)
    bench = None
    if names:
        from gptoughts.tools.harness import Harness

        bench = Harness(
            names,
            task_dir=a.task_dir,
            allow_download=a.download,
            num_fewshot=a.num_fewshot,
            limit=a.limit,
        )
    for run in a.path:
        if not Path(run).exists():
            raise UserError(
                f"{run} does not exist; pass a run directory, a checkpoint directory or a HF folder"
            )
    results: dict[str, dict[str, Any]] = {}
    for run in a.path:
        loaded = load(run, device=a.device, trust_remote_code=a.trust_remote_code)
        res: dict[str, Any] = {}
        if a.data:
            res = evaluate(
                loaded, a.data, batch_size=a.batch_size, block_size=a.block_size, max_batches=a.max_batches
            )
        if tasks or bench:
            res["tasks"] = evaluate_tasks(
                loaded,
                tasks,
                batch_size=a.batch_size,
                mc_samples=a.mc_samples or MC_SAMPLES,
                max_new_tokens=a.max_new_tokens,
            )
            if bench is not None:
                res["tasks"].update(bench.evaluate(loaded, batch_size=a.batch_size, mc_samples=a.mc_samples))
            if (Path(run) / "run.json").is_file():
                _save_task_scores(Path(run), res["tasks"])
        results[run] = res
        del loaded  # one model in memory at a time
    if len(results) > 1:
        if a.json:
            print(json.dumps(results))
            return 0
        print(format_comparison(results))
        if a.data:
            for run, res in results.items():
                print(f"{run}: {int(res['tokens']):,} tokens scored: {res['scored']} of {', '.join(a.data)}")
        return 0
    (res,) = results.values()
    if a.json:
        print(json.dumps(res))
        return 0
    if a.data:
        print(
            f"loss {res['loss']:.4f}  perplexity {res['perplexity']:.2f}  ({int(res['tokens']):,} tokens scored: "
            f"{res['scored']} of {', '.join(a.data)})"
        )
    if tasks or bench:
        print(format_table(res["tasks"]))
    return 0


def cmd_plot(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(
        prog="gptoughts plot",
        description="PNG plots of runs (loss, lr, tokens/s, grad "
        "norm, memory): one run -> RUN/plots/; several -> one figure overlaying them.",
    )
    p.add_argument("runs", nargs="+", help="run directories (each holds metrics.jsonl)")
    p.add_argument("--out", default=None, help="with several runs: the PNG to write (default compare.png)")
    a = p.parse_args(argv)
    from gptoughts.training.plots import compare_runs, write_run_plots

    if len(a.runs) == 1 and a.out is None:
        if not (Path(a.runs[0]) / "metrics.jsonl").is_file():
            raise UserError(f"{a.runs[0]} has no metrics.jsonl; pass a run directory")
        written = write_run_plots(a.runs[0])
        if not written:
            raise UserError(f"nothing to plot in {a.runs[0]} (no metrics yet, or matplotlib is missing)")
        print("\n".join(str(w) for w in written))
        return 0
    print(compare_runs(a.runs, a.out or "compare.png"))
    return 0


def cmd_config(argv: Sequence[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(
            "usage: gptoughts config [PRESET|FILE.toml] [train's options]\nPrints the fully resolved config of "
            "`gptoughts train` with the same arguments, as TOML (nothing runs)."
        )
        return 0
    preset, overrides, _ = parse_overrides(argv, switches=())
    from gptoughts.config import load_config, to_toml

    print(to_toml(load_config(preset, overrides)), end="")
    return 0


def cmd_env(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="gptoughts env", description="Hardware and what `auto` means on it.")
    p.add_argument("--json", action="store_true")
    p.add_argument("--device", default="auto")
    a = p.parse_args(argv)
    import torch

    from gptoughts.perf.attention import available
    from gptoughts.perf.hardware import detect

    prof = detect(a.device)
    d = prof.to_dict()
    d["attention"] = available(torch.device(prof.device))
    # perf.sdpa_backend = auto's choice (training/setup.py attention_rule: FA4 measured faster where it runs)
    d["recommended"]["attention"] = "fa4" if d["attention"].get("fa4") == "available" else "sdpa"
    if a.json:
        print(json.dumps(d, default=str))
        return 0
    mem = f"{d['memory_bytes'] / 2**30:.1f} GiB" if d["memory_bytes"] else "unknown"
    print(
        f"device     {d['device']}  ({d['name']}, {d['arch']}, {d['gpu_count']} GPU(s), {d['cpu_count']} CPU cores)"
    )
    print(f"memory     {mem}")
    precisions = ["fp32"] + [p for p in ("bf16", "fp16", "fp8") if d[p]]
    print(f"precisions {', '.join(precisions)}")
    print(f"compile    {'available' if d['compile'] else 'unavailable'}")
    # what --perf.sdpa_backend fa4 and --perf.doc_mask_attention flex would find here
    print("attention  " + "\n           ".join(f"{k}: {v}" for k, v in d["attention"].items()))
    print(f"torch      {d['torch_version']}")
    print("recommended: " + ", ".join(f"{k}={v}" for k, v in d["recommended"].items()))
    return 0


def _pop_options(argv: Sequence[str], flags: set[str], valued: set[str]) -> tuple[list[str], dict[str, Any]]:
    """Take command-specific options out of argv; the rest are config overrides."""
    rest: list[str] = []
    found: dict[str, Any] = {}
    args = list(argv)
    i = 0
    while i < len(args):
        name, eq, value = args[i][2:].partition("=") if args[i].startswith("--") else ("", "", "")
        if name in flags:
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


def cmd_bench(argv: Sequence[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(
            "usage: gptoughts bench [PRESET|FILE.toml] [--model F --size S --block_size T --batch_size B ...]\n"
            "                       [--steps 20] [--warmup 5] [--compare hf|torchtitan[:flex,sdpa,nographs]]\n"
            "                       [--shards DIR] [--kernels N] [--json]\n"
            "Times training steps (synthetic tokens, or prepared --shards) and prints tokens/s, MFU, peak memory\n"
            "and the step breakdown; --compare hf runs transformers' LlamaForCausalLM (eager and compiled) on the\n"
            "same shape in the same process and prints the ratios; --compare torchtitan runs torchtitan's own\n"
            "Llama 3 model and parallelize functions (pip install torchtitan==0.3.0). --kernels N profiles N more steps and\n"
            "reports GPU time by kernel category (matmul, attention, element-wise, optimizer, ...)."
        )
        return 0
    rest, opts = _pop_options(argv, {"json"}, {"steps", "warmup", "compare", "shards", "kernels"})
    preset, overrides, _ = parse_overrides(rest)
    from gptoughts.config import load_config
    from gptoughts.tools.bench import format_result, run_bench

    cfg = load_config(preset or "default", overrides)
    res = run_bench(
        cfg,
        steps=int(opts.get("steps", 20)),
        warmup=int(opts.get("warmup", 5)),
        compare=opts.get("compare"),
        data_dir=opts.get("shards"),
        kernel_steps=int(opts.get("kernels", 0)),
    )
    print(json.dumps(res, default=str) if opts.get("json") else format_result(res))
    return 0


def cmd_estimate(argv: Sequence[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(
            "usage: gptoughts estimate [PRESET|FILE.toml] [train's options: --model F --size S --batch_size N|auto\n"
            "                          --block_size T --activation_checkpointing M --strategy fsdp --cpu_offload ...]\n"
            "                          [--gpu H100] [--num_gpus N] [--tokens 50e9] [--mfu 0.5] [--price 2.5] [--json]\n"
            "Memory, time and cost of the run `gptoughts train` would make with the same options (same keys, same\n"
            "defaults: --size 1b means its block 2048 and automatic batch), on --gpu (default H100)."
        )
        return 0
    rest, opts = _pop_options(argv, {"json"}, {"gpu", "num_gpus", "tokens", "mfu", "price"})
    preset, overrides, _ = parse_overrides(rest, switches=())
    from gptoughts.config import load_config
    from gptoughts.perf.estimate import estimate_config, format_estimate

    def number(name: str, kind: type) -> Any:
        if name not in opts:
            return None
        try:
            return kind(float(opts[name])) if kind is int else kind(opts[name])
        except ValueError:
            raise ConfigError(f"--{name} must be a number, got {opts[name]!r}") from None

    cfg = load_config(preset, overrides)
    e, micro, accum = estimate_config(
        cfg,
        gpu=opts.get("gpu", "H100"),
        num_gpus=number("num_gpus", int) or 1,
        tokens=number("tokens", int),
        mfu=number("mfu", float),
        price=number("price", float),
    )
    if opts.get("json"):
        print(json.dumps({**e.to_dict(), "micro_batch": micro, "grad_accum": accum}))
    else:
        print(
            f"{cfg.model.family}/{cfg.model.size}: micro-batch {micro} x {cfg.train.block_size} tokens x "
            f"accumulation {accum}"
            + ("" if isinstance(cfg.train.batch_size, int) else f" (auto: fits 90% of {e.gpu})")
        )
        print(format_estimate(e))
    return 0


def cmd_tune(argv: Sequence[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(
            "usage: gptoughts tune [PRESET|FILE.toml] [--size S --block_size T ...] [--ac none,selective,full]\n"
            "                      [--compile_modes blocks,model] [--fp8 off,tensorwise,rowwise] [--batches auto]\n"
            "                      [--steps 10] [--out tuned.toml]\n"
            "Searches micro-batch x activation checkpointing x compile mode x fp8 recipe for the highest tokens/s\n"
            "within memory, prints the table and writes the winning config (default tuned.toml)."
        )
        return 0
    rest, opts = _pop_options(
        argv, set(), {"ac", "compile_modes", "fp8", "batches", "steps", "warmup", "out"}
    )
    preset, overrides, _ = parse_overrides(rest)
    from gptoughts.config import load_config
    from gptoughts.tools.tune import best, format_table, run_tune, write_winner

    def csv(name: str) -> list[str] | None:
        return [v.strip() for v in opts[name].split(",")] if name in opts else None

    batches = [int(b) if b.isdigit() else b for b in csv("batches")] if "batches" in opts else None
    cfg = load_config(preset or "default", overrides)
    trials = run_tune(
        cfg,
        steps=int(opts.get("steps", 10)),
        warmup=int(opts.get("warmup", 3)),
        ac=csv("ac"),
        compile_modes=csv("compile_modes"),
        fp8=csv("fp8"),
        batches=batches,
    )
    print(format_table(trials))
    win = best(trials)
    if win is None:
        raise UserError("no combination ran; see the errors in the table")
    path = write_winner(win, cfg, opts.get("out", "tuned.toml"))
    print(f"best settings written to {path}: gptoughts train {path} --data ...")
    return 0


COMMANDS: dict[str, tuple[Callable[[Sequence[str]], int], str]] = {
    "train": (cmd_train, "train a model (default: the quickstart preset)"),
    "finetune": (cmd_finetune, "fine-tune a Hugging Face model (full or --lora) on SFT JSONL or text"),
    "export": (cmd_export, "write a run as a Hugging Face transformers folder (--format hf OUT)"),
    "prepare": (cmd_prepare, "tokenize a corpus into token shards"),
    "sample": (cmd_sample, "generate text from a run or checkpoint"),
    "eval": (cmd_eval, "loss and perplexity of a run on a corpus; accuracy on multiple-choice tasks"),
    "plot": (cmd_plot, "PNG plots of a run, or several runs overlaid"),
    "config": (cmd_config, "print the fully resolved config of a train command"),
    "env": (cmd_env, "hardware, supported precisions, recommended settings"),
    "estimate": (cmd_estimate, "memory, time and cost of a run before it starts"),
    "tune": (cmd_tune, "search batch x checkpointing x compile x fp8 for the fastest settings"),
    "bench": (cmd_bench, "time training steps: tokens/s, MFU, memory, breakdown (--compare hf)"),
}


def usage() -> str:
    lines = ["usage: gptoughts COMMAND [ARGS]", "", "commands:"]
    lines += [f"  {name:<9} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += [
        "",
        "`gptoughts COMMAND --help` for details; `gptoughts train` alone trains the quickstart (a ~10M Llama "
        "on the Python standard library, a few minutes on a CPU). `gptoughts --version` prints the version.",
    ]
    return "\n".join(lines)


def _setup_logging() -> None:
    import logging

    from rich.console import Console
    from rich.logging import RichHandler

    log = logging.getLogger("gptoughts")
    if not log.handlers:  # to stderr: stdout stays clean for --json output and generated text
        log.addHandler(
            RichHandler(console=Console(stderr=True), show_path=False, show_time=False, markup=False)
        )
        log.setLevel(logging.INFO)
        log.propagate = False


def main(argv: Sequence[str] | None = None) -> int:
    from gptoughts.perf.startup import mark_command

    mark_command()  # `train` reports the time from here (from the process's start) to its first step
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if argv[0] in ("-V", "--version", "version"):
        from gptoughts import __version__

        print(f"gptoughts {__version__}")
        return 0
    if argv[0].startswith("-"):  # `gptoughts --data X` is `gptoughts train --data X`
        argv = ["train", *argv]
    name, rest = argv[0], argv[1:]
    _setup_logging()
    import warnings

    # Python warnings (a corrupt checkpoint skipped, a library's notice) as one line each, without the source line
    warnings.formatwarning = lambda message, category, *args, **kwargs: f"warning: {message}\n"
    if name not in COMMANDS:
        hint = closest(name, COMMANDS)
        print(
            f"error: unknown command {name!r}"
            + (f" (did you mean {hint!r}?)" if hint else "")
            + "\n\n"
            + usage(),
            file=sys.stderr,
        )
        return 2
    try:
        return COMMANDS[name][0](rest)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (
        KeyboardInterrupt
    ):  # Ctrl-C before training started (or a second one): nothing half-written remains
        print("interrupted", file=sys.stderr)
        return 130
    except (
        BrokenPipeError
    ):  # `gptoughts ... | head`: the reader left; nothing to say, and no one to say it to
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at interpreter exit
        return 0
    except Exception as e:
        from gptoughts.errors import as_disk_full

        full = as_disk_full(e)
        if full is None:
            raise
        print(
            f"error: disk full{' while writing ' + str(full.filename) if full.filename else ''} ({full.strerror}); "
            "what was saved before is intact: free some space and run again",
            file=sys.stderr,
        )
        return 2


if __name__ == "__main__":
    sys.exit(main())
