"""The ``gptoughts`` command. Thin: parse argv, build a config, call :mod:`gptoughts.api`.

``gptoughts train [PRESET|FILE.toml] [--section.key VALUE ...] [--alias VALUE ...]``: any dotted config key
works; the aliases below are the spellings of the user's own scripts.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from gptoughts.errors import ConfigError, UserError, closest

# alias -> dotted key
ALIASES: dict[str, str] = {
    "model": "model.family",
    "model_type": "model.family",
    "size": "model.size",
    "data": "data.sources",
    "tokenizer": "data.tokenizer",
    "out": "run.out",
    "save_dir": "run.out",
    "max_steps": "train.max_steps",
    "epochs": "train.epochs",
    "max_tokens": "train.max_tokens",
    "batch_size": "train.batch_size",
    "grad_accum": "train.grad_accum",
    "gradient_accumulation_steps": "train.grad_accum",
    "block_size": "train.block_size",
    "learning_rate": "train.learning_rate",
    "lr": "train.learning_rate",
    "warmup_steps": "train.warmup_steps",
    "seed": "train.seed",
    "log_interval": "train.log_interval",
    "eval_interval": "train.eval_interval",
    "save_interval": "train.save_interval",
    "device": "perf.device",
    "precision": "perf.precision",
    "compile": "perf.compile",
    "fp8": "perf.fp8",
    "use_fp8": "perf.fp8",
    "activation_checkpointing": "perf.activation_checkpointing",
    "overwrite": "run.overwrite",
    "resume": "run.resume",
    "wandb": "run.wandb",
    "no_progress": "run.progress",
    "profile": "train.profile",
}
REPEATABLE = {"data.sources"}
# Flags that take no value, and the value they set.
FLAGS: dict[str, Any] = {"overwrite": True, "wandb": True, "no_progress": False}
# Options whose value may be left out, and the value they then take.
OPTIONAL_VALUE: dict[str, Any] = {"resume": "auto", "compile": True, "fp8": True, "use_fp8": True}
_BOOL_WORDS = {"true", "false", "auto", "1", "0"}
OPTIONAL_CHOICES: dict[str, set[str]] = {"compile": _BOOL_WORDS, "fp8": _BOOL_WORDS, "use_fp8": _BOOL_WORDS}

TRAIN_USAGE = """usage: gptoughts train [PRESET|FILE.toml] [--section.key VALUE ...] [options]

Trains a model. With no arguments: the `quickstart` preset (a ~10M-param Llama on the Python standard library).

options (aliases of config keys):
  --model FAMILY          model.family (llama, ...)          --size SIZE        model.size (debug, 125m, 1b, ...)
  --data PATH             data.sources (repeatable)          --tokenizer SPEC   bpe:VOCAB | bytes | HF_TOKENIZER_DIR
  --out DIR               run.out (run directory)            --max_steps N / --epochs E / --max_tokens N
  --batch_size N|auto     --grad_accum N                     --block_size N     --learning_rate LR
  --device DEV            --seed N                           --precision {auto,fp32,bf16,fp16}
  --compile [true|false|auto]     --fp8 [true|false|auto] (alias --use_fp8)
  --activation_checkpointing {none,selective,full}        --log_interval / --eval_interval / --save_interval N
  --overwrite             replace the run in --out           --resume [auto|PATH] continue a run
  --wandb                 log to Weights & Biases            --interactive      ask the INL guide's four questions
  --profile START:END     torch.profiler trace of those steps into OUT/profile/ (Perfetto, TensorBoard)
  --section.key VALUE     any config key, e.g. --train.warmup_steps 100 --model.n_layers 4

