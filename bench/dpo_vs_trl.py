"""LoRA DPO: gptoughts (`gptoughts finetune --objective dpo --lora` path) vs TRL's DPOTrainer + PEFT, one process.

Both sides train the same random ``LlamaForCausalLM`` (made and saved by transformers, bench/finetune_vs_peft.py's
``make_model_dir``; ``--size 1b`` is the Llama-3.2-1B shape) on the same synthetic preference pairs with the same
settings: bf16 base weights (fp32 on CPU), LoRA r16 alpha 32 dropout 0 on q/k/v/o/gate/up/down, the sigmoid loss
with beta 0.1, the reference = the base with its adapters disabled (no precomputed log-probabilities), ``--batch``
pairs per step, no accumulation, the same constant learning rate, grad clip 1.0, no evaluation or logging to disk.
Activation checkpointing as each ships: ours as `gptoughts finetune` resolves it, TRL's ``gradient_checkpointing``
default (on; ``--trl_gradient_checkpointing false`` times it off). ``--variants`` times ours with more overrides.

The data: every row (prompt + completion, chosen or rejected) is exactly ``--seq`` tokens, so nothing is truncated
on either side and both run ``[2 x batch, seq]`` rows. Ours reads the JSONL as ``gptoughts finetune`` does
(data/prefs.py, the default chat template); TRL gets the very same token ids (prompt_ids / chosen_ids /
rejected_ids rebuilt from our rows; its own text tokenization, data preparation only, is skipped). Tokens/s counts
the tokens of both rows of each pair, the same count for both sides.

Ours is timed through the trainer's own ``train_step`` (one device sync around the timed steps, the batch's
host-to-device copy included); TRL through a ``TrainerCallback`` (sync at ``on_step_begin`` / ``on_step_end``, its
data loading outside). Peak memory: ``torch.cuda.max_memory_allocated`` from after the model load to the last step.
Then the reference log-probabilities (adapters disabled) of the first ``--batch`` pairs from both are compared.

    python bench/dpo_vs_trl.py --size 1b --seq 1024 --batch 4 --out results.json          # GPU target
    python bench/dpo_vs_trl.py --size tiny --device cpu --steps 2 --warmup 1 --out /tmp/dpo.json  # smoke
    python bench/dpo_vs_trl.py --size 1b --seq 1024 --batch 4 --variants '[{"dpo.head": "fused"}, {"dpo.head": "chunked"}]'  # the heads

TRL's wheels (the GPU machine has transformers, peft, accelerate, not trl or datasets): trl==1.16.0 datasets==5.2.0
and what datasets needs (pyarrow, pandas, dill, multiprocess, xxhash), ``pip install --no-deps --target .peer``;
run with PYTHONPATH=.:.peer. A side out of GPU memory is recorded under "failed"; the other still runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import string
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from finetune_vs_peft import SIZES, TARGETS, _peak_gib, _reset, _sync, make_model_dir, time_steps  # noqa: E402

from gptoughts.perf.ce import IGNORE_INDEX  # noqa: E402

# issue 34's targets: tokens/s ours/TRL >= 2x, peak memory ours/TRL <= 0.6x
SPEED_TARGET, MEMORY_TARGET = 2.0, 0.6
TEXT = string.ascii_lowercase + " "


def ref_tolerance(precision: str) -> float:
    """Largest relative difference of a summed reference log-probability accepted as the same value. bf16 keeps 8
    significant bits (a rounding of 2^-9 relative); two implementations that round in different places (fused
    norms, attention kernels, the LM head in tiles or not) differ by a few roundings per token, and a sum of
    same-sign terms keeps that relative size: 2^-7 allows four. fp32 (CPU): only summation order differs."""
    return 2.0**-7 if precision == "bf16" else 1e-4


# ------------------------------------------------------------------------------------------ the data


def template_overhead(tokenizer: Any) -> int:
    """Tokens the chat rendering adds around a one-token prompt and a one-token completion."""
    from gptoughts.data.sft import encode_conversations

    conv = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    ((ids, _),) = encode_conversations([conv], tokenizer)
    return len(ids) - 2


def write_prefs(path: Path, pairs: int, seq: int, overhead: int, seed: int = 0) -> Path:
    """``pairs`` lines of random lowercase text whose rendered rows (prompt + completion) are ``seq`` tokens each
    with a tokenizer of one token per character: the prompt takes a quarter to a half of the row, chosen and
    rejected (different text) the rest."""
    if seq - overhead - seq // 2 < 1:
        raise SystemExit(f"--seq {seq} is too short: the chat rendering alone takes {overhead} tokens")
    rng = random.Random(seed)
    lines = []
    for _ in range(pairs):
        p = rng.randint(max(1, seq // 4), seq // 2)
        c = seq - overhead - p
        prompt, chosen, rejected = ("".join(rng.choices(TEXT, k=k)) for k in (p, c, c))
        lines.append(json.dumps({"prompt": prompt, "chosen": chosen, "rejected": rejected}))
    path.write_text("\n".join(lines) + "\n")
    return path


def read_prefs(path: Path, tokenizer: Any, seq: int) -> Any:
    """Our PrefData of the file, checked: every row exactly ``seq`` tokens, nothing truncated or dropped."""
    from gptoughts.data.prefs import PrefData

    prefs = PrefData([str(path)], tokenizer, block_size=seq, truncation="drop")
    s = prefs.stats
    lengths = {len(x) + 1 for x, _ in prefs.rows}
    if s["truncated"] or s["dropped_too_long"] or s["dropped_no_target"] or lengths != {seq}:
        raise SystemExit(
            f"the synthetic pairs are not {seq} tokens a row: {s}, row lengths {sorted(lengths)}"
        )
    return prefs


def trl_examples(prefs: Any) -> list[dict[str, list[int]]]:
    """Our rows as TRL's tokenized examples: ``prompt_ids`` and each completion's ids (its last span of targets,
    the rendered completion and its end-of-turn token), the same tokens in the same order."""
    out = []
    for i in range(len(prefs)):
        split = []
        for x, y in prefs.rows[2 * i : 2 * i + 2]:
            targets = np.flatnonzero(y != IGNORE_INDEX)
            if y[-1] == IGNORE_INDEX or len(targets) != targets[-1] - targets[0] + 1:
                raise SystemExit("a row's completion is not one span at its end: not comparable with TRL")
            ids = np.append(x, y[-1]).tolist()  # the last target is the sequence's last token
            split.append((ids[: targets[0] + 1], ids[targets[0] + 1 :]))
        (prompt, chosen), (prompt_r, rejected) = split
        if prompt != prompt_r:
            raise SystemExit("chosen and rejected of a pair render different prompts")
        out.append({"prompt_ids": prompt, "chosen_ids": chosen, "rejected_ids": rejected})
    return out


def our_pair_tokens(prefs: Any) -> list[int]:
    """Tokens of each pair's two rows as our trainer sees them (inputs plus the last target)."""
    return [len(prefs.rows[2 * i][0]) + len(prefs.rows[2 * i + 1][0]) + 2 for i in range(len(prefs))]


