from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest

from gptoughts.data.sources import CHUNK_BYTES, SourceStats, iter_documents, source_kind
from gptoughts.errors import DataError


def read(path: Path | str, **kw) -> tuple[list[str], SourceStats]:
    stats = SourceStats()
    return list(iter_documents(path, stats=stats, **kw)), stats


def test_text_file_is_one_document(tmp_path: Path) -> None:
    p = tmp_path / "a.md"
    p.write_text("# hello\nworld\n")
    docs, st = read(p)
    assert docs == ["# hello\nworld\n"]
    assert (st.files_read, st.docs, st.bytes_read) == (1, 1, len("# hello\nworld\n"))
    assert source_kind(p) == "text"


def test_large_text_file_is_cut_at_newlines(tmp_path: Path) -> None:
    line = "é" * 50 + "\n"  # multi-byte characters: cuts must respect UTF-8
    text = line * (3 * CHUNK_BYTES // len(line.encode()))
    p = tmp_path / "big.txt"
    p.write_text(text, encoding="utf-8")
    docs, st = read(p)
    assert len(docs) >= 3
    assert "".join(docs) == text
    assert all(d.endswith("\n") for d in docs)
    assert all(len(d.encode()) <= CHUNK_BYTES for d in docs)
    assert st.docs == len(docs) and st.replaced_chars == 0


def test_folder_recursive_sorted_filtered_and_binary_skipped(tmp_path: Path) -> None:
    root = tmp_path / "src"
    (root / "b_dir").mkdir(parents=True)
    (root / "a.py").write_text("print('a')\n")
    (root / "b_dir" / "c.txt").write_text("c text\n")
    (root / "z.rst").write_text("z\n")
    (root / "image.png").write_bytes(b"\x89PNG\0\0")  # extension not listed: ignored, not counted
    (root / "blob.txt").write_bytes(b"abc\0def")  # listed extension but binary: skipped and counted
    (root / ".hidden").mkdir()
    (root / ".hidden" / "h.txt").write_text("hidden\n")
    (root / "__pycache__").mkdir()
    (root / "__pycache__" / "x.py").write_text("cached\n")
    (root / "empty.md").write_text("")
    docs, st = read(root)
    assert docs == ["print('a')\n", "z\n", "c text\n"]  # root files first (sorted), then sub-folders
    assert st.skipped_binary == 1 and st.skipped_empty == 1 and st.files_read == 4
    docs2, _ = read(root, extensions=["py"])
    assert docs2 == ["print('a')\n"]
    assert source_kind(root) == "folder"


def test_folder_of_binary_files_only_is_an_error(tmp_path: Path) -> None:
    root = tmp_path / "bin"
    root.mkdir()
    for k in range(3):
        (root / f"f{k}.txt").write_bytes(b"\0\1\2")
    with pytest.raises(DataError, match="all 3 candidate file"):
        read(root)


def test_folder_without_matching_files_hints_extensions(tmp_path: Path) -> None:
    root = tmp_path / "pq"
    root.mkdir()
    pq.write_table(pa.table({"text": ["x"]}), root / "part.parquet")
    with pytest.raises(DataError, match="add parquet to --extensions"):
        read(root)
    docs, _ = read(root, extensions=["parquet"])
    assert docs == ["x"]


def test_missing_path() -> None:
    with pytest.raises(
        DataError, match="does not exist; pass a file, folder, .jsonl, .parquet or a saved HF"
    ):
        read("/no/such/corpus")


def test_invalid_utf8_is_replaced_and_counted(tmp_path: Path) -> None:
    p = tmp_path / "bad.txt"
    p.write_bytes(b"ok \xff\xfe here \xef\xbf\xbd genuine")  # 2 invalid bytes + a genuine U+FFFD
    docs, st = read(p)
    assert docs == ["ok \ufffd\ufffd here \ufffd genuine"]
    assert st.invalid_utf8_files == 1 and st.replaced_chars == 2


def test_jsonl(tmp_path: Path) -> None:
    p = tmp_path / "d.jsonl"
    p.write_text('{"text": "one", "id": 1}\n\n{"text": "two"}\n{"text": null}\n')
    docs, st = read(p)
    assert docs == ["one", "two"] and st.skipped_empty == 1
    assert source_kind(p) == "jsonl"
    docs, _ = read(p.with_name("d.jsonl"), text_field="text")
    assert docs == ["one", "two"]


def test_jsonl_missing_field_names_line_and_keys(tmp_path: Path) -> None:
    p = tmp_path / "d.jsonl"
    p.write_text('{"text": "one"}\n{"content": "two", "id": 2}\n')
    with pytest.raises(DataError, match=r"d.jsonl:2 has no field 'text' \(available keys: content, id\)"):
        read(p)
    p.write_text('{"text": "one"}\nnot json\n')
    with pytest.raises(DataError, match=r"d.jsonl:2 is not valid JSON"):
        read(p)


def test_parquet(tmp_path: Path) -> None:
    p = tmp_path / "d.parquet"
    table = pa.table({"content": [f"doc {i}" for i in range(2500)] + [None], "n": list(range(2501))})
    pq.write_table(table, p, row_group_size=1000)
    docs, st = read(p, text_field="content")
    assert docs == [f"doc {i}" for i in range(2500)]
    assert st.skipped_empty == 1 and st.bytes_read == sum(len(d) for d in docs)
    with pytest.raises(DataError, match=r"no column 'text' \(columns: content, n\)"):
        read(p)


def test_a_categorical_parquet_text_column_is_read_as_text(tmp_path: Path) -> None:
    # pandas writes a category column as a dictionary of strings: it was refused as "not string"
    p = tmp_path / "d.parquet"
    texts = ["spam", "eggs", "spam", None]
    pq.write_table(pa.table({"text": pa.array(texts).dictionary_encode()}), p)
    docs, st = read(p)
    assert docs == ["spam", "eggs", "spam"] and st.skipped_empty == 1


def _write_arrow_stream(path: Path, texts: list[str]) -> None:
    table = pa.table({"text": texts, "label": list(range(len(texts)))})
    with pa.OSFile(str(path), "wb") as sink, ipc.new_stream(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=2):
            writer.write_batch(batch)


def _write_hf_dataset(folder: Path, shards: list[list[str]]) -> None:
    """What datasets.Dataset.save_to_disk writes: arrow IPC streams + state.json + dataset_info.json."""
    folder.mkdir(parents=True)
    files = []
    for k, texts in enumerate(shards):
        name = f"data-{k:05d}-of-{len(shards):05d}.arrow"
        _write_arrow_stream(folder / name, texts)
        files.append({"filename": name})
    (folder / "state.json").write_text(json.dumps({"_data_files": files, "_split": None}))
    (folder / "dataset_info.json").write_text(json.dumps({"features": {"text": {"dtype": "string"}}}))


def test_saved_hf_dataset(tmp_path: Path) -> None:
    ds = tmp_path / "hf"
    _write_hf_dataset(ds, [["a", "b", "c"], ["d", "e"]])
    assert source_kind(ds) == "hf_dataset"
    docs, st = read(ds)
    assert docs == ["a", "b", "c", "d", "e"] and st.files_read == 2


def test_saved_hf_dataset_dict_reads_train(tmp_path: Path) -> None:
    dd = tmp_path / "dd"
    _write_hf_dataset(dd / "train", [["t1", "t2"]])
    _write_hf_dataset(dd / "test", [["x"]])
    (dd / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    assert source_kind(dd) == "hf_dataset"
    docs, _ = read(dd)
    assert docs == ["t1", "t2"]
    with pytest.raises(DataError, match="no column 'body'"):
        read(dd, text_field="body")


def test_a_dataset_prepared_inside_a_saved_dataset_keeps_its_key(tmp_path: Path) -> None:
    """A saved dataset's key covered every file below it: a prepare into a folder inside it was refused as "changed
    while it was being prepared" (its own build folder changed the key), and a run inside it re-tokenized each time."""
    from gptoughts.data import prepare
    from gptoughts.data.sources import source_fingerprint

    ds = tmp_path / "hf"
    _write_hf_dataset(ds, [["a b c " * 50, "d e f " * 50]])
    before = source_fingerprint(ds)
    m = prepare([ds], ds / "prepared", "bytes", progress=False, val_fraction=0.0)
    (ds / "runs" / "r").mkdir(parents=True)
    (ds / "runs" / "r" / "metrics.jsonl").write_text("{}\n")
    assert source_fingerprint(ds) == before
    assert prepare([ds], ds / "prepared", "bytes", progress=False, val_fraction=0.0).created == m.created
    (ds / "data-00000-of-00001.arrow").unlink()
    _write_arrow_stream(ds / "data-00000-of-00001.arrow", ["another text"])
    assert source_fingerprint(ds) != before  # the data itself still is its key


@pytest.mark.parametrize("listed", ["../other/data-00000-of-00001.arrow", "ABSOLUTE", "sub/../../x.arrow"])
def test_a_saved_dataset_reads_no_file_outside_its_folder(tmp_path: Path, listed: str) -> None:
    """state.json names the files to read: one outside the folder was read, though not in the folder's
    fingerprint (edits to it never invalidated the cache)."""
    _write_hf_dataset(tmp_path / "other", [["secret"]])
    ds = tmp_path / "hf"
    _write_hf_dataset(ds, [["a"]])
    if listed == "ABSOLUTE":
        listed = str(tmp_path / "other" / "data-00000-of-00001.arrow")
    (ds / "state.json").write_text(json.dumps({"_data_files": [{"filename": listed}]}))
    with pytest.raises(DataError, match=r"state.json lists .*, outside .*hf; copy that file into"):
        read(ds)


def test_jsonl_lone_surrogates_are_replaced(tmp_path: Path) -> None:
    p = tmp_path / "s.jsonl"
    p.write_text('{"text": "a\\ud800b \\ud83d\\ude00"}\n')  # a lone surrogate, then a valid pair
    docs, st = read(p)
    assert docs == ["a\ufffdb \U0001f600"]
    assert st.replaced_chars == 1 and st.invalid_utf8_files == 1


def test_broken_symlink_in_a_folder_is_skipped(tmp_path: Path) -> None:
    from gptoughts.data.sources import source_fingerprint

    root = tmp_path / "src"
    root.mkdir()
    (root / "a.txt").write_text("hello\n")
    (root / "b.txt").symlink_to(tmp_path / "nowhere.txt")
    docs, _ = read(root)
    assert docs == ["hello\n"]
    source_fingerprint(root)  # stats every file: a dangling link used to raise FileNotFoundError


def test_jsonl_with_a_byte_order_mark(tmp_path: Path) -> None:
    p = tmp_path / "bom.jsonl"
    p.write_bytes(b'\xef\xbb\xbf{"text": "first"}\n{"text": "second"}\n')
    docs, _ = read(p)
    assert docs == ["first", "second"]


def test_unreadable_file_is_a_data_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import gptoughts.data.sources as sources

    p = tmp_path / "secret.txt"
    p.write_text("x")

    def denied(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(sources, "open", denied, raising=False)  # tests run as root: chmod would not do
    with pytest.raises(DataError, match=rf"cannot read {p} \(Permission denied\); fix its permissions"):
        read(p)


def test_corrupt_parquet_and_arrow_files_are_data_errors(tmp_path: Path) -> None:
    p = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": [f"row {i} " * 20 for i in range(5000)]}), p)
    raw = bytearray(p.read_bytes())
    raw[200:4000] = b"\xab" * 3800  # data pages: the footer still opens, reading the rows fails
    p.write_bytes(bytes(raw))
    with pytest.raises(DataError, match=f"{p} is not a readable parquet file"):
        read(p)
    ds = tmp_path / "hf"
    _write_hf_dataset(ds, [[f"row {i}" for i in range(100)]])
    arrow = next(ds.glob("*.arrow"))
    raw = bytearray(arrow.read_bytes())
    raw[100:400] = b"\xff" * 300
    arrow.write_bytes(bytes(raw))
    with pytest.raises(DataError, match=f"{arrow} is not a readable arrow file"):
        read(ds)
