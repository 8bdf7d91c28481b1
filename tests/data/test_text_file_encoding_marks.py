"""What Windows editors put in text files that is not text: the UTF-8 byte order mark."""

from __future__ import annotations

from pathlib import Path

from gptoughts.data.sources import SourceStats, iter_documents


def test_a_text_file_byte_order_mark_is_not_part_of_its_document(tmp_path: Path) -> None:
    # Notepad's "UTF-8 with BOM": the mark was trained on as the start of every document (3 byte tokens), where
    # the same text in a .jsonl lost it
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "a.txt").write_bytes(b"\xef\xbb\xbfHello\r\nworld\r\n")
    (folder / "b.txt").write_bytes(b"\xef\xbb\xbf")  # a mark alone is an empty file
    (folder / "c.md").write_bytes("caf\u00e9\n".encode())
    stats = SourceStats()
    docs = list(iter_documents(folder, stats=stats))
    assert docs == ["Hello\r\nworld\r\n", "caf\u00e9\n"]
    assert stats.skipped_empty == 1
    assert stats.bytes_read == sum(
        f.stat().st_size for f in folder.iterdir()
    )  # the file's bytes, mark included


def test_a_large_text_file_loses_only_its_leading_byte_order_mark(tmp_path: Path) -> None:
    src = tmp_path / "big.txt"
    line = "a zero width no-break space (\ufeff) inside a line\n"
    src.write_bytes(b"\xef\xbb\xbf" + (line * 40_000).encode())  # ~1.7 MB: read in ~1 MB documents
    docs = list(iter_documents(src))
    assert len(docs) > 1
    assert docs[0].startswith(
        "a zero width"
    )  # (whole texts compared as booleans: a failure's diff is 1.7 MB)
    assert ("".join(docs) == line * 40_000) is True
