"""Time to loss: the wall time and the tokens each training variant takes to reach a target validation loss.

Every variant trains the same shape on the same prepared token shards: the same corpus, tokenizer, block size,
micro-batch, accumulation, token budget, seed and held-out windows (the shards are prepared once, first, and
every run reads that cache; a run that read other shards is flagged). These shared keys are given to every
run and cannot be changed per variant (a variant that repeats one is skipped: "given twice"). Each variant
evaluates every ``--eval_every`` steps (default: ~25 evaluations a run) and at its end, on
``--val_fraction`` (2%, 4x gptoughts' default, for a steadier val loss) of the corpus held out.
Variants (``--variants``, run in the order given):

* ``adamw``: ``gptoughts train`` with our defaults (AdamW, cosine schedule with warmup, compile on CUDA);
* ``muon``: the same with ``--train.optimizer muon``;
* ``speedrun``: the preset ``llama-125m-speedrun`` (skipped with one line when that preset is not there): its
  model switches, Muon, learning rate and wsd schedule, with the shared batch above (not its ~0.5M tokens
  per step);
* ``hf``: transformers' ``Trainer`` training ``LlamaForCausalLM`` of the same shape (its config built from our
  model args by ``gptoughts.tools.bench.hf_llama_config``), fed the same rows in the same order (our
  ``BatchLoader`` over the same shards), with the adamw variant's resolved peak lr, AdamW betas, eps, weight
  decay and gradient clip (``--args`` changes them for both), ``cosine_with_min_lr`` to its ``min_lr_ratio``
  after the same linear warmup, bf16 autocast on CUDA, SDPA attention, eager unless ``--hf_compile``;
  evaluated on our held-out windows (``gptoughts.data.loader.eval_batches``, the windows our trainer uses) as
  the mean token cross-entropy. What stays the Trainer's own: its init (std 0.02 everywhere), its
  weight-decay grouping (embeddings decayed), its warmup (lr 0 at step 0), its fp32 logits;
* more with ``--define NAME='[PRESET] --key value ...'`` (gptoughts overrides), e.g. a learning-rate sweep.

The clock. Each variant is a fresh process (``python -m gptoughts train ...``; the hf variant re-runs this
script as its worker) timed from just before its launch: Python and the imports, the model build, compile
(by default each variant gets an empty compile cache, ``--compile_cache fresh``, as on a first run) and every
evaluation all count. A variant's time to the target is the ``time`` field (Unix time, written as the row is
logged, i.e. after that evaluation) of its first ``val_loss`` row at or under the target in ``metrics.jsonl``,
minus the launch time; its tokens are that row's step x tokens per step. ``total_seconds`` runs from launch
to exit; ``startup_seconds`` from launch to the end of the first optimizer step (our ``summary.json``);
``tokens_per_s`` is the budget over ``total_seconds``, ``train_tokens_per_s`` the median of the logged
windows (steady state).

The target: ``--target X``, else the adamw variant's final val loss (so adamw reaches it at its last
evaluation, or earlier if its curve came back up). A variant that never reaches it reports null. Ratios
against adamw and against hf: ``speedup`` = base seconds to target / the variant's (> 1: sooner),
``token_efficiency`` = base tokens to target / the variant's (> 1: fewer tokens), ``throughput`` = the
variant's tokens/s / the base's. With an hf run, ``to_hf_final`` is each variant's time (and tokens) to the Trainer's
final val loss, and ``vs_hf_total`` that time over the Trainer's whole run, start-up included (< 1: sooner; issue
14's wall-time measure).

Output: a table, and ``--out DIR`` holds ``results.json`` (settings, target, one row per variant with its
curve), a log per variant, each run's directory, and ``NAME.record.json`` per variant: with ``--reuse`` a
variant recorded under the same settings is not re-run (split a long comparison over several commands, e.g.
``--variants adamw`` then ``--variants muon,hf --reuse``; the table then holds every matching record).

GPU (one H100, the defaults: llama 125m, @stdlib, bpe:8192, block 1024, 32 x 1024 x accumulation 2 = 65,536
tokens per step, 20M tokens = 306 steps, an evaluation every 12 steps)::

    python bench/time_to_loss.py --out $OUT/ttl

Estimate at ~500k tokens/s for ours at 125m (BENCHMARKS: 531k at b32 s1024 on an H200 with a 32k vocab;
transformers eager 248k): the shards once (tokenizer training + tokenization of the stdlib, cached: under a
minute), then per gptoughts variant ~30 s of start-up and compile + 20M / 500k = 40 s, hf ~10 s + 20M / 250k =
80 s; with evaluations about 4 x ~80 s + 1 min = ~6 min for the four variants. Each extra 10M tokens adds
~20 s per gptoughts variant and ~40 s for hf (~100 s for the four): ~35M tokens fit a 9-minute command. A
budget like 300M (600 s of training for each of ours at 500k tok/s) fits no single command: run one variant
per command with ``--reuse`` and keep each under the limit (~240M tokens for one of ours, ~120M for hf
eager), or pass ``--timeout S`` (a variant past it is stopped and reported on the evaluations it made).
Mind the epochs: the H100 machines' stdlib is small (BENCHMARKS: 10.7 MB, 2.6M tokens at bpe:32768; a little
more at bpe:8192), so 20M tokens is ~6 passes (the plan warns past ~4) and a longer budget measures
memorisation more than learning; each run's epochs are in the results. ``--data`` takes any other corpus.

CPU smoke test (tests/test_time_to_loss.py)::

    python bench/time_to_loss.py --data DIR --size debug --tokenizer bytes --block_size 32 --batch_size 4 \\
        --grad_accum 1 --max_tokens 2048 --eval_every 4 --eval_batches 2 --device cpu --threads 1 \\
        --variants adamw,muon,hf --out /tmp/ttl
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SPEEDRUN_PRESET = "llama-125m-speedrun"
EVALS_PER_RUN = 25
BASES = ("adamw", "hf")


@dataclass(frozen=True)
class Variant:
    name: str
    preset: str | None = None
    args: tuple[str, ...] = ()
    hf: bool = False


BUILTIN: dict[str, Variant] = {
    "adamw": Variant("adamw"),
    "muon": Variant("muon", args=("--train.optimizer", "muon")),
    "speedrun": Variant("speedrun", preset=SPEEDRUN_PRESET),
    "hf": Variant("hf", hf=True),
}


def _int(text: str) -> int:
    """300_000_000, 3e8 or 300000000."""
    return int(float(text.replace("_", ""))) if any(c in text for c in ".eE") else int(text)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="adamw,muon,speedrun,hf", help="comma-separated, run in this order")
    p.add_argument(
        "--define",
        action="append",
        default=[],
        metavar="NAME='[PRESET] ARGS'",
        help="another variant: a name and gptoughts train overrides (repeatable); add NAME to --variants",
    )
    p.add_argument("--data", default="@stdlib", help="corpus (gptoughts --data)")
    p.add_argument("--model", default="llama", help="model family (hf needs llama)")
    p.add_argument("--size", default="125m")
    p.add_argument("--tokenizer", default="bpe:8192")
    p.add_argument("--block_size", type=int, default=1024)
    p.add_argument(
        "--batch_size", type=int, default=32, help="micro-batch in sequences (fixed: no auto search)"
    )
    p.add_argument("--grad_accum", type=int, default=2)
    p.add_argument("--max_tokens", type=_int, default=20_000_000, help="token budget of every variant")
    p.add_argument("--eval_every", type=int, default=None, help=f"steps (default: ~{EVALS_PER_RUN} per run)")
    p.add_argument("--eval_batches", type=int, default=20, help="micro-batches of held-out windows per eval")
    p.add_argument(
        "--val_fraction",
        type=float,
        default=0.02,
        help="held-out share of the corpus (4x gptoughts' default: a steadier val loss)",
    )
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--target", type=float, default=None, help="target val loss (default: adamw's final)")
    p.add_argument("--device", default="auto")
    p.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp32"])
    p.add_argument("--threads", type=int, default=None, help="CPU threads of every variant")
    p.add_argument("--args", default="", help="extra gptoughts overrides for every gptoughts variant")
    p.add_argument("--hf_compile", action="store_true", help="hf: TrainingArguments(torch_compile=True)")
    p.add_argument(
        "--compile_cache",
        default="fresh",
        choices=["fresh", "shared"],
        help="fresh: each variant compiles from an empty cache (a first run); shared: the usual caches",
    )
    p.add_argument("--timeout", type=float, default=None, help="seconds per variant; stopped past it")
    p.add_argument(
        "--reuse", action="store_true", help="keep variants recorded in --out under the same settings"
    )
    p.add_argument("--out", default="runs/time_to_loss", help="a folder (or FOLDER/results.json)")
    p.add_argument("--hf_worker", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------------ settings
def variant_table(defines: list[str]) -> dict[str, Variant]:
    table = dict(BUILTIN)
    for d in defines:
        name, eq, spec = d.partition("=")
        name = name.strip()
        if not eq or not name:
            raise SystemExit(f"--define wants NAME='[PRESET] --key value ...'; got {d!r}")
        words = shlex.split(spec)
        preset = words.pop(0) if words and not words[0].startswith("-") else None
        table[name] = Variant(name, preset=preset, args=tuple(words))
    return table


def common_args(a: argparse.Namespace, eval_every: int) -> list[str]:
    """The overrides every gptoughts variant gets: what must be the same for all (shape, data, budget, eval)."""
    data = a.data if a.data.startswith("@") else str(Path(a.data).resolve())
    args = [
        "--data", data, "--model", a.model, "--size", a.size, "--tokenizer", a.tokenizer,
        "--block_size", str(a.block_size), "--batch_size", str(a.batch_size), "--grad_accum", str(a.grad_accum),
        "--max_tokens", str(a.max_tokens), "--train.seed", str(a.seed), "--data.val_fraction", str(a.val_fraction),
        "--eval.eval_interval", str(eval_every), "--eval.eval_batches", str(a.eval_batches),
        # no samples (each costs a generation), no checkpoints, no TensorBoard, no progress bar: timed runs
        "--eval.sample_prompts=", "--checkpoint.checkpoints", "false", "--run.tensorboard", "false",
        "--run.progress", "false", "--perf.device", a.device,
    ]  # fmt: skip
    if a.precision != "auto":
        args += ["--perf.precision", a.precision]
    if a.threads:
        args += ["--perf.threads", str(a.threads)]
    return args + shlex.split(a.args)


def settings_of(a: argparse.Namespace) -> dict[str, Any]:
    """What a recorded variant must share with this command to be reused."""
    keys = ("data", "model", "size", "tokenizer", "block_size", "batch_size", "grad_accum", "max_tokens")
    keys += ("eval_every", "eval_batches", "val_fraction", "seed", "device", "precision", "threads", "args")
    keys += ("hf_compile", "compile_cache")
    out = {k: getattr(a, k) for k in keys}
    if not a.data.startswith("@"):
        out["data"] = str(Path(a.data).resolve())
    return out


def load_variant_config(v: Variant, common: list[str]) -> Any:
    """The variant's resolved gptoughts Config (checks its preset and keys before anything runs)."""
    from gptoughts.cli.options import parse_overrides
    from gptoughts.config import load_config

    argv = ([v.preset] if v.preset else []) + common + list(v.args)
    preset, overrides, _ = parse_overrides(argv)
    return load_config(preset, overrides)


