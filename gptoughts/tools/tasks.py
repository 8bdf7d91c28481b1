"""Evaluation tasks from JSONL files (``gptoughts eval RUN --tasks FILE.jsonl``): multiple choice, scored by
log-likelihood, and generation, scored by greedy decoding.

A file holds one kind of task (the first line decides; a line of the other kind is an error naming it):

* **multiple choice**, ``{"context": str, "choices": [str, ...], "answer": int}`` per line. Every choice is
  scored by the summed log-probability of its tokens given the context, as lm-evaluation-harness does for its
  ``loglikelihood`` tasks: ``acc`` picks the highest sum, ``acc_norm`` the highest sum per character of the
  choice. The choice is appended to the context exactly as written (put the space in it: ``" paris"``).
* **generation**, ``{"prompt": str, "expected": str, "until": [str, ...]}`` per line (``until`` optional,
  default ``["\\n"]``). The model continues the prompt greedily; the text is cut at the first stop string and
  ``exact_match`` counts the examples whose cut text equals ``expected``, both stripped of surrounding white
  space (the harness's ``generate_until`` and ``exact_match``).

Masked-diffusion models (LLaDA) have no exact likelihood and no left-to-right decoding: their choices are
scored by LLaDA's Monte-Carlo estimate of the likelihood bound, their generations by its denoising sampler.
"""

from __future__ import annotations

import contextlib
import json
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gptoughts.errors import DataError, UserError
from gptoughts.sampling import compute_device


class Interrupted(Exception):  # noqa: N818 - a stop asked for, not an error
    """Scoring stopped between two batches because :func:`stop_when`'s check said so (a run's Ctrl-C/SIGTERM)."""


_stop_check: Callable[[], bool] | None = None


@contextlib.contextmanager
def stop_when(check: Callable[[], bool] | None) -> Iterator[None]:
    """Within the block, the scoring loops call ``check`` between batches and raise :class:`Interrupted` when it
    is True: a run asked to stop (a scheduler's SIGTERM and its grace period) does not wait for a long task.
    Only for models whose forwards are not collectives (one process, DDP replicas): ranks of a sharded model
    would stop at different forwards."""
    global _stop_check
    previous, _stop_check = _stop_check, check
    try:
        yield
    finally:
        _stop_check = previous


def _check_stop() -> None:
    if _stop_check is not None and _stop_check():
        raise Interrupted


FORMAT = 'one JSON object per line: {"context": "...", "choices": ["...", "..."], "answer": 0}'
GEN_FORMAT = (
    'one JSON object per line: {"prompt": "...", "expected": "...", "until": ["\\n"]} (until optional)'
)
DEFAULT_UNTIL = ("\n",)
MC_SAMPLES = 32
"""Monte-Carlo draws per choice for masked-diffusion likelihoods (LLaDA's own evaluation uses 128: more draws,
less noise, proportionally more compute)."""
MC_SEED = 0


@dataclass(frozen=True)
class Example:
    """A multiple-choice question."""

    context: str
    choices: tuple[str, ...]
    answer: int


@dataclass(frozen=True)
class GenExample:
    """A prompt to continue and the answer expected before the first stop string."""

    prompt: str
    expected: str
    until: tuple[str, ...] = field(default=DEFAULT_UNTIL)


@dataclass(frozen=True)
class Task:
    name: str
    path: Path
    examples: tuple[Example, ...] | tuple[GenExample, ...]

    @property
    def kind(self) -> str:
        """``"choice"`` (multiple choice) or ``"generation"``; a file holds one kind only."""
        return "generation" if isinstance(self.examples[0], GenExample) else "choice"


_CHOICE_KEYS = ("context", "choices", "answer")
_GEN_KEYS = ("prompt", "expected", "until")


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


