"""A dataset cached under the same key but read past ``data.max_bytes`` is not served as if capped."""

from __future__ import annotations

import json
from pathlib import Path

from gptoughts.data import prepare


def test_a_dataset_read_past_max_bytes_under_its_key_is_rebuilt(tmp_path: Path) -> None:
    # Before data.max_bytes cut the document crossing it, that document was kept whole under the same cache key: a
    # 20 KB file with max_bytes 1000 gave all 20 KB. Such a folder is made here by giving an uncapped build the
    # key and settings of the capped one.
    src = tmp_path / "book.txt"
    src.write_text("".join(f"line {k} of a single document\n" for k in range(700)), encoding="utf-8")
    capped = prepare([src], tmp_path / "capped", "bytes", progress=False, max_bytes=1000)
    out = tmp_path / "out"
    whole = prepare([src], out, "bytes", progress=False)
    record = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
    record["cache_key"], record["settings"] = capped.cache_key, capped.settings
    record["sources"][0]["truncated"] = True
    (out / "manifest.json").write_text(json.dumps(record), encoding="utf-8")
    assert whole.sources[0].bytes > 1000

    again = prepare([src], out, "bytes", progress=False, max_bytes=1000)
    assert again.sources[0].bytes <= 1000
    assert again.train_tokens + again.val_tokens == capped.train_tokens + capped.val_tokens


def test_a_capped_source_ending_in_blank_text_past_the_cap_is_reused(tmp_path: Path) -> None:
    # the blank file after the last document counts its bytes past the cap, though nothing of it is read
    src = tmp_path / "c"
    src.mkdir()
    (src / "a.txt").write_text("x" * 990, encoding="utf-8")
    (src / "b.txt").write_text(" " * 50, encoding="utf-8")
    prepare([src], tmp_path / "o", "bytes", progress=False, max_bytes=1000)
    made = (tmp_path / "o" / "manifest.json").stat()
    prepare([src], tmp_path / "o", "bytes", progress=False, max_bytes=1000)
    again = (tmp_path / "o" / "manifest.json").stat()
    assert (again.st_ino, again.st_mtime_ns) == (
        made.st_ino,
        made.st_mtime_ns,
    )  # reused, not rebuilt every run