presets: {presets}
"""


def parse_overrides(argv: Sequence[str], aliases: dict[str, str] | None = None,
                    flags: dict[str, Any] | None = None) -> tuple[str | None, dict[str, Any], bool]:
    """Split ``[PRESET] --k v ...`` into (preset, {dotted key: value}, interactive).

    ``aliases``/``flags`` replace :data:`ALIASES`/:data:`FLAGS` (``finetune`` maps ``--model`` elsewhere)."""
    aliases = ALIASES if aliases is None else aliases
    flags = FLAGS if flags is None else flags
    preset: str | None = None
    out: dict[str, Any] = {}
    interactive = False
    i = 0
    args = list(argv)
    while i < len(args):
        tok = args[i]
        i += 1
        if not tok.startswith("--"):
            if preset is None and not out:
                preset = tok
                continue
            raise ConfigError(f"unexpected argument {tok!r}; options are written --key VALUE")
        name, eq, value = tok[2:].partition("=")
        name = name.replace("-", "_") if "." not in name else name
        if name == "interactive":
            interactive = True
            continue
        if name in flags and not eq:
            out[aliases[name]] = flags[name]
            continue
        if not eq:
            nxt = args[i] if i < len(args) else None
            if name in OPTIONAL_VALUE:
                choices = OPTIONAL_CHOICES.get(name)
                if nxt is None or nxt.startswith("--") or (choices is not None and nxt.lower() not in choices):
                    value = OPTIONAL_VALUE[name]
                else:
                    value, i = nxt, i + 1
            else:
                if nxt is None or (nxt.startswith("--") and len(nxt) > 2):
                    raise ConfigError(f"--{name} needs a value")
                value, i = nxt, i + 1
        key = aliases.get(name, name)
        if "." not in key:
            from gptoughts.config import Config

            sections = {f"{s}" for s in Config.__dataclass_fields__}
            hint = closest(name, list(aliases) + [f"{s}.{name}" for s in sections])
            raise ConfigError(f"unknown option --{name}" + (f" (did you mean --{hint}?)" if hint else
                                                             "; run `gptoughts train --help`"))
        if key in REPEATABLE:
            out.setdefault(key, []).append(value)
        else:
            out[key] = value
    return preset, out, interactive


def ask_interactive(overrides: dict[str, Any], ask: Callable[[str, str], str] | None = None) -> dict[str, Any]:
    """The INL guide's four questions (size, corpus, epochs, batch size), each with a default."""
    def default_ask(question: str, default: str) -> str:
        answer = input(f"{question} [{default}]: ").strip()
        return answer or default

    ask = ask or default_ask
    from gptoughts import models

    family = overrides.get("model.family", "llama")
    sizes = ", ".join(models.list_sizes(family))
    out = dict(overrides)
    out["model.size"] = ask(f"Model size ({sizes})", str(overrides.get("model.size", "debug")))
    corpus = ask("Training corpus (file, folder, .jsonl, .parquet; @stdlib = Python's standard library)",
                 ",".join(overrides.get("data.sources", ["@stdlib"])))
    out["data.sources"] = [c.strip() for c in corpus.split(",") if c.strip()]
    out["train.epochs"] = ask("Epochs", str(overrides.get("train.epochs", 1)))
    out["train.batch_size"] = ask("Batch size", str(overrides.get("train.batch_size", 8)))
    return out


def cmd_train(argv: Sequence[str]) -> int:
    from gptoughts.config import list_presets, load_config

    if any(a in ("-h", "--help") for a in argv):
        print(TRAIN_USAGE.replace("{presets}", ", ".join(list_presets())))
        return 0
    preset, overrides, interactive = parse_overrides(argv)
    if interactive:
        overrides = ask_interactive(overrides)
    cfg = load_config(preset, overrides)
    from gptoughts.api import run_training

    run_training(cfg)
    return 0


# `finetune` reads the same options as `train`, except that --model names the pretrained folder.
FINETUNE_ALIASES: dict[str, str] = {
    **ALIASES,
    "model": "model.init_from",
    "init_from": "model.init_from",
    "trust_remote_code": "model.trust_remote_code",
    "lora": "lora.enabled",
    "lora_r": "lora.r",
    "lora_alpha": "lora.alpha",
    "lora_dropout": "lora.dropout",
    "target_modules": "lora.target_modules",
    "qlora": "lora.quantize",
    "format": "data.format",
    "packing": "data.packing",
    "truncation": "data.truncation",
}
FINETUNE_FLAGS: dict[str, Any] = {**FLAGS, "lora": True, "trust_remote_code": True, "qlora": "4bit"}

FINETUNE_USAGE = """usage: gptoughts finetune [PRESET|FILE.toml] --model HF_DIR --data PATH [--lora] [options]

Fine-tunes a local Hugging Face model folder (config.json, safetensors, tokenizer files). Llama, Mistral, Qwen2
and Qwen3 layouts run on the native fast path; other causal LMs train through transformers (a notice says so).
Default preset: finetune (lr 2e-5; with --lora use about --lr 2e-4).

data (--data, repeatable):
  .jsonl of {"prompt": ..., "response": ...} or {"messages": [{"role": ..., "content": ...}, ...]}: loss on the
  responses only, the tokenizer's chat template when it has one; examples packed per row (--packing false: one
  per row); longer than a row: --truncation right (cut) or drop. Anything else: continued pretraining.

options (besides every `gptoughts train` option and any --section.key VALUE):
  --model HF_DIR          model.init_from                 --trust_remote_code  run the folder's own code
  --lora                  train LoRA adapters (PEFT)      --lora_r R / --lora_alpha A / --lora_dropout P
  --target_modules a,b    lora.target_modules (default: every linear layer of the blocks)
  --qlora                 4-bit base (bitsandbytes, CUDA only)   --lora.base_dtype {auto,fp32,bf16,fp16}
  --format {auto,text,sft}   --packing {true,false}   --truncation {right,drop}

then: gptoughts sample RUN --prompt "..." (chat template applied) and gptoughts export RUN --format hf OUT.
presets: {presets}
"""


