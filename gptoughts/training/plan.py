"""The run plan: what a run will do, printed before its first step and written to ``run.json``.

Model (family/size, parameters total and non-embedding), corpus read (files, bytes, tokens, and "all of it" or
what was cut and why), tokens per step, steps, epochs over the data, the estimated peak memory (the
``gptoughts estimate`` formulas) and time on this hardware, where the run lands, and the warnings a person
would want before spending hours: many epochs over a small corpus, a model far larger than its data, a block
longer than most documents, a cap that cuts the corpus.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gptoughts.perf.estimate import duration
from gptoughts.perf.layout import REFUSE_ABOVE
from gptoughts.training.checkpoint import store
from gptoughts.training.estimates import (
    GPU_FIXES,
    cpu_optimizer_seconds,
    device_memory_gib,
    estimate_peak,
    estimate_speed,
    with_optimizer_step,
)
from gptoughts.training.evaluation import early_stopping_line
from gptoughts.training.rundir import adapter_scale_change, is_run, read_run_json

MEASURED_BATCH = "auto: largest that fits"
"""How the batch plan names a micro-batch found with real training steps (``batches._probed_micro_batch``)."""

# Beyond ~4 epochs, repeated data adds little and overfits (Muennighoff et al. 2023, "Scaling data-constrained
# language models").
MAX_USEFUL_EPOCHS = 4.0
# Fewer optimizer steps than this leave the schedule (warmup, decay) no room; an automatic batch is cut to keep
# an epoch rule above it.
MIN_USEFUL_STEPS = 20
# Compute-optimal training wants ~20 tokens per parameter (Hoffmann et al. 2022); below 1 the model memorises.
TOKENS_PER_PARAM_OPTIMAL = 20


@dataclass
class BatchPlan:
    micro_batch: int
    grad_accum: int
    world_size: int
    block_size: int
    tokens_per_step: int
    total_steps: int
    train_tokens: int
    """Training tokens in one epoch of the data."""
    epochs: float
    stop_rule: str
    warmup_steps: int
    eval_interval: int
    save_interval: int
    why: dict[str, str] = field(default_factory=dict)
    dp_size: int = 1
    """Data-parallel ranks (reading different data): fewer than ``world_size`` under pipeline/tensor parallelism
    (0 in the run.json of older runs: all of them)."""
    tp: int = 1
    """Tensor-parallel degree: ``world_size / tp`` data-parallel ranks read different micro-batches."""
    tasks_interval: int = 0
    """Steps between two scorings of ``eval.eval_tasks`` (0: only at the end)."""
    eval_block: int | None = None
    """Tokens of an evaluation window: the block, or less when the held-out split is shorter (0: no held-out
    data, no evaluation); None: the block (not known before the corpus is tokenized, or examples)."""
    checkpoints: bool = True
    """Whether the run writes checkpoints at all (checkpoint.checkpoints)."""
    total_tokens: int = 0
    """Training tokens of the whole run: ``total_steps x tokens_per_step``, or for a run resumed at another batch
    size the tokens its checkpoint saw plus the steps left at this batch (0 in the run.json of older runs: the
    product)."""
    phases: list[dict[str, Any]] = field(default_factory=list)
    """The curriculum (``data.phases``): each phase's name, token budget, first token and the step holding its first
    batch (``curriculum.phase_schedule``); empty without one."""


@dataclass
class RunPlan:
    model: str
    params: int
    params_non_embedding: int
    trainable_params: int
    vocab_size: int
    block_size: int
    corpus: dict[str, Any]
    batch: dict[str, Any]
    memory_gib: float | None
    device_memory_gib: float | None
    tokens_per_s: float | None
    speed_basis: str
    hours: float | None
    out: str
    resume: str | None
    resolved: dict[str, Any]
    warnings: list[str]
    host_memory_gib: float | None = None
    """CPU memory per process for the offloaded training state (``parallel.cpu_offload``)."""
    checkpoint_staging_gib: float | None = None
    """CPU memory per process that asynchronous sharded checkpoints keep: a host copy of the rank's shards."""
    tasks: dict[str, Any] = field(default_factory=dict)
    """``eval.eval_tasks`` scored during training: names, examples, interval, how ranks share them ({}: none)."""
    layout: str = ""
    """The transformers architecture a Llama with a variant's switch is (``qwen2 layout (exports as
    Qwen2ForCausalLM)``: what ``--model qwen2`` asked for); empty for the family's own layout."""
    device_type: str = "cuda"
    """cuda, mps or cpu: what the processes are (GPUs or not) and what memory bounds them."""
    start_step: int = 0
    """The step a resumed run starts after (0: a new run): ``hours`` is the time of the steps left."""
    replaces: str = ""
    """What --overwrite does to a run ``out`` holds, said before it is gone ("": nothing there to replace)."""
    early_stopping: str = ""
    """A resumed run whose checkpoint already counts evaluations without improvement: when early stopping will end
    it, the count carrying over (``evaluation.early_stopping_line``); "": nothing carried over."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def format(self, threads_pending: bool = False) -> str:
        """The plan as the lines a person reads before the run starts. ``threads_pending``: a CPU run's thread
        probe comes next, so the thread count, the time it sets and the rest follow it (:meth:`after_probe`)."""
        lines = [self._model_line(), self._corpus_line(), self._batch_line(), self._steps_line()]
        lines += self._curriculum_lines()
        lines += [f"  early stopping: {self.early_stopping}"] if self.early_stopping else []
        lines += self._setting_lines()
        if threads_pending:
            return "\n".join([*lines, f"  {self._memory_figure()}"])
        lines.append(f"  {self._memory_figure()}; {self.time_line()}")
        if "threads" in self.resolved:
            lines.append(self.threads_line())
        return "\n".join(lines + self._closing_lines())

    def after_probe(self) -> str:
        """The plan's last lines once the thread probe has chosen the count and retimed the run."""
        return "\n".join([self.threads_line(), f"  {self.time_line()}", *self._closing_lines()])

    def _closing_lines(self) -> list[str]:
        out = f"  out: {self.out}" + (f" (resuming {self.resume})" if self.resume else "")
        out += f" ({self.replaces})" if self.replaces else ""
        return [out, *(f"  [yellow]warning:[/yellow] {w}" for w in self.warnings)]

    def _model_line(self) -> str:
        return (
            f"[bold]plan[/bold]: {self.model}, {self.params:,} parameters ({self.params_non_embedding:,} "
            f"non-embedding"
            + (f", {self.trainable_params:,} trainable" if self.trainable_params != self.params else "")
            + f"), vocab {self.vocab_size:,}, block {self.block_size:,}"
            + (f" ({self.resolved['block_size']})" if "block_size" in self.resolved else "")
            + (f"; {self.layout}" if self.layout else "")
        )

    def _corpus_line(self) -> str:
        c = self.corpus
        if "examples" in c:
            return f"  corpus: {c['summary']}"
        approx = "≈" if c.get("estimated") else ""
        read = (
            "all of it"
            if not c.get("cut")
            else f"{_mb(c['bytes_read'])} of it (cut by data.max_bytes = {c.get('max_bytes'):,})"
        )
        return (
            f"  corpus: {c['files']:,} file(s), {_mb(c['bytes'])} on disk, read {read}; "
            f"{approx}{c['tokens']:,} train tokens"
            + (f" + {c['val_tokens']:,} held out" if c.get("val_tokens") is not None else "")
            + (" (estimated: not tokenized yet)" if c.get("estimated") else "")
        )

    def _batch_line(self) -> str:
        b = self.batch
        dp = b.get("dp_size") or b["world_size"] // b.get("tp", 1)
        pairs = b["tokens_per_step"] == 2 * b["micro_batch"] * b["block_size"] * b["grad_accum"] * dp
        rows = f"{b['micro_batch']} pairs x 2 rows" if pairs else f"{b['micro_batch']}"  # preference pairs
        return (
            f"  batch: {rows} x {b['block_size']} tokens x accumulation {b['grad_accum']}"
            + self._ranks()
            + f" = {b['tokens_per_step']:,} tokens per step"
            + (f" (batch_size {self.resolved['batch_size']})" if "batch_size" in self.resolved else "")
            + (f"; accumulation {self.resolved['grad_accum']}" if "grad_accum" in self.resolved else "")
        )

    def _ranks(self) -> str:
        """The batch line's factor of processes: tensor-parallel groups, data-parallel ranks, or all of them."""
        b = self.batch
        units = "GPUs" if self.device_type == "cuda" else "processes"
        # (dp_size 0: a run.json from before it was always written, when it meant "all of them")
        dp = b.get("dp_size") or b["world_size"] // b.get("tp", 1)
        if b.get("tp", 1) > 1:
            return f" x {dp} data-parallel rank(s) (tensor parallel x{b['tp']}: {b['world_size']} {units})"
        if dp == b["world_size"]:
            return f" x {dp} {units}" if dp > 1 else ""
        return f" x {dp} data-parallel" if dp > 1 else ""  # (pipeline stages share each row)

    def _steps_line(self) -> str:
        b = self.batch
        ev = f"eval every {b['eval_interval']:,}" if b["eval_interval"] else "eval at the end"
        if b.get("eval_block") == 0:
            ev = "no evaluation (no held-out data)"
        # a pair or example file too small (or data.val_fraction 0) holds nothing out
        if self.corpus.get("val_pairs") == 0:
            ev = "no evaluation (no held-out pairs)"
        if self.corpus.get("val_examples") == 0:
            ev = "no evaluation (no held-out examples)"
        sv = f"checkpoint every {b['save_interval']:,}" if b["save_interval"] else "checkpoint at the end"
        # an interval past the run's end happens once, at the end
        total = b["total_steps"]
        if b["eval_interval"] and b["eval_interval"] >= total and ev.startswith("eval every"):
            ev = f"eval at the end ({ev}: longer than the run)"
        if b["save_interval"] and b["save_interval"] >= total:
            sv = f"checkpoint at the end ({sv}: longer than the run)"
        if not b.get("checkpoints", True):
            sv = "no checkpoints (checkpoint.checkpoints false)"
        elif ev.startswith("eval every"):  # the trainer saves the best weights as it finds them
            sv += " and at each new best val loss"
        tokens = b.get("total_tokens") or b["total_steps"] * b["tokens_per_step"]
        return (
            f"  steps: {b['total_steps']:,} ({b['stop_rule']}) = {b['epochs']:.2f} epoch(s) over the data, "
            f"{tokens:,} tokens; warmup {b['warmup_steps']:,}, {ev}, {sv}"
        )

    def _curriculum_lines(self) -> list[str]:
        """The curriculum's phases, each with the step its first batch is drawn at (or why none is)."""
        b = self.batch
        phases = b.get("phases") or []
        if not phases:
            return []
        total = b["total_steps"]
        parts = []
        for p in phases:
            budget = f"{p['tokens']:,} tokens" if p["tokens"] is not None else "to the end"
            if p["step"] is None:  # (a resume at another batch size: the steps before it were of that batch)
                when = f"{'done' if p.get('done') else 'under way'} at step {self.start_step:,}"
            elif p["step"] > total:
                when = f"from step {p['step']:,}: not reached"
            elif p["skipped"]:
                when = "never drawn (shorter than a batch)"
            else:
                when = f"from step {p['step']:,}"
            parts.append(f"{p['name']} ({budget}) {when}")
        return ["  curriculum: " + ", ".join(parts)]

    def _setting_lines(self) -> list[str]:
        """One line per resolved setting that differs from a plain run (parallelism, tasks, optimizer, memory
        layout, fp8, compile), in the order a reader checks them."""
        r = self.resolved
        lines = []
        if "objective" in r:
            spikes = r.get("spike_detection")
            lines.append(f"  objective: {r['objective']}" + (f"; spike detection {spikes}" if spikes else ""))
        if "parallel" in r:
            reshard, sync = r.get("reshard_after_forward"), r.get("grad_sync")
            lines.append(
                f"  parallel: {r['parallel']}"
                + (f"; reshard_after_forward {reshard}" if reshard else "")
                + (f"; gradients reduced {sync}" if sync and self.batch["grad_accum"] > 1 else "")
            )
        if self.tasks:
            lines.append(self._tasks_line())
        for key, label in (("pipeline", "pipeline"), ("optimizer", "optimizer")):
            if key in r:
                lines.append(f"  {label}: {r[key]}")
        ac = str(r.get("activation_checkpointing", "none"))
        if not ac.startswith("none"):
            lines.append(f"  activation checkpointing: {ac}")
        for key, label in (("optimizer_states", "optimizer states"), ("cpu_offload", "CPU offload")):
            if key in r:  # (set by the memory layout's choice, with why)
                lines.append(f"  {label}: {r[key]}")
        if not str(r.get("fp8", "False")).startswith("False"):
            lines.append(self._fp8_line())
        if not str(r.get("compile", "False")).startswith("False"):
            graphs = str(r.get("cuda_graphs", ""))  # "True" or "True (why)" when on
            graphs = f"; CUDA graphs{graphs[4:]}" if graphs.startswith("True") else ""
            lines.append(f"  compile: {r['compile']}{graphs}")
        if "integrator" in r:
            lines.append(f"  integrator: {r['integrator']}")
        return lines

    def _tasks_line(self) -> str:
        tk = self.tasks
        every = f"every {tk['interval']:,} steps and at the end" if tk["interval"] else "at the end"
        listed = ", ".join(f"{n} ({e:,} examples)" for n, e in zip(tk["names"], tk["examples"]))
        return f"  tasks: {listed}; scored {every}{tk['how']}"

    def _fp8_line(self) -> str:
        n = self.resolved.get("fp8_linears")
        fast = str(self.resolved.get("fp8_fast_accum", "")).startswith("True")
        return (
            f"  fp8: {self.resolved['fp8']}"
            + (f", {n} linear layers" if n else "")
            + ("; fast accumulation in the backward matmuls too" if fast else "")
            + ("; weight gradients in fp8 too" if "fp8_wgrad" in self.resolved else "")
        )

    def _memory_figure(self) -> str:
        if self.memory_gib is None:
            return "memory: not estimated"
        return (
            f"memory: ~{gib(self.memory_gib)} peak"
            + (
                f" of {gib(self.device_memory_gib)}" + (" available" if self.device_type == "cpu" else "")
                if self.device_memory_gib
                else ""
            )
            + (
                " estimated (the micro-batch was measured to fit in real steps)"
                if measured_to_fit(self.batch)
                and self.device_memory_gib
                and self.memory_gib > self.device_memory_gib
                else ""
            )
            + (f" + ~{gib(self.host_memory_gib)} of CPU memory (offload)" if self.host_memory_gib else "")
            + (
                f" + ~{gib(self.checkpoint_staging_gib)} of CPU memory per saving process for background checkpoints"
                if self.checkpoint_staging_gib
                else ""
            )
        )

    def time_line(self) -> str:
        if self.tokens_per_s is None:
            return "time: measured once the run starts"
        left = f" for the {self.steps_left:,} steps left" if self.start_step else ""
        return f"time: ~{duration(self.hours)}{left} at ~{_rate(self.tokens_per_s)} tokens/s ({self.speed_basis})"

    @property
    def steps_left(self) -> int:
        return max(0, self.batch["total_steps"] - self.start_step)

    def retime(self, tokens_per_s: float, basis: str) -> None:
        """A better speed figure than the plan's first (measured after the plan was printed)."""
        self.tokens_per_s, self.speed_basis = tokens_per_s, basis
        self.hours = self.steps_left * self.batch["tokens_per_step"] / tokens_per_s / 3600

    def threads_line(self) -> str:
        """The CPU thread count and why; a count is where the run's losses reproduce bit for bit."""
        t = str(self.resolved["threads"])
        n = t.split(" ", 1)[0]
        return f"  threads: {t}" + (
            f"; results reproduce at this count (--threads {n})" if n.isdigit() else ""
        )


