"""DPO on several processes (gloo): the pair metrics and the reference are per pair, the loss's count is summed over
the data-parallel ranks, and the reference log-ratios precomputed before training must cover each rank's pairs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hf_helpers import losses
from test_dpo import prefs_file


def _margins(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["dpo/reward_margin"] for r in rows if "dpo/reward_margin" in r}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    "mode, extra",
    [
        ("lora-ddp", ["--lora", "--parallel.strategy", "ddp"]),
        ("full-fsdp", ["--parallel.strategy", "fsdp"]),
        # the fused head where sharding meets it (its weight gradient, made in the forward, reaches the root's
        # sharded head); the heads' maths on one process: test_dpo_head.py (the second tier's time)
        ("full-fsdp-fused", ["--parallel.strategy", "fsdp", "--dpo.head", "fused"]),
    ],
)
def test_dpo_on_two_processes_trains_like_one(mode, extra, hf_model, tmp_path, ft_cache):
    """2 ranks x 2 pairs x accumulation 2 train like 1 process x 4 pairs x accumulation 2 with the plain head: the
    same losses and reward margins (LoRA under DDP: the adapters-off reference each step; full under FSDP2: the
    reference precomputed once; the fused head under FSDP2 too)."""
    base, data = hf_model("llama"), prefs_file(tmp_path / "p.jsonl", n=64)
    argv = [
        "finetune", "--model", str(base), "--data", str(data), "--objective", "dpo", "--block_size", "48",
        "--grad_accum", "2", "--max_steps", "3", "--perf.device", "cpu", "--precision", "fp32", "--compile",
        "false", "--run.progress", "false", "--log_interval", "1", "--eval_interval", "0", "--save_interval", "0",
        "--warmup_steps", "0", "--data.val_fraction", "0", "--sample_prompts=", "--learning_rate", "1e-3",
        "--dpo.logp_chunk", "2",
    ]  # fmt: skip
    lora = extra[:1] if extra[0] == "--lora" else []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = {}
    for name, launch, batch, more in (
        ("one", [], "4", [*lora, "--dpo.head", "plain"]),
        ("two", ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"], "2", extra),
    ):
        out = tmp_path / name
        r = subprocess.run(
            [sys.executable, *launch, "-m", "gptoughts", *argv, "--batch_size", batch, "--out", str(out), *more],
            env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]
        runs[name] = (losses(out), _margins(out))
    (a, ma), (b, mb) = runs["one"], runs["two"]
    assert sorted(a) == sorted(b) == [1, 2, 3], (a, b)
    for s in a:
        assert b[s] == pytest.approx(a[s], rel=1e-4), (mode, s, a[s], b[s])
        assert mb[s] == pytest.approx(ma[s], rel=1e-3, abs=1e-5), (mode, s, ma[s], mb[s])
    assert a[3] != a[1]  # it trained