def prepare_shards(cfg: Any) -> tuple[Any, Any]:
    """Tokenize once, into the cache every run reads; returns (Data, model args). The parent process is one CPU
    process (no process group, no CUDA touched): the timed runs are its children."""
    import torch

    from gptoughts.parallel.dist import DistInfo
    from gptoughts.perf import hardware
    from gptoughts.training.corpus import prepare_data
    from gptoughts.training.environment import Environment
    from gptoughts.training.modeling import build_model

    env = Environment(
        device=torch.device("cpu"), dist=DistInfo(), hw=hardware.detect("cpu"), precision="fp32"
    )
    data = prepare_data(cfg, env)
    model = build_model(cfg, env, data, meta=True)
    return data, model.args


# ------------------------------------------------------------------------------------------------- running
def _launch(
    cmd: list[str], log: Path, env: dict[str, str], timeout: float | None
) -> tuple[float, float, str]:
    """(launch time, exit time, status) of one timed process; its output goes to ``log``."""
    with open(log, "w") as f:
        t0 = time.time()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        status = "ok"
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()  # our trainer stops at the end of the step (no checkpoint: they are off)
            try:
                rc = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
            status = "timeout"
        t1 = time.time()
    if status == "ok" and rc != 0:
        status = f"failed (exit {rc})"
    return t0, t1, status


