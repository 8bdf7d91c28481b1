"""The one assembly: a :class:`~gptoughts.config.Config` becomes a ready trainer, in named steps, in one order.

``build(cfg)`` runs, each step receiving only what it needs and returning a typed result:

1. ``environment.setup_environment``  device, process group, hardware profile, precision
2. ``rundir.check``                   what ``run.out`` holds: a new run, a run to resume, a refusal
3. ``corpus.prepare_data``            sources -> tokenizer -> token shards (or SFT examples)
4. ``modeling.build_model``           meta build -> load or init -> LoRA -> ``resolve.resolve_transforms``
                                      (every transform decided) -> ``setup.apply_transforms``; first on meta,
                                      for :func:`choose_memory_layout` (checkpointing, optimizer states, CPU
                                      offload: what fits the GPU at the batch step 5 will plan, decided before
                                      the real build)
5. ``batches.plan_batches``           micro-batch, accumulation, tokens per step, steps, epochs, warmup, intervals
6. ``plan.make_plan``                 what the run will do (printed before the first step); then the whole
                                      model's compile, where it was chosen
7. ``components.make_trainer``        optimizer and schedule, loaders, sampler, checkpointer, recovery, evaluator,
                                      metrics and plots, the run directory's files, the ``Trainer``

Nothing is written to the run directory before every step has succeeded (a rejected resume leaves the run as it
was); ``dry_run`` stops after step 6 having written nothing at all (the model is built on the meta device and
the corpus is not tokenized when its shards are not cached). ``train``, ``finetune``, ``bench``, ``tune``, the
bench scripts and the tests all assemble through here.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from gptoughts.config import Config
from gptoughts.data.sources import read_json_dict
from gptoughts.errors import UserError
from gptoughts.parallel import dist as pdist
from gptoughts.perf import hardware
from gptoughts.training import rundir
from gptoughts.training.batches import plan_batches
from gptoughts.training.checkpoint import store
from gptoughts.training.components import Assembly, make_trainer
from gptoughts.training.corpus import Data, prepare_data
from gptoughts.training.environment import (
    Environment,
    setup_environment,
    use_our_compile_cache,
)
from gptoughts.training.estimates import cpu_optimizer_seconds, with_optimizer_step
from gptoughts.training.modeling import Model, apply_planned_compile, build_model
from gptoughts.training.plan import BatchPlan, RunPlan, make_plan, memory_refusal, resumed_step
from gptoughts.training.resolve import resolve_grad_sync

# ------------------------------------------------------------------------------------------ 1. environment


# ------------------------------------------------------------------------------------------------ 3. data


# ------------------------------------------------------------------------------------------------ 4. model


# ---------------------------------------------------------------------------------------------- 5. batches


# ------------------------------------------------------------------------------------------------ assembly


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
    if env.dist.ep > 1 and cfg.model.init_from is None:
        from gptoughts.parallel import ep

        ep.check_family(cfg.model.family, env.dist.ep, lora=cfg.lora.enabled)
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

        # 2. the run directory: locked first (one process per run), then checked, by rank 0; nothing written yet
        def lock_and_check() -> tuple[Path | None, dict[str, Any] | None]:
            nonlocal lock
            lock = rundir.RunLock.acquire(run_dir)
            try:
                return rundir.check(run_dir, cfg)
            except BaseException:
                lock.release()
                raise

        resume_from, resumed_run = pdist.on_main(lock_and_check, env.dist)
        if cfg.run.resume == "auto" and resume_from is None and env.dist.is_main:
            from gptoughts.training.metrics import console

            console.print(
                f"{run_dir} has no checkpoint yet (the run stopped before its first save): its own "
                "config.toml starts again from step 0",
                highlight=False,
            )
    elif cfg.run.resume:  # the plan of the resume itself (its step, its batch); rundir.check only reads
        resume_from, resumed_run = rundir.check(run_dir, cfg)
    elif (run_dir / "config.toml").exists() and not cfg.run.overwrite:
        rundir.check(run_dir, cfg)  # the plan of a run that would be refused is a refusal too
    try:
        return _assemble(cfg, env, run_dir, dry_run, resume_from, resumed_run, lock, tasks)
    except BaseException:
        if lock is not None:
            lock.release()
        raise


def _resumed_at(resume_from: Path | None) -> tuple[int, int] | None:
    """The step and tokens seen of the checkpoint a run resumes, from its meta.json (None where unreadable: the
    resume then falls back to an earlier checkpoint or refuses, as for any corruption)."""
    if resume_from is None:
        return None
    try:
        meta = store.read_meta(resume_from)
        return int(meta["step"]), int(meta["tokens_seen"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _refuse_nothing_to_train(
    run_dir: Path,
    resume_from: Path | None,
    resumed_at: tuple[int, int] | None,
    batch: BatchPlan,
    *,
    dry_run: bool,
) -> str | None:
    """A resume whose stopping rule is at or behind its checkpoint's step trains nothing: it exited 0 having
    rewritten the run's config and summary (or left a branch with no checkpoint). Refused, except for the run's
    own folder where it was killed between its last checkpoint and its summary: resumed, it ends properly. A dry
    run's refusal is returned instead, for :func:`_print_plan` (None: the resume trains)."""
    refusal = _nothing_to_train(run_dir, resume_from, resumed_at, batch)
    if refusal and not dry_run:
        raise UserError(refusal)
    return refusal


