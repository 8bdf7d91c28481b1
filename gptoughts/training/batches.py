"""The batch step of the assembly: micro-batch (auto: the largest that fits), accumulation, tokens per step, steps,
epochs, warmup and the evaluation/checkpoint intervals, each with the rule that decided it."""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any

from gptoughts.config import Config, TrainConfig
from gptoughts.errors import ConfigError, UserError
from gptoughts.parallel import dist as pdist
from gptoughts.training.corpus import Data
from gptoughts.training.environment import Environment
from gptoughts.training.modeling import Model
from gptoughts.training.plan import MEASURED_BATCH, BatchPlan
from gptoughts.training.plan import gib as plan_gib


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
    resumed_at: tuple[int, int] | None = None,
) -> BatchPlan:
    """Micro-batch (auto: the largest that fits), accumulation, tokens per step, steps, epochs, warmup and the
    evaluation/checkpoint intervals, each with the rule that decided it. ``resumed_at``: the step and the tokens
    seen of the checkpoint a run resumes (a token or epoch budget counts them)."""
    from gptoughts.training.optim import default_warmup

    t, info = cfg.train, env.dist
    why: dict[str, str] = {}
    train_tokens = _train_tokens(cfg, data, model, info)
    epochs = _epochs_asked(t)
    row_tokens = _row_tokens(cfg, data)
    if not isinstance(t.batch_size, int):
        # the rows a step may hold so that the epochs asked for are enough steps (_fit_epochs): what the memory
        # estimates below assume of the accumulation too
        rows_cap = _rows_for_epochs(epochs * train_tokens, row_tokens * info.dp_size) if epochs else None
        micro, accum = _auto_batch(cfg, env, model, dry_run, why, rows_cap)
        if epochs is not None:
            micro, accum = _fit_epochs(micro, accum, epochs * train_tokens, row_tokens * info.dp_size, why)
    else:
        micro, accum = given_batch(
            cfg, env, data, model, why=why, train_tokens=train_tokens, resumed_run=resumed_run
        )
    if data.prefs is not None:
        why.setdefault("batch_size", "pairs, each 2 rows: chosen and rejected")
    accum, tokens_per_step = _resumed_global_batch(cfg, resumed_run, micro, accum, row_tokens, info, why)
    total_steps, rule = _total_steps(cfg, epochs, train_tokens, tokens_per_step)
    # The run's tokens: a resumed run's checkpoint saw its own; the steps after it are of this batch.
    total_tokens = total_steps * tokens_per_step
    if resumed_at is not None and resumed_at[1] != resumed_at[0] * tokens_per_step:
        step, seen = resumed_at
        if t.max_steps is None:
            # The run's batch was another until now: the budget's remaining tokens at this batch, not all of it
            # again. (An unchanged batch keeps the plan of the run's start, so that an exact resume stays exact.)
            budget = t.max_tokens if t.max_tokens is not None else epochs * train_tokens  # type: ignore[operator]
            left = (budget - seen) / tokens_per_step
            # at least the tokens asked for; the epochs asked for to within half a step, as a new run plans them
            total_steps = step + max(
                0, math.ceil(left) if t.max_tokens is not None else math.floor(left + 0.5)
            )
            rule += f", {max(0, budget - seen):,.0f} tokens of it left at step {step} at this batch"
        total_tokens = seen + max(0, total_steps - step) * tokens_per_step
    warmup = t.warmup_steps if t.warmup_steps is not None else default_warmup(total_steps)
    why["warmup_steps"] = "asked" if t.warmup_steps is not None else "auto: 2% of the run, at most 2000"
    eval_interval, save_interval, tasks_interval = _intervals(
        cfg, env, model, micro, tokens_per_step, total_steps, why
    )
    return BatchPlan(
        micro_batch=micro,
        grad_accum=accum,
        world_size=info.world_size,
        dp_size=info.dp_size,
        block_size=t.block_size,
        tokens_per_step=tokens_per_step,
        total_steps=total_steps,
        train_tokens=train_tokens,
        epochs=total_tokens / max(1, train_tokens),
        total_tokens=total_tokens,
        phases=_phases(cfg, data, tokens_per_step, accum, resumed_at),
        stop_rule=rule,
        warmup_steps=min(warmup, total_steps),
        eval_interval=eval_interval,
        save_interval=save_interval,
        why=why,
        tp=info.tp,
        tasks_interval=tasks_interval,
        eval_block=data.dataset.longest_window("val", t.block_size) if data.manifest is not None else None,
        checkpoints=cfg.checkpoint.checkpoints,
    )