def child_env(a: argparse.Namespace, out: Path, name: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    if a.compile_cache == "fresh":
        cache = out / ".compile-cache" / name
        shutil.rmtree(cache, ignore_errors=True)
        env["TORCHINDUCTOR_CACHE_DIR"] = str(cache / "inductor")
        env["TRITON_CACHE_DIR"] = str(cache / "triton")
    return env


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line cut by a stopped process
    return rows


def collect(run_dir: Path, t0: float, t1: float, status: str) -> dict[str, Any]:
    """A finished (or stopped) run's curve and numbers, from its metrics.jsonl, run.json and summary.json."""
    rows = _read_jsonl(run_dir / "metrics.jsonl")
    run = json.loads((run_dir / "run.json").read_text()) if (run_dir / "run.json").exists() else {}
    summary = (
        json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    )
    tps = run.get("tokens_per_step")
    batch = run.get("plan", {}).get("batch", {})
    curve = [
        {
            "step": r["step"],
            "tokens": r["step"] * tps if tps else None,
            "seconds": round(r["time"] - t0, 3),
            "val_loss": r["val_loss"],
        }
        for r in rows
        if isinstance(r.get("val_loss"), (int, float))
    ]
    windows = [r["tokens_per_s"] for r in rows if isinstance(r.get("tokens_per_s"), (int, float))]
    steady = statistics.median(windows[1:] if len(windows) > 2 else windows) if windows else None
    steps = (
        batch.get("total_steps") if status == "ok" else max([r["step"] for r in rows if "step" in r] or [0])
    )
    tokens = steps * tps if (steps and tps) else None
    total = t1 - t0
    startup = (summary.get("startup") or {}).get("to_first_step_s")
    if startup is None and run.get("first_step_time"):  # the hf worker's
        startup = run["first_step_time"] - t0
    resolved = run.get("resolved", {})
    return {
        "status": status,
        "run_dir": str(run_dir),
        "data": run.get("data"),
        "device": (run.get("hardware") or {}).get("name") or run.get("device"),
        "params": run.get("params"),
        "optimizer": resolved.get("optimizer") or run.get("optimizer"),
        "steps": steps,
        "tokens_per_step": tps,
        "tokens": tokens,
        "epochs": batch.get("epochs"),
        "warmup_steps": batch.get("warmup_steps"),
        "eval_every": batch.get("eval_interval"),
        "final_val_loss": curve[-1]["val_loss"] if curve else None,
        "total_seconds": round(total, 3),
        "startup_seconds": round(startup, 3) if startup is not None else None,
        "tokens_per_s": tokens / total if tokens else None,
        "train_tokens_per_s": steady,
        "curve": curve,
    }


def run_gptoughts(v: Variant, a: argparse.Namespace, common: list[str], out: Path) -> dict[str, Any]:
    run_dir = out / v.name
    cmd = [sys.executable, "-m", "gptoughts", "train", *([v.preset] if v.preset else []), *common, *v.args]
    cmd += ["--out", str(run_dir), "--overwrite"]
    t0, t1, status = _launch(cmd, out / f"{v.name}.log", child_env(a, out, v.name), a.timeout)
    row = collect(run_dir, t0, t1, status)
    row["command"] = shlex.join(cmd)
    return row


def run_hf(a: argparse.Namespace, cfg: Any, data: Any, margs: Any, steps: int, eval_every: int, out: Path):
    from gptoughts.training.optim import default_warmup

    t = cfg.train
    if t.schedule != "cosine":
        raise SystemExit(f"the hf variant reproduces the cosine schedule only; this one is {t.schedule}")
    run_dir = out / "hf"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    spec = {
        "out": str(run_dir),
        "data": str(data.manifest.dir),
        "args": asdict(margs),
        "batch_size": t.batch_size,
        "grad_accum": t.grad_accum,
        "block_size": t.block_size,
        "steps": steps,
        "warmup_steps": min(steps, t.warmup_steps if t.warmup_steps is not None else default_warmup(steps)),
        "learning_rate": t.learning_rate,
        "min_lr_ratio": t.min_lr_ratio,
        "beta1": t.beta1,
        "beta2": t.beta2,
        "eps": t.eps,
        "weight_decay": t.weight_decay,
        "grad_clip": t.grad_clip,
        "seed": t.seed,
        "eval_every": eval_every,
        "eval_batches": cfg.eval.eval_batches,
        "device": a.device,
        "precision": a.precision,
        "threads": a.threads,
        "compile": a.hf_compile,
    }
    spec_path = out / "hf.spec.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--hf_worker", str(spec_path)]
    t0, t1, status = _launch(cmd, out / "hf.log", child_env(a, out, "hf"), a.timeout)
    row = collect(run_dir, t0, t1, status)
    row["command"] = shlex.join(cmd)
    return row


