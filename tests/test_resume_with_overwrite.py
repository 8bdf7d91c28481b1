"""`--resume auto --overwrite`: continue the run or replace it? The overwrite was ignored silently; now the two
typed together are refused in one line, while a run first made with --overwrite still resumes."""

from __future__ import annotations

import pytest
from cli_helpers import FASTRUN, ok, refused


@pytest.mark.slow  # a training run
def test_resume_auto_and_overwrite_typed_together_are_refused(tmp_path, text_corpus, cache_dir, capsys):
    out = tmp_path / "run"
    first = [
        "train",
        "--data",
        str(text_corpus),
        "--out",
        str(out),
        "--size",
        "debug",
        "--tokenizer",
        "bytes",
    ]
    ok([*first, "--max_steps", "1", "--overwrite", *FASTRUN], capsys)
    before = sorted(p.name for p in out.rglob("*"))
    resume = ["train", "--resume", "auto", "--out", str(out), "--max_steps", "2", "--dry_run"]
    refused([*resume, "--overwrite"], capsys, "--resume auto continues the run", "pass one of them")
    assert sorted(p.name for p in out.rglob("*")) == before
    assert "plan:" in ok(
        resume, capsys
    )  # the first command's --overwrite, saved with the run, is not this one's
