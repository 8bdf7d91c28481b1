"""Corpora as a newcomer brings them: mixed folders, compressed files, a corpus edited while it is prepared."""

from __future__ import annotations

import gzip
import importlib
import json
import logging
import re
from pathlib import Path

import pytest

from gptoughts.data.prepare import prepare
from gptoughts.data.sources import DEFAULT_EXTENSIONS, iter_documents
from gptoughts.errors import DataError


def _jsonl(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(n)))
    return path


def test_a_corpus_shrunk_while_prepared_is_a_one_line_error(tmp_path: Path, monkeypatch) -> None:
    # pass 2 re-reads the sources: a file that lost documents since pass 1 was a RuntimeError (StopIteration)
    prep = importlib.import_module("gptoughts.data.prepare")
    src = _jsonl(tmp_path / "c.jsonl", 50)
    original = prep._new_tokenizer

    def edit_then_train(*a, **k):
        _jsonl(src, 10)
        return original(*a, **k)

    monkeypatch.setattr(prep, "_new_tokenizer", edit_then_train)
    with pytest.raises(
        DataError, match=r"c\.jsonl changed while it was being prepared.*run the command again"
    ):
        prepare([src], tmp_path / "o", "bpe:300", progress=False, workers=1)
    assert not (tmp_path / "o").exists()


def test_a_corpus_edited_while_prepared_is_not_installed(tmp_path: Path, monkeypatch) -> None:
    # the same number of documents, other text: the shards would hold text the key (its stat) does not describe
    prep = importlib.import_module("gptoughts.data.prepare")
    src = _jsonl(tmp_path / "c.jsonl", 20)
    original = prep._new_tokenizer

    def edit_then_train(*a, **k):
        src.write_text("".join(json.dumps({"text": f"other {i} " * 30}) + "\n" for i in range(20)))
        return original(*a, **k)

    monkeypatch.setattr(prep, "_new_tokenizer", edit_then_train)
    with pytest.raises(DataError, match="changed while it was being prepared"):
        prepare([src], tmp_path / "o", "bpe:300", progress=False, workers=1)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("name", ["notes.txt.gz", "data.jsonl.gz"])
def test_a_compressed_file_says_decompress_it(tmp_path: Path, name: str) -> None:
    # was: "all 1 candidate file(s) are binary ...; pass text files or set --extensions" (extensions are for folders)
    p = tmp_path / name
    with gzip.open(p, "wt") as f:
        f.write("hello world\n" * 100)
    with pytest.raises(DataError) as e:
        list(iter_documents(p))
    msg = str(e.value)
    assert "gzip" in msg and "gunzip" in msg and "--extensions" not in msg


def test_a_single_binary_file_does_not_advise_extensions(tmp_path: Path) -> None:
    p = tmp_path / "image.png"
    p.write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR" + bytes(range(256)) * 8)
    with pytest.raises(DataError, match=r"image\.png is a binary file") as e:
        list(iter_documents(p))
    assert "--extensions" not in str(e.value)


def test_jsonl_line_missing_the_field_others_have_says_fix_that_line(tmp_path: Path) -> None:
    # was: "pass --text_field with one of them" naming the odd line's keys, while every other line has "text"
    p = tmp_path / "c.jsonl"
    lines = [{"text": "fine"}] * 3 + [{"body": "odd one"}] + [{"text": "fine"}]
    p.write_text("".join(json.dumps(r) + "\n" for r in lines))
    with pytest.raises(DataError) as e:
        list(iter_documents(p))
    msg = str(e.value)
    assert "c.jsonl:4 has no field 'text'" in msg and "fix or remove that line" in msg
    assert "--text_field" not in msg
    # the first line lacking it still suggests another field
    p.write_text(json.dumps({"content": "x"}) + "\n")
    with pytest.raises(DataError, match="pass --text_field with one of them"):
        list(iter_documents(p))


