"""``gptoughts bench``: tokens/s, MFU, peak memory and the step breakdown of one configuration, optionally
side by side with ``transformers`` (``LlamaForCausalLM``, eager and compiled) on the same shape, in one run.

The timed step is the trainer's own ``train_step`` (same precision handling, fused AdamW, gradient clipping and
accumulation), so what bench reports is what ``train`` runs.
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from gptoughts import models
from gptoughts.config import Config
from gptoughts.errors import ConfigError


class SyntheticBatches:
    """Random token windows generated once on the device: the data never waits (pure model speed)."""

    def __init__(
        self,
        vocab_size: int,
        batch_size: int,
        block_size: int,
        device: torch.device,
        seed: int = 0,
        pool: int = 8,
    ):
        g = torch.Generator(device="cpu").manual_seed(seed)
        data = torch.randint(0, vocab_size, (pool, batch_size, block_size + 1), generator=g)
        self.batches = [(d[:, :-1].to(device), d[:, 1:].to(device)) for d in data]
        self.i = 0

    def __iter__(self) -> Iterator:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        b = self.batches[self.i % len(self.batches)]
        self.i += 1
        return b

    def state_dict(self) -> dict:
        return {"i": self.i}

    def close(self) -> None:
        pass


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak_memory(device: torch.device) -> float | None:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return None


def time_steps(step_fn, device: torch.device, warmup: int, steps: int) -> float:
    """Seconds per step: warm-up (compilation, allocator growth) excluded, one sync around the timed steps."""
    for _ in range(warmup):
        step_fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step_fn()
    _sync(device)
    return (time.perf_counter() - t0) / steps


def profile_steps(step_fn, device: torch.device, steps: int) -> dict[str, Any] | None:
    """GPU time per step by kernel category over ``steps`` profiled steps (None off CUDA)."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    from gptoughts.perf.timing import summarize_profile

    _sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step_fn()
        _sync(device)
        wall = time.perf_counter() - t0
    out = summarize_profile(prof, steps)
    out["step_ms_profiled"] = wall * 1e3 / steps
    return out


def run_bench(
    cfg: Config,
    *,
    steps: int = 20,
    warmup: int = 5,
    compare: str | None = None,
    data_dir: str | None = None,
    hf_modes: tuple[str, ...] = ("eager", "compiled"),
    kernel_steps: int = 0,
) -> dict[str, Any]:
    from gptoughts.train.build import (
        build_model,
        plan_batches,
        setup_environment,
        synthetic_data,
        timing_trainer,
    )

    env = setup_environment(cfg)
    device, hw, precision = env.device, env.hw, env.precision
    family = models.get_family(cfg.model.family)
    vocab = int(models.model_args(family.name, cfg.model.size, dict(cfg.model.overrides)).vocab_size)
    _reset_memory(device)
    data = synthetic_data(vocab)
    model = build_model(cfg, env, data)  # the train assembly's own step: transforms in their one order
    batch = plan_batches(cfg, env, data, model)  # batch_size = auto: the same search as train
    t = replace(cfg.train, batch_size=batch.micro_batch, grad_accum=batch.grad_accum)
    if data_dir is not None:
        from gptoughts.data.loader import BatchLoader, TokenDataset

        loader: Any = BatchLoader(
            TokenDataset(data_dir),
            split="train",
            batch_size=t.batch_size,
            block_size=t.block_size,
            seed=t.seed,
            device=device,
        )
    else:
        loader = SyntheticBatches(vocab, t.batch_size, t.block_size, device, seed=t.seed)
    trainer = timing_trainer(cfg, env, model, loader, batch)
    # The breakdown comes from the CUDA events of the timed steps themselves (they cost nothing measurable), and
    # what the events do not cover (host time between steps) is reported as "other": the parts add up to the
    # headline step time.
    for _ in range(warmup):
        trainer.train_step()
    trainer.timer.pending.clear()
    step_s = time_steps(trainer.train_step, device, 0, steps)
    breakdown = _breakdown(trainer.timer.summary(), step_s * 1e3)
    kernels = profile_steps(trainer.train_step, device, kernel_steps) if kernel_steps > 0 else None
    tokens_per_step = batch.tokens_per_step
    tps = tokens_per_step / step_s
    raw, args = model.raw, model.args
    flops_tok = raw.flops_per_token(t.block_size)
    peak = hw.peak_bf16_flops
    result: dict[str, Any] = {
        "family": family.name,
        "size": cfg.model.size,
        "device": hw.name,
        "precision": precision,
        "compile": cfg.perf.compile,
        "batch_size": t.batch_size,
        "block_size": t.block_size,
        "grad_accum": t.grad_accum,
        "params": raw.num_params(),
        "params_non_embedding": raw.num_params(True),
        "flops_per_token": flops_tok,
        "step_ms": step_s * 1e3,
        "tokens_per_s": tps,
        "mfu": (flops_tok * tps / peak) if peak else None,
        "peak_memory_gib": _peak_memory(device),
        "breakdown": breakdown,
        "data": "shards" if data_dir else "synthetic",
    }
    result["resolved"] = {**model.built.resolved, **batch.why}
    if kernels is not None:
        result["kernels"] = kernels
    loader.close()
    del trainer, model, raw, loader
    _reset_memory(device)

    if compare == "hf":
        result["hf"] = {}
        for mode in hf_modes:
            if mode == "compiled" and not (hw.compile and result["resolved"].get("compile")):
                continue  # like with like: transformers is compiled only when our side is
            r = bench_hf(
                args,
                t.batch_size,
                t.block_size,
                t.grad_accum,
                device,
                precision,
                mode=mode,
                steps=steps,
                warmup=warmup,
                seed=t.seed,
            )
            r["mfu"] = (flops_tok * r["tokens_per_s"] / peak) if peak else None
            r["speedup"] = tps / r["tokens_per_s"]
            result["hf"][mode] = r
            _reset_memory(device)
    elif compare is not None:
        raise ConfigError(f"--compare {compare!r}: only `hf` is supported")
    return result


