"""The one assembly: a :class:`~gptoughts.config.Config` becomes a ready trainer, in named steps, in one order.

``build(cfg)`` runs, each step receiving only what it needs and returning a typed result:

1. :func:`setup_environment`  device, process group, hardware profile, precision
2. :func:`check_run_dir`      what ``run.out`` holds: a new run, a run to resume (its checkpoint), a refusal
3. :func:`prepare_data`       sources -> tokenizer -> token shards (or SFT examples)
4. :func:`build_model`        build on meta -> load or init -> LoRA -> the transforms of ``training/setup.py``
                              (residual dtype -> fp8 -> activation checkpointing -> compile -> DDP/FSDP);
                              first on meta, for :func:`choose_memory_layout` (checkpointing, optimizer
                              states, CPU offload: what fits the GPU, decided before the real build)
5. :func:`plan_batches`       micro-batch, accumulation, tokens per step, steps, epochs, warmup, intervals
6. :func:`~gptoughts.training.plan.make_plan`   what the run will do (printed before the first step)
7. optimizer and schedule, loaders, sampler, metrics, the :class:`~gptoughts.training.trainer.Trainer`

Nothing is written to the run directory before every step has succeeded (a rejected resume leaves the run as it
was); ``dry_run`` stops after step 6 having written nothing at all (the model is built on the meta device and
the corpus is not tokenized when its shards are not cached). ``train``, ``finetune``, ``bench``, ``tune``, the
bench scripts and the tests all assemble through here.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gptoughts import models
from gptoughts.config import Config, TrainConfig, is_task_file, to_toml
from gptoughts.data.sources import STDLIB_ALIAS, stdlib_path
from gptoughts.errors import ConfigError, DataError, UserError
from gptoughts.parallel import dist as pdist
from gptoughts.perf import checkpointing, hardware
from gptoughts.training import checkpoint as ckpt
from gptoughts.training import rundir
from gptoughts.training.plan import BatchPlan, RunPlan, make_plan, memory_refusal
from gptoughts.training.plan import gib as plan_gib


# ------------------------------------------------------------------------------------------ 1. environment
@dataclass
class Environment:
    device: torch.device
    dist: pdist.DistInfo
    hw: hardware.HardwareProfile
    precision: str
    """fp32, bf16 or fp16 (``perf.precision = auto`` resolved by the hardware profile)."""
    resolved: dict[str, str] = field(default_factory=dict)
    """Each ``auto`` of the environment and why it became what it is."""


def use_our_compile_cache() -> None:
    """Point torch.compile's caches beside the token cache (not for a dry run: importing dynamo creates the
    folder, and a dry run writes nothing)."""
    # torch.compile's caches (inductor's FX graphs, AOTAutograd's graphs, autotuning results) default to /tmp,
    # which a reboot or a cluster's job cleanup empties; beside the token cache they last, so a second run of
    # the same config compiles from cache (its start-up is printed after the first step). A user's own wins.
    # (torch writes its /tmp default into the variable the first time it looks, so that value counts as unset.)
    # (Only a set variable is compared with it: reading torch's default imports the inductor package.)
    user_cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if user_cache is None or user_cache == _torch_inductor_default():
        from gptoughts.data.prepare import default_cache_dir

        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(default_cache_dir() / "inductor")


def setup_environment(cfg: Config) -> Environment:
    """Device, process group (torchrun), hardware profile and precision. Call :func:`pdist.shutdown` after."""
    import warnings

    # torch's RMSNorm says it cannot use its fused kernel when a bf16 residual meets an fp32 weight: expected
    # (perf.residual_dtype), and compiled blocks fuse the norm anyway. Not a thing for the user to act on.
    warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
    # FlashAttention-4's CuTe DSL says, at each kernel's first compile, that an argument of its own is passed as a
    # runtime value (flash-attn-4 4.0.0b36); two "warning:" lines per run for the user, nothing to act on.
    warnings.filterwarnings("ignore", message=r"Argument aux_data .* cannot be converted to a JitArgument")
    device = hardware.resolve_device(cfg.perf.device)
    # Before anything touches CUDA: the allocator reads its settings when it starts.
    hardware.apply_runtime_settings(
        device, tf32=cfg.perf.tf32, expandable_segments=cfg.perf.expandable_segments
    )
    par = cfg.parallel
    info = pdist.init(
        device,
        par.backend,
        par.strategy,
        par.tp,
        par.pp,
        par.cpu_offload,
        ddp_bucket_mb=par.ddp_bucket_mb,
    )
    hw = hardware.detect(device)
    from gptoughts.training.setup import check_attention

    # a missing kernel or optimizer package is said before anything is built or written (every Environment is made
    # here: the later steps that use them need not check again)
    check_attention(cfg.perf, device)
    check_optimizer_states(cfg.train, info)
    precision = hardware.resolve_precision(cfg.perf.precision, hw)
    why = {"precision": f"{precision} ({'asked' if cfg.perf.precision != 'auto' else 'auto: ' + hw.arch})"}
    if cfg.perf.gpu_memory_gib is not None and device.type == "cuda" and hw.memory_bytes:
        cap = min(hw.memory_bytes, int(cfg.perf.gpu_memory_gib * 2**30))
        torch.cuda.set_per_process_memory_fraction(cap / hw.memory_bytes, device)
        hw = replace(hw, memory_bytes=cap)
        why["gpu_memory"] = f"capped at {cap / 2**30:.1f} GiB (perf.gpu_memory_gib)"
    if info.strategy == "fsdp" and not info.cpu_offload:
        reshard, reason = _fsdp_reshard(cfg, info, hw, device, precision)
        why["reshard_after_forward"] = f"{str(reshard).lower()} ({reason})"
        info = replace(info, reshard_after_forward=reshard)
    return Environment(device=device, dist=info, hw=hw, precision=precision, resolved=why)


def _fsdp_reshard(
    cfg: Config, info: Any, hw: Any, device: torch.device, precision: str = "bf16"
) -> tuple[bool, str]:
    """``parallel.reshard_after_forward`` resolved, and why. auto keeps every block gathered from its forward to
    its backward (no second all-gather: 1b scaled 97.1% instead of 95.4% on 2 x H200, bench/BENCHMARKS.md) when
    the memory estimate with them kept stays under 80% of the GPU at the asked micro-batch; it frees them when
    the estimate does not fit, or cannot be made (an HF model, batch_size auto, a CPU)."""
    asked = cfg.parallel.reshard_after_forward
    if asked is not True and asked is not False:
        asked = "auto"
    if asked != "auto":
        return bool(asked), "asked"
    t = cfg.train
    mem = (hw.memory_bytes or 0) / 2**30
    if device.type != "cuda" or not mem or not isinstance(t.batch_size, int) or cfg.model.init_from:
        return True, "auto: no estimate to check the kept weights against"
    if precision not in ("bf16", "fp16"):  # fp32 training gathers fp32 weights: kept, they would cost twice
        return True, f"auto: {precision} weights are resharded (kept gathered only in bf16/fp16)"
    from gptoughts.perf.estimate import estimate

    try:
        e = estimate(
            cfg.model.family,
            cfg.model.size,
            cfg.model.overrides,
            batch_size=t.batch_size,
            block_size=t.block_size,
            activation_checkpointing=checkpointing.resolve(cfg.perf.activation_checkpointing, cfg.lora)[0],
            num_gpus=info.world_size,
            strategy="fsdp",
            optimizer=t.optimizer,
            optimizer_states=t.optimizer_states,
            tp=info.tp,
            reshard_after_forward=False,
            residual_dtype="bf16" if precision == "bf16" and cfg.perf.residual_dtype != "fp32" else "fp32",
        )
    except Exception:  # noqa: BLE001 - an estimate must never stop a run
        return True, "auto: no estimate to check the kept weights against"
    if e.total_gib <= 0.8 * mem:
        return (
            False,
            f"auto: blocks kept gathered until backward (~{e.total_gib:.0f} GiB of {mem:.0f} estimated)",
        )
    return True, f"auto: blocks resharded after forward (kept, ~{e.total_gib:.0f} GiB > 80% of {mem:.0f})"


def _torch_inductor_default() -> str | None:
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir as torch_default
    except ImportError:  # a torch without it: only an unset variable is ours to set
        return None
    return os.path.abspath(torch_default())


# ------------------------------------------------------------------------------------------------ 3. data
@dataclass
class Data:
    sources: list[str]
    """Resolved paths (``@stdlib`` expanded)."""
    format: str
    """text (token shards) or sft (examples with a target mask)."""
    tokenizer: Any
    manifest: Any = None
    """The prepared shards' Manifest (text runs, once prepared)."""
    sft: Any = None
    """SFTData (sft runs)."""
    init_from: Path | None = None
    estimated: bool = False
    """Dry run with no cached shards: token counts are estimated from the corpus size, nothing was tokenized."""
    corpus: dict[str, Any] = field(default_factory=dict)
    """What the plan reports: files, bytes on disk, bytes read, tokens, what a cap cut."""

    @property
    def dataset(self) -> Any:
        from gptoughts.data.loader import TokenDataset

        return TokenDataset(self.manifest.dir) if self.manifest is not None else None

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.vocab_size) if self.tokenizer is not None else int(self.corpus["vocab"])


