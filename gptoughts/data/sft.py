"""Supervised fine-tuning data: JSONL conversations -> packed token rows with loss on responses only.

Input, one JSON object per line (``.jsonl`` files, or folders of them; a ``.json`` file of JSON lines or of one
JSON array of them too)::

    {"prompt": "...", "response": "..."}                      (optional "system": "...")
    {"messages": [{"role": "system"|"user"|"assistant"|..., "content": "..."}, ...]}

TRL's prompt-completion records are the first form: "completion" for "response", and the prompt and the answer
may be lists of messages.

Every assistant turn is a target; the rest is context. Conversations are rendered with the tokenizer's chat
template (each assistant turn found by rendering with and without it; the rendered text tokenized whole, and a
token a target where it overlaps an answer's characters), else with this default (role markers
are plain text, so data cannot inject special tokens; the loss is on ``{response}<eos>``)::

    [bos]<|system|>\n{system}\n<|user|>\n{prompt}\n<|assistant|>\n{response}<eos><|user|>\n...

With ``packing`` examples share rows (greedy first-fit, never split) with ``position_ids`` restarting at 0 and
their own ``doc_ids``; without it, one right-padded example per row. Too-long examples are cut or dropped
(``truncation``) and counted. :class:`SFTLoader` has the interface of
:class:`~gptoughts.data.loader.BatchLoader`. Rendering and row layout in full: ``docs/data.md``.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gptoughts.errors import ConfigError, DataError

IGNORE_INDEX = -100
STATE_VERSION = 1
_EXPECTED = (
    'each line must be {"prompt": str, "response": str} ("completion" for "response") or {"messages": [{"role": '
    'str, "content": str}, ...]}'
)
# The answer's key of a prompt/answer record: ours, and TRL's prompt-completion name.
_ANSWER_KEYS = ("response", "completion")
# First-fit packing looks for room in this many most recent open rows: near-optimal fill (rows left open
# longer rarely fit anything) at O(examples * this) cost.
_OPEN_ROWS = 64

Message = dict[str, str]


# ------------------------------------------------------------------------------------------------ reading


def _jsonl_files(source: str | Path) -> list[Path]:
    p = Path(source).expanduser()
    if p.is_dir():  # walked as text sources are (os.walk: 5x faster than rglob on the stdlib's 2,000 folders)
        from gptoughts.data.sources import walk_files

        return sorted(walk_files(p, ("jsonl",)))
    if not p.exists():
        raise DataError(f"{p} does not exist; pass a .jsonl file or a folder of them with --data")
    return [p]


# Records are read from .jsonl files, and from .json files: JSON lines too (what ``datasets``' ``to_json`` writes),
# or one JSON array of records.
_RECORD_SUFFIXES = (".jsonl", ".json")
# The first record of a JSON array is looked for in this much of the file's start.
_ARRAY_PEEK = 1 << 22


def is_record_file(source: str | Path) -> bool:
    """A file whose name says it holds JSON records (``.jsonl`` or ``.json``)."""
    return str(source).lower().endswith(_RECORD_SUFFIXES)


def _first_record(path: Path) -> Any:
    # utf-8-sig: a byte order mark (Windows editors) is not JSON; invalid UTF-8 is replaced, as in text sources.
    with open(path, encoding="utf-8-sig", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            if line.lstrip().startswith("["):  # a JSON array: its first element
                f.seek(0)
                head = f.read(_ARRAY_PEEK).lstrip().removeprefix("[")
                try:
                    return json.JSONDecoder().raw_decode(head.lstrip())[0]
                except ValueError:
                    return None
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


def is_sft_record(obj: Any) -> bool:
    return isinstance(obj, dict) and (("prompt" in obj and _answer_key(obj) is not None) or "messages" in obj)


def _answer_key(obj: dict) -> str | None:
    return next((k for k in _ANSWER_KEYS if k in obj), None)


def message_list(msgs: Any, where: str, key: str, expected: str) -> list[Message]:
    """``msgs`` (the record's field ``key``) as a checked non-empty list of ``{"role", "content"}`` strings."""
    if not isinstance(msgs, list) or not msgs:
        raise DataError(f'{where}: "{key}" must be a non-empty list; {expected}')
    for i, m in enumerate(msgs):
        if (
            not isinstance(m, dict)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content"), str)
        ):
            raise DataError(f'{where}: {key}[{i}] needs string "role" and "content"; {expected}')
    return [{"role": m["role"], "content": m["content"]} for m in msgs]


def turns(obj: dict, key: str, role: str, where: str, expected: str) -> list[Message]:
    """The field ``key`` as turns: a string is one turn of ``role``; a list of messages (TRL's conversational
    prompt and completion) is itself."""
    value = obj[key]
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if not isinstance(value, list):
        raise DataError(
            f'{where}: "{key}" must be a string or a list of messages, not {type(value).__name__}; {expected}'
        )
    return message_list(value, where, key, expected)


def resolve_format(fmt: str, sources: Sequence[str]) -> str:
    """``text`` or ``sft``; ``auto`` looks at the first record of each ``.jsonl`` or ``.json`` source (a folder: of
    its ``.jsonl`` files)."""
    if fmt != "auto":
        return fmt
    kinds = set()
    for s in sources:
        files = _jsonl_files(s) if Path(s).expanduser().is_dir() or is_record_file(s) else []
        sft = bool(files) and all(is_sft_record(_first_record(f)) for f in files)
        kinds.add("sft" if sft else "text")
    if len(kinds) > 1:
        raise ConfigError(
            "data.sources mixes SFT .jsonl (prompt/response or messages) with plain text; train them "
            "in separate runs or set data.format explicitly"
        )
    return kinds.pop() if kinds else "text"


def _conversation(obj: Any, where: str) -> list[Message]:
    if not isinstance(obj, dict):
        raise DataError(f"{where}: not a JSON object; {_EXPECTED}")
    answer = _answer_key(obj)
    if "messages" in obj:
        out = message_list(obj["messages"], where, "messages", _EXPECTED)
    elif "prompt" in obj and answer is not None:
        out = turns(obj, "prompt", "user", where, _EXPECTED) + turns(
            obj, answer, "assistant", where, _EXPECTED
        )
        if isinstance(obj.get("system"), str):
            out.insert(0, {"role": "system", "content": obj["system"]})
    else:
        raise DataError(f"{where}: has keys {sorted(obj)[:6]}; {_EXPECTED}")
    if not any(m["role"] == "assistant" for m in out):
        roles = ", ".join(dict.fromkeys(m["role"][:40] for m in out))  # each role named once
        raise DataError(
            f'{where}: no assistant message, so nothing to learn (roles: {roles}); an answer has role "assistant"'
        )
    return out


def _array_records(path: Path, expected: str) -> Iterator[tuple[str, Any]]:
    """``("FILE[i]", element)`` of a file that holds one JSON array."""
    try:
        items = json.loads(path.read_text(encoding="utf-8-sig", errors="replace"))
    except ValueError as e:
        raise DataError(f"{path}: invalid JSON ({e.args[0][:60]}); {expected}") from None
    if not isinstance(items, list):
        raise DataError(f"{path}: not a JSON array of records nor one record a line; {expected}")
    for i, obj in enumerate(items):
        yield f"{path}[{i}]", obj


def read_records(sources: Sequence[str], expected: str) -> Iterator[tuple[str, Any]]:
    """``("FILE:LINE", parsed JSON)`` of every non-blank line of the sources' ``.jsonl`` (or ``.json``) files, in
    order; a file that holds one JSON array gives its elements (``FILE[i]``)."""
    for s in sources:
        for path in _jsonl_files(s):
            with open(path, encoding="utf-8-sig", errors="replace") as f:
                first = next((line for line in f if line.strip()), "")
            if first.lstrip().startswith("["):
                yield from _array_records(path, expected)
                continue
            with open(path, encoding="utf-8-sig", errors="replace") as f:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    where = f"{path}:{lineno}"
                    try:
                        obj = json.loads(line)
                    except ValueError as e:
                        raise DataError(f"{where}: invalid JSON ({e.args[0][:60]}); {expected}") from None
                    yield where, obj


def read_located_conversations(sources: Sequence[str]) -> tuple[list[list[Message]], list[str]]:
    """Every conversation of the sources, in order, and the ``FILE:LINE`` of each (DataError naming the file and
    line of a bad record)."""
    convs: list[list[Message]] = []
    wheres: list[str] = []
    for where, obj in read_records(sources, _EXPECTED):
        convs.append(_conversation(obj, where))
        wheres.append(where)
    if not convs:
        raise DataError(f"no SFT examples in {', '.join(map(str, sources))}; {_EXPECTED}")
    return convs, wheres


def read_conversations(sources: Sequence[str]) -> list[list[Message]]:
    """Every conversation of the sources, in order (DataError naming the file and line of a bad record)."""
    return read_located_conversations(sources)[0]


# ---------------------------------------------------------------------------------------------- rendering

# A segment is (text or token id, is_target).
Segment = tuple[str | int, bool]


# The documented default template (module docstring) as Jinja, for the tokenizer of an export: its
# ``apply_chat_template`` then renders what fine-tuning trained on. It must render what _default_segments below
# does (a test compares the two token by token).
DEFAULT_CHAT_TEMPLATE = (
    "{% if bos_token and bos_token != eos_token %}{{ bos_token }}{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "{{ '<|assistant|>\\n' + m['content'] + eos_token }}"
    "{% else %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def _default_segments(messages: list[Message], tokenizer: Any, generation_prompt: bool) -> list[Segment]:
    segs: list[Segment] = []
    if tokenizer.bos_id is not None and tokenizer.bos_id != tokenizer.eos_id:
        segs.append((tokenizer.bos_id, False))
    for m in messages:
        if m["role"] == "assistant":
            segs += [("<|assistant|>\n", False), (m["content"], True), (tokenizer.eos_id, True)]
        else:
            segs.append((f"<|{m['role']}|>\n{m['content']}\n", False))
    if generation_prompt:
        segs.append(("<|assistant|>\n", False))
    return segs


def _render(tokenizer: Any, messages: list[Message], generation_prompt: bool) -> str:
    text = tokenizer.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    if not isinstance(text, str):  # some versions return a list for a batch of one
        text = text[0]
    return text


def _prompt_before(tokenizer: Any, messages: list[Message], i: int, upto: str) -> str:
    """The rendered text that precedes the answer ``messages[i]``: the conversation before it with the generation
    prompt. An answer that opens the conversation has nothing before it to render (templates refuse an empty
    conversation), so its header is found in ``upto`` (its own rendering) as the generation prompt the template
    appends after a turn; a template whose header is not that keeps the whole turn a target."""
    if i:
        return _render(tokenizer, messages[:i], True)
    probe = [{"role": "user", "content": "."}]
    closed, opened = _render(tokenizer, probe, False), _render(tokenizer, probe, True)
    header = opened[len(closed) :] if opened.startswith(closed) else ""
    at = upto.find(header) if header else -1
    return upto[: at + len(header)] if at >= 0 else ""


def _template_segments(messages: list[Message], tokenizer: Any) -> list[Segment]:
    full = _render(tokenizer, messages, False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        upto = _render(tokenizer, messages[: i + 1], False)
        before = _prompt_before(tokenizer, messages, i, upto)
        if not (full.startswith(upto) and upto.startswith(before)):
            spans = None
            break
        spans.append((len(before), len(upto)))
    if spans is None:
        # The template rewrites earlier turns (e.g. drops past reasoning): only the last answer is a clean target.
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        before = _prompt_before(tokenizer, messages, last, _render(tokenizer, messages[: last + 1], False))
        if not full.startswith(before):
            raise DataError(
                "the tokenizer's chat template does not render a conversation's prompt as a prefix of "
                "the whole conversation; give prompt/response pairs instead"
            )
        spans = [(len(before), len(full))]
    segs: list[Segment] = []
    pos = 0
    for a, b in spans:
        if a > pos:
            segs.append((full[pos:a], False))
        if b > a:
            segs.append((full[a:b], True))
        pos = b
    if pos < len(full):
        segs.append((full[pos:], False))
    return segs


def _checked_template_segments(messages: list[Message], tokenizer: Any, where: str) -> list[Segment]:
    """:func:`_template_segments`, with a template that refuses the conversation (Jinja's ``raise_exception``:
    "System role not supported", "roles must alternate", or a template error) as a one-line DataError."""
    from jinja2.exceptions import TemplateError

    try:
        return _template_segments(messages, tokenizer)
    except TemplateError as e:
        reason = " ".join(str(e).split())[:200] or type(e).__name__
        roles = ", ".join(m["role"] for m in messages)
        raise DataError(
            f"{where}: the tokenizer's chat template refuses this conversation (roles: {roles}): {reason}; "
            "rewrite the line in a form the template accepts (e.g. fold a system message into the first user "
            "message, alternate user and assistant turns) or drop it"
        ) from None


Run = tuple[str, list[tuple[int, int]]] | tuple[int, bool]


def _runs(segs: list[Segment]) -> list[Run]:
    """A conversation's segments as runs: each token id segment alone, ``(id, is_target)``, and each stretch of
    consecutive text segments joined into one text with the character spans of its targets, ``(text, spans)``
    (a run of text is tokenized whole)."""
    runs: list[Run] = []
    text, spans = "", []
    for s, is_target in segs:
        if isinstance(s, str):
            if is_target and s:
                spans.append((len(text), len(text) + len(s)))
            text += s
            continue
        if text:
            runs.append((text, spans))
            text, spans = "", []
        runs.append((int(s), is_target))
    if text:
        runs.append((text, spans))
    return runs


def _token_targets(
    text: str, spans: list[tuple[int, int]], n: int, offsets: list[tuple[int, int]]
) -> np.ndarray:
    """Which of the ``n`` tokens of ``text`` overlap a target span (character ``spans``); ``offsets`` empty: the
    bytes tokenizer, one token per byte of the UTF-8 text."""
    if not offsets:
        flags = np.zeros(n, dtype=bool)
        for a, b in spans:
            start = len(text[:a].encode("utf-8"))
            flags[start : start + len(text[a:b].encode("utf-8"))] = True
        return flags
    chars = np.zeros(len(text) + 1, dtype=np.int64)
    for a, b in spans:
        chars[a:b] = 1
    before = np.concatenate([[0], np.cumsum(chars)])  # targets among the characters before each position
    at = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    starts, ends = at[:, 0], at[:, 1]
    # A token of no characters is one whose offsets were trimmed to nothing (a ByteLevel post-processor trims a
    # whitespace token's to the end of it): it is the character before that point.
    empty = ends <= starts
    starts = np.where(empty, np.maximum(starts - 1, 0), starts)
    ends = np.where(empty, starts + 1, ends)
    return (before[np.minimum(ends, len(text) + 1)] - before[starts]) > 0


def encode_conversations(
    convs: Sequence[list[Message]], tokenizer: Any, wheres: Sequence[str] | None = None
) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(ids, is_target)`` per conversation. All text is tokenized in one parallel batch. ``wheres``
    (``FILE:LINE`` per conversation) names the line of a conversation the chat template refuses.

    Text is tokenized whole, as ``apply_chat_template`` and the prompt at sampling time tokenize it (a run of text
    between token ids of the default template; the whole conversation with a chat template), never piece by
    piece: a SentencePiece tokenizer would begin each piece with a word boundary (``▁Hello`` where the
    conversation has ``Hello``). A token is a target when it overlaps a target's characters."""
    use_template = tokenizer.chat_template is not None
    all_runs = [
        _runs(
            _checked_template_segments(c, tokenizer, wheres[i] if wheres else f"conversation {i + 1}")
            if use_template
            else _default_segments(c, tokenizer, False)
        )
        for i, c in enumerate(convs)
    ]
    texts = [r[0] for runs in all_runs for r in runs if isinstance(r[0], str)]
    # Template text holds special tokens by design (<|im_start|>...); the default template is plain text.
    encoded = iter(tokenizer.encode_batch_offsets(texts, special=use_template))
    out = []
    for runs in all_runs:
        ids: list[int] = []
        tgt: list[bool] = []
        for r in runs:
            if not isinstance(r[0], str):  # the default template's bos (context) and eos (an answer's end)
                ids.append(r[0])
                tgt.append(bool(r[1]))
                continue
            text, spans = r  # type: ignore[misc]
            piece, offsets = next(encoded)
            ids += piece
            tgt += _token_targets(text, spans, len(piece), offsets).tolist()
        out.append((np.asarray(ids, dtype=np.int64), np.asarray(tgt, dtype=bool)))
    return out


def render_prompt(tokenizer: Any, messages: list[Message]) -> list[int]:
    """Token ids of a conversation followed by the assistant's generation prompt (for sampling), tokenized as
    :func:`encode_conversations` tokenizes a conversation."""
    if tokenizer.chat_template is not None:
        return tokenizer.encode(_render(tokenizer, messages, True), special=True)
    runs = _runs(_default_segments(messages, tokenizer, True))
    encoded = iter(
        tokenizer.encode_batch_offsets([r[0] for r in runs if isinstance(r[0], str)], special=False)
    )
    ids: list[int] = []
    for r in runs:
        ids += next(encoded)[0] if isinstance(r[0], str) else [r[0]]
    return ids


def turn_end_id(tokenizer: Any) -> int | None:
    """The special token the tokenizer's chat template closes an answer with where that is not eos (ChatML's
    ``<|im_end|>`` over a base whose eos is ``<|endoftext|>``): SFT teaches the model to end its answers with
    it, so generation must stop there. None without a template, or where an answer ends otherwise."""
    from jinja2.exceptions import TemplateError

    if tokenizer.chat_template is None:
        return None
    answer = "\x00answer\x00"
    try:
        text = _render(
            tokenizer, [{"role": "user", "content": "."}, {"role": "assistant", "content": answer}], False
        )
    except TemplateError:
        return None
    at = text.rfind(answer)
    if at < 0:  # a template that does not render the answer: nothing follows it
        return None
    ids = tokenizer.encode(text[at + len(answer) :], special=True)
    specials = {i for i, t in tokenizer.backend.get_added_tokens_decoder().items() if t.special}
    return ids[0] if ids and ids[0] != tokenizer.eos_id and ids[0] in specials else None


# ------------------------------------------------------------------------------------------------ dataset


def data_fingerprint(*arrays: np.ndarray) -> str:
    """16 hex digits of a SHA-256 over the arrays' dtypes, shapes and bytes."""
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()[:16]


def split_indices(n: int, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, held-out) indices of ``n`` examples: a seeded shuffle, ``val_fraction`` of them held out (at least
    one when the fraction is positive, never all)."""
    n_val = 0 if n < 2 or val_fraction <= 0 else min(n - 1, max(1, round(n * val_fraction)))
    perm = np.random.default_rng([seed, 0x5F7]).permutation(n)
    return np.sort(perm[n_val:]), np.sort(perm[:n_val])


def opening_system(convs: Sequence[list[Message]]) -> str | bool | None:
    """The system message every conversation opens with (a run records it: ``gptoughts sample`` says to pass it, as
    the model never saw a prompt without one): its text when they share it, True when each has its own, None when
    one has none."""
    if not convs or not all(c and c[0]["role"] == "system" for c in convs):
        return None
    texts = {c[0]["content"] for c in convs}
    return texts.pop() if len(texts) == 1 else True


class SFTData:
    """Tokenized examples of both splits, truncated to fit a row, with counts of what was cut or skipped."""

    def __init__(
        self,
        sources: Sequence[str],
        tokenizer: Any,
        *,
        block_size: int,
        truncation: str = "right",
        val_fraction: float = 0.0,
        seed: int = 0,
    ) -> None:
        if truncation not in ("right", "drop"):
            raise ConfigError(f"data.truncation must be right or drop, got {truncation!r}")
        self.block_size = block_size
        self.pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_id
        convs, wheres = read_located_conversations(sources)
        self.system = opening_system(convs)
        encoded = encode_conversations(convs, tokenizer, wheres)
        stats = {"examples": len(encoded), "truncated": 0, "dropped_too_long": 0, "dropped_no_target": 0}
        keep_ids, keep_tgt = [], []
        for ids, tgt in encoded:
            if len(ids) > block_size + 1:
                if truncation == "drop":
                    stats["dropped_too_long"] += 1
                    continue
                ids, tgt = ids[: block_size + 1], tgt[: block_size + 1]
                stats["truncated"] += 1
            if len(ids) < 2 or not tgt[1:].any():  # the first token is never predicted
                stats["dropped_no_target"] += 1
                continue
            keep_ids.append(ids)
            keep_tgt.append(tgt)
        if not keep_ids:  # none kept: every example truncated lost all its answer tokens to the cut
            cut, empty = stats["truncated"], stats["dropped_no_target"] - stats["truncated"]
            limit = f"block_size+1 = {block_size + 1} tokens"
            lost = (
                (stats["dropped_too_long"], f"dropped as longer than {limit}"),
                (cut, f"cut at {limit} before their answer"),
                (empty, "with no answer token"),
            )
            hint = (
                "raise --block_size or set data.truncation = right"
                if stats["dropped_too_long"]
                else "raise --block_size"
                if cut
                else "give each example a non-empty answer"
            )
            raise DataError(
                f"no usable SFT example: {', '.join(f'{n} {what}' for n, what in lost if n)}; {hint}"
            )
        lengths = np.array([len(i) for i in keep_ids], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(lengths)])
        tokens = np.concatenate(keep_ids)
        self.x_tokens = tokens
        # Targets with the loss mask applied once: a row's y is then a plain slice.
        self.y_tokens = np.where(np.concatenate(keep_tgt), tokens, IGNORE_INDEX)
        self.pairs = lengths - 1  # (input, target) positions each example fills in a row
        self.train_idx, self.val_idx = split_indices(len(lengths), val_fraction, seed)
        stats.update(
            train=len(self.train_idx),
            val=len(self.val_idx),
            target_tokens=int((self.y_tokens[1:] != IGNORE_INDEX).sum()),
            tokens=int(len(tokens)),
        )
        self.stats = stats

    @cached_property  # (a hash of every token: read by the plan and by the run record)
    def fingerprint(self) -> str:
        """A short hash of the examples as tokenized and split: equal exactly when a resume would read the same
        rows (a run records it; a resume on edited data is then said)."""
        return data_fingerprint(self.x_tokens, self.y_tokens, self.offsets, self.train_idx, self.val_idx)

    def indices(self, split: str) -> np.ndarray:
        if split not in ("train", "val"):
            raise ConfigError(f"split must be train or val, got {split!r}")
        return self.train_idx if split == "train" else self.val_idx

    def summary(self) -> str:
        s = self.stats
        cut = []
        if s["truncated"]:
            cut.append(f"{s['truncated']:,} truncated to {self.block_size + 1} tokens")
        if s["dropped_too_long"]:
            cut.append(f"{s['dropped_too_long']:,} dropped as too long")
        if s["dropped_no_target"]:
            cut.append(f"{s['dropped_no_target']:,} dropped with no response tokens left")
        return (
            f"SFT data: {s['examples']:,} examples ({s['train']:,} train, {s['val']:,} val), "
            f"{s['target_tokens']:,} target tokens of {s['tokens']:,}"
            + (f"; {', '.join(cut)}" if cut else "")
        )

    # ------------------------------------------------------------------------------------- rows

    def pack(self, order: np.ndarray, packing: bool) -> list[np.ndarray]:
        """Rows (arrays of example indices) for examples taken in ``order``."""
        if not packing:
            return [np.array([e]) for e in order.tolist()]
        cap = self.block_size
        rows: list[list[int]] = []
        room: list[int] = []
        open_rows: list[int] = []
        for e in order.tolist():
            need = int(self.pairs[e])
            for j, r in enumerate(open_rows):
                if room[r] >= need:
                    rows[r].append(e)
                    room[r] -= need
                    if room[r] == 0:
                        open_rows.pop(j)
                    break
            else:
                rows.append([e])
                room.append(cap - need)
                if room[-1] > 0:
                    open_rows.append(len(rows) - 1)
                    if len(open_rows) > _OPEN_ROWS:
                        open_rows.pop(0)
        return [np.array(r) for r in rows]

    def fill(self, rows: Sequence[np.ndarray], out: np.ndarray) -> None:
        """Write rows into ``out [4, B, T]`` int64: inputs, targets, position ids, document ids."""
        x, y, pos, doc = out
        x.fill(self.pad_id)
        y.fill(IGNORE_INDEX)
        t = out.shape[-1]
        for b, row in enumerate(rows):
            c = 0
            for k, e in enumerate(row.tolist()):
                s, end = int(self.offsets[e]), int(self.offsets[e + 1])
                n = end - s - 1
                x[b, c : c + n] = self.x_tokens[s : end - 1]
                y[b, c : c + n] = self.y_tokens[s + 1 : end]
                pos[b, c : c + n] = np.arange(n)
                doc[b, c : c + n] = k
                c += n
            # Padding is a document of its own: nothing real attends to it, and it attends to nothing real.
            pos[b, c:] = np.arange(t - c)
            doc[b, c:] = len(row)

    def eval_batches(
        self,
        *,
        batch_size: int,
        max_batches: int | None,
        packing: bool = True,
        device: str | torch.device = "cpu",
    ) -> Iterator[tuple[torch.Tensor, ...]]:
        """The same fixed validation batches on every call (full batches, or one smaller if there are few)."""
        rows = self.pack(self.val_idx, packing)
        if not rows:
            return
        bs = min(batch_size, len(rows))
        n = len(rows) // bs if max_batches is None else min(max_batches, len(rows) // bs)
        dev = torch.device(device)
        for i in range(n):
            buf = np.empty((4, bs, self.block_size), dtype=np.int64)
            self.fill(rows[i * bs : (i + 1) * bs], buf)
            t = torch.from_numpy(buf).to(dev)
            yield (t[0], t[1], t[2], t[3]) if packing else (t[0], t[1])


# ------------------------------------------------------------------------------------------------- loader


class SFTLoader:
    """Endless batches of SFT rows: ``(x, y, position_ids, doc_ids)`` with packing, ``(x, y)`` without.

    The stream: epoch ``e`` shuffles the train examples with ``(seed, e)`` and packs them into rows; epochs
    follow each other. A global batch is ``batch_size * world_size`` consecutive rows of the stream and rank
    ``r`` keeps its ``r``-th slice, as in :class:`~gptoughts.data.loader.BatchLoader`. The state is the epoch and
    the row within it (plain ints): an epoch's packing is recomputed from the seed on resume.
    """

    def __init__(
        self,
        data: SFTData,
        *,
        batch_size: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        packing: bool = True,
        device: str | torch.device = "cpu",
    ) -> None:
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1; got {batch_size}")
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank must be in [0, world_size={world_size}); got {rank}")
        if len(data.train_idx) == 0:
            raise DataError(
                "no SFT training examples left after the validation split; add data or lower "
                "data.val_fraction"
            )
        self.data = data
        self.batch_size, self.seed, self.rank, self.world_size = batch_size, seed, rank, world_size
        self.packing = packing
        self.block_size = data.block_size
        self.device = torch.device(device)
        self._epoch, self._pos, self._rows_done = 0, 0, 0
        self._rows_cache: tuple[int, list[np.ndarray]] | None = None
        # Host staging: on CUDA a small ring of pinned buffers, each reused only after the GPU has finished the
        # asynchronous copy out of it (its event), so the copy never makes the host wait in steady state.
        self._ring: list[tuple[torch.Tensor, Any]] = []
        self._ring_i = 0

    def _epoch_rows(self, epoch: int) -> list[np.ndarray]:
        if self._rows_cache is None or self._rows_cache[0] != epoch:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.data.train_idx)
            self._rows_cache = (epoch, self.data.pack(order, self.packing))
        return self._rows_cache[1]

    @property
    def rows_per_epoch(self) -> int:
        return len(self._epoch_rows(self._epoch))

    def _take(self, n: int) -> list[np.ndarray]:
        out: list[np.ndarray] = []
        while len(out) < n:
            rows = self._epoch_rows(self._epoch)
            take = rows[self._pos : self._pos + n - len(out)]
            out += take
            self._pos += len(take)
            if self._pos >= len(rows):
                self._epoch, self._pos = self._epoch + 1, 0
        self._rows_done += n
        return out

    def _buffer(self) -> torch.Tensor:
        shape = (4, self.batch_size, self.block_size)
        if self.device.type != "cuda":
            return torch.empty(shape, dtype=torch.int64)
        if not self._ring:
            self._ring = [
                (torch.empty(shape, dtype=torch.int64, pin_memory=True), torch.cuda.Event()) for _ in range(4)
            ]
        buf, event = self._ring[self._ring_i]
        event.synchronize()
        return buf

    def __iter__(self) -> SFTLoader:
        return self

    def __next__(self) -> tuple[torch.Tensor, ...]:
        rows = self._take(self.batch_size * self.world_size)
        mine = rows[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]
        host = self._buffer()
        self.data.fill(mine, host.numpy())
        if self.device.type == "cuda":
            out = host.to(self.device, non_blocking=True)
            self._ring[self._ring_i][1].record()
            self._ring_i = (self._ring_i + 1) % len(self._ring)
        else:
            out = host.to(self.device)
        if not self.packing:
            return out[0], out[1]
        return out[0], out[1], out[2], out[3]

    def close(self) -> None:
        """Nothing runs in the background; kept for the loader interface."""

    # ------------------------------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "kind": "sft",
            "seed": int(self.seed),
            "block_size": int(self.block_size),
            "packing": bool(self.packing),
            "epoch": int(self._epoch),
            "pos": int(self._pos),
            "rows": int(self._rows_done),
            "batch_size": int(self.batch_size),
            "world_size": int(self.world_size),
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd.get("kind") != "sft" or sd.get("version") != STATE_VERSION:
            raise ConfigError(
                "the checkpoint's data loader is not an SFT loader of this version; resume with the "
                "run's own data settings (see its config.toml)"
            )
        for key in ("seed", "block_size", "packing"):
            if sd[key] != getattr(self, key):
                raise ConfigError(
                    f"the checkpoint's data loader used {key}={sd[key]!r}, this run "
                    f"{getattr(self, key)!r}; resume with the same {key}"
                )
        self._epoch, self._pos, self._rows_done = int(sd["epoch"]), int(sd["pos"]), int(sd["rows"])

    @property
    def epoch(self) -> float:
        return self._epoch + self._pos / max(1, self.rows_per_epoch)

    @property
    def tokens_consumed(self) -> int:
        return self._rows_done * self.block_size


def epoch_rows(data: SFTData, seed: int, packing: bool) -> int:
    """Rows in the first epoch (sizes ``epochs``-based runs)."""
    order = np.random.default_rng([seed, 0]).permutation(data.train_idx)
    return max(1, len(data.pack(order, packing)))


def padding_fraction(data: SFTData, seed: int, packing: bool) -> float:
    rows = epoch_rows(data, seed, packing)
    return 1.0 - float(data.pairs[data.train_idx].sum()) / (rows * data.block_size) if rows else math.nan