def _rate(r: float) -> str:
    return f"{r:,.0f}" if r >= 100 else f"{r:.2g}"


def gib(g: float) -> str:
    return f"{g:.1f} GiB" if g >= 1 else f"{g * 1024:.0f} MiB"


def _mb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} KB"


def make_plan(
    cfg: Any,
    *,
    env: Any,
    data: Any,
    model: Any,
    batch: BatchPlan,
    run_dir: Path,
    resume_from: Path | None,
    resolved: dict[str, Any],
    tasks: Any = None,
) -> RunPlan:
    """The plan of a run; ``tasks``: the ``TaskScorer`` of ``eval.eval_tasks`` (None: none)."""
    raw = model.raw
    params, params_ne = raw.num_params(), raw.num_params(non_embedding=True)
    trainable = sum(p.numel() for p in raw.parameters() if p.requires_grad) if cfg.lora.enabled else params
    # the size's name, and what the config changed of its shape (the quickstart is a 10M "debug" resized)
    changed = ", ".join(f"{k} {v}" for k, v in cfg.model.overrides.items())
    what = (
        f"{model.family.name}/{cfg.model.size}" + (f" resized ({changed})" if changed else "")
        if data.init_from is None
        else f"{model.family.name} from {resolved.get('base', cfg.model.init_from)}"
        + (" + LoRA" if cfg.lora.enabled else "")
    )
    layout = _variant_layout(model.family, model.args)
    corpus = dict(data.corpus, estimated=data.estimated, max_bytes=cfg.data.max_bytes)
    corpus.pop("per_source", None)
    memory, device_memory, host, staging = _memory(cfg, env, model, batch)
    tps, basis = _speed(cfg, env, model, batch)
    resolved.update(_integrator(cfg, model))  # (the same dict: the assembly adds the measured threads later)
    start = resumed_step(resume_from)
    # The resumed run's record: a branch's is the run its checkpoint comes from (its own folder is new)
    source = (store.run_of(Path(resume_from)) or run_dir) if start else run_dir
    before = (read_run_json(source) or {}) if start else {}
    if start and (own := _own_speed(before, source, env, batch, resolved)):
        tps, basis = own, "this run's own speed before the resume"
    hours = max(0, batch.total_steps - start) * batch.tokens_per_step / tps / 3600 if tps else None
    warnings = (
        _warnings(cfg, data, model, batch, params, memory, device_memory, on_cpu=env.device.type == "cpu")
        + curriculum_warnings(batch)
        + _unused_fp8_switches(cfg, resolved)
        + unused_fsdp_switches(cfg, env.dist)
        + kept_by_compiled_checkpointing(model, batch, resolved)
        + _schedule_moved(cfg, batch, before, start)
        + _corpus_moved(data, before, start)
        + _rolled_back_rate(resume_from, start)
        + (adapter_scale_change(source, cfg) if start else [])
    )
    return RunPlan(
        model=what,
        layout=layout,
        params=params,
        params_non_embedding=params_ne,
        trainable_params=trainable,
        vocab_size=int(getattr(model.args, "vocab_size", data.vocab_size)),
        block_size=batch.block_size,
        corpus=corpus,
        batch=asdict(batch),
        memory_gib=memory,
        device_memory_gib=device_memory,
        host_memory_gib=host,
        checkpoint_staging_gib=staging,
        tokens_per_s=tps,
        speed_basis=basis,
        hours=hours,
        out=str(run_dir),
        resume=str(resume_from) if resume_from else None,
        resolved=resolved,
        warnings=warnings,
        tasks=_tasks(env, batch, tasks),
        device_type=env.device.type,
        start_step=start,
        replaces="replacing the run there: --overwrite"
        if cfg.run.overwrite and resume_from is None and is_run(run_dir)
        else "",
        early_stopping=early_stopping_line(cfg, batch, corpus, resume_from, start),
    )


