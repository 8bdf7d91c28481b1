"""A dry run refuses the corpus its run refuses: an empty file or a folder with nothing to read planned "256 epochs
over 0 tokens" and exited 0, where the run stops with one line."""

from __future__ import annotations

import pytest

from gptoughts import cli


@pytest.mark.parametrize("kind", ["empty file", "empty jsonl", "folder without text"])
def test_a_dry_run_of_an_empty_corpus_is_refused_as_the_run_is(kind, tmp_path, capsys):
    if kind == "folder without text":
        data = tmp_path / "d"
        data.mkdir()
        (data / "image.png").write_bytes(b"\x89PNG")
        said = "has no files with extensions"
    else:
        data = tmp_path / ("empty.txt" if kind == "empty file" else "empty.jsonl")
        data.write_text("")
        said = "contains no text"
    out = tmp_path / "run"
    argv = ["train", "--data", str(data), "--size", "debug", "--device", "cpu", "--out", str(out)]
    for extra in (["--dry_run"], ["--max_steps", "1", "--no_progress"]):
        assert cli.main([*argv, *extra]) == 2
        err = capsys.readouterr().err
        assert said in err and "Traceback" not in err, err
    assert not out.exists()