def cmd_finetune(argv: Sequence[str]) -> int:
    from gptoughts.config import list_presets, load_config

    if any(a in ("-h", "--help") for a in argv):
        print(FINETUNE_USAGE.replace("{presets}", ", ".join(list_presets())))
        return 0
    preset, overrides, _ = parse_overrides(argv, FINETUNE_ALIASES, FINETUNE_FLAGS)
    if overrides.get("lora.quantize") == "4bit":
        overrides.setdefault("lora.enabled", True)
    cfg = load_config(preset or "finetune", overrides)
    if cfg.model.init_from is None:
        raise ConfigError("finetune needs a pretrained model: pass --model HF_DIR (a local Hugging Face folder)")
    from gptoughts.api import run_training

    run_training(cfg)
    return 0


def cmd_export(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="gptoughts export",
                                description="Write a run as a Hugging Face transformers model folder (LoRA merged).")
    p.add_argument("path", help="run directory, checkpoint directory (or an HF folder)")
    p.add_argument("out_pos", nargs="?", metavar="OUT", help="output folder (or --out)")
    p.add_argument("--out", default=None, help="output folder")
    p.add_argument("--format", default="hf", choices=["hf"], help="hf: config.json + safetensors + tokenizer")
    p.add_argument("--max_shard_size", default="5GB", help="split weights above this size (e.g. 5GB, 500MB)")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                   help="auto: the base model's dtype (fp32 for models trained from scratch)")
    p.add_argument("--overwrite", action="store_true", help="write into a non-empty OUT")
    p.add_argument("--device", default="cpu", help="where LoRA is merged (cpu needs no GPU memory)")
    a = p.parse_intermixed_args(argv)
    out = a.out or a.out_pos
    if out is None:
        raise ConfigError("export needs an output folder: gptoughts export RUN --format hf OUT")
    from gptoughts.api import export

    written = export(a.path, out, format=a.format, max_shard_size=a.max_shard_size, dtype=a.dtype,
                     overwrite=a.overwrite, device=a.device)
    print(f"wrote {written} (load it with transformers.AutoModelForCausalLM.from_pretrained)")
    return 0


def cmd_prepare(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="gptoughts prepare", description="Tokenize a corpus into token shards.")
    p.add_argument("--data", action="append", required=True, help="file, folder, .jsonl, .parquet or saved HF dataset")
    p.add_argument("--out", required=True, help="output directory for shards + manifest.json + tokenizer/")
    p.add_argument("--tokenizer", default="bpe:8192", help="bpe:VOCAB | bytes | HF tokenizer folder")
    p.add_argument("--text_field", default="text")
    p.add_argument("--val_fraction", type=float, default=0.005)
    p.add_argument("--max_bytes", type=int, default=None)
    p.add_argument("--seed", type=int, default=1337)
    a = p.parse_args(argv)
    from gptoughts.api import resolve_sources
    from gptoughts.data.prepare import prepare

    m = prepare(resolve_sources(a.data), a.out, a.tokenizer, text_field=a.text_field, val_fraction=a.val_fraction,
                max_bytes=a.max_bytes, seed=a.seed)
    print(f"{a.out}: {m.train_tokens:,} train tokens, {m.val_tokens:,} val tokens")
    return 0


def cmd_sample(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="gptoughts sample", description="Generate text from a trained model.")
    p.add_argument("path", help="run directory, checkpoint directory or Hugging Face model folder")
    p.add_argument("--prompt", default="", help="text to continue (with --chat: the user's message)")
    p.add_argument("--chat", default="auto", choices=["auto", "on", "off"],
                   help="render the prompt with the chat template and print only the answer; auto: on for SFT runs "
                        "and for HF folders whose tokenizer has a chat template")
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top_k", type=int, default=50)
    p.add_argument("--top_p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--device", default="auto")
    a = p.parse_args(argv)
    from gptoughts.api import generate_text, load

    loaded = load(a.path, device=a.device)
    chat = None if a.chat == "auto" else a.chat == "on"
    print(generate_text(loaded, a.prompt, max_new_tokens=a.max_new_tokens, temperature=a.temperature,
                        top_k=a.top_k if a.top_k and a.top_k > 0 else None, top_p=a.top_p, seed=a.seed, chat=chat))
    return 0