def _corpus_moved(data: Any, record: dict[str, Any], start: int) -> list[str]:
    """A resume on another corpus (files edited, added, or another --data) is allowed but said: its batches and
    held-out set are not the run's. Compared by the shards' cache key (``record``: the resumed run's run.json)."""
    examples = (data.sft or data.prefs) if data.format in ("sft", "prefs") else None
    if start and examples is not None and isinstance(record.get("data_fingerprint"), str):
        if record["data_fingerprint"] == examples.fingerprint:
            return []
        return [
            "the examples differ from the ones this run trained on until now (lines edited, added or removed, or "
            "another --data): the batches from here are not an uninterrupted run's, its held-out examples are "
            "another draw (some may have been trained on), and val losses before and after compare only loosely"
        ]
    was = record.get("data") if start else None
    if not isinstance(was, str) or data.manifest is None:
        return []
    key = str(data.manifest.dir).rsplit("-", 1)[-1]
    if Path(was).name.rsplit("-", 1)[-1] == key:
        return []
    return [
        "the corpus differs from the one this run trained on until now (its tokenized shards do): the batches from "
        "here are not an uninterrupted run's, and val losses before and after compare only loosely"
    ]


def _schedule_moved(cfg: Any, batch: BatchPlan, record: dict[str, Any], start: int) -> list[str]:
    """A resume that changes the run's length recomputes the schedule for the new one: the learning rate of the
    next step moves (a finished cosine run extended goes back up). Said, with both rates (``record``: the resumed
    run's run.json)."""
    from gptoughts.training.optim import Schedule

    if not start or cfg.train.schedule == "constant":
        return []
    try:
        then = record["plan"]["batch"]
        old_total, old_warmup = int(then["total_steps"]), int(then["warmup_steps"])
    except (ValueError, KeyError, TypeError):
        return []
    if old_total == batch.total_steps:
        return []
    t = cfg.train
    rates = [
        Schedule(t.schedule, t.learning_rate, total, warmup, t.min_lr_ratio, t.decay_fraction).lr_at(start)
        for total, warmup in ((old_total, old_warmup), (batch.total_steps, batch.warmup_steps))
    ]
    if math.isclose(rates[0], rates[1], rel_tol=0.01):
        return []
    return [
        f"the {t.schedule} schedule is recomputed for {batch.total_steps:,} steps (the run was planned for "
        f"{old_total:,}): the learning rate at step {start + 1:,} moves from {rates[0]:.2e} to {rates[1]:.2e}"
    ]


