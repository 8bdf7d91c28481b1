"""Fine-tuning a Hugging Face model under tensor parallelism (parallel/tp.py), on gloo."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hf_helpers import losses, sft_rows
from torchrun_runs import here


@pytest.mark.distributed
def test_qwen3_sft_under_tp_matches_one_process(hf_model, tmp_path, ft_cache):
    """A Qwen3 folder (q/k norms over a head_dim apart from d_model / heads) fine-tuned on chat rows (masked
    targets: the token count is summed over data-parallel ranks only) under TP=2 trains like one process, and
    samples the same answer."""
    base = hf_model("qwen3")
    data = sft_rows(tmp_path / "d.jsonl")
    argv = [
        "finetune", "--model", str(base), "--data", str(data), "--block_size", "64", "--batch_size", "4",
        "--max_steps", "4", "--perf.device", "cpu", "--precision", "fp32", "--compile", "false",
        "--run.progress", "false", "--log_interval", "1", "--eval_interval", "0", "--save_interval", "0",
        "--warmup_steps", "0", "--data.val_fraction", "0", "--sample_prompts", "hi", "--sample_max_new_tokens", "4",
    ]  # fmt: skip
    # the one-process reference in this process; TP=2 through torchrun
    sample = "sample ('hi'):"
    text = here([*argv, "--out", str(tmp_path / "one")], env={"GPTOUGHTS_CACHE": str(ft_cache)})
    runs = {"one": (losses(tmp_path / "one"), text.split(sample)[-1].splitlines()[1])}
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "gptoughts",
         *argv, "--out", str(tmp_path / "tp"), "--parallel.tp", "2"],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    runs["tp"] = (losses(tmp_path / "tp"), r.stdout.split(sample)[-1].splitlines()[1])
    (a, sample_a), (b, sample_b) = runs["one"], runs["tp"]
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for s in a:
        assert abs(a[s] - b[s]) < 1e-4 * abs(a[s]), (s, a[s], b[s])
    assert sample_a == sample_b