def _breakdown(events: dict[str, float], step_ms: float) -> dict[str, float]:
    """The per-phase means of the timed steps, with the time their events do not cover added to "other", as
    shares of the measured step (so the parts sum to the headline step time)."""
    if not events:
        return {}
    from gptoughts.perf.timing import PHASES

    out = {f"time/{k}_ms": events.get(f"time/{k}_ms", 0.0) for k in PHASES}
    out["time/other_ms"] += max(0.0, step_ms - sum(out.values()))
    out["time/step_ms"] = step_ms
    for k in PHASES:
        out[f"time/{k}_pct"] = 100.0 * out[f"time/{k}_ms"] / step_ms if step_ms > 0 else 0.0
    return out


def hf_llama_config(args: Any) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=args.d_model,
        intermediate_size=args.ffn_dim,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_kv_heads,
        vocab_size=args.vocab_size,
        max_position_embeddings=args.max_seq_len,
        rope_theta=args.rope_theta,
        rms_norm_eps=args.norm_eps,
        tie_word_embeddings=args.tie_embeddings,
        attention_bias=args.qkv_bias,
        head_dim=args.d_model // args.n_heads,
    )


def bench_hf(
    args: Any,
    batch_size: int,
    block_size: int,
    grad_accum: int,
    device: torch.device,
    precision: str,
    *,
    mode: str,
    steps: int,
    warmup: int,
    seed: int,
) -> dict[str, Any]:
    """The same shape through transformers' LlamaForCausalLM: fp32 weights, autocast, fused AdamW, its own loss."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    hf_cfg = hf_llama_config(args)
    hf_cfg._attn_implementation = "sdpa"
    model: nn.Module = LlamaForCausalLM(hf_cfg).to(device)
    model.train()
    step_model = torch.compile(model) if mode == "compiled" else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    data = SyntheticBatches(args.vocab_size, batch_size, block_size + 0, device, seed=seed)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)

    def step() -> None:
        for _ in range(grad_accum):
            x, y = next(data)
            ctx = torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()
            with ctx:
                out = step_model(input_ids=x, labels=x)
            (out.loss / grad_accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    _reset_memory(device)
    step_s = time_steps(step, device, warmup, steps)
    res = {
        "mode": mode,
        "step_ms": step_s * 1e3,
        "tokens_per_s": batch_size * block_size * grad_accum / step_s,
        "peak_memory_gib": _peak_memory(device),
    }
    return res


def format_result(r: dict[str, Any]) -> str:
    def f(v: Any, spec: str) -> str:
        return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)

    lines = [
        f"{r['family']}/{r['size']} on {r['device']} ({r['precision']}, compile={r['compile']}): "
        f"batch {r['batch_size']} x {r['block_size']} x accum {r['grad_accum']}, {r['params'] / 1e6:.1f}M params",
        f"  tokens/s {f(r['tokens_per_s'], ',.0f')}   step {f(r['step_ms'], '.1f')} ms   MFU {f(r['mfu'], '.3f')}   "
        f"peak memory {f(r['peak_memory_gib'], '.2f')} GiB   ({r['data']} data)",
    ]
    b = r.get("breakdown") or {}
    if b:
        parts = [
            f"{k} {b.get(f'time/{k}_ms', 0):.1f} ms ({b.get(f'time/{k}_pct', 0):.0f}%)"
            for k in ("data", "forward", "backward", "optimizer", "other")
        ]
        lines.append("  breakdown: " + ", ".join(parts))
    if r.get("kernels"):
        from gptoughts.perf.timing import format_profile

        lines += ["  " + line for line in format_profile(r["kernels"])]
    for mode, h in (r.get("hf") or {}).items():
        lines.append(
            f"  transformers {mode}: tokens/s {f(h['tokens_per_s'], ',.0f')}  MFU {f(h['mfu'], '.3f')}  "
            f"peak {f(h['peak_memory_gib'], '.2f')} GiB  -> ours is {h['speedup']:.2f}x"
        )
    return "\n".join(lines)