def _rolled_back_rate(resume_from: Path | None, start: int) -> list[str]:
    """A checkpoint saved after rollbacks carries their cut of the learning rate, which the resumed run keeps on top
    of the schedule (and of a new --learning_rate): said, since the plan's peak lr is the schedule's."""
    if not start or resume_from is None:
        return []
    try:
        meta = store.read_meta(Path(resume_from))
        scale, rollbacks = float(meta.get("lr_scale", 1.0)), int(meta.get("rollbacks", 0))
    except (OSError, ValueError, TypeError, AttributeError):
        return []
    if scale >= 1.0:
        return []
    return [
        f"the learning rate runs at {scale:g}x the schedule's above: the checkpoint's {rollbacks} rollback(s) cut "
        "it, and a resume keeps the cut"
    ]


def resumed_step(resume_from: Path | None) -> int:
    """The step of the checkpoint a run resumes from (0 for a new run, or where its step cannot be read: the plan
    then times the whole run)."""
    if resume_from is None:
        return 0
    from gptoughts.training.checkpoint import store

    try:
        return store.step_of(Path(resume_from))
    except Exception:  # noqa: BLE001 - a plan's time figure never stops a run
        return 0


def _integrator(cfg: Any, model: Any) -> dict[str, str]:
    """INL's integrator as it will run, and why where the size asked for kernels this machine does not run."""
    args = model.args
    if model.family.name != "inl" or not getattr(args, "n_iterations", 0) or cfg.model.init_from is not None:
        return {}
    from gptoughts import models

    asked = models.model_args("inl", cfg.model.size, dict(cfg.model.overrides)).integrator_impl
    kind = {"reference": "reference (autograd)", "fused": "fused (one autograd Function)", "triton": "triton"}
    line = kind[args.integrator_impl]
    if asked != args.integrator_impl:
        # (a family's own field is an override of the size's value: Config.given does not name those)
        whose = (
            "asked" if "integrator_impl" in cfg.model.overrides else f"the {cfg.model.size} size's default"
        )
        line += (
            f" (instead of {asked}, {whose}: its kernels need a CUDA GPU with Triton, bf16 or fp16, a power-of-two "
            "width)"
        )
    return {"integrator": line}


