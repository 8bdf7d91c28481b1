"""A folder holding a saved Hugging Face dataset (datasets' save_to_disk) beside text files."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pyarrow as pa
import pytest

from gptoughts.data.sources import iter_documents


def _save_dataset(folder: Path, texts: list[str]) -> None:
    """What datasets.Dataset.save_to_disk writes: an arrow IPC stream + state.json + dataset_info.json."""
    folder.mkdir(parents=True)
    table = pa.table({"text": texts})
    with (
        pa.OSFile(str(folder / "data-00000-of-00001.arrow"), "wb") as f,
        pa.ipc.new_stream(f, table.schema) as w,
    ):
        w.write_table(table)
    (folder / "state.json").write_text(
        json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]})
    )
    (folder / "dataset_info.json").write_text(json.dumps({"features": {"text": {"dtype": "string"}}}))


def test_its_metadata_is_not_read_as_text_and_a_warning_names_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # `--data data` with data/wiki saved by datasets: the two JSON files of wiki were trained on as documents, its
    # articles (in .arrow) were not, and only an info line counted "1 .arrow" among the files not read
    data = tmp_path / "data"
    (data / "books").mkdir(parents=True)
    (data / "books" / "b.txt").write_text("a book\n", encoding="utf-8")
    _save_dataset(data / "wiki", ["an article"])
    with caplog.at_level(logging.INFO, logger="gptoughts.data"):
        docs = list(iter_documents(data))
    assert docs == ["a book\n"]
    said = [r for r in caplog.records if "wiki" in r.getMessage()]
    assert (
        said
        and said[0].levelno == logging.WARNING
        and "wiki (a saved Hugging Face dataset" in said[0].getMessage()
    )
    assert list(iter_documents(data / "wiki")) == ["an article"]
