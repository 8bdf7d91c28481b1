"""A .json file given as a source that holds JSON Lines (datasets' to_json writes them under that name)."""

from __future__ import annotations

import json
from pathlib import Path

from gptoughts.data.sources import iter_documents, source_kind


def test_json_lines_in_a_json_file_are_read_as_records(tmp_path: Path) -> None:
    # `--data train.json` from Dataset.to_json("train.json"): one document of raw JSON, braces, keys and \\n escapes
    # trained on, and the records run together
    src = tmp_path / "train.json"
    src.write_text(
        "".join(json.dumps({"text": t}) + "\n" for t in ("first\nrecord", "second")), encoding="utf-8"
    )
    assert source_kind(src) == "jsonl"
    assert list(iter_documents(src)) == ["first\nrecord", "second"]


def test_other_json_files_are_still_text(tmp_path: Path) -> None:
    pretty = tmp_path / "config.json"
    pretty.write_text(json.dumps({"a": 1, "b": [1, 2]}, indent=2), encoding="utf-8")
    array = tmp_path / "list.json"
    array.write_text(json.dumps([{"text": "x"}]), encoding="utf-8")
    folder = tmp_path / "code"
    folder.mkdir()
    (folder / "records.json").write_text(json.dumps({"text": "kept as code"}) + "\n", encoding="utf-8")
    assert source_kind(pretty) == source_kind(array) == "text"
    assert list(iter_documents(folder)) == [(folder / "records.json").read_text(encoding="utf-8")]