def _variant_layout(family: Any, args: Any) -> str:
    """``qwen2 layout (exports as Qwen2ForCausalLM)`` when the family's export is one of ``models.VARIANTS``; why
    it does not export where no transformers class computes the model."""
    from gptoughts.errors import UserError
    from gptoughts.models import VARIANTS

    if family.hf is None:
        return ""
    try:
        hf = family.hf.hf_config(args)
    except UserError as e:  # a switch transformers has no class for: said now, not first at export
        return str(e)
    kind = hf.get("model_type")
    return f"{kind} layout (exports as {hf['architectures'][0]})" if kind in VARIANTS else ""


def _tasks(env: Any, batch: BatchPlan, tasks: Any) -> dict[str, Any]:
    if tasks is None:
        return {}
    d = env.dist
    how = (
        " by every rank (sharded model)"
        if d.sharded and d.enabled
        else f", examples split over {d.dp_size} data-parallel ranks"
        + (" (harness tasks: scored whole by every rank, rank 0's counted)" if tasks.harness else "")
        if d.dp_size > 1
        else ""
    )
    return {"names": tasks.names, "examples": tasks.examples, "interval": batch.tasks_interval, "how": how}


def _memory(
    cfg: Any, env: Any, model: Any, batch: BatchPlan
) -> tuple[float | None, float | None, float | None, float | None]:
    """Peak training memory per device (:func:`estimate_peak`), the device's memory (:func:`device_memory_gib`), the
    host memory an offloaded run keeps per process, and the host copy that background checkpoints keep per saving
    process (the trainer's ShardedSaver or FileSaver; pipelines are not estimated)."""
    e = estimate_peak(
        cfg, env, model, batch.micro_batch, batch.block_size, batch.world_size, batch.tp, batch.grad_accum
    )
    if e is None:
        return None, None, None, None
    ck = cfg.checkpoint
    # Background checkpoints keep a host copy of what each saving process writes: every rank's shards (sharded
    # runs), rank 0's whole state (one process or DDP on GPUs: savers.FileSaver; CPU runs write synchronously).
    staged = ck.checkpoints and ck.async_save and (env.dist.sharded or env.device.type == "cuda")
    return (
        e.total_gib,
        device_memory_gib(env),
        e.host_gib or None,
        (e.checkpoint_staging_gib or None) if staged else None,
    )


def measured_to_fit(batch: dict[str, Any]) -> bool:
    """Whether the micro-batch was found with real training steps on this device (``batch_size = auto`` on a GPU):
    then it fits by measurement, and the estimate, a formula, neither warns nor refuses."""
    return str(batch.get("why", {}).get("batch_size", "")).startswith(MEASURED_BATCH)


def memory_refusal(plan: RunPlan, on_cpu: bool) -> str | None:
    """The one-line refusal of a run whose estimated peak clearly exceeds the device's memory (None: it fits): it
    would end out of memory, and on a CPU the kernel kills the process without a word."""
    return peak_refusal(plan.memory_gib, plan.device_memory_gib, plan.batch, on_cpu)


