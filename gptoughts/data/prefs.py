"""Preference data for DPO: JSONL pairs -> one (chosen, rejected) pair of right-padded rows per example.

Input, one JSON object per line (``.jsonl`` files, or folders of them)::

    {"prompt": str, "chosen": str, "rejected": str}                       (optional "system": str)
    {"messages": [{"role": ..., "content": ...}, ...], "chosen": {"role": "assistant", "content": str},
     "rejected": {"role": "assistant", "content": str}}

TRL's conversational pairs read the same: a prompt that is a list of messages, and each completion a list of
messages whose last is the answer (the turns before it, the same in both, are then the prompt).

Each completion is rendered after its prompt exactly as SFT renders an assistant turn (``data/sft.py``: the
tokenizer's chat template, else the default one); only the completion's tokens are targets. Every line is checked
when the file is read, before any model loads: a bad one is a one-line error naming the file, the line and the fix.
A pair longer than a row is cut on the right or dropped (``data.truncation``), as SFT examples are; a pair whose
two rows are the same (chosen = rejected, as written or once cut) teaches nothing and is dropped, counted. The
batch of ``B`` pairs is ``(x [B, 2, T], ref_logratio [B], y [B, 2, T])``: index 0 of the second axis is the chosen
completion, 1 the rejected; ``ref_logratio`` is the reference model's log p(chosen) - log p(rejected), filled in
once before training where the reference is precomputed (NaN until then).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from functools import cached_property
from typing import Any

import numpy as np
import torch

from gptoughts.data.sft import (
    IGNORE_INDEX,
    STATE_VERSION,
    Message,
    SFTData,
    SFTLoader,
    _first_record,
    _jsonl_files,
    data_fingerprint,
    encode_conversations,
    is_record_file,
    message_list,
    read_records,
    resolve_format,
    split_indices,
    turns,
)
from gptoughts.errors import ConfigError, DataError

_EXPECTED = (
    'each line must be {"prompt": str, "chosen": str, "rejected": str} or {"messages": [...], '
    '"chosen": {"role": "assistant", "content": str}, "rejected": {...}}'
)
Pair = tuple[list[Message], str, str]


def is_pref_record(obj: Any) -> bool:
    return isinstance(obj, dict) and "chosen" in obj and "rejected" in obj


def examples_kind(sources: Sequence[str], fmt: str = "auto") -> str | None:
    """What the sources hold when it is not a corpus of text: "preference pairs" or "chat examples" (read from their
    first records, as ``data.format = auto`` reads them; an asked ``text`` is text), else None."""
    if fmt == "text":
        return None
    if looks_like_prefs(sources):
        return "preference pairs"
    return "chat examples" if resolve_format(fmt, sources) == "sft" else None


def looks_like_prefs(sources: Sequence[str]) -> bool:
    """Whether the first record of the first ``.jsonl`` (or ``.json``) file is a preference pair (a hint for the
    user)."""
    for s in sources:
        files = _jsonl_files(s) if is_record_file(s) else []
        if files:
            return is_pref_record(_first_record(files[0]))
    return False


def _completion(obj: dict, key: str, where: str) -> tuple[list[Message], str]:
    """The completion ``key``, and the turns written before it in the same field: TRL's conversational pairs give
    a completion as a list of messages, the whole conversation (``ultrafeedback_binarized``) or its last turn."""
    if key not in obj:
        raise DataError(f'{where}: missing "{key}"; {_EXPECTED}')
    value = obj[key]
    before: list[Message] = []
    if isinstance(value, list):
        *before, value = message_list(value, where, key, _EXPECTED)
    if isinstance(value, dict):
        if value.get("role", "assistant") != "assistant" or not isinstance(value.get("content"), str):
            raise DataError(f'{where}: "{key}" must be {{"role": "assistant", "content": str}}; {_EXPECTED}')
        value = value["content"]
    elif not isinstance(value, str):
        raise DataError(f'{where}: "{key}" must be a string, not {type(value).__name__}; {_EXPECTED}')
    if not value.strip():
        raise DataError(f'{where}: "{key}" is empty; give both completions some text (or drop the line)')
    return before, value


def _prompt(obj: dict, where: str) -> list[Message]:
    if "messages" in obj:
        return message_list(obj["messages"], where, "messages", _EXPECTED)
    if "prompt" not in obj:
        raise DataError(f'{where}: missing "prompt" (or "messages"); {_EXPECTED}')
    prompt = turns(obj, "prompt", "user", where, _EXPECTED)  # (TRL's conversational prompt: a list)
    system = obj.get("system")
    if system is not None and not isinstance(system, str):
        raise DataError(f'{where}: "system" must be a string; {_EXPECTED}')
    return ([{"role": "system", "content": system}] if system else []) + prompt


def read_located_pairs(sources: Sequence[str]) -> tuple[list[Pair], list[str]]:
    """Every pair of the sources, in order, and the ``FILE:LINE`` of each; the first bad line is a DataError
    naming its file and line."""
    pairs: list[Pair] = []
    wheres: list[str] = []
    for where, obj in read_records(sources, _EXPECTED):
        if not isinstance(obj, dict):
            raise DataError(f"{where}: not a JSON object; {_EXPECTED}")
        (before, chosen), (other, rejected) = (_completion(obj, k, where) for k in ("chosen", "rejected"))
        if before != other:
            raise DataError(
                f'{where}: "chosen" and "rejected" differ before their last message; give both the same '
                f"conversation before the answer; {_EXPECTED}"
            )
        # a conversation written in the completions is the prompt (a "prompt" beside it repeats its first turn)
        pairs.append((before or _prompt(obj, where), chosen, rejected))
        wheres.append(where)
    if not pairs:
        raise DataError(f"no preference pairs in {', '.join(map(str, sources))}; {_EXPECTED}")
    return pairs, wheres


def read_pairs(sources: Sequence[str]) -> list[Pair]:
    """Every pair of the sources, in order; the first bad line is a DataError naming its file and line."""
    return read_located_pairs(sources)[0]


def _last_span(tgt: np.ndarray) -> np.ndarray:
    """Only the last run of targets: the completion (earlier assistant turns of the prompt are context)."""
    idx = np.flatnonzero(tgt)
    out = np.zeros_like(tgt)
    if len(idx):
        end = idx[-1]
        start = end
        while start > 0 and tgt[start - 1]:
            start -= 1
        out[start : end + 1] = True
    return out


class PrefData:
    """Tokenized pairs of both splits as input/target rows, and each pair's reference log-ratio (NaN until set)."""

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
        pairs, wheres = read_located_pairs(sources)
        convs = [
            p + [{"role": "assistant", "content": c}]
            for p, chosen, rejected in pairs
            for c in (chosen, rejected)
        ]
        encoded = encode_conversations(convs, tokenizer, [w for w in wheres for _ in (0, 1)])
        stats = {
            "pairs": len(pairs),
            "truncated": 0,
            "dropped_too_long": 0,
            "dropped_no_target": 0,
            "dropped_identical": 0,
        }
        rows: list[tuple[np.ndarray, np.ndarray]] = []  # (x, y) of chosen then rejected, per kept pair
        for i in range(len(pairs)):
            kept = [self._row(*encoded[2 * i + k], truncation) for k in (0, 1)]
            too_long = any(len(encoded[2 * i + k][0]) > block_size + 1 for k in (0, 1))
            if any(r is None for r in kept):
                stats["dropped_too_long" if truncation == "drop" and too_long else "dropped_no_target"] += 1
                continue
            (xc, yc), (xr, yr) = kept  # type: ignore[misc]
            if np.array_equal(xc, xr) and np.array_equal(yc, yr):
                # chosen == rejected (as written, or once cut to the row): its loss is log 2 whatever the
                # weights, its gradient zero; kept, it would only dilute the mean over the real pairs.
                stats["dropped_identical"] += 1
                continue
            stats["truncated"] += too_long
            rows += kept  # type: ignore[arg-type]
        if not rows:
            if stats["dropped_identical"]:
                raise DataError(
                    f"no usable preference pair: {stats['dropped_identical']:,} of {len(pairs):,} have the same "
                    f"chosen and rejected completion (as written, or once cut to block_size+1 = {block_size + 1} "
                    "tokens), which teaches nothing; give pairs whose completions differ (or raise --block_size)"
                )
            keep = " or set data.truncation = right" if truncation == "drop" else ""
            raise DataError(
                f"no usable preference pair: none fits block_size+1 = {block_size + 1} tokens with completion "
                f"tokens left; raise --block_size{keep}"
            )
        self.rows = rows
        n = len(rows) // 2
        self.ref_logratio = np.full(n, np.nan, dtype=np.float64)
        self.train_idx, self.val_idx = split_indices(n, val_fraction, seed)
        stats.update(train=len(self.train_idx), val=len(self.val_idx))
        stats["target_tokens"] = int(sum((y != IGNORE_INDEX).sum() for _, y in rows))
        self.stats = stats

    @cached_property  # (a hash of every token: read by the plan and by the run record)
    def fingerprint(self) -> str:
        """A short hash of the pairs as tokenized and split (see ``SFTData.fingerprint``)."""
        return data_fingerprint(*(a for row in self.rows for a in row), self.train_idx, self.val_idx)

    def _row(self, ids: np.ndarray, tgt: np.ndarray, truncation: str) -> tuple[np.ndarray, np.ndarray] | None:
        tgt = _last_span(tgt)
        if len(ids) > self.block_size + 1:
            if truncation == "drop":
                return None
            ids, tgt = ids[: self.block_size + 1], tgt[: self.block_size + 1]
        if len(ids) < 2 or not tgt[1:].any():  # the first token is never predicted
            return None
        return ids[:-1], np.where(tgt[1:], ids[1:], IGNORE_INDEX)

    def __len__(self) -> int:
        return len(self.ref_logratio)

    indices = SFTData.indices  # reads train_idx and val_idx only

    def summary(self) -> str:
        s = self.stats
        cut = [
            f"{s[k]:,} {what}"
            for k, what in (
                ("truncated", f"truncated to {self.block_size + 1} tokens"),
                ("dropped_too_long", "dropped as too long"),
                ("dropped_no_target", "dropped with no completion tokens left"),
                ("dropped_identical", "dropped with chosen = rejected"),
            )
            if s[k]
        ]
        return (
            f"preference data: {s['pairs']:,} pairs ({s['train']:,} train, {s['val']:,} val), "
            f"{s['target_tokens']:,} completion tokens" + (f"; {', '.join(cut)}" if cut else "")
        )

    # ------------------------------------------------------------------------------------- batches

    def pack(self, order: np.ndarray, packing: bool = False) -> list[np.ndarray]:
        """One pair per row (the SFT loader's interface; pairs are never packed)."""
        return [np.array([e]) for e in order.tolist()]

    def batch(
        self, pairs: np.ndarray, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(x [B, 2, T], ref_logratio [B], y [B, 2, T])`` of the pairs ``pairs`` (right-padded)."""
        b, t = len(pairs), self.block_size
        x = np.full((b, 2, t), self.pad_id, dtype=np.int64)
        y = np.full((b, 2, t), IGNORE_INDEX, dtype=np.int64)
        for i, e in enumerate(pairs.tolist()):
            for k in (0, 1):
                xi, yi = self.rows[2 * e + k]
                x[i, k, : len(xi)] = xi
                y[i, k, : len(yi)] = yi
        ref = torch.from_numpy(self.ref_logratio[pairs].astype(np.float32))
        return torch.from_numpy(x).to(device), ref.to(device), torch.from_numpy(y).to(device)

    def batches(
        self, idx: np.ndarray, batch_size: int, device: torch.device, max_batches: int | None = None
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """The pairs ``idx`` in order, in batches of ``batch_size`` (the last one smaller)."""
        n = -(-len(idx) // batch_size)
        for i in range(n if max_batches is None else min(n, max_batches)):
            yield self.batch(idx[i * batch_size : (i + 1) * batch_size], device)


class PrefLoader(SFTLoader):
    """Endless batches of pairs, with :class:`~gptoughts.data.sft.SFTLoader`'s stream (epochs shuffled from the
    seed, rank slices of each global batch) and resumable state; a row is a pair."""

    def __init__(self, data: PrefData, **kwargs: Any) -> None:
        super().__init__(data, packing=False, **kwargs)  # type: ignore[arg-type]

    def __next__(self) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        rows = self._take(self.batch_size * self.world_size)
        mine = rows[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]
        return self.data.batch(np.concatenate(mine), self.device)  # type: ignore[attr-defined]

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "kind": "dpo"}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd.get("kind") != "dpo" or sd.get("version") != STATE_VERSION:
            raise ConfigError(
                "the checkpoint's data loader is not a preference (DPO) loader of this version; resume with "
                "the run's own data and --objective (see its config.toml)"
            )
        super().load_state_dict({**sd, "kind": "sft"})

    @property
    def tokens_consumed(self) -> int:
        return self._rows_done * 2 * self.block_size


def epoch_pairs(data: PrefData) -> int:
    return max(1, len(data.train_idx))
