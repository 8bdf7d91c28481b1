"""Tiny corpora written on the fly, and a prepared byte-level dataset."""

from __future__ import annotations

import string
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest


def _make_docs(n: int, size: int = 200, seed: int = 0) -> list[str]:
    """``n`` distinct documents; each starts with a unique marker ``<doc-k>`` so splits can be audited."""
    rng = np.random.default_rng(seed)
    letters = np.array(list(string.ascii_lowercase + "     \n"))
    return [f"<doc-{k}> " + "".join(rng.choice(letters, size)) for k in range(n)]


def _write_folder(root: Path, docs: list[str], ext: str = "txt") -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for k, d in enumerate(docs):
        (root / f"doc_{k:04d}.{ext}").write_text(d, encoding="utf-8")
    return root


# Helpers as fixtures (not imported from this module, whose name is shared with other conftest files).
@pytest.fixture
def make_docs() -> Callable[..., list[str]]:
    return _make_docs


@pytest.fixture
def write_folder() -> Callable[..., Path]:
    return _write_folder


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """A folder of 40 text documents of ~200 bytes."""
    return _write_folder(tmp_path / "corpus", _make_docs(40))


@pytest.fixture
def bytes_dataset(tmp_path: Path, corpus: Path) -> Path:
    """``corpus`` prepared with the bytes tokenizer (~8 K train tokens)."""
    from gptoughts.data import prepare

    out = tmp_path / "prepared"
    prepare([corpus], out, "bytes", progress=False, val_fraction=0.1)
    return out
