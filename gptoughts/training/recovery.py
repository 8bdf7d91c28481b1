"""What the run does about bad steps, decided at each flush of the loop (the full account and measurements:
docs/checkpoints.md, "Recovery" and "Loss spikes"):

* a non-finite step is skipped on the device by the optimizer (``found_inf``), never checked from Python;
* ``recovery.nan_policy``: ``stop``, ``skip`` (up to ``max_bad_steps`` in a row) or ``rollback`` (to the checkpoint
  saved before the streak, learning rate cut, data not rewound: ``TrainState.data_steps_skipped`` keeps the loader
  position consistent); a collapsed step (loss ln(vocab), zero gradient) counts as bad; no checkpoint is written
  during a streak;
* loss spikes (``recovery.spike_*``) are detected on the device; a spiking step is held, re-run once from its
  pre-step state at the flush, and kept (transient) or handled by the policy (reproducible). Multi-process and
  fp16 runs only report spikes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from gptoughts.config import RecoveryConfig
from gptoughts.errors import UserError
from gptoughts.parallel import dist as pdist
from gptoughts.training.checkpointer import Checkpointer
from gptoughts.training.metrics import MetricsLogger
from gptoughts.training.state import Batch, RngState, TrainState, log_line

_SPIKE_EMA = 0.02  # weight of one step in the running loss statistics (~50 steps of memory)
_SPIKE_MIN_SAMPLES = 8  # steps seen before the spike check can arm
# A collapsed step: loss within this relative distance of ln(vocab) and a gradient norm below this. Healthy
# training can sit at ln(vocab) (a zero-initialised output layer at step 1) but never with a zero gradient.
_COLLAPSE_LOSS_RTOL = 1e-3
_COLLAPSE_GRAD_NORM = 1e-6

# Columns of a flushed record.
LOSS, TOKENS, NORM, INF, HOLD = range(5)


@dataclass
class StepRecord:
    """One step's device values, read at the next flush; the batches and RNG state only while the spike check
    is armed (a held step is re-run from them)."""

    step: int
    loss_sum: torch.Tensor
    n_tokens: torch.Tensor
    grad_norm: torch.Tensor
    found_inf: torch.Tensor
    hold: torch.Tensor | None
    batches: list[Batch] | None
    rng: RngState | None
    pairs: torch.Tensor | None = None
    """Preference tuning: the step's (margin sum, pairs preferred, pairs), on the device (dpo.DPO)."""


@dataclass
class Window:
    """The steps of one flush: their records, their values read to the host (columns LOSS..HOLD), and what the
    flush found in them."""

    recs: list[StepRecord]
    vals: list[list[float]]
    dropped: list[bool] = field(default_factory=list)
    """Reproducible spikes held back: neither break nor extend a streak."""
    nonfinite: list[int] = field(default_factory=list)
    collapsed: list[int] = field(default_factory=list)
    new_collapse: tuple[int, list[float]] | None = None
    """The first collapsed step of a streak that had none (warned once per streak)."""

    def __post_init__(self) -> None:
        self.dropped = self.dropped or [False] * len(self.recs)

    @property
    def good(self) -> list[list[float]]:
        return [v for v, drop in zip(self.vals, self.dropped) if not v[INF] and not drop]


@dataclass
class Rollback:
    """A rollback happened: the state is now that of ``path``, which the loop saves again (with the loader past the
    bad batches, the cut learning rate and the rollback count) where a resume finds the decision."""

    path: Path
    val_loss: float | None


# Re-run steps from their kept batches: the new records and their values (the state is the first one's pre-step).
Rerun = Callable[[list[StepRecord]], tuple[list[StepRecord], list[list[float]]]]