def _epochs_asked(t: TrainConfig) -> float | None:
    """The epochs asked for (one when no stopping rule is given); None under a step or token budget."""
    return None if t.max_steps is not None or t.max_tokens is not None else (t.epochs or 1.0)


def _row_tokens(cfg: Config, data: Data) -> int:
    """Tokens of one row of a micro-batch: a preference pair is two rows (chosen, rejected), a step counts both."""
    return cfg.train.block_size * (2 if data.prefs is not None else 1)


def given_batch(
    cfg: Config,
    env: Environment,
    data: Data,
    model: Model,
    *,
    why: dict[str, str] | None = None,
    train_tokens: int | None = None,
    resumed_run: dict[str, Any] | None = None,
) -> tuple[int, int]:
    """(micro-batch, accumulation) of a run whose micro-batch is a number (not ``auto``): as given, or a default one
    cut for a small corpus (:func:`_fit_default_batch`); a resumed run keeps its own where this command names
    neither. What this step plans, and what the memory layout is chosen for before it (:func:`layout_batch`).
    ``train_tokens``: one epoch's, where already counted."""
    t, info = cfg.train, env.dist
    assert isinstance(t.batch_size, int), t.batch_size
    own = ((resumed_run or {}).get("plan") or {}).get("batch") or {}
    if _default_batch(cfg) and not cfg.is_given("train.grad_accum") and own.get("micro_batch"):
        # (another --epochs would otherwise cut the default again: the batch would change under the resume)
        if why is not None:
            why["batch_size"] = f"{own['micro_batch']}: the resumed run's own"
        return int(own["micro_batch"]), int(own.get("grad_accum") or t.grad_accum)
    epochs = _epochs_asked(t)
    if epochs is None or not _default_batch(cfg):
        return t.batch_size, t.grad_accum
    if train_tokens is None:
        train_tokens = _train_tokens(cfg, data, model, info)
    return _fit_default_batch(
        cfg,
        t.batch_size,
        t.grad_accum,
        epochs * train_tokens,
        _row_tokens(cfg, data) * info.dp_size,
        {} if why is None else why,
    )


def layout_batch(
    cfg: Config, env: Environment, data: Data, model: Model, resumed_run: dict[str, Any] | None = None
) -> tuple[int, int] | None:
    """(micro-batch, accumulation) that the memory layout is chosen for (``build.choose_memory_layout``, before this
    step): a given micro-batch as :func:`plan_batches` will plan it (:func:`given_batch`, then a resumed run's global
    batch kept); None under ``batch_size = auto`` (its micro-batch is found after the layout)."""
    if not isinstance(cfg.train.batch_size, int):
        return None
    micro, accum = given_batch(cfg, env, data, model, resumed_run=resumed_run)
    accum, _ = _resumed_global_batch(cfg, resumed_run, micro, accum, _row_tokens(cfg, data), env.dist, {})
    return micro, accum


def _phases(
    cfg: Config, data: Data, tokens_per_step: int, accum: int, resumed_at: tuple[int, int] | None
) -> list[dict[str, Any]]:
    """The curriculum's phases with the step each begins at (``curriculum.phase_schedule``); none for a run without
    one, or whose data is examples or pairs (their loaders draw no phases)."""
    if not cfg.data.phases or data.sft is not None or data.prefs is not None:
        return []
    from gptoughts.training.curriculum import phase_schedule

    return phase_schedule(
        cfg.data.phases, tokens_per_step=tokens_per_step, grad_accum=accum, resumed_at=resumed_at
    )


def _default_batch(cfg: Config) -> bool:
    """Whether the micro-batch is a default the user did not choose: no --batch_size (nor a TOML of theirs) named it,
    or a shipped preset did (its choice for its own corpus)."""
    return not cfg.is_given("train.batch_size") or "train.batch_size" in cfg.shipped


