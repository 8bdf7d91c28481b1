"""``gptoughts prepare`` then ``gptoughts train`` with the same --data and settings: the train reads the shards the
prepare wrote and tokenizes nothing. Without --out, prepare writes into the cache that train reads; with --out
DIR, into DIR (for bench --shards), and train refuses ``--data DIR`` in one line naming both ways."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
from cli_helpers import FASTRUN, ok, refused

prepare_module = importlib.import_module(
    "gptoughts.data.prepare"
)  # (gptoughts.data.prepare is also a function)

SETTINGS = [
    "--size",
    "debug",
    "--max_bytes",
    "40000",
    "--val_fraction",
    "0.1",
]  # the size's own tokenizer (bpe)


def test_prepare_without_out_fills_the_cache_train_reads(
    text_corpus: Path, cache_dir: Path, capsys, monkeypatch: pytest.MonkeyPatch
):
    text = ok(["prepare", "--data", str(text_corpus), *SETTINGS], capsys)
    folders = list((cache_dir / "datasets").iterdir())
    assert len(folders) == 1 and (folders[0] / "manifest.json").is_file(), folders
    assert str(folders[0]) in text and "gptoughts train" in text, text
    before = sorted(p.name for p in (cache_dir / "datasets").iterdir())

    plan = ok(
        ["train", "--data", str(text_corpus), *SETTINGS, "--max_steps", "2", "--dry_run", *FASTRUN], capsys
    )
    assert "not tokenized yet" not in plan.split("corpus:")[1].splitlines()[0], plan[-2000:]  # the real count

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("train tokenized the corpus again")

    monkeypatch.setattr(prepare_module, "_build_and_install", no_tokenizing)
    text = ok(["train", "--data", str(text_corpus), *SETTINGS, "--max_steps", "2", "--out", "runs/p", *FASTRUN],
              capsys)  # fmt: skip
    assert f"reusing cached shards in {folders[0]}" in text, text[-2000:]
    assert sorted(p.name for p in (cache_dir / "datasets").iterdir()) == before


def test_a_folder_prepared_with_out_is_refused_as_data_naming_both_ways(
    text_corpus: Path, cache_dir: Path, capsys
):
    shards = Path("shards")
    text = ok(["prepare", "--data", str(text_corpus), "--out", str(shards), "--tokenizer", "bytes"], capsys)
    assert "without --out" in text, text
    refused(
        [
            "train",
            "--data",
            str(shards),
            "--size",
            "debug",
            "--tokenizer",
            "bytes",
            "--max_steps",
            "1",
            *FASTRUN,
        ],
        capsys,
        "prepared dataset",
        "`gptoughts prepare` without --out",
        f"--data {text_corpus}",
    )
