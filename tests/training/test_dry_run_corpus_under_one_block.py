"""A dry run refuses a corpus of fewer training tokens than one block, as the run does: with nothing cached, it
planned "15.1 epochs over 17 tokens" and exited 0, where the run stops with "fewer than one block". Its tokens are
bounded from above, so that a corpus that trains is never refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gptoughts import cli
from gptoughts.config import load_config
from gptoughts.data.prepare import cached_prepare
from gptoughts.data.tokenizer import Tokenizer, bytes_tokenizer, train_bpe

QUIET = ["--size", "debug", "--device", "cpu", "--threads", "1", "--no_progress"]


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe:300"])
def test_a_dry_run_refuses_a_corpus_under_one_block_as_the_run_does(tokenizer, tmp_path, cache_dir, capsys):
    data = tmp_path / "tiny.txt"
    data.write_text("hello world tiny\n")  # 18 tokens with its end-of-text, at most, for a block of 256
    out = tmp_path / "run"
    argv = ["train", "--data", str(data), "--tokenizer", tokenizer, *QUIET, "--out", str(out)]
    for extra in (["--dry_run"], ["--max_steps", "1"]):
        assert cli.main([*argv, *extra]) == 2, extra
        err = capsys.readouterr().err
        assert "fewer than one block of block_size+1 = 257" in err and "Traceback" not in err, err
    assert not out.exists()


def test_a_cap_that_leaves_less_than_a_block_is_refused_by_the_dry_run(tmp_path, cache_dir, capsys):
    data = tmp_path / "big.txt"
    data.write_text("some words of text\n" * 500)
    out = tmp_path / "run"
    argv = [
        "train",
        "--data",
        str(data),
        "--tokenizer",
        "bytes",
        "--data.max_bytes",
        "100",
        *QUIET,
        "--out",
        str(out),
    ]
    for extra in (["--dry_run"], ["--max_steps", "1"]):
        assert cli.main([*argv, *extra]) == 2, extra
        err = capsys.readouterr().err
        assert "fewer than one block of block_size+1 = 257" in err, err


@pytest.mark.slow
def test_a_corpus_of_exactly_one_block_is_planned_and_trains(tmp_path, cache_dir, capsys):
    data = tmp_path / "one_block.txt"
    data.write_text("x" * 32)  # 32 bytes and the end-of-text: one block of block_size + 1 = 33
    out = tmp_path / "run"
    argv = [
        "train",
        "--data",
        str(data),
        "--tokenizer",
        "bytes",
        *QUIET,
        "--block_size",
        "32",
        "--out",
        str(out),
    ]
    assert cli.main([*argv, "--dry_run"]) == 0, capsys.readouterr().err
    assert cli.main([*argv, "--max_steps", "1", "--sample_max_new_tokens", "2"]) == 0, capsys.readouterr().err
    assert json.loads((out / "summary.json").read_text())["steps"] == 1


def _model_tokenizer(folder: Path, text: str) -> str:
    """A model's own tokenizer folder (a BPE with a BOS distinct from its end-of-text)."""
    bpe = train_bpe([text], 300)
    Tokenizer(bpe.backend, eos_token=bpe.eos_token, bos_token=bpe.pad_token).save(folder)
    return str(folder)


@pytest.mark.slow
def test_the_bound_holds_at_least_the_tokens_the_run_prepares(tmp_path, cache_dir):
    from gptoughts.training.corpus import _most_tokens

    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"document {k}: caf\u00e9 \u00e9t\u00e9 " * (k + 1)}) + "\n"
                            for k in range(30)))  # fmt: skip
    raw = tmp_path / "raw.txt"
    raw.write_bytes(b"bytes \xff\xfe not UTF-8, each one read as U+FFFD (three bytes)\n" * 20)
    folder = tmp_path / "folder"
    folder.mkdir()
    for k in range(12):
        (folder / f"f{k}.txt").write_text("def f():\n    return 1\n" * (k + 1))
    specs = {
        "bytes": "bytes",
        "bpe": "bpe:300",
        "model": _model_tokenizer(tmp_path / "tok", docs.read_text() + raw.read_text(errors="replace")),
    }
    for name, spec in specs.items():
        for sources, cap in (([str(docs)], None), ([str(raw)], None), ([str(folder), str(docs)], 300)):
            cfg = load_config("default", {"data.max_bytes": cap, "train.block_size": 1 << 20})
            tok = (
                bytes_tokenizer()
                if spec == "bytes"
                else None
                if spec.startswith("bpe")
                else Tokenizer.load(spec)
            )
            most = sum(_most_tokens(cfg, sources, None, tok))
            m = cached_prepare(
                sources, spec, max_bytes=cap, seed=cfg.train.seed, val_fraction=cfg.data.val_fraction
            )
            assert most >= m.train_tokens, (name, sources, most, m.train_tokens)
            if name == "bytes":  # one token a byte and one a document: at most the whole corpus (both splits)
                assert most <= m.train_tokens + m.val_tokens, (sources, most, m.train_tokens, m.val_tokens)