# ------------------------------------------------------------------------------------------------- the hf side
def hf_worker(spec_path: str) -> None:
    """transformers' Trainer on our shards (run as its own process by :func:`run_hf`)."""
    import contextlib
    import dataclasses

    import torch
    import torch.nn.functional as F
    from transformers import LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments, set_seed

    from gptoughts import models
    from gptoughts.data.loader import BatchLoader, eval_batches
    from gptoughts.tools.bench import hf_llama_config

    s = json.loads(Path(spec_path).read_text())
    out = Path(s["out"])
    device = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if s["device"] == "auto" else s["device"]
    )
    cuda = device.type == "cuda"
    if s["threads"]:
        torch.set_num_threads(s["threads"])
    bf16 = cuda and s["precision"] in ("auto", "bf16")
    args = models.get_family("llama").args_cls(**s["args"])
    # Fields hf_llama_config does not carry (the init switches do not matter: the Trainer's model has its own).
    defaults = {f.name: f.default for f in dataclasses.fields(args)}
    carried_elsewhere = ("rope_scaling", "qk_norm", "sliding_window", "full_attention_layers", "mlp")
    unsupported = {
        k: getattr(args, k)
        for k in (*carried_elsewhere, "logit_softcap", "head_dim")
        if hasattr(args, k) and getattr(args, k) != defaults.get(k)
    }
    if unsupported.get("head_dim") == args.d_model // args.n_heads:
        unsupported.pop("head_dim")
    if unsupported:
        raise SystemExit(f"hf variant: hf_llama_config does not carry {unsupported}")
    hf_cfg = hf_llama_config(args)
    hf_cfg._attn_implementation = "sdpa"
    hf_cfg.use_cache = False
    set_seed(s["seed"])
    model = LlamaForCausalLM(hf_cfg)
    B, T, V = s["batch_size"], s["block_size"], args.vocab_size

    class Rows(torch.utils.data.IterableDataset):
        """Our train stream, row by row (the Trainer's DataLoader batches them back into micro-batches)."""

        def __iter__(self):
            with BatchLoader(s["data"], split="train", batch_size=B, block_size=T, seed=s["seed"]) as loader:
                for x, y in loader:
                    for i in range(B):
                        # shift_labels: y is already x shifted (our windows are T+1 tokens), so the loss sees
                        # every one of the T targets, as ours does, instead of HF shifting labels = x by one
                        yield {"input_ids": x[i], "labels": y[i], "shift_labels": y[i]}

    def collate(rows: list[dict]) -> dict:
        return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}

    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
    metrics = open(out / "metrics.jsonl", "w", buffering=1)
    tokens_per_step = B * T * s["grad_accum"]
    run = {
        "tokens_per_step": tokens_per_step,
        "data": s["data"],
        "args": s["args"],
        "params": sum(p.numel() for p in model.parameters()),
        "device": str(device),
        "hardware": {"name": torch.cuda.get_device_name(device) if cuda else "cpu"},
        "optimizer": f"transformers Trainer, {'adamw_torch_fused' if cuda else 'adamw_torch'}, "
        f"peak lr {s['learning_rate']:.1e}, cosine_with_min_lr",
        "plan": {
            "batch": {
                "total_steps": s["steps"],
                "warmup_steps": s["warmup_steps"],
                "eval_interval": s["eval_every"],
            }
        },
    }

    @torch.no_grad()
    def evaluate(m: torch.nn.Module) -> float:
        m.eval()
        total = torch.zeros((), device=device, dtype=torch.float64)
        count = 0
        for x, y in eval_batches(
            s["data"], batch_size=B, block_size=T, max_batches=s["eval_batches"], device=device
        ):
            with autocast():
                logits = m(input_ids=x).logits
            total += F.cross_entropy(logits.float().view(-1, V), y.reshape(-1), reduction="sum").double()
            count += y.numel()
        m.train()
        return (total / max(count, 1)).item()

    class Clock(TrainerCallback):
        """Evaluates every eval_every steps; logs the training loss and the window's tokens/s (evaluations
        left out) at the Trainer's logging steps (the same interval: its loss read is a sync anyway)."""

        window_t0, window_step, window_eval_s = 0.0, 0, 0.0

        def on_step_end(self, targs, state, control, model=None, **kw):  # noqa: ANN001
            step = state.global_step
            if "first_step_time" not in run:
                if cuda:
                    torch.cuda.synchronize(device)
                run["first_step_time"] = time.time()
                (out / "run.json").write_text(json.dumps(run, indent=1))
                self.window_t0, self.window_step = run["first_step_time"], step
            if step % s["eval_every"] == 0 or step >= s["steps"]:
                t = time.perf_counter()
                loss = evaluate(model)
                self.window_eval_s += time.perf_counter() - t
                metrics.write(
                    json.dumps({"step": step, "time": round(time.time(), 3), "val_loss": loss}) + "\n"
                )

        def on_log(self, targs, state, control, logs=None, **kw):  # noqa: ANN001
            if not logs or "loss" not in logs:
                return
            now, step = time.time(), state.global_step
            row = {"step": step, "time": round(now, 3), "loss": logs["loss"], "lr": logs.get("learning_rate")}
            busy = now - self.window_t0 - self.window_eval_s
            if step > self.window_step and busy > 0:
                row["tokens_per_s"] = (step - self.window_step) * tokens_per_step / busy
            self.window_t0, self.window_step, self.window_eval_s = now, step, 0.0
            metrics.write(json.dumps(row) + "\n")

    targs = TrainingArguments(
        output_dir=str(out / "trainer"),
        max_steps=s["steps"],
        per_device_train_batch_size=B,
        gradient_accumulation_steps=s["grad_accum"],
        learning_rate=s["learning_rate"],
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": s["min_lr_ratio"]},
        warmup_steps=s["warmup_steps"],
        adam_beta1=s["beta1"],
        adam_beta2=s["beta2"],
        adam_epsilon=s["eps"],
        weight_decay=s["weight_decay"],
        max_grad_norm=s["grad_clip"],
        optim="adamw_torch_fused" if cuda else "adamw_torch",
        bf16=bf16,
        torch_compile=bool(s["compile"]),
        use_cpu=not cuda,
        seed=s["seed"],
        logging_strategy="steps",
        logging_steps=s["eval_every"],
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
        remove_unused_columns=False,  # keep shift_labels (not a named argument of forward)
        dataloader_num_workers=0,
    )
    trainer = Trainer(
        model=model, args=targs, train_dataset=Rows(), data_collator=collate, callbacks=[Clock()]
    )
    trainer.train()
    metrics.close()


