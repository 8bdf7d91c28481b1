"""The Python API: ``train``, ``load``, ``generate_text``, ``evaluate``. The CLI is a thin layer over these."""

from __future__ import annotations

import json
import math
import shutil
import sysconfig
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gptoughts import models
from gptoughts.config import Config, config_from_toml_text, load_config, to_toml
from gptoughts.errors import ConfigError, DataError, UserError
from gptoughts.models.hf import HFArgs, HFCausalLM, is_hf_folder, load_pretrained
from gptoughts.parallel import dist as pdist
from gptoughts.perf import hardware
from gptoughts.train import checkpoint as ckpt

STDLIB = "@stdlib"
# Stands for "a transformers model without native code" where the pipeline expects a Family (objective, name);
# not registered in models.FAMILIES: it cannot be built from args, only loaded from a folder.
GENERIC_FAMILY = models.Family("hf", HFCausalLM, HFArgs, {}, objective="causal")


def stdlib_path() -> Path:
    """The running interpreter's standard library source: the embedded default corpus."""
    return Path(sysconfig.get_paths()["stdlib"])


def resolve_sources(sources: list[str]) -> list[str]:
    if not sources:
        raise ConfigError("no training data: pass --data PATH (a file, folder, .jsonl, .parquet or saved HF dataset)")
    return [str(stdlib_path()) if s == STDLIB else s for s in sources]


