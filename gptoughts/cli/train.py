"""``gptoughts train``, ``finetune`` and ``config``: the commands that compose a config from a preset and
options, then run it (or print it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gptoughts.cli.options import (
    ALIASES,
    FINETUNE_ALIASES,
    FINETUNE_FLAGS,
    FINETUNE_SECTIONS,
    FLAGS,
    TRAIN_SECTIONS,
    bare_keys,
    options_help,
    parse_overrides,
)
from gptoughts.errors import ConfigError, UserError

WHERE_A_RUN_STARTS = """Where a run starts: a bare `gptoughts train` trains the quickstart preset (a ~10M-parameter Llama on
6 MB of the Python standard library, 250 steps). A run that names --data, --model, --size or a preset starts
from the defaults of its family and size (gptoughts/presets/sizes.toml: sequence length, learning rate, batch,
vocabulary), then the preset or TOML file it names, then its flags; nothing of the quickstart leaks into it.
With --resume the run's own config.toml is the start, and flags beside it override what they name. Before the
first step a run prints its plan (model, parameters, corpus read, tokens, steps, epochs, memory, time)."""


def train_help() -> str:
    from gptoughts import models
    from gptoughts.config import list_presets

    lines = [
        "usage: gptoughts train [PRESET|FILE.toml|--config FILE.toml] [--option VALUE ...] [--section.key VALUE ...]",
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
    lines += options_help(TRAIN_SECTIONS, {**bare_keys(TRAIN_SECTIONS), **ALIASES}, FLAGS)
    lines += [
        "",
        "model architecture fields (--model.NAME VALUE, e.g. --model.n_layers 8) depend on the family: "
        "see docs/internals.md and gptoughts/models/FAMILY.py.",
    ]
    return "\n".join(lines)


def _run(
    preset: str | None,
    overrides: dict[str, Any],
    switches: set[str],
    default_preset: str | None = None,
    finetune: bool = False,
) -> int:
    from gptoughts.config import load_config, to_toml

    cfg = load_config(preset or default_preset, overrides)
    if finetune:
        from gptoughts.training.rundir import check_finetune_base

        check_finetune_base(cfg)  # a resume without --model: the base model of the run's config.toml
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


FINETUNE_USAGE = """usage: gptoughts finetune [PRESET|FILE.toml] --model HF_DIR|ORG/NAME --data PATH [--lora] [options]

Fine-tunes a Hugging Face model: a local folder (config.json, safetensors, tokenizer files) or a hub id, read from
the Hugging Face cache and downloaded into it when online (`hf download ORG/NAME` fetches it ahead), or a
gptoughts run (RUN: its newest checkpoint exported into OUT/base first, LoRA merged: SFT, then DPO from it).
Llama, Mistral, Qwen2, Qwen3, GPT-2 and DeepSeek-V3 layouts run on the native fast path; other causal LMs train
through transformers (a notice says so). Default preset: finetune; unless given, the block is the model's positions
up to 1024 and the learning rate 2e-5 (2e-4 with --lora), and the plan says so.

data (--data, repeatable):
  .jsonl of {"prompt": ..., "response" (or "completion"): ...} or {"messages": [{"role": ..., "content": ...},
  ...]}: loss on the responses only, the tokenizer's chat template when it has one; examples packed per row
  (--packing false: one per row); longer than a row: --truncation right (cut) or drop. Anything else: continued
  pretraining.
  With --objective dpo: .jsonl of {"prompt": ..., "chosen": ..., "rejected": ...} (or "messages" with "chosen"
  and "rejected" assistant messages): DPO on the completions (--dpo.beta, --dpo.label_smoothing).

options (besides every `gptoughts train` option and any --section.key VALUE):
  --model HF_DIR|ORG/NAME|RUN model.init_from (--model_name)  --trust_remote_code  run the folder's own code
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
        lines = options_help(("lora",), {**bare_keys(("lora",)), **FINETUNE_ALIASES}, FINETUNE_FLAGS)
        print("\n".join(["LoRA options:", *lines[1:]]))
        lines = options_help(("dpo",), {}, {})
        print("\n".join(["preference tuning (--objective dpo) options:", *lines[1:]]))
        return 0
    preset, overrides, switches = parse_overrides(
        argv, FINETUNE_ALIASES, FINETUNE_FLAGS, sections=(*TRAIN_SECTIONS, *FINETUNE_SECTIONS)
    )
    if overrides.get("lora.quantize") == "4bit":
        overrides.setdefault("lora.enabled", True)
    if "model.init_from" not in overrides and preset is None and "run.resume" not in overrides:
        raise ConfigError(
            "finetune needs a pretrained model: pass --model HF_DIR (a local Hugging Face folder) or "
            "--model ORG/NAME (a Hugging Face hub id)"
        )
    return _run(preset, overrides, switches, default_preset="finetune", finetune=True)


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