def _gen_example(obj: dict, where: str) -> GenExample:
    for key in ("prompt", "expected"):
        if key not in obj:
            raise DataError(f"{where} has no {key!r} key; write {GEN_FORMAT}")
    prompt, expected = obj["prompt"], obj["expected"]
    if not isinstance(prompt, str):
        raise DataError(f"{where}: 'prompt' must be a string; write {GEN_FORMAT}")
    if not isinstance(expected, str):
        raise DataError(f"{where}: 'expected' must be a string; write {GEN_FORMAT}")
    if not expected.strip():
        # Compared stripped, an empty answer would match any generation that stops at once: surely a mistake.
        raise DataError(f"{where}: 'expected' is empty; give the answer the model should generate")
    until = obj.get("until", list(DEFAULT_UNTIL))
    if not isinstance(until, list) or not until or not all(isinstance(s, str) for s in until):
        raise DataError(
            f"{where}: 'until' must be a non-empty list of stop strings, e.g. [\"\\n\"]; or leave it out "
            "(default: a newline)"
        )
    if any(s == "" for s in until):
        raise DataError(f"{where}: 'until' holds an empty string, which would cut every answer to nothing")
    return GenExample(prompt, expected, tuple(until))


def _parse(obj: Any, where: str) -> Example | GenExample:
    """One line of either kind: generation if it names ``prompt``/``expected``, multiple choice otherwise (whose
    validation then names the missing keys)."""
    if not isinstance(obj, dict):
        raise DataError(f"{where} is not a JSON object; write {FORMAT}, or {GEN_FORMAT}")
    choice_keys = [k for k in _CHOICE_KEYS if k in obj]
    gen_keys = [k for k in _GEN_KEYS if k in obj]
    if choice_keys and gen_keys:
        raise DataError(
            f"{where} mixes multiple-choice keys ({', '.join(choice_keys)}) with generation keys "
            f"({', '.join(gen_keys)}); write either {FORMAT}, or {GEN_FORMAT}"
        )
    return _gen_example(obj, where) if gen_keys else _example(obj, where)


