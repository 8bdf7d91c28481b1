"""Multiple-choice tasks from JSONL files, scored by log-likelihood (``gptoughts eval RUN --tasks FILE.jsonl``).

Each line of a task file is ``{"context": str, "choices": [str, ...], "answer": int}``. Every choice is scored by
the summed log-probability of its tokens given the context, as lm-evaluation-harness does for its
``loglikelihood`` tasks: ``acc`` picks the highest sum, ``acc_norm`` the highest sum per character of the
choice. The choice is appended to the context exactly as written (put the space in it: ``" paris"``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gptoughts.errors import DataError, UserError

FORMAT = 'one JSON object per line: {"context": "...", "choices": ["...", "..."], "answer": 0}'


@dataclass(frozen=True)
class Example:
    context: str
    choices: tuple[str, ...]
    answer: int


@dataclass(frozen=True)
class Task:
    name: str
    path: Path
    examples: tuple[Example, ...]


def _example(obj: Any, where: str) -> Example:
    if not isinstance(obj, dict):
        raise DataError(f"{where} is not a JSON object; write {FORMAT}")
    for key in ("context", "choices", "answer"):
        if key not in obj:
            raise DataError(f"{where} has no {key!r} key; write {FORMAT}")
    context, choices, answer = obj["context"], obj["choices"], obj["answer"]
    if not isinstance(context, str):
        raise DataError(f"{where}: 'context' must be a string; write {FORMAT}")
    if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
        raise DataError(f"{where}: 'choices' must be a list of strings; write {FORMAT}")
    if len(choices) < 2:
        raise DataError(f"{where} has {len(choices)} choice(s); give at least 2")
    if any(c == "" for c in choices):
        raise DataError(f"{where} has an empty choice; every choice needs at least one character")
    if isinstance(answer, bool) or not isinstance(answer, int):
        raise DataError(f"{where}: 'answer' must be an integer index into 'choices'")
    if not 0 <= answer < len(choices):
        raise DataError(
            f"{where}: answer {answer} is out of range for {len(choices)} choices; use an index from 0 to "
            f"{len(choices) - 1}"
        )
    return Example(context, tuple(choices), answer)


def read_task(path: str | Path) -> Task:
    """The examples of one task file, validated line by line (blank lines are skipped); a ``DataError`` naming
    the file, the line and the fix otherwise."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"task file {p} does not exist; pass a .jsonl file with {FORMAT}")
    examples = []
    with p.open(encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{p} line {n}"
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise DataError(
                    f"{where} is not JSON ({str(e).splitlines()[0][:80]}); write {FORMAT}"
                ) from None
            examples.append(_example(obj, where))
    if not examples:
        raise DataError(f"task file {p} has no examples; write {FORMAT}")
    return Task(p.stem, p, tuple(examples))


def read_tasks(paths: list[str]) -> list[Task]:
    """All task files, validated before any model is loaded; names are the file stems (the path if two
    files share a stem)."""
    tasks = [read_task(p) for p in paths]
    stems = [t.name for t in tasks]
    return [Task(str(t.path), t.path, t.examples) if stems.count(t.name) > 1 else t for t in tasks]


def _encode_pair(tokenizer: Any, context: str, choice: str) -> tuple[list[int], list[int]]:
    """(context tokens, choice tokens) as the harness splits them: the choice's tokens are those of
    ``context + choice`` past the context's own, so a merge across the boundary is not invented; trailing spaces
    of the context move to the choice first (BPE tokenizers attach a space to the word after it)."""
    stripped = context.rstrip(" ")
    choice = context[len(stripped) :] + choice
    ctx = tokenizer.encode(stripped)
    whole = tokenizer.encode(stripped + choice)
    if whole[: len(ctx)] != ctx:  # the boundary merged: fall back to the two parts on their own
        return ctx, tokenizer.encode(choice)
    return ctx, whole[len(ctx) :]


@torch.no_grad()
def loglikelihoods(
    model: nn.Module,
    tokenizer: Any,
    pairs: list[tuple[str, str]],
    *,
    batch_size: int = 8,
    max_len: int | None = None,
    with_greedy: bool = False,
) -> list[float] | list[tuple[float, bool]]:
    """Summed log-probability of each ``choice`` given its ``context``, in ``pairs`` order; with
    ``with_greedy``, ``(log-probability, whether greedy decoding would produce exactly the choice's tokens)``
    pairs, as lm-evaluation-harness's ``loglikelihood`` returns.

    A sequence ``context + choice`` is fed without its last token; the logits at position ``t`` predict token
    ``t + 1``, so the choice's ``k`` tokens are scored by the last ``k`` positions. An empty context starts from
    the eos token (the document separator the model saw in training). A sequence longer than ``max_len + 1``
    keeps its last tokens (the choice, and as much context as fits)."""
    dev = next(model.parameters()).device
    seqs: list[tuple[list[int], int]] = []
    for context, choice in pairs:
        ctx, cont = _encode_pair(tokenizer, context, choice)
        if not ctx:
            ctx = [tokenizer.eos_id]
        whole = ctx + cont
        if max_len is not None:
            whole = whole[-(max_len + 1) :]
        seqs.append((whole, min(len(cont), len(whole) - 1)))
    # Longest first: the batches hold sequences of similar lengths, so little padding is computed.
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i][0]))
    out: list = [0.0] * len(seqs)
    for b in range(0, len(order), batch_size):
        idx = order[b : b + batch_size]
        width = max(len(seqs[i][0]) for i in idx) - 1
        # Right padding: with a causal mask, the pad after a sequence changes none of its logits.
        x = torch.full((len(idx), width), tokenizer.eos_id, dtype=torch.long)
        for r, i in enumerate(idx):
            toks = seqs[i][0][:-1]
            x[r, : len(toks)] = torch.tensor(toks)
        logits = model(x.to(dev)).float()
        for r, i in enumerate(idx):
            toks, k = seqs[i]
            n = len(toks) - 1  # input length
            pos = torch.arange(n - k, n, device=dev)
            target = torch.tensor(toks[n + 1 - k :], device=dev)
            logp_all = torch.log_softmax(logits[r, pos], dim=-1)
            logp = float(logp_all.gather(-1, target[:, None]).sum())  # one host sync per sequence
            out[i] = (logp, bool((logp_all.argmax(-1) == target).all())) if with_greedy else logp
    return out