def cmd_eval(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="gptoughts eval", description="Validation loss and perplexity on a corpus.")
    p.add_argument("path", help="run directory or checkpoint directory")
    p.add_argument("--data", action="append", required=True)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--block_size", type=int, default=None)
    p.add_argument("--max_batches", type=int, default=100)
    p.add_argument("--device", default="auto")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    a = p.parse_args(argv)
    from gptoughts.api import evaluate, load

    loaded = load(a.path, device=a.device)
    res = evaluate(loaded, a.data, batch_size=a.batch_size, block_size=a.block_size, max_batches=a.max_batches)
    if a.json:
        print(json.dumps(res))
    else:
        print(f"loss {res['loss']:.4f}  perplexity {res['perplexity']:.2f}  ({int(res['tokens']):,} tokens, "
              f"{res['split']} split)")
    return 0


def cmd_env(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="gptoughts env", description="Hardware and what `auto` means on it.")
    p.add_argument("--json", action="store_true")
    p.add_argument("--device", default="auto")
    a = p.parse_args(argv)
    from gptoughts.perf.hardware import detect

    prof = detect(a.device)
    d = prof.to_dict()
    if a.json:
        print(json.dumps(d, default=str))
        return 0
    mem = f"{d['memory_bytes'] / 2**30:.1f} GiB" if d["memory_bytes"] else "unknown"
    print(f"device     {d['device']}  ({d['name']}, {d['arch']}, {d['gpu_count']} GPU(s), {d['cpu_count']} CPU cores)")
    print(f"memory     {mem}")
    precisions = ["fp32"] + [p for p in ("bf16", "fp16", "fp8") if d[p]]
    print(f"precisions {', '.join(precisions)}")
    print(f"compile    {'available' if d['compile'] else 'unavailable'}")
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
        print("usage: gptoughts bench [PRESET|FILE.toml] [--model F --size S --block_size T --batch_size B ...]\n"
              "                       [--steps 20] [--warmup 5] [--compare hf] [--shards DIR] [--kernels N] [--json]\n"
              "Times training steps (synthetic tokens, or prepared --shards) and prints tokens/s, MFU, peak memory\n"
              "and the step breakdown; --compare hf runs transformers' LlamaForCausalLM (eager and compiled) on the\n"
              "same shape in the same process and prints the ratios. --kernels N profiles N more steps and\n"
              "reports GPU time by kernel category (matmul, attention, element-wise, optimizer, ...).")
        return 0
    rest, opts = _pop_options(argv, {"json"}, {"steps", "warmup", "compare", "shards", "kernels"})
    preset, overrides, _ = parse_overrides(rest)
    from gptoughts.config import load_config
    from gptoughts.perf.bench import format_result, run_bench

    cfg = load_config(preset or "default", overrides)
    res = run_bench(cfg, steps=int(opts.get("steps", 20)), warmup=int(opts.get("warmup", 5)),
                    compare=opts.get("compare"), data_dir=opts.get("shards"),
                    kernel_steps=int(opts.get("kernels", 0)))
    print(json.dumps(res, default=str) if opts.get("json") else format_result(res))
    return 0


def cmd_estimate(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="gptoughts estimate",
                                description="Memory, time and cost of a training run before it starts.")
    p.add_argument("--model", default="llama", help="model family")
    p.add_argument("--size", default="125m")
    p.add_argument("--batch_size", type=int, default=8, help="micro-batch per GPU (sequences)")
    p.add_argument("--block_size", type=int, default=2048)
    p.add_argument("--activation_checkpointing", default="none", choices=["none", "selective", "full"])
    p.add_argument("--loss", default="chunked", choices=["chunked", "plain"])
    p.add_argument("--residual_dtype", default="bf16", choices=["bf16", "fp32"],
                   help="dtype of the residual stream (train's perf.residual_dtype; auto is bf16 on GPUs)")
    p.add_argument("--gpu", default="H100", help="GPU name, e.g. H100, H200, A100, RTX 4090")
    p.add_argument("--num_gpus", type=int, default=1)
    p.add_argument("--strategy", default="ddp", choices=["ddp", "fsdp"],
                   help="parallel.strategy: fsdp divides weights, gradients and optimizer state by --num_gpus")
    p.add_argument("--tokens", type=float, default=None, help="token budget, e.g. 50e9")
    p.add_argument("--mfu", type=float, default=None, help="assumed model FLOPs utilisation (default: measured)")
    p.add_argument("--price", type=float, default=None, help="$ per GPU-hour")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    from gptoughts.perf.estimate import estimate, format_estimate

    e = estimate(a.model, a.size, batch_size=a.batch_size, block_size=a.block_size,
                 activation_checkpointing=a.activation_checkpointing, loss=a.loss, gpu=a.gpu,
                 tokens=int(a.tokens) if a.tokens else None, mfu=a.mfu, price=a.price, num_gpus=a.num_gpus,
                 residual_dtype=a.residual_dtype, strategy=a.strategy)
    print(json.dumps(e.to_dict()) if a.json else format_estimate(e))
    return 0