def peak_refusal(mem: float | None, limit: float | None, batch: dict[str, Any], on_cpu: bool) -> str | None:
    """:func:`memory_refusal` of an estimated peak ``mem`` against ``limit`` (GiB) at ``batch`` (a batch plan as a
    dict): what ``bench`` refuses too, before it builds anything."""
    if mem is None or not limit or mem <= REFUSE_ABOVE * limit or measured_to_fit(batch):
        return None
    where = f"the {gib(limit)} this machine has available" if on_cpu else f"this GPU's {gib(limit)}"
    fixes = "lower --batch_size or --block_size, or train a smaller --size here" if on_cpu else GPU_FIXES
    return (
        f"the estimated peak memory, ~{gib(mem)} at micro-batch {batch['micro_batch']} x "
        f"{batch['block_size']:,} tokens, exceeds {where}: {fixes}; --ignore_memory_estimate tries anyway"
    )


# What a run's speed depends on beyond its shape: a resumed run timed at its own speed must match on each.
_SPEED_SETTINGS = (
    "compile",
    "cuda_graphs",
    "fp8",
    "activation_checkpointing",
    "parallel",
    "cpu_offload",
    "integrator",
)


def _own_speed(
    record: dict[str, Any], run_dir: Path, env: Any, batch: BatchPlan, resolved: dict[str, Any]
) -> float | None:
    """The median tokens/s of a resumed run's last logged windows (``record``: its run.json), where it ran as this
    resume will (processes, device, precision, rows, block and the settings above): a better figure than any
    estimate. None: not comparable, or too few windows logged (a session's first window holds its compilation)."""
    then = record.get("plan", {}).get("batch", {})

    def settings(r: dict[str, Any]) -> list[str]:
        return [str(r.get(k, "")).split(" (")[0] for k in _SPEED_SETTINGS]

    same = (
        (record.get("world_size"), record.get("dp_size")) == (env.dist.world_size, env.dist.dp_size)
        and str(record.get("device", "")).split(":")[0] == env.device.type
        and record.get("hardware", {}).get("name") == env.hw.name
        and record.get("precision") == env.precision
        and (then.get("micro_batch"), then.get("block_size")) == (batch.micro_batch, batch.block_size)
        and settings(record.get("resolved", {})) == settings(resolved)
    )
    metrics = run_dir / "metrics.jsonl"
    if not same or not metrics.is_file():
        return None
    with open(metrics, "rb") as f:  # the last windows only: a long run's file holds many thousand lines
        start = max(0, f.seek(0, 2) - (1 << 16))
        f.seek(start)
        tail = f.read().decode("utf-8", "replace").splitlines()[1 if start else 0 :]  # (a cut first line)
    speeds = []
    for line in tail:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("tokens_per_s"), (int, float)):
            speeds.append(float(row["tokens_per_s"]))
    return float(np.median(speeds[-10:])) if len(speeds) >= 5 else None


def _speed(cfg: Any, env: Any, model: Any, batch: BatchPlan) -> tuple[float | None, str]:
    if env.dist.cpu_offload:  # bound by host-device copies and the CPU's optimizer step, not by the matmuls
        return None, ""
    tps, basis = estimate_speed(env, model, batch.block_size, batch.micro_batch, batch.world_size)
    optimizer_s = cpu_optimizer_seconds(cfg, model) if tps and env.device.type == "cpu" else 0.0
    if optimizer_s:
        tps = with_optimizer_step(tps, batch.tokens_per_step, optimizer_s)
        basis += f"; Muon's Newton-Schulz ~{optimizer_s:.1f} s a step at its bf16 matmul speed"
    return tps, basis