def score_task(
    model: nn.Module, tokenizer: Any, task: Task, *, batch_size: int = 8, max_len: int | None = None
) -> dict[str, Any]:
    """``acc`` and ``acc_norm`` of one task (ties go to the first choice, as ``argmax`` does)."""
    pairs = [(ex.context, c) for ex in task.examples for c in ex.choices]
    lls = loglikelihoods(model, tokenizer, pairs, batch_size=batch_size, max_len=max_len)
    hits = hits_norm = 0
    at = 0
    for ex in task.examples:
        scores = lls[at : at + len(ex.choices)]
        at += len(ex.choices)
        norm = [s / len(c) for s, c in zip(scores, ex.choices, strict=True)]
        hits += max(range(len(scores)), key=scores.__getitem__) == ex.answer
        hits_norm += max(range(len(norm)), key=norm.__getitem__) == ex.answer
    n = len(task.examples)
    return {"file": str(task.path), "examples": n, "acc": hits / n, "acc_norm": hits_norm / n}


def evaluate_tasks(loaded: Any, tasks: list[Task], *, batch_size: int = 8) -> dict[str, dict[str, Any]]:
    """Scores of each task (by name) for a model from ``gptoughts.api.load``; causal families only."""
    from gptoughts import models

    if models.family_of(loaded.family).objective == "diffusion":
        raise UserError(
            f"--tasks scores causal models only; {loaded.family} (masked diffusion) is not supported yet"
        )
    max_len = getattr(loaded.args, "max_seq_len", None)
    model = loaded.model.eval()
    return {
        t.name: score_task(model, loaded.tokenizer, t, batch_size=batch_size, max_len=max_len) for t in tasks
    }


def format_table(results: dict[str, dict[str, Any]]) -> str:
    """The results as an aligned text table: task, examples, acc, acc_norm."""
    w = max([4, *(len(k) for k in results)])
    lines = [f"{'task':<{w}}  {'examples':>8}  {'acc':>6}  {'acc_norm':>8}"]
    for name, r in results.items():
        lines.append(f"{name:<{w}}  {r['examples']:>8}  {r['acc']:>6.4f}  {r['acc_norm']:>8.4f}")
    return "\n".join(lines)
