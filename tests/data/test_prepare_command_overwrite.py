"""`gptoughts prepare --out DIR` run again into DIR: the same flags reuse it, other flags are refused in one line
naming the difference and --overwrite, which replaces it (as `train --overwrite` replaces a run)."""

from __future__ import annotations

from pathlib import Path

from cli_helpers import ok, refused


def test_prepare_again_with_another_tokenizer_is_refused_until_overwrite(
    text_corpus: Path, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "shards"
    base = ["prepare", "--data", str(text_corpus), "--out", str(out)]
    ok([*base, "--tokenizer", "bytes"], capsys)
    manifest = (out / "manifest.json").read_bytes()
    assert "reusing cached shards" in ok([*base, "--tokenizer", "bytes"], capsys)
    refused(
        [*base, "--tokenizer", "bpe:300"], capsys, "tokenizer bytes (this prepare: bpe:300)", "--overwrite"
    )
    refused(
        [*base, "--tokenizer", "bytes", "--val_fraction", "0.2"], capsys, "val_fraction 0.005", "--overwrite"
    )
    assert (out / "manifest.json").read_bytes() == manifest
    text = ok([*base, "--tokenizer", "bpe:300", "--overwrite"], capsys)
    assert "vocab 300" in text and (out / "manifest.json").read_bytes() != manifest


def test_overwrite_takes_its_word_and_needs_out(text_corpus: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "shards"
    base = ["prepare", "--data", str(text_corpus), "--out", str(out)]
    ok([*base, "--tokenizer", "bytes"], capsys)
    refused([*base, "--tokenizer", "bpe:300", "--overwrite", "false"], capsys, "--overwrite")
    assert "vocab 300" in ok([*base, "--tokenizer", "bpe:300", "--overwrite", "true"], capsys)
    refused(["prepare", "--data", str(text_corpus), "--overwrite"], capsys, "without --out")
