"""The trainer's parts, built once the run is decided: optimizer and schedule, loaders, sampler, the resumed
state, the checkpointer, recovery and evaluator, the metrics and plots, and the run directory's files; then the
:class:`~gptoughts.training.trainer.Trainer` that takes them ready. ``timing_trainer``: the same trainer, bare, for
bench and tune."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from gptoughts.config import Config, TrainConfig, is_task_file, to_toml
from gptoughts.data.tokenizer import parse_spec
from gptoughts.errors import UserError
from gptoughts.models.hf import base_fingerprint
from gptoughts.parallel import dist as pdist
from gptoughts.training import rundir
from gptoughts.training.batches import data_packing
from gptoughts.training.checkpoint import restore
from gptoughts.training.checkpoint import store as ckpt
from gptoughts.training.corpus import Data, loader_phases
from gptoughts.training.environment import (
    Environment,
)
from gptoughts.training.modeling import Model, apply_planned_compile
from gptoughts.training.plan import BatchPlan, RunPlan


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
        cfg.eval,
        eval_interval=batch.eval_interval,
        eval_tasks_interval=batch.tasks_interval,
        sample_prompts=asm.data.sample_prompts(cfg.eval.sample_prompts),
    )
    checkpointing = replace(cfg.checkpoint, save_interval=batch.save_interval)
    check_train_ranges(t, evaluation, checkpointing, cfg.recovery)  # with the plan's values
    # 7. sampler, optimizer, schedule, loaders: still nothing written
    asm.sampler = _sampler(cfg, asm.data, model)
    if model.built.pipeline is None:  # (a pipeline's stages do not sample)
        # samples that cannot fit the model's positions refused now, not as a warning at the run's end
        asm.sampler.check_room(evaluation.sample_prompts, ("--sample_max_new_tokens", "--sample_prompts"))
    optimizer = train_optimizer(cfg, env, model, t)
    asm.loader, eval_fn = make_loaders(cfg, env, asm.data, model, t, batch.eval_block)
    _reference_logratios(asm, t)  # before a resume loads its weights: the reference is the starting model
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
    pdist.on_main(lambda: write_run_files(asm), env.dist)
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
        chat=data.format in ("sft", "prefs"),
        max_new_tokens=cfg.eval.sample_max_new_tokens,
        temperature=cfg.eval.sample_temperature,
        top_k=cfg.eval.sample_top_k,
        # the system message every conversation opened with (not one each: no text stands for them all)
        system=data.sft.system if data.sft is not None and isinstance(data.sft.system, str) else None,
    )


def _reference_logratios(asm: Assembly, t: TrainConfig) -> None:
    """Preference tuning with a precomputed reference: one pass of the starting model over every pair."""
    objective, prefs = asm.model.objective, asm.data.prefs
    if prefs is None or getattr(objective, "reference", None) != "precomputed":
        return
    from gptoughts.training.dpo import precompute_reference
    from gptoughts.training.metrics import console
    from gptoughts.training.state import autocast

    env, built = asm.env, asm.model.built
    t0 = time.perf_counter()
    precompute_reference(
        objective,
        pdist.unwrap(built.model) if env.dist.enabled and not env.dist.sharded else built.model,
        prefs,
        batch_size=t.batch_size,
        device=env.device,
        autocast=lambda: autocast(env.device, env.precision, built.forward_context),
    )
    pdist.reshard(built.model)  # before the trainer collects the parameters
    if env.dist.is_main:
        console.print(
            f"reference log-probabilities of {len(prefs):,} pairs computed in {time.perf_counter() - t0:.1f} s",
            highlight=False,
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
        phases=batch.phases,
        **common,
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
                model.built.pipeline.load_weights(restore.read_model_file(path), path)
            else:
                restore.load_weights(model.weights, path, sharded=env.dist.sharded)
            # FSDP: the full optimizer state stays in host memory; each rank copies only its shard to the GPU
            return path, restore.load_state(path, "cpu" if env.dist.sharded else env.device)
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


def make_loaders(
    cfg: Config, env: Environment, data: Data, model: Model, t: TrainConfig, eval_block: int | None = None
) -> tuple[Any, Any]:
    """The training loader (resumable, rank-aware) and the evaluation batches (None without held-out data).
    ``eval_block``: the evaluation windows' length (BatchPlan.eval_block; None: the block)."""
    from gptoughts.data.loader import BatchLoader, eval_batches
    from gptoughts.data.sft import SFTLoader

    info, device = env.dist, env.device
    if data.prefs is not None:
        return _pref_loaders(cfg, env, data.prefs, t)
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
        phases=loader_phases(cfg),
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