def resolve_sources(sources: list[str]) -> list[str]:
    if not sources:
        raise ConfigError(
            "no training data: pass --data PATH (a file, folder, .jsonl, .parquet or saved HF dataset; "
            "--data @stdlib trains on the Python standard library)"
        )
    return [str(stdlib_path()) if s == STDLIB_ALIAS else s for s in sources]


def init_from_dir(cfg: Config, *, weights: bool = True) -> Path | None:
    """``model.init_from`` as a checked HF model folder (None when training from scratch); a hub id is its
    snapshot in the Hugging Face cache, downloaded when online (``weights=False``: config and tokenizer only)."""
    if cfg.model.init_from is None:
        return None
    from gptoughts.models.hf import locate, read_config

    p = locate(cfg.model.init_from, weights=weights)
    if (p / "config.toml").exists() or (p / "meta.json").exists() or (p / "checkpoints").is_dir():
        raise UserError(
            f"{p} is a gptoughts run; export it first (gptoughts export {p} --format hf OUT) and "
            "fine-tune OUT"
        )
    read_config(p)  # a clear error now rather than deep inside the model loading
    return p


def prepare_data(cfg: Config, env: Environment, *, dry_run: bool = False) -> Data:
    """Tokenizer and token shards (rank 0 prepares, the others read the cache), or the SFT examples."""
    from gptoughts.data.sft import SFTData, resolve_format

    sources = resolve_sources(cfg.data.sources)
    init_from = init_from_dir(cfg, weights=not dry_run)  # a dry run reads no weights
    tok_spec: Any = str(init_from) if init_from is not None else cfg.data.tokenizer  # fine-tuning: its own
    data_format = resolve_format(cfg.data.format, sources)
    if data_format == "sft":  # every rank tokenizes the (small) SFT set itself: deterministic, no cache
        tokenizer = _sft_tokenizer(tok_spec, sources)
        sft = SFTData(
            sources,
            tokenizer,
            block_size=cfg.train.block_size,
            truncation=cfg.data.truncation,
            val_fraction=cfg.data.val_fraction,
            seed=cfg.train.seed,
        )
        return Data(
            sources=sources,
            format="sft",
            tokenizer=tokenizer,
            sft=sft,
            init_from=init_from,
            corpus={"examples": sft.stats["examples"], "summary": sft.summary()},
        )
    from gptoughts.data.prepare import cached_prepare, lookup_cached

    kwargs = dict(
        text_field=cfg.data.text_field,
        extensions=cfg.data.extensions or None,
        val_fraction=cfg.data.val_fraction,
        max_bytes=cfg.data.max_bytes,
        seed=cfg.train.seed,
        cache_root=cfg.data.cache_dir,
    )
    corpus = corpus_size(sources, cfg.data.extensions or None)
    if dry_run:
        manifest = lookup_cached(sources, tok_spec, **kwargs)
        if manifest is None:  # estimate, tokenize nothing
            from gptoughts.data.tokenizer import parse_spec, tokenizer_before_training

            kind = parse_spec(tok_spec)[0]
            tokenizer, vocab = tokenizer_before_training(tok_spec)
            read = (
                corpus["bytes"]
                if cfg.data.max_bytes is None
                else sum(min(b, cfg.data.max_bytes) for b in corpus["per_source"])
            )
            corpus.update(
                bytes_read=read,
                vocab=vocab,
                tokens=int(read / _bytes_per_token(kind, vocab)),
                cut=read < corpus["bytes"],
            )
            return Data(
                sources=sources,
                format="text",
                tokenizer=tokenizer,
                init_from=init_from,
                estimated=True,
                corpus=corpus,
            )
    else:
        manifest = None
        if env.dist.is_main:
            manifest = cached_prepare(
                sources, tok_spec, progress=cfg.run.progress, workers=cfg.data.workers, **kwargs
            )
        pdist.barrier(env.dist)
        if not env.dist.is_main:
            manifest = cached_prepare(sources, tok_spec, progress=False, **kwargs)
    corpus.update(
        bytes_read=sum(s.bytes for s in manifest.sources),
        tokens=manifest.train_tokens,
        val_tokens=manifest.val_tokens,
        docs=manifest.totals["docs"],
        vocab=manifest.vocab_size,
        cut=any(s.truncated for s in manifest.sources),
    )
    return Data(
        sources=sources,
        format="text",
        tokenizer=manifest.tokenizer(),
        manifest=manifest,
        init_from=init_from,
        corpus=corpus,
    )


# Bytes of text per token of a byte-level BPE trained on the corpus, measured on the Python standard library
# (30 MB of code): bpe:8192 3.2, bpe:32768 3.9 (what a dry run assumes before the corpus is tokenized).
def _bytes_per_token(kind: str, vocab: int | None) -> float:
    if kind == "bytes":
        return 1.0
    if vocab is None or vocab >= 32768:
        return 3.9
    return 3.2 if vocab >= 8192 else 2.5


def corpus_size(sources: list[str], extensions: list[str] | None) -> dict[str, Any]:
    """Files and bytes on disk of the sources (a walk of file sizes: no reading)."""
    import os

    from gptoughts.data.sources import normalize_extensions, walk_files

    exts = normalize_extensions(extensions)
    files, per_source = 0, []
    for s in sources:
        p = Path(s).expanduser()
        if p.is_dir():
            sizes = (
                [f.stat().st_size for f in walk_files(p, exts)]
                if not (p / "dataset_info.json").exists() and not (p / "dataset_dict.json").exists()
                else [f.stat().st_size for f in p.rglob("*.arrow")]
            )
            files += len(sizes)
            per_source.append(sum(sizes))
        elif p.is_file():
            files += 1
            per_source.append(os.path.getsize(p))
        else:
            per_source.append(0)
    return {"files": files, "bytes": sum(per_source), "per_source": per_source}


def _sft_tokenizer(spec: str, sources: list[str]) -> Any:
    """The tokenizer of an SFT run: a folder's or ``bytes`` as is; ``bpe:N`` trained on the conversations."""
    from gptoughts.data.sft import read_conversations
    from gptoughts.data.tokenizer import build_tokenizer

    return build_tokenizer(spec, texts=lambda: (m["content"] for c in read_conversations(sources) for m in c))


# ------------------------------------------------------------------------------------------------ 4. model
@dataclass
class Model:
    family: models.Family
    args: Any
    raw: nn.Module
    """The plain module: state dicts, generation, export."""
    weights: nn.Module
    """What checkpoints hold: the whole model, or for LoRA only the adapters (TrainableWeights)."""
    built: Any = None
    """setup.Built: the transformed model the trainer runs (None in a dry run)."""
    objective: Any = None
    pretrained: Any = None
    """models.hf.Pretrained when fine-tuning."""