def read_task(path: str | Path) -> Task:
    """The examples of one task file, validated line by line (blank lines are skipped); a ``DataError`` naming
    the file, the line and the fix otherwise. The first example decides the file's kind."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"task file {p} does not exist; pass a .jsonl file with {FORMAT}, or {GEN_FORMAT}")
    examples: list = []
    first = 0
    with p.open(encoding="utf-8-sig", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{p} line {n}"
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise DataError(
                    f"{where} is not JSON ({str(e).splitlines()[0][:80]}); write {FORMAT}, or {GEN_FORMAT}"
                ) from None
            ex = _parse(obj, where)
            if examples and type(ex) is not type(examples[0]):
                kinds = {Example: "multiple-choice", GenExample: "generation"}
                raise DataError(
                    f"{where} is a {kinds[type(ex)]} example but line {first} is {kinds[type(examples[0])]}; "
                    "a task file holds one kind: put them in two files"
                )
            first = first or n
            examples.append(ex)
    if not examples:
        raise DataError(f"task file {p} has no examples; write {FORMAT}, or {GEN_FORMAT}")
    return Task(p.stem, p, tuple(examples))


def read_tasks(paths: list[str]) -> list[Task]:
    """All task files, validated before any model is loaded; names are the file stems (the path if two
    files share a stem)."""
    tasks = [read_task(p) for p in paths]
    stems = [t.name for t in tasks]
    return [Task(str(t.path), t.path, t.examples) if stems.count(t.name) > 1 else t for t in tasks]


def _encode_pair(tokenizer: Any, context: str, choice: str) -> tuple[list[int], list[int]]:
    """(context tokens, choice tokens) exactly as lm-evaluation-harness's models split them: trailing whitespace
    of the context moves to the choice (BPE tokenizers attach a space to the word after it), and the choice's
    tokens are those of ``context + choice`` past the context's own count (a merge across the boundary is not
    invented by encoding the two apart). Same split, same scores: the custom-file and harness paths agree."""
    stripped = context.rstrip()
    choice = context[len(stripped) :] + choice
    ctx = tokenizer.encode(stripped)
    return ctx, tokenizer.encode(stripped + choice)[len(ctx) :]


def loglikelihoods(
    model: nn.Module,
    tokenizer: Any,
    pairs: list[tuple[str, str]],
    *,
    batch_size: int = 8,
    max_len: int | None = None,
    with_greedy: bool = False,
    diffusion: bool = False,
    mask_id: int | None = None,
    mc_samples: int = MC_SAMPLES,
    seed: int = MC_SEED,
) -> list[float] | list[tuple[float, bool]]:
    """Summed log-probability of each ``choice`` given its ``context``, in ``pairs`` order; with
    ``with_greedy``, ``(log-probability, whether greedy decoding would produce exactly the choice's tokens)``
    pairs, as lm-evaluation-harness's ``loglikelihood`` returns. The texts are split into tokens as the harness
    splits them (:func:`_encode_pair`), then scored by :func:`score_tokens`."""
    windows = [_encode_pair(tokenizer, context, choice) for context, choice in pairs]
    return score_tokens(
        model,
        windows,
        eos_id=tokenizer.eos_id,
        batch_size=batch_size,
        max_len=max_len,
        with_greedy=with_greedy,
        diffusion=diffusion,
        mask_id=mask_id,
        mc_samples=mc_samples,
        seed=seed,
    )


@torch.no_grad()
def score_tokens(
    model: nn.Module,
    windows: list[tuple[list[int], list[int]]],
    *,
    eos_id: int,
    batch_size: int = 8,
    max_len: int | None = None,
    with_greedy: bool = False,
    diffusion: bool = False,
    mask_id: int | None = None,
    mc_samples: int = MC_SAMPLES,
    seed: int = MC_SEED,
) -> list[float] | list[tuple[float, bool]]:
    """Summed log-probability of each ``(context ids, continuation ids)`` window's continuation given its
    context (the unit of the harness's ``loglikelihood`` and of its rolling windows).

    A sequence ``context + continuation`` is fed without its last token; the logits at position ``t`` predict
    token ``t + 1``, so the continuation's ``k`` tokens are scored by the last ``k`` positions. An empty context
    starts from ``eos_id`` (the document separator the model saw in training). A sequence longer than
    ``max_len + 1`` keeps its last tokens (the continuation, and as much context as fits).

    ``diffusion`` (masked-diffusion models such as LLaDA, whose mask token is ``mask_id``, default the model's):
    the log-likelihood is LLaDA's Monte-Carlo lower bound (:func:`diffusion_loglikelihoods`); the greedy flag is
    then always False (a diffusion model has no left-to-right greedy decoding to compare with)."""
    if diffusion:
        lls = diffusion_loglikelihoods(
            model,
            windows,
            eos_id=eos_id,
            batch_size=batch_size,
            max_len=max_len,
            mask_id=mask_id,
            mc_samples=mc_samples,
            seed=seed,
        )
        return [(ll, False) for ll in lls] if with_greedy else lls
    dev = compute_device(model)
    seqs: list[tuple[list[int], int]] = []
    for ctx, cont in windows:
        whole = (ctx or [eos_id]) + cont
        if max_len is not None:
            whole = whole[-(max_len + 1) :]
        seqs.append((whole, min(len(cont), len(whole) - 1)))
    # Longest first: the batches hold sequences of similar lengths, so little padding is computed.
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i][0]))
    out: list = [0.0] * len(seqs)
    for b in range(0, len(order), batch_size):
        _check_stop()
        idx = order[b : b + batch_size]
        width = max(len(seqs[i][0]) for i in idx) - 1
        # Right padding: with a causal mask, the pad after a sequence changes none of its logits.
        x = torch.full((len(idx), width), eos_id, dtype=torch.long)
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


@torch.no_grad()
def diffusion_loglikelihoods(
    model: nn.Module,
    windows: list[tuple[list[int], list[int]]],
    *,
    eos_id: int,
    batch_size: int = 8,
    max_len: int | None = None,
    mask_id: int | None = None,
    mc_samples: int = MC_SAMPLES,
    seed: int = MC_SEED,
) -> list[float]:
    """LLaDA's estimate of ``log p(choice | context)`` for a masked-diffusion model (their
    ``get_log_likelihood``), per pair: over ``mc_samples`` draws, ``l`` of the choice's ``A`` tokens are masked
    (``l`` uniform on ``1..A``, stratified over the draws; the context is never masked), the model reads context
    and partly masked choice bidirectionally, and the draw's estimate is ``-(A / l) * sum of the masked tokens'
    cross-entropy``; the result is the mean over draws (computed by ``models.llada.diffusion_log_likelihood``).

    It is a lower bound on the log-likelihood (the diffusion ELBO), the quantity LLaDA ranks choices by. Each
    pair draws from a generator seeded with ``seed``, so a pair's score is the same whatever else is scored with
    it or in which order, and the choices of one question of equal token length see the same masks (common
    random numbers: their difference is less noisy than either score). ``batch_size`` is the number of masked
    copies per forward pass. The sequence is cut to its last ``max_len`` tokens (no shift: every position is
    read, none predicts the next)."""
    from gptoughts.models.llada import diffusion_log_likelihood

    if mc_samples < 1:
        raise UserError(f"mc_samples must be >= 1, got {mc_samples}")
    dev = compute_device(model)
    out = []
    for ctx, cont in windows:
        _check_stop()
        whole = (ctx or [eos_id]) + cont
        if max_len is not None:
            whole = whole[-max_len:]
        k = min(len(cont), len(whole))
        if k == 0:
            out.append(0.0)
            continue
        g = torch.Generator(device=dev).manual_seed(seed)
        nll = diffusion_log_likelihood(
            model,
            torch.tensor(whole, device=dev),
            prompt_len=len(whole) - k,
            n_samples=mc_samples,
            mask_id=mask_id,
            batch_size=batch_size,
            generator=g,
        )
        out.append(-float(nll) * k)  # nll is per answer token; one host sync per pair
    return out


def _cut(text: str, until: tuple[str, ...] | list[str]) -> str:
    """``text`` up to (not including) the earliest stop string."""
    cut = min((i for i in (text.find(s) for s in until) if i >= 0), default=len(text))
    return text[:cut]


@torch.no_grad()
def generate_until(
    model: nn.Module,
    tokenizer: Any,
    prompts: list[str],
    *,
    until: list[str] | tuple[str, ...],
    max_new_tokens: int = 64,
    batch_size: int = 8,
    diffusion: bool = False,
    mask_id: int | None = None,
    max_len: int | None = None,
) -> list[str]:
    """Greedy continuation of each prompt, cut before the first of the ``until`` strings (lm-evaluation-harness's
    ``generate_until``), in ``prompts`` order.

    Causal models decode with their KV cache (``sampling.generate`` at temperature 0) and a row stops at eos;
    diffusion models (``diffusion=True``, mask token ``mask_id``) fill ``max_new_tokens`` positions with
    ``sampling.diffusion_generate`` (one token per step, blocks of 32, no noise), cut at the first eos. A causal
    row whose text holds a stop string is finished at the sampler's next check (every few tokens: a batch stops
    once all its rows are); the diffusion sampler fills its fixed length. The prompts are grouped by token length (the samplers take same-length prompts
    without padding, since a pad would shift positions) and decoded ``batch_size`` at a time. A prompt keeps its
    last tokens so that prompt and answer fit ``max_len`` (default: the model's ``args.max_seq_len``); an empty
    prompt starts from eos."""
    from gptoughts.sampling import diffusion_generate, eager, generate

    if not until or not all(isinstance(s, str) and s for s in until):
        raise UserError(f"until must be a non-empty list of non-empty stop strings, got {until!r}")
    if max_new_tokens < 1:
        raise UserError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if max_len is None:
        max_len = getattr(getattr(model, "args", None), "max_seq_len", None)
    # Positions the answer takes: the cached sampler never feeds its last token back, the diffusion one holds
    # every answer position.
    room = None if max_len is None else max_len - (max_new_tokens if diffusion else max_new_tokens - 1)
    if room is not None and room < 1:
        raise UserError(
            f"max_new_tokens={max_new_tokens} leaves no room for a prompt within the model's {max_len} positions; "
            "lower max_new_tokens (eval --max_new_tokens)"
        )
    eos = tokenizer.eos_id
    ids = [tokenizer.encode(p) or [eos] for p in prompts]
    if room is not None:
        ids = [t[-room:] for t in ids]  # the prompt's end matters most: it is what the answer continues
    by_len: dict[int, list[int]] = defaultdict(list)
    for i, t in enumerate(ids):
        by_len[len(t)].append(i)
    dev = compute_device(model)
    out = [""] * len(prompts)

    def stopped(new: torch.Tensor) -> list[bool]:
        """Rows whose text already holds a stop string: finished, as at eos (no decoding on to the limit)."""
        rows = [r[: r.index(eos)] if eos in r else r for r in new.tolist()]
        return [any(s in tokenizer.decode(r) for s in until) for r in rows]

    with eager(model):  # a compiled model (periodic evaluation) would recompile for every new shape
        for length, group in by_len.items():
            for b in range(0, len(group), batch_size):
                _check_stop()
                idx = group[b : b + batch_size]
                x = torch.tensor([ids[i] for i in idx], dtype=torch.long, device=dev)
                if diffusion:
                    y = diffusion_generate(
                        model,
                        x,
                        gen_length=max_new_tokens,
                        steps=max_new_tokens,
                        block_length=min(32, max_new_tokens),
                        temperature=0.0,
                        mask_id=mask_id,
                    )
                else:
                    y = generate(model, x, max_new_tokens, temperature=0.0, eos_id=eos, stop=stopped)
                for r, i in enumerate(idx):
                    new = y[r, length:].tolist()
                    new = new[: new.index(eos)] if eos in new else new
                    out[i] = _cut(tokenizer.decode(new), until)
    return out


def score_task(
    model: nn.Module,
    tokenizer: Any,
    task: Task,
    *,
    batch_size: int = 8,
    max_len: int | None = None,
    diffusion: bool = False,
    mask_id: int | None = None,
    mc_samples: int = MC_SAMPLES,
    max_new_tokens: int = 64,
) -> dict[str, Any]:
    """The metrics of one task: ``acc`` and ``acc_norm`` for multiple choice (ties go to the first choice, as
    ``argmax`` does), ``exact_match`` for generation; with ``file`` and ``examples``. ``diffusion``: a
    masked-diffusion model (see :func:`loglikelihoods` and :func:`generate_until`). The model is in eval mode
    during the call and given back in the mode it came in (periodic evaluation calls this mid-training)."""
    from gptoughts.sampling import eager

    was_training = model.training
    model.eval()
    try:
        # Eager: a compiled model (periodic evaluation) would recompile for each new batch shape.
        with eager(model):
            if task.kind == "generation":
                return _score_generation(
                    model,
                    tokenizer,
                    task,
                    batch_size=batch_size,
                    max_len=max_len,
                    diffusion=diffusion,
                    mask_id=mask_id,
                    max_new_tokens=max_new_tokens,
                )
            return _score_choices(
                model,
                tokenizer,
                task,
                batch_size=batch_size,
                max_len=max_len,
                diffusion=diffusion,
                mask_id=mask_id,
                mc_samples=mc_samples,
            )
    finally:
        model.train(was_training)


def _score_choices(model: nn.Module, tokenizer: Any, task: Task, **kw: Any) -> dict[str, Any]:
    """``acc`` and ``acc_norm`` of a multiple-choice task."""
    pairs = [(ex.context, c) for ex in task.examples for c in ex.choices]
    lls = loglikelihoods(model, tokenizer, pairs, **kw)
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


def _score_generation(model: nn.Module, tokenizer: Any, task: Task, **kw: Any) -> dict[str, Any]:
    """``exact_match`` of a generation task; examples sharing stop strings are generated together."""
    by_until: dict[tuple[str, ...], list[int]] = defaultdict(list)
    for i, ex in enumerate(task.examples):
        by_until[ex.until].append(i)
    hits = 0
    for until, idx in by_until.items():
        texts = generate_until(model, tokenizer, [task.examples[i].prompt for i in idx], until=until, **kw)
        hits += sum(t.strip() == task.examples[i].expected.strip() for t, i in zip(texts, idx, strict=True))
    n = len(task.examples)
    return {"file": str(task.path), "examples": n, "exact_match": hits / n}


def mask_id_of(tokenizer: Any, model: nn.Module, family: str) -> int:
    """The mask token a masked-diffusion model was trained with: the tokenizer's, else the model's config."""
    mask_id = getattr(tokenizer, "mask_id", None)
    if mask_id is None:
        mask_id = getattr(getattr(model, "args", None), "mask_token_id", None)
    if mask_id is None:
        raise UserError(
            f"{family} is a masked-diffusion model but its tokenizer has no mask token; evaluate a run trained "
            "with one"
        )
    return mask_id


def evaluate_tasks(
    loaded: Any,
    tasks: list[Task],
    *,
    batch_size: int = 8,
    mc_samples: int = MC_SAMPLES,
    max_new_tokens: int = 64,
) -> dict[str, dict[str, Any]]:
    """Scores of each task (by name) for a model from ``gptoughts.api.load``. Masked-diffusion families are
    scored through their Monte-Carlo likelihood (``mc_samples`` draws per choice) and their denoising sampler;
    the mask token is the tokenizer's, as in training and sampling."""
    from gptoughts import models

    diffusion = models.family_of(loaded.family).objective == "diffusion"
    mask_id = mask_id_of(loaded.tokenizer, loaded.model, loaded.family) if diffusion else None
    max_len = getattr(loaded.args, "max_seq_len", None)
    model = loaded.model.eval()
    return {
        t.name: score_task(
            model,
            loaded.tokenizer,
            t,
            batch_size=batch_size,
            max_len=max_len,
            diffusion=diffusion,
            mask_id=mask_id,
            mc_samples=mc_samples,
            max_new_tokens=max_new_tokens,
        )
        for t in tasks
    }


def _metrics(results: dict[str, dict[str, Any]]) -> list[str]:
    """The metric names of ``results`` (numbers other than ``examples``), in order of first appearance."""
    names: dict[str, None] = {}
    for r in results.values():
        for k, v in r.items():
            if k != "examples" and isinstance(v, int | float) and not isinstance(v, bool):
                names.setdefault(k)
    return list(names)


def format_table(results: dict[str, dict[str, Any]]) -> str:
    """The results of one model as an aligned text table: task, examples, then one column per metric (``-``
    where a task has no such metric: multiple-choice tasks have no exact_match, generation tasks no acc)."""
    w = max([4, *(len(k) for k in results)])
    metrics = _metrics(results)
    widths = [max(6, len(m)) for m in metrics]
    head = "  ".join(f"{m:>{mw}}" for m, mw in zip(metrics, widths, strict=True))
    lines = [f"{'task':<{w}}  {'examples':>8}  {head}"]
    for name, r in results.items():
        cells = "  ".join(
            f"{r[m]:>{mw}.4f}" if m in r else f"{'-':>{mw}}" for m, mw in zip(metrics, widths, strict=True)
        )
        lines.append(f"{name:<{w}}  {r.get('examples', '-'):>8}  {cells}")
    return "\n".join(lines)


def format_comparison(runs: dict[str, dict[str, Any]]) -> str:
    """Several models' results (``{run: {"loss", "perplexity", "prefs": {...}, "tasks": {...}}}``, each part
    optional) as one table: a row per task and metric, a column per run, so each metric reads across the runs.
    Corpus loss and perplexity (``--data``) come first, under the task name ``data``, then the preference pairs'
    accuracy and reward margin (``--prefs``) under ``prefs``."""
    labels = list(runs)
    rows: list[tuple[str, str, str, list[str]]] = []
    first = next(iter(runs.values()))
    for metric, fmt in (("loss", ".4f"), ("perplexity", ".2f")):
        if metric in first:
            rows.append(("data", metric, "", [format(runs[r][metric], fmt) for r in labels]))
    if "prefs" in first:
        for metric in ("preference_accuracy", "reward_margin"):
            cells = [format(runs[r]["prefs"][metric], ".4f") for r in labels]
            rows.append(("prefs", metric, str(first["prefs"]["pairs"]), cells))
    tasks = first.get("tasks", {})
    for name in tasks:
        for metric in _metrics({name: tasks[name]}):
            cells = [format(runs[r]["tasks"][name][metric], ".4f") for r in labels]
            rows.append((name, metric, str(tasks[name]["examples"]), cells))
    tw = max([4, *(len(r[0]) for r in rows)])
    mw = max([6, *(len(r[1]) for r in rows)])
    cw = [max(len(lab), *(len(r[3][j]) for r in rows)) for j, lab in enumerate(labels)]
    lines = [
        f"{'task':<{tw}}  {'metric':<{mw}}  {'examples':>8}  "
        + "  ".join(f"{lab:>{w}}" for lab, w in zip(labels, cw, strict=True))
    ]
    for task, metric, n, cells in rows:
        lines.append(
            f"{task:<{tw}}  {metric:<{mw}}  {n:>8}  "
            + "  ".join(f"{c:>{w}}" for c, w in zip(cells, cw, strict=True))
        )
    return "\n".join(lines)