def _fit_default_batch(
    cfg: Config, micro: int, accum: int, tokens: float, row_tokens: int, why: dict[str, str]
) -> tuple[int, int]:
    """A default micro-batch (:func:`_default_batch`) cut as an automatic one is (:func:`_fit_epochs`): so that the
    epochs asked for (``tokens`` of training) hold at least MIN_USEFUL_STEPS steps, never one step that reads a small
    corpus twice. The user's --grad_accum is kept (only the default, the micro-batch, is cut to make room for it).
    Returns (micro-batch, accumulation)."""
    rows = _rows_for_epochs(tokens, row_tokens)
    if micro * accum <= rows:
        return micro, accum
    if cfg.is_given("train.grad_accum") and "train.grad_accum" not in cfg.shipped:
        cut = max(1, min(micro, rows // accum))
        if cut < micro:
            from gptoughts.training.plan import MIN_USEFUL_STEPS

            steps = tokens / (cut * accum * row_tokens)
            why["batch_size"] = (
                f"the default {micro} cut to {cut} for the epochs: {tokens:,.0f} tokens of training are then "
                f"~{steps:.0f} steps at --grad_accum {accum} ({MIN_USEFUL_STEPS} or more wanted)"
            )
        return cut, accum
    if rows < micro:
        why["batch_size"] = f"the default {micro}"
    return _fit_epochs(micro, accum, tokens, row_tokens, why, what="default")


def _train_tokens(cfg: Config, data: Data, model: Model, info: pdist.DistInfo) -> int:
    """Tokens of one epoch: the windows the loader draws in one pass over the shards (``epoch_windows``; a dry run
    without shards: :func:`_estimated_windows`), the SFT examples' rows (packed or not) or the pairs' two rows, times
    the block. Not the corpus's tokens: each shard's tail shorter than a window is never drawn, and the loader's
    epoch counter (the one ``metrics.jsonl`` logs) counts windows."""
    block = cfg.train.block_size
    if data.prefs is not None:
        return len(data.prefs.train_idx) * 2 * block
    if data.sft is None:
        if data.manifest is not None:
            from gptoughts.data.loader import epoch_windows

            return epoch_windows(data.dataset, block) * block
        if data.estimated:
            return _estimated_windows(cfg, data) * block
        return int(data.corpus["tokens"])  # (stand-in data of timing runs: no shards)
    from gptoughts.data.sft import epoch_rows

    packing = data_packing(cfg, model)
    if packing and info.pp > 1:
        raise ConfigError(
            "parallel.pp passes only the hidden state between stages, not the packed rows' document "
            "ids: add --data.packing false"
        )
    return epoch_rows(data.sft, cfg.train.seed, packing) * cfg.train.block_size


def _estimated_windows(cfg: Config, data: Data) -> int:
    """A dry run's windows of one epoch, before the corpus is tokenized: its estimated train tokens shared out over
    the sources by their bytes (each cut to data.max_bytes), each source's split written as prepare writes it (shards
    of SHARD_TOKENS, the last holding the rest), counted as the loader counts them."""
    from gptoughts.data.loader import windows_in
    from gptoughts.data.prepare import SHARD_TOKENS

    cap = cfg.data.max_bytes
    sizes = [b if cap is None else min(b, cap) for b in data.corpus.get("per_source") or [1]]
    tokens, shards = int(data.corpus["tokens"]), []
    for b in sizes:
        full, rest = divmod(tokens * b // max(1, sum(sizes)), SHARD_TOKENS)
        shards += [SHARD_TOKENS] * full + [rest]
    # (at least one: a corpus the dry run's checks pass has a source of a window, however the shares fall)
    return max(1, int(windows_in(shards, cfg.train.block_size).sum()))


def _auto_batch(
    cfg: Config,
    env: Environment,
    model: Model,
    dry_run: bool,
    why: dict[str, str],
    rows_cap: int | None = None,
) -> tuple[int, int]:
    """``batch_size = auto``: the micro-batch that fits, then the accumulation of the global batch (``rows_cap``: the
    rows a step may hold for the epochs asked for, :func:`_rows_for_epochs`)."""
    info = env.dist
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
        micro, why["batch_size"] = _cpu_micro_batch(cfg, env, model, rows_cap)
    elif dry_run:
        micro = _largest_fitting(cfg, env, model, [2**k for k in range(9)], rows_cap=rows_cap)[0]
        why["batch_size"] = "auto: estimated from memory (found with real steps when the run starts)"
    else:
        micro, why["batch_size"] = _probed_micro_batch(cfg, env, model)
    return _auto_accumulation(cfg, micro, info.dp_size, why)


def _probed_micro_batch(cfg: Config, env: Environment, model: Model) -> tuple[int, str]:
    """The largest micro-batch that fits in real training steps on this GPU (cached per model and GPU), and why."""
    from gptoughts.perf.autobatch import NothingFits
    from gptoughts.training.setup import auto_micro_batch

    t = cfg.train
    parts = {
        "family": model.family.name,
        "args": asdict(model.args) if hasattr(model.args, "__dataclass_fields__") else repr(model.args),
        "block": t.block_size,
        "gpu": env.hw.name,
        "precision": env.precision,
        "resolved": model.built.resolved,
        "world": env.dist.world_size,
        "accumulates": _accumulates(cfg),
        # What else fills the memory the probe measured: another optimizer, its states' storage, a GPU cap, offload,
        # adapters or the objective's rows change the micro-batch that fits.
        "memory_bytes": env.hw.memory_bytes,
        "optimizer": (t.optimizer, t.optimizer_states),
        "offload": env.dist.cpu_offload,
        "lora": asdict(cfg.lora) if cfg.lora.enabled else None,
        "objective": t.objective,
        "dpo": asdict(cfg.dpo) if t.objective == "dpo" else None,
        "loss": (cfg.perf.loss, cfg.perf.loss_chunk),
        "fused_adamw": cfg.perf.fused_adamw,
        "reserve": _graph_reserve(cfg, env, model),
        "margin": "of the memory the run may fill",  # (not of the whole GPU under a cap, as cached before)
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
            dist=env.dist,
            parts=parts,
            accumulates=parts["accumulates"],
            reserve_bytes=parts["reserve"],
            # The margin is of what the run may fill (a --gpu_memory_gib cap), not of the whole GPU: a probe that
            # passed just under the cap left the run's first accumulated step out of memory.
            capacity=env.hw.memory_bytes or None,
        )
    except NothingFits:  # the estimate said it would: say what each way out needs
        lead = f"not even one row of {t.block_size:,} tokens fits in real training steps"
        raise UserError(layout_refusal(cfg, env, model, lead)) from None
    return micro, MEASURED_BATCH + (" (cached)" if cached else "")


def _graph_reserve(cfg: Config, env: Environment, model: Model) -> int:
    """Bytes the run keeps that the probe's steps do not: Muon's recorded step's private memory
    (perf.muon_graph), held aside while probing."""
    from gptoughts.perf.estimate import muon_graph_bytes
    from gptoughts.training.optim import records_muon_step

    graph = records_muon_step(cfg, env, getattr(model.built, "keep_grads", False))
    return int(muon_graph_bytes(model.raw)) if graph else 0


def _accumulates(cfg: Config) -> bool:
    """Whether an automatic batch's run will accumulate gradients, known before its micro-batch: the user's
    --grad_accum, else a global batch to reach (more than one micro-batch, unless the micro-batch alone reaches
    it: then the probe was cautious by one gradient's memory)."""
    t = cfg.train
    if cfg.is_given("train.grad_accum"):
        return t.grad_accum > 1
    return bool(t.global_batch_tokens)


def _auto_accumulation(cfg: Config, micro: int, dp_size: int, why: dict[str, str]) -> tuple[int, int]:
    """(micro-batch, accumulation) of an automatic batch: the user's --grad_accum, else what reaches the size's
    global batch."""
    from gptoughts.perf.autobatch import global_batch_shape

    t = cfg.train
    accum = t.grad_accum
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
        micro, accum = global_batch_shape(t.global_batch_tokens, micro, t.block_size, dp_size)
        why["grad_accum"] = f"to reach train.global_batch_tokens = {t.global_batch_tokens:,}"
    return micro, accum


def _resumed_global_batch(
    cfg: Config,
    resumed_run: dict[str, Any] | None,
    micro: int,
    accum: int,
    block: int,
    info: pdist.DistInfo,
    why: dict[str, str],
) -> tuple[int, int]:
    """(accumulation, tokens per step): a run resumed on another number of data-parallel ranks (an FSDP run
    resumed on one GPU) keeps its global batch, so that the schedule, the data position and the loss scale mean
    what they meant; a --grad_accum typed in this command wins, and the plan says the global batch changes."""
    tokens_per_step = micro * block * accum * info.dp_size
    saved_dp = resumed_run.get("dp_size", resumed_run.get("world_size")) if resumed_run else None
    old = resumed_run.get("tokens_per_step") if resumed_run else None
    if not saved_dp or saved_dp == info.dp_size or not old or old == tokens_per_step:
        return accum, tokens_per_step

    def ranks(dp: int, world: Any) -> str:
        # the ranks that read their own rows set the global batch; tensor or pipeline parallel processes share
        # them, so the same process count may be another number of ranks
        return f"{dp} data-parallel rank(s)" + (f" of {world} processes" if world and world != dp else "")

    now, saved = ranks(info.dp_size, info.world_size), ranks(saved_dp, (resumed_run or {}).get("world_size"))
    if "train.grad_accum" in cfg.flags:
        why["grad_accum"] = (
            f"{accum} (--grad_accum): the global batch changes from the resumed run's {old:,} tokens "
            f"(saved on {saved}) to {tokens_per_step:,}"
        )
        return accum, tokens_per_step
    k = old / (micro * block * info.dp_size)
    if k != int(k):
        rows = old // block
        fix = (
            f"pass --batch_size and --grad_accum with batch x grad_accum x {info.dp_size} x {block} = {old:,}"
            if rows % info.dp_size == 0
            else f"its {rows} rows a step do not split over {info.dp_size} ranks: resume it on a number of "
            f"ranks that divides {rows}, or pass --grad_accum to train on at another global batch"
        )
        raise ConfigError(
            f"resuming on {now} a run saved on {saved} changes the global batch from {old:,} to "
            f"{tokens_per_step:,} tokens and no --grad_accum keeps it; {fix}"
        )
    why["grad_accum"] = (
        f"{int(k)}: keeps the resumed run's global batch of {old:,} tokens on {now} (it was saved on {saved})"
    )
    return int(k), old


def _total_steps(
    cfg: Config, epochs: float | None, train_tokens: int, tokens_per_step: int
) -> tuple[int, str]:
    """The run's optimizer steps, and the stopping rule that decided them, named where it came from: a flag of
    this command, the shipped preset, or the file that holds it (the TOML named, the resumed run's config.toml)."""
    t = cfg.train
    if t.max_steps is not None:
        total_steps, name, value = t.max_steps, "max_steps", str(t.max_steps)
    elif t.max_tokens is not None:
        total_steps, name, value = (
            math.ceil(t.max_tokens / tokens_per_step),
            "max_tokens",
            f"{t.max_tokens:,}",
        )
    else:
        assert epochs is not None
        # The nearest whole number of steps: the plan's epochs are then the asked ones to within half a step.
        total_steps = math.floor(epochs * train_tokens / tokens_per_step + 0.5)
        if t.epochs is None:
            return max(1, total_steps), "one epoch (no --max_steps, --epochs or --max_tokens)"
        name, value = "epochs", f"{epochs:g}"
    key = f"train.{name}"
    if key in cfg.flags or cfg.origin is None:  # typed, or a Config built in code
        rule = f"--{name} {value}"
    elif key in cfg.shipped:
        rule = f"the preset's {name} {value}"
    else:
        rule = f"{name} {value} in {cfg.origin}"
    return max(1, total_steps), rule


def _intervals(
    cfg: Config,
    env: Environment,
    model: Model,
    micro: int,
    tokens_per_step: int,
    total_steps: int,
    why: dict[str, str],
) -> tuple[int, int, int]:
    """(eval, save, task-scoring) intervals in steps: the asked ones, else spaced by the plan's time estimate."""
    from gptoughts.training.estimates import estimate_speed

    tps, _ = estimate_speed(env, model, cfg.train.block_size, micro, env.dist.world_size)
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
    return eval_interval, save_interval, tasks_interval


def _fit_epochs(
    micro: int, accum: int, tokens: float, row_tokens: int, why: dict[str, str], what: str = "automatic"
) -> tuple[int, int]:
    """An automatic batch (``what``: or a default one, :func:`_fit_default_batch`) cut so that the epochs asked for
    (``tokens`` of training) hold at least MIN_USEFUL_STEPS steps: a global batch larger than a small corpus would
    take it twice or more in one step (one epoch planned as 2, even 4), with too few steps for the schedule. Returns
    (micro-batch, accumulation)."""
    from gptoughts.training.plan import MIN_USEFUL_STEPS

    rows = _rows_for_epochs(tokens, row_tokens)
    if micro * accum <= rows:
        return micro, accum
    if rows < micro:  # the batch line's figures are of the micro-batch the memory rule chose: say it was cut
        why["batch_size"] = (
            f"{why.get('batch_size', 'auto')}; {micro} rows cut to {rows} for the epochs (below)"
        )
    micro = min(micro, rows)
    accum = max(1, rows // micro)
    if tokens < MIN_USEFUL_STEPS * row_tokens:  # even one row a step leaves fewer: say so, not "at least"
        why["grad_accum"] = (
            f"1, with micro-batch 1: the {what} batch cut to one row a step, its least ({tokens:,.0f} tokens "
            f"of training, the epochs asked for, hold {tokens / row_tokens:.1f} steps of one row per rank)"
        )
        return micro, accum
    why["grad_accum"] = (
        f"{accum}, with micro-batch {micro}: the {what} batch cut so that {tokens:,.0f} tokens of training "
        f"(the epochs asked for) are at least {MIN_USEFUL_STEPS} steps"
    )
    return micro, accum


def _rows_for_epochs(tokens: float, row_tokens: int) -> int:
    """The rows each rank may read a step so that ``tokens`` of training hold at least MIN_USEFUL_STEPS steps."""
    from gptoughts.training.plan import MIN_USEFUL_STEPS

    return max(1, int(tokens // (MIN_USEFUL_STEPS * row_tokens)))


def _largest_fitting(
    cfg: Config,
    env: Environment,
    model: Model,
    candidates: list[int],
    default: int = 8,
    rows_cap: int | None = None,
) -> tuple[int, float | None, float | None]:
    """(micro-batch, its estimated peak GiB, the device's GiB): the largest of ``candidates`` whose estimate fits
    90% of the device's memory (the smallest when none does: the memory check then refuses the run); ``default``
    where there is no estimate or no memory figure. Each is estimated at the accumulation the run would have, cut
    to ``rows_cap`` rows a step as :func:`_fit_epochs` cuts it (the plan's memory line then agrees)."""
    from gptoughts.training.estimates import accumulation, device_memory_gib, estimate_peak

    mem = device_memory_gib(env)
    best, peak = candidates[0], None
    t, dist = cfg.train, env.dist
    for b in candidates:
        accum = accumulation(cfg, b, t.block_size, dist.world_size // dist.tp)
        if rows_cap is not None:
            accum = min(accum, max(1, rows_cap // b))
        e = estimate_peak(cfg, env, model, b, t.block_size, dist.world_size, dist.tp, accum)
        if e is None or not mem:
            return default, None, mem
        if b > candidates[0] and e.total_gib > 0.9 * mem:
            break
        best, peak = b, e.total_gib
    return best, peak, mem


def _cpu_micro_batch(
    cfg: Config, env: Environment, model: Model, rows_cap: int | None = None
) -> tuple[int, str]:
    """``batch_size = auto`` off CUDA, and why: no trial steps (the memory search needs a GPU's allocator), so the
    largest of 1, 2, 4, 8 rows (8: the CPU default) whose estimated peak fits 90% of the memory available."""
    micro, peak, mem = _largest_fitting(cfg, env, model, [1, 2, 4, 8], rows_cap=rows_cap)
    if peak is None or not mem:
        return micro, f"auto on a {env.device.type.upper()}: {micro}, the default (no memory estimate here)"
    if peak > 0.9 * mem:  # none fits: the smallest, which the memory check then judges
        return micro, (
            f"auto on a {env.device.type.upper()}: {micro}, the smallest of 1, 2, 4, 8 rows; even its estimated peak "
            f"(~{plan_gib(peak)}) is over 90% of the {plan_gib(mem)} available"
        )
    return micro, (
        f"auto on a {env.device.type.upper()}: the largest of 1, 2, 4, 8 rows whose estimated peak "
        f"(~{plan_gib(peak)}) fits 90% of the {plan_gib(mem)} available"
    )


def data_packing(cfg: Config, model: Model) -> bool:
    """SFT packing, unless the model is a generic transformers model (no per-document attention masks)."""
    return bool(cfg.data.packing and not (model.pretrained is not None and model.pretrained.generic))


def layout_refusal(cfg: Config, env: Environment, model: Model, lead: str) -> str:
    """The refusal of a run that does not fit, led by ``lead``: the memory each way out would need (estimates), or
    the ways out alone where the run has no estimate."""
    from gptoughts.training.estimates import GPU_FIXES, layout_search

    search = layout_search(cfg, env, model)
    return search.refusal(lead) if search is not None else f"{lead}: {GPU_FIXES}"
