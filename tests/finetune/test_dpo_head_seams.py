"""The DPO heads (``dpo.head = fused | chunked``) where they meet the features around them: data parallelism
(FSDP2 walks the root's gathered head weight, DDP the frozen head of a LoRA run), a LoRA run's exact resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hf_helpers import losses
from test_dpo import _opts, prefs_file

from gptoughts import api
from gptoughts.training.trainer import Trainer


def _margins(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["dpo/reward_margin"] for r in rows if "dpo/reward_margin" in r}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    "mode, extra",
    [
        ("lora-ddp-fused", ["--lora", "--parallel.strategy", "ddp", "--dpo.head", "fused"]),
        ("full-fsdp-fused", ["--parallel.strategy", "fsdp", "--dpo.head", "fused"]),
        ("full-fsdp-chunked", ["--parallel.strategy", "fsdp", "--dpo.head", "chunked"]),
    ],
)
def test_dpo_heads_on_two_processes_train_like_the_plain_head_on_one(
    mode, extra, hf_model, tmp_path, ft_cache
):
    """2 ranks x 2 pairs x accumulation 2 with the fused or chunked head train like 1 process x 4 pairs x
    accumulation 2 with the plain head: the same losses and reward margins. Under FSDP2 the fused head's weight
    gradient, computed in the forward, reaches the root's sharded head like the plain head's."""
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


@pytest.mark.slow
def test_lora_dpo_with_the_fused_head_resumes_exactly(hf_model, tmp_path, ft_fast, ft_cache, monkeypatch):
    """A LoRA run walks its frozen head in token chunks with the adapters-off reference each step; stopped at step
    4 and resumed, its losses equal an uninterrupted run's (the adapters and their optimizer state come back)."""
    base, data = hf_model("llama"), prefs_file(tmp_path / "p.jsonl", n=48)
    o = _opts(ft_fast, **{"train.max_steps": 8, "train.learning_rate": 1e-3, "train.log_interval": 1})
    o.update({"lora.enabled": True, "dpo.head": "fused", "dpo.logp_chunk_tokens": 40})

    def go(out: Path, **kw) -> None:
        api.finetune(model_path=str(base), data_path=str(data), save_dir=str(out), **o, **kw)

    go(tmp_path / "a")
    original = Trainer.train_step

    def stop_at_4(self):
        out = original(self)
        if self.state.step + 1 == 4:
            self.stop_requested = True
        return out

    monkeypatch.setattr(Trainer, "train_step", stop_at_4)
    go(tmp_path / "b")
    monkeypatch.setattr(Trainer, "train_step", original)
    go(tmp_path / "b", **{"run.resume": "auto"})
    a, b = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert sorted(a) == sorted(b) == list(range(1, 9))
    assert all(a[s] == b[s] for s in a), (a, b)
    assert a[8] != a[1]  # it trained
