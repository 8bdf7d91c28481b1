"""A run trained on 2 gloo processes, resumed on one: without --grad_accum the accumulation doubles to keep the
global batch; a --grad_accum typed in the resuming command wins (it was replaced by the kept batch's, since the
config could not tell this command's flags from the run's own), and the plan says the global batch changes."""

from __future__ import annotations

import json
import shutil

import pytest
from cli_helpers import QUIET_CPU
from torchrun_runs import here, launch

RUN = ["--size", "debug", "--tokenizer", "bytes", "--block_size", "32", "--batch_size", "2", *QUIET_CPU]


def _batch(run) -> dict:
    return json.loads((run / "run.json").read_text())["plan"]["batch"]


@pytest.mark.distributed
def test_a_resume_on_one_process_keeps_the_global_batch_unless_grad_accum_is_typed(shared_corpus, tmp_path):
    env = {"GPTOUGHTS_CACHE": str(tmp_path / "cache")}
    plain, typed = tmp_path / "plain", tmp_path / "typed"
    start = ["train", "--data", str(shared_corpus), "--max_steps", "2", *RUN]
    launch(
        [[*start, "--out", str(plain)], [*start, "--out", str(typed), "--grad_accum", "1"]],
        tmp=tmp_path,
        env=env,
    )
    saved = _batch(plain)
    assert saved["dp_size"] == 2 and saved["grad_accum"] == 1 and _batch(typed) == saved
    shutil.copytree(plain, tmp_path / "plain2")
    resume = ["train", "--resume", "auto", "--max_steps", "3", "--no_progress"]

    text = here([*resume, "--out", str(plain), "--grad_accum", "1"], env=env)
    b = _batch(plain)
    assert (
        b["dp_size"] == 1 and b["grad_accum"] == 1 and b["tokens_per_step"] == saved["tokens_per_step"] // 2
    )
    assert "global batch changes" in text, text
    # without the flag (the first command typed none, or typed --grad_accum 1 then): the global batch is kept
    for run in (tmp_path / "plain2", typed):
        here([*resume, "--out", str(run)], env=env)
        b = _batch(run)
        assert b["grad_accum"] == 2 and b["tokens_per_step"] == saved["tokens_per_step"], (run, b)