class Recovery:
    """The NaN, collapse and spike policy of ``cfg`` over ``state`` (the loop's own object). ``precision`` and
    ``dist`` say whether spikes can be checked on the device; ``vocab_size``: the model's outputs, for the collapse
    check (None: none); ``grad_accum``: batches per step, for the rollback's report."""

    def __init__(
        self,
        state: TrainState,
        cfg: RecoveryConfig,
        *,
        metrics: MetricsLogger,
        dist: pdist.DistInfo,
        device: torch.device,
        precision: str,
        grad_accum: int,
        checkpointer: Checkpointer | None = None,
        vocab_size: int | None = None,
    ):
        self.state = state
        self.cfg = cfg
        self.policy = "stop" if cfg.nan_policy == "raise" else cfg.nan_policy
        self.metrics = metrics
        self.dist = dist
        self.device = device
        self.grad_accum = grad_accum
        self.checkpointer = checkpointer
        self.vocab_size = vocab_size
        self.rescue: Callable[[int], Path | None] | None = None
        """Set by the trainer: saves the state from before a streak of skipped steps as the step before ``first_bad``
        (its checkpoint's path, or None where it cannot)."""
        self._streak_start = 0  # first step of the current streak of bad steps
        self._streak_kinds: set[str] = set()  # "non-finite", "collapsed": what the current streak holds
        # The on-device spike check needs the global loss of each step and the right to skip a step: one process,
        # no fp16 loss scaler (which decides its own skips). Elsewhere spikes are only reported at flushes.
        self._gate_ok = not dist.enabled and precision != "fp16"
        self._spike_thr: float | None = None
        self.armed = False
        """Whether the steps run now are checked for spikes on the device (the loop keeps their batches)."""
        self._hold: torch.Tensor | None = None

    # ---------------------------------------------------------------------------------- the on-device gate
    def arm_spike_gate(self) -> None:
        """Set the spike threshold for the next window from the running statistics (None: not armed yet)."""
        st, rc = self.state, self.cfg
        thr = None
        if rc.spike_detection and st.step >= rc.spike_warmup_steps and st.loss_count >= _SPIKE_MIN_SAMPLES:
            std = math.sqrt(max(st.loss_var, 0.0))
            thr = max(st.loss_mean + rc.spike_std * std, rc.spike_ratio * st.loss_mean)
            if not (math.isfinite(thr) and thr > 0):
                thr = None
        self._spike_thr = thr
        self.armed = thr is not None and self._gate_ok
        self._hold = torch.zeros((), dtype=torch.bool, device=self.device) if self.armed else None

    def hold_spike(self, loss_sum: torch.Tensor, n_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The spike check of an armed step, on the device: a step whose mean loss is above the threshold, and
        every later step of the window (the flag is sticky), is skipped by the optimizer exactly like a non-finite
        one, so the flush finds the weights in that step's pre-step state and can re-run it. Returns the loss the
        optimizer sees (nan when held) and the flag."""
        hold = self._hold | (loss_sum > n_tokens * self._spike_thr)
        self._hold = hold
        return torch.where(hold, math.nan, loss_sum), hold

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

    # ------------------------------------------------------------------------------------ at each flush
    def rerun_spikes(self, w: Window, rerun: Rerun) -> Rollback | None:
        """Re-run the window's held spikes (an armed gate), or report the spikes of an unarmed one."""
        if self.armed and any(v[HOLD] for v in w.vals):
            return self._rerun_held(w, rerun)
        if self._spike_thr is not None and not self.armed:  # several processes, fp16: report only
            for r, v in zip(w.recs, w.vals):
                loss = v[LOSS] / max(v[TOKENS], 1.0)
                if not v[INF] and loss > self._spike_thr:
                    self._report_spike(r.step, "unchecked", loss, None, "none (kept)")
        return None

    def _rerun_held(self, w: Window, rerun: Rerun) -> Rollback | None:
        """Re-run each held spike once from its pre-step state, classify it, apply the policy, then run the
        window's later steps (held only because the flag is sticky) from their kept batches. Edits the window."""
        st = self.state
        end_step, end_tokens = st.step, st.tokens_seen
        recs, vals = w.recs, w.vals
        i = next(k for k, v in enumerate(vals) if v[HOLD])
        while True:
            rec = recs[i]
            spike = vals[i][LOSS] / max(vals[i][TOKENS], 1.0)
            # Steps i.. were skipped on the device: the weights and optimizer are those after step rec.step - 1.
            self._hold = torch.zeros((), dtype=torch.bool, device=self.device)
            again, again_vals = rerun([rec])
            recs[i], vals[i] = again[0], again_vals[0]
            rerun_loss = vals[i][LOSS] / max(vals[i][TOKENS], 1.0)
            if not vals[i][HOLD]:  # not held again: the re-run is below the threshold
                self._report_spike(rec.step, "transient", spike, rerun_loss, "kept the re-run")
            else:
                w.dropped[i] = True
                st.step, st.tokens_seen = end_step, end_tokens  # the loader is at the window's end
                if self._reproducible_spike(rec.step, spike, rerun_loss):
                    return self.rollback(f"reproducible loss spike at step {rec.step}", rec.step)
            self._hold = torch.zeros((), dtype=torch.bool, device=self.device)
            if i + 1 < len(recs):
                recs[i + 1 :], vals[i + 1 :] = rerun(recs[i + 1 :])
            nxt = [k for k in range(i + 1, len(vals)) if vals[k][HOLD]]
            if not nxt:
                break
            i = nxt[0]
        st.step, st.tokens_seen = end_step, end_tokens
        return None

    def _reproducible_spike(self, step: int, spike: float, rerun: float) -> bool:
        """Report a spike that its re-run repeated and apply the policy: True to roll back (raises to stop)."""
        action = {"skip": "step dropped", "rollback": "rolling back", "stop": "stopping"}[self.policy]
        self._report_spike(step, "reproducible", spike, rerun, action)
        if self.policy == "stop":  # (the step and the window's later ones were held: skipped)
            raise self._stopped(
                f"reproducible loss spike at step {step} (loss {rerun:.4g}, threshold "
                f"{self._spike_thr:.4g}; recovery.nan_policy = stop)",
                step,
            )
        return self.policy == "rollback"

    def _report_spike(self, step: int, kind: str, loss: float, rerun: float | None, action: str) -> None:
        thr = self._spike_thr
        if kind == "unchecked":
            text = f"step {step}: loss spike {loss:.4g} (threshold {thr:.4g}); not re-run (several processes or fp16)"
        else:
            text = (
                f"step {step}: loss spike {loss:.4g} (threshold {thr:.4g}); the re-run on the same batch gives "
                f"{rerun:.4g}: {'transient' if kind == 'transient' else 'reproducible spike'}, {action}"
            )
        log_line(text, self.dist)
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

    def classify(self, w: Window) -> None:
        """Count the window's non-finite and collapsed steps into the streak of bad steps (a good step ends it)."""
        st = self.state
        for r, v, drop in zip(w.recs, w.vals, w.dropped):
            if drop:  # a reproducible spike held back: neither breaks nor extends a streak
                continue
            kind = "non-finite" if v[INF] else "collapsed" if self._collapsed(v) else None
            if kind is None:
                st.bad_steps = 0
                self._streak_kinds = set()
                continue
            if kind == "collapsed" and kind not in self._streak_kinds and w.new_collapse is None:
                w.new_collapse = (r.step, v)  # warned once per streak
            (w.nonfinite if kind == "non-finite" else w.collapsed).append(r.step)
            self._streak_kinds.add(kind)
            if st.bad_steps == 0:
                self._streak_start = r.step
            st.bad_steps += 1

    def apply_policy(self, w: Window, at_end: bool) -> Rollback | None:
        """The policy on the window's bad steps (stop raises; a streak too long, or still open at the run's end
        ``at_end``, is settled), then the spike statistics and the gate for the next window."""
        st = self.state
        if w.nonfinite:
            if self.policy == "stop":
                # What a resume goes on from: the state before the open streak, or where good steps followed the
                # bad ones (applied over them: a skipped step changed nothing), the state of now.
                raise self._stopped(
                    f"non-finite loss or gradient at step {w.nonfinite[0]} (recovery.nan_policy = stop)",
                    self._streak_start if st.bad_steps else st.step + 1,
                )
            log_line(
                f"step {st.step}: {len(w.nonfinite)} step(s) skipped (non-finite loss or gradient)", self.dist
            )
        if w.new_collapse is not None:
            self._warn_collapse(*w.new_collapse)
        if st.bad_steps >= self.cfg.max_bad_steps or (at_end and st.bad_steps):
            return self.settle_streak(at_end=st.bad_steps < self.cfg.max_bad_steps)
        thr = self._spike_thr
        self._update_loss_stats(
            [v[LOSS] / max(v[TOKENS], 1.0) for v in w.good]
            + [thr for drop in w.dropped if drop and thr is not None]
        )
        self.arm_spike_gate()
        return None

    def _collapsed(self, v: list[float]) -> bool:
        """Whether a finite step is a collapsed one (see the module docstring)."""
        if not self.vocab_size or not v[TOKENS]:
            return False
        uniform, loss = math.log(self.vocab_size), v[LOSS] / v[TOKENS]
        return abs(loss - uniform) <= _COLLAPSE_LOSS_RTOL * uniform and v[NORM] <= _COLLAPSE_GRAD_NORM

    def _warn_collapse(self, step: int, v: list[float]) -> None:
        loss = f"{v[LOSS] / v[TOKENS]:.4f} = ln({self.vocab_size:,})"
        if self.policy == "stop":
            raise UserError(
                f"the model collapsed at step {step} (loss {loss} with a zero gradient; recovery.nan_policy = "
                f"stop); {self._last_good_text(step)}"
            )
        log_line(
            f"[yellow]warning:[/yellow] step {step}: the model collapsed (loss {loss}, a uniform prediction, "
            f"with a zero gradient): its steps count as bad steps "
            f"(recovery.nan_policy = {self.policy}, max_bad_steps = {self.cfg.max_bad_steps}); no checkpoint is "
            "written while it lasts",
            self.dist,
        )

    # ------------------------------------------------------------------------------------ streaks, rollback
    def _streak_kind(self) -> str:
        return " or ".join(sorted(self._streak_kinds, reverse=True)) or "non-finite"

    def checkpoint_problem(self) -> str | None:
        """Why the current state is not one to write (and roll back to later), or None."""
        if self.state.bad_steps:
            return f"the last {self.state.bad_steps} step(s) were {self._streak_kind()}"
        if self.checkpointer is not None and not self.checkpointer.weights_finite():
            return "the weights are not finite"
        return None

    def settle_streak(self, *, at_end: bool) -> Rollback:
        """Apply the policy to the open streak of bad steps: roll back, or raise the divergence error."""
        what = f"{self.state.bad_steps} consecutive {self._streak_kind()} steps"
        if at_end:
            what += " at the end of the run"
        if self.policy != "rollback":
            raise self._diverged(what, self._streak_start)
        return self.rollback(what, self._streak_start)

    def _last_good(self, before: int) -> Path | None:
        ck = self.checkpointer
        return ck.last_good(before) if ck is not None and ck.enabled else None

    def _last_good_text(self, before: int) -> str:
        path = self._last_good(before)
        if path is None:
            return "no good checkpoint was written before it; start again with a lower --learning_rate"
        return f"the last good checkpoint is {path}; resume from it with a lower --learning_rate"

    def _diverged(self, what: str, before: int) -> UserError:
        st = self.state
        rollbacks = f"{st.rollbacks} rollback{'' if st.rollbacks == 1 else 's'}"
        return self._stopped(f"training diverged at step {st.step} ({what}, {rollbacks})", before)

    def _stopped(self, head: str, first_bad: int) -> UserError:
        """The error that stops the run at the bad steps from ``first_bad`` on, naming what a resume goes on from:
        the last good checkpoint before them or, where none was written, the state they left, saved now."""
        saved = self._rescue_before_streak(first_bad)
        if saved is not None:
            return UserError(
                f"{head}; no checkpoint was written before it, so the weights it left (its steps were skipped, "
                f"not applied) are saved as {saved}; resume from it with a lower --learning_rate"
            )
        return UserError(f"{head}; {self._last_good_text(first_bad)}")

    def rescue_open_streak(self) -> Path | None:
        """A run stopped inside a streak of bad steps (a signal): :meth:`_rescue_before_streak` of that streak."""
        return self._rescue_before_streak(self._streak_start) if self.state.bad_steps else None

    def _rescue_before_streak(self, first_bad: int) -> Path | None:
        """A run about to stop on bad steps with no good checkpoint before them would lose all its steps. The steps
        from ``first_bad`` on were skipped (non-finite, or held spikes), so the weights and optimizer are still
        those of step ``first_bad - 1``, which the trainer saves when asked through ``rescue`` (when that is a
        trained step and the run writes checkpoints); its path, or None. Collapsed steps were applied: no such
        state is left behind a streak that holds any."""
        if (
            self.rescue is None
            or "collapsed" in self._streak_kinds
            or first_bad <= 1
            or self._last_good(first_bad) is not None
        ):
            return None
        return self.rescue(first_bad)

    def rollback(self, reason: str, bad_from: int) -> Rollback:
        """Reload the newest good checkpoint of a step < ``bad_from`` (weights, optimizer, RNG, step), keep the
        data loader where it is (past the bad batches), scale the learning rate by ``rollback_lr_factor``; the loop
        then re-saves that checkpoint with the new state. Raises the divergence error when no rollback is left."""
        st, rc = self.state, self.cfg
        if st.rollbacks >= rc.max_rollbacks:
            raise self._diverged(f"{reason}; recovery.max_rollbacks = {rc.max_rollbacks} reached", bad_from)
        path = self._last_good(bad_from)
        if path is None:
            raise self._diverged(reason, bad_from)
        assert self.checkpointer is not None
        self.checkpointer.load_weights(path)
        if not self.checkpointer.weights_finite():  # checkpoints written before this check existed
            raise UserError(
                f"cannot roll back at step {st.step}: {path} holds non-finite weights; resume from an "
                f"earlier checkpoint with a lower --learning_rate"
            )
        old = replace(st)
        self.checkpointer.load_state(path, st)
        skipped = old.step - st.step
        st.lr_scale = old.lr_scale * rc.rollback_lr_factor
        st.rollbacks = old.rollbacks + 1
        st.data_steps_skipped = old.data_steps_skipped + skipped
        st.phase = old.phase  # (the loader stays where it is: so does the phase of its last batch)
        st.bad_steps = 0
        self._streak_start = 0
        self._streak_kinds = set()
        self.arm_spike_gate()
        self._report_rollback(reason, path, old, skipped)
        return Rollback(path, self.checkpointer.val_loss_of(path))

    def _report_rollback(self, reason: str, path: Path, old: TrainState, skipped: int) -> None:
        new, batches = self.state, skipped * self.grad_accum
        log_line(
            f"step {old.step}: {reason}; rolled back to {path.name}, skipping the {batches} batch"
            f"{'' if batches == 1 else 'es'} of steps {new.step + 1}-{old.step}, learning rate "
            f"x{new.lr_scale:g} (rollback {new.rollbacks} of at most {self.cfg.max_rollbacks})",
            self.dist,
        )
        if self.dist.is_main:
            self.metrics.rewind(new.step)
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
