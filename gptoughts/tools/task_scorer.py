"""The tasks of ``eval.eval_tasks`` as the object the trainer scores its live model with (``gptoughts train
--eval_tasks FILE.jsonl``).

The files are read and checked by :func:`read_scorer` before the run builds or writes anything; the trainer
receives the :class:`TaskScorer` (it never imports this layer) and decides when to call it, in which mode, on
which slice of the examples, and how the slices of several ranks add up (``train/trainer.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from gptoughts.tools.tasks import Task, read_tasks, score_task


@dataclass(frozen=True)
class TaskScorer:
    tasks: tuple[Task, ...]
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
        return [t.name for t in self.tasks]

    @property
    def examples(self) -> list[int]:
        return [len(t.examples) for t in self.tasks]

    def bind(
        self, tokenizer: Any, *, max_len: int | None, batch_size: int, diffusion: bool = False
    ) -> TaskScorer:
        mask_id = getattr(tokenizer, "mask_id", None) if diffusion else None
        return replace(
            self,
            tokenizer=tokenizer,
            max_len=max_len,
            batch_size=max(1, batch_size),
            diffusion=diffusion,
            mask_id=mask_id,
        )

    def __call__(self, model: nn.Module, *, shard: tuple[int, int] = (0, 1)) -> dict[str, dict[str, float]]:
        """``{task: {"examples": n, metric: value, ...}}`` over the examples ``shard[0]::shard[1]`` of each task
        (``{"examples": 0}`` for a slice with none); every numeric value ``score_task`` returns is kept. The
        caller sets eval mode, ``no_grad`` and autocast; compiled blocks run eagerly here (the inputs' lengths
        vary: compiled graphs would recompile for each)."""
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
                )
                out[task.name] = {
                    k: float(v)
                    for k, v in scores.items()
                    if isinstance(v, (int, float)) and not isinstance(v, bool)
                }
                out[task.name]["examples"] = len(part.examples)
        return out


def read_scorer(paths: list[str]) -> TaskScorer | None:
    """The tasks of ``paths``, every file read and checked line by line (a one-line ``DataError`` naming the file,
    the line and the fix otherwise); None for no paths."""
    return TaskScorer(tuple(read_tasks(list(paths)))) if paths else None
