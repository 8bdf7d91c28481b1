"""A resumed run keeps its own micro-batch where the command names none. The review: the default micro-batch is cut
for a small corpus by the epochs asked, so a resume with more --epochs cut it otherwise and the batch changed
under the resume, unannounced."""

from __future__ import annotations

import json
import random

from cli_helpers import QUIET_CPU, ok


def test_a_resume_with_more_epochs_keeps_the_runs_micro_batch(tmp_path, cache_dir, capsys):
    rng = random.Random(0)
    words = "the cat sat on a mat and then it ran to the red house by the sea".split()
    corpus = tmp_path / "small.txt"
    corpus.write_text("\n".join(" ".join(rng.choice(words) for _ in range(12)) for _ in range(45)))
    out = tmp_path / "run"
    base = ["--size", "debug", "--tokenizer", "bytes", "--block_size", "32", *QUIET_CPU]
    ok(["train", "--data", str(corpus), "--out", str(out), "--epochs", "1", *base], capsys)
    micro = json.loads((out / "run.json").read_text())["plan"]["batch"]["micro_batch"]
    assert micro < 8  # the default 8 rows, cut for one epoch of this corpus
    text = ok(["train", "--resume", "auto", "--out", str(out), "--epochs", "3", "--dry_run"], capsys)
    assert f"batch: {micro} x 32 tokens" in text and "the resumed run's own" in text, text
