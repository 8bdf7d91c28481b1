"""The one training loop.

Pretraining, fine-tuning, LoRA and masked diffusion all run here; they differ by the model, the data loader
and the objective passed in, never by a copied loop. Speed features (compile, fp8, activation checkpointing,
FSDP) are applied to the model before it reaches the trainer (see ``training/setup.py``).

Key decisions (the full account and measurements: docs/checkpoints.md, "Recovery" and "Loss spikes"):

* host-device syncs happen only at log/eval/save intervals ("flushes"): each step's values stay on the device
  in ``Trainer._pending`` and the flush reads them in one transfer;
* a non-finite step is skipped on the device by the optimizer (``found_inf``), never checked from Python;
* ``recovery.nan_policy`` (on :class:`~gptoughts.config.RecoveryConfig`): ``stop``, ``skip`` (up to
  ``max_bad_steps`` in a row) or ``rollback`` (to the checkpoint saved before the streak, learning rate cut,
  data not rewound: ``TrainState.data_steps_skipped`` keeps the loader position consistent); a collapsed step
  (loss ln(vocab), zero gradient) counts as bad; no checkpoint is written during a streak;
* loss spikes (``recovery.spike_*``) are detected on the device; a spiking step is held, re-run once from its
  pre-step state at the flush, and kept (transient) or handled by the policy (reproducible). Multi-process and
  fp16 runs only report spikes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gptoughts.config import (
    CheckpointConfig,
    EvalConfig,
    RecoveryConfig,
    RunConfig,
    TrainConfig,
    check_train_ranges,
)
from gptoughts.errors import UserError, first_line
from gptoughts.parallel import dist as pdist
from gptoughts.perf.autobatch import free_memory
from gptoughts.perf.timing import GpuMonitor, StepTimer, advice, format_profile, summarize_profile
from gptoughts.training.checkpoint import restore, savers, sharded
from gptoughts.training.checkpoint import store as ckpt
from gptoughts.training.metrics import MetricsLogger, ProgressBar, console, format_eta
from gptoughts.training.optim import Schedule, clip_and_step, set_lr, zero_grads

log = logging.getLogger("gptoughts.training")

Batch = tuple[torch.Tensor, ...]

_SPIKE_EMA = 0.02  # weight of one step in the running loss statistics (~50 steps of memory)
_SPIKE_MIN_SAMPLES = 8  # steps seen before the spike check can arm
# A collapsed step: loss within this relative distance of ln(vocab) and a gradient norm below this. Healthy
# training can sit at ln(vocab) (a zero-initialised output layer at step 1) but never with a zero gradient.
_COLLAPSE_LOSS_RTOL = 1e-3
_COLLAPSE_GRAD_NORM = 1e-6
_ROLLED_BACK = "rolled back"


@dataclass
class TrainState:
    step: int = 0
    """Optimizer steps applied to the current weights (goes back to the checkpoint's step on a rollback)."""
    tokens_seen: int = 0
    """Tokens of those steps (``step * tokens_per_step``)."""
    best_val_loss: float = math.inf
    evals_without_improvement: int = 0
    lr_scale: float = 1.0
    """Product of the rollbacks' learning-rate factors."""
    bad_steps: int = 0
    """Non-finite steps in a row, up to ``step``."""
    rollbacks: int = 0
    history: list[dict[str, float]] = field(default_factory=list)
    data_steps_skipped: int = 0
    """Steps' worth of batches that rollbacks jumped over: the loader has consumed ``step + data_steps_skipped``
    steps of batches."""
    loss_mean: float = 0.0
    """Running mean of the per-step training loss (spike detector)."""
    loss_var: float = 0.0
    """Running variance of the per-step training loss (spike detector)."""
    loss_count: int = 0
    """Steps fed into the running statistics."""


@dataclass
class _StepRecord:
    """One step's device values, read at the next flush; the batches and RNG state only while the spike check
    is armed (a held step is re-run from them)."""

    step: int
    loss_sum: torch.Tensor
    n_tokens: torch.Tensor
    grad_norm: torch.Tensor
    found_inf: torch.Tensor
    hold: torch.Tensor | None
    batches: list[Batch] | None
    rng: tuple[torch.Tensor, torch.Tensor | None] | None


# Columns of a flushed record.
_LOSS, _TOKENS, _NORM, _INF, _HOLD = range(5)


class Trainer:
    def __init__(
        self,
        *,
        model: nn.Module,
        objective: Callable[[nn.Module, Batch], tuple[torch.Tensor, torch.Tensor]],
        optimizer: torch.optim.Optimizer,
        schedule: Schedule,
        loader: Any,
        eval_batches: Callable[[], Iterator[Batch]] | None,
        cfg: TrainConfig,
        run: RunConfig,
        run_dir: Path,
        dist: pdist.DistInfo,
        device: torch.device,
        precision: str,
        metrics: MetricsLogger,
        total_steps: int,
        tokens_per_step: int,
        sample_fn: Callable[[str], str] | None = None,
        static_token_count: bool = True,
        save_weights: Callable[[], nn.Module] | None = None,
        timing: bool = True,
        forward_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        after_optimizer_step: Callable[[], None] | None = None,
        mfu_per_token_s: float | None = None,
        plots: Any = None,
        evaluation: EvalConfig | None = None,
        checkpointing: CheckpointConfig | None = None,
        recovery: RecoveryConfig | None = None,
        pipeline: Any = None,
        tasks: Any = None,
        keep_grads: bool = False,
        vocab_size: int | None = None,
    ):
        check_train_ranges(cfg, evaluation, checkpointing, recovery)
        self.model = model
        # parallel.pp.Pipeline under pipeline parallelism: forward/backward run through its schedule, `model` is
        # the rank's stages as one module (parameters, train/eval mode), evaluation and checkpoints go through it.
        self.pipeline = pipeline
        self.objective = objective
        self.optimizer = optimizer
        self.schedule = schedule
        self.loader = loader
        self.eval_batches = eval_batches
        self.cfg = cfg
        # Each part of the trainer reads its own section: [eval], [checkpoint], [recovery] (defaults when absent).
        self.ev = evaluation or EvalConfig()
        self.ck = checkpointing or CheckpointConfig()
        self.rc = recovery or RecoveryConfig()
        self.run = run
        self.run_dir = run_dir
        self.ckpt_dir = run_dir / "checkpoints"
        self.dist = dist
        self.device = device
        self.precision = precision
        self.metrics = metrics
        self.total_steps = total_steps
        self.tokens_per_step = tokens_per_step
        self.sample_fn = sample_fn
        # tools.task_scorer.TaskScorer of eval.eval_tasks: scored every eval_tasks_interval steps and at the end
        if tasks is not None and pipeline is not None:
            raise UserError("eval.eval_tasks does not run under pipeline parallelism; drop --eval_tasks")
        self.tasks = tasks
        self.task_scores: dict[str, dict[str, float]] = {}
        """The last scores of ``tasks`` (``{task: {"examples": n, metric: value}}``), for the run's summary."""
        self.last_samples: tuple[int, list[str]] | None = None
        """(step, one text per ``sample_prompts``) of the last samples generated, for the run's summary."""
        self.startup: Any = None
        """A :class:`~gptoughts.perf.startup.Startup` the caller fills before :meth:`fit`: the first step
        completes it (one device sync) and prints it."""
        self.forward_context = forward_context
        # MFU of a logged window = its tokens/s x this (FLOPs per token / the GPUs' total bf16 peak); None off CUDA
        self.mfu_per_token_s = mfu_per_token_s
        self.plots = (
            plots  # plots.PlotWriter: redraws RUN/plots/ after each evaluation, off the training thread
        )
        self.stop_signal: int | None = None
        self._phase: str | None = None
        # Pretraining batches have no ignored targets: the token count of a step is known without looking at the
        # data, so we avoid an all-reduce of the count each step. SFT batches set this False.
        self.static_token_count = static_token_count
        self.weights_module = save_weights or (lambda: pdist.unwrap(self.model))
        self.state = TrainState()
        self.params = [p for p in model.parameters() if p.requires_grad]
        # setup.Built.keep_grads (CUDA graphs): gradients zeroed in place, never freed. Allocated at the first step,
        # not here: a resume loads the optimizer state after this, and torch's DCP optimizer state dict creates no
        # state slots to load into while any .grad exists (the moments would silently restart from zero).
        self.keep_grads = keep_grads
        self.fused = bool(getattr(optimizer, "defaults", {}).get("fused"))
        self.scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
        self.policy = "stop" if self.rc.nan_policy == "raise" else self.rc.nan_policy
        self.stop_requested = False
        self._interrupts = 0
        inner = self.weights_module()
        self._after_step = getattr(inner, "after_optimizer_step", None)
        self._after_transforms = after_optimizer_step
        self._rank_summed = getattr(inner, "rank_summed_state", None) if dist.enabled else None
        self._model_metrics = getattr(inner, "log_metrics", None)
        self.timer = StepTimer(device, enabled=timing)
        self.split = 1
        self.gpu_monitor = GpuMonitor(device)
        self._logs = 0
        self._previous_gpu: dict[str, float] = {}  # the last window's GPU reading (advice needs two low ones)
        self._pending: list[_StepRecord] = []
        self._streak_start = 0  # first step of the current streak of bad steps
        self._streak_kinds: set[str] = set()  # "non-finite", "collapsed": what the current streak holds
        self.vocab_size = vocab_size  # the model's outputs, for the collapse check (None: none)
        self._window_t0 = time.perf_counter()
        # The on-device spike check needs the global loss of each step and the right to skip a step: one process,
        # no fp16 loss scaler (which decides its own skips). Elsewhere spikes are only reported at flushes.
        self._gate_ok = not dist.enabled and self.scaler is None
        self._spike_thr: float | None = None
        self._gate_armed = False
        self._hold: torch.Tensor | None = None
        self._last_hold: torch.Tensor | None = None
        self._last_micro: list[Batch] | None = None
        self._last_rng: tuple[torch.Tensor, torch.Tensor | None] | None = None
        # Sharded runs write sharded (DCP) checkpoints, each rank its own shards, by default in the background
        # (checkpoint/savers.py); constructing the saver is a collective (its own gloo group). Other runs write the
        # single-file format from rank 0, in the background where that pays (savers.FileSaver); a pipeline run
        # gathers its stages to rank 0 for it (its ranks hold different keys).
        self.saver: savers.ShardedSaver | savers.FileSaver | None = None
        if self.ck.checkpoints and dist.sharded and pipeline is None:
            self.saver = savers.ShardedSaver(
                self.ckpt_dir, rank=dist.rank, async_save=self.ck.async_save, keep_last=self.ck.keep_last
            )
        elif self.ck.checkpoints and dist.is_main:
            self.saver = savers.FileSaver(
                self.ckpt_dir, keep_last=self.ck.keep_last, background=self.ck.async_save
            )

    # ------------------------------------------------------------------------------------------ precision
    def autocast(self) -> contextlib.AbstractContextManager:
        """Mixed precision (and the SDPA backend choice) around forward passes."""
        stack = contextlib.ExitStack()
        if self.precision in ("bf16", "fp16"):
            dtype = torch.bfloat16 if self.precision == "bf16" else torch.float16
            stack.enter_context(torch.autocast(self.device.type, dtype=dtype))
        stack.enter_context(self.forward_context())
        return stack

    # ------------------------------------------------------------------------------------------- one step
    def _no_sync(self, last: bool) -> contextlib.AbstractContextManager:
        # DDP all-reduces (FSDP reduce-scatters) gradients during backward; skip it on all but the last
        # micro-batch of the step.
        if hasattr(self.model, "set_requires_gradient_sync"):  # FSDP2
            self.model.set_requires_gradient_sync(last)
        elif not last and hasattr(self.model, "no_sync"):
            return self.model.no_sync()
        return contextlib.nullcontext()

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One optimizer step over grad_accum micro-batches.

        Returns, on the device: this rank's summed token loss, the global target-token count, found_inf.
        """
        accum = self.cfg.grad_accum
        self.timer.start()
        micro = [next(self.loader) for _ in range(accum)]
        self.timer.mark("data")
        return self._run_step(micro)

    def _run_step(self, micro: list[Batch]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if (
            self._gate_armed
        ):  # keep what a re-run of this step needs (references and a 5 KB RNG copy: no sync)
            self._last_micro, self._last_rng = micro, self._rng_state()
        else:
            self._last_micro = self._last_rng = None
        while True:
            try:
                return self._step_on(micro)
            except torch.OutOfMemoryError:
                rows = micro[0][0].shape[0]
                # One rank cannot change its micro-batch alone: the others would wait in a collective forever.
                if self.dist.enabled or self.split * 2 > rows:
                    raise
                pdist.discard_failed_step(self.model)  # before the zeroing: its reset may reduce gradients
                zero_grads(self.optimizer, self.params, keep=self.keep_grads)
                self.timer.start()  # drop the failed step's partial marks
                free_memory(self.device)
                self.split *= 2
                self.log_line(
                    f"step {self.state.step}: out of memory; micro-batch halved to {rows // self.split} "
                    f"rows, accumulation doubled (same data, same global batch)"
                )

    def _step_on(self, loaded: list[Batch]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        timer = self.timer
        # After an OOM back-off each loaded batch runs as `split` smaller micro-batches.
        micro = (
            [piece for b in loaded for piece in zip(*(t.chunk(self.split) for t in b))]
            if self.split > 1
            else loaded
        )
        accum = len(micro)
        if self.static_token_count:
            # torch.full, not torch.tensor(host number, device=cuda): the latter is a pageable host-to-device copy
            # that waits for the GPU to drain the previous step, so the GPU idled while the host queued the next
            # one (measured faster: see docs/performance.md, "Host-device copies in the step").
            n_total = torch.full(
                (), float(sum(b[1].numel() for b in micro) * self.dist.dp_size), device=self.device
            )
        else:
            n_total = sum((b[1] != -100).sum() for b in micro).float()
            n_total = pdist.all_reduce_dp(n_total, self.dist)
        # DDP averages gradients over the data-parallel ranks; scaling by their number makes the result the
        # gradient of the global token-mean loss.
        scale = self.dist.dp_size / n_total.clamp_min(1.0)
        loss_sum = torch.zeros((), device=self.device)
        if self.keep_grads and self.params and self.params[0].grad is None:
            zero_grads(self.optimizer, self.params, keep=True)  # the first step (see __init__)
        if self.pipeline is not None:
            # The step's rows in one batch: the schedule splits them into its micro-batches, runs forward and
            # backward through the stages, and syncs data-parallel gradients once, after the last.
            rows = tuple(torch.cat(ts) for ts in zip(*micro)) if accum > 1 else micro[0]
            with self.autocast():
                loss_sum = self.pipeline.step(rows, scale)
            timer.mark("forward")  # forward and backward interleave: all of it counts as forward
            micro = []
        for i, batch in enumerate(micro):
            with self._no_sync(i == accum - 1):
                with self.autocast():
                    ls, _ = self.objective(self.model, batch)
                timer.mark("forward")
                loss = ls * scale
                (self.scaler.scale(loss) if self.scaler else loss).backward()
            timer.mark("backward")
            loss_sum += ls.detach().float()

        gate_loss, self._last_hold = loss_sum, None
        if self._gate_armed:
            # The spike check, on the device: a step whose mean loss is above the threshold, and every later step
            # of the window (the flag is sticky), is skipped by the optimizer exactly like a non-finite one, so the
            # flush finds the weights in that step's pre-step state and can re-run it.
            hold = self._hold | (loss_sum > n_total * self._spike_thr)
            self._hold = self._last_hold = hold
            gate_loss = torch.where(hold, math.nan, loss_sum)
        lr = self.schedule.lr_at(self.state.step) * self.state.lr_scale
        set_lr(self.optimizer, lr)
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        grad_norm, found_inf = clip_and_step(
            self.optimizer,
            self.params,
            max_norm,
            gate_loss,
            fused=self.fused,
            scaler=self.scaler,
            norm_reduce=self.pipeline.global_norm if self.pipeline is not None else None,
        )
        zero_grads(self.optimizer, self.params, keep=self.keep_grads)
        if self._after_step is not None:
            with torch.no_grad():
                for t in self._rank_summed() if self._rank_summed is not None else ():
                    pdist.all_reduce_dp(t, self.dist)  # global statistics: every rank updates alike
                self._after_step()
        if self._after_transforms is not None:
            with torch.no_grad():
                self._after_transforms()
        timer.mark("optimizer")
        timer.stop()
        self._last_grad_norm = grad_norm.detach()
        self._last_lr = lr
        return loss_sum, n_total, found_inf

    def _record(self, loss_sum: torch.Tensor, n_tokens: torch.Tensor, found_inf: torch.Tensor) -> _StepRecord:
        """The step just run (``state.step + 1``), kept for the next flush."""
        return _StepRecord(
            self.state.step + 1,
            loss_sum,
            n_tokens,
            self._last_grad_norm,
            found_inf,
            self._last_hold,
            self._last_micro,
            self._last_rng,
        )

    def _rng_state(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        # Host copies: the CUDA generator's state is its seed and offset, kept on the host (no sync).
        return (
            torch.get_rng_state(),
            torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None,
        )

    def _set_rng_state(self, rng: tuple[torch.Tensor, torch.Tensor | None] | None) -> None:
        if rng is None:
            return
        torch.set_rng_state(rng[0])
        if rng[1] is not None:
            torch.cuda.set_rng_state(rng[1], self.device)

    # ------------------------------------------------------------------------------------------- evaluate
    @torch.no_grad()
    def evaluate(self) -> tuple[float, float]:
        """(val loss, perplexity) over the fixed validation windows, sharded across ranks."""
        if self.eval_batches is None:
            return math.nan, math.nan
        self.model.eval()
        total = torch.zeros((), device=self.device, dtype=torch.float64)
        count = torch.zeros((), device=self.device, dtype=torch.float64)
        model = pdist.unwrap(self.model) if self.dist.enabled else self.model  # no DDP hooks during eval

        def loss_of(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
            with self.autocast():
                if self.pipeline is not None:  # (0, 0) on ranks without the last stage
                    return self.pipeline.eval_loss(batch)
                return self.objective(model, batch)

        # Split by data-parallel rank: the ranks of a tensor-parallel group or of one pipeline evaluate the same
        # batches together.
        world, rank = self.dist.dp_size, self.dist.dp_rank
        n_batches, batch = 0, None
        for i, batch in enumerate(self.eval_batches()):
            n_batches = i + 1
            if i % world != rank:
                continue
            ls, n = loss_of(batch)
            total += ls.double()
            count += n.double()
        if self.dist.sharded and n_batches % world and rank >= n_batches % world:
            # Under FSDP or TP every forward is a collective: a rank without a batch in the last round runs one
            # (discarded) forward so that all ranks run the same number.
            loss_of(batch)
        self.model.train()
        pdist.all_reduce_loss(total, self.dist)
        pdist.all_reduce_loss(count, self.dist)
        loss = (total / count.clamp_min(1)).item()
        return loss, math.exp(min(loss, 50.0))

    # --------------------------------------------------------------------------------------- checkpoints
    def state_dict(self, *, optimizer: bool = True) -> dict[str, Any]:
        """Everything but the weights; a collective under FSDP (the optimizer state is gathered to rank 0).
        ``optimizer=False``: without the optimizer (a sharded checkpoint holds it in its shards), with every
        rank's RNG state instead (a collective when distributed)."""
        st = asdict(self.state)
        st["best_val_loss"] = float(st["best_val_loss"])
        rng = {"torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        out = {
            "trainer": st,
            "optimizer": (
                None
                if not optimizer
                else self.pipeline.optimizer_state(self.optimizer)
                if self.pipeline is not None
                else pdist.optimizer_state(self.weights_module(), self.optimizer, self.dist)
            ),
            "scaler": self.scaler.state_dict() if self.scaler else None,
            "loader": self.loader.state_dict(),
            "rng": rng,
        }
        if not optimizer:
            # Ranks draw from RNGs seeded apart (diffusion masks, dropout): each gets its own back on a resume
            # at the same world size.
            out["rng_ranks"] = pdist.all_gather_object(rng, self.dist)
        return out

    def load_state_dict(self, sd: dict[str, Any], *, restore_loader: bool = True) -> None:
        known = {f.name for f in fields(TrainState)}
        self.state = TrainState(**{k: v for k, v in sd["trainer"].items() if k in known})
        if sd.get("optimizer") is None and sd.get(ckpt.DCP_FORMAT):
            # A sharded checkpoint: DCP reads this rank's part of the optimizer state into the live optimizer
            sharded.load_dcp(Path(sd[ckpt.DCP_FORMAT]), self.weights_module(), self.optimizer, weights=False)
        elif self.pipeline is not None:
            self.pipeline.load_optimizer_state(self.optimizer, sd["optimizer"])
        else:
            pdist.load_optimizer_state(self.weights_module(), self.optimizer, sd["optimizer"], self.dist)
        if self.scaler is not None and sd.get("scaler"):
            self.scaler.load_state_dict(sd["scaler"])
        if restore_loader:
            self.loader.load_state_dict(sd["loader"])
        ranks = sd.get("rng_ranks")
        rng = ranks[self.dist.rank] if ranks and len(ranks) == self.dist.world_size else sd["rng"]
        torch.set_rng_state(rng["torch"].cpu())
        if self.device.type == "cuda" and "cuda" in rng:
            torch.cuda.set_rng_state(rng["cuda"].cpu(), self.device)

    def weights_finite(self) -> bool:
        """Whether every trained parameter and floating buffer is finite: one fused max-abs reduction (no
        overflow, unlike a sum of squares, for huge but finite weights) and one sync; a collective when
        distributed (sharded ranks hold different parts)."""
        tensors = [p.detach() for p in self.params]
        tensors += [b for b in pdist.unwrap(self.model).buffers() if b.is_floating_point()]
        local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
        local = [t for t in local if t.numel()]
        bad = torch.zeros((), device=self.device)
        if local:
            norms = torch._foreach_norm(local, math.inf)
            bad = (~torch.stack([n.float().to(self.device) for n in norms]).isfinite()).sum().float()
        return pdist.all_reduce_sum(bad, self.dist).item() == 0

    def _checkpoint_problem(self) -> str | None:
        """Why the current state is not one to write (and roll back to later), or None."""
        if self.state.bad_steps:
            return f"the last {self.state.bad_steps} step(s) were {self._streak_kind()}"
        if not self.weights_finite():
            return "the weights are not finite"
        return None

    def save(self, *, val_loss: float | None = None, is_best: bool = False) -> bool:
        """Write a checkpoint of the current state unless it is a bad one (see the module docstring)."""
        if not self.ck.checkpoints:
            return False
        problem = self._checkpoint_problem()
        if problem is not None:
            good = self._last_good(self.state.step + 1)
            self.log_line(
                f"step {self.state.step}: checkpoint not written ({problem}); "
                + (f"the last good one is {good}" if good is not None else "no good one was written yet")
            )
            return False
        st = self.state
        meta = {
            "tokens_seen": st.tokens_seen,
            "data_steps_skipped": st.data_steps_skipped,
            "rollbacks": st.rollbacks,
            "lr_scale": st.lr_scale,
        }
        if isinstance(self.saver, savers.ShardedSaver):  # every rank writes its own shards, no gather
            state = self.state_dict(optimizer=False)
            self.saver.save(
                st.step,
                sharded.sharded_state(self.weights_module(), self.optimizer),
                state if self.dist.is_main else None,
                val_loss=val_loss,
                is_best=is_best,
                meta=meta,
            )
            if self.dist.is_main:  # how long training stood still for it (the shards' copy to host memory)
                self.metrics.log(st.step, {"checkpoint_blocked_s": self.saver.blocked_s})
            return True
        weights: nn.Module | dict[str, torch.Tensor] = self.weights_module()
        if self.pipeline is not None:  # every stage's tensors gathered to rank 0
            weights = self.pipeline.full_state_dict()
        state = self.state_dict()
        if self.saver is not None:  # rank 0
            tensors, metadata = (
                ckpt.weights_for_file(weights) if isinstance(weights, nn.Module) else (weights, None)
            )
            self.saver.save(
                st.step,
                tensors,
                state,
                weights_metadata=metadata,
                val_loss=val_loss,
                is_best=is_best,
                meta=meta,
            )
            # how long training stood still for it (the copy to host memory when written in the background)
            self.metrics.log(st.step, {"checkpoint_blocked_s": self.saver.blocked_s})
        pdist.barrier(self.dist)
        return True

    def wait_for_save(self) -> None:
        """Block until a background checkpoint write is on disk (raises its error, if it failed)."""
        if self.saver is not None:
            self.saver.wait()

    def _last_good(self, before: int) -> Path | None:
        """The newest intact checkpoint of a step < ``before`` (rank 0 looks, every rank gets the answer)."""
        self.wait_for_save()  # the newest one may still be being written
        path = ckpt.latest_valid(self.ckpt_dir, before=before) if self.dist.is_main else None
        return pdist.broadcast_object(path, self.dist)  # type: ignore[return-value]

    def _last_good_text(self, before: int) -> str:
        path = self._last_good(before) if self.ck.checkpoints else None
        if path is None:
            return "no good checkpoint was written before it; start again with a lower --learning_rate"
        return f"the last good checkpoint is {path}; resume from it with a lower --learning_rate"

    def _diverged(self, what: str, before: int) -> UserError:
        st = self.state
        return UserError(
            f"training diverged at step {st.step} ({what}, {st.rollbacks} rollback"
            f"{'' if st.rollbacks == 1 else 's'}); {self._last_good_text(before)}"
        )

    def rollback(self, reason: str, bad_from: int) -> str:
        """Reload the newest good checkpoint of a step < ``bad_from`` (weights, optimizer, RNG, step), keep the
        data loader where it is (past the bad batches), scale the learning rate by ``rollback_lr_factor``, and
        re-save that checkpoint with the new state. Raises the divergence error when no rollback is left."""
        cfg, old = self.cfg, self.state
        if old.rollbacks >= self.rc.max_rollbacks:
            raise self._diverged(
                f"{reason}; recovery.max_rollbacks = {self.rc.max_rollbacks} reached", bad_from
            )
        path = self._last_good(bad_from) if self.ck.checkpoints else None
        if path is None:
            raise self._diverged(reason, bad_from)
        if self.pipeline is not None:
            self.pipeline.load_weights(restore.read_model_file(path), path)
        else:
            restore.load_weights(self.weights_module(), path, sharded=self.dist.sharded)
        if not self.weights_finite():  # checkpoints written before this check existed
            raise UserError(
                f"cannot roll back at step {old.step}: {path} holds non-finite weights; resume from an "
                f"earlier checkpoint with a lower --learning_rate"
            )
        self.load_state_dict(
            restore.load_state(path, "cpu" if self.dist.sharded else self.device), restore_loader=False
        )
        new = self.state
        skipped = old.step - new.step
        new.lr_scale = old.lr_scale * self.rc.rollback_lr_factor
        new.rollbacks = old.rollbacks + 1
        new.data_steps_skipped = old.data_steps_skipped + skipped
        new.bad_steps = 0
        self._streak_start = 0
        self._streak_kinds = set()
        self._pending = []
        self._arm_spike_gate()
        batches = skipped * cfg.grad_accum
        self.log_line(
            f"step {old.step}: {reason}; rolled back to {path.name}, skipping the {batches} batch"
            f"{'' if batches == 1 else 'es'} of steps {new.step + 1}-{old.step}, learning rate "
            f"x{new.lr_scale:g} (rollback {new.rollbacks} of at most {self.rc.max_rollbacks})"
        )
        if self.dist.is_main:
            self.metrics.log(
                new.step,
                {
                    "event": "rollback",
                    "reason": reason,
                    "from_step": old.step,
                    "to_step": new.step,
                    "checkpoint": path.name,
                    "skipped_steps": skipped,
                    "skipped_batches": batches,
                    "lr_scale": new.lr_scale,
                    "rollbacks": new.rollbacks,
                },
            )
        # Record the decision where a resume finds it: the checkpoint returned to, now with the loader past the
        # bad batches, the cut learning rate and the rollback count (an atomic replace; see checkpoint/store.py).
        meta = ckpt.read_meta(path) if self.dist.is_main else {}
        self.save(val_loss=meta.get("val_loss"))
        self._window_t0 = time.perf_counter()
        return _ROLLED_BACK

    # -------------------------------------------------------------------------------------------- logging
    def log_line(self, text: str) -> None:
        """An event line on rank 0 (above the progress bar when there is one; printed either way: rollbacks,
        spikes and skipped steps must not vanish with --no_progress)."""
        if self.dist.is_main:
            progress = getattr(self, "progress", None)
            if progress is not None and progress.enabled:
                progress.print(text)
            else:
                console.print(text, highlight=False, soft_wrap=True)

    def _on_signal(self, signum: int, frame: object) -> None:
        self._interrupts += 1
        if self._interrupts > 1:
            raise KeyboardInterrupt
        self.stop_requested = True
        self.stop_signal = signum  # the CLI exits with 128 + signum (130 for SIGINT, 143 for SIGTERM)

    # ---------------------------------------------------------------------------------------------- fit
    def _first_step_done(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        su = self.startup
        su.first_step_s = max(1e-3, su.age() - su.imports_s - su.assembly_s)
        if self.dist.is_main:
            console.print(su.line(), highlight=False)
            hint = su.bytecode_hint()
            if hint:
                console.print(hint, highlight=False)

    def fit(self) -> TrainState:
        cfg = self.cfg
        self.model.train()
        self.progress = ProgressBar(
            self.total_steps, self.state.step, enabled=self.dist.is_main and self.run.progress
        )
        old_handlers = {}
        try:
            for sig in (signal.SIGINT, signal.SIGTERM):
                old_handlers[sig] = signal.signal(sig, self._on_signal)
        except ValueError:  # not the main thread (e.g. a notebook executor): no graceful stop
            old_handlers = {}
        sample_every = self.ev.eval_interval if self.ev.sample_interval is None else self.ev.sample_interval
        tasks_every = (
            self.ev.eval_interval if self.ev.eval_tasks_interval is None else self.ev.eval_tasks_interval
        )
        self._pending = []
        self._window_t0 = time.perf_counter()
        self._arm_spike_gate()
        stop_reason = "max steps"
        profiler = _Profiler(self.cfg.profile, self.run_dir / "profile", self.dist.rank)
        try:
            while self.state.step < self.total_steps:
                # Always through self.state, never a local alias: a rollback replaces the object.
                st = self.state
                profiler.before_step(st.step + 1)
                self._pending.append(self._record(*self.train_step()))
                profiler.after_step(st.step + 1)
                if self.startup is not None and not self.startup.first_step_s:
                    self._first_step_done()
                if self.saver is not None and not self.saver.prepared:
                    # After the first step the optimizer state exists: the saves' host buffers are allocated and
                    # pinned now, beside training, not at the first save (ShardedSaver/FileSaver.prepare).
                    if isinstance(self.saver, savers.ShardedSaver):
                        self.saver.prepare(sharded.sharded_state(self.weights_module(), self.optimizer))
                    elif self.pipeline is None:
                        self.saver.prepare(ckpt.weights_for_file(self.weights_module())[0], self.state_dict())
                    else:  # its weights come from a gather at each save
                        self.saver.prepared = True
                st.step += 1
                st.tokens_seen += self.tokens_per_step
                step = st.step
                at_end = step >= self.total_steps
                log_due = step % cfg.log_interval == 0 or at_end
                # No held-out data, no evaluation (never a nan val loss in the log)
                eval_due = self.eval_batches is not None and (
                    bool(self.ev.eval_interval and step % self.ev.eval_interval == 0) or at_end
                )
                sample_due = bool(
                    self.sample_fn is not None and sample_every and (step % sample_every == 0 or at_end)
                )
                tasks_due = self.tasks is not None and (
                    bool(tasks_every and step % tasks_every == 0) or at_end
                )
                save_due = bool(self.ck.save_interval and step % self.ck.save_interval == 0) or at_end
                # Alone, a signal stops at the next step; with several ranks only where they agree (log steps),
                # or one rank would save (a collective under FSDP) while the others start the next step.
                stop = self.stop_requested and not self.dist.enabled
                if not (log_due or eval_due or sample_due or tasks_due or save_due or stop):
                    continue
                # Evaluating, sampling and saving read the model: the window's held or non-finite steps are
                # settled first (the flush may re-run a spike, roll back, or raise; at the end, any open streak).
                if self._flush(at_end) == _ROLLED_BACK:
                    continue
                if log_due:
                    stop = stop or self._agree_stop()
                    if (
                        not self.dist.enabled
                        and isinstance(self.saver, savers.FileSaver)
                        and self.saver.failed()
                    ):
                        # A background write failed: the state is saved again now (synchronously; see
                        # FileSaver.save) rather than at the next interval, so no more work is at risk.
                        self.save()

                val_loss, improved = None, False
                if eval_due:
                    val_loss, improved = self._eval_and_track()
                    if (
                        self.ev.early_stopping_patience is not None
                        and self.state.evals_without_improvement >= self.ev.early_stopping_patience
                    ):
                        stop, stop_reason = True, "early stopping"
                        # An end too: an open streak is settled first (a rollback trains on from there).
                        if self.state.bad_steps and self._settle_streak(at_end=True) == _ROLLED_BACK:
                            stop, stop_reason = False, "max steps"
                            continue
                saved = (save_due or improved or stop) and self.save(val_loss=val_loss, is_best=improved)
                # Samples and task scores only read the model: they come after the save, and a failure in them is a
                # warning, so neither can cost this step's checkpoint (at the end: the run's last one).
                if sample_due:
                    self._sample_or_drop_it()
                # An early stop is an end too (every rank decides it alike, from the all-reduced val loss); a
                # Ctrl-C is not made to wait for a scoring.
                if tasks_due or (self.tasks is not None and stop_reason == "early stopping"):
                    self._score_tasks_or_drop_them()
                if stop:
                    # Inside a streak of bad steps the save is refused: the reason says which it was.
                    kept = "checkpoint saved" if saved else "no checkpoint now, the last good one kept"
                    if self.stop_requested:
                        stop_reason = f"interrupted ({kept}; resume with --resume auto)"
                    break
            self.wait_for_save()  # the run ends with its last checkpoint on disk (or with its write error)
        finally:
            if self.saver is not None:  # leaving on an error too: never mid-write; frees the staging buffers
                try:
                    self.saver.close()
                except (UserError, OSError) as e:  # (a full disk: see FileSaver.wait)
                    log.warning("%s", e)
            profiler.close()
            for sig, handler in old_handlers.items():
                signal.signal(sig, handler)
            self.progress.close()
        self.stop_reason = stop_reason
        return self.state

    def _agree_stop(self) -> bool:
        # Ranks may see a signal at different steps; they agree at log intervals so collectives stay aligned.
        if not self.dist.enabled:
            return self.stop_requested
        flag = torch.tensor(float(self.stop_requested), device=self.device)
        return bool(pdist.all_reduce_sum(flag, self.dist).item() > 0)

    # ------------------------------------------------------------------------------------------- flushes
    def _read(self, recs: list[_StepRecord]) -> list[list[float]]:
        """The records' values as floats: one stack, one all-reduce of the loss column, one transfer."""
        zero = torch.zeros((), device=self.device)
        flat = [
            t.float().to(self.device)  # a no-op, except an offloaded run's grad norm, computed on the CPU
            for r in recs
            for t in (r.loss_sum, r.n_tokens, r.grad_norm, r.found_inf, zero if r.hold is None else r.hold)
        ]
        table = torch.stack(flat).view(len(recs), 5)
        if self.dist.enabled:  # each rank summed its own rows' loss; the counts and flags are global already
            col = table[:, _LOSS].contiguous()
            pdist.all_reduce_loss(col, self.dist)  # a tensor-parallel group's ranks hold the same loss
            table[:, _LOSS] = col
        return table.tolist()

    def _flush(self, at_end: bool = False) -> str | None:
        """Settle the steps since the last flush: re-run held spikes, log the window, apply the non-finite policy,
        update the spike statistics. Returns ``_ROLLED_BACK`` when a rollback replaced the state. ``at_end``: the
        run's last step, where a streak still open is settled whatever its length."""
        recs, self._pending = self._pending, []
        if not recs:
            return None
        st = self.state
        vals = self._read(recs)
        dropped = [False] * len(recs)
        if self._gate_armed and any(v[_HOLD] for v in vals):
            if self._rerun_held(recs, vals, dropped) == _ROLLED_BACK:
                return _ROLLED_BACK
        elif self._spike_thr is not None and not self._gate_armed:  # several processes, fp16: report only
            for r, v in zip(recs, vals):
                loss = v[_LOSS] / max(v[_TOKENS], 1.0)
                if not v[_INF] and loss > self._spike_thr:
                    self._report_spike(r.step, "unchecked", loss, None, "none (kept)")

        nonfinite, collapsed, new_collapse = [], [], None
        for r, v, drop in zip(recs, vals, dropped):
            if drop:  # a reproducible spike held back: neither breaks nor extends a streak
                continue
            kind = "non-finite" if v[_INF] else "collapsed" if self._collapsed(v) else None
            if kind is None:
                st.bad_steps = 0
                self._streak_kinds = set()
                continue
            if kind == "collapsed" and kind not in self._streak_kinds and new_collapse is None:
                new_collapse = (r.step, v)  # warned once per streak
            (nonfinite if kind == "non-finite" else collapsed).append(r.step)
            self._streak_kinds.add(kind)
            if st.bad_steps == 0:
                self._streak_start = r.step
            st.bad_steps += 1
        good = [v for v, drop in zip(vals, dropped) if not v[_INF] and not drop]
        self._log_window(recs, vals, good, len(nonfinite), sum(dropped), len(collapsed))

        if nonfinite:
            if self.policy == "stop":
                raise UserError(
                    f"non-finite loss or gradient at step {nonfinite[0]} (recovery.nan_policy = stop); "
                    f"{self._last_good_text(nonfinite[0])}"
                )
            self.log_line(f"step {st.step}: {len(nonfinite)} step(s) skipped (non-finite loss or gradient)")
        if new_collapse is not None:
            self._warn_collapse(*new_collapse)
        if st.bad_steps >= self.rc.max_bad_steps or (at_end and st.bad_steps):
            return self._settle_streak(at_end=st.bad_steps < self.rc.max_bad_steps)

        thr = self._spike_thr
        self._update_loss_stats(
            [v[_LOSS] / max(v[_TOKENS], 1.0) for v in good]
            + [thr for drop in dropped if drop and thr is not None]
        )
        self._arm_spike_gate()
        return None

    def _collapsed(self, v: list[float]) -> bool:
        """Whether a finite step is a collapsed one (see the module docstring)."""
        if not self.vocab_size or not v[_TOKENS]:
            return False
        uniform, loss = math.log(self.vocab_size), v[_LOSS] / v[_TOKENS]
        return abs(loss - uniform) <= _COLLAPSE_LOSS_RTOL * uniform and v[_NORM] <= _COLLAPSE_GRAD_NORM

    def _warn_collapse(self, step: int, v: list[float]) -> None:
        loss = f"{v[_LOSS] / v[_TOKENS]:.4f} = ln({self.vocab_size:,})"
        if self.policy == "stop":
            raise UserError(
                f"the model collapsed at step {step} (loss {loss} with a zero gradient; recovery.nan_policy = "
                f"stop); {self._last_good_text(step)}"
            )
        self.log_line(
            f"[yellow]warning:[/yellow] step {step}: the model collapsed (loss {loss}, a uniform prediction, "
            f"with a zero gradient): its steps count as bad steps "
            f"(recovery.nan_policy = {self.policy}, max_bad_steps = {self.rc.max_bad_steps}); no checkpoint is "
            "written while it lasts"
        )

    def _streak_kind(self) -> str:
        return " or ".join(sorted(self._streak_kinds, reverse=True)) or "non-finite"

    def _settle_streak(self, *, at_end: bool) -> str:
        """Apply the policy to the open streak of bad steps: roll back, or raise the divergence error."""
        what = f"{self.state.bad_steps} consecutive {self._streak_kind()} steps"
        if at_end:
            what += " at the end of the run"
        if self.policy != "rollback":
            raise self._diverged(what, self._streak_start)
        return self.rollback(what, self._streak_start)

    def _log_window(
        self,
        recs: list[_StepRecord],
        vals: list[list[float]],
        good: list[list[float]],
        bad: int,
        dropped: int,
        collapsed: int = 0,
    ) -> None:
        st = self.state
        n_steps = len(recs)
        n_tokens = sum(v[_TOKENS] for v in good)
        loss = sum(v[_LOSS] for v in good) / max(1.0, n_tokens) if good else math.nan
        elapsed = time.perf_counter() - self._window_t0
        self._window_t0 = time.perf_counter()
        tps = n_steps * self.tokens_per_step / max(elapsed, 1e-9)
        row = {
            "loss": loss,
            "lr": self._last_lr,
            "tokens_per_s": tps,
            "grad_norm": vals[-1][_NORM],
            "tokens": st.tokens_seen,
            "epoch": getattr(self.loader, "epoch", None),
            "skipped_steps": bad,
        }
        if dropped:
            row["dropped_spikes"] = dropped
        if collapsed:
            row["collapsed_steps"] = collapsed
        phase = getattr(self.loader, "phase_name", None)
        if phase is not None:
            row["phase"] = phase
            if phase != self._phase:
                if self._phase is not None:  # the curriculum moved on: say so, once
                    self.log_line(
                        f"step {st.step}: curriculum phase '{phase}' begins (after '{self._phase}')"
                    )
                self._phase = phase
        if self.mfu_per_token_s:
            row["mfu"] = tps * self.mfu_per_token_s
        if self.device.type == "cuda":
            row["memory/peak_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        if self._model_metrics is not None:
            row.update(self._model_metrics())
        breakdown = self.timer.summary()
        gpu = self.gpu_monitor.read()
        row.update(breakdown)
        row.update(gpu)
        self._logs += 1
        if self.dist.is_main and (
            self._logs in (3, 30) or self._logs % 300 == 0
        ):  # after warm-up, then rarely
            for tip in advice(breakdown, gpu, self._previous_gpu):
                self.log_line(f"[yellow]hint:[/yellow] {tip}")
        self._previous_gpu = gpu
        if self.dist.is_main:
            self.metrics.log(st.step, {k: v for k, v in row.items() if v is not None})
            eta = (self.total_steps - st.step) * self.tokens_per_step / tps if tps > 0 else None
            self.progress.update(
                st.step,
                loss=loss,
                lr=self._last_lr,
                tps=tps,
                eta_s=eta,
                line=f"step {st.step}/{self.total_steps} loss {loss:.4f} lr {self._last_lr:.2e} "
                f"{tps:,.0f} tok/s" + (f" eta {format_eta(eta)}" if eta is not None else ""),
            )

    # -------------------------------------------------------------------------------------------- spikes
    def _arm_spike_gate(self) -> None:
        """Set the spike threshold for the next window from the running statistics (None: not armed yet)."""
        st, rc = self.state, self.rc
        thr = None
        if rc.spike_detection and st.step >= rc.spike_warmup_steps and st.loss_count >= _SPIKE_MIN_SAMPLES:
            std = math.sqrt(max(st.loss_var, 0.0))
            thr = max(st.loss_mean + rc.spike_std * std, rc.spike_ratio * st.loss_mean)
            if not (math.isfinite(thr) and thr > 0):
                thr = None
        self._spike_thr = thr
        self._gate_armed = thr is not None and self._gate_ok
        self._hold = torch.zeros((), dtype=torch.bool, device=self.device) if self._gate_armed else None

    def _update_loss_stats(self, losses: list[float]) -> None:
        """EMA of mean and variance (a plain average over the first 1/_SPIKE_EMA steps)."""
        st = self.state
        for x in losses:
            if not math.isfinite(x):
                continue
            st.loss_count += 1
            a = max(1.0 / st.loss_count, _SPIKE_EMA)
            d = x - st.loss_mean
            st.loss_mean += a * d
            st.loss_var = (1.0 - a) * (st.loss_var + a * d * d)

    def _replay(self, rec: _StepRecord) -> _StepRecord:
        """Run the step ``rec.step`` again from its kept batches (the state must be its pre-step state)."""
        st = self.state
        st.step = rec.step - 1
        self._set_rng_state(rec.rng)
        assert rec.batches is not None
        self.timer.start()
        new = self._record(*self._run_step(rec.batches))
        st.step += 1
        return new

    def _rerun_held(
        self, recs: list[_StepRecord], vals: list[list[float]], dropped: list[bool]
    ) -> str | None:
        """Re-run each held spike once from its pre-step state, classify it, apply the policy, then run the
        window's later steps (held only because the flag is sticky) from their kept batches. Edits the lists."""
        st = self.state
        end_step, end_tokens = st.step, st.tokens_seen
        thr = self._spike_thr
        assert thr is not None
        i = next(k for k, v in enumerate(vals) if v[_HOLD])
        while True:
            rec = recs[i]
            spike = vals[i][_LOSS] / max(vals[i][_TOKENS], 1.0)
            # Steps i.. were skipped on the device: the weights and optimizer are those after step rec.step - 1.
            self._hold = torch.zeros((), dtype=torch.bool, device=self.device)
            recs[i] = self._replay(rec)
            (vals[i],) = self._read([recs[i]])
            rerun = vals[i][_LOSS] / max(vals[i][_TOKENS], 1.0)
            reproducible = bool(vals[i][_HOLD])  # held again: the re-run is above the threshold too
            if not reproducible:
                self._report_spike(rec.step, "transient", spike, rerun, "kept the re-run")
            else:
                dropped[i] = True
                action = {"skip": "step dropped", "rollback": "rolling back", "stop": "stopping"}[self.policy]
                self._report_spike(rec.step, "reproducible", spike, rerun, action)
                if self.policy == "stop":
                    raise UserError(
                        f"reproducible loss spike at step {rec.step} (loss {rerun:.4g}, threshold "
                        f"{thr:.4g}; recovery.nan_policy = stop); {self._last_good_text(rec.step)}"
                    )
                if self.policy == "rollback":
                    st.step, st.tokens_seen = end_step, end_tokens  # the loader is at the window's end
                    return self.rollback(f"reproducible loss spike at step {rec.step}", rec.step)
            self._hold = torch.zeros((), dtype=torch.bool, device=self.device)
            later = [self._replay(r) for r in recs[i + 1 :]]
            if later:
                recs[i + 1 :] = later
                vals[i + 1 :] = self._read(later)
            nxt = [k for k in range(i + 1, len(vals)) if vals[k][_HOLD]]
            if not nxt:
                break
            i = nxt[0]
        st.step, st.tokens_seen = end_step, end_tokens
        return None

    def _report_spike(self, step: int, kind: str, loss: float, rerun: float | None, action: str) -> None:
        thr = self._spike_thr
        if kind == "unchecked":
            text = f"step {step}: loss spike {loss:.4g} (threshold {thr:.4g}); not re-run (several processes or fp16)"
        else:
            text = (
                f"step {step}: loss spike {loss:.4g} (threshold {thr:.4g}); the re-run on the same batch gives "
                f"{rerun:.4g}: {'transient' if kind == 'transient' else 'reproducible spike'}, {action}"
            )
        self.log_line(text)
        if self.dist.is_main:
            row: dict[str, Any] = {
                "event": "spike",
                "kind": kind,
                "spike_loss": loss,
                "threshold": thr,
                "action": action,
            }
            if rerun is not None:
                row["rerun_loss"] = rerun
            self.metrics.log(step, row)

    # ------------------------------------------------------------------------------------- eval / sample
    def _eval_and_track(self) -> tuple[float, bool]:
        st = self.state
        val_loss, ppl = self.evaluate()
        # Weights inside a streak of bad steps are never the best (a collapsed model's first evaluation would be).
        improved = (
            math.isfinite(val_loss)
            and not st.bad_steps
            and val_loss < st.best_val_loss - self.ev.early_stopping_min_delta
        )
        if improved:
            st.best_val_loss = val_loss
            st.evals_without_improvement = 0
        elif math.isfinite(val_loss):
            st.evals_without_improvement += 1
        st.history.append({"step": st.step, "val_loss": val_loss, "val_ppl": ppl})
        if self.dist.is_main:
            self.metrics.log(st.step, {"val_loss": val_loss, "val_ppl": ppl})
            self.log_line(
                f"step {st.step}: val loss {val_loss:.4f}, perplexity {ppl:.2f}"
                + (" (best)" if improved else "")
            )
            if self.plots is not None:
                self.plots.request()
        return val_loss, improved

    @torch.no_grad()
    def _score_tasks_or_drop_them(self) -> None:
        """Score the tasks, or drop them on a failure the checks before the run could not see (a harness metric's
        options, memory). ``_score_tasks`` tells every rank about any rank's failure, so all drop them alike."""
        if not self._or_warn(
            "scoring eval_tasks", self._score_tasks, "them", "gptoughts eval RUN --tasks ..."
        ):
            self.tasks = None

    def _or_warn(self, what: str, action: Callable[[], Any], lost: str, later: str) -> bool:
        """Run an optional part of the run (samples, task scores): a failure is one warning line and the run goes on
        without it, since it must not cost the run. False on a failure."""
        try:
            action()
            return True
        except Exception as e:  # noqa: BLE001 - said in one line; the run continues
            self.model.train()
            self.log_line(
                f"warning: step {self.state.step}: {what} failed ({first_line(e)}); the run goes on without {lost} "
                f"({later} afterwards)"
            )
            return False

    def _score_tasks(self) -> dict[str, dict[str, float]]:
        """Score ``eval.eval_tasks`` with the live model; log ``tasks/NAME/METRIC`` rows and a console line.

        Under FSDP or TP every forward is a collective, and the number of forwards depends on the examples (their
        choices, batches, and for generation tasks the generated lengths): every rank scores every example, with
        the same inputs, so all run the same forwards. Replicas (DDP, or one process) split each task's examples
        by data-parallel rank on the plain module (no DDP hooks) and combine the slices, weighted by their
        example counts. Scoring draws no training randomness, and the RNG state is restored around it anyway:
        a resumed run continues bit for bit as one that never stopped."""
        assert self.tasks is not None
        t0 = time.perf_counter()
        d = self.dist
        shard = (0, 1) if d.sharded else (d.dp_rank, d.dp_size)
        model = pdist.unwrap(self.model) if d.enabled else self.model
        rng = self._rng_state()
        self.model.eval()
        error = None
        try:
            with self.autocast():
                # A stop asked for (Ctrl-C, a scheduler's SIGTERM) ends the scoring at the next batch, where the
                # forwards are not collectives (one process, DDP replicas): the run saves and exits in time.
                stop = None if d.sharded else (lambda: self.stop_requested)
                local = self.tasks(model, shard=shard, stop=stop)
        except Exception as e:  # noqa: BLE001 - told to every rank below, before the next collective
            local, error = {}, first_line(e)
        finally:
            self.model.train()
            self._set_rng_state(rng)
        # Every rank learns whether any rank failed, so all drop the tasks alike (a rank that went on to the next
        # step's collectives alone would hang the run). A failure inside a sharded forward cannot be rescued:
        # the other ranks wait in that forward's collective.
        parts = pdist.all_gather_object({"scores": local, "error": error}, d)
        errors = [p["error"] for p in parts if p["error"]]  # type: ignore[index]
        if errors:
            raise RuntimeError(errors[0])
        if any(p["scores"] is None for p in parts):  # type: ignore[index]
            self.log_line(f"step {self.state.step}: task scoring stopped (a stop was asked for); not logged")
            self._window_t0 += time.perf_counter() - t0
            return {}
        scored = [p["scores"] for p in parts] if shard[1] > 1 else [local]  # type: ignore[index]
        results = self.task_scores = combine_task_scores(scored)  # type: ignore[arg-type]
        step = self.state.step
        if d.is_main:
            row = {
                f"tasks/{name}/{k}": v for name, r in results.items() for k, v in r.items() if k != "examples"
            }
            self.metrics.log(step, row)
            self.log_line(
                f"step {step}: tasks "
                + "; ".join(
                    f"{name} "
                    + " ".join(f"{k} {v:.4f}" for k, v in r.items() if k != "examples")
                    + f" ({int(r['examples'])} examples)"
                    for name, r in results.items()
                )
            )
            if self.plots is not None:
                self.plots.request()
        # The logged throughput is training's: the next window does not count the time spent scoring.
        self._window_t0 += time.perf_counter() - t0
        return results

    def _sample_or_drop_it(self) -> None:
        """Write the samples, or stop sampling on a failure (memory, a sampler bug). Under FSDP every rank generates
        the same tokens, so a failure is every rank's alike."""
        if not self._or_warn("sampling", self._sample, "samples", "gptoughts sample RUN"):
            self.sample_fn = None

    def _sample(self) -> None:
        # Under FSDP or TP every rank generates (each forward is a collective), the same tokens (same logits, same
        # seeded generator); rank 0 writes.
        if self.sample_fn is None or not (self.dist.is_main or self.dist.sharded):
            return
        self.model.eval()
        texts = []
        for prompt in self.ev.sample_prompts:
            with self.autocast():
                texts.append(self.sample_fn(prompt))
        self.model.train()
        self.last_samples = (self.state.step, texts)
        if not self.dist.is_main:
            return
        with open(self.run_dir / "samples.txt", "a", encoding="utf-8") as f:
            f.write(f"=== step {self.state.step}\n")
            for prompt, text in zip(self.ev.sample_prompts, texts):
                f.write(f"--- prompt: {prompt!r}\n{text}\n")
        for i, text in enumerate(texts):
            self.metrics.text(f"samples/{i}", text, self.state.step)


def combine_task_scores(parts: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """One ``{task: {"examples": n, metric: value}}`` from the slices that ranks scored: each metric the mean of
    the slices' values weighted by their example counts (an accuracy from the summed hits)."""
    out: dict[str, dict[str, float]] = {}
    for name in parts[0]:
        slices = [p[name] for p in parts if p[name].get("examples")]
        n = sum(sl["examples"] for sl in slices)
        metrics = [k for k in slices[0] if k != "examples"] if slices else []
        out[name] = {k: sum(sl[k] * sl["examples"] for sl in slices) / n for k in metrics}
        out[name]["examples"] = n
    return out


class _Profiler:
    """torch.profiler over steps START..END (1-based, inclusive), written as a Chrome/Perfetto trace."""

    def __init__(self, spec: str | None, out_dir: Path, rank: int):
        self.prof = None
        if not spec:
            self.start = self.end = -1
            return
        start, _, end = spec.partition(":")
        self.start, self.end = int(start), int(end)
        self.out_dir = out_dir
        self.rank = rank

    def before_step(self, step: int) -> None:
        if step == self.start:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self.prof = profile(activities=acts, record_shapes=True)
            self.prof.__enter__()

    def after_step(self, step: int) -> None:
        if self.prof is not None and step >= self.end:
            self.close()

    def close(self) -> None:
        if self.prof is None:
            return
        self.prof.__exit__(None, None, None)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / f"trace_rank{self.rank}_steps{self.start}-{self.end}.pt.trace.json"
        self.prof.export_chrome_trace(str(path))
        summary = summarize_profile(self.prof, self.end - self.start + 1)
        if (
            summary
        ):  # CUDA runs: where the GPU time went, by kernel category, and its idle gaps, next to the trace
            (self.out_dir / f"kernels_rank{self.rank}_steps{self.start}-{self.end}.json").write_text(
                json.dumps(summary, indent=2)
            )
            log.info("profile steps %d-%d: %s", self.start, self.end, "; ".join(format_profile(summary)))
        log.info("profiler trace written to %s (open in Perfetto or TensorBoard)", path)
        self.prof = None
