"""The tasks of ``eval.eval_tasks`` as the object the trainer scores its live model with (``gptoughts train
--eval_tasks FILE.jsonl``).

The files are read and checked by :func:`read_scorer` before the run builds or writes anything; the trainer
receives the :class:`TaskScorer` (it never imports this layer) and decides when to call it, in which mode, on
which slice of the examples, and how the slices of several ranks add up (``training/evaluation.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from gptoughts.tools.tasks import Interrupted, Task, read_tasks, score_task, stop_when


@dataclass(frozen=True)
class TaskScorer:
    tasks: tuple[Task, ...]
    harness: Any = None
    """``tools.harness.Harness`` of the lm-evaluation-harness names in ``eval_tasks`` (their data loaded)."""
    family: str = "llama"
    """The run's model family (the harness adapter scores masked-diffusion families their way)."""
    tokenizer: Any = None
    """Set by the assembly (:meth:`bind`) once the run's tokenizer exists."""
    max_len: int | None = None
    """Longest input scored (the run's block size): longer sequences keep their last tokens."""
    batch_size: int = 8
    """Sequences per forward."""
    diffusion: bool = False
    """A masked-diffusion model (LLaDA): Monte-Carlo likelihoods and the denoising sampler."""
    mask_id: int | None = None
    """Its mask token (the tokenizer's)."""

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tasks] + (list(self.harness.names) if self.harness else [])

    @property
    def examples(self) -> list[int]:
        harness = [self.harness.examples(n) for n in self.harness.names] if self.harness else []
        return [len(t.examples) for t in self.tasks] + harness

    def bind(
        self,
        tokenizer: Any,
        *,
        max_len: int | None,
        batch_size: int,
        diffusion: bool = False,
        family: str = "llama",
    ) -> TaskScorer:
        mask_id = getattr(tokenizer, "mask_id", None) if diffusion else None  # checked when scored (tasks)
        return replace(
            self,
            tokenizer=tokenizer,
            max_len=max_len,
            batch_size=max(1, batch_size),
            diffusion=diffusion,
            mask_id=mask_id,
            family=family,
        )

    def __call__(
        self,
        model: nn.Module,
        *,
        shard: tuple[int, int] = (0, 1),
        stop: Callable[[], bool] | None = None,
    ) -> dict[str, dict[str, float]] | None:
        """``{task: {"examples": n, metric: value, ...}}`` over the examples ``shard[0]::shard[1]`` of each task
        (``{"examples": 0}`` for a slice with none); every numeric value ``score_task`` returns is kept. The
        caller sets eval mode, ``no_grad`` and autocast; compiled blocks run eagerly here (the inputs' lengths
        vary: compiled graphs would recompile for each). ``stop``: checked between batches; None is returned
        when it said stop (``tasks.stop_when``: not for a sharded model, whose forwards are collectives)."""
        try:
            with stop_when(stop):
                return self._score(model, shard)
        except Interrupted:
            return None

    def _score(self, model: nn.Module, shard: tuple[int, int]) -> dict[str, dict[str, float]]:
        from gptoughts.sampling import eager

        rank, world = shard
        out: dict[str, dict[str, float]] = {}
        with eager(model):
            for task in self.tasks:
                part = task if world == 1 else replace(task, examples=task.examples[rank::world])
                if not part.examples:
                    out[task.name] = {"examples": 0}
                    continue
                scores = score_task(
                    model,
                    self.tokenizer,
                    part,
                    batch_size=self.batch_size,
                    max_len=self.max_len,
                    diffusion=self.diffusion,
                    mask_id=self.mask_id,
                    # generation tasks: at most half the run's window, so a prompt always has room
                    max_new_tokens=min(64, max(1, (self.max_len or 128) // 2)),
                )
                out[task.name] = {**_numbers(scores), "examples": len(part.examples)}
            if self.harness is not None:
                out.update(self._harness(model, scores_here=rank == 0))
        return out

    def _harness(self, model: nn.Module, *, scores_here: bool) -> dict[str, dict[str, float]]:
        """The harness tasks, whole, on every rank: a sharded model's ranks must run the same forwards, and the
        replicas of data parallelism score them too rather than wait for rank 0 in a collective that a long
        harness task could time out (the same wall time). Only rank 0's scores count (``scores_here``): the
        others report none, and the slices combine to rank 0's."""
        from types import SimpleNamespace

        loaded = SimpleNamespace(
            model=model,
            tokenizer=self.tokenizer,
            family=self.family,
            args=SimpleNamespace(max_seq_len=self.max_len),
        )
        rows = self.harness.evaluate(loaded, batch_size=self.batch_size, asked_only=True)
        if not scores_here:
            return {name: {"examples": 0} for name in self.harness.names}
        return {name: _numbers(r) for name, r in rows.items()}


def _numbers(scores: dict[str, Any]) -> dict[str, float]:
    """The numeric entries of a task's scores (not its file path), as floats for the metrics rows."""
    return {k: float(v) for k, v in scores.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def read_scorer(
    specs: list[str], *, task_dir: str | None = None, limit: int | None = None
) -> TaskScorer | None:
    """The tasks of ``specs`` (None for none): task files read and checked line by line (a one-line ``DataError``
    naming the file, the line and the fix otherwise), lm-evaluation-harness names looked up (in ``task_dir`` too)
    and their data loaded offline (one line naming what is missing). ``limit``: the first N examples of each."""
    if not specs:
        return None
    from gptoughts.tools.harness import Harness, check_names, split_specs

    files, names = split_specs(list(specs))
    tasks = read_tasks(files)
    if limit is not None:
        tasks = [replace(t, examples=t.examples[:limit]) for t in tasks]
    check_names([t.name for t in tasks], names)
    harness = Harness(names, task_dir=task_dir, limit=limit, during_training=True) if names else None
    return TaskScorer(tuple(tasks), harness=harness)
