"""The one assembly: a :class:`~gptoughts.config.Config` becomes a ready trainer, in named steps, in one order.

``build(cfg)`` runs, each step receiving only what it needs and returning a typed result:

1. ``environment.setup_environment``  device, process group, hardware profile, precision
2. ``rundir.check``                   what ``run.out`` holds: a new run, a run to resume, a refusal
3. ``corpus.prepare_data``            sources -> tokenizer -> token shards (or SFT examples)
4. ``modeling.build_model``           meta build -> load or init -> LoRA -> ``resolve.resolve_transforms``
                                      (every transform decided) -> ``setup.apply_transforms``; first on meta,
                                      for :func:`choose_memory_layout` (checkpointing, optimizer states, CPU
                                      offload: what fits the GPU, decided before the real build)
5. ``batches.plan_batches``           micro-batch, accumulation, tokens per step, steps, epochs, warmup, intervals
6. ``plan.make_plan``                 what the run will do (printed before the first step); then the whole
                                      model's compile, where it was chosen
7. optimizer and schedule, loaders, sampler, metrics, the :class:`~gptoughts.training.trainer.Trainer`

Nothing is written to the run directory before every step has succeeded (a rejected resume leaves the run as it
was); ``dry_run`` stops after step 6 having written nothing at all (the model is built on the meta device and
the corpus is not tokenized when its shards are not cached). ``train``, ``finetune``, ``bench``, ``tune``, the
bench scripts and the tests all assemble through here.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from gptoughts.config import Config, TrainConfig, is_task_file, to_toml
from gptoughts.errors import ConfigError, DataError, UserError
from gptoughts.parallel import dist as pdist
from gptoughts.perf import hardware
from gptoughts.training import rundir
from gptoughts.training.batches import data_packing, plan_batches
from gptoughts.training.checkpoint import restore
from gptoughts.training.checkpoint import store as ckpt
from gptoughts.training.corpus import Data, prepare_data, resolve_sources
from gptoughts.training.environment import (
    Environment,
    setup_environment,
    use_our_compile_cache,
)
from gptoughts.training.modeling import Model, build_model
from gptoughts.training.plan import BatchPlan, RunPlan, make_plan, memory_refusal

# ------------------------------------------------------------------------------------------ 1. environment


# ------------------------------------------------------------------------------------------------ 3. data


# ------------------------------------------------------------------------------------------------ 4. model


# ---------------------------------------------------------------------------------------------- 5. batches


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
    if not dry_run:
        apply_planned_compile(env, model)
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
    from gptoughts.training.estimates import layout_search

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
    if model.transforms is not None and model.transforms.whole_model_auto:
        _whole_model_for_long_runs(env, model, batch)
    from gptoughts.training.resolve import resolve_run

    applied = model.built.resolved if model.built is not None else None
    spec = resolve_run(cfg, env.resolved, model.transforms, applied, batch, env.dist, model.raw, threads)
    if spec.pipeline_micro is not None and model.built is not None:
        model.built.pipeline.n_micro = spec.pipeline_micro
    resolved = dict(spec.resolved)
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
    from gptoughts.training.estimates import estimate_speed
    from gptoughts.training.resolve import WHOLE_MODEL_MIN_RUN_S

    tps, _ = estimate_speed(env, model, batch.block_size, batch.micro_batch, env.dist.world_size)
    if not tps:
        _use_blocks(model, "auto: the run's length cannot be estimated on this GPU (unknown peak)")
        return
    run_s = batch.total_steps * batch.tokens_per_step / tps
    if run_s < WHOLE_MODEL_MIN_RUN_S:
        _use_blocks(
            model,
            f"auto: a run estimated at ~{max(1, round(run_s / 60))} min (the whole model's compile repays from "
            f"~{WHOLE_MODEL_MIN_RUN_S // 60} min)",
        )


def _use_blocks(model: Model, why: str) -> None:
    """The decision recorded where the plan reads it (nothing compiled whole yet: nothing to undo)."""
    model.transforms = model.transforms.with_blocks(why)
    if model.built is not None:
        model.built.spec = model.transforms
        model.built.resolved["compile"] = "blocks"
        model.built.why["compile"] = model.transforms.why["compile"]


def apply_planned_compile(env: Environment, model: Model) -> None:
    """The whole model's compile, once the batch is planned (and the CPU thread probe has run its steps)."""
    from gptoughts.training.setup import apply_whole_model_compile, whole_model_later

    if model.built is not None and whole_model_later(model.built.spec, env.dist):
        apply_whole_model_compile(model.built)


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
