"""``gptoughts bench``: tokens/s, MFU, peak memory and the step breakdown of one configuration, optionally
side by side, in the same process and at the same shape, with ``transformers`` (``LlamaForCausalLM``, eager and
compiled: ``--compare hf``) or with torchtitan's own Llama 3 and its own ``parallelize_llama`` (``--compare
torchtitan``: ``bench_torchtitan.py``).

The timed step is the trainer's own ``train_step`` (same precision handling, fused AdamW, gradient clipping and
accumulation), so what bench reports is what ``train`` runs.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from torch import nn

from gptoughts import models
from gptoughts.config import Config
from gptoughts.errors import UserError
from gptoughts.tools.bench_torchtitan import (
    align_ours_with_torchtitan,
    bench_torchtitan,
    import_torchtitan,
    parse_torchtitan_compare,
)
from gptoughts.tools.bench_torchtitan_deepseek import import_torchtitan_deepseek
from gptoughts.tools.measure import (
    SyntheticBatches,
    peak_memory,
    profile_steps,
    reset_memory,
    time_steps,
)


@dataclass
class _Ours:
    """What a peer is run at to be compared with our step: the model's args, the batch, device and precision, and
    our figures (for its MFU and the ratio)."""

    args: Any
    batch_size: int
    block_size: int
    grad_accum: int
    seed: int
    device: torch.device
    precision: str
    compiled: bool
    """Like with like: a peer is compiled only when our step was."""
    flops_per_token: float
    peak_flops: float | None
    tokens_per_s: float

    @property
    def shape(self) -> tuple[Any, int, int, int, torch.device, str]:
        """The leading arguments of :func:`bench_hf` and :func:`bench_torchtitan`."""
        return self.args, self.batch_size, self.block_size, self.grad_accum, self.device, self.precision

    def rate(self, peer: dict[str, Any]) -> dict[str, Any]:
        """``peer`` with its MFU and ``speedup`` (ours over its tokens/s) added."""
        peer["mfu"] = (
            (self.flops_per_token * peer["tokens_per_s"] / self.peak_flops) if self.peak_flops else None
        )
        peer["speedup"] = self.tokens_per_s / peer["tokens_per_s"]
        return peer


def run_bench(
    cfg: Config,
    *,
    steps: int = 20,
    warmup: int = 5,
    compare: str | None = None,
    data_dir: str | None = None,
    hf_modes: tuple[str, ...] = ("eager", "compiled"),
    kernel_steps: int = 0,
    announce: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Time ``cfg``'s training step; ``compare``: ``hf``, or ``torchtitan[:MODE,...]`` (see
    :func:`parse_torchtitan_compare`), run after ours on the same shape, batch and precision. A shape whose
    estimated peak memory clearly exceeds the device's is refused before anything is built, as ``train`` refuses
    it (:class:`MemoryRefused`; ``perf.ignore_memory_estimate`` tries anyway). ``announce``: told in one line what
    is about to be built and timed, before the first slow step."""
    if steps < 1 or warmup < 0 or kernel_steps < 0:  # (a speed over no steps is a division by zero)
        raise UserError(
            f"bench needs steps >= 1, warmup >= 0 and kernel_steps >= 0; got {steps}, {warmup} and {kernel_steps}"
        )
    # our step is built from the family and size on random tokens: a model named to start from is never loaded
    if cfg.model.init_from is not None:
        raise UserError(
            f"bench and tune time a model built from --model FAMILY --size S on random tokens, and do not load "
            f"--init_from {cfg.model.init_from}; drop --init_from, or time the fine-tune itself: gptoughts finetune "
            f"--model {cfg.model.init_from} --max_steps 20"
        )
    tt_modes: tuple[str, ...] = ()
    tt_graphs = True
    ours_notes: list[str] = []
    if compare is not None and compare != "hf":
        tt_modes, tt_graphs = parse_torchtitan_compare(compare)
        # Before anything is built or timed: a missing peer, or an option it has no equivalent for, is said in one
        # line at once, not after our run.
        import_torchtitan()
        cfg, ours_notes = align_ours_with_torchtitan(cfg)
        if models.get_family(cfg.model.family).name == "deepseek":
            import_torchtitan_deepseek()  # its modules beyond Llama's (MTP, the MoE hook)
    result, ours = _bench_ours(
        cfg, steps=steps, warmup=warmup, data_dir=data_dir, kernel_steps=kernel_steps, announce=announce
    )
    if ours_notes:
        result["ours_for_compare"] = ours_notes  # what our measured step left out to be the peer's model
    if compare == "hf":
        result["hf"] = {}
        for mode in hf_modes:
            if mode == "compiled" and not ours.compiled:
                continue
            r = bench_hf(*ours.shape, mode=mode, steps=steps, warmup=warmup, seed=ours.seed)
            result["hf"][mode] = ours.rate(r)
            reset_memory(ours.device)
    elif tt_modes:
        result["torchtitan"] = {}
        for mode in tt_modes:
            result["torchtitan"][mode] = _bench_torchtitan_mode(
                cfg, ours, result, mode, tt_graphs, steps, warmup
            )
            reset_memory(ours.device)
    return result


