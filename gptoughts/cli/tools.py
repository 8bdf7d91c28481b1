"""Commands around a run: ``prepare`` (a corpus into token shards), ``env`` (the hardware), ``estimate``
(memory, time and cost before a run), ``tune`` and ``bench`` (measured settings and speed).
"""

from __future__ import annotations

import json
import math
import sys
import uuid
from collections.abc import Sequence
from typing import Any

from gptoughts.cli.options import ALIASES, FLAGS, bare_keys, options_help, parse_overrides, pop_options
from gptoughts.cli.trained import Parser
from gptoughts.errors import ConfigError, UserError


def cmd_prepare(argv: Sequence[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(
            "usage: gptoughts prepare --data PATH [--data PATH ...] [--out DIR [--overwrite]] [--size S | --tokenizer SPEC]\n"
            "                         [--text_field F --extensions a,b --val_fraction X --max_bytes N --seed N\n"
            "                          --workers N]\n"
            "Tokenize a corpus into token shards (manifest.json, tokenizer/, *.bin) with the same keys and defaults\n"
            "as `gptoughts train` (with --size, the tokenizer that size trains with). Without --out, into the cache\n"
            "that `gptoughts train` with the same --data and settings reads: that train then starts without\n"
            "tokenizing. With --out DIR, into DIR, for `gptoughts bench --shards DIR` (train does not read DIR); a DIR\n"
            "prepared with other data, tokenizer or settings is replaced only with --overwrite."
        )
        print("\n".join(options_help(("data",), {**bare_keys(("data",)), **ALIASES}, FLAGS)))
        return 0
    rest, opts = pop_options(argv, {"overwrite"}, {"out"})
    preset, overrides, _ = parse_overrides(rest, sections=("model", "data", "train"), switches=())
    from gptoughts.config import load_config
    from gptoughts.data.prepare import cached_prepare, prepare
    from gptoughts.training.corpus import resolve_sources

    cfg = load_config(preset, overrides)
    d = cfg.data
    kwargs: dict[str, Any] = dict(
        text_field=d.text_field,
        extensions=d.extensions or None,
        val_fraction=d.val_fraction,
        max_bytes=d.max_bytes,
        seed=cfg.train.seed,
        workers=d.workers,
    )
    if "overwrite" in opts and "out" not in opts:
        raise ConfigError(
            "--overwrite replaces the dataset of --out DIR; without --out, prepare fills train's cache, which it "
            "rebuilds when its inputs change: drop --overwrite, or pass --out"
        )
    sources = resolve_sources(d.sources)
    _refuse_examples(sources, d.format)
    if "out" in opts:
        m = prepare(sources, opts["out"], d.tokenizer, overwrite="overwrite" in opts, **kwargs)
        where, note = (
            opts["out"],
            "; train reads its own cache, which `gptoughts prepare` without --out fills",
        )
    else:  # where train's data step looks (training/corpus.py: the same sources, tokenizer and settings)
        m = cached_prepare(sources, d.tokenizer, cache_root=d.cache_dir, **kwargs)
        where = str(m.dir)
        note = "; `gptoughts train` with the same --data and settings reads these shards"
    print(
        f"{where}: {m.train_tokens:,} train tokens, {m.val_tokens:,} val tokens (vocab {m.vocab_size:,}){note}"
    )
    return 0


def cmd_env(argv: Sequence[str]) -> int:
    p = Parser(prog="gptoughts env", description="Hardware and what `auto` means on it.")
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
    # a CPU's arch is "cpu", its device's name already
    about = [d["name"]] + ([d["arch"]] if d["arch"] not in (d["name"], d["device"]) else [])
    print(
        f"device     {d['device']}  ({', '.join(about)}, {d['gpu_count']} GPU(s), {d['cpu_count']} CPU cores)"
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


def cmd_bench(argv: Sequence[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(
            "usage: gptoughts bench [PRESET|FILE.toml] [--model F --size S --block_size T --batch_size B ...]\n"
            "                       [--steps 20] [--warmup 5] [--compare hf|torchtitan[:flex,sdpa,nographs]]\n"
            "                       [--shards DIR] [--kernels N] [--json]\n"
            "Times training steps (synthetic tokens, or prepared --shards) and prints tokens/s, MFU, peak memory\n"
            "and the step breakdown; --compare hf runs transformers' LlamaForCausalLM (eager and compiled) on the\n"
            "same shape in the same process and prints the ratios; --compare torchtitan runs torchtitan's own\n"
            "Llama 3 (or, with --model deepseek, DeepSeek-V3) model and parallelize functions (pip install\n"
            "torchtitan==0.3.0). --kernels N profiles N more steps and reports GPU time by kernel category\n"
            "(matmul, attention, element-wise, optimizer, ...)."
        )
        return 0
    rest, opts = pop_options(argv, {"json"}, {"steps", "warmup", "compare", "shards", "kernels"})
    preset, overrides, _ = parse_overrides(rest)
    from gptoughts.config import load_config
    from gptoughts.tools.bench import format_result, run_bench

    # checked before the model is built: a count that is not one was a traceback, and --steps -1 a negative speed
    steps = whole_number(opts, "steps", 20, minimum=1)
    warmup = whole_number(opts, "warmup", 5, minimum=0)
    kernels = whole_number(opts, "kernels", 0, minimum=0)
    cfg = load_config(preset or "default", overrides)
    res = run_bench(
        cfg,
        steps=steps,
        warmup=warmup,
        compare=opts.get("compare"),
        data_dir=opts.get("shards"),
        kernel_steps=kernels,
        # to stderr: stdout stays the result alone (--json)
        announce=lambda line: print(line, file=sys.stderr, flush=True),
    )
    print(json.dumps(res, default=str) if opts.get("json") else format_result(res))
    return 0


def _refuse_examples(sources: list[str], fmt: str) -> None:
    """Chat examples or preference pairs are not a corpus to prepare: fine-tuning reads them whole, with the model's
    own tokenizer (prepare said they had no field 'text' and to pass --text_field)."""
    from gptoughts.data.prefs import examples_kind

    what = examples_kind(sources, fmt)
    if what is not None:
        objective = " --objective dpo" if what == "preference pairs" else ""
        raise UserError(
            f"{sources[0]} holds {what}, which fine-tuning reads whole with the model's own tokenizer: there is "
            f"nothing to prepare; run `gptoughts finetune --model MODEL --data {sources[0]}{objective}`"
        )


def whole_number(opts: dict[str, Any], name: str, default: int, *, minimum: int) -> int:
    """``--NAME``'s value as a whole number >= ``minimum`` (``default`` when not given), else a one-line error."""
    value = str(opts.get(name, default)).strip()
    if not value.isdigit() or int(value) < minimum:
        raise ConfigError(f"--{name} must be a whole number >= {minimum}, got {value!r}")
    return int(value)


def cmd_estimate(argv: Sequence[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(
            "usage: gptoughts estimate [PRESET|FILE.toml] [train's options: --model F --size S --batch_size N|auto\n"
            "                          --block_size T --activation_checkpointing M --strategy fsdp --cpu_offload ...]\n"
            "                          [--gpu H100] [--num_gpus N] [--tokens 50e9] [--mfu 0.5] [--price 2.5] [--json]\n"
            "Memory, time and cost of the run `gptoughts train` would make with the same options (same keys, same\n"
            "defaults: --size 1b means its block 2048 and automatic batch; the memory layout train chooses where the\n"
            "defaults do not fit), on --gpu (default H100). The time is of --tokens, or of the run's --max_steps or\n"
            "--max_tokens (not with --tokens). For this machine's CPU, `gptoughts train` with the same flags and\n"
            "--device cpu --dry_run prints the plan."
        )
        return 0
    own = {"gpu", "num_gpus", "tokens", "mfu", "price"}
    rest, opts = pop_options(argv, {"json"}, own)
    preset, overrides, _ = parse_overrides(rest, switches=(), own=sorted(own))
    from gptoughts.config import load_config
    from gptoughts.perf.estimate import estimate_config, format_estimate

    def number(name: str, kind: type, ok: Any, what: str) -> Any:
        """``--NAME`` as a finite number of ``kind`` for which ``ok`` holds (50e9 is a whole number), else one line:
        --num_gpus 0 was taken as 1, -2 gave a negative speed, --tokens inf a traceback, --mfu 2 twice the peak."""
        if name not in opts:
            return None
        try:
            value = float(opts[name])
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or (kind is int and not value.is_integer()) or not ok(value):
            raise ConfigError(f"--{name} must be {what}, got {opts[name]!r}")
        return kind(value)

    gpus = number("num_gpus", int, lambda v: v >= 1, "a whole number >= 1")
    tokens = number("tokens", int, lambda v: v >= 1, "a number of tokens >= 1 (e.g. 50e9)")
    mfu = number("mfu", float, lambda v: 0 < v <= 1, "a fraction of the GPU's peak in (0, 1] (e.g. 0.5)")
    price = number("price", float, lambda v: v >= 0, "a price per GPU-hour >= 0")
    cfg = load_config(preset, overrides)
    e, micro, accum = estimate_config(
        cfg, gpu=opts.get("gpu", "H100"), num_gpus=gpus or 1, tokens=tokens, mfu=mfu, price=price
    )
    if opts.get("json"):
        print(json.dumps({**e.to_dict(), "micro_batch": micro, "grad_accum": accum}))
    else:
        print(
            f"{cfg.model.family}/{cfg.model.size}: micro-batch {micro} x {cfg.train.block_size} tokens x "
            f"accumulation {accum}"
            + ("" if isinstance(cfg.train.batch_size, int) else f" (auto: fits 90% of {e.gpu})")
        )
        # what train's memory layout chooser changes of the settings left to their defaults, as its plan says
        for name, why in e.layout.items():
            print(f"{name}: {why}")
        print(format_estimate(e))
        if "gpu" not in opts:
            print("(on an H100: --gpu names another)")
        if e.refusal:
            print(f"`gptoughts train` refuses this run: {e.refusal}")
        elif e.fits is False:
            print(
                "over 95% of the GPU, but no layout brings it under 90% and it is within the estimate's error: "
                "train runs it as set (`gptoughts train` with these flags and --dry_run prints its plan)"
            )
        if "cpu_offload" in e.layout:
            print(
                f"offload needs ~{e.host_gib:.1f} GiB of host memory per process: on a machine with less free, "
                "train refuses the run"
            )
        if e.hours is None and e.tokens_per_s is not None and cfg.is_given("train.epochs"):
            print(
                "time: --epochs counts passes over the corpus, which estimate does not read: pass --max_tokens "
                "or --max_steps instead (or --tokens without --epochs)"
            )
    return 0


def cmd_tune(argv: Sequence[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(
            "usage: gptoughts tune [PRESET|FILE.toml] [--size S --block_size T ...] [--ac none,selective,full]\n"
            "                      [--compile_modes blocks,model] [--fp8 off,tensorwise,rowwise] [--batches auto]\n"
            "                      [--steps 10] [--out tuned.toml] [--overwrite]\n"
            "Searches micro-batch x activation checkpointing x compile mode x fp8 recipe for the highest tokens/s\n"
            "within memory, prints the table and writes the winning config (default tuned.toml; a file already\n"
            "there is kept unless --overwrite)."
        )
        return 0
    # --overwrite is tune's own (replace OUT), not the config's run.overwrite: it never goes into tuned.toml
    rest, opts = pop_options(
        argv, {"overwrite"}, {"ac", "compile_modes", "fp8", "batches", "steps", "warmup", "out"}
    )
    # before any trial: a search takes minutes, and its result must have somewhere to go
    from gptoughts.training.rundir import output_file

    out = output_file(opts.get("out"), "tuned.toml", bool(opts.get("overwrite")))
    preset, overrides, _ = parse_overrides(rest)
    from gptoughts.config import load_config
    from gptoughts.tools.tune import best, format_table, run_tune, write_winner
    from gptoughts.training.rundir import place_file

    def csv(name: str) -> list[str] | None:
        return [v.strip() for v in opts[name].split(",")] if name in opts else None

    def batch(value: str) -> int | str:
        if value == "auto" or (value.isdigit() and int(value) >= 1):
            return value if value == "auto" else int(value)
        raise ConfigError(f"--batches takes micro-batch sizes >= 1 or auto, comma-separated; got {value!r}")

    batches = [batch(b) for b in csv("batches") or []] if "batches" in opts else None
    steps, warmup = whole_number(opts, "steps", 10, minimum=1), whole_number(opts, "warmup", 3, minimum=0)
    cfg = load_config(preset or "default", overrides)
    trials = run_tune(
        cfg,
        steps=steps,
        warmup=warmup,
        ac=csv("ac"),
        compile_modes=csv("compile_modes"),
        fp8=csv("fp8"),
        batches=batches,
    )
    print(format_table(trials))
    win = best(trials)
    if win is None:
        raise UserError("no combination ran; see the errors in the table")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        write_winner(win, cfg, tmp, name=str(out))
        path = place_file(tmp, out, bool(opts.get("overwrite")))
    finally:
        tmp.unlink(missing_ok=True)
    if path != out:
        print(f"{out} appeared during the search; kept it and wrote {path} instead", file=sys.stderr)
    print(f"best settings written to {path}: gptoughts train {path} --data ...")
    return 0
