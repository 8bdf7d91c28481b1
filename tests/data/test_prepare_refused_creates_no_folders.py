"""A refused ``gptoughts prepare --out a/b/c`` (an empty corpus: found only once it is read, after the lock beside the
output is taken) creates nothing: the folders above the output made for the lock are removed again. A prepare that
succeeds keeps them, with its output inside."""

from __future__ import annotations

from cli_helpers import ok, refused


def test_a_refused_prepare_leaves_no_empty_folders(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty.txt").write_text("")
    refused(["prepare", "--data", "empty.txt", "--out", "a/b/c"], capsys, "empty.txt contains no text")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.txt"]
    (tmp_path / "full.txt").write_text("hello world\n")
    ok(["prepare", "--data", "full.txt", "--tokenizer", "bytes", "--out", "a/b/c"], capsys)
    assert [p.name for p in (tmp_path / "a" / "b").iterdir()] == ["c"]
    assert (tmp_path / "a" / "b" / "c" / "manifest.json").is_file()