def trl_pair_tokens(examples: list[dict[str, list[int]]]) -> list[int]:
    """Tokens of each pair's two rows as TRL's collator builds them (prompt + chosen, prompt + rejected)."""
    return [2 * len(e["prompt_ids"]) + len(e["chosen_ids"]) + len(e["rejected_ids"]) for e in examples]


# ------------------------------------------------------------------------------------------ the sides


def _reserved_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_reserved(device) / 2**30 if device.type == "cuda" else None


def run_ours(
    model_dir: Path,
    prefs_path: Path,
    prefs: Any,
    a: argparse.Namespace,
    device: torch.device,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Our LoRA-DPO step, assembled as `gptoughts finetune --objective dpo --lora` assembles it; ``extra``: more
    config overrides (a lever to time)."""
    from gptoughts.config import load_config
    from gptoughts.data.prefs import PrefLoader
    from gptoughts.training.batches import plan_batches
    from gptoughts.training.components import timing_trainer
    from gptoughts.training.corpus import prepare_data
    from gptoughts.training.environment import setup_environment
    from gptoughts.training.modeling import build_model

    overrides = {
        "model.init_from": str(model_dir),
        "train.objective": "dpo",
        "data.sources": [str(prefs_path)],
        "data.val_fraction": 0.0,
        "lora.enabled": True,
        "lora.r": a.r,
        "lora.alpha": a.alpha,
        "lora.dropout": 0.0,
        "dpo.beta": a.beta,
        "dpo.reference": "adapters_off",
        "train.block_size": a.seq,
        "train.batch_size": a.batch,
        "train.learning_rate": a.lr,
        "train.grad_clip": 1.0,
        "perf.device": str(device),
        "perf.precision": a.precision,
        "perf.compile": a.compile,
        "run.progress": False,
        "run.tensorboard": False,
        **(extra or {}),
    }
    cfg = load_config("finetune", overrides)
    env = setup_environment(cfg)
    data = prepare_data(cfg, env)
    if len(data.prefs.rows) != len(prefs.rows) or not all(
        np.array_equal(p[0], q[0]) and np.array_equal(p[1], q[1]) for p, q in zip(data.prefs.rows, prefs.rows)
    ):
        raise SystemExit("our run read other tokens than the ones given to TRL")
    if a.peak_sites and device.type == "cuda":
        torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    model = build_model(cfg, env, data)
    _reset(device)  # after the model load, as on TRL's side
    loader = PrefLoader(data.prefs, batch_size=a.batch, seed=cfg.train.seed, device=env.device)
    trainer = timing_trainer(cfg, env, model, loader, plan_batches(cfg, env, data, model), timing=False)

    saved: dict[int, tuple[int, str]] = {}

    # what the autograd graph keeps: distinct storages, counted once
    def tally(t: torch.Tensor) -> torch.Tensor:
        saved.setdefault(t.untyped_storage().data_ptr(), (t.untyped_storage().nbytes(), str(tuple(t.shape))))
        return t

    def saved_by_shape() -> dict[str, Any]:
        by: dict[str, list[float]] = {}
        for nbytes, shape in saved.values():
            row = by.setdefault(shape, [0.0, 0])
            row[0] += nbytes / 2**30
            row[1] += 1
        top = sorted(by.items(), key=lambda kv: -kv[1][0])[:10]
        return {"saved_tensors_gib": sum(n for n, _ in saved.values()) / 2**30, "saved_by_shape": dict(top)}

    def step() -> torch.Tensor:
        if not a.saved_tensors:
            loss_sum, n, _ = trainer.train_step()
            return loss_sum / n
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(tally, lambda t: t):
            loss_sum, n, _ = trainer.train_step()
        return loss_sum / n

    for _ in range(a.warmup):  # compilation and the allocator's growth
        step()
    warm_peak, warm_reserved = _peak_gib(device), _reserved_gib(device)
    if device.type == "cuda":  # the timed steps' own peak too: is the run's peak a warm-up one?
        torch.cuda.reset_peak_memory_stats(device)
    step_s, loss = time_steps(step, device, 0, a.steps)
    steady, steady_reserved = _peak_gib(device), _reserved_gib(device)
    peak = None if steady is None else max(warm_peak, steady)
    sites = None
    if a.peak_sites and device.type == "cuda":
        from oom_snapshot import at_peak

        sites = at_peak(torch.cuda.memory._snapshot(), top=a.peak_sites)
        torch.cuda.memory._record_memory_history(enabled=None)
        print(f"ours {extra or {}}: {sites}", flush=True)
    x, _, y = data.prefs.batch(np.arange(a.batch), env.device)
    with trainer.autocast():
        ref = model.objective.reference_logps(trainer.model, x, y).float().cpu()
    return {
        "step_ms": step_s * 1e3,
        "tokens_per_s": a.pair_tokens * a.batch / step_s,
        "peak_memory_gib": peak,
        "steady_peak_memory_gib": steady,
        # CUDA graphs replay without the allocator: their activations show in the reserved pool, not in allocated
        "peak_reserved_gib": None if steady_reserved is None else max(warm_reserved, steady_reserved),
        "steady_peak_reserved_gib": steady_reserved,
        **(saved_by_shape() if a.saved_tensors else {}),
        "trainable_params": sum(p.numel() for p in model.raw.parameters() if p.requires_grad),
        "loss": loss,
        "ref_logps": ref.tolist(),
        "resolved": {k: str(v) for k, v in model.built.resolved.items()},
        "dpo_head": {k: getattr(model.objective, k) for k in ("head", "chunk_rows", "chunk_tokens")},
        "overrides": extra or {},
        **({"peak_sites": sites} if sites else {}),
    }


def _trl_config(a: argparse.Namespace, device: torch.device, out_dir: str) -> Any:
    from trl import DPOConfig

    return DPOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=a.batch,
        gradient_accumulation_steps=1,
        max_steps=a.warmup + a.steps,
        learning_rate=a.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch_fused" if device.type == "cuda" else "adamw_torch",
        bf16=a.precision == "bf16",
        fp16=False,
        use_cpu=device.type == "cpu",
        gradient_checkpointing=a.trl_gradient_checkpointing,
        beta=a.beta,
        loss_type=["sigmoid"],
        precompute_ref_log_probs=False,
        max_length=a.seq,  # every row is exactly seq tokens: nothing cut
        eval_strategy="no",
        save_strategy="no",
        logging_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )


def run_trl(
    model_dir: Path, examples: list[dict[str, list[int]]], a: argparse.Namespace, device: torch.device
) -> dict[str, Any]:
    """TRL's DPOTrainer with a PEFT LoraConfig, timed by a callback around each optimizer step."""
    import peft
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOTrainer

    class Pretokenized(DPOTrainer):
        """The examples arrive as token ids (ours): TRL's text tokenization is skipped, nothing else."""

        def _prepare_dataset(self, dataset, *args, **kwargs):  # noqa: ANN001, ANN202
            return dataset

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.seconds: list[float] = []
            self.t0 = 0.0

        def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
            _sync(device)
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
            _sync(device)
            self.seconds.append(time.perf_counter() - self.t0)

    dtype = torch.bfloat16 if a.precision == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, attn_implementation="sdpa")
    model = model.to(device)
    _reset(device)  # after the model load, as on our side
    lora = peft.LoraConfig(
        r=a.r,
        lora_alpha=a.alpha,
        lora_dropout=0.0,
        target_modules=TARGETS,
        bias="none",
        task_type="CAUSAL_LM",
    )
    timer = StepTimer()
    with tempfile.TemporaryDirectory(prefix="trl-out-") as out_dir:
        trainer = Pretokenized(
            model=model,
            args=_trl_config(a, device, out_dir),
            train_dataset=Dataset.from_list(examples),
            processing_class=AutoTokenizer.from_pretrained(str(model_dir)),
            peft_config=lora,
            callbacks=[timer],
        )
        result = trainer.train()
    step_s = sum(timer.seconds[a.warmup :]) / max(1, len(timer.seconds) - a.warmup)
    peak = _peak_gib(device)
    batch = {k: v.to(device) for k, v in trainer.data_collator(examples[: a.batch]).items()}
    chosen, rejected = trainer.compute_ref_log_probs(trainer.model, batch)
    ref = torch.stack([chosen, rejected], dim=1).float().cpu()
    out = {
        "step_ms": step_s * 1e3,
        "tokens_per_s": a.pair_tokens * a.batch / step_s,
        "peak_memory_gib": peak,
        "peak_reserved_gib": _reserved_gib(device),
        "trainable_params": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
        "loss": float(result.training_loss),  # TRL's mean over all its steps
        "ref_logps": ref.tolist(),
        "gradient_checkpointing": a.trl_gradient_checkpointing,
    }
    del trainer, model
    gc.collect()
    return out