def cmd_tune(argv: Sequence[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print("usage: gptoughts tune [PRESET|FILE.toml] [--size S --block_size T ...] [--ac none,selective,full]\n"
              "                      [--compile_modes blocks,model] [--fp8 off,tensorwise,rowwise] [--batches auto]\n"
              "                      [--steps 10] [--out tuned.toml]\n"
              "Searches micro-batch x activation checkpointing x compile mode x fp8 recipe for the highest tokens/s\n"
              "within memory, prints the table and writes the winning config (default tuned.toml).")
        return 0
    rest, opts = _pop_options(argv, set(), {"ac", "compile_modes", "fp8", "batches", "steps", "warmup", "out"})
    preset, overrides, _ = parse_overrides(rest)
    from gptoughts.config import load_config
    from gptoughts.perf.tune import best, format_table, run_tune, write_winner

    def csv(name: str) -> list[str] | None:
        return [v.strip() for v in opts[name].split(",")] if name in opts else None

    batches = [int(b) if b.isdigit() else b for b in csv("batches")] if "batches" in opts else None
    cfg = load_config(preset or "default", overrides)
    trials = run_tune(cfg, steps=int(opts.get("steps", 10)), warmup=int(opts.get("warmup", 3)), ac=csv("ac"),
                      compile_modes=csv("compile_modes"), fp8=csv("fp8"), batches=batches)
    print(format_table(trials))
    win = best(trials)
    if win is None:
        raise UserError("no combination ran; see the errors in the table")
    path = write_winner(win, cfg, opts.get("out", "tuned.toml"))
    print(f"best settings written to {path}: gptoughts train {path} --data ...")
    return 0


COMMANDS: dict[str, tuple[Callable[[Sequence[str]], int], str]] = {
    "train": (cmd_train, "train a model (default: the quickstart preset)"),
    "finetune": (cmd_finetune, "fine-tune a local Hugging Face model (full or --lora) on SFT JSONL or text"),
    "export": (cmd_export, "write a run as a Hugging Face transformers folder (--format hf OUT)"),
    "prepare": (cmd_prepare, "tokenize a corpus into token shards"),
    "sample": (cmd_sample, "generate text from a run or checkpoint"),
    "eval": (cmd_eval, "val loss and perplexity of a run on a corpus"),
    "env": (cmd_env, "hardware, supported precisions, recommended settings"),
    "estimate": (cmd_estimate, "memory, time and cost of a run before it starts"),
    "tune": (cmd_tune, "search batch x checkpointing x compile x fp8 for the fastest settings"),
    "bench": (cmd_bench, "time training steps: tokens/s, MFU, memory, breakdown (--compare hf)"),
}


def usage() -> str:
    lines = ["usage: gptoughts COMMAND [ARGS]", "", "commands:"]
    lines += [f"  {name:<9} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`gptoughts COMMAND --help` for details. `gptoughts` alone runs `gptoughts train` (quickstart)."]
    return "\n".join(lines)


def _setup_logging() -> None:
    import logging

    from rich.console import Console
    from rich.logging import RichHandler

    log = logging.getLogger("gptoughts")
    if not log.handlers:  # to stderr: stdout stays clean for --json output and generated text
        log.addHandler(RichHandler(console=Console(stderr=True), show_path=False, show_time=False, markup=False))
        log.setLevel(logging.INFO)
        log.propagate = False


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if not argv or argv[0].startswith("-"):
        argv = ["train", *argv]
    name, rest = argv[0], argv[1:]
    _setup_logging()
    if name not in COMMANDS:
        hint = closest(name, COMMANDS)
        print(f"error: unknown command {name!r}" + (f" (did you mean {hint!r}?)" if hint else "") + "\n\n" + usage(),
              file=sys.stderr)
        return 2
    try:
        return COMMANDS[name][0](rest)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
