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
from gptoughts.parallel import dist as pdist
from gptoughts.perf import hardware
from gptoughts.train import checkpoint as ckpt

STDLIB = "@stdlib"


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


def run_training(cfg: Config) -> tuple[nn.Module, Any, History]:
    from gptoughts.data.loader import BatchLoader, TokenDataset, eval_batches
    from gptoughts.data.prepare import cached_prepare
    from gptoughts.data.tokenizer import Tokenizer
    from gptoughts.perf.autobatch import accumulation_for
    from gptoughts.train.metrics import MetricsLogger, console
    from gptoughts.train.optim import Schedule, default_warmup
    from gptoughts.train.setup import (
        apply_transforms,
        auto_micro_batch,
        build_raw_model,
        make_objective,
        make_optimizer,
    )
    from gptoughts.train.trainer import Trainer

    device = hardware.resolve_device(cfg.perf.device)
    info = pdist.init(device, cfg.parallel.backend, cfg.parallel.strategy)
    try:
        hw = hardware.detect(device)
        precision = hardware.resolve_precision(cfg.perf.precision, hw)
        if device.type == "cuda" and cfg.perf.tf32:
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        run_dir = Path(cfg.run.out)
        resume_from = _check_run_dir(run_dir, cfg) if info.is_main else None
        resume_from = pdist.broadcast_object(resume_from, info)
        if cfg.run.resume and resume_from is None and info.is_main:
            console.print(f"no checkpoint to resume in {run_dir}; starting a new run")

        # ---- data: tokenizer and token shards (rank 0 prepares, the others read the cache)
        tok_spec: Any = cfg.data.tokenizer
        sources = resolve_sources(cfg.data.sources)
        prep_kwargs = dict(text_field=cfg.data.text_field, extensions=cfg.data.extensions or None,
                           val_fraction=cfg.data.val_fraction, max_bytes=cfg.data.max_bytes, seed=cfg.train.seed,
                           cache_root=cfg.data.cache_dir)
        if info.is_main:
            manifest = cached_prepare(sources, tok_spec, progress=cfg.run.progress, **prep_kwargs)
        pdist.barrier(info)
        if not info.is_main:
            manifest = cached_prepare(sources, tok_spec, progress=False, **prep_kwargs)
        tokenizer: Tokenizer = manifest.tokenizer()
        if resume_from is not None and (run_dir / "tokenizer").exists():
            saved = Tokenizer.load(run_dir / "tokenizer")
            if saved.fingerprint() != tokenizer.fingerprint():
                raise UserError(f"the tokenizer of {run_dir} differs from --tokenizer {cfg.data.tokenizer}; resume "
                                f"with the run's own setting (see {run_dir}/config.toml)")
        dataset = TokenDataset(manifest.dir)

        # ---- model
        family = models.get_family(cfg.model.family)
        overrides = dict(cfg.model.overrides)
        overrides.setdefault("vocab_size", round_up(tokenizer.vocab_size, 64))
        args = models.model_args(family.name, cfg.model.size, overrides)
        if getattr(args, "vocab_size", tokenizer.vocab_size) < tokenizer.vocab_size:
            raise ConfigError(f"model.vocab_size = {args.vocab_size} is smaller than the tokenizer's "
                              f"{tokenizer.vocab_size}; drop the override or raise it")
        if hasattr(args, "max_seq_len") and args.max_seq_len < cfg.train.block_size:
            args = replace(args, max_seq_len=cfg.train.block_size)
        raw = build_raw_model(family.name, args, device, cfg.train.seed)
        built = apply_transforms(raw, perf=cfg.perf, hw=hw, device=device, dist=info)

        # ---- batch size (auto: the largest that fits, then accumulation to reach the global batch)
        t = cfg.train
        objective = make_objective(family, built, cfg.perf)
        if not isinstance(t.batch_size, int):
            parts = {"family": family.name, "args": _jsonable(args), "block": t.block_size, "gpu": hw.name,
                     "precision": precision, "resolved": built.resolved, "world": info.world_size}
            micro, cached = auto_micro_batch(built, objective, vocab_size=args.vocab_size, block_size=t.block_size,
                                             precision=precision, perf=cfg.perf, t=t, device=device, dist=info,
                                             parts=parts)
            accum = accumulation_for(t.global_batch_tokens, micro, t.block_size, info.world_size) \
                if t.global_batch_tokens else t.grad_accum
            t = replace(t, batch_size=micro, grad_accum=accum)
            if info.is_main:
                console.print(f"auto batch size: micro-batch {micro} x accumulation {accum}"
                              + (" (cached)" if cached else "") + (" (no GPU: fixed default)" if
                                                                     device.type != "cuda" else ""))
        tokens_per_step = t.batch_size * t.block_size * t.grad_accum * info.world_size
        train_tokens = manifest.train_tokens
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

        loader = BatchLoader(dataset, split="train", batch_size=t.batch_size, block_size=t.block_size, seed=t.seed,
                             rank=info.rank, world_size=info.world_size, phases=_phases(cfg), device=device)
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
                "data": str(manifest.dir), "torch": torch.__version__, "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
            }, indent=2, default=str))
        pdist.barrier(info)
        resume_step = None
        state = None
        if resume_from is not None:
            ckpt.load_weights(raw, resume_from)
            state = ckpt.load_state(resume_from, device)
            resume_step = int(state["trainer"]["step"])
        metrics = MetricsLogger(run_dir, enabled=info.is_main, tensorboard=cfg.run.tensorboard, wandb=cfg.run.wandb,
                                wandb_project=cfg.run.wandb_project, config=cfg.to_dict(), resume_step=resume_step)
        sample_fn = _make_sampler(raw, tokenizer, t, device, family.objective)
        trainer = Trainer(model=built.model, objective=objective, optimizer=optimizer,
                          schedule=schedule, loader=loader, eval_batches=eval_fn, cfg=t, run=cfg.run, run_dir=run_dir,
                          dist=info, device=device, precision=precision, metrics=metrics, total_steps=total_steps,
                          tokens_per_step=tokens_per_step, sample_fn=sample_fn, save_weights=lambda: raw,
                          forward_context=built.forward_context)
        if state is not None:
            trainer.load_state_dict(state)
            if info.is_main:
                console.print(f"resumed from {resume_from} at step {resume_step}")
        if info.is_main:
            console.print(f"[bold]gptoughts[/bold]: {family.name}/{cfg.model.size} "
                          f"{raw.num_params() / 1e6:.1f}M params on {hw.name} ({device}, {precision}), "
                          f"{info.world_size} process(es); {manifest.train_tokens:,} train tokens; "
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
        if info.is_main:
            if math.isfinite(history.final_val_loss):
                console.print(f"val loss {history.final_val_loss:.4f}, perplexity {history.final_val_ppl:.2f}")
            prompt = t.sample_prompts[0] if t.sample_prompts else ""
            if t.sample_prompts:
                raw.eval()
                with trainer.autocast():
                    history.sample = sample_fn(prompt)
                console.print(f"[bold]sample[/bold] ({prompt!r}):\n{history.sample}", highlight=False)
            console.print(f"run saved in {run_dir} ({trainer.stop_reason})")
        return raw, tokenizer, history
    finally:
        pdist.shutdown()


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


def _make_sampler(model: nn.Module, tokenizer: Any, t: Any, device: torch.device, objective: str):
    from gptoughts.generate import generate
    from gptoughts.train.setup import eager

    def sample(prompt: str) -> str:
        ids = tokenizer.encode(prompt) or [tokenizer.eos_id]
        x = torch.tensor([ids], dtype=torch.long, device=device)
        g = torch.Generator(device=device).manual_seed(0)
        with eager(model):  # decode shapes change every token: no recompiles
            out = generate(model, x, t.sample_max_new_tokens, temperature=t.sample_temperature,
                           top_k=t.sample_top_k, eos_id=tokenizer.eos_id, generator=g)
        return tokenizer.decode(out[0].tolist())

    return sample


# ---------------------------------------------------------------------------------------------- load etc.

@dataclass
class Loaded:
    model: nn.Module
    tokenizer: Any
    config: Config
    checkpoint: Path
    family: str


def load(path: str | Path, device: str = "auto") -> Loaded:
    """Load a trained model from a run directory or a checkpoint directory."""
    from gptoughts.data.tokenizer import Tokenizer
    from gptoughts.train.setup import build_raw_model

    ck = ckpt.resolve(path)
    run_dir = ck.parent.parent if ck.parent.name == "checkpoints" else ck.parent
    cfg_file, run_file = run_dir / "config.toml", run_dir / "run.json"
    if not cfg_file.exists() or not run_file.exists():
        raise UserError(f"{run_dir} has no config.toml/run.json next to its checkpoints; is it a gptoughts run?")
    cfg = config_from_toml_text(cfg_file.read_text())
    run = json.loads(run_file.read_text())
    dev = hardware.resolve_device(device)
    family = models.get_family(run["family"])
    args = family.args_cls(**run["args"])
    model = build_raw_model(family.name, args, dev, seed=0)
    ckpt.load_weights(model, ck)
    model.eval()
    if not (run_dir / "tokenizer").exists():
        raise DataError(f"{run_dir}/tokenizer is missing; cannot decode this model's outputs")
    return Loaded(model=model, tokenizer=Tokenizer.load(run_dir / "tokenizer"), config=cfg, checkpoint=ck,
                  family=family.name)


def generate_text(loaded: Loaded, prompt: str, *, max_new_tokens: int = 128, temperature: float = 0.8,
                  top_k: int | None = 50, top_p: float | None = None, seed: int | None = None) -> str:
    from gptoughts.generate import generate

    dev = next(loaded.model.parameters()).device
    ids = loaded.tokenizer.encode(prompt) or [loaded.tokenizer.eos_id]
    x = torch.tensor([ids], dtype=torch.long, device=dev)
    g = torch.Generator(device=dev).manual_seed(seed) if seed is not None else None
    out = generate(loaded.model, x, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                   eos_id=loaded.tokenizer.eos_id, generator=g)
    return loaded.tokenizer.decode(out[0].tolist())


@torch.no_grad()
def evaluate(loaded: Loaded, data: list[str], *, batch_size: int = 8, block_size: int | None = None,
             max_batches: int = 100) -> dict[str, float]:
    """Val loss and perplexity of a loaded model on a corpus tokenized with the model's own tokenizer."""
    from gptoughts.data.loader import TokenDataset, eval_batches
    from gptoughts.data.prepare import cached_prepare
    from gptoughts.train.objectives import build_objective

    cfg = loaded.config
    block = block_size or cfg.train.block_size
    run_tok = loaded.checkpoint.parent.parent / "tokenizer"
    manifest = cached_prepare(resolve_sources(data), str(run_tok), text_field=cfg.data.text_field,
                              val_fraction=cfg.data.val_fraction, seed=cfg.train.seed, cache_root=cfg.data.cache_dir,
                              progress=False)
    dataset = TokenDataset(manifest.dir)
    split = "val" if dataset.num_tokens("val") > block else "train"
    dev = next(loaded.model.parameters()).device
    objective = build_objective(models.get_family(loaded.family).objective)
    total, count = 0.0, 0.0
    for batch in eval_batches(dataset, split=split, batch_size=batch_size, block_size=block, max_batches=max_batches,
                              device=dev):
        ls, n = objective(loaded.model, batch)
        total += float(ls)
        count += float(n)
    loss = total / max(count, 1.0)
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": count, "split": split}