# ------------------------------------------------------------------------------------------------- results
def time_to_target(curve: list[dict], target: float | None) -> dict | None:
    """The first evaluation at or under the target (None: never)."""
    if target is None:
        return None
    return next((p for p in curve if p["val_loss"] <= target), None)


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def finish(rows: list[dict], target: float | None) -> None:
    """Fill tokens/seconds to target and the ratios against adamw and hf, in place."""
    for r in rows:
        hit = time_to_target(r.get("curve", []), target)
        r["step_to_target"] = hit["step"] if hit else None
        r["tokens_to_target"] = hit["tokens"] if hit else None
        r["seconds_to_target"] = hit["seconds"] if hit else None
    by = {r["name"]: r for r in rows}
    # Issue 14's wall-time measure: each variant's time to the Trainer's final val loss, over the Trainer's whole
    # run (its total, start-up included).
    hf = by.get("hf")
    hf_final = hf.get("final_val_loss") if hf and hf.get("status") in ("ok", "reused") else None
    for r in rows:
        hit = time_to_target(r.get("curve", []), hf_final)
        r["to_hf_final"] = (
            None
            if hf_final is None
            else {
                "val_loss": hf_final,
                "tokens": hit["tokens"] if hit else None,
                "seconds": hit["seconds"] if hit else None,
                "vs_hf_total": _ratio(hit["seconds"], hf.get("total_seconds")) if hit else None,
            }
        )
    for r in rows:
        for base in BASES:
            b = by.get(base)
            if b is None or b.get("curve") is None:
                r[f"vs_{base}"] = None
                continue
            r[f"vs_{base}"] = {
                "speedup": _ratio(b.get("seconds_to_target"), r.get("seconds_to_target")),
                "token_efficiency": _ratio(b.get("tokens_to_target"), r.get("tokens_to_target")),
                "throughput": _ratio(r.get("tokens_per_s"), b.get("tokens_per_s")),
            }