def build_model(cfg: Config, env: Environment, data: Data, *, meta: bool = False) -> Model:
    """Build on meta, then load (fine-tuning) or initialise, LoRA, then the transforms in their one order.
    ``meta``: stop after building on the meta device (dry run: parameter counts without memory)."""
    from gptoughts.training.setup import TrainableWeights, apply_transforms, build_raw_model, make_objective

    device = torch.device("meta") if meta else env.device
    # Offloaded runs keep the weights in CPU memory: build or load them there (the model may not fit the GPU).
    home = torch.device("cpu") if env.dist.cpu_offload and not meta else device
    pretrained = None
    perf = cfg.perf
    if data.init_from is not None:
        pretrained, raw, perf = build_finetune_model(cfg, data.init_from, home, env.precision)
        _check_tp(cfg, env, pretrained.family, pretrained.model.args, generic=pretrained.generic)
        if pretrained.generic and env.dist.sharded:
            raise ConfigError(
                f"parallel.strategy = fsdp covers the native families; {data.init_from} runs on the "
                "generic transformers path (tied weights, generate): use DDP (the default)"
            )
        args = pretrained.model.args
        family = models.family_of(pretrained.family)
        if args.vocab_size < data.vocab_size:
            raise DataError(
                f"the tokenizer of {data.init_from} has {data.vocab_size} tokens but the model only "
                f"{args.vocab_size} embeddings; fix the model folder"
            )
        if args.max_seq_len < cfg.train.block_size:
            raise ConfigError(
                f"--block_size {cfg.train.block_size} exceeds the {args.max_seq_len} positions of "
                f"{cfg.model.init_from}; pass --block_size {args.max_seq_len} or less (or leave it out)"
            )
    else:
        family = models.get_family(cfg.model.family)
        overrides = dict(cfg.model.overrides)
        overrides.setdefault("vocab_size", round_up(data.vocab_size, 64))
        if family.objective == "diffusion":
            mask_id = data.tokenizer.mask_id if data.tokenizer is not None else 2
            if mask_id is None:
                raise ConfigError(
                    "LLaDA needs a mask token; use --tokenizer bpe:N or bytes (which reserve <|mask|>)"
                )
            overrides.setdefault("mask_token_id", mask_id)
        args = models.model_args(family.name, cfg.model.size, overrides)
        if getattr(args, "vocab_size", data.vocab_size) < data.vocab_size:
            raise ConfigError(
                f"model.vocab_size = {args.vocab_size} is smaller than the tokenizer's "
                f"{data.vocab_size}; drop the override or raise it"
            )
        if hasattr(args, "max_seq_len") and args.max_seq_len < cfg.train.block_size:
            args = replace(args, max_seq_len=cfg.train.block_size)
        _check_tp(cfg, env, family.name, args)
        if meta:
            with torch.device("meta"):
                raw = models.build_model(family.name, args, device="meta")
        else:
            raw = build_raw_model(family.name, args, home, cfg.train.seed)
    if env.dist.pp > 1:  # refused in one line before anything is written
        from gptoughts.parallel import pp

        pp.check_supported(
            family.name,
            args,
            lora=cfg.lora.enabled,
            generic=bool(pretrained is not None and pretrained.generic),
            objective=family.objective,
        )
    weights = TrainableWeights(raw) if cfg.lora.enabled else raw
    out = Model(family=family, args=args, raw=raw, weights=weights, pretrained=pretrained)
    if meta:
        return out
    out.built = apply_transforms(
        raw,
        perf=perf,
        hw=env.hw,
        device=env.device,
        dist=env.dist,
        precision=env.precision,
        parallel=cfg.parallel,
        family=family.name,
        lora=cfg.lora,
        auto_batch=cfg.train.batch_size == "auto",
    )
    out.objective = make_objective(family, out.built, cfg.perf)
    return out


def _check_tp(cfg: Config, env: Environment, family: str, args: object, *, generic: bool = False) -> None:
    """Tensor parallelism's one-line refusals (parallel/tp.py), before any weight is loaded or file written."""
    from gptoughts.parallel.tp import check_tp

    check_tp(family, args, env.dist.tp, generic=generic, lora=cfg.lora.enabled)


