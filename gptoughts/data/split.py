"""Pass 1 of prepare: read every source once, decide the train/val split, collect the BPE training text.

The split is deterministic: a function of the text read and the settings, all in the cache key.

* Every document draws a lottery ticket from (seed, source, index, content); a short document whose draw
  falls under ``val_fraction`` is held out whole.
* A long document (over :meth:`SplitRule.cap` characters) is cut instead: its tail, the last
  :meth:`SplitRule.share` of it at a line start, is val and its head train, so one big file holds out a share
  of its tokens rather than all or nothing.
* When fewer than ``min_val_docs`` documents gave val text, the short documents with the smallest draws are
  held out whole; one document always stays train.

The cut threshold depends on the corpus size, known only at the end of the pass: the few documents that may
be cut are remembered and settled then, so memory stays O(min_val_docs + a few long documents) beside the BPE
text. Reasons and measurements: docs/data.md, "Preparing a corpus".
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gptoughts.data.sources import SourceStats, iter_documents
from gptoughts.errors import DataError

# BPE training sees at most this much text (split evenly between sources): merges learnt on 50 MB are
# nearly those learnt on 10 GB, and training cost grows with the text.
TOKENIZER_TRAIN_BYTES = 50_000_000
# With min_val_docs > 0, val holds at least ~_MIN_VAL_CHARS characters of a small corpus, but never more than
# _SMALL_CORPUS_VAL_SHARE of it; a tail shorter than _MIN_TAIL_CHARS is not worth cutting (the document is
# then held out whole or not at all).
_MIN_VAL_CHARS = 1024
_SMALL_CORPUS_VAL_SHARE = 0.1
_MIN_TAIL_CHARS = 32


def _doc_u(seed: int, src: int, idx: int, doc: str) -> float:
    """A uniform [0, 1) draw from (seed, source, index, content): the document's split lottery ticket."""
    h = hashlib.blake2b(f"{seed}\0{src}\0{idx}\0".encode(), digest_size=8)
    h.update(doc.encode("utf-8", "surrogatepass"))
    return int.from_bytes(h.digest(), "little") / 2.0**64


@dataclass(frozen=True)
class SplitRule:
    """The split rule of the module docstring, as functions of the corpus size ``chars``."""

    val_fraction: float
    min_val_docs: int

    def share(self, chars: int) -> float:
        """``s``: the fraction of a long document held out as its tail (non-increasing in ``chars``)."""
        floor = min(_SMALL_CORPUS_VAL_SHARE, _MIN_VAL_CHARS / chars) if self.min_val_docs and chars else 0.0
        return max(self.val_fraction, floor)

    def cap(self, chars: int) -> float:
        """Longest document that may be held out whole (non-decreasing in ``chars``)."""
        return min(2.0 * self.share(chars), 0.5) * chars

    def tail(self, length: int, chars: int) -> int:
        """Characters of the val tail of a document of ``length`` in a corpus of ``chars``; 0: not cut."""
        t = round(self.share(chars) * length)
        return t if length > self.cap(chars) and _MIN_TAIL_CHARS <= t < length else 0

    def may_cut(self, length: int, chars_so_far: int) -> bool:
        """False only for documents that :meth:`tail` will not cut, whatever the final corpus size: cap only
        grows and share only shrinks as more text is read."""
        # One character of slack each way: float rounding must never settle a document pass 2 will cut.
        return (
            length + 1 > self.cap(chars_so_far) and self.share(chars_so_far) * length + 1 >= _MIN_TAIL_CHARS
        )