def _warnings(
    cfg: Any,
    data: Any,
    model: Any,
    batch: BatchPlan,
    params: int,
    memory: float | None,
    device_memory: float | None,
    *,
    on_cpu: bool,
) -> list[str]:
    out = []
    # the corpus's tokens, as its line says them (an epoch's windows leave out each shard's tail); examples' rows
    tokens = data.corpus.get("tokens", batch.train_tokens)
    if batch.epochs > MAX_USEFUL_EPOCHS:
        out.append(
            f"{batch.epochs:.1f} epochs over {tokens:,} tokens: beyond ~{MAX_USEFUL_EPOCHS:g} epochs repeated "
            "data adds little and the model memorises it; add data or train fewer steps"
        )
    # (a shipped preset that picks both its corpus and its model, the quickstart's demo, is sized so on purpose)
    ours = {"data.sources", "model.size"} <= getattr(cfg, "shipped", frozenset())
    if data.init_from is None and tokens < params and not ours:
        suggestion = _size_for(model.family, cfg, tokens)
        out.append(
            f"the corpus ({tokens:,} tokens) is smaller than the model ({params:,} parameters): compute-"
            f"optimal training wants ~{TOKENS_PER_PARAM_OPTIMAL} tokens per parameter"
            + (f"; --size {suggestion} suits this corpus better" if suggestion else "; add data")
        )
    vocab, read = data.corpus.get("vocab") or 0, data.corpus.get("bytes_read") or 0
    bpe = data.init_from is None and str(cfg.data.tokenizer).startswith("bpe")  # (a fine-tune: its model's)
    if getattr(data, "estimated", False) and bpe and read < 64 * vocab:
        # a dry run sizes the model at the asked vocabulary; BPE trained on a small text stops far short of it
        out.append(
            f"the vocabulary is planned at the {vocab:,} asked, but a BPE trained on {_mb(read)} of text holds "
            "far fewer (the run says how many), and the model's parameters shrink with it"
        )
    if data.corpus.get("cut") and "data.max_bytes" not in getattr(cfg, "shipped", frozenset()):
        out.append(
            f"data.max_bytes = {cfg.data.max_bytes:,} cuts the corpus: "
            f"{data.corpus['bytes_read']:,} of {data.corpus['bytes']:,} bytes are read; drop the cap to read it all"
        )
    short = _short_document_share(data, batch.block_size)
    if short is not None and short > 0.5:
        out.append(
            f"{short:.0%} of the documents are shorter than the block ({batch.block_size:,} tokens): they are "
            "packed end to end (separated by an end-of-text token), which is fine for pretraining; a shorter "
            "--block_size trains faster if long context is not needed"
        )
    window = batch.eval_block
    if window is not None and window < batch.block_size:
        val = data.corpus.get("val_tokens", 0)
        # a window never spans two sources: the tails held out of several can add up to more than a block
        short = (
            f"holds no block ({batch.block_size:,} tokens) in one source (a window never spans two; the longest "
            f"holds {window + 1:,})"
            if window and val > window + 1
            else f"is shorter than one block ({batch.block_size:,})"
        )
        out.append(
            f"the held-out split ({val:,} tokens) {short}: "
            + (
                f"evaluations use windows of {window:,} tokens (a shorter context than training's)"
                if window
                else "the run is not evaluated"
            )
            + "; raise --data.val_fraction or add data"
        )
    warmup = cfg.train.warmup_steps
    if warmup is not None and warmup >= batch.total_steps > 1:
        out.append(
            f"the warmup ({warmup:,} steps"
            + (f", cut to the run's {batch.warmup_steps:,}" if warmup > batch.warmup_steps else "")
            + f") covers the whole {batch.total_steps:,}-step run: the learning rate never decays; lower "
            "--warmup_steps"
        )
    elif cfg.train.schedule == "wsd":
        out += _wsd_decay_cut(cfg.train, batch)
    if batch.total_steps < MIN_USEFUL_STEPS and cfg.train.max_steps is None:
        smaller = (  # a step of one row per rank: only a shorter row makes more steps of the same data
            "lower --block_size"
            if batch.micro_batch * batch.grad_accum == 1
            else "lower --train.global_batch_tokens / --batch_size"
        )
        out.append(
            f"only {batch.total_steps} optimizer step(s) of {batch.tokens_per_step:,} tokens: too few for the "
            f"schedule; add data, raise --epochs, or {smaller}"
        )
    out += _memory_warning(memory, device_memory, batch, on_cpu=on_cpu)
    if (
        cfg.model.size == "debug"
        and (not cfg.is_given("model.size") or "model.size" in cfg.shipped)
        and data.init_from is None
        and cfg.model.overrides == {}
    ):  # the size a bare --data run gets, not one the user named
        out.append("model.size = debug is the test size: name a size with --size (e.g. 125m)")
    return out


def _wsd_decay_cut(t: Any, batch: BatchPlan) -> list[str]:
    """The line of a wsd run whose warmup runs into the decay window ``train.decay_fraction`` asks for: the decay
    starts where the warmup ends (``Schedule.decay_start``), over fewer steps than asked."""
    from dataclasses import replace

    from gptoughts.training.optim import Schedule

    total = batch.total_steps
    s = Schedule(t.schedule, t.learning_rate, total, batch.warmup_steps, t.min_lr_ratio, t.decay_fraction)
    asked = total - replace(s, warmup_steps=0).decay_start()
    left = total - s.decay_start()
    if left >= asked:
        return []
    return [
        f"the warmup ({batch.warmup_steps:,} steps) runs into the wsd decay of the last {asked:,} steps "
        f"(train.decay_fraction {t.decay_fraction:g}): the learning rate decays over the last {left:,} only; "
        f"lower --warmup_steps, or --decay_fraction to {left / total:.3g} to ask for that decay"
    ]


def curriculum_warnings(batch: BatchPlan) -> list[str]:
    """The phases of a curriculum the run never trains on: those it ends before, and those shorter than a batch (the
    loader draws a batch from the phase its first token falls in: one that no batch starts in is passed over)."""
    total, out = batch.total_steps, []
    late = [p for p in batch.phases if p["step"] is not None and p["step"] > total]
    if late:
        names = " and ".join(f"'{p['name']}' (step {p['step']:,})" for p in late)
        need = max(p["step"] for p in late)
        out.append(
            f"the run ends at step {total:,}, before curriculum phase{'s' if len(late) > 1 else ''} {names} "
            f"begin{'' if len(late) > 1 else 's'}: train at least {need:,} steps to reach "
            f"{'it' if len(late) == 1 else 'them all'}, or lower the earlier phases' tokens"
        )
    batch_tokens = batch.tokens_per_step // max(1, batch.grad_accum)
    for p in batch.phases:
        if p["skipped"] and p["step"] is not None and p["step"] <= total:
            out.append(
                f"curriculum phase '{p['name']}' ({p['tokens']:,} tokens) is shorter than a batch "
                f"({batch_tokens:,} tokens): no batch starts inside it, so none is drawn from it; give it at least "
                f"{batch_tokens:,} tokens"
            )
    return out