def test_a_folder_says_which_files_it_does_not_read(tmp_path: Path, caplog) -> None:
    # a .jsonl, .parquet, .csv or .gz beside the text files was skipped without a word
    root = tmp_path / "mix"
    root.mkdir()
    (root / "a.txt").write_text("some text " * 20)
    _jsonl(root / "records.jsonl", 3)
    (root / "table.csv").write_text("a,b\n1,2\n")
    (root / "more.csv").write_text("a,b\n1,2\n")
    (root / "c.txt.gz").write_bytes(gzip.compress(b"hello"))
    (root / "Makefile").write_text("all:\n")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "x.txt").write_text("linked text")
    (root / "linked").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (root / "broken.txt").symlink_to(tmp_path / "nowhere.txt")
    with caplog.at_level(logging.WARNING, logger="gptoughts.data"):
        docs = list(iter_documents(root))
    assert len(docs) == 1
    lines = [r.getMessage() for r in caplog.records if "not read" in r.getMessage()]
    assert len(lines) == 1, caplog.text
    line = lines[0]
    for part in ("2 .csv", "1 .gz", "1 .jsonl", "1 without extension"):
        assert part in line, line
    # --extensions replaces the default list: the command given keeps it and adds the readable format
    assert f"--extensions {','.join(DEFAULT_EXTENSIONS)},jsonl" in line, line
    assert "linked" in line and "symbolic link" in line and "broken.txt" in line
    assert "compressed files are never read: decompress them first" in line


def _rows(n: int) -> list[str]:
    return [f"row {i} " * 150 for i in range(n)]  # ~1 KB each


@pytest.mark.parametrize("kind", ["parquet", "arrow"])
def test_max_bytes_reads_as_much_of_a_columnar_source_as_asked(tmp_path: Path, kind: str) -> None:
    # the bytes of a whole record batch were counted before its first row: the cap stopped after one row
    # (811 tokens of a 100 KB cap) and the manifest said 1 MB was read
    import pyarrow as pa
    import pyarrow.ipc as ipc
    import pyarrow.parquet as pq

    table = pa.table({"text": _rows(1000)})
    if kind == "parquet":
        src = tmp_path / "big.parquet"
        pq.write_table(table, src)
    else:  # a datasets.save_to_disk folder: state.json beside IPC streams
        src = tmp_path / "ds"
        src.mkdir()
        with ipc.new_stream(str(src / "data-00000-of-00001.arrow"), table.schema) as w:
            w.write_table(table)
        (src / "state.json").write_text(
            json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]})
        )
        (src / "dataset_info.json").write_text("{}")
    m = prepare([src], tmp_path / "o", "bytes", progress=False, max_bytes=100_000)
    s = m.sources[0]
    assert s.truncated and 95_000 <= s.bytes <= 100_000, s.bytes
    assert 95_000 <= s.train_tokens + s.val_tokens - s.docs <= 100_000  # bytes tokens: one per byte, plus eos


def test_max_bytes_cuts_a_big_text_file_at_the_cap(tmp_path: Path) -> None:
    # a text file over 1 MB is read in ~1 MB documents: --max_bytes 30000 read 1 MB of it (the dry run said 30 KB)
    src = tmp_path / "one_line.txt"
    src.write_text("word " * 700_000)
    m = prepare([src], tmp_path / "o", "bytes", progress=False, max_bytes=30_000)
    s = m.sources[0]
    assert s.truncated and s.bytes == 30_000 and s.docs == 1
    assert s.train_tokens + s.val_tokens - 2 <= 30_000  # the head and the held-out tail each end with eos


def test_val_fraction_zero_holds_nothing_out(tmp_path: Path, corpus: Path) -> None:
    # --val_fraction 0 still held out ~1 KiB (10% of a small corpus): the floor meant for a tiny val_fraction
    from gptoughts.data.prepare import lookup_cached

    m = prepare([corpus], tmp_path / "o", "bytes", progress=False, val_fraction=0.0)
    assert m.val_tokens == 0 and m.totals["val_docs"] == 0 and m.totals["train_docs"] == 40
    assert prepare([corpus], tmp_path / "p", "bytes", progress=False, val_fraction=0.1).val_tokens > 0
    # train's cache lookup computes the same key as the prepare that filled it
    root = tmp_path / "cache"
    from gptoughts.data.prepare import cached_prepare

    filled = cached_prepare([corpus], "bytes", cache_root=root, progress=False, val_fraction=0.0)
    assert lookup_cached([corpus], "bytes", cache_root=root, val_fraction=0.0).dir == filled.dir