class MemoryRefused(UserError, RuntimeError):
    """A shape refused on its memory estimate (``train``'s refusal). A ``UserError`` (one line, exit 2), and a
    ``RuntimeError`` so that ``tune``, which times each combination through :func:`run_bench`, records it as that
    combination's failure and goes on with the others."""


def _bench_ours(
    cfg: Config,
    *,
    steps: int,
    warmup: int,
    data_dir: str | None,
    kernel_steps: int,
    announce: Callable[[str], None] | None = None,
) -> tuple[dict[str, Any], _Ours]:
    """Our step, built by train's own assembly and timed; the result's fields, and what a peer is compared at."""
    from gptoughts.training.batches import plan_batches
    from gptoughts.training.components import timing_trainer
    from gptoughts.training.corpus import synthetic_data
    from gptoughts.training.environment import setup_environment, use_our_compile_cache
    from gptoughts.training.modeling import build_model

    env = setup_environment(cfg)
    use_our_compile_cache()
    device, hw = env.device, env.hw
    if kernel_steps > 0 and device.type != "cuda":  # (it ran the steps, announced them, and printed nothing)
        raise UserError(f"--kernels profiles CUDA kernels; this bench runs on {device.type}: drop --kernels")
    family = models.get_family(cfg.model.family)
    tokenizer, vocab = _vocabulary(cfg, data_dir)
    reset_memory(device)
    data = synthetic_data(vocab, tokenizer=tokenizer)
    what = _check_memory(cfg, env, data)  # before the real build: a 1b on a CPU fills GBs in seconds
    if announce is not None and env.dist.is_main:
        announce(
            f"bench: {what}: building it, then {warmup} warmup + {steps} timed steps"
            + (f" + {kernel_steps} profiled" if kernel_steps > 0 else "")
        )
    model = build_model(cfg, env, data)  # the train assembly's own step: transforms in their one order
    batch = plan_batches(cfg, env, data, model)  # batch_size = auto: the same search as train
    t = replace(cfg.train, batch_size=batch.micro_batch, grad_accum=batch.grad_accum)
    loader = _loader(data_dir, vocab, t, device)
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
    tps = batch.tokens_per_step / step_s
    raw = model.raw
    flops_tok = raw.flops_per_token(t.block_size)
    peak = hw.peak_bf16_flops
    result: dict[str, Any] = {
        "family": family.name,
        "size": cfg.model.size,
        "device": hw.name,
        "precision": env.precision,
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
        "peak_memory_gib": peak_memory(device),
        "breakdown": breakdown,
        "data": "shards" if data_dir else "synthetic",
    }
    result["resolved"] = {**model.built.resolved, **batch.why}
    if kernels is not None:
        result["kernels"] = kernels
    ours = _Ours(model.args, t.batch_size, t.block_size, t.grad_accum, t.seed, device, env.precision,
                 compiled=bool(hw.compile and result["resolved"].get("compile")), flops_per_token=flops_tok,
                 peak_flops=peak, tokens_per_s=tps)  # fmt: skip
    loader.close()
    del trainer, model, raw, loader
    reset_memory(device)
    return result, ours


def _check_memory(cfg: Config, env: Any, data: Any) -> str:
    """Train's memory refusal for this shape (:func:`~gptoughts.training.plan.peak_refusal` of the estimated peak
    at the planned micro-batch, on the model built on the meta device: nothing allocated), raised as
    :class:`MemoryRefused`; else what will be timed, in words: model, parameters, batch, device, precision and the
    estimated peak."""
    from gptoughts.parallel import dist as pdist
    from gptoughts.training.batches import plan_batches
    from gptoughts.training.estimates import device_memory_gib, estimate_peak
    from gptoughts.training.modeling import build_model
    from gptoughts.training.plan import gib, peak_refusal

    meta = build_model(cfg, env, data, meta=True)
    batch = plan_batches(cfg, env, data, meta, dry_run=True)
    e = estimate_peak(
        cfg, env, meta, batch.micro_batch, batch.block_size, batch.world_size, batch.tp, batch.grad_accum
    )
    peak, limit = (e.total_gib if e is not None else None), device_memory_gib(env)
    if not cfg.perf.ignore_memory_estimate:
        # rank 0's verdict for all, as in train
        verdict = peak_refusal(peak, limit, asdict(batch), on_cpu=env.device.type == "cpu")
        refusal = pdist.broadcast_object(verdict, env.dist)
        if refusal:
            raise MemoryRefused(str(refusal))
    auto = not isinstance(cfg.train.batch_size, int) and env.device.type == "cuda"
    shape = (
        f"micro-batch auto (found with real steps) x {batch.block_size:,} tokens"
        if auto
        else f"micro-batch {batch.micro_batch} x {batch.block_size:,} tokens x accum {batch.grad_accum}"
    )
    memory = (
        f", ~{gib(peak)} estimated peak" + (f" of {gib(limit)}" if limit else "")
        if peak is not None and not auto
        else ""
    )
    return (
        f"{meta.family.name}/{cfg.model.size}, {meta.raw.num_params():,} parameters, {shape} on {env.hw.name} "
        f"({env.device.type}, {env.precision}){memory}"
    )


