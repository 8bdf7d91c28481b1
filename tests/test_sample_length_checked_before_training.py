"""``--sample_max_new_tokens`` longer than the model's positions allow after its sample prompt: refused before the
run trains or writes anything (it trained to the end, then printed a warning where its sample should have been)."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_helpers import FASTRUN, ok, refused_leaving

# the debug size has 256 positions; a sample prompt of a few tokens leaves ~250
TOO_LONG = ["--sample_max_new_tokens", "300", "--sample_prompts", "def "]
i = FASTRUN.index("--sample_max_new_tokens")
QUICK = FASTRUN[:i] + FASTRUN[i + 2 :]  # (this file names its own)


def _train(corpus: Path, out: Path, *flags: str) -> list[str]:
    return ["train", "--data", str(corpus), "--tokenizer", "bytes", "--size", "debug", "--out", str(out),
            *QUICK, *flags]  # fmt: skip


def test_a_sample_longer_than_the_model_allows_is_refused_before_training(
    tmp_path, text_corpus, cache_dir, capsys
):
    runs = tmp_path / "runs"
    runs.mkdir()
    line = refused_leaving(
        runs,
        _train(text_corpus, runs / "new", "--max_steps", "2", *TOO_LONG),
        capsys,
        "--sample_max_new_tokens 300",
    )
    assert "(4 tokens)" in line and line.endswith("pass --sample_max_new_tokens 253 or less"), line
    assert not (runs / "new").exists()


@pytest.mark.slow
def test_a_resume_asking_for_too_long_a_sample_leaves_the_run_as_it_was(
    tmp_path, text_corpus, cache_dir, capsys
):
    run = tmp_path / "run"
    ok(_train(text_corpus, run, "--max_steps", "2"), capsys)
    refused_leaving(
        run,
        ["train", "--resume", "auto", "--out", str(run), "--max_steps", "4", *TOO_LONG],
        capsys,
        "or less",
    )