def _nothing_to_train(
    run_dir: Path, resume_from: Path | None, resumed_at: tuple[int, int] | None, batch: BatchPlan
) -> str | None:
    """Why a resume trains nothing (see :func:`_refuse_nothing_to_train`); None when it trains."""
    if resume_from is None or resumed_at is None or batch.total_steps > resumed_at[0]:
        return None
    step = resumed_at[0]
    fix = f"pass a --max_steps above {step} to train on (sample, evaluate or export the run as it is)"
    if batch.total_steps < step:
        return f"the run is at step {step}, past {batch.stop_rule}: nothing would train; {fix}"
    home = store.run_of(resume_from)
    own = home is not None and home.resolve() == run_dir.resolve()
    if own and (read_json_dict(run_dir / "summary.json") or {}).get("steps") != step:
        return None
    return f"{home or resume_from} is complete at step {step} ({batch.stop_rule}): nothing to train; {fix}"


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
    # A resume tokenizes as its run did: compared here, before the plan and in a dry run too (a BPE still to be
    # trained on an uncached corpus is judged by what it would be trained on; compared again once trained)
    tokenizer_note = (
        rundir.check_resumed_tokenizer(run_dir, resume_from, data.tokenizer, cfg)
        if resume_from is not None
        else None
    )
    model = build_model(cfg, env, data, meta=True)
    # 4b: what the later steps build, for the batch step 5 will plan
    cfg, env = choose_memory_layout(cfg, env, model, dry_run=dry_run, data=data, resumed_run=resumed_run)
    resumed_at = _resumed_at(resume_from)
    batch = plan_batches(cfg, env, data, model, dry_run=True, resumed_run=resumed_run, resumed_at=resumed_at)
    nothing = _refuse_nothing_to_train(run_dir, resume_from, resumed_at, batch, dry_run=dry_run)
    threads = _given_threads(cfg, env, resumed_run)  # None: measured after the plan is printed
    why = _threads_why(env, threads, dry_run)
    resolved, plan = _plan(cfg, env, data, model, batch, run_dir, resume_from, tasks, why)
    if dry_run and plan.replaces:
        plan.replaces = "--overwrite would replace the run there"
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
        if resume_from is not None:
            rundir.check_resumed_tokenizer(run_dir, resume_from, data.tokenizer, cfg)
    if not dry_run:
        model = build_model(cfg, env, data)  # 4
        batch = plan_batches(cfg, env, data, model, resumed_run=resumed_run, resumed_at=resumed_at)  # 5
        resolved, plan = _plan(cfg, env, data, model, batch, run_dir, resume_from, tasks, why)  # 6
    probing = threads is None and not dry_run and _single_cpu_process(env)
    _print_plan(env, plan, probing, refusal=nothing, note=tokenizer_note if dry_run else None)
    if probing:
        # After the plan: on a CPU the probe's forward+backward steps are the first thing that takes a while.
        step, probe_tokens = _probe_step(cfg, model, data)
        count, how, step_s = hardware.measure_cpu_threads(step)
        threads = (count, how)
        resolved["threads"] = f"{count} ({how})"
        # The probe's speed at the chosen count is a better guess of the run's than the matmul-based one
        optimizer_s = cpu_optimizer_seconds(cfg, model)
        basis = "the thread probe's forward+backward at this count" + (
            f", and Muon's Newton-Schulz ~{optimizer_s:.1f} s a step at its bf16 matmul speed"
            if optimizer_s
            else ""
        )
        tps = with_optimizer_step(probe_tokens / step_s, batch.tokens_per_step, optimizer_s)
        plan.retime(tps, basis)
        if env.dist.is_main:
            console.print(plan.after_probe(), highlight=False)
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


def _print_plan(
    env: Environment, plan: RunPlan, probing: bool, *, refusal: str | None, note: str | None = None
) -> None:
    """The plan, printed by rank 0, and a dry run's ``note`` (what only the real run can decide). Then a dry run's
    ``refusal`` (a resume with nothing to train), raised: the plan shows the user where the run stands, then the
    same one line and exit status as the run itself, so that a script checking with ``--dry_run`` gets the real
    verdict (as for a folder it would refuse)."""
    from gptoughts.training.metrics import console

    if env.dist.is_main:
        console.print(plan.format(threads_pending=probing), highlight=False)
        if note:
            console.print(f"note: {note}", highlight=False)
    if refusal:
        raise UserError(refusal)