def _vocabulary(cfg: Config, data_dir: str | None) -> tuple[Any, int]:
    """The tokenizer and vocabulary train would build for this size's tokenizer (bpe:8192 at debug, bytes: 259
    rounded up to 320), or the prepared shards' own: the model's default would time another model than `train
    --size S` trains."""
    if data_dir is not None:
        from gptoughts.data.loader import TokenDataset

        return None, TokenDataset(data_dir).vocab_size
    from gptoughts.data.tokenizer import tokenizer_before_training

    return tokenizer_before_training(cfg.data.tokenizer)


def _loader(data_dir: str | None, vocab: int, t: Any, device: torch.device) -> Any:
    """The prepared shards of ``data_dir`` through train's loader, or synthetic batches already on the device."""
    if data_dir is None:
        return SyntheticBatches(vocab, t.batch_size, t.block_size, device, seed=t.seed)
    from gptoughts.data.loader import BatchLoader, TokenDataset

    return BatchLoader(
        TokenDataset(data_dir),
        split="train",
        batch_size=t.batch_size,
        block_size=t.block_size,
        seed=t.seed,
        device=device,
    )


def _bench_torchtitan_mode(
    cfg: Config, ours: _Ours, result: dict[str, Any], mode: str, cuda_graphs: bool, steps: int, warmup: int
) -> dict[str, Any]:
    """torchtitan's model of our family at our shape with ``mode``'s attention and our run's checkpointing and fp8;
    a failure of the peer (a torch API it expects, a kernel) is the result's ``error``, not the loss of our
    measurement."""
    resolved = result["resolved"]
    try:
        r = bench_torchtitan(
            *ours.shape,
            family=result["family"],
            attention=mode,
            compiled=ours.compiled,
            cuda_graphs=cuda_graphs,
            activation_checkpointing=str(resolved.get("activation_checkpointing", "none")),
            fp8=resolved.get("fp8") or None,
            fp8_bf16_end_layers=cfg.perf.fp8_bf16_end_layers,
            ours_notes=result.get("ours_for_compare"),
            steps=steps,
            warmup=warmup,
            seed=ours.seed,
        )
    except UserError:
        raise
    except Exception as e:
        return {"mode": mode, "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    return ours.rate(r)


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

    reset_memory(device)
    step_s = time_steps(step, device, warmup, steps)
    res = {
        "mode": mode,
        "step_ms": step_s * 1e3,
        "tokens_per_s": batch_size * block_size * grad_accum / step_s,
        "peak_memory_gib": peak_memory(device),
    }
    return res


def format_result(r: dict[str, Any]) -> str:
    def f(v: Any, spec: str) -> str:
        return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)

    # what the step ran with (False, blocks or model), not the setting asked for (auto)
    compiled = (r.get("resolved") or {}).get("compile", r["compile"])
    lines = [
        f"{r['family']}/{r['size']} on {r['device']} ({r['precision']}, compile={compiled or 'off'}): "
        f"batch {r['batch_size']} x {r['block_size']} x accum {r['grad_accum']}, {r['params'] / 1e6:.1f}M params",
        f"  tokens/s {f(r['tokens_per_s'], ',.0f')}   step {f(r['step_ms'], '.1f')} ms   MFU {f(r['mfu'], '.3f')}   "
        f"peak memory {f(r['peak_memory_gib'], '.2f')} GiB   ({r['data']} data)",
    ]
    for note in r.get("ours_for_compare") or []:
        lines.append(f"  ours, for the compare: {note}")
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
    for mode, h in (r.get("torchtitan") or {}).items():
        if "error" in h:
            lines.append(f"  torchtitan {mode}: failed: {h['error']}")
            continue
        # both counts exact, side by side: the reader sees that the peer ran the same model
        same = "= ours" if h["params"] == r["params"] else f"!= ours {r['params']:,}"
        params = f"  ({h['params']:,} params {same})"
        lines.append(
            f"  torchtitan {mode}: tokens/s {f(h['tokens_per_s'], ',.0f')}  MFU {f(h['mfu'], '.3f')}  "
            f"peak {f(h['peak_memory_gib'], '.2f')} GiB  -> ours is {h['speedup']:.2f}x{params}"
        )
        lines.append(f"    [{h['label']}]")
    return "\n".join(lines)