def _memory_warning(
    memory: float | None, device_memory: float | None, batch: BatchPlan, *, on_cpu: bool
) -> list[str]:
    """The warning of an estimated peak near or over the device's memory; none where the micro-batch was
    measured to fit (:func:`measured_to_fit`)."""
    if (
        memory is None
        or not device_memory
        or memory <= 0.95 * device_memory
        or measured_to_fit(asdict(batch))
    ):
        return []
    refused = (
        " (a run is refused at this estimate; --ignore_memory_estimate tries anyway)"
        if memory > REFUSE_ABOVE * device_memory
        else ""
    )
    # between 95% and 100% the estimate is not over, but within its own error of the limit
    verb = "exceeds" if memory > device_memory else "is within 5% of"
    if on_cpu:
        return [
            f"the estimated peak ({gib(memory)}) {verb} the {gib(device_memory)} of memory available on "
            f"this machine: train a smaller size here, or on a GPU{refused}"
        ]
    return [
        f"the estimated peak ({gib(memory)}) {verb} this GPU's {gib(device_memory)}: {GPU_FIXES}{refused}"
    ]


def _unused_fp8_switches(cfg: Any, resolved: dict[str, Any]) -> list[str]:
    """A warning for the fp8 refinements asked in a run whose matmuls are not fp8 (they would do nothing)."""
    asked = [f"perf.{n}" for n in ("fp8_fast_accum", "fp8_bf16_end_layers") if getattr(cfg.perf, n)]
    asked += ["perf.fp8_wgrad"] if cfg.perf.fp8_wgrad == "fp8" else []
    fp8 = str(resolved.get("fp8", ""))
    if not asked or not fp8.startswith("False"):
        return []
    why = fp8[len("False") :].strip(" ()")
    # not an auto rule's reason: the user's, the framework's or a size's default setting
    why = "--fp8 is off" if why in ("", "asked", "default") or why.endswith(" default") else why
    verb, obj = ("acts", "it") if len(asked) == 1 else ("act", "them")
    return [
        f"{' and '.join(asked)} {verb} on fp8 matmuls, but this run's matmuls are not fp8 ({why}): add --fp8 or "
        f"drop {obj}"
    ]


def kept_by_compiled_checkpointing(model: Any, batch: BatchPlan, resolved: dict[str, Any]) -> list[str]:
    """A note where compiled full activation checkpointing keeps what a newer torch recomputes (the estimate counts
    it: ``perf.estimate.kept_by_compiled_full``), with the switch that avoids it."""
    # the run's resolved values read "VALUE (why)"
    ac, compiled = (str(resolved.get(k, "")).split(" ")[0] for k in ("activation_checkpointing", "compile"))
    if ac != "full" or compiled in ("", "False"):
        return []
    from gptoughts.perf.estimate import kept_by_compiled_full

    kept = kept_by_compiled_full(model.family.name, model.args) * batch.micro_batch * batch.block_size
    if not kept:
        return []
    what, fix = {
        "deepseek": (
            "DeepSeek's permuted rows",
            "--model.moe_permute index_put recomputes them (a slower MoE step)",
        ),
        "inl": ("the fused integrator's tensors", "--model.integrator_impl reference recomputes them"),
    }[model.family.name]
    import torch

    return [
        f"torch {torch.__version__} keeps {what} under compiled full activation checkpointing, ~{gib(kept / 2**30)} "
        f"of the estimate (pytorch/pytorch#177396): {fix}, or use a newer torch"
    ]


def unused_fsdp_switches(cfg: Any, dist: Any) -> list[str]:
    """A warning for the FSDP2 settings asked (true or false, not auto) of a run that FSDP2 does not wrap: one
    process without offload, or DDP. They would do nothing."""
    if dist.strategy == "fsdp":
        return []
    names = ("grad_sync_every_microbatch", "reshard_after_forward")
    asked = [f"parallel.{n}" for n in names if isinstance(getattr(cfg.parallel, n), bool)]
    if not asked:
        return []
    run = f"{dist.strategy} x{dist.world_size}" if dist.strategy != "none" else "one process"
    verb, obj = ("acts", "it") if len(asked) == 1 else ("act", "them")
    return [
        f"{' and '.join(asked)} {verb} on FSDP2 (--parallel.strategy fsdp on several processes, or "
        f"--parallel.cpu_offload), but this run is {run}: drop {obj}"
    ]


def _size_for(family: Any, cfg: Any, tokens: int) -> str | None:
    """The largest size of ``family`` whose parameters are at most 1/20 of ``tokens`` (None if none is)."""
    import torch

    from gptoughts import models

    best = None
    for size in models.list_sizes(family.name):
        if size == "debug":
            continue
        try:
            with torch.device("meta"):
                m = models.build_model(family.name, models.model_args(family.name, size, {}), device="meta")
        except Exception:  # noqa: BLE001
            continue
        if m.num_params() * TOKENS_PER_PARAM_OPTIMAL <= tokens:
            best = size
    return best


def _short_document_share(data: Any, block: int) -> float | None:
    """Share of documents shorter than ``block`` tokens, from the end-of-text tokens of the first ~20M training
    tokens (None before tokenization)."""
    if data.manifest is None:
        return None
    m = data.manifest
    eos = m.eos_id
    lengths: list[np.ndarray] = []
    seen = 0
    for s in m.sources:
        for name in s.train_shards:
            arr = np.memmap(m.dir / name, dtype=np.dtype(m.dtype), mode="r")[: 20_000_000 - seen]
            ends = np.flatnonzero(arr == eos)
            if ends.size > 1:
                lengths.append(np.diff(ends))
            seen += arr.size
            if seen >= 20_000_000:
                break
    if not lengths:
        return None
    all_lengths = np.concatenate(lengths)
    return float(np.mean(all_lengths < block)) if all_lengths.size else None