def round_up(n: int, multiple: int) -> int:
    return ((n + multiple - 1) // multiple) * multiple


def build_finetune_model(
    cfg: Config, init_from: Path, device: torch.device, precision: str
) -> tuple[Any, nn.Module, Any]:
    """The model a fine-tuning run trains: ``init_from`` loaded (native or generic), LoRA applied when enabled.

    Returns ``(pretrained, model, perf)``; ``perf`` is ``cfg.perf`` with fp8 off under LoRA (fp8 would convert
    the frozen base layers). The frozen base is loaded directly in ``lora.base_dtype`` (no fp32 copy is ever
    allocated). ``model.*`` overrides that leave the architecture unchanged (e.g. DeepSeek's
    ``bias_update_rate``) apply to native families."""
    from gptoughts.models.hf import load_pretrained
    from gptoughts.training.setup import apply_lora, lora_base_dtype

    base_dtype = lora_base_dtype(cfg.lora, precision) if cfg.lora.enabled else torch.float32
    pretrained = load_pretrained(
        init_from,
        device=device,
        trust_remote_code=cfg.model.trust_remote_code,
        dtype=base_dtype,
        overrides=cfg.model.overrides,
    )
    model, perf = pretrained.model, cfg.perf
    if cfg.lora.enabled:
        if perf.fp8 is True:
            raise ConfigError(
                "--fp8 converts the frozen base layers; it does not combine with --lora (drop one)"
            )
        perf = replace(perf, fp8=False)
        if device.type == "meta":
            return pretrained, model, perf
        # The adapters' random init is a function of train.seed alone (not of what ran before in the process).
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(cfg.train.seed)
            model = apply_lora(
                model,
                cfg.lora,
                device=device,
                compute_dtype=torch.float16 if precision == "fp16" else torch.bfloat16,
            )
    return pretrained, model, perf


# ---------------------------------------------------------------------------------------------- 5. batches
def auto_interval(total_steps: int, count: int, cap: int, at_least: int = 1) -> int:
    """About ``count`` events per run, at a round number of steps (1, 2, 5 x 10^k), at most every ``cap`` steps
    and at least every ``at_least``; 0 (only at the end) when ``at_least`` exceeds the run."""
    if at_least > total_steps:
        return 0
    target = max(1, total_steps // count, at_least)
    nice = 1
    for k in range(7):
        for m in (1, 2, 5):
            if m * 10**k <= target:
                nice = m * 10**k
    if nice < at_least:  # rounding down went below the floor: the next round number
        nice = next(m * 10**k for k in range(8) for m in (1, 2, 5) if m * 10**k >= at_least)
    return min(nice, max(cap, at_least))


# Evaluations at least this far apart, checkpoints at least this far apart, by the plan's time estimate (an
# evaluation costs about a third of a step at the default eval_batches; a 1b checkpoint ~13 GB of writes).
EVAL_EVERY_S, SAVE_EVERY_S = 60.0, 600.0


def plan_batches(
    cfg: Config,
    env: Environment,
    data: Data,
    model: Model,
    *,
    dry_run: bool = False,
    resumed_run: dict[str, Any] | None = None,
) -> BatchPlan:
    """Micro-batch (auto: the largest that fits), accumulation, tokens per step, steps, epochs, warmup and the
    evaluation/checkpoint intervals, each with the rule that decided it."""
    from gptoughts.data.sft import epoch_rows
    from gptoughts.perf.autobatch import NothingFits, accumulation_for
    from gptoughts.training.optim import default_warmup
    from gptoughts.training.setup import auto_micro_batch

    t, info = cfg.train, env.dist
    why: dict[str, str] = {}
    micro, accum = t.batch_size, t.grad_accum
    if data.sft is not None:
        packing = data_packing(cfg, model)
        if packing and info.pp > 1:
            raise ConfigError(
                "parallel.pp passes only the hidden state between stages, not the packed rows' document "
                "ids: add --data.packing false"
            )
        train_tokens = epoch_rows(data.sft, t.seed, packing) * t.block_size
    else:
        train_tokens = int(data.corpus["tokens"])
    # The epochs asked for (one when no stopping rule is given); None under a step or token budget.
    epochs = None if t.max_steps is not None or t.max_tokens is not None else (t.epochs or 1.0)
    if not isinstance(micro, int):
        if info.pp > 1:
            raise ConfigError(
                "train.batch_size = auto probes memory with whole-model trial steps, not a pipeline stage's; "
                "with --parallel.pp pass --batch_size N"
            )
        if info.sharded and info.enabled:  # one offloading process probes like any single-GPU run
            raise ConfigError(
                "train.batch_size = auto probes memory with trial steps, which a sharded (FSDP or tensor-"
                "parallel) run cannot do safely (a rank out of memory would leave the others waiting in a "
                "collective); pass --batch_size N (`gptoughts estimate --num_gpus N --strategy fsdp`)"
            )
        if env.device.type != "cuda":
            micro, why["batch_size"] = _cpu_micro_batch(cfg, env, model)
        elif dry_run:
            micro = _largest_fitting(cfg, env, model, [2**k for k in range(9)])[0]
            why["batch_size"] = "auto: estimated from memory (found with real steps when the run starts)"
        else:
            parts = {
                "family": model.family.name,
                "args": asdict(model.args)
                if hasattr(model.args, "__dataclass_fields__")
                else repr(model.args),
                "block": t.block_size,
                "gpu": env.hw.name,
                "precision": env.precision,
                "resolved": model.built.resolved,
                "world": info.world_size,
            }
            try:
                micro, cached = auto_micro_batch(
                    model.built,
                    model.objective,
                    vocab_size=model.args.vocab_size,
                    block_size=t.block_size,
                    precision=env.precision,
                    perf=cfg.perf,
                    t=t,
                    device=env.device,
                    dist=info,
                    parts=parts,
                )
            except NothingFits:  # the estimate said it would: say what each way out needs
                lead = f"not even one row of {t.block_size:,} tokens fits in real training steps"
                raise UserError(layout_refusal(cfg, env, model, lead)) from None
            why["batch_size"] = "auto: largest that fits" + (" (cached)" if cached else "")
        if t.global_batch_tokens and cfg.is_given("train.grad_accum"):
            if cfg.is_given("train.global_batch_tokens"):
                raise ConfigError(
                    "--grad_accum and --global_batch_tokens both set the accumulation of an automatic batch; "
                    "give one of them"
                )
            why["grad_accum"] = (
                f"{accum} (--grad_accum): the global batch follows the automatic micro-batch, not the size's "
                f"train.global_batch_tokens = {t.global_batch_tokens:,}"
            )
        elif t.global_batch_tokens:
            # A micro-batch larger than the global batch would overshoot the target: cap it there. Then the
            # fewest accumulation steps with a micro-batch that fits, and the smallest micro-batch that reaches
            # the target with them (115 x 3 x 2048 would overshoot 0.5M by 35%; 86 x 3 is within 1%).
            micro = max(1, min(micro, t.global_batch_tokens // (t.block_size * info.dp_size)))
            accum = accumulation_for(t.global_batch_tokens, micro, t.block_size, info.dp_size)
            micro = min(micro, -(-t.global_batch_tokens // (accum * t.block_size * info.dp_size)))
            why["grad_accum"] = f"to reach train.global_batch_tokens = {t.global_batch_tokens:,}"
        if epochs is not None:
            micro, accum = _fit_epochs(micro, accum, epochs * train_tokens, t.block_size * info.dp_size, why)
    tokens_per_step = micro * t.block_size * accum * info.dp_size
    saved_dp = resumed_run.get("dp_size", resumed_run.get("world_size")) if resumed_run else None
    if saved_dp and saved_dp != info.dp_size:
        old = resumed_run.get("tokens_per_step")
        if old and old != tokens_per_step:
            # Another number of ranks (an FSDP run resumed on one GPU): keep the global batch, so that the
            # schedule, the data position and the loss scale mean what they meant.
            k = old / (micro * t.block_size * info.dp_size)
            if k != int(k):
                raise ConfigError(
                    f"resuming on {info.dp_size} process(es) a run saved on {saved_dp} "
                    f"changes the global batch from {old:,} to {tokens_per_step:,} tokens and no "
                    f"--grad_accum keeps it; pass --batch_size and --grad_accum with "
                    f"batch x grad_accum x {info.dp_size} x {t.block_size} = {old:,}"
                )
            accum = int(k)
            tokens_per_step = old
            why["grad_accum"] = (
                f"{accum}: keeps the resumed run's global batch of {old:,} tokens on "
                f"{info.dp_size} process(es) (it was saved on {saved_dp})"
            )
    if t.max_steps is not None:
        total_steps, rule = t.max_steps, f"--max_steps {t.max_steps}"
    elif t.max_tokens is not None:
        total_steps, rule = math.ceil(t.max_tokens / tokens_per_step), f"--max_tokens {t.max_tokens:,}"
    else:
        assert epochs is not None
        # The nearest whole number of steps: the plan's epochs are then the asked ones to within half a step.
        total_steps = math.floor(epochs * train_tokens / tokens_per_step + 0.5)
        rule = (
            f"--epochs {epochs:g}"
            if t.epochs is not None
            else "one epoch (no --max_steps, --epochs or --max_tokens)"
        )
    total_steps = max(1, total_steps)
    warmup = t.warmup_steps if t.warmup_steps is not None else default_warmup(total_steps)
    why["warmup_steps"] = "asked" if t.warmup_steps is not None else "auto: 2% of the run, at most 2000"
    from gptoughts.training.plan import estimate_speed

    tps, _ = estimate_speed(env, model, t.block_size, micro, info.world_size)
    step_s = tokens_per_step / tps if tps else 0.0
    eval_interval, save_interval = cfg.eval.eval_interval, cfg.checkpoint.save_interval
    if eval_interval is None:
        eval_interval = auto_interval(
            total_steps, 20, 1000, math.ceil(EVAL_EVERY_S / step_s) if step_s else 1
        )
        why["eval_interval"] = "auto: ~20 per run, at least a minute apart (estimated)"
    if save_interval is None:
        save_interval = auto_interval(
            total_steps, 10, 2000, math.ceil(SAVE_EVERY_S / step_s) if step_s else 1
        )
        why["save_interval"] = (
            "auto: ~10 per run, at least 10 minutes apart (estimated); 0: at the end (and on Ctrl-C/SIGTERM)"
        )
    tasks_interval = cfg.eval.eval_tasks_interval
    if tasks_interval is None:
        tasks_interval = eval_interval
        if cfg.eval.eval_tasks:
            why["eval_tasks_interval"] = "auto: the eval interval"
    return BatchPlan(
        micro_batch=micro,
        grad_accum=accum,
        world_size=info.world_size,
        dp_size=info.dp_size if info.dp_size != info.world_size else 0,
        block_size=t.block_size,
        tokens_per_step=tokens_per_step,
        total_steps=total_steps,
        train_tokens=train_tokens,
        epochs=total_steps * tokens_per_step / max(1, train_tokens),
        stop_rule=rule,
        warmup_steps=min(warmup, total_steps),
        eval_interval=eval_interval,
        save_interval=save_interval,
        why=why,
        tp=info.tp,
        tasks_interval=tasks_interval,
        eval_block=data.dataset.longest_window("val", t.block_size) if data.manifest is not None else None,
    )


def _fit_epochs(
    micro: int, accum: int, tokens: float, row_tokens: int, why: dict[str, str]
) -> tuple[int, int]:
    """An automatic batch cut so that the epochs asked for (``tokens`` of training) hold at least
    MIN_USEFUL_STEPS steps: a global batch larger than a small corpus would take it twice or more in one step
    (one epoch planned as 2, even 4), with too few steps for the schedule. Returns (micro-batch, accumulation)."""
    from gptoughts.training.plan import MIN_USEFUL_STEPS

    rows = max(1, int(tokens // (MIN_USEFUL_STEPS * row_tokens)))  # rows each rank reads per step
    if micro * accum <= rows:
        return micro, accum
    micro = min(micro, rows)
    accum = max(1, rows // micro)
    why["grad_accum"] = (
        f"{accum}, with micro-batch {micro}: the automatic batch cut so that {tokens:,.0f} tokens of training "
        f"(the epochs asked for) are at least {MIN_USEFUL_STEPS} steps"
    )
    return micro, accum


def _largest_fitting(
    cfg: Config, env: Environment, model: Model, candidates: list[int], default: int = 8
) -> tuple[int, float | None, float | None]:
    """(micro-batch, its estimated peak GiB, the device's GiB): the largest of ``candidates`` whose estimate fits
    90% of the device's memory (the smallest when none does: the memory check then refuses the run); ``default``
    where there is no estimate or no memory figure."""
    from gptoughts.training.plan import device_memory_gib, estimate_peak

    mem = device_memory_gib(env)
    best, peak = candidates[0], None
    for b in candidates:
        e = estimate_peak(cfg, env, model, b, cfg.train.block_size, env.dist.world_size, env.dist.tp)
        if e is None or not mem:
            return default, None, mem
        if b > candidates[0] and e.total_gib > 0.9 * mem:
            break
        best, peak = b, e.total_gib
    return best, peak, mem


def _cpu_micro_batch(cfg: Config, env: Environment, model: Model) -> tuple[int, str]:
    """``batch_size = auto`` off CUDA, and why: no trial steps (the memory search needs a GPU's allocator), so the
    largest of 1, 2, 4, 8 rows (8: the CPU default) whose estimated peak fits 90% of the memory available."""
    micro, peak, mem = _largest_fitting(cfg, env, model, [1, 2, 4, 8])
    if peak is None or not mem:
        return micro, f"auto on a {env.device.type.upper()}: {micro}, the default (no memory estimate here)"
    return micro, (
        f"auto on a {env.device.type.upper()}: the largest of 1, 2, 4, 8 rows whose estimated peak "
        f"(~{plan_gib(peak)}) fits 90% of the {plan_gib(mem)} available"
    )


def data_packing(cfg: Config, model: Model) -> bool:
    """SFT packing, unless the model is a generic transformers model (no per-document attention masks)."""
    return bool(cfg.data.packing and not (model.pretrained is not None and model.pretrained.generic))


# ------------------------------------------------------------------------------------------------ assembly
@dataclass
class Assembly:
    cfg: Config
    env: Environment
    data: Data
    model: Model
    batch: BatchPlan
    plan: RunPlan
    run_dir: Path
    resume_from: Path | None = None
    trainer: Any = None
    loader: Any = None
    metrics: Any = None
    plots: Any = None
    """plots.PlotWriter (rank 0): redraws RUN/plots/ after evaluations; its close draws the final ones."""
    sampler: Any = None
    resolved: dict[str, Any] = field(default_factory=dict)
    lock: Any = None
    threads: int | None = None
    """CPU runs: torch's thread count (run.json keeps it: a resume keeps it, and with it the same losses)."""

    def close(self) -> None:
        if self.plots is not None:
            self.plots.close()  # (after a failure too: the plots of a run that diverged are worth a look)
            self.plots = None
        for part in (self.metrics, self.loader):
            if part is not None:
                part.close()
        if self.lock is not None:
            self.lock.release()


def build(
    cfg: Config, *, dry_run: bool = False, env: Environment | None = None, tasks: Any = None
) -> Assembly:
    """The whole assembly (see the module docstring); ``env`` from :func:`setup_environment` (made here when
    None; the caller shuts the process group down with ``pdist.shutdown()``). ``tasks``: the files of
    ``eval.eval_tasks``, already read and checked by the caller (``gptoughts.tools.task_scorer.read_scorer``:
    that layer sits above this one), for the plan and the trainer."""
    if bool(cfg.eval.eval_tasks) != (tasks is not None):
        raise ValueError("build: pass tasks=read_scorer(cfg.eval.eval_tasks) exactly when eval_tasks is set")
    env = env or setup_environment(cfg)
    if env.dist.tp > 1 and cfg.model.init_from is None:  # refused before any data is prepared
        from gptoughts.parallel.tp import check_family

        check_family(cfg.model.family, env.dist.tp, lora=cfg.lora.enabled)
    run_dir = Path(cfg.run.out)
    if cfg.run.wandb and not dry_run:
        from gptoughts.training.metrics import check_wandb

        check_wandb()  # a missing package is refused before the run directory is touched
    lock = None
    resume_from, resumed_run = None, None
    if cfg.run.resume == "auto":  # before the lock, which would create the folder a refusal must not leave
        rundir.check_resumable(run_dir)
    if not dry_run:
        use_our_compile_cache()
        # 2. the run directory: locked first (one process per run), then checked; nothing written yet
        if env.dist.is_main:
            lock = rundir.RunLock.acquire(run_dir)
        try:
            resume_from, resumed_run = rundir.check(run_dir, cfg) if env.dist.is_main else (None, None)
        except BaseException:
            if lock is not None:
                lock.release()
            raise
        resume_from, resumed_run = pdist.broadcast_object((resume_from, resumed_run), env.dist)
        if cfg.run.resume == "auto" and resume_from is None and env.dist.is_main:
            from gptoughts.training.metrics import console

            console.print(
                f"{run_dir} has no checkpoint yet (the run stopped before its first save): its own "
                "config.toml starts again from step 0",
                highlight=False,
            )
    elif (run_dir / "config.toml").exists() and not cfg.run.resume and not cfg.run.overwrite:
        rundir.check(run_dir, cfg)  # the plan of a run that would be refused is a refusal too
    try:
        return _assemble(cfg, env, run_dir, dry_run, resume_from, resumed_run, lock, tasks)
    except BaseException:
        if lock is not None:
            lock.release()
        raise


def _assemble(
    cfg: Config,
    env: Environment,
    run_dir: Path,
    dry_run: bool,
    resume_from: Path | None,
    resumed_run: dict[str, Any] | None,
    lock: Any,
    tasks: Any = None,
) -> Assembly:
    from gptoughts.training.metrics import console

    # 3-6 first on estimates: the vocabulary and the corpus's size (nothing tokenized), the model on the meta
    # device, the micro-batch, the plan. A run that cannot fit is refused here, before anything heavy is done.
    data = prepare_data(cfg, env, dry_run=True)
    model = build_model(cfg, env, data, meta=True)
    cfg, env = choose_memory_layout(cfg, env, model, dry_run=dry_run)  # 4b: what the later steps build
    batch = plan_batches(cfg, env, data, model, dry_run=True, resumed_run=resumed_run)
    threads = _given_threads(cfg, env, resumed_run)  # None: measured after the plan is printed
    why = _threads_why(env, threads, dry_run)
    resolved, plan = _plan(cfg, env, data, model, batch, run_dir, resume_from, tasks, why)
    if not dry_run and not cfg.perf.ignore_memory_estimate:
        # rank 0's verdict for all: each rank reads a CPU's available memory at a slightly different moment
        refusal = pdist.broadcast_object(memory_refusal(plan, on_cpu=env.device.type == "cpu"), env.dist)
        if refusal:
            if env.dist.is_main:
                console.print(plan.format(), highlight=False)
            raise UserError(refusal)
    if not dry_run:
        if threads is not None:
            torch.set_num_threads(threads[0])
        # the real shards: prepared, or their checksums verified (SFT examples were made whole above)
        if data.format == "text":
            data = prepare_data(cfg, env)  # 3
        if resume_from is not None and (run_dir / "tokenizer").exists():
            rundir.check_tokenizer(run_dir, data.tokenizer, cfg)
    _check_corpus(cfg, data)
    if not dry_run:
        model = build_model(cfg, env, data)  # 4
        batch = plan_batches(cfg, env, data, model, resumed_run=resumed_run)  # 5
        resolved, plan = _plan(cfg, env, data, model, batch, run_dir, resume_from, tasks, why)  # 6
    if env.dist.is_main:
        console.print(plan.format(), highlight=False)
    if threads is None and not dry_run and _single_cpu_process(env):
        # After the plan: on a CPU the probe's forward+backward steps are the first thing that takes a while.
        step, probe_tokens = _probe_step(cfg, model, data)
        count, how, step_s = hardware.measure_cpu_threads(step)
        threads = (count, how)
        resolved["threads"] = f"{count} ({how})"
        # The probe's speed at the chosen count is a better guess of the run's than the matmul-based one
        plan.retime(probe_tokens / step_s, "the thread probe's forward+backward at this count")
        if env.dist.is_main:
            console.print(plan.threads_line() + "\n  " + plan.time_line(), highlight=False)
    asm = Assembly(
        cfg=cfg,
        env=env,
        data=data,
        model=model,
        batch=batch,
        plan=plan,
        run_dir=run_dir,
        resume_from=resume_from,
        resolved=resolved,
        lock=lock,
        threads=threads[0] if threads is not None and not dry_run else None,
    )
    if dry_run:
        return asm
    return make_trainer(asm, tasks)  # 7-8


def make_trainer(asm: Assembly, tasks: Any = None) -> Assembly:
    """Steps 7 and 8: the optimizer, schedule, loaders and sampler, the resumed state (checked to fit this run before
    anything is written), the run directory, then the metrics and plots, and the Trainer with its components.
    ``tasks``: the files of ``eval.eval_tasks`` (see :func:`build`)."""
    from gptoughts.config import check_train_ranges
    from gptoughts.training.checkpointer import Checkpointer, grad_scaler
    from gptoughts.training.metrics import MetricsLogger, console
    from gptoughts.training.plots import PlotWriter
    from gptoughts.training.state import TrainState

    cfg, env, model, batch, run_dir = asm.cfg, asm.env, asm.model, asm.batch, asm.run_dir
    t = replace(cfg.train, batch_size=batch.micro_batch, grad_accum=batch.grad_accum)
    evaluation = replace(
        cfg.eval, eval_interval=batch.eval_interval, eval_tasks_interval=batch.tasks_interval
    )
    checkpointing = replace(cfg.checkpoint, save_interval=batch.save_interval)
    check_train_ranges(t, evaluation, checkpointing, cfg.recovery)  # with the plan's values
    # 7. optimizer, schedule, loaders, sampler: still nothing written
    optimizer = train_optimizer(cfg, env, model, t)
    asm.loader, eval_fn = make_loaders(cfg, env, asm.data, model, t, batch.eval_block)
    asm.sampler = _sampler(cfg, asm.data, model)
    resumed = None
    if asm.resume_from is not None:  # read and checked before anything of the run directory is rewritten
        asm.resume_from, resumed = load_resume_checkpoint(cfg, env, model, run_dir, asm.resume_from)
    # Masked-diffusion objectives draw their noise from torch's global RNG (checkpoints save and restore it);
    # seeding it here, after any autobatch probe, makes a run reproducible from train.seed. Data-parallel ranks
    # differ so that they draw different masks; the ranks of a tensor-parallel group read the same rows and must
    # draw the same ones.
    torch.manual_seed(t.seed + env.dist.dp_rank)
    bound = _bind_tasks(tasks, asm, t)
    scaler = grad_scaler(env.device, env.precision)
    state = TrainState()
    checkpointer = Checkpointer(
        run_dir / "checkpoints",
        checkpointing,
        model=model.built.model,
        weights=model.weights,
        optimizer=optimizer,
        loader=asm.loader,
        scaler=scaler,
        pipeline=model.built.pipeline,
        dist=env.dist,
        device=env.device,
    )
    if resumed is not None:  # the state must fit this run (optimizer, loader, RNG) before anything is written
        checkpointer.load_state_dict(resumed, state)
    # 8. the run directory: written only now that everything has been checked
    if env.dist.is_main:
        write_run_files(asm)
    pdist.barrier(env.dist)
    asm.metrics = MetricsLogger(
        run_dir,
        enabled=env.dist.is_main,
        tensorboard=cfg.run.tensorboard,
        wandb=cfg.run.wandb,
        wandb_project=cfg.run.wandb_project,
        config=cfg.to_dict(),
        resume_step=int(state.step) if resumed is not None else None,
    )
    asm.plots = PlotWriter(run_dir) if env.dist.is_main else None
    asm.trainer = _trainer(asm, t, evaluation, state, optimizer, eval_fn, checkpointer, scaler, bound)
    if resumed is not None and env.dist.is_main:
        console.print(f"resumed from {asm.resume_from} at step {int(state.step)}")
    return asm


def _sampler(cfg: Config, data: Data, model: Model) -> Any:
    from gptoughts.sampling import Sampler

    return Sampler(
        model.raw,
        data.tokenizer,
        diffusion=model.family.objective == "diffusion",
        chat=data.format == "sft",
        max_new_tokens=cfg.eval.sample_max_new_tokens,
        temperature=cfg.eval.sample_temperature,
        top_k=cfg.eval.sample_top_k,
    )


def _bind_tasks(tasks: Any, asm: Assembly, t: TrainConfig) -> Any:
    """The task scorer of the run, or None. Task sequences are scored in batches of at most the training micro-batch
    (its [rows, block] activations fit; the full-vocabulary logits of 8 rows are the eval command's batch)."""
    if tasks is None:
        return None
    return tasks.bind(
        asm.data.tokenizer,
        max_len=t.block_size,
        batch_size=min(8, asm.batch.micro_batch),
        diffusion=asm.model.family.objective == "diffusion",
        family=asm.model.family.name,
    )


def _trainer(
    asm: Assembly,
    t: TrainConfig,
    evaluation: Any,
    state: Any,
    optimizer: Any,
    eval_fn: Any,
    checkpointer: Any,
    scaler: Any,
    tasks: Any,
) -> Any:
    """The Trainer of the run and its recovery and evaluator, on ``state``."""
    from gptoughts.training.evaluation import Evaluator
    from gptoughts.training.optim import Schedule
    from gptoughts.training.recovery import Recovery
    from gptoughts.training.trainer import Trainer

    cfg, env, model, batch, built = asm.cfg, asm.env, asm.model, asm.batch, asm.model.built
    common = {"metrics": asm.metrics, "dist": env.dist, "device": env.device, "precision": env.precision}
    recovery = Recovery(
        state,
        cfg.recovery,
        checkpointer=checkpointer,
        grad_accum=t.grad_accum,
        # The collapse check: ln(vocab) is the loss of a uniform prediction.
        vocab_size=getattr(model.args, "vocab_size", None),
        **common,
    )
    evaluator = Evaluator(
        state,
        evaluation,
        model=built.model,
        objective=model.objective,
        batches=eval_fn,
        run_dir=asm.run_dir,
        forward_context=built.forward_context,
        pipeline=built.pipeline,
        sampler=asm.sampler if built.pipeline is None else None,
        tasks=tasks,
        plots=asm.plots,
        **common,
    )
    return Trainer(
        model=built.model,
        objective=model.objective,
        optimizer=optimizer,
        schedule=Schedule(
            t.schedule,
            t.learning_rate,
            batch.total_steps,
            batch.warmup_steps,
            t.min_lr_ratio,
            t.decay_fraction,
        ),
        loader=asm.loader,
        cfg=t,
        total_steps=batch.total_steps,
        tokens_per_step=batch.tokens_per_step,
        state=state,
        checkpointer=checkpointer,
        recovery=recovery,
        evaluator=evaluator,
        scaler=scaler,
        weights=model.weights,
        pipeline=built.pipeline,
        forward_context=built.forward_context,
        after_optimizer_step=built.after_optimizer_step,
        keep_grads=built.keep_grads,
        static_token_count=asm.data.sft is None,
        mfu_per_token_s=_mfu_per_token_s(env, model, t.block_size),
        progress=cfg.run.progress,
        profile_dir=asm.run_dir / "profile",
        **common,
    )


def choose_memory_layout(
    cfg: Config, env: Environment, model: Model, *, dry_run: bool
) -> tuple[Config, Environment]:
    """The memory layout that fits this GPU (``perf/layout.py``: activation checkpointing, optimizer states, CPU
    offload, among the settings the user left to their defaults), decided once on the meta model's estimates and
    applied to the config, with why in ``cfg.resolved`` (the plan prints it); offload also starts the process group
    of one it needs. A run that nothing fits is refused here, before anything heavy, unless
    ``--ignore_memory_estimate`` (or a dry run: its plan warns)."""
    from gptoughts.training.plan import layout_search

    search = layout_search(cfg, env, model)
    if search is None:
        return cfg, env
    # rank 0's choice for all: the host memory each rank reads differs by a little
    choice = pdist.broadcast_object(search.choose(), env.dist)
    if choice.refusal and not dry_run and not cfg.perf.ignore_memory_estimate:
        raise UserError(choice.refusal)
    if choice.layout == search.start:
        return cfg, env
    cfg = replace(choice.layout.apply(cfg, search.start), resolved={**cfg.resolved, **choice.why})
    if choice.layout.cpu_offload and not env.dist.cpu_offload:
        par = cfg.parallel
        dist = (
            replace(env.dist, strategy="fsdp", cpu_offload=True)  # a dry run trains nothing: no process group
            if dry_run
            else pdist.init(
                env.device, par.backend, par.strategy, 1, 1, True, ddp_bucket_mb=par.ddp_bucket_mb
            )
        )
        env = replace(env, dist=dist)
    return cfg, env


def layout_refusal(cfg: Config, env: Environment, model: Model, lead: str) -> str:
    """The refusal of a run that does not fit, led by ``lead``: the memory each way out would need (estimates), or
    the ways out alone where the run has no estimate."""
    from gptoughts.training.plan import GPU_FIXES, layout_search

    search = layout_search(cfg, env, model)
    return search.refusal(lead) if search is not None else f"{lead}: {GPU_FIXES}"


def _plan(
    cfg: Config,
    env: Environment,
    data: Data,
    model: Model,
    batch: BatchPlan,
    run_dir: Path,
    resume_from: Path | None,
    tasks: Any,
    threads: str | None,
) -> tuple[dict[str, Any], RunPlan]:
    """Every ``auto`` resolved (with why) and the run's plan, from what steps 3-5 decided; ``threads``: the CPU
    thread count and why, when known before the plan."""
    if model.built is not None and model.built.whole_model_auto:
        _whole_model_for_long_runs(env, model, batch)
    built = (
        {}
        if model.built is None
        else {
            k: f"{v} ({model.built.why[k]})" if k in model.built.why else str(v)
            for k, v in model.built.resolved.items()
        }
    )
    # (the config's own last: the memory layout's reasons replace the "asked" of the values it set)
    resolved = {**env.resolved, **built, **batch.why, **cfg.resolved}
    if env.dist.pp > 1:
        from gptoughts.parallel import pp

        par = cfg.parallel
        pp_micro = pp.microbatches(
            batch.micro_batch * batch.grad_accum, env.dist.pp, par.pp_schedule, par.pp_microbatches
        )
        split = pp.split_layers(
            model.args.n_layers, pp.stages_of(env.dist.pp, par.pp_schedule), par.pp_layers
        )
        resolved["pipeline"] = pp.describe(split, env.dist.pp, par.pp_schedule, pp_micro)
        if model.built is not None:
            model.built.pipeline.n_micro = pp_micro
    if model.raw is not None:
        from gptoughts.training.optim import describe_states
        from gptoughts.training.setup import optimizer_rule

        name, why = optimizer_rule(model.raw, cfg.train)
        t = cfg.train
        lr = f"peak lr {t.learning_rate:.1e}" + (
            f" (Muon {t.muon_learning_rate:.1e})" if name == "muon" and t.muon_learning_rate else ""
        )
        if "learning_rate" in cfg.resolved:
            lr += f" ({cfg.resolved['learning_rate']})"
        states = describe_states(t.optimizer_states) + (" for the AdamW groups" if name == "muon" else "")
        resolved["optimizer"] = f"{name} ({states}), {lr}, {t.schedule} schedule ({why})"
    if threads is not None:
        resolved["threads"] = threads
    plan = make_plan(
        cfg,
        env=env,
        data=data,
        model=model,
        batch=batch,
        run_dir=run_dir,
        resume_from=resume_from,
        resolved=resolved,
        tasks=tasks,
    )
    return resolved, plan


def _check_corpus(cfg: Config, data: Data) -> None:
    if data.format == "text" and not data.estimated and data.corpus["tokens"] < cfg.train.block_size + 1:
        raise DataError(
            f"the corpus has {data.corpus['tokens']:,} training tokens, fewer than one block of "
            f"{cfg.train.block_size + 1:,}; lower --block_size or add data"
        )


def _threads_why(env: Environment, threads: tuple[int, str] | None, dry_run: bool) -> str | None:
    """The plan's thread line before the run starts: the count given and why, what a dry run's run would measure,
    or None (measured after the plan, or not ours to choose)."""
    if threads is not None:
        return f"{threads[0]} ({threads[1]})"
    if dry_run and _single_cpu_process(env):
        return (
            f"measured when the run starts: the faster of 1 and {hardware.cpu_cores()} on a short forward+backward "
            "(--threads N sets it)"
        )
    return None


def _single_cpu_process(env: Environment) -> bool:
    """A CPU run in one process: it chooses its thread count (under torchrun, the launcher's OMP_NUM_THREADS)."""
    return env.device.type == "cpu" and not env.dist.enabled


def _given_threads(
    cfg: Config, env: Environment, resumed_run: dict[str, Any] | None
) -> tuple[int, str] | None:
    """(count, why) of a one-process CPU run whose thread count is given (hardware.given_cpu_threads); None when
    it is measured, or not ours to choose."""
    if not _single_cpu_process(env):
        return None
    run = resumed_run or {}
    kept = run.get("threads")
    resolved = run.get("resolved")
    if kept is None and isinstance(
        resolved, dict
    ):  # a run.json with the count in its text only: "2 (measured...)"
        first = str(resolved.get("threads", "")).split(" ")[0]
        kept = int(first) if first.isdigit() else None
    return hardware.given_cpu_threads(cfg.perf.threads, kept if isinstance(kept, int) and kept > 0 else None)


def _whole_model_for_long_runs(env: Environment, model: Model, batch: BatchPlan) -> None:
    """``compile_mode = auto``: a run estimated shorter than ``WHOLE_MODEL_MIN_RUN_S`` trains on the per-block
    graphs (the whole model's compile would cost more than its faster steps gain)."""
    from gptoughts.training.plan import estimate_speed
    from gptoughts.training.setup import WHOLE_MODEL_MIN_RUN_S

    tps, _ = estimate_speed(env, model, batch.block_size, batch.micro_batch, env.dist.world_size)
    if not tps:
        model.built.use_per_block("auto: the run's length cannot be estimated on this GPU (unknown peak)")
        return
    run_s = batch.total_steps * batch.tokens_per_step / tps
    if run_s < WHOLE_MODEL_MIN_RUN_S:
        model.built.use_per_block(
            f"auto: a run estimated at ~{max(1, round(run_s / 60))} min (the whole model's compile repays from "
            f"~{WHOLE_MODEL_MIN_RUN_S // 60} min)"
        )


def _mfu_per_token_s(env: Environment, model: Model, block_size: int) -> float | None:
    """FLOPs per token over the bf16 peak of every GPU of the run: MFU = tokens/s x this (None off CUDA)."""
    peak = env.hw.peak_bf16_flops if env.device.type == "cuda" else None
    return model.raw.flops_per_token(block_size) / (peak * env.dist.world_size) if peak else None


def load_resume_checkpoint(
    cfg: Config, env: Environment, model: Model, run_dir: Path, path: Path
) -> tuple[Path, dict[str, Any]]:
    """Weights and trainer state of the checkpoint to resume. With ``--resume auto`` a checkpoint that verifies
    but cannot be read (forged or corrupt state.pt or weights) is skipped for the previous one, as a corrupt one
    is; when none is left, or for an explicit ``--resume PATH``, the run is refused with nothing changed."""
    from gptoughts.training.metrics import console

    while True:
        try:
            if model.built.pipeline is not None:
                if ckpt.is_dcp(path):
                    raise UserError(
                        f"{path} is a sharded checkpoint (an FSDP or tensor-parallel run's); a pipeline run "
                        "cannot load one yet: resume it without --parallel.pp"
                    )
                model.built.pipeline.load_weights(ckpt.read_model_file(path), path)
            else:
                ckpt.load_weights(model.weights, path, sharded=env.dist.sharded)
            # FSDP: the full optimizer state stays in host memory; each rank copies only its shard to the GPU
            return path, ckpt.load_state(path, "cpu" if env.dist.sharded else env.device)
        except ckpt.UnreadableCheckpoint as e:
            older = (
                ckpt.latest_valid(run_dir / "checkpoints", before=ckpt.step_of(path))
                if cfg.run.resume == "auto"
                else None
            )
            if older is None:
                raise UserError(
                    f"{e}; no earlier usable checkpoint: nothing was changed (restore the checkpoint, "
                    "or start over with --overwrite)"
                ) from None
            if env.dist.is_main:
                console.print(f"[yellow]warning:[/yellow] {e}; falling back to {older.name}", highlight=False)
            path = older


# Tokens of the thread-count probe's forward+backward: enough for the cores to share real matmuls, few enough that
# the probe takes seconds where the run's own micro-batch may take minutes (four forward+backward passes of a 125m
# model's 8 x 2048 micro-batch: ~6 minutes on 2 cores).
PROBE_TOKENS = 512


def _probe_step(cfg: Config, model: Model, data: Data) -> tuple[Any, int]:
    """One forward+backward of the real model on at most :data:`PROBE_TOKENS` tokens (CPU thread-count probe), and
    the tokens it reads."""
    block = min(cfg.train.block_size, PROBE_TOKENS)
    micro = cfg.train.batch_size if isinstance(cfg.train.batch_size, int) else 8
    rows = max(1, min(micro, PROBE_TOKENS // block))
    vocab = model.args.vocab_size if hasattr(model.args, "vocab_size") else data.vocab_size

    def step() -> None:
        # The probe must leave no trace: it runs in eval mode (a training forward records statistics, e.g.
        # DeepSeek's expert loads for the next bias update), restores the buffers, drops its gradients and
        # draws its tokens from a generator of its own.
        saved = {n: b.detach().clone() for n, b in model.raw.named_buffers()}
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, min(vocab, data.vocab_size), (rows, block + 1), generator=g)
        model.built.model.eval()
        try:
            with model.built.per_block():  # under whole-model compile: not a graph the run never uses
                loss, _ = model.objective(model.built.model, (x[:, :-1], x[:, 1:]))
            loss.backward()
        finally:
            model.built.model.train()
            model.built.model.zero_grad(set_to_none=True)
            with torch.no_grad():
                for n, b in model.raw.named_buffers():
                    b.copy_(saved[n])

    return step, rows * block


def make_loaders(
    cfg: Config, env: Environment, data: Data, model: Model, t: TrainConfig, eval_block: int | None = None
) -> tuple[Any, Any]:
    """The training loader (resumable, rank-aware) and the evaluation batches (None without held-out data).
    ``eval_block``: the evaluation windows' length (BatchPlan.eval_block; None: the block)."""
    from gptoughts.data.loader import BatchLoader, eval_batches
    from gptoughts.data.sft import SFTLoader

    info, device = env.dist, env.device
    if data.sft is not None:
        sft, packing = data.sft, data_packing(cfg, model)
        if not packing and cfg.data.packing and info.is_main:
            from gptoughts.training.metrics import console

            console.print(
                "note: packed rows need the native fast path; one SFT example per row", highlight=False
            )
        loader: Any = SFTLoader(
            sft,
            batch_size=t.batch_size,
            seed=t.seed,
            rank=info.dp_rank,
            world_size=info.dp_size,
            packing=packing,
            device=device,
        )
        eval_fn = (
            (
                lambda: sft.eval_batches(
                    batch_size=t.batch_size, max_batches=cfg.eval.eval_batches, packing=packing, device=device
                )
            )
            if len(sft.val_idx)
            else None
        )
        return loader, eval_fn
    dataset = data.dataset
    loader = BatchLoader(
        dataset,
        split="train",
        batch_size=t.batch_size,
        block_size=t.block_size,
        seed=t.seed,
        rank=info.dp_rank,
        world_size=info.dp_size,
        phases=phases(cfg),
        device=device,
    )
    # A held-out split shorter than a block is evaluated in shorter windows (the plan says so), never skipped.
    window = t.block_size if eval_block is None else eval_block
    eval_fn = (
        (
            lambda: eval_batches(
                dataset,
                split="val",
                batch_size=t.batch_size,
                block_size=window,
                max_batches=cfg.eval.eval_batches,
                device=device,
            )
        )
        if window > 0
        else None
    )
    return loader, eval_fn


def phases(cfg: Config) -> list | None:
    if not cfg.data.phases:
        return None
    from gptoughts.data.loader import Phase

    out = []
    known = resolve_sources(cfg.data.sources)
    for p in cfg.data.phases:
        srcs = resolve_sources(p.sources)
        for s in srcs:
            if s not in known:
                raise ConfigError(
                    f"data.phases `{p.name}` uses {s}, which is not in data.sources; add it there"
                )
        # Bare sources are weighted by their token counts; explicit weights are used as given.
        out.append(
            Phase(name=p.name, sources=list(zip(srcs, p.weights)) if p.weights else srcs, tokens=p.tokens)
        )
    return out


def write_run_files(asm: Assembly) -> None:
    """config.toml (sources and task files as absolute paths: the file can be moved and still resumes),
    tokenizer/, run.json (with the plan). Called once everything has been validated."""
    cfg, env, model, data, run_dir = asm.cfg, asm.env, asm.model, asm.data, asm.run_dir
    if asm.resume_from is None and rundir.is_run(run_dir):
        # --overwrite, or --resume auto on a run killed before its first checkpoint: it starts over, and what it
        # wrote before (metrics rows, samples) goes, so that nothing is counted twice
        rundir.clear(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    saved = replace(
        cfg,
        data=replace(cfg.data, sources=[_absolute(s) for s in cfg.data.sources]),
        eval=replace(
            cfg.eval,
            eval_tasks=[_absolute(s) if is_task_file(s) else s for s in cfg.eval.eval_tasks],
            eval_task_dir=_absolute(cfg.eval.eval_task_dir) if cfg.eval.eval_task_dir else None,
        ),
        run=replace(cfg.run, resume=None, overwrite=False),
    )
    raw = model.raw
    record = {
        "gptoughts": 1,
        "family": model.family.name,
        "args": asdict(model.args) if hasattr(model.args, "__dataclass_fields__") else {},
        "device": str(env.device),
        "precision": env.precision,
        "world_size": env.dist.world_size,
        "dp_size": env.dist.dp_size,
        "params": raw.num_params(),
        "hardware": env.hw.to_dict(),
        "data": str(data.manifest.dir) if data.manifest is not None else data.sources,
        "data_format": data.format,
        "init_from": str(data.init_from) if data.init_from is not None else None,
        "generic": bool(model.pretrained is not None and model.pretrained.generic),
        "lora": cfg.lora.enabled,
        "trainable_params": sum(p.numel() for p in raw.parameters() if p.requires_grad),
        "tokens_per_step": asm.batch.tokens_per_step,
        "threads": asm.threads,
        "plan": asm.plan.to_dict(),
        "resolved": asm.resolved,
        "torch": torch.__version__,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    # run.json first: it is what makes the folder a run, so that a kill before the rest is written leaves one
    # that --overwrite may replace (and that --resume auto refuses, naming the missing config.toml)
    rundir.write_text_atomic(run_dir / "run.json", json.dumps(record, indent=2, default=str))
    rundir.write_text_atomic(run_dir / "config.toml", to_toml(saved))
    data.tokenizer.save(run_dir / "tokenizer")


def _absolute(source: str) -> str:
    if source.startswith("@"):
        return source
    p = Path(source).expanduser()
    return str(p.resolve()) if p.exists() else source


# ------------------------------------------------------------------------------- timing (bench, tune, scripts)
def synthetic_data(vocab_size: int, init_from: Path | None = None, tokenizer: Any = None) -> Data:
    """Stand-in data for timing runs (random tokens): the vocabulary the model is built for, no corpus."""
    return Data(
        sources=[],
        format="text",
        tokenizer=tokenizer,
        init_from=init_from,
        corpus={"vocab": vocab_size, "tokens": 1 << 40, "files": 0, "bytes": 0, "bytes_read": 0},
    )


def train_optimizer(cfg: Config, env: Environment, model: Model, t: TrainConfig) -> Any:
    """The run's optimizer; under pipeline parallelism also the order in which a one-process run's optimizer holds
    the parameters (its checkpoints key them by index): an optimizer over the whole model, built but never stepped
    (no state is allocated; unfused: the parameters a rank does not hold are on the meta device)."""
    from gptoughts.training.setup import make_optimizer

    optimizer = make_optimizer(model.built.model, t, cfg.perf, env.device)
    if model.built.pipeline is not None:
        names = {id(p): n for n, p in model.raw.named_parameters()}
        whole = make_optimizer(model.raw, t, replace(cfg.perf, fused_adamw=False), env.device)
        model.built.pipeline.param_order = [names[id(p)] for g in whole.param_groups for p in g["params"]]
    return optimizer


def check_optimizer_states(t: TrainConfig, dist: pdist.DistInfo) -> None:
    """``train.optimizer_states = 8bit`` where torchao's AdamW8bit is missing or not known to work: refused in one
    line. Its states are tensor subclasses that our sharded (DCP) checkpoints do not read back, and that tensor
    parallelism's mix of plain tensors and DTensors was never tried with."""
    if t.optimizer_states != "8bit":
        return
    import importlib.util

    from gptoughts.training.optim import TORCHAO_MISSING

    if importlib.util.find_spec("torchao") is None:  # said here, before the data is prepared
        raise UserError(TORCHAO_MISSING)
    if dist.sharded or dist.tp > 1 or dist.pp > 1:
        raise UserError(
            "train.optimizer_states = 8bit runs on one GPU or under DDP; under FSDP, tensor or pipeline "
            "parallelism use --train.optimizer_states bf16"
        )


def timing_trainer(
    cfg: Config, env: Environment, model: Model, loader: Any, batch: BatchPlan, *, timing: bool = True
) -> Any:
    """The trainer of a timing run: the real train_step (precision, fused AdamW, clipping, accumulation), no run
    directory, metrics, checkpoints, recovery or evaluation (what ``bench``, ``tune`` and bench/finetune_vs_peft.py
    time)."""
    from gptoughts.training.checkpointer import grad_scaler
    from gptoughts.training.metrics import MetricsLogger
    from gptoughts.training.optim import Schedule
    from gptoughts.training.trainer import Trainer

    t = replace(cfg.train, batch_size=batch.micro_batch, grad_accum=batch.grad_accum)
    optimizer = train_optimizer(cfg, env, model, t)
    return Trainer(
        model=model.built.model,
        objective=model.objective,
        optimizer=optimizer,
        schedule=Schedule("constant", t.learning_rate, 1 << 40, 0),
        loader=loader,
        cfg=t,
        dist=env.dist,
        device=env.device,
        precision=env.precision,
        scaler=grad_scaler(env.device, env.precision),
        metrics=MetricsLogger(Path("."), enabled=False),
        total_steps=1 << 40,
        tokens_per_step=batch.tokens_per_step,
        forward_context=model.built.forward_context,
        after_optimizer_step=model.built.after_optimizer_step,
        keep_grads=model.built.keep_grads,
        timing=timing,
    )