def _pref_loaders(cfg: Config, env: Environment, prefs: Any, t: TrainConfig) -> tuple[Any, Any]:
    from gptoughts.data.prefs import PrefLoader

    info, device = env.dist, env.device
    loader = PrefLoader(
        prefs, batch_size=t.batch_size, seed=t.seed, rank=info.dp_rank, world_size=info.dp_size, device=device
    )
    if not len(prefs.val_idx):
        return loader, None
    return loader, lambda: prefs.batches(prefs.val_idx, t.batch_size, device, cfg.eval.eval_batches)


def write_run_files(asm: Assembly) -> None:
    """config.toml (sources, a tokenizer folder, the base model's folder and task files as absolute paths: the
    run resumes and samples from any working directory), tokenizer/, run.json (with the plan). Called once
    everything has been validated."""
    cfg, env, model, data, run_dir = asm.cfg, asm.env, asm.model, asm.data, asm.run_dir
    if asm.resume_from is None and rundir.is_run(run_dir):
        # --overwrite, or --resume auto on a run killed before its first checkpoint: it starts over, and what it
        # wrote before (metrics rows, samples) goes, so that nothing is counted twice
        rundir.clear(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    saved = replace(
        cfg,
        data=replace(
            cfg.data,
            sources=[_absolute(s) for s in cfg.data.sources],
            tokenizer=_absolute(cfg.data.tokenizer)
            if parse_spec(cfg.data.tokenizer)[0] == "folder"
            else cfg.data.tokenizer,
        ),
        model=replace(cfg.model, init_from=_absolute(cfg.model.init_from) if cfg.model.init_from else None),
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
        # SFT and preference runs read their examples whole (no cached shards): a resume compares this
        "data_fingerprint": (data.sft or data.prefs).fingerprint if (data.sft or data.prefs) else None,
        # the system message that opens every SFT conversation (True: each its own): sample says to pass one
        "sft_system": data.sft.system if data.sft is not None else None,
        "init_from": _absolute(str(data.init_from)) if data.init_from is not None else None,
        # what LoRA adapters were trained over: a resume, sample or export over a changed base is refused
        "base_fingerprint": base_fingerprint(data.init_from) if data.init_from is not None else None,
        "generic": bool(model.pretrained is not None and model.pretrained.generic),
        "lora": cfg.lora.enabled,
        "trainable_params": sum(p.numel() for p in raw.parameters() if p.requires_grad),
        "tokens_per_step": asm.batch.tokens_per_step,
        "threads": asm.threads,
        # what the user gave (a resume counts only these as theirs: config.toml holds every decided value too)
        "given": sorted(cfg.given) if cfg.given is not None else None,
        "shipped": sorted(cfg.shipped),
        "plan": asm.plan.to_dict(),
        "resolved": asm.resolved,
        "torch": torch.__version__,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    home = ckpt.run_of(asm.resume_from) if asm.resume_from is not None else None
    if asm.resume_from is not None and (home is None or home.resolve() != run_dir.resolve()):
        # a branch: where a --resume auto of it goes on from until it writes a checkpoint of its own
        record["branched_from"] = str(asm.resume_from.resolve())
    # run.json first: it is what makes the folder a run, so that a kill before the rest is written leaves one
    # that --overwrite may replace (and that --resume auto refuses, naming the missing config.toml)
    ckpt.write_text_atomic(run_dir / "run.json", json.dumps(record, indent=2, default=str))
    ckpt.write_text_atomic(run_dir / "config.toml", to_toml(saved))
    data.tokenizer.save(run_dir / "tokenizer")


def _absolute(source: str) -> str:
    if source.startswith("@"):
        return source
    p = Path(source).expanduser()
    return str(p.resolve()) if p.exists() else source


def train_optimizer(cfg: Config, env: Environment, model: Model, t: TrainConfig) -> Any:
    """The run's optimizer; under pipeline parallelism also the order in which a one-process run's optimizer holds
    the parameters (its checkpoints key them by index): an optimizer over the whole model, built but never stepped
    (no state is allocated; unfused: the parameters a rank does not hold are on the meta device)."""
    from gptoughts.training.optim import records_muon_step
    from gptoughts.training.setup import make_optimizer

    graph = records_muon_step(cfg, env, model.built.keep_grads)
    optimizer = make_optimizer(model.built.model, t, cfg.perf, env.device, graph=graph)
    if model.built.pipeline is not None:
        names = {id(p): n for n, p in model.raw.named_parameters()}
        whole = make_optimizer(model.raw, t, replace(cfg.perf, fused_adamw=False), env.device)
        model.built.pipeline.param_order = [names[id(p)] for g in whole.param_groups for p in g["params"]]
    return optimizer


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

    # The batch is planned: the whole model compiled now, as train does (without it the steps timed would run the
    # per-block graphs, without CUDA graphs, while the result says "model").
    apply_planned_compile(env, model)
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