def _tail_start(doc: str, t: int) -> int:
    """Where the val tail of about ``t`` characters starts: the line start nearest to ``len - t`` within
    ``t/2`` (so the tail is t/2..3t/2, t on average), else exactly there."""
    n = len(doc)
    target = n - t
    lo, hi = max(1, target - t // 2), min(n - 1, target + t // 2)
    cut = target
    before = doc.rfind("\n", lo - 1, target)  # a newline at k: the next line starts at k + 1
    after = doc.find("\n", target, hi)
    if before >= 0:
        cut = before + 1
    if after >= 0 and (before < 0 or after + 1 - target < target - cut):
        cut = after + 1
    return min(max(cut, 1), n - 1)


@dataclass
class Plan:
    """What pass 1 decided: documents per source, the split, and the BPE training text."""

    n_docs: list[int]
    stats: list[SourceStats]
    truncated: list[bool]
    chars: int
    rule: SplitRule
    forced_val: set[tuple[int, int]]  # short documents promoted to val so that min_val_docs hold
    forced_train: set[tuple[int, int]]  # kept in train so that one training document remains
    n_cut: int  # long documents cut into a train head and a val tail
    train_texts: list[str]

    def label(self, i: int, j: int, doc: str, u: float) -> tuple[str, int]:
        """("cut", where the val tail starts) | ("val", 0) | ("train", 0) for document ``j`` of source ``i``
        whose lottery draw is ``u``: the one decision both passes share."""
        t = self.rule.tail(len(doc), self.chars)
        if t:
            return "cut", _tail_start(doc, t)
        if (i, j) in self.forced_train:
            return "train", 0
        if u < self.rule.val_fraction or (i, j) in self.forced_val:
            return "val", 0
        return "train", 0

    def describe(self) -> str:
        if not self.n_cut:
            return "documents"
        s = self.rule.share(self.chars)
        return (
            f"documents, and the last {s:.2%} of each of the {self.n_cut} document(s) longer than "
            f"{self.rule.cap(self.chars):,.0f} characters"
        )

    def record(self) -> dict[str, Any]:
        """The decisions, as JSON (the BPE text aside): what a resumed build reads back by :meth:`from_record`."""
        return {
            "n_docs": self.n_docs,
            "stats": [st.as_dict() for st in self.stats],
            "truncated": self.truncated,
            "chars": self.chars,
            "forced_val": sorted(self.forced_val),
            "forced_train": sorted(self.forced_train),
            "n_cut": self.n_cut,
        }

    @classmethod
    def from_record(cls, rec: dict[str, Any], rule: SplitRule) -> Plan:
        return cls(
            rec["n_docs"],
            [SourceStats(**d) for d in rec["stats"]],
            rec["truncated"],
            rec["chars"],
            rule,
            {tuple(x) for x in rec["forced_val"]},
            {tuple(x) for x in rec["forced_train"]},
            rec["n_cut"],
            [],
        )


def _cut_utf8(doc: str, keep: int) -> str:
    """The first ``keep`` UTF-8 bytes of ``doc`` (whole characters), ended at a line end when one is in the
    second half."""
    if keep <= 0:
        return ""
    head = doc.encode("utf-8", "surrogatepass")[:keep].decode("utf-8", "ignore")
    nl = head.rfind("\n")
    return head[: nl + 1] if nl >= len(head) // 2 else head


class SourceChanged(DataError):
    """A source edited while prepare read it: the work done is of a corpus that no longer exists."""


def changed_while_prepared(path: Path) -> SourceChanged:
    """The error of a source edited between the two passes of prepare (its shards would not be what was planned)."""
    return SourceChanged(
        f"{path} changed while it was being prepared (edited, added or removed files); run the command again "
        f"once it is no longer being written"
    )


class Reader:
    """The documents of each source in reading order, and their lottery draws: what both passes read."""

    def __init__(self, paths: list[Path], settings: dict[str, Any], exts: tuple[str, ...]) -> None:
        self.paths, self.exts = paths, exts
        self.text_field: str = settings["text_field"]
        self.seed: int = settings["seed"]
        self.max_bytes: int | None = settings["max_bytes"]
        self.capped: set[int] = set()  # sources whose reading stopped at max_bytes

    def docs(self, i: int, stats: SourceStats | None = None) -> Iterator[str]:
        """Source ``i``'s documents, the one that crosses ``max_bytes`` cut there (both passes read the same)."""
        st = stats if stats is not None else SourceStats()
        docs = iter_documents(self.paths[i], text_field=self.text_field, extensions=self.exts, stats=st)
        if self.max_bytes is None:
            yield from docs
            return
        start = st.bytes_read
        try:
            for doc in docs:
                over = st.bytes_read - start - self.max_bytes
                if over > 0:  # a long document (a 1 MB piece of a big file, say) would overshoot the cap
                    size = len(doc.encode("utf-8", "surrogatepass"))
                    doc = _cut_utf8(doc, size - over)
                    st.bytes_read -= size - len(doc.encode("utf-8", "surrogatepass"))
                    # (a JSONL line's syntax counts too, but only its text is cut: at most the cap either way)
                    st.bytes_read = min(st.bytes_read, start + self.max_bytes)
                if st.bytes_read - start >= self.max_bytes or over > 0:
                    self.capped.add(i)
                    if doc.strip():
                        yield doc
                    else:
                        st.docs -= 1
                    return
                yield doc
        finally:
            docs.close()
            # blank text after the last document (a whitespace-only file, blank lines) is counted past the cap,
            # though none of it is read
            st.bytes_read = min(st.bytes_read, start + self.max_bytes)

    def draw(self, i: int, j: int, doc: str) -> float:
        return _doc_u(self.seed, i, j, doc)


def scan(reader: Reader, settings: dict[str, Any], train_bpe: bool, advance: Callable[[int], None]) -> Plan:
    """Pass 1: count documents and characters (up to max_bytes), draw the split, collect BPE training text
    (when ``train_bpe``). ``advance(chars)`` is called after each document (a progress bar)."""
    scanner = _Scanner(reader, settings, train_bpe, advance)
    for i in range(len(reader.paths)):
        scanner.read(i)
    return scanner.plan()


class _Scanner:
    """Pass 1's running state. Documents that cannot be cut whatever the final corpus size
    (:meth:`SplitRule.may_cut` is False: nearly all of them) are settled as they are read, the few others
    are remembered and settled by :meth:`plan`."""

    def __init__(
        self, reader: Reader, settings: dict[str, Any], train_bpe: bool, advance: Callable[[int], None]
    ) -> None:
        self.reader, self.train_bpe, self.advance = reader, train_bpe, advance
        self.rule = SplitRule(settings["val_fraction"], settings["min_val_docs"])
        self.min_val_docs: int = settings["min_val_docs"]
        self.per_source_train_chars: int = settings["tokenizer_train_bytes"] // len(reader.paths)
        self.n_docs: list[int] = []
        self.stats: list[SourceStats] = []
        self.truncated: list[bool] = []
        self.chars = 0
        self.n_val = 0  # short documents that drew val
        self.top_val: tuple[float, int, int] | None = None  # the one with the largest draw
        # The short train documents with the smallest draws, promoted to val when fewer than min_val_docs
        # documents gave val text: a max-heap (draws negated) of size min_val_docs keeps memory O(min_val_docs).
        self.smallest: list[tuple[float, int, int]] = []
        self.maybe_long: list[tuple[float, int, int, int]] = []  # (draw, source, index, length)
        self.texts: list[tuple[int, int, str]] = []

    def read(self, i: int) -> None:
        """Read source ``i`` (up to max_bytes)."""
        st = SourceStats()
        n, collected = 0, 0
        for doc in self.reader.docs(i, st):
            u = self.reader.draw(i, n, doc)
            self.chars += len(doc)
            if self.rule.may_cut(len(doc), self.chars):
                self.maybe_long.append((u, i, n, len(doc)))
            else:
                self._settle_short(u, i, n)
            if self.train_bpe and collected < self.per_source_train_chars:
                self.texts.append((i, n, doc))  # val text is filtered out by plan(), once the split is known
                collected += len(doc)
            n += 1
            self.advance(len(doc))
        self.n_docs.append(n)
        self.stats.append(st)
        self.truncated.append(i in self.reader.capped)

    def _settle_short(self, u: float, i: int, j: int) -> None:
        if u < self.rule.val_fraction:
            self.n_val += 1
            if self.top_val is None or u > self.top_val[0]:
                self.top_val = (u, i, j)
        elif self.min_val_docs:
            item = (-u, i, j)
            if len(self.smallest) < self.min_val_docs:
                heapq.heappush(self.smallest, item)
            elif item > self.smallest[0]:
                heapq.heapreplace(self.smallest, item)

    def plan(self) -> Plan:
        """Settle the remembered documents once the corpus size is known; the split and the BPE text."""
        total = sum(self.n_docs)
        if total == 0:
            raise DataError("the corpus has no documents; pass a non-empty source")
        n_cut = 0
        for u, i, j, length in self.maybe_long:
            if self.rule.tail(length, self.chars):
                n_cut += 1
            else:
                self._settle_short(u, i, j)
        forced_val, forced_train = self._forced(total, n_cut)
        plan = Plan(
            self.n_docs,
            self.stats,
            self.truncated,
            self.chars,
            self.rule,
            forced_val,
            forced_train,
            n_cut,
            [],
        )
        for i, j, doc in self.texts:
            kind, at = plan.label(i, j, doc, self.reader.draw(i, j, doc))
            if kind != "val":
                plan.train_texts.append(doc[:at] if kind == "cut" else doc)
        return plan

    def _forced(self, total: int, n_cut: int) -> tuple[set[tuple[int, int]], set[tuple[int, int]]]:
        """(documents promoted to val so that min_val_docs hold, the one kept in train when all would be val)."""
        need = max(0, self.min_val_docs - self.n_val - n_cut)
        forced_val = {
            (i, j) for _, i, j in sorted(self.smallest, reverse=True)[:need]
        }  # smallest draws first
        forced_train: set[tuple[int, int]] = set()
        if (
            not n_cut and self.n_val + len(forced_val) >= total
        ):  # everything would be val: keep one for training
            if forced_val:
                forced_val.discard(
                    next((i, j) for _, i, j in sorted(self.smallest))
                )  # the largest forced draw
            elif self.top_val is not None:
                forced_train.add(self.top_val[1:])
        return forced_val, forced_train
