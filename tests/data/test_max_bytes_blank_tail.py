"""data.max_bytes counts the text read: blank text after the last document adds nothing past the cap."""

from __future__ import annotations

from pathlib import Path

from gptoughts.data import prepare


def test_blank_text_after_the_last_document_is_not_counted_past_the_cap(tmp_path: Path) -> None:
    src = tmp_path / "c"
    src.mkdir()
    (src / "a.txt").write_text("x" * 990, encoding="utf-8")
    (src / "b.txt").write_text(" " * 50, encoding="utf-8")  # read as nothing: recorded as 1040 bytes of 1000
    m = prepare([src], tmp_path / "o", "bytes", progress=False, max_bytes=1000)
    assert m.sources[0].bytes == 1000
    assert not m.sources[0].truncated
