"""DPO on several processes (gloo): the pair metrics and the reference are per pair, the loss's count is summed over
the data-parallel ranks, and the reference log-ratios precomputed before training must cover each rank's pairs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hf_helpers import losses, save_hf_model
from test_dpo import prefs_file
from torchrun_runs import here, launch

MODES = {
    "lora-ddp": ["--lora", "--parallel.strategy", "ddp"],  # the fused head, the default
    "full-fsdp-plain": ["--parallel.strategy", "fsdp", "--dpo.head", "plain"],
    # the fused head where sharding meets it (its weight gradient, made in the forward, reaches the root's
    # sharded head); the heads' maths on one process: test_dpo_head.py (the second tier's time)
    "full-fsdp-fused": ["--parallel.strategy", "fsdp"],
}


def _margins(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["dpo/reward_margin"] for r in rows if "dpo/reward_margin" in r}


@pytest.fixture(scope="module")
def dpo_runs(tmp_path_factory) -> Path:
    """One process x 4 pairs with the plain head, with LoRA (``one-lora``) and without (``one-full``: the
    reference of both full modes), in this process; 2 ranks x 2 pairs, each mode of :data:`MODES`, in ONE
    torchrun launch (tests/torchrun_runs.py)."""
    tmp = tmp_path_factory.mktemp("dpo2")
    base, data = save_hf_model(tmp / "hf-llama", "llama"), prefs_file(tmp / "p.jsonl", n=64)
    env = {"GPTOUGHTS_CACHE": str(tmp / "cache")}
    argv = [
        "finetune", "--model", str(base), "--data", str(data), "--objective", "dpo", "--block_size", "48",
        "--grad_accum", "2", "--max_steps", "3", "--perf.device", "cpu", "--precision", "fp32", "--compile",
        "false", "--run.progress", "false", "--log_interval", "1", "--eval_interval", "0", "--save_interval", "0",
        "--warmup_steps", "0", "--data.val_fraction", "0", "--sample_prompts=", "--learning_rate", "1e-3",
        "--dpo.logp_chunk", "2",
    ]  # fmt: skip
    for name, lora in (("one-lora", ["--lora"]), ("one-full", [])):
        here([*argv, "--batch_size", "4", "--out", str(tmp / name), *lora, "--dpo.head", "plain"], env=env)
    launch(
        [[*argv, "--batch_size", "2", "--out", str(tmp / m), *x] for m, x in MODES.items()], tmp=tmp, env=env
    )
    return tmp


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("mode", list(MODES))
def test_dpo_on_two_processes_trains_like_one(mode, dpo_runs):
    """2 ranks x 2 pairs x accumulation 2 (the fused head, the default; under FSDP2 the plain head too) train like
    1 process x 4 pairs x accumulation 2 with the plain head: the same losses and reward margins (LoRA under DDP:
    the adapters-off reference each step; full under FSDP2: the reference precomputed once)."""
    one = dpo_runs / ("one-lora" if mode == "lora-ddp" else "one-full")
    (a, ma), (b, mb) = (losses(one), _margins(one)), (losses(dpo_runs / mode), _margins(dpo_runs / mode))
    assert sorted(a) == sorted(b) == [1, 2, 3], (a, b)
    for s in a:
        assert b[s] == pytest.approx(a[s], rel=1e-4), (mode, s, a[s], b[s])
        assert mb[s] == pytest.approx(ma[s], rel=1e-3, abs=1e-5), (mode, s, ma[s], mb[s])
    assert a[3] != a[1]  # it trained
