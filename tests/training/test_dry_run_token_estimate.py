"""A dry run's estimate of an uncached corpus holds out what the split will: it counted every byte as a training
token, so a small corpus (whose held-out share is up to 10%) was planned ~10% more steps an epoch than the run
takes (1,582 planned for the run's 1,566 on the tests' 100 KB corpus)."""

from __future__ import annotations

import json

import pytest

from gptoughts.config import load_config
from gptoughts.data.prepare import cached_prepare
from gptoughts.training.corpus import prepare_data


@pytest.mark.parametrize("files", [3, 10])
def test_the_estimate_holds_out_what_the_split_will(files, text_corpus, tmp_path, cache_dir):
    for f in sorted(text_corpus.iterdir())[files:]:
        f.unlink()
    cfg = load_config("default", {"data.sources": [str(text_corpus)], "data.tokenizer": "bytes"})
    estimate = prepare_data(cfg, None, dry_run=True)  # nothing cached: estimated, nothing tokenized
    assert estimate.estimated
    m = cached_prepare(
        [str(text_corpus)], "bytes", val_fraction=cfg.data.val_fraction, seed=cfg.train.seed, progress=False
    )
    # one token a byte: only the end-of-text of each document and where the split's cuts fall are not known
    assert abs(estimate.corpus["tokens"] - m.train_tokens) <= 0.002 * m.train_tokens + files, (
        estimate.corpus, m.train_tokens)  # fmt: skip
    assert abs(estimate.corpus["val_tokens"] - m.val_tokens) <= 0.1 * m.val_tokens + files, (
        estimate.corpus, m.val_tokens)  # fmt: skip


def test_a_jsonl_corpus_is_estimated_by_its_text_not_its_json(tmp_path, cache_dir):
    # JSON's syntax and escapes (json.dumps writes "é" as 6 bytes): a French corpus was planned as 1.6x its text
    words = "le café était très bon et la journée a été ensoleillée".split()
    lines = [
        json.dumps({"text": " ".join(words[(k + i) % len(words)] for i in range(40))}) for k in range(1000)
    ]
    data = tmp_path / "fr.jsonl"
    data.write_text("\n".join(lines) + "\n")
    cfg = load_config("default", {"data.sources": [str(data)], "data.tokenizer": "bytes"})
    estimate = prepare_data(cfg, None, dry_run=True).corpus
    m = cached_prepare(
        [str(data)], "bytes", val_fraction=cfg.data.val_fraction, seed=cfg.train.seed, progress=False
    )
    # one token a byte of text, and one a document (its end-of-text, which the estimate leaves out)
    assert abs(estimate["tokens"] - m.train_tokens) <= 0.03 * m.train_tokens, (estimate, m.totals)