def choose_memory_layout(
    cfg: Config,
    env: Environment,
    model: Model,
    *,
    dry_run: bool,
    data: Data | None = None,
    resumed_run: dict[str, Any] | None = None,
) -> tuple[Config, Environment]:
    """The memory layout that fits this GPU (``perf/layout.py``: activation checkpointing, optimizer states, CPU
    offload, among the settings the user left to their defaults), decided once on the meta model's estimates and
    applied to the config, with why in ``cfg.resolved`` (the plan prints it); offload also starts the process group
    of one it needs. A run that nothing fits is refused here, before anything heavy, unless
    ``--ignore_memory_estimate`` (or a dry run: its plan warns).

    Estimated at the batch the run will train with (``batches.layout_batch``, given ``data``: a size's default
    micro-batch cut for a small corpus, a resume's global batch), not the config's micro-batch: a layout chosen for
    rows the run never holds would turn on checkpointing or offload it does not need."""
    from gptoughts.training.batches import layout_batch
    from gptoughts.training.estimates import layout_search

    shape = layout_batch(cfg, env, data, model, resumed_run) if data is not None else None
    search = layout_search(_at_batch(cfg, shape), env, model)
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
        # Resolved again for the offloaded run (auto: every micro-batch, or FSDP2 would keep the whole unsharded
        # gradient on the GPU between micro-batches, which the estimate that chose offload does not count).
        dist, sync = resolve_grad_sync(cfg, dist, env.hw)
        cfg = replace(cfg, resolved={**cfg.resolved, "grad_sync": sync})
        env = replace(env, dist=dist)
    return cfg, env


def _at_batch(cfg: Config, shape: tuple[int, int] | None) -> Config:
    """``cfg`` with the (micro-batch, accumulation) the run will train with, for the layout's estimates only (the
    config the run keeps is unchanged: the batch step plans the same shape from it)."""
    if shape is None or shape == (cfg.train.batch_size, cfg.train.grad_accum):
        return cfg
    return replace(cfg, train=replace(cfg.train, batch_size=shape[0], grad_accum=shape[1]))


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
        _whole_model_for_long_runs(env, model, batch, start=resumed_step(resume_from))
    from gptoughts.training.resolve import resolve_run

    # A dry run builds nothing: what the build would apply, with the layout read where the build reads it.
    applied = model.built.resolved if model.built is not None else _unbuilt_settings(env, model)
    spec = resolve_run(
        cfg, env.resolved, model.transforms, applied, batch, env.dist, model.raw, threads, env.device.type
    )
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


def _unbuilt_settings(env: Environment, model: Model) -> dict[str, object] | None:
    """A dry run's :attr:`setup.Built.resolved`, from the meta model and the process group it would run in."""
    from gptoughts.training.setup import parallel_layout, settings

    if model.transforms is None:
        return None
    return settings(model.transforms, parallel_layout(env.dist, model.raw))


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


def _whole_model_for_long_runs(env: Environment, model: Model, batch: BatchPlan, start: int = 0) -> None:
    """``compile_mode = auto``: a run estimated shorter than ``WHOLE_MODEL_MIN_RUN_S`` trains on the per-block
    graphs (the whole model's compile would cost more than its faster steps gain). ``start``: the step a resumed
    run starts after; what this session trains, and so repays the compile, is the steps left."""
    from gptoughts.training.estimates import estimate_speed
    from gptoughts.training.resolve import WHOLE_MODEL_MIN_RUN_S

    tps, _ = estimate_speed(env, model, batch.block_size, batch.micro_batch, env.dist.world_size)
    if not tps:
        _use_blocks(model, "auto: the run's length cannot be estimated on this GPU (unknown peak)")
        return
    left = max(0, batch.total_steps - start)
    run_s = left * batch.tokens_per_step / tps
    if run_s < WHOLE_MODEL_MIN_RUN_S:
        what = f"the {left:,} steps left after step {start:,}" if start else "a run"
        _use_blocks(
            model,
            f"auto: {what} estimated at ~{max(1, round(run_s / 60))} min (the whole model's compile repays from "
            f"~{WHOLE_MODEL_MIN_RUN_S // 60} min)",
        )


def _use_blocks(model: Model, why: str) -> None:
    """The decision recorded where the plan reads it (nothing compiled whole yet: nothing to undo)."""
    model.transforms = model.transforms.with_blocks(why)
    if model.built is not None:
        model.built.spec = model.transforms


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


# ------------------------------------------------------------------------------- timing (bench, tune, scripts)
