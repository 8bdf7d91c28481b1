"""The one training loop.

Pretraining, fine-tuning, LoRA and masked diffusion all run here; they differ by the model, the data loader and the
objective passed in, never by a copied loop. Speed features (compile, fp8, activation checkpointing, FSDP) are
applied to the model before it reaches the trainer (``training/setup.py``); its components, the checkpointer
(``checkpointer.py``), the NaN and spike policy (``recovery.py``) and the evaluator (``evaluation.py``), are built by
the assembly (``build.py``) and handed over ready.

Host-device syncs happen only at log/eval/save intervals ("flushes"): each step's values stay on the device in
``Trainer._pending`` and the flush reads them in one transfer, then recovery settles the window's bad steps.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gptoughts.config import TrainConfig, check_train_ranges
from gptoughts.errors import UserError
from gptoughts.parallel import dist as pdist
from gptoughts.perf.autobatch import free_memory
from gptoughts.perf.startup import Startup
from gptoughts.perf.timing import GpuMonitor, StepTimer, advice, format_profile, summarize_profile
from gptoughts.training.checkpointer import Checkpointer
from gptoughts.training.dpo import pair_row, pop_pairs
from gptoughts.training.evaluation import Evaluator
from gptoughts.training.metrics import MetricsLogger, ProgressBar, console, format_eta
from gptoughts.training.optim import Schedule, clip_and_step, set_lr, zero_grads
from gptoughts.training.recovery import INF, LOSS, NORM, TOKENS, Recovery, Rollback, StepRecord, Window
from gptoughts.training.state import (
    Batch,
    TrainState,
    autocast,
    log_line,
    rng_state,
    set_rng_state,
)

log = logging.getLogger("gptoughts.training")


@dataclass
class _Due:
    """What the end of a step calls for."""

    log: bool
    evaluate: bool
    sample: bool
    tasks: bool
    save: bool
    stop: bool
    at_end: bool


def _check_parts(
    cfg: TrainConfig,
    precision: str,
    scaler: torch.amp.GradScaler | None,
    state: TrainState,
    recovery: Recovery | None,
    evaluator: Evaluator | None,
) -> None:
    check_train_ranges(cfg)
    if (precision == "fp16") != (scaler is not None):
        raise ValueError(
            "Trainer: pass a GradScaler (checkpointer.grad_scaler) exactly when precision is fp16"
        )
    if any(part is not None and part.state is not state for part in (recovery, evaluator)):
        raise ValueError("Trainer: the recovery and the evaluator must be built on the trainer's state")


class Trainer:
    """The loop over ``total_steps`` optimizer steps of ``model``, each of ``cfg.grad_accum`` batches of ``loader``.

    The components come ready from the assembly and share ``state`` (which a rollback restores in place):
    ``checkpointer`` (None: no checkpoints), ``recovery`` (the NaN and spike policy; None: a trainer that only
    steps, for timing and tests), ``evaluator`` (None: no evaluation, samples or task scores). ``scaler``: fp16's
    loss scaler, exactly when ``precision`` is fp16. ``weights``: what checkpoints hold (the model, or a LoRA model's
    adapters), whose trainer hooks (``after_optimizer_step``, ``rank_summed_state``, ``log_metrics``) run here.
    ``pipeline``: a ``parallel.pp.Pipeline``, through whose schedule forward and backward run (``model`` is then the
    rank's stages as one module). ``phases``: the curriculum as the plan lists it (``BatchPlan.phases``): each phase
    is announced, and written to the metrics, as its first batch is drawn (None: only the changes are announced)."""

    def __init__(
        self,
        *,
        model: nn.Module,
        objective: Callable[[nn.Module, Batch], tuple[torch.Tensor, torch.Tensor]],
        optimizer: torch.optim.Optimizer,
        schedule: Schedule,
        loader: Any,
        cfg: TrainConfig,
        dist: pdist.DistInfo,
        device: torch.device,
        precision: str,
        metrics: MetricsLogger,
        total_steps: int,
        tokens_per_step: int,
        state: TrainState | None = None,
        checkpointer: Checkpointer | None = None,
        recovery: Recovery | None = None,
        evaluator: Evaluator | None = None,
        scaler: torch.amp.GradScaler | None = None,
        weights: nn.Module | None = None,
        pipeline: Any = None,
        static_token_count: bool = True,
        keep_grads: bool = False,
        forward_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        after_optimizer_step: Callable[[], None] | None = None,
        mfu_per_token_s: float | None = None,
        timing: bool = True,
        progress: bool = True,
        profile_dir: Path = Path("profile"),
        phases: list[dict[str, Any]] | None = None,
    ):
        self.state = state if state is not None else TrainState()
        _check_parts(cfg, precision, scaler, self.state, recovery, evaluator)
        self.model = model
        self.pipeline = pipeline
        self.objective = objective
        self.optimizer = optimizer
        self.schedule = schedule
        self.loader = loader
        self.cfg = cfg
        self.dist = dist
        self.device = device
        self.precision = precision
        self.metrics = metrics
        self.total_steps = total_steps
        self.tokens_per_step = tokens_per_step
        self.checkpointer = checkpointer
        self.recovery = recovery
        if recovery is not None:
            recovery.rescue = self._checkpoint_before_streak
        self.evaluator = evaluator
        self.scaler = scaler
        self.forward_context = forward_context
        # MFU of a logged window = its tokens/s x this (FLOPs per token / the GPUs' total bf16 peak); None off CUDA
        self.mfu_per_token_s = mfu_per_token_s
        self.show_progress, self.profile_dir = progress, profile_dir
        # Pretraining batches have no ignored targets: the token count of a step is known without looking at the
        # data, so we avoid an all-reduce of the count each step. SFT batches set this False.
        self.static_token_count = static_token_count
        self.params = [p for p in model.parameters() if p.requires_grad]
        # setup.Built.keep_grads (CUDA graphs): gradients zeroed in place, never freed. Allocated at the first step,
        # not here: a resume loads the optimizer state after this, and torch's DCP optimizer state dict creates no
        # state slots to load into while any .grad exists (the moments would silently restart from zero).
        self.keep_grads = keep_grads
        self.fused = bool(getattr(optimizer, "defaults", {}).get("fused"))
        inner = weights if weights is not None else pdist.unwrap(model)
        self._after_step = getattr(inner, "after_optimizer_step", None)
        self._rank_summed = getattr(inner, "rank_summed_state", None) if dist.enabled else None
        self._rank_summed_log = getattr(inner, "rank_summed_log_state", None) if dist.enabled else None
        self._model_metrics = getattr(inner, "log_metrics", None)
        self._after_transforms = after_optimizer_step
        self.timer, self.gpu_monitor = StepTimer(device, enabled=timing), GpuMonitor(device)
        self.split = 1
        self.startup: Startup | None = None  # given to fit: the first step completes it
        self.stop_requested, self.stop_signal, self.stop_reason = False, None, "max steps"
        self._interrupts = self._logs = 0
        self.phases = phases or []
        self._phase: str | None = None  # the curriculum phase of the last batch drawn
        self._previous_gpu: dict[str, float] = {}  # the last window's GPU reading (advice needs two low ones)

    def autocast(self) -> contextlib.AbstractContextManager:
        """Mixed precision (and the SDPA backend choice) around forward passes."""
        return autocast(self.device, self.precision, self.forward_context)

    def log_line(self, text: str) -> None:
        """An event line on rank 0 (see ``state.log_line``)."""
        log_line(text, self.dist)

    # ------------------------------------------------------------------------------------------- one step
    def _no_sync(self, last: bool) -> contextlib.AbstractContextManager:
        # DDP all-reduces (FSDP reduce-scatters) gradients during backward; skip it on all but the last
        # micro-batch of the step, unless FSDP2 is to reduce every micro-batch (an unsharded whole-model
        # gradient would not fit: DistInfo.sync_every_microbatch).
        if hasattr(self.model, "set_requires_gradient_sync"):  # FSDP2
            self.model.set_requires_gradient_sync(last or self.dist.sync_every_microbatch)
        elif not last and hasattr(self.model, "no_sync"):
            return self.model.no_sync()
        return contextlib.nullcontext()

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One optimizer step over grad_accum micro-batches.

        Returns, on the device: this rank's summed token loss, the global target-token count, found_inf.
        """
        accum = self.cfg.grad_accum
        self.timer.start()
        micro = []
        for _ in range(accum):
            self._enter_phase()  # (host only: the loader's position)
            micro.append(next(self.loader))
        self.timer.mark("data")
        return self._run_step(micro)

    def _run_step(self, micro: list[Batch]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._spike_gate_armed():
            # keep what a re-run of this step needs (references and a 5 KB RNG copy: no sync)
            self._last_micro, self._last_rng = micro, rng_state(self.device)
        else:
            self._last_micro = self._last_rng = None
        while True:
            pop_pairs(self.objective, True)  # a failed attempt's pairs never count: the retry runs them again
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
        if self._spike_gate_armed():  # a spiking step is held: skipped like a non-finite one (recovery.py)
            gate_loss, self._last_hold = self.recovery.hold_spike(loss_sum, n_total)
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

    def _record(self, loss_sum: torch.Tensor, n_tokens: torch.Tensor, found_inf: torch.Tensor) -> StepRecord:
        """The step just run (``state.step + 1``), kept for the next flush: with its spike flag, and while the gate
        is armed its batches and RNG state."""
        return StepRecord(
            self.state.step + 1,
            loss_sum,
            n_tokens,
            self._last_grad_norm,
            found_inf,
            self._last_hold,
            self._last_micro,
            self._last_rng,
            pop_pairs(self.objective, True),
        )

    def _spike_gate_armed(self) -> bool:
        return self.recovery is not None and self.recovery.armed

    def _replay(self, rec: StepRecord) -> StepRecord:
        """Run the step ``rec.step`` again from its kept batches (the state must be its pre-step state)."""
        st = self.state
        st.step = rec.step - 1
        set_rng_state(rec.rng, self.device)
        assert rec.batches is not None
        self.timer.start()
        new = self._record(*self._run_step(rec.batches))
        st.step += 1
        return new

    def _rerun(self, recs: list[StepRecord]) -> tuple[list[StepRecord], list[list[float]]]:
        """Run ``recs`` again (the state being the first one's pre-step state), then read them (recovery's re-run of
        held spikes)."""
        new = [self._replay(r) for r in recs]
        return new, self._read(new)

    # ---------------------------------------------------------------------------------------------- fit
    def fit(self, startup: Startup | None = None) -> TrainState:
        """Train to ``total_steps``, or to an early stop or a stop asked for (``stop_reason`` says which).
        ``startup``: the start-up's clock, which the first step completes (one device sync) and prints."""
        if self.recovery is None:
            raise ValueError("Trainer.fit needs a Recovery (the policy for non-finite steps)")
        self.startup = startup
        self.model.train()
        self.progress = ProgressBar(
            self.total_steps, self.state.step, enabled=self.dist.is_main and self.show_progress
        )
        old_handlers = self._catch_signals()
        self._pending: list[StepRecord] = []  # the steps since the last flush
        self._window_t0 = time.perf_counter()
        self.recovery.arm_spike_gate()
        self.stop_reason = "max steps"
        profiler = _Profiler(self.cfg.profile, self.profile_dir, self.dist.rank)
        try:
            while self.state.step < self.total_steps:
                st = self.state
                profiler.before_step(st.step + 1)
                self._pending.append(self._record(*self.train_step()))
                profiler.after_step(st.step + 1)
                self._after_first_step()
                st.step += 1
                st.tokens_seen += self.tokens_per_step
                due = self._due()
                # Evaluating, sampling and saving read the model: the window's held or non-finite steps are
                # settled first (the flush may re-run a spike, roll back, or raise; at the end, any open streak).
                if due is None or self._flush(due.at_end):
                    continue
                if self._at_interval(due):
                    break
            if self.checkpointer is not None:
                self.checkpointer.wait()  # the run ends with its last checkpoint on disk (or with its write error)
        finally:
            if self.checkpointer is not None:  # leaving on an error too: never mid-write
                self.checkpointer.close()
            profiler.close()
            for sig, handler in old_handlers.items():
                signal.signal(sig, handler)
            self.progress.close()
        if not self.stop_reason.startswith("interrupted"):
            self.stop_signal = None  # (see _interval_work) it exits as a complete run does, not 128 + signal
        return self.state

    def _catch_signals(self) -> dict[int, Any]:
        """Ctrl-C and SIGTERM ask for a graceful stop (a checkpoint, then exit); the handlers they replace."""
        old_handlers = {}
        try:
            for sig in (signal.SIGINT, signal.SIGTERM):
                old_handlers[sig] = signal.signal(sig, self._on_signal)
        except ValueError:  # not the main thread (e.g. a notebook executor): no graceful stop
            return {}
        return old_handlers

    def _on_signal(self, signum: int, frame: object) -> None:
        self._interrupts += 1
        if self._interrupts > 1:
            raise KeyboardInterrupt
        self.stop_requested = True
        self.stop_signal = signum  # the CLI exits with 128 + signum (130 for SIGINT, 143 for SIGTERM)

    def _after_first_step(self) -> None:
        """The start-up's end (first step only) and the checkpointer's buffers (once the optimizer state exists)."""
        su = self.startup
        if su is not None and not su.first_step_s:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            su.first_step_s = max(1e-3, su.age() - su.imports_s - su.assembly_s)
            if self.dist.is_main:
                console.print(su.line(), highlight=False)
                hint = su.bytecode_hint()
                if hint:
                    console.print(hint, highlight=False)
        if self.checkpointer is not None:
            self.checkpointer.prepare(self.state)

    def _due(self) -> _Due | None:
        """What the step just finished calls for; None: nothing (the next step follows at once)."""
        step = self.state.step
        at_end = step >= self.total_steps
        ev = self.evaluator
        evaluate, sample, tasks = ev.due(step, at_end) if ev is not None else (False, False, False)
        every = self.checkpointer.cfg.save_interval if self.checkpointer is not None else None
        due = _Due(
            log=step % self.cfg.log_interval == 0 or at_end,
            evaluate=evaluate,
            sample=sample,
            tasks=tasks,
            save=bool(every and step % every == 0) or at_end,
            # Alone, a signal stops at the next step; with several ranks only where they agree (log steps),
            # or one rank would save (a collective under FSDP) while the others start the next step.
            stop=self.stop_requested and not self.dist.enabled,
            at_end=at_end,
        )
        return due if (due.log or evaluate or sample or tasks or due.save or due.stop) else None

    def _at_interval(self, due: _Due) -> bool:
        """After the flush: log, evaluate, save, sample and score as due. True: the run stops here. The logged
        throughput is training's: the next window does not count the time spent here."""
        t0 = time.perf_counter()
        try:
            return self._interval_work(due)
        finally:  # (a rollback in it restarted the window already: never later than now)
            now = time.perf_counter()
            self._window_t0 = min(self._window_t0 + now - t0, now)

    def _interval_work(self, due: _Due) -> bool:
        stop, ev = due.stop, self.evaluator
        if due.log:
            stop = stop or self._agree_stop()
            if self.checkpointer is not None and self.checkpointer.background_failed():
                # A background write failed: the state is saved again now (synchronously; see FileSaver.save)
                # rather than at the next interval, so no more work is at risk.
                self.save()
        val_loss, best = None, False
        if due.evaluate:
            val_loss, best = ev.evaluate_and_track()
            # (at the last step the run ends by its own rule, complete: a resume of it needs more steps, not patience)
            if ev.patience_exhausted() and not due.at_end:
                stop, self.stop_reason = True, "early stopping"
                # An end too: an open streak is settled first (a rollback trains on from there).
                if self.state.bad_steps:
                    self._after_rollback(self.recovery.settle_streak(at_end=True))
                    self.stop_reason = "max steps"
                    return False
        saved = (due.save or best or stop) and self.save(val_loss=val_loss, is_best=best)
        # Samples and task scores only read the model: they come after the save, and a failure in them is a
        # warning, so neither can cost this step's checkpoint (at the end: the run's last one). An early stop is an
        # end: its samples go to samples.txt as the last step's would.
        if due.sample or (self.stop_reason == "early stopping" and ev.due(self.state.step, True)[1]):
            ev.sample_or_drop_it()
        # An early stop is an end too (every rank decides it alike, from the all-reduced val loss); a Ctrl-C is not
        # made to wait for a scoring.
        if due.tasks or (ev is not None and ev.tasks is not None and self.stop_reason == "early stopping"):
            self._score_tasks()
        if not stop:
            return False
        # A signal at the run's last step, or at an early stop, ends nothing that was not ending: the run is
        # complete, as its resume would find it.
        if self.stop_requested and not due.at_end and self.stop_reason != "early stopping":
            self.stop_reason = self._interrupted(saved)
        return True

    def _interrupted(self, saved: bool) -> str:
        """The stop reason of a run a signal ends, with ``saved``: whether this step's checkpoint was written.
        Inside a streak of bad steps it is refused; with no good checkpoint before the streak, the state from before
        it is saved instead (``Recovery.rescue_open_streak``), or every step trained so far would be lost."""
        ck = self.checkpointer
        if ck is None or not ck.enabled:
            return "interrupted (checkpoint.checkpoints false: nothing to resume from)"
        if saved:
            kept = "checkpoint saved"
        elif (rescued := self.recovery.rescue_open_streak()) is not None:
            kept = f"the state from before the bad steps saved as {rescued.name}"
        elif ck.last_good(self.state.step + 1) is not None:
            kept = "no checkpoint now, the last good one kept"
        else:
            kept = "no checkpoint written yet"
        return f"interrupted ({kept}; resume with --resume auto)"

    def _agree_stop(self) -> bool:
        # Ranks may see a signal at different steps, or only some of them see it (one process killed by hand); they
        # agree at log intervals so collectives stay aligned, and on the signal: every rank stops as interrupted
        # (rank 0's summary and every exit code say so, not "max steps" and 0).
        if not self.dist.enabled:
            return self.stop_requested
        seen = torch.tensor(float(self.stop_signal or 0), device=self.device)
        signum = int(pdist.all_reduce_max(seen, self.dist).item())
        if signum and not self.stop_requested:
            self.stop_requested, self.stop_signal = True, signum
        return bool(signum)

    def _score_tasks(self) -> None:
        self.evaluator.score_tasks_or_drop_them(stop=lambda: self.stop_requested)

    # ------------------------------------------------------------------------------------------ checkpoints
    def save(self, *, val_loss: float | None = None, is_best: bool = False) -> bool:
        """Write a checkpoint of the current state unless it is a bad one (``recovery.py``)."""
        ck = self.checkpointer
        if ck is None or not ck.enabled:
            return False
        problem = self.recovery.checkpoint_problem() if self.recovery is not None else None
        if problem is not None:
            good = ck.last_good(self.state.step + 1)
            self.log_line(
                f"step {self.state.step}: checkpoint not written ({problem}); "
                + (f"the last good one is {good}" if good is not None else "no good one was written yet")
            )
            return False
        blocked = ck.write(self.state, val_loss=val_loss, is_best=is_best)
        if blocked is not None:  # how long training stood still for it
            self.metrics.log(self.state.step, {"checkpoint_blocked_s": blocked})
        return True

    def _checkpoint_before_streak(self, first_bad: int) -> Path | None:
        """``Recovery.rescue``: the weights and optimizer from before a streak of skipped steps, saved as step
        ``first_bad - 1`` (the loader stays past the streak's batches, as after a rollback; ``first_bad - 1`` the
        step of now: the state as it is); the checkpoint's path, or None where none could be written (no
        checkpoints, non-finite weights, a failed write)."""
        ck, st = self.checkpointer, self.state
        back = st.step - (first_bad - 1)
        if ck is None or not ck.enabled or back < 0 or not ck.weights_finite():
            return None
        st.step, st.tokens_seen = st.step - back, st.tokens_seen - back * self.tokens_per_step
        st.data_steps_skipped += back
        st.bad_steps = 0
        # The streak's evaluations belong to steps the resume runs again: each counted one without improvement.
        st.evals_without_improvement -= sum(
            h["step"] > st.step and math.isfinite(h["val_loss"]) for h in st.history
        )
        st.history = [h for h in st.history if h["step"] <= st.step]
        try:
            if not self.save():
                return None
            ck.wait()
        except (UserError, OSError) as e:  # the run stops on its divergence either way; this is said too
            self.log_line(f"step {st.step}: the state before the streak could not be saved ({e})")
            return None
        return ck.last_good(st.step + 1)

    def _after_rollback(self, rollback: Rollback) -> None:
        # Record the decision where a resume finds it: the checkpoint returned to, now with the loader past the
        # bad batches, the cut learning rate and the rollback count (an atomic replace; see checkpoint.py).
        self._pending = []
        self.save(val_loss=rollback.val_loss)
        self._window_t0 = time.perf_counter()

    # ------------------------------------------------------------------------------------------- flushes
    def _read(self, recs: list[StepRecord]) -> list[list[float]]:
        """The records' values as floats: one stack, one all-reduce of the loss column, one transfer."""
        zero = torch.zeros((), device=self.device)
        flat = [
            t.float().to(self.device)  # a no-op, except an offloaded run's grad norm, computed on the CPU
            for r in recs
            for t in (r.loss_sum, r.n_tokens, r.grad_norm, r.found_inf, zero if r.hold is None else r.hold)
        ]
        table = torch.stack(flat).view(len(recs), 5)
        if self.dist.enabled:  # each rank summed its own rows' loss; the counts and flags are global already
            col = table[:, LOSS].contiguous()
            pdist.all_reduce_loss(col, self.dist)  # a tensor-parallel group's ranks hold the same loss
            table[:, LOSS] = col
        return table.tolist()

    def _flush(self, at_end: bool = False) -> bool:
        """Settle the steps since the last flush: recovery re-runs held spikes, the window is logged, recovery
        applies its policy to the bad steps and updates the spike statistics. True when a rollback restored an
        earlier state. ``at_end``: the run's last step, where a streak still open is settled whatever its length."""
        recs, self._pending = self._pending, []
        if not recs:
            return False
        window = Window(recs, self._read(recs))
        rolled = self.recovery.rerun_spikes(window, self._rerun)
        if rolled is None:
            self.recovery.classify(window)
            self._log_window(window)
            rolled = self.recovery.apply_policy(window, at_end)
        if rolled is None:
            return False
        self._after_rollback(rolled)
        return True

    def _log_window(self, w: Window) -> None:
        st, good = self.state, w.good
        n_tokens = sum(v[TOKENS] for v in good)
        loss = sum(v[LOSS] for v in good) / max(1.0, n_tokens) if good else math.nan
        elapsed = time.perf_counter() - self._window_t0
        self._window_t0 = time.perf_counter()
        tps = len(w.recs) * self.tokens_per_step / max(elapsed, 1e-9)
        row = {
            "loss": loss,
            "lr": self._last_lr,
            "tokens_per_s": tps,
            "grad_norm": w.vals[-1][NORM],
            "tokens": st.tokens_seen,
            "epoch": getattr(self.loader, "epoch", None),
            "skipped_steps": len(w.nonfinite),
        }
        if any(w.dropped):
            row["dropped_spikes"] = sum(w.dropped)
        if w.collapsed:
            row["collapsed_steps"] = len(w.collapsed)
        self._note_phase(row)
        if self.mfu_per_token_s:
            row["mfu"] = tps * self.mfu_per_token_s
        if self.device.type == "cuda":
            row["memory/peak_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        if self._model_metrics is not None:
            with torch.no_grad():  # every rank logs the window: the model's statistics of all ranks' data
                for t in self._rank_summed_log() if self._rank_summed_log is not None else ():
                    pdist.all_reduce_dp(t, self.dist)
            row.update(self._model_metrics())
        # preference tuning only: the pairs of the steps that trained (a re-run replaced its record, a skipped or
        # dropped step trained nothing)
        kept = [
            r.pairs for r, v, d in zip(w.recs, w.vals, w.dropped) if r.pairs is not None and not (d or v[INF])
        ]
        row.update(pair_row(sum(kept) if kept else None, self.dist, "dpo/"))
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
            self._show_progress(loss, tps)

    def _note_phase(self, row: dict[str, Any]) -> None:
        """A log row's curriculum phase: that of the window's last batch."""
        if self._phase is not None:
            row["phase"] = self._phase

    def _enter_phase(self) -> None:
        """Before a batch is drawn: the first batch of a curriculum phase is announced with its step (the plan's
        rule, ``curriculum.phase_schedule``) and written to the metrics as ``{"event": "phase"}``; a resumed run
        inside a phase says which. Rollbacks move the loader forward only: the last batch's phase stays right."""
        name = getattr(self.loader, "phase_name", None)
        if name is None or name == self._phase:
            return
        st = self.state
        step, before, last = st.step + 1, self._phase, st.phase
        self._phase = st.phase = name
        note = f" (after '{before}')"
        if before is None:
            # no curriculum known: the loader's one phase (or a trainer built without a plan)
            if not self.phases:
                return
            from gptoughts.training.curriculum import begins_now, phase_index

            loader = self.loader
            batch = int(getattr(loader, "global_batch_size", 0)) * int(getattr(loader, "block_size", 0))
            consumed = int(getattr(loader, "tokens_consumed", 0))
            # Whether the batch before this one, the checkpoint's last, was of this phase. A checkpoint that does not
            # say is judged at this run's batch, which a resume may have changed.
            goes_on = last == name if last is not None else not begins_now(self.phases, consumed, batch)
            if goes_on:
                self.log_line(f"step {step}: curriculum phase '{name}' goes on (resumed inside it)")
                return
            k, n = phase_index(self.phases, consumed), len(self.phases)  # (a resume may begin any of them)
            note = f" (the first of {n})" if k == 0 else f" ({k + 1} of {n})"
        self.log_line(f"step {step}: curriculum phase '{name}' begins{note}")
        if self.dist.is_main:
            self.metrics.log(step, {"event": "phase", "phase": name})

    def _show_progress(self, loss: float, tps: float) -> None:
        step = self.state.step
        eta = (self.total_steps - step) * self.tokens_per_step / tps if tps > 0 else None
        self.progress.update(
            step,
            loss=loss,
            lr=self._last_lr,
            tps=tps,
            eta_s=eta,
            line=f"step {step}/{self.total_steps} loss {loss:.4f} lr {self._last_lr:.2e} {tps:,.0f} tok/s"
            + (f" eta {format_eta(eta)}" if eta is not None else ""),
        )


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
