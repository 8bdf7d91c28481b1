"""What the run measures of the model while it trains: the validation loss (and the best so far, for early stopping
and the best checkpoint), samples of the ``eval.sample_prompts``, and the scores of ``eval.eval_tasks``. Samples and
task scores are optional parts of a run: a failure in them is one warning and the run goes on without them."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gptoughts.config import EvalConfig
from gptoughts.errors import UserError, first_line
from gptoughts.parallel import dist as pdist
from gptoughts.training.dpo import pair_metrics
from gptoughts.training.metrics import MetricsLogger
from gptoughts.training.state import Batch, TrainState, autocast, log_line, rng_state, set_rng_state


class Evaluator:
    """Evaluation of ``model`` as ``cfg`` says, over ``state`` (the loop's own object).

    ``batches``: the fixed validation windows (None: no held-out text, no evaluation); ``objective`` computes their
    (loss sum, token count); ``sampler``: prompt -> text (None: no samples); ``tasks``: a bound
    ``tools.task_scorer.TaskScorer`` (None: no task scores); ``pipeline``: a ``parallel.pp.Pipeline`` whose stages
    evaluate the loss. ``plots`` (a ``plots.PlotWriter``, rank 0) redraws after each evaluation and scoring."""

    def __init__(
        self,
        state: TrainState,
        cfg: EvalConfig,
        *,
        model: nn.Module,
        objective: Callable[[nn.Module, Batch], tuple[torch.Tensor, torch.Tensor]],
        batches: Callable[[], Iterator[Batch]] | None,
        metrics: MetricsLogger,
        run_dir: Path,
        dist: pdist.DistInfo,
        device: torch.device,
        precision: str,
        forward_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        pipeline: Any = None,
        sampler: Callable[[str], str] | None = None,
        tasks: Any = None,
        plots: Any = None,
    ):
        if tasks is not None and pipeline is not None:
            raise UserError("eval.eval_tasks does not run under pipeline parallelism; drop --eval_tasks")
        self.state = state
        self.cfg = cfg
        self.model = model
        self.objective = objective
        self.batches = batches
        self.metrics = metrics
        self.run_dir = run_dir
        self.dist = dist
        self.device = device
        self.precision = precision
        self.forward_context = forward_context
        self.pipeline = pipeline
        self.sampler = sampler
        self.tasks = tasks
        self.plots = plots
        # Samples follow the evaluations (eval_interval 0: the one at the end) unless sample_interval sets their own
        # interval; sample_interval 0 turns them off.
        self.sample_every = cfg.eval_interval if cfg.sample_interval is None else cfg.sample_interval
        self.samples_on = cfg.sample_interval != 0
        self.tasks_every = cfg.eval_interval if cfg.eval_tasks_interval is None else cfg.eval_tasks_interval
        self.task_scores: dict[str, dict[str, float]] = {}
        """The last scores of ``tasks`` (``{task: {"examples": n, metric: value}}``), for the run's summary."""
        self.last_pair_metrics: dict[str, float] = {}
        """Preference tuning: the last evaluation's ``val_dpo/accuracy`` and ``val_dpo/reward_margin``."""
        self.last_samples: tuple[int, list[str]] | None = None
        """(step, one text per ``sample_prompts``) of the last samples generated, for the run's summary."""

    def _autocast(self) -> contextlib.AbstractContextManager:
        return autocast(self.device, self.precision, self.forward_context)

    def due(self, step: int, at_end: bool) -> tuple[bool, bool, bool]:
        """Whether an evaluation, samples and task scores are due after ``step`` (``at_end``: the run's last)."""
        ev = self.cfg
        # No held-out data, no evaluation (never a nan val loss in the log)
        evaluate = self.batches is not None and (
            bool(ev.eval_interval and step % ev.eval_interval == 0) or at_end
        )
        sample = (
            self.sampler is not None
            and self.samples_on
            and (bool(self.sample_every and step % self.sample_every == 0) or at_end)
        )
        tasks = self.tasks is not None and (bool(self.tasks_every and step % self.tasks_every == 0) or at_end)
        return evaluate, sample, tasks

    # ------------------------------------------------------------------------------------- validation loss
    @torch.no_grad()
    def evaluate(self) -> tuple[float, float]:
        """(val loss, perplexity) over the fixed validation windows, sharded across ranks."""
        if self.batches is None:
            return math.nan, math.nan
        self.model.eval()
        total = torch.zeros((), device=self.device, dtype=torch.float64)
        count = torch.zeros((), device=self.device, dtype=torch.float64)
        model = pdist.unwrap(self.model) if self.dist.enabled else self.model  # no DDP hooks during eval

        def loss_of(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
            with self._autocast():
                if self.pipeline is not None:  # (0, 0) on ranks without the last stage
                    return self.pipeline.eval_loss(batch)
                return self.objective(model, batch)

        # Split by data-parallel rank: the ranks of a tensor-parallel group or of one pipeline evaluate the same
        # batches together.
        world, rank = self.dist.dp_size, self.dist.dp_rank
        n_batches, batch = 0, None
        for i, batch in enumerate(self.batches()):
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
        self.last_pair_metrics = pair_metrics(self.objective, False, self.dist, "val_dpo/")
        pdist.all_reduce_loss(total, self.dist)
        pdist.all_reduce_loss(count, self.dist)
        loss = (total / count.clamp_min(1)).item()
        return loss, math.exp(min(loss, 50.0))

    def evaluate_and_track(self) -> tuple[float, bool]:
        """Evaluate, log it, and track the best loss: (val loss, whether it is the best so far).

        The best is the lowest val loss (best.json, the "(best)" marks, the summary); ``early_stopping_min_delta``
        only decides which evaluations reset early stopping's patience."""
        st = self.state
        val_loss, ppl = self.evaluate()
        # Weights inside a streak of bad steps are never the best (a collapsed model's first evaluation would be).
        counts = math.isfinite(val_loss) and not st.bad_steps
        best = counts and val_loss < st.best_val_loss
        improved = counts and val_loss < self._patience_reference() - self.cfg.early_stopping_min_delta
        if best:
            st.best_val_loss = val_loss
        if improved:
            st.evals_without_improvement = 0
        elif math.isfinite(val_loss):
            st.evals_without_improvement += 1
        entry = {"step": st.step, "val_loss": val_loss, "val_ppl": ppl}
        if not counts and math.isfinite(val_loss):
            # never the best: no checkpoint is written inside a streak (best_evaluation)
            entry["in_streak"] = True
        st.history.append(entry)
        if self.dist.is_main:
            pairs = self.last_pair_metrics
            self.metrics.log(st.step, {"val_loss": val_loss, "val_ppl": ppl, **pairs})
            log_line(
                f"step {st.step}: val loss {val_loss:.4f}, "
                + (
                    f"preference accuracy {pairs['val_dpo/accuracy']:.3f}, reward margin "
                    f"{pairs['val_dpo/reward_margin']:.3f}"
                    if pairs
                    else f"perplexity {ppl:.2f}"
                )
                + (" (best)" if best else ""),
                self.dist,
            )
            if self.plots is not None:
                self.plots.request()
        return val_loss, best

    def _patience_reference(self) -> float:
        return patience_reference(self.state.history, self.state.evals_without_improvement)

    def patience_exhausted(self) -> bool:
        """Whether early stopping ends the run (every rank decides it alike, from the all-reduced val loss)."""
        patience = self.cfg.early_stopping_patience
        return patience is not None and self.state.evals_without_improvement >= patience

    # ------------------------------------------------------------------------------- samples, task scores
    def _or_warn(self, what: str, action: Callable[[], Any], lost: str, later: str) -> bool:
        """Run an optional part of the run (samples, task scores): a failure is one warning line and the run goes on
        without it, since it must not cost the run. False on a failure."""
        try:
            action()
            return True
        except Exception as e:  # noqa: BLE001 - said in one line; the run continues
            self.model.train()
            log_line(
                f"warning: step {self.state.step}: {what} failed ({first_line(e)}); the run goes on without {lost} "
                f"({later} afterwards)",
                self.dist,
            )
            return False

    def sample_or_drop_it(self) -> None:
        """Write the samples, or stop sampling on a failure (memory, a sampler bug). Under FSDP every rank generates
        the same tokens, so a failure is every rank's alike."""
        if not self._or_warn("sampling", self._sample, "samples", "gptoughts sample RUN"):
            self.sampler = None

    def _sample(self) -> None:
        # Under FSDP or TP every rank generates (each forward is a collective), the same tokens (same logits, same
        # seeded generator); rank 0 writes.
        if self.sampler is None or not (self.dist.is_main or self.dist.sharded):
            return
        self.model.eval()
        texts = []
        for prompt in self.cfg.sample_prompts:
            with self._autocast():
                texts.append(self.sampler(prompt))
        self.model.train()
        step = self.state.step
        self.last_samples = (step, texts)
        if not self.dist.is_main:
            return
        with open(self.run_dir / "samples.txt", "a", encoding="utf-8") as f:
            f.write(f"=== step {step}\n")
            for prompt, text in zip(self.cfg.sample_prompts, texts):
                f.write(f"--- prompt: {prompt!r}\n{text}\n")
        for i, text in enumerate(texts):
            self.metrics.text(f"samples/{i}", text, step)

    @torch.no_grad()
    def score_tasks_or_drop_them(self, stop: Callable[[], bool]) -> None:
        """Score the tasks, or drop them on a failure the checks before the run could not see (a harness metric's
        options, memory). ``_score_tasks`` tells every rank about any rank's failure, so all drop them alike.
        ``stop``: whether a stop was asked for (Ctrl-C, a scheduler's SIGTERM)."""
        if not self._or_warn(
            "scoring eval_tasks", lambda: self._score_tasks(stop), "them", "gptoughts eval RUN --tasks ..."
        ):
            self.tasks = None

    def _score_tasks(self, stop: Callable[[], bool]) -> None:
        """Score ``eval.eval_tasks`` with the live model; log ``tasks/NAME/METRIC`` rows and a console line.

        Under FSDP or TP every forward is a collective, and the number of forwards depends on the examples (their
        choices, batches, and for generation tasks the generated lengths): every rank scores every example, with
        the same inputs, so all run the same forwards. Replicas (DDP, or one process) split each task's examples
        by data-parallel rank on the plain module (no DDP hooks) and combine the slices, weighted by their
        example counts. Scoring draws no training randomness, and the RNG state is restored around it anyway:
        a resumed run continues bit for bit as one that never stopped."""
        assert self.tasks is not None
        d = self.dist
        shard = (0, 1) if d.sharded else (d.dp_rank, d.dp_size)
        model = pdist.unwrap(self.model) if d.enabled else self.model
        rng = rng_state(self.device)
        self.model.eval()
        error = None
        try:
            with self._autocast():
                # A stop asked for ends the scoring at the next batch, where the forwards are not collectives (one
                # process, DDP replicas): the run saves and exits in time.
                local = self.tasks(model, shard=shard, stop=None if d.sharded else stop)
        except Exception as e:  # noqa: BLE001 - told to every rank below, before the next collective
            local, error = {}, first_line(e)
        finally:
            self.model.train()
            set_rng_state(rng, self.device)
        # Every rank learns whether any rank failed, so all drop the tasks alike (a rank that went on to the next
        # step's collectives alone would hang the run). A failure inside a sharded forward cannot be rescued:
        # the other ranks wait in that forward's collective.
        parts = pdist.all_gather_object({"scores": local, "error": error}, d)
        errors = [p["error"] for p in parts if p["error"]]  # type: ignore[index]
        if errors:
            raise RuntimeError(errors[0])
        if any(p["scores"] is None for p in parts):  # type: ignore[index]
            log_line(f"step {self.state.step}: task scoring stopped (a stop was asked for); not logged", d)
            return
        scored = [p["scores"] for p in parts] if shard[1] > 1 else [local]  # type: ignore[index]
        self.task_scores = combine_task_scores(scored)  # type: ignore[arg-type]
        if d.is_main:
            self._log_task_scores()

    def _log_task_scores(self) -> None:
        step, results = self.state.step, self.task_scores
        row = {f"tasks/{name}/{k}": v for name, r in results.items() for k, v in r.items() if k != "examples"}
        self.metrics.log(step, row)
        log_line(
            f"step {step}: tasks "
            + "; ".join(
                f"{name} "
                + " ".join(f"{k} {v:.4f}" for k, v in r.items() if k != "examples")
                + f" ({int(r['examples'])} examples)"
                for name, r in results.items()
            ),
            self.dist,
        )
        if self.plots is not None:
            self.plots.request()


def best_evaluation(history: list[dict[str, float]]) -> tuple[float, int] | None:
    """(val loss, step) of the best evaluation of ``history``, the one ``best.json`` names: the lowest finite val
    loss, first reached, of weights outside a streak of bad steps (those have no checkpoint); None before any."""
    counted = [
        (h["val_loss"], int(h["step"]))
        for h in history
        if math.isfinite(h["val_loss"]) and not h.get("in_streak")
    ]
    return min(counted) if counted else None


def patience_reference(history: list[dict[str, float]], evals_without_improvement: int) -> float:
    """The val loss of the last evaluation that reset early stopping's patience (inf before any): an evaluation
    improves when it is lower than this by more than ``early_stopping_min_delta``. Each finite evaluation since then
    added one to ``evals_without_improvement``, so it is the finite one that many before the last: derived from the
    history every checkpoint keeps, it comes back with a resumed or rolled-back run, older checkpoints included (and
    the plan of a resume reads it from there: :func:`early_stopping_line`)."""
    finite = [h["val_loss"] for h in history if math.isfinite(h["val_loss"])]
    n = evals_without_improvement
    return finite[-n - 1] if n < len(finite) else math.inf


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


def early_stopping_line(
    cfg: Any, batch: Any, corpus: dict[str, Any], resume_from: Path | None, start: int
) -> str:
    """The plan's line of what early stopping does in a resumed run whose checkpoint already counts evaluations without improvement
    (``eval.early_stopping_patience`` as this run sets it): the count and the val loss to beat come back with the
    checkpoint (:func:`patience_reference`), so a run that early stopping ended stops again at its next
    evaluation that does not improve, whatever its new --max_steps. Said with the way to train on. "": a new run,
    early stopping off, nothing counted, or a checkpoint whose state cannot be read here."""
    patience = cfg.eval.early_stopping_patience
    if not start or patience is None or resume_from is None or start >= batch.total_steps:
        return ""
    from gptoughts.training.checkpoint.restore import peek_state

    saved = (peek_state(resume_from) or {}).get("trainer")
    try:
        count = int(saved["evals_without_improvement"])  # type: ignore[index]
        history = [h for h in saved["history"] if math.isfinite(float(h["val_loss"]))]  # type: ignore[index]
    except (TypeError, KeyError, ValueError):
        return ""
    if count <= 0 and patience > 0:
        return ""
    delta = cfg.eval.early_stopping_min_delta
    ref = patience_reference(history, count)
    by = f" by more than min_delta {delta:g}" if delta else ""
    if math.isfinite(ref):  # (the evaluation that last reset the count: the one `count` before the last)
        beat = f"val loss below {ref - delta:.4f}"
        at = int(history[-count - 1]["step"])
        since = f"{count} evaluation(s) without improving{by} on val loss {ref:.4f} of step {at:,}"
    else:
        beat, since = "a finite val loss", f"{count} evaluation(s) without improvement"
    if not _evaluates(batch, corpus):
        return (
            f"{since}, carried over from the checkpoint; this run has no evaluation (no held-out data): early "
            "stopping cannot end it"
        )
    every = batch.eval_interval
    nxt = min(batch.total_steps, (start // every + 1) * every) if every else batch.total_steps
    nxt_s = f"step {nxt:,}" + (", the run's last" if nxt == batch.total_steps else "")
    if patience == 0:
        return (
            f"--early_stopping_patience 0 ends the run at its first evaluation ({nxt_s}), improved or not; "
            "--early_stopping_patience none turns early stopping off"
        )
    if count < patience:
        more = patience - count
        return (
            f"{count} of its patience of {patience} used by step {start:,} ({since}; carried over from the "
            f"checkpoint): {more} more evaluation(s) in a row without {beat} end the run (the next at {nxt_s}); "
            "one below resets the count"
        )
    ended = _ended_by_early_stopping(resume_from, start)
    return (
        f"its patience of {patience} was used up at step {start:,}"
        + (" (early stopping ended the run there)" if ended else "")
        + f": {since}. The count carries over from the checkpoint, so the run stops at its next evaluation "
        f"({nxt_s}) unless that brings {beat}. To train on: --early_stopping_patience none turns it off, or "
        f"--early_stopping_patience {count + patience} ends the run after {patience} more evaluation(s) without "
        "improvement"
    )


def _evaluates(batch: Any, corpus: dict[str, Any]) -> bool:
    """Whether the run evaluates at all: held-out windows, pairs or examples (as the steps line says)."""
    return batch.eval_block != 0 and corpus.get("val_pairs") != 0 and corpus.get("val_examples") != 0


def _ended_by_early_stopping(resume_from: Path, step: int) -> bool:
    """Whether the summary of the run the checkpoint sits in says early stopping ended it at ``step``."""
    from gptoughts.data.sources import read_json_dict
    from gptoughts.training.checkpoint.store import run_of

    home = run_of(Path(resume_from))
    summary = (read_json_dict(home / "summary.json") if home else None) or {}
    return summary.get("stop_reason") == "early stopping" and summary.get("steps") == step