def _fmt(v: Any, spec: str = "") -> str:
    if v is None:
        return "-"
    return format(v, spec) if spec else str(v)


def table(rows: list[dict], target: float | None) -> str:
    head = (
        f"{'variant':<10} {'status':<10} {'final val':>9} {'tokens→target':>14} {'s→target':>9} "
        f"{'total s':>8} {'start s':>7} {'tok/s':>9} {'train tok/s':>11} "
        f"{'speedup vs adamw/hf':>20} {'token eff. vs adamw/hf':>22}"
    )
    lines = [f"target val loss: {_fmt(target, '.4f')}", head, "-" * len(head)]
    for r in rows:
        sp = "/".join(_fmt((r.get(f"vs_{b}") or {}).get("speedup"), ".2f") for b in BASES)
        te = "/".join(_fmt((r.get(f"vs_{b}") or {}).get("token_efficiency"), ".2f") for b in BASES)
        lines.append(
            f"{r['name']:<10} {r['status'][:10]:<10} {_fmt(r.get('final_val_loss'), '.4f'):>9} "
            f"{_fmt(r.get('tokens_to_target'), ','):>14} {_fmt(r.get('seconds_to_target'), '.1f'):>9} "
            f"{_fmt(r.get('total_seconds'), '.1f'):>8} {_fmt(r.get('startup_seconds'), '.1f'):>7} "
            f"{_fmt(r.get('tokens_per_s'), ',.0f'):>9} {_fmt(r.get('train_tokens_per_s'), ',.0f'):>11} "
            f"{sp:>20} {te:>22}"
        )
    hf = next((r for r in rows if r["name"] == "hf" and r.get("to_hf_final")), None)
    if hf is not None:
        reach = [
            f"{r['name']} at {r['to_hf_final']['seconds']:.1f} s "
            f"({_fmt(r['to_hf_final']['vs_hf_total'], '.2f')}x the Trainer's whole run)"
            if r["to_hf_final"]["seconds"] is not None
            else f"{r['name']} never"
            for r in rows
            if r.get("to_hf_final") and r["name"] != "hf"
        ]
        lines.append(
            f"the Trainer's final val loss {hf['to_hf_final']['val_loss']:.4f} (its whole run "
            f"{_fmt(hf.get('total_seconds'), '.1f')} s) reached by: " + (", ".join(reach) or "-")
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    if a.hf_worker:
        hf_worker(a.hf_worker)
        return {}
    out = Path(a.out)
    results_path = out / "results.json"
    if out.suffix == ".json":
        out, results_path = out.parent, out
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    results_path = results_path.resolve()
    table_of = variant_table(a.define)
    names = [n.strip() for n in a.variants.split(",") if n.strip()]
    unknown = [n for n in names if n not in table_of]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; known: {', '.join(table_of)} (more with --define)")

    tokens_per_step = a.batch_size * a.block_size * a.grad_accum
    steps = max(1, math.ceil(a.max_tokens / tokens_per_step))  # train's rule for --max_tokens
    if a.eval_every is None:
        a.eval_every = max(1, steps // EVALS_PER_RUN)
    common = common_args(a, a.eval_every)
    settings = settings_of(a)
    base_cfg = load_variant_config(BUILTIN["adamw"], common)
    print(
        f"time to loss: {a.model}/{a.size} on {a.data} ({a.tokenizer}), {a.batch_size} x {a.block_size} x "
        f"accumulation {a.grad_accum} = {tokens_per_step:,} tokens per step, {steps:,} steps = "
        f"{steps * tokens_per_step:,} tokens, an evaluation every {a.eval_every} steps",
        flush=True,
    )
    t_prep = time.time()
    data, margs = prepare_shards(base_cfg)
    print(
        f"shards: {data.manifest.dir} ({data.manifest.train_tokens:,} train tokens, "
        f"{data.manifest.val_tokens:,} held out; {time.time() - t_prep:.1f} s)",
        flush=True,
    )

    rows: list[dict] = []
    for name in names:
        v = table_of[name]
        record_path = out / f"{name}.record.json"
        vsettings = json.loads(json.dumps({**settings, "variant": asdict(v)}))  # as a record reads back
        if a.reuse and record_path.exists():
            rec = json.loads(record_path.read_text())
            if rec.get("settings") == vsettings and rec.get("status") in ("ok", "timeout"):
                print(f"{name}: reused {record_path}", flush=True)
                rows.append({**rec, "status": "reused" if rec["status"] == "ok" else rec["status"]})
                continue
        row: dict[str, Any]
        if v.hf:
            if a.model != "llama":
                print(
                    f"skip {name}: the transformers baseline is LlamaForCausalLM (--model llama)", flush=True
                )
                rows.append({"name": name, "status": "skipped", "reason": "needs --model llama"})
                continue
            try:
                import transformers  # noqa: F401
            except ImportError:
                print(f"skip {name}: transformers is not installed", flush=True)
                rows.append({"name": name, "status": "skipped", "reason": "transformers not installed"})
                continue
            print(f"{name}: transformers Trainer, LlamaForCausalLM ...", flush=True)
            row = run_hf(a, base_cfg, data, margs, steps, a.eval_every, out)
        else:
            from gptoughts.errors import ConfigError

            try:
                cfg = load_variant_config(v, common)
            except ConfigError as e:
                print(f"skip {name}: {e}", flush=True)
                rows.append({"name": name, "status": "skipped", "reason": str(e)})
                continue
            if asdict(cfg.data) != asdict(base_cfg.data) or cfg.train.seed != base_cfg.train.seed:
                reason = "its data settings differ from the others' (other shards)"
                print(f"skip {name}: {reason}", flush=True)
                rows.append({"name": name, "status": "skipped", "reason": reason})
                continue
            what = shlex.join(([v.preset] if v.preset else []) + list(v.args)) or "(our defaults)"
            print(f"{name}: gptoughts train {what} ...", flush=True)
            row = run_gptoughts(v, a, common, out)
        row = {"name": name, **row, "settings": vsettings}
        row["same_shards"] = row.get("data") == str(data.manifest.dir)
        if row.get("epochs") is None and row.get("tokens"):  # the hf worker has no plan of its own
            row["epochs"] = row["tokens"] / max(1, data.manifest.train_tokens)
        if row["status"] == "ok" and not row["same_shards"]:
            print(f"warning: {name} read {row.get('data')}, not {data.manifest.dir}", flush=True)
        if row["status"] == "ok" and row.get("steps") != steps:
            print(f"warning: {name} ran {row.get('steps')} steps, not {steps}", flush=True)
        print(
            f"{name}: {row['status']}, final val loss {_fmt(row.get('final_val_loss'), '.4f')}, "
            f"{row['total_seconds']:.1f} s (log: {out / (name + '.log')})",
            flush=True,
        )
        if row["status"] != "ok":
            tail = (out / f"{name}.log").read_text(errors="replace").splitlines()[-15:]
            print("\n".join(f"  | {line}" for line in tail), flush=True)
        record_path.write_text(json.dumps(row, indent=1))
        rows.append(row)

    if a.reuse:  # the other variants recorded here under the same settings (e.g. adamw, for the target)
        have = {r["name"] for r in rows}
        for p in sorted(out.glob("*.record.json")):
            rec = json.loads(p.read_text())
            name = rec.get("name")
            if name in have or rec.get("status") not in ("ok", "timeout"):
                continue
            if rec.get("settings", {}).get("variant", {}).get("name") != name:
                continue
            if {k: v for k, v in rec["settings"].items() if k != "variant"} == settings:
                rows.append({**rec, "status": "reused" if rec["status"] == "ok" else rec["status"]})

    by = {r["name"]: r for r in rows}
    target, source = a.target, "--target"
    if target is None:
        adamw = by.get("adamw")
        target = adamw.get("final_val_loss") if adamw else None
        source = "adamw's final val loss" if target is not None else "none (no adamw run; give --target)"
        if adamw and target is not None and adamw.get("status") == "timeout":
            source = "adamw's last val loss (it was stopped by --timeout)"
    finish(rows, target)
    results = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(argv),
        "device": next((r.get("device") for r in rows if r.get("device")), None),
        "settings": settings,
        "tokens_per_step": tokens_per_step,
        "steps": steps,
        "tokens": steps * tokens_per_step,
        "shards": str(data.manifest.dir),
        "train_tokens": data.manifest.train_tokens,
        "val_tokens": data.manifest.val_tokens,
        "target": target,
        "target_source": source,
        "clock": "each variant a fresh process timed from just before its launch (imports, build, compile and "
        "evaluations included); time to target = the metrics.jsonl `time` of its first val_loss row <= target "
        "minus the launch time",
        "variants": rows,
    }
    results_path.write_text(json.dumps(results, indent=1))
    print(table(rows, target))
    print(f"results: {results_path}")
    return results


if __name__ == "__main__":
    main()