# ------------------------------------------------------------------------------------------ the comparison


def compare_ref(ours: list[list[float]], theirs: list[list[float]], tol: float) -> dict[str, Any]:
    """Max absolute and relative difference of the reference log-probabilities [pairs, (chosen, rejected)]."""
    o, t = torch.tensor(ours, dtype=torch.float64), torch.tensor(theirs, dtype=torch.float64)
    diff = (o - t).abs()
    rel = float((diff / t.abs().clamp_min(1e-12)).max())
    return {
        "max_abs_diff": float(diff.max()),
        "max_rel_diff": rel,
        "logratio_max_abs_diff": float(((o[:, 0] - o[:, 1]) - (t[:, 0] - t[:, 1])).abs().max()),
        "tolerance_rel": tol,
        "within_tolerance": rel <= tol,
    }


def report(res: dict[str, Any], a: argparse.Namespace) -> None:
    print(f"LoRA DPO, Llama {a.size}, seq {a.seq}, {a.batch} pairs/step, {res['device']}, {a.precision}")
    print(f"{'':<14}{'tokens/s':>12}{'step ms':>10}{'peak GiB':>10}{'loss':>8}")
    for name, r in res["runs"].items():
        mem = f"{r['peak_memory_gib']:.2f}" if r["peak_memory_gib"] is not None else "-"
        print(
            f"{name:<14}{r['tokens_per_s']:>12,.0f}{r['step_ms']:>10.1f}{mem:>10}{r['loss']:>8.4f}  "
            f"{r.get('overrides') or ''}"
        )
    for name, why in res.get("failed", {}).items():
        print(f"{name:<14}FAILED {why}")
    if "speedup" not in res:
        return
    mem_ratio = f"{res['memory_ratio']:.2f}x" if "memory_ratio" in res else "n/a (no CUDA)"
    print(
        f"speed ours/trl {res['speedup']:.2f}x (target >= {SPEED_TARGET}x), memory ours/trl {mem_ratio} "
        f"(target <= {MEMORY_TARGET}x)"
    )
    r = res["ref_logps"]
    print(
        f"reference log-probs of {a.batch} pairs: max |diff| {r['max_abs_diff']:.4g}, max rel "
        f"{r['max_rel_diff']:.3g} (tolerance {r['tolerance_rel']:.3g}: "
        f"{'ok' if r['within_tolerance'] else 'NOT within'}), log-ratio max |diff| {r['logratio_max_abs_diff']:.4g}"
    )


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="1b", choices=sorted(SIZES))
    p.add_argument("--seq", type=int, default=1024, help="tokens of every row (prompt + completion)")
    p.add_argument("--batch", type=int, default=4, help="preference pairs per step (2 rows each)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--r", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--device", default="auto")
    p.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp32"], help="auto: bf16 on CUDA")
    p.add_argument("--compile", default="auto", help="ours: perf.compile (auto = on for CUDA)")
    p.add_argument(
        "--trl_gradient_checkpointing",
        type=lambda s: s.lower() in ("1", "true", "yes", "on"),
        default=True,
        help="TRL's gradient_checkpointing (DPOConfig's default: true)",
    )
    p.add_argument(
        "--variants",
        default=None,
        help='ours: JSON list of extra config overrides, each timed as "ours+<i>", e.g. \'[{"dpo.head": "fused"}]\'',
    )
    p.add_argument("--model_dir", default=None, help="reuse/keep the saved random model here")
    p.add_argument("--order", default="trl,ours", help="which side runs first")
    p.add_argument(
        "--peak_sites",
        type=int,
        default=0,
        help="CUDA: record our runs' allocations and print this many sites "
        "live at the peak (slower steps: not for timing)",
    )
    p.add_argument(
        "--saved_tensors",
        action="store_true",
        help="ours: tally the bytes the autograd graph saves in the last step (weights included; not for timing)",
    )
    p.add_argument("--out", default=None, help="write the results as JSON here")
    a = p.parse_args(argv)
    if a.steps < 1 or a.warmup < 0 or a.batch < 1:
        p.error("--steps and --batch must be >= 1, --warmup >= 0")
    if sorted(a.order.split(",")) not in (["ours", "trl"], ["ours"]):
        p.error(f"--order must name ours and trl once each (e.g. trl,ours), or ours alone; got {a.order!r}")
    return a


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from gptoughts.data.tokenizer import build_tokenizer
    from gptoughts.perf import hardware

    a = parse(argv)
    device = hardware.resolve_device(a.device)
    if a.precision == "auto":
        a.precision = "bf16" if device.type == "cuda" else "fp32"
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    tmp = tempfile.TemporaryDirectory(prefix="dpo-bench-")
    model_dir = make_model_dir(
        a.size,
        a.seq,
        torch.bfloat16 if a.precision == "bf16" else torch.float32,
        device,
        Path(a.model_dir or tmp.name),
    )
    tokenizer = build_tokenizer(str(model_dir))
    prefs_path = write_prefs(
        Path(tmp.name) / "prefs.jsonl", (a.warmup + a.steps) * a.batch, a.seq, template_overhead(tokenizer)
    )
    prefs = read_prefs(prefs_path, tokenizer, a.seq)
    examples = trl_examples(prefs)
    ours_tokens, trl_tokens = our_pair_tokens(prefs), trl_pair_tokens(examples)
    if ours_tokens != trl_tokens or len(set(ours_tokens)) != 1:
        raise SystemExit("the two sides would count different tokens, or pairs differ in length")
    a.pair_tokens = ours_tokens[0]
    res: dict[str, Any] = {
        "size": a.size,
        "seq": a.seq,
        "pairs_per_step": a.batch,
        "tokens_per_pair": a.pair_tokens,
        "steps": a.steps,
        "warmup": a.warmup,
        "device": hardware.detect(device).name,
        "precision": a.precision,
        "lora_r": a.r,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "runs": {},
    }
    jobs: list[tuple[str, Any]] = []
    for side in a.order.split(","):
        if side == "trl":
            jobs.append(("trl", lambda: run_trl(model_dir, examples, a, device)))
            continue
        jobs.append(("gptoughts", lambda: run_ours(model_dir, prefs_path, prefs, a, device)))
        for i, extra in enumerate(json.loads(a.variants or "[]")):
            jobs.append((f"ours+{i}", lambda e=extra: run_ours(model_dir, prefs_path, prefs, a, device, e)))
    for name, job in jobs:
        try:
            res["runs"][name] = job()
        except Exception as e:  # noqa: BLE001 - recorded (out of memory, a bad variant): the others still run
            if name in ("trl", "gptoughts") and not isinstance(e, torch.OutOfMemoryError):
                raise
            res.setdefault("failed", {})[name] = repr(e)[:300]
            gc.collect()
    if {"trl", "gptoughts"} <= res["runs"].keys():
        compare(res, a)
    report(res, a)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=2, default=str))
    tmp.cleanup()
    return res


def compare(res: dict[str, Any], a: argparse.Namespace) -> None:
    """The ratios against the targets and the reference log-probabilities' agreement."""
    ours, trl = res["runs"]["gptoughts"], res["runs"]["trl"]
    res["speedup"] = ours["tokens_per_s"] / trl["tokens_per_s"]
    if ours["peak_memory_gib"] and trl["peak_memory_gib"]:
        res["memory_ratio"] = ours["peak_memory_gib"] / trl["peak_memory_gib"]
    res["speedups"] = {
        k: r["tokens_per_s"] / trl["tokens_per_s"] for k, r in res["runs"].items() if k != "trl"
    }
    res["ref_logps"] = compare_ref(ours["ref_logps"], trl["ref_logps"], ref_tolerance(a.precision))
    res["meets_targets"] = {
        f"speed >= {SPEED_TARGET}x": res["speedup"] >= SPEED_TARGET,
        f"memory <= {MEMORY_TARGET}x": res.get("memory_ratio", float("nan")) <= MEMORY_TARGET,
        "reference log-probs equal": res["ref_logps"]["within_tolerance"],
    }


if __name__ == "__main__":
    # Before huggingface_hub is imported (it reads them once): no hub look-up, no telemetry ping from TRL.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    main()
