"""A resumed run knows which of its settings its user gave: its config.toml holds every value its first start
decided, but only the given ones count as the user's (run.json ``given``), so an automatic batch resumes with the
accumulation it was planned with, not refused as if --grad_accum and --global_batch_tokens had both been given."""

from __future__ import annotations

import json

from cli_helpers import QUIET_CPU, run_cli


def test_a_resumed_automatic_batch_keeps_its_planned_accumulation(tmp_path, text_corpus, cache_dir, capsys):
    out = tmp_path / "r"
    argv = ["train", "--data", str(text_corpus), "--size", "debug", "--tokenizer", "bytes", "--block_size", "32",
            *QUIET_CPU, "--batch_size", "auto", "--train.global_batch_tokens", "128", "--out", str(out)]  # fmt: skip
    rc, text = run_cli([*argv, "--max_steps", "2"], capsys)
    assert rc == 0, text
    first = json.loads((out / "run.json").read_text())
    assert "train.global_batch_tokens" in first["given"] and "train.grad_accum" not in first["given"]
    rc, text = run_cli([*argv, "--max_steps", "3", "--resume", "auto"], capsys)
    assert rc == 0, text
    resumed = json.loads((out / "run.json").read_text())
    assert resumed["tokens_per_step"] == first["tokens_per_step"] == 128
    assert resumed["resolved"]["grad_accum"].startswith("to reach train.global_batch_tokens"), resumed[
        "resolved"
    ]
    assert "train.max_steps" in resumed["given"] and "train.global_batch_tokens" in resumed["given"]
