"""Where a corpus folder meets what gptoughts writes: prepared datasets and runs are never read as corpus text."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from cli_helpers import FASTRUN, ok, refused

from gptoughts.data.sources import walk_files
from gptoughts.errors import DataError

TRAIN = ["train", "--size", "debug", *FASTRUN]


def test_training_on_a_prepared_folder_is_refused_naming_its_corpus(
    text_corpus: Path, tmp_path: Path, capsys
) -> None:
    prepared = tmp_path / "P"
    ok(
        [
            "prepare",
            "--data",
            str(text_corpus),
            "--out",
            str(prepared),
            "--size",
            "debug",
            "--tokenizer",
            "bytes",
        ],
        capsys,
    )
    for extra in (["--dry_run"], []):
        line = refused(
            [*TRAIN, "--data", str(prepared), "--tokenizer", "bytes", "--max_steps", "1", *extra],
            capsys,
            "prepared dataset",
            f"--data {text_corpus}",
            "--tokenizer bytes",
        )
    assert not Path("runs/llama-debug").exists(), line


def test_walk_skips_prepared_folders_and_runs_and_says_so(
    text_corpus: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from gptoughts.data import prepare

    prepare([text_corpus], text_corpus / "shards", "bytes", progress=False)
    run = text_corpus / "runs" / "r1"
    (run / "tokenizer").mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"family": "llama", "args": {}}))
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "tokenizer" / "tokenizer.json").write_text("{}")
    (text_corpus / "sub").mkdir()
    (text_corpus / "sub" / "run.json").write_text("{}")  # not written by a run: corpus text like any other
    with caplog.at_level(logging.INFO, logger="gptoughts"):
        files = [
            f.relative_to(text_corpus).as_posix() for f in walk_files(text_corpus, ("py", "json", "jsonl"))
        ]
    assert files and all(f.endswith(".py") for f in files[:-1]) and files[-1] == "sub/run.json", files
    said = [r.getMessage() for r in caplog.records if "gptoughts wrote" in r.getMessage()]
    assert (
        len(said) == 1 and "runs/r1 (a gptoughts run)" in said[0] and "shards (a prepared dataset)" in said[0]
    ), said


def test_a_run_folder_given_as_data_is_refused(tmp_path: Path) -> None:
    from gptoughts.data.sources import resolve_source

    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"family": "llama", "args": {}}))
    with pytest.raises(DataError, match="is a gptoughts run"):
        resolve_source(run)


def test_training_inside_the_corpus_resumes(
    text_corpus: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.chdir(text_corpus)
    ok(
        [*TRAIN, "--data", ".", "--max_steps", "2"], capsys
    )  # a BPE trained on the corpus, as a user's would be
    assert Path("runs/llama-debug/run.json").is_file()
    text = ok([*TRAIN, "--resume", "auto", "--out", "runs/llama-debug", "--max_steps", "3"], capsys)
    assert "runs/llama-debug (a gptoughts run)" in text, text[-2000:]
    # the run's config.toml names the corpus by its absolute path: the same shards, not a second tokenization
    assert "reusing cached shards" in text and "prepared " not in text, text[-2000:]
