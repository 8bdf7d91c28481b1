"""A curriculum (``data.phases``) as a run plans it: the step at which each phase's first batch is drawn.

The loader (``data/loader.py``) draws each batch from the phase its first token falls in: phase k holds the tokens
from the sum of the earlier phases' budgets to that sum plus its own (the last phase goes on to the end). A phase
therefore begins at the first batch whose first token is at or past its start; a phase shorter than a batch can
fall between two batches and never be drawn. The plan prints these steps, the trainer announces each phase as its
first batch is drawn, and both follow this rule.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def phase_schedule(
    phases: Sequence[Any],
    *,
    tokens_per_step: int,
    grad_accum: int,
    resumed_at: tuple[int, int] | None = None,
) -> list[dict[str, Any]]:
    """One entry per phase (``phases``: objects with ``name`` and ``tokens``, as ``data.phases``):

    ``name``; ``tokens`` (its budget; None for the last phase, which goes on to the end); ``start`` (the run's tokens
    before it); ``step`` (the step holding its first batch; None where it began before a resume at another batch
    size, whose steps were of that batch); ``skipped`` (no batch starts inside it: never drawn); ``done`` (it ended
    before such a resume; with ``step`` None and not ``done``, the resume is inside it).

    A batch here is what the loader draws at once, one micro-batch of every data-parallel rank: ``tokens_per_step /
    grad_accum`` tokens. ``resumed_at``: the step and tokens seen of the checkpoint a run resumes (positions after
    it advance at this batch; an unchanged batch is the same geometry from the run's start)."""
    batch = max(1, tokens_per_step // max(1, grad_accum))
    step0, seen0 = resumed_at or (0, 0)
    if seen0 == step0 * tokens_per_step:  # the same batch throughout: every step counted from the start
        step0, seen0 = 0, 0
    out: list[dict[str, Any]] = []
    start = 0
    for k, ph in enumerate(phases):
        last = k == len(phases) - 1
        budget = None if last or ph.tokens is None else int(ph.tokens)
        end = math.inf if budget is None else start + budget
        done = False
        if start < seen0:  # under way at the resume, or done before it
            step, skipped, done = None, False, end <= seen0
        else:
            m = -(-(start - seen0) // batch)  # batches after the resume point before the phase's first one
            step = step0 + m // max(1, grad_accum) + 1
            skipped = seen0 + m * batch >= end
        out.append(
            {
                "name": ph.name,
                "tokens": budget,
                "start": start,
                "step": step,
                "skipped": skipped,
                "done": done,
            }
        )
        if budget is not None:
            start += budget
    return out


def phase_index(phases: Sequence[dict[str, Any]], consumed: int) -> int:
    """The position in ``phases`` (:func:`phase_schedule`'s) of the phase the batch drawn after ``consumed`` tokens
    (all ranks) comes from: the last one starting at or before it."""
    return max(0, sum(p["start"] <= consumed for p in phases) - 1)


def begins_now(phases: Sequence[dict[str, Any]], consumed: int, batch_tokens: int) -> bool:
    """Whether the batch about to be drawn, after ``consumed`` tokens (all ranks), is the first of its phase: the
    batch before it started before the phase (``phases``: :func:`phase_schedule`'s; ``batch_tokens``: a batch's
    tokens, all ranks). A run resumed at another batch size is judged at this one."""
    return consumed == 0 or consumed - batch_tokens < phases[phase_index(phases, consumed)]["start"]
