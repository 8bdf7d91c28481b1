"""File names as corpora bring them: accents, emoji and spaces, and names that are not UTF-8 at all (Latin-1 bytes
from an old archive, which Python keeps as surrogates)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from gptoughts.data import prepare
from gptoughts.data.sources import resolve_source
from gptoughts.errors import DataError

pytestmark = pytest.mark.skipif(
    sys.platform != "linux", reason="needs a filesystem that takes any bytes as a file name"
)


def _latin1_name(folder: Path, stem: bytes, text: str) -> Path:
    """A file in ``folder`` whose name holds the Latin-1 byte of 'é' (not UTF-8)."""
    path = Path(os.fsdecode(os.fsencode(folder) + b"/" + stem + b"\xe9.txt"))
    path.write_text(text, encoding="utf-8")
    return path


def test_a_folder_with_unicode_and_non_utf8_file_names_is_prepared(tmp_path: Path) -> None:
    corpus = tmp_path / "données été"
    (corpus / "sous dossier ☕").mkdir(parents=True)
    (corpus / "sous dossier ☕" / "café.txt").write_text("bonjour le monde, où est la gare ?\n")
    _latin1_name(corpus, b"caf", "un autre document\n")
    m = prepare([corpus], tmp_path / "out", "bytes", progress=False, val_fraction=0.0)
    assert m.totals["docs"] == 2 and m.sources[0].path == str(corpus)


def test_a_source_whose_own_name_is_not_utf8_is_refused_in_one_line(tmp_path: Path) -> None:
    """config.toml (UTF-8) could not record it: the run stopped with a traceback after preparing."""
    src = _latin1_name(tmp_path, b"lat", "du texte\n")
    with pytest.raises(DataError) as e:
        resolve_source(src)
    line = str(e.value)
    assert "\n" not in line and "lat\ufffd.txt" in line and "not UTF-8" in line and "rename it" in line, line
    line.encode("utf-8")  # printable as it is