def _dry_run_corpus_line(tmp_path: Path, src: Path, capsys) -> str:
    from cli_helpers import FASTRUN, ok

    text = ok(
        ["train", "--size", "debug", *FASTRUN, "--data", str(src), "--tokenizer", "bytes", "--max_steps", "1",
         "--out", str(tmp_path / "run"), "--data.cache_dir", str(tmp_path / "cache"), "--dry_run"],
        capsys,
    )  # fmt: skip
    return next(ln for ln in text.splitlines() if "corpus:" in ln)


def test_a_dry_run_counts_the_split_a_dataset_dict_reads(tmp_path: Path, capsys) -> None:
    # a DatasetDict's train split is read; its test and validation splits were counted too (3x the tokens)
    import pyarrow as pa
    import pyarrow.ipc as ipc

    root = tmp_path / "dd"
    table = pa.table({"text": _rows(100)})
    for split in ("train", "test", "validation"):
        (root / split).mkdir(parents=True)
        with ipc.new_stream(str(root / split / "data-00000-of-00001.arrow"), table.schema) as w:
            w.write_table(table)
        (root / split / "state.json").write_text(
            json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]})
        )
    (root / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test", "validation"]}))
    line = _dry_run_corpus_line(tmp_path, root, capsys)
    text_bytes = sum(len(r.encode()) for r in _rows(100))
    assert "1 file(s)" in line and text_bytes <= _both_splits(line) < 1.2 * text_bytes, line


def test_a_dry_run_counts_the_text_of_a_parquet_file_not_its_compressed_size(tmp_path: Path, capsys) -> None:
    # parquet compresses text ~15x here: the dry run planned 68 K tokens for 1.2 M
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = tmp_path / "big.parquet"
    pq.write_table(pa.table({"text": _rows(1000), "id": list(range(1000))}), src)
    line = _dry_run_corpus_line(tmp_path, src, capsys)
    text_bytes = sum(len(r.encode()) for r in _rows(1000))
    assert text_bytes <= _both_splits(line) < 1.1 * text_bytes, line


def _both_splits(line: str) -> int:
    """The tokens a dry run's corpus line estimates, training and held-out together (one a byte here)."""
    m = re.search(r"≈([\d,]+) train tokens \+ ([\d,]+) held out", line)
    assert m, line
    return sum(int(g.replace(",", "")) for g in m.groups())


def test_a_source_given_twice_is_refused(tmp_path: Path, corpus: Path) -> None:
    # --data ed --data ./ed/ read the folder twice: every document trained on twice, and a held-out document of
    # one copy trained on in the other (the split's draw depends on the source's index)
    from gptoughts.data.prepare import lookup_cached

    for other in (str(corpus), str(corpus) + "/", str(corpus / "doc_0003.txt")):
        with pytest.raises(DataError, match="read twice"):
            prepare([corpus, other], tmp_path / "o", "bytes", progress=False)
        with pytest.raises(DataError, match="read twice"):  # a dry run's lookup
            lookup_cached([corpus, other], "bytes", cache_root=tmp_path / "cache")
    assert not (tmp_path / "o").exists()


def test_a_utf16_file_says_convert_it(tmp_path: Path) -> None:
    # Windows' "Unicode" text has NUL bytes: it was "binary; pass text files or set --extensions"
    p = tmp_path / "notes.txt"
    p.write_text("bonjour à tous\n" * 50, encoding="utf-16")
    with pytest.raises(DataError, match=r"notes\.txt is UTF-16 text, not UTF-8; convert it first \(iconv"):
        list(iter_documents(p))


def test_a_source_shorter_than_a_block_is_named_not_dropped_silently(
    tmp_path: Path, corpus: Path, caplog
) -> None:
    # a source with fewer train tokens than one block was weighted 0 and never drawn, with nothing said
    from gptoughts.data.loader import BatchLoader

    short = tmp_path / "short.txt"
    short.write_text("a short note\n")
    out = tmp_path / "o"
    prepare([corpus, short], out, "bytes", progress=False, val_fraction=0.0)
    with caplog.at_level(logging.WARNING, logger="gptoughts.data"):
        with BatchLoader(out, batch_size=2, block_size=64, prefetch=0) as loader:
            next(loader)
    assert (
        "short.txt has 14 train tokens, fewer than one block" in caplog.text and "never drawn" in caplog.text
    )