def round_up(n: int, multiple: int) -> int:
    return ((n + multiple - 1) // multiple) * multiple


@dataclass
class History:
    """What ``train`` returns besides the model and tokenizer (the INL guide's ``history``)."""

    steps: int = 0
    tokens: int = 0
    val_loss: list[float] = field(default_factory=list)
    val_ppl: list[float] = field(default_factory=list)
    eval_steps: list[int] = field(default_factory=list)
    final_val_loss: float = math.nan
    final_val_ppl: float = math.nan
    sample: str = ""
    run_dir: str = ""
    stop_reason: str = ""


# ------------------------------------------------------------------------------------------------ run dir

def _check_run_dir(run_dir: Path, cfg: Config) -> Path | None:
    """Refuse to clobber another run. Returns the checkpoint to resume from (or None)."""
    cfg_file = run_dir / "config.toml"
    has_run = cfg_file.exists() or (run_dir / "checkpoints").exists()
    resume = cfg.run.resume
    if resume and resume != "auto":
        return ckpt.resolve(resume)
    if not has_run:
        if run_dir.exists() and any(run_dir.iterdir()) and not cfg.run.overwrite:
            raise UserError(f"{run_dir} exists and is not empty; choose another --out or pass --overwrite")
        return None
    if resume == "auto":
        old = config_from_toml_text(cfg_file.read_text()) if cfg_file.exists() else None
        if old is not None and (old.model.family, old.model.size, old.model.overrides) != \
                (cfg.model.family, cfg.model.size, cfg.model.overrides):
            raise UserError(f"{run_dir} holds a run of model {old.model.family}/{old.model.size}; resuming it as "
                            f"{cfg.model.family}/{cfg.model.size} is impossible; use another --out")
        if old is not None and (old.model.init_from, old.lora.enabled) != (cfg.model.init_from, cfg.lora.enabled):
            raise UserError(f"{run_dir} fine-tunes {old.model.init_from} (LoRA {'on' if old.lora.enabled else 'off'})"
                            f"; resume it with the same --model and --lora, or use another --out")
        return ckpt.latest_valid(run_dir / "checkpoints")
    if cfg.run.overwrite:
        return None
    steps = ckpt.list_steps(run_dir / "checkpoints")
    where = f" (checkpoints up to step {steps[-1]})" if steps else ""
    raise UserError(f"{run_dir} already holds a run{where}; pass --resume auto to continue it, --overwrite to "
                    f"replace it, or choose another --out")


def _clear_run_dir(run_dir: Path) -> None:
    for name in ("checkpoints", "tensorboard", "metrics.jsonl", "samples.txt", "config.toml", "run.json",
                 "tokenizer", "wandb"):
        p = run_dir / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()


# -------------------------------------------------------------------------------------------------- train

def train(config: Config | str | None = None, *, data_path: str | list[str] | None = None, model: str | None = None,
          size: str | None = None, num_epochs: float | None = None, batch_size: int | str | None = None,
          learning_rate: float | None = None, save_dir: str | None = None, device: str | None = None,
          max_steps: int | None = None, **overrides: Any) -> tuple[nn.Module, Any, History]:
    """Train a model; returns ``(model, tokenizer, history)``.

    ``config`` is a Config, a preset name or a TOML path (default: the quickstart preset). The keyword
    arguments mirror the INL guide's ``train_inl_llm``; ``overrides`` take dotted keys as in the CLI
    (``train.warmup_steps=10`` is written ``**{"train.warmup_steps": 10}``).
    """
    if not isinstance(config, Config):
        kw: dict[str, Any] = {}
        if data_path is not None:
            kw["data.sources"] = [data_path] if isinstance(data_path, str) else list(data_path)
        for key, value in (("model.family", model), ("model.size", size), ("train.epochs", num_epochs),
                           ("train.batch_size", batch_size), ("train.learning_rate", learning_rate),
                           ("run.out", save_dir), ("perf.device", device), ("train.max_steps", max_steps)):
            if value is not None:
                kw[key] = value
        kw.update(overrides)
        config = load_config(config, kw)
    return run_training(config)


def finetune(config: Config | str | None = None, *, model_path: str | None = None,
             data_path: str | list[str] | None = None, lora: bool | None = None, num_epochs: float | None = None,
             batch_size: int | str | None = None, learning_rate: float | None = None, save_dir: str | None = None,
             device: str | None = None, max_steps: int | None = None, trust_remote_code: bool | None = None,
             **overrides: Any) -> tuple[nn.Module, Any, History]:
    """Fine-tune a local Hugging Face model folder (``model_path``) on ``data_path``; ``(model, tokenizer, history)``.

    The same pipeline as :func:`train` (``config`` defaults to the ``finetune`` preset): JSONL with
    prompt/response or messages trains on the responses only; plain text continues pretraining. ``lora=True``
    trains PEFT LoRA adapters (``lora.*`` overrides: ``**{"lora.r": 8}``).
    """
    if not isinstance(config, Config):
        kw: dict[str, Any] = {}
        if data_path is not None:
            kw["data.sources"] = [data_path] if isinstance(data_path, str) else list(data_path)
        for key, value in (("model.init_from", model_path), ("lora.enabled", lora), ("train.epochs", num_epochs),
                           ("train.batch_size", batch_size), ("train.learning_rate", learning_rate),
                           ("run.out", save_dir), ("perf.device", device), ("train.max_steps", max_steps),
                           ("model.trust_remote_code", trust_remote_code)):
            if value is not None:
                kw[key] = value
        kw.update(overrides)
        config = load_config(config if config is not None else "finetune", kw)
    if config.model.init_from is None:
        raise ConfigError("finetune needs a pretrained model: pass model_path (--model HF_DIR)")
    return run_training(config)


def run_training(cfg: Config) -> tuple[nn.Module, Any, History]:
    from gptoughts.data.loader import BatchLoader, TokenDataset, eval_batches
    from gptoughts.data.prepare import cached_prepare
    from gptoughts.data.sft import SFTData, SFTLoader, epoch_rows, resolve_format
    from gptoughts.data.tokenizer import Tokenizer
    from gptoughts.perf.autobatch import accumulation_for
    from gptoughts.train.metrics import MetricsLogger, console
    from gptoughts.train.optim import Schedule, default_warmup
    from gptoughts.train.setup import (
        TrainableWeights,
        apply_transforms,
        auto_micro_batch,
        build_raw_model,
        make_objective,
        make_optimizer,
    )
    from gptoughts.train.trainer import Trainer

    device = hardware.resolve_device(cfg.perf.device)
    # Before anything touches CUDA: the allocator reads its settings when it starts.
    hardware.apply_runtime_settings(device, tf32=cfg.perf.tf32, expandable_segments=cfg.perf.expandable_segments)
    info = pdist.init(device, cfg.parallel.backend, cfg.parallel.strategy)
    try:
        hw = hardware.detect(device)
        precision = hardware.resolve_precision(cfg.perf.precision, hw)
        run_dir = Path(cfg.run.out)
        resume_from = _check_run_dir(run_dir, cfg) if info.is_main else None
        resume_from = pdist.broadcast_object(resume_from, info)
        if cfg.run.resume and resume_from is None and info.is_main:
            console.print(f"no checkpoint to resume in {run_dir}; starting a new run")

        # ---- data: tokenizer and token shards (rank 0 prepares, the others read the cache)
        tok_spec: Any = cfg.data.tokenizer
        sources = resolve_sources(cfg.data.sources)
        init_from = _init_from_dir(cfg)
        if init_from is not None:  # fine-tuning: the pretrained model's own tokenizer, whatever data.tokenizer says
            tok_spec = str(init_from)
        data_format = resolve_format(cfg.data.format, sources)
        manifest = sft_data = None
        if data_format == "sft":  # every rank tokenizes the (small) SFT set itself: deterministic, no cache
            tokenizer: Tokenizer = _sft_tokenizer(tok_spec, sources)
            sft_data = SFTData(sources, tokenizer, block_size=cfg.train.block_size, truncation=cfg.data.truncation,
                               val_fraction=cfg.data.val_fraction, seed=cfg.train.seed)
        else:
            prep_kwargs = dict(text_field=cfg.data.text_field, extensions=cfg.data.extensions or None,
                               val_fraction=cfg.data.val_fraction, max_bytes=cfg.data.max_bytes,
                               seed=cfg.train.seed, cache_root=cfg.data.cache_dir)
            if info.is_main:
                manifest = cached_prepare(sources, tok_spec, progress=cfg.run.progress, **prep_kwargs)
            pdist.barrier(info)
            if not info.is_main:
                manifest = cached_prepare(sources, tok_spec, progress=False, **prep_kwargs)
            tokenizer = manifest.tokenizer()
        if resume_from is not None and (run_dir / "tokenizer").exists():
            saved = Tokenizer.load(run_dir / "tokenizer")
            if saved.fingerprint() != tokenizer.fingerprint():
                raise UserError(f"the tokenizer of {run_dir} differs from --tokenizer {cfg.data.tokenizer}; resume "
                                f"with the run's own setting (see {run_dir}/config.toml)")
        dataset = TokenDataset(manifest.dir) if manifest is not None else None

        # ---- model
        pretrained = None
        perf = cfg.perf
        if init_from is not None:
            pretrained, raw, perf = build_finetune_model(cfg, init_from, device, precision)
            if pretrained.generic and info.sharded:
                raise ConfigError(f"parallel.strategy = fsdp covers the native families; {init_from} runs on the "
                                  "generic transformers path (tied weights, generate): use DDP (the default)")
            if pretrained.notice and info.is_main:
                console.print(pretrained.notice, highlight=False)
            args = pretrained.model.args
            family = models.get_family(pretrained.family) if pretrained.family else GENERIC_FAMILY
            if args.vocab_size < tokenizer.vocab_size:
                raise DataError(f"the tokenizer of {init_from} has {tokenizer.vocab_size} tokens but the model only "
                                f"{args.vocab_size} embeddings; fix the model folder")
            if args.max_seq_len < cfg.train.block_size:
                raise ConfigError(f"--block_size {cfg.train.block_size} exceeds the {args.max_seq_len} positions of "
                                  f"{init_from}; lower it")
        else:
            family = models.get_family(cfg.model.family)
            overrides = dict(cfg.model.overrides)
            overrides.setdefault("vocab_size", round_up(tokenizer.vocab_size, 64))
            if family.objective == "diffusion":
                if tokenizer.mask_id is None:
                    raise ConfigError("LLaDA needs a mask token; use --tokenizer bpe:N or bytes (which reserve "
                                      "<|mask|>)")
                overrides.setdefault("mask_token_id", tokenizer.mask_id)
            args = models.model_args(family.name, cfg.model.size, overrides)
            if getattr(args, "vocab_size", tokenizer.vocab_size) < tokenizer.vocab_size:
                raise ConfigError(f"model.vocab_size = {args.vocab_size} is smaller than the tokenizer's "
                                  f"{tokenizer.vocab_size}; drop the override or raise it")
            if hasattr(args, "max_seq_len") and args.max_seq_len < cfg.train.block_size:
                args = replace(args, max_seq_len=cfg.train.block_size)
            raw = build_raw_model(family.name, args, device, cfg.train.seed)
        # What checkpoints hold: the whole model, or for LoRA only the adapters (the base is model.init_from).
        weights = TrainableWeights(raw) if cfg.lora.enabled else raw
        built = apply_transforms(raw, perf=perf, hw=hw, device=device, dist=info, precision=precision)

        # ---- batch size (auto: the largest that fits, then accumulation to reach the global batch)
        t = cfg.train
        objective = make_objective(family, built, cfg.perf)
        if not isinstance(t.batch_size, int) and info.sharded:
            raise ConfigError("train.batch_size = auto probes memory with trial steps, which a sharded (FSDP) run "
                              "cannot do safely (a rank out of memory would leave the others waiting in a "
                              "collective); pass --batch_size N (`gptoughts estimate --num_gpus N --strategy fsdp`)")
        if not isinstance(t.batch_size, int):
            parts = {"family": family.name, "args": _jsonable(args), "block": t.block_size, "gpu": hw.name,
                     "precision": precision, "resolved": built.resolved, "world": info.world_size}
            micro, cached = auto_micro_batch(built, objective, vocab_size=args.vocab_size, block_size=t.block_size,
                                             precision=precision, perf=cfg.perf, t=t, device=device, dist=info,
                                             parts=parts)
            if t.global_batch_tokens:
                # A micro-batch larger than the global batch would overshoot the target: cap it there.
                micro = max(1, min(micro, t.global_batch_tokens // (t.block_size * info.world_size)))
                accum = accumulation_for(t.global_batch_tokens, micro, t.block_size, info.world_size)
            else:
                accum = t.grad_accum
            t = replace(t, batch_size=micro, grad_accum=accum)
            if info.is_main:
                console.print(f"auto batch size: micro-batch {micro} x accumulation {accum}"
                              + (" (cached)" if cached else "") + (" (no GPU: fixed default)" if
                                                                     device.type != "cuda" else ""))
        tokens_per_step = t.batch_size * t.block_size * t.grad_accum * info.world_size
        packing = cfg.data.packing
        if sft_data is not None and packing and pretrained is not None and pretrained.generic:
            packing = False
            if info.is_main:
                console.print("note: packed rows need the native fast path; one SFT example per row", highlight=False)
        train_tokens = manifest.train_tokens if sft_data is None else \
            epoch_rows(sft_data, t.seed, packing) * t.block_size
        if t.max_steps is not None:
            total_steps = t.max_steps
        elif t.max_tokens is not None:
            total_steps = math.ceil(t.max_tokens / tokens_per_step)
        else:
            total_steps = math.ceil((t.epochs if t.epochs is not None else 1.0) * train_tokens / tokens_per_step)
        total_steps = max(1, total_steps)
        warmup = t.warmup_steps if t.warmup_steps is not None else default_warmup(total_steps)
        schedule = Schedule(t.schedule, t.learning_rate, total_steps, min(warmup, total_steps), t.min_lr_ratio,
                            t.decay_fraction)
        optimizer = make_optimizer(built.model, t, cfg.perf, device)

        if sft_data is not None:
            loader: Any = SFTLoader(sft_data, batch_size=t.batch_size, seed=t.seed, rank=info.rank,
                                    world_size=info.world_size, packing=packing, device=device)
            eval_fn = (lambda: sft_data.eval_batches(batch_size=t.batch_size, max_batches=t.eval_batches,
                                                     packing=packing, device=device)) if len(sft_data.val_idx) else None
        else:
            loader = BatchLoader(dataset, split="train", batch_size=t.batch_size, block_size=t.block_size,
                                 seed=t.seed, rank=info.rank, world_size=info.world_size, phases=_phases(cfg),
                                 device=device)
            has_val = dataset.num_tokens("val") > t.block_size
            eval_fn = (lambda: eval_batches(dataset, split="val", batch_size=t.batch_size, block_size=t.block_size,
                                            max_batches=t.eval_batches, device=device)) if has_val else None

        # ---- run dir
        if info.is_main:
            if cfg.run.overwrite and resume_from is None:
                _clear_run_dir(run_dir)
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "config.toml").write_text(to_toml(cfg))
            tokenizer.save(run_dir / "tokenizer")
            (run_dir / "run.json").write_text(json.dumps({
                "family": family.name, "args": _jsonable(args), "device": str(device), "precision": precision,
                "world_size": info.world_size, "params": raw.num_params(), "hardware": hw.to_dict(),
                "data": str(manifest.dir) if manifest is not None else sources, "data_format": data_format,
                "init_from": str(init_from) if init_from is not None else None,
                "generic": bool(pretrained is not None and pretrained.generic), "lora": cfg.lora.enabled,
                "trainable_params": sum(p.numel() for p in raw.parameters() if p.requires_grad),
                "torch": torch.__version__, "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
            }, indent=2, default=str))
        pdist.barrier(info)
        resume_step = None
        state = None
        if resume_from is not None:
            ckpt.load_weights(weights, resume_from, sharded=info.sharded)
            # FSDP: the full optimizer state stays in host memory; each rank copies only its shard to the GPU
            state = ckpt.load_state(resume_from, "cpu" if info.sharded else device)
            resume_step = int(state["trainer"]["step"])
        metrics = MetricsLogger(run_dir, enabled=info.is_main, tensorboard=cfg.run.tensorboard, wandb=cfg.run.wandb,
                                wandb_project=cfg.run.wandb_project, config=cfg.to_dict(), resume_step=resume_step)
        sample_fn = _make_sampler(raw, tokenizer, t, device, family.objective, chat=sft_data is not None)
        # Masked-diffusion objectives draw their noise from torch's global RNG (checkpoints save and restore it);
        # seeding it here, after any autobatch probe, makes a run reproducible from train.seed. Ranks differ so
        # that they draw different masks.
        torch.manual_seed(t.seed + info.rank)
        trainer = Trainer(model=built.model, objective=objective, optimizer=optimizer,
                          schedule=schedule, loader=loader, eval_batches=eval_fn, cfg=t, run=cfg.run, run_dir=run_dir,
                          dist=info, device=device, precision=precision, metrics=metrics, total_steps=total_steps,
                          tokens_per_step=tokens_per_step, sample_fn=sample_fn, save_weights=lambda: weights,
                          forward_context=built.forward_context, static_token_count=sft_data is None)
        if state is not None:
            trainer.load_state_dict(state)
            if info.is_main:
                console.print(f"resumed from {resume_from} at step {resume_step}")
        if info.is_main:
            what = f"{family.name}/{cfg.model.size}" if init_from is None else f"{family.name} from {init_from}"
            if sft_data is not None:
                console.print(sft_data.summary(), highlight=False)
            if cfg.lora.enabled:
                trainable = sum(p.numel() for p in raw.parameters() if p.requires_grad)
                console.print(f"LoRA r={cfg.lora.r} alpha={cfg.lora.alpha:g}: {trainable / 1e6:.2f}M trainable "
                              f"parameters", highlight=False)
                if t.learning_rate < 1e-4:
                    console.print(f"[yellow]hint:[/yellow] LoRA usually wants a larger learning rate than full "
                                  f"fine-tuning (~2e-4); this run uses {t.learning_rate:g} (--lr)")
            console.print(f"[bold]gptoughts[/bold]: {what} "
                          f"{raw.num_params() / 1e6:.1f}M params on {hw.name} ({device}, {precision}), "
                          f"{info.world_size} process(es); {train_tokens:,} train tokens; "
                          f"{total_steps} steps of {tokens_per_step:,} tokens", highlight=False)
        try:
            st = trainer.fit()
        except torch.OutOfMemoryError:
            raise UserError("out of GPU memory; lower --batch_size (raise --grad_accum to keep the global batch) "
                            "or --block_size; checkpoints already written are intact") from None
        finally:
            metrics.close()
            loader.close()

        history = History(steps=st.step, tokens=st.tokens_seen, run_dir=str(run_dir), stop_reason=trainer.stop_reason)
        for h in st.history:
            history.eval_steps.append(h["step"])
            history.val_loss.append(h["val_loss"])
            history.val_ppl.append(h["val_ppl"])
        if history.val_loss:
            history.final_val_loss, history.final_val_ppl = history.val_loss[-1], history.val_ppl[-1]
        prompt = t.sample_prompts[0] if t.sample_prompts else ""
        if t.sample_prompts and (info.is_main or info.sharded):  # under FSDP every rank takes part in generation
            raw.eval()
            with trainer.autocast():
                history.sample = sample_fn(prompt)
        if info.is_main:
            if math.isfinite(history.final_val_loss):
                console.print(f"val loss {history.final_val_loss:.4f}, perplexity {history.final_val_ppl:.2f}")
            if t.sample_prompts:
                console.print(f"[bold]sample[/bold] ({prompt!r}):\n{history.sample}", highlight=False)
            console.print(f"run saved in {run_dir} ({trainer.stop_reason})")
        return raw, tokenizer, history
    finally:
        pdist.shutdown()


def build_finetune_model(cfg: Config, init_from: Path, device: torch.device,
                         precision: str) -> tuple[Any, nn.Module, Any]:
    """The model a fine-tuning run trains: ``init_from`` loaded (native or generic), LoRA applied when enabled.

    Returns ``(pretrained, model, perf)``; ``perf`` is ``cfg.perf`` with fp8 off under LoRA (fp8 would convert
    the frozen base layers). The frozen base is loaded directly in ``lora.base_dtype`` (no fp32 copy is ever
    allocated). Shared by :func:`run_training` and ``bench/finetune_vs_peft.py``.
    """
    from gptoughts.train.setup import apply_lora, lora_base_dtype

    base_dtype = lora_base_dtype(cfg.lora, precision) if cfg.lora.enabled else torch.float32
    pretrained = load_pretrained(init_from, device=device, trust_remote_code=cfg.model.trust_remote_code,
                                 dtype=base_dtype)
    model, perf = pretrained.model, cfg.perf
    if cfg.lora.enabled:
        if perf.fp8 is True:
            raise ConfigError("--fp8 converts the frozen base layers; it does not combine with --lora (drop one)")
        perf = replace(perf, fp8=False)
        # The adapters' random init is a function of train.seed alone (not of what ran before in the process).
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(cfg.train.seed)
            model = apply_lora(model, cfg.lora, device=device,
                               compute_dtype=torch.float16 if precision == "fp16" else torch.bfloat16)
    return pretrained, model, perf


def _init_from_dir(cfg: Config) -> Path | None:
    """``model.init_from`` as a checked HF model folder (None when training from scratch)."""
    if cfg.model.init_from is None:
        return None
    from gptoughts.models.hf import read_config

    p = Path(cfg.model.init_from).expanduser()
    if (p / "config.toml").exists() or (p / "meta.json").exists() or (p / "checkpoints").is_dir():
        raise UserError(f"{p} is a gptoughts run; export it first (gptoughts export {p} --format hf OUT) and "
                        "fine-tune OUT")
    read_config(p)  # a clear error now rather than deep inside the model loading
    return p


def _sft_tokenizer(spec: str, sources: list[str]) -> Any:
    """The tokenizer of an SFT run: a folder's or ``bytes`` as is; ``bpe:N`` trained on the conversations."""
    from gptoughts.data.sft import read_conversations
    from gptoughts.data.tokenizer import build_tokenizer

    return build_tokenizer(spec, texts=lambda: (m["content"] for c in read_conversations(sources) for m in c))


def _phases(cfg: Config) -> list | None:
    if not cfg.data.phases:
        return None
    from gptoughts.data.loader import Phase

    out = []
    known = resolve_sources(cfg.data.sources)
    for p in cfg.data.phases:
        srcs = resolve_sources(p.sources)
        for s in srcs:
            if s not in known:
                raise ConfigError(f"data.phases `{p.name}` uses {s}, which is not in data.sources; add it there")
        # Bare sources are weighted by their token counts; explicit weights are used as given.
        out.append(Phase(name=p.name, sources=list(zip(srcs, p.weights)) if p.weights else srcs, tokens=p.tokens))
    return out


def _jsonable(args: object) -> dict:
    from dataclasses import asdict

    return asdict(args)  # type: ignore[arg-type]


def _make_sampler(model: nn.Module, tokenizer: Any, t: Any, device: torch.device, objective: str, *,
                  chat: bool = False):
    from gptoughts.generate import generate
    from gptoughts.train.setup import eager

    if objective == "diffusion":
        from gptoughts.generate import diffusion_generate

        def sample_diffusion(prompt: str) -> str:
            ids = tokenizer.encode(prompt) or [tokenizer.eos_id]
            x = torch.tensor([ids], dtype=torch.long, device=device)
            g = torch.Generator(device=device).manual_seed(0)
            n = t.sample_max_new_tokens
            with eager(model):  # the sample's length differs from the training shape: no recompiles
                out = diffusion_generate(model, x, gen_length=n, steps=n, block_length=min(32, n),
                                         temperature=t.sample_temperature, mask_id=tokenizer.mask_id, generator=g)
            return tokenizer.decode(_until_eos(out[0].tolist(), len(ids), tokenizer.eos_id))

        return sample_diffusion

    def sample(prompt: str) -> str:
        # SFT runs: the prompt is a user turn in the chat template, and the sample is the assistant's answer.
        ids = _prompt_ids(tokenizer, prompt, chat)
        x = torch.tensor([ids], dtype=torch.long, device=device)
        g = torch.Generator(device=device).manual_seed(0)
        with eager(model):  # decode shapes change every token: no recompiles
            out = generate(model, x, t.sample_max_new_tokens, temperature=t.sample_temperature,
                           top_k=t.sample_top_k, eos_id=tokenizer.eos_id, generator=g)
        return _decode_sample(tokenizer, out[0].tolist(), len(ids), chat)

    return sample


def _prompt_ids(tokenizer: Any, prompt: str, chat: bool) -> list[int]:
    if chat:
        from gptoughts.data.sft import render_prompt

        return render_prompt(tokenizer, [{"role": "user", "content": prompt}])
    return tokenizer.encode(prompt) or [tokenizer.eos_id]


def _decode_sample(tokenizer: Any, ids: list[int], prompt_len: int, chat: bool) -> str:
    if chat:
        return tokenizer.decode(ids[prompt_len:], skip_special_tokens=True)
    return tokenizer.decode(ids)


def _until_eos(ids: list[int], prompt_len: int, eos_id: int) -> list[int]:
    """``ids`` up to and including the first eos after the prompt: a diffusion sample has a fixed length, and
    what follows an eos belongs to another document (the causal sampler stops there)."""
    try:
        return ids[: ids.index(eos_id, prompt_len) + 1]
    except ValueError:
        return ids


# ---------------------------------------------------------------------------------------------- load etc.

@dataclass
class Loaded:
    model: nn.Module
    tokenizer: Any
    config: Config
    checkpoint: Path
    family: str
    chat: bool = False
    """Prompts go through the chat template by default (SFT runs, HF folders whose tokenizer has a template)."""
    init_from: str | None = None
    """The HF folder the run started from (export keeps its config's extra keys)."""
    args: Any = None


def load(path: str | Path, device: str = "auto") -> Loaded:
    """Load a trained model from a run directory, a checkpoint directory or a Hugging Face model folder.

    Runs fine-tuned with LoRA (or of an architecture without native code) rebuild the base model from their
    ``model.init_from`` folder, then load the checkpoint (the adapters) over it; the result is the PEFT model
    (``merge_and_unload()`` gives the plain one)."""
    from gptoughts.data.tokenizer import Tokenizer
    from gptoughts.train.setup import TrainableWeights, apply_lora, build_raw_model

    dev = hardware.resolve_device(device)
    if is_hf_folder(path):
        pre = load_pretrained(path, device=dev)
        return Loaded(model=pre.model.eval(), tokenizer=pre.tokenizer, config=load_config("default"),
                      checkpoint=Path(path), family=pre.family or GENERIC_FAMILY.name,
                      chat=pre.tokenizer.chat_template is not None, init_from=str(path), args=pre.model.args)
    ck = ckpt.resolve(path)
    run_dir = ck.parent.parent if ck.parent.name == "checkpoints" else ck.parent
    cfg_file, run_file = run_dir / "config.toml", run_dir / "run.json"
    if not cfg_file.exists() or not run_file.exists():
        raise UserError(f"{run_dir} has no config.toml/run.json next to its checkpoints; is it a gptoughts run?")
    cfg = config_from_toml_text(cfg_file.read_text())
    run = json.loads(run_file.read_text())
    init_from = run.get("init_from")
    if init_from and (cfg.lora.enabled or run.get("generic")):
        if not Path(init_from).is_dir():
            raise UserError(f"{run_dir} holds only what was trained on top of {init_from}, which is missing; put "
                            "the base model folder back at that path")
        pre = load_pretrained(init_from, device=dev, trust_remote_code=cfg.model.trust_remote_code)
        model, family_name, args = pre.model, pre.family or GENERIC_FAMILY.name, pre.model.args
        if cfg.lora.enabled:
            # QLoRA adapters are put back over the full-precision base (the usual way to merge and export them:
            # the result differs from the 4-bit training-time model by the base's quantization error only), so a
            # QLoRA run loads, samples and exports on any device.
            model = apply_lora(model, replace(cfg.lora, quantize="none"), device=dev)
        ckpt.load_weights(TrainableWeights(model) if cfg.lora.enabled else model, ck)
    else:
        family = models.get_family(run["family"])
        family_name, args = family.name, family.args_cls(**run["args"])
        model = build_raw_model(family.name, args, dev, seed=0)
        ckpt.load_weights(model, ck)
    model.eval()
    if not (run_dir / "tokenizer").exists():
        raise DataError(f"{run_dir}/tokenizer is missing; cannot decode this model's outputs")
    return Loaded(model=model, tokenizer=Tokenizer.load(run_dir / "tokenizer"), config=cfg, checkpoint=ck,
                  family=family_name, chat=run.get("data_format") == "sft", init_from=init_from, args=args)


def generate_text(loaded: Loaded, prompt: str, *, max_new_tokens: int = 128, temperature: float = 0.8,
                  top_k: int | None = 50, top_p: float | None = None, seed: int | None = None,
                  chat: bool | None = None) -> str:
    """Continue ``prompt``. Masked-diffusion families (LLaDA) use ``diffusion_generate`` (one step per token,
    blocks of 32, ``temperature`` as Gumbel noise; ``top_k``/``top_p`` do not apply) and stop at the first eos.

    ``chat`` (default ``loaded.chat``): the prompt is a user message rendered with the chat template (the
    tokenizer's own, else the SFT default) and only the assistant's answer is returned."""
    from gptoughts.generate import generate

    chat = loaded.chat if chat is None else chat
    dev = next(loaded.model.parameters()).device
    ids = _prompt_ids(loaded.tokenizer, prompt, chat)
    x = torch.tensor([ids], dtype=torch.long, device=dev)
    g = torch.Generator(device=dev).manual_seed(seed) if seed is not None else None
    fam = models.FAMILIES.get(loaded.family, GENERIC_FAMILY)
    if fam.objective == "diffusion":
        from gptoughts.generate import diffusion_generate

        n = max_new_tokens
        out = diffusion_generate(loaded.model, x, gen_length=n, steps=n, block_length=min(32, n),
                                 temperature=temperature, mask_id=loaded.tokenizer.mask_id, generator=g)
        return loaded.tokenizer.decode(_until_eos(out[0].tolist(), len(ids), loaded.tokenizer.eos_id))
    out = generate(loaded.model, x, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                   eos_id=loaded.tokenizer.eos_id, generator=g)
    return _decode_sample(loaded.tokenizer, out[0].tolist(), len(ids), chat)


@torch.no_grad()
def evaluate(loaded: Loaded, data: list[str], *, batch_size: int = 8, block_size: int | None = None,
             max_batches: int = 100) -> dict[str, float]:
    """Val loss and perplexity of a loaded model on a corpus tokenized with the model's own tokenizer."""
    from gptoughts.data.loader import TokenDataset, eval_batches
    from gptoughts.data.prepare import cached_prepare
    from gptoughts.train.objectives import build_objective

    cfg = loaded.config
    block = block_size or cfg.train.block_size
    # The folder the tokenizer was loaded from: a run's tokenizer/ or the HF model folder itself.
    run_tok = loaded.tokenizer.source_dir or loaded.checkpoint.parent.parent / "tokenizer"
    manifest = cached_prepare(resolve_sources(data), str(run_tok), text_field=cfg.data.text_field,
                              val_fraction=cfg.data.val_fraction, seed=cfg.train.seed, cache_root=cfg.data.cache_dir,
                              progress=False)
    dataset = TokenDataset(manifest.dir)
    split = "val" if dataset.num_tokens("val") > block else "train"
    dev = next(loaded.model.parameters()).device
    fam = models.FAMILIES.get(loaded.family, GENERIC_FAMILY)  # "hf": a generic transformers model, causal
    diffusion = fam.objective == "diffusion"
    objective = None if diffusion else build_objective(fam.objective)
    mc_gen = torch.Generator(device=dev).manual_seed(0) if diffusion else None
    total, count = 0.0, 0.0
    for batch in eval_batches(dataset, split=split, batch_size=batch_size, block_size=block, max_batches=max_batches,
                              device=dev):
        if diffusion:
            # Masked diffusion has no exact likelihood: a Monte-Carlo estimate of its NLL bound per token (see
            # llada.diffusion_log_likelihood). Few draws per window suffice, the corpus average pools them all.
            from gptoughts.models.llada import diffusion_log_likelihood

            x = batch[0]
            ls = diffusion_log_likelihood(loaded.model, x, n_samples=8, generator=mc_gen).sum() * x.size(1)
            n = x.numel()
        else:
            ls, n = objective(loaded.model, batch)
        total += float(ls)
        count += float(n)
    loss = total / max(count, 1.0)
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": count, "split": split}


# ------------------------------------------------------------------------------------------------- export

def export(path: str | Path, out: str | Path, *, format: str = "hf", max_shard_size: str | int = "5GB",
           dtype: str = "auto", overwrite: bool = False, device: str = "cpu") -> Path:
    """Write a run (or checkpoint, or HF folder) as a ``transformers`` model folder; LoRA adapters are merged.

    ``dtype``: auto (the dtype of the model the run started from, fp32 for runs trained from scratch), fp32,
    bf16 or fp16. ``max_shard_size``: weights above it are split into shards with an index (e.g. ``5GB``).
    """
    from gptoughts.models.hf import (
        copy_tokenizer_files,
        model_dtype,
        parse_size,
        read_config,
        save_generic,
        save_hf,
    )

    if format != "hf":
        raise ConfigError(f"--format {format!r}: only hf (a transformers model folder) is supported")
    names = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    if dtype not in ("auto", *names):
        raise ConfigError(f"--dtype must be auto, fp32, bf16 or fp16; got {dtype!r}")
    loaded = load(path, device=device)
    model = loaded.model
    if hasattr(model, "merge_and_unload"):  # PEFT: fold B @ A * alpha / r into the base weights
        model = model.merge_and_unload()
    base = read_config(loaded.init_from) if loaded.init_from else None
    target = names.get(dtype) or (model_dtype(base) if base else torch.float32)
    shard = parse_size(max_shard_size)
    if isinstance(model, HFCausalLM):
        return save_generic(model, loaded.tokenizer, out, max_shard_bytes=shard, dtype=target, overwrite=overwrite)
    gen = None
    if loaded.init_from and (Path(loaded.init_from) / "generation_config.json").is_file():
        gen = json.loads((Path(loaded.init_from) / "generation_config.json").read_text())
    written = save_hf(model, loaded.family, loaded.args, loaded.tokenizer, out, base_config=base,
                      base_generation_config=gen, max_shard_bytes=shard, dtype=target, overwrite=overwrite)
    if loaded.init_from:  # fine-tuning keeps the vocabulary: ship the original tokenizer files as they were
        copy_tokenizer_files(loaded.init_from, written)
    return written
