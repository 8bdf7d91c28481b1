"""CPU offload (FSDP2 CPUOffloadPolicy, one process or several) and multi-node launch through c10d rendezvous."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torchrun_runs import here

from gptoughts.config import load_config
from gptoughts.errors import ConfigError
from gptoughts.perf.estimate import estimate
from gptoughts.training.checkpoint import sharded


def _env() -> dict[str, str]:
    """The test's environment (its GPTOUGHTS_CACHE included: read at each call, not at import), one thread."""
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def _args(corpus: Path, fast: dict) -> list[str]:
    skip = ("train.batch_size", "train.sample_prompts", "train.warmup_steps")
    return [
        "--data",
        str(corpus),
        "--log_interval",
        "1",
        "--eval_interval",
        "0",
        "--save_interval",
        "0",
        "--train.schedule",
        "constant",
        "--warmup_steps",
        "0",
        "--max_steps",
        "3",
    ] + [f"--{k}={v}" for k, v in fast.items() if k not in skip]


def _losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _close(a: dict[int, float], b: dict[int, float]) -> None:
    assert a.keys() == b.keys() == {1, 2, 3}
    for s in a:
        assert abs(a[s] - b[s]) < 1e-4 * abs(a[s]), (s, a[s], b[s])


@pytest.mark.distributed
def test_one_process_offload_trains_like_a_plain_run(tmp_path, text_corpus, cache_dir, fast):
    """``--parallel.cpu_offload`` without torchrun: FSDP2 in a process group of one, the state kept in CPU
    memory; fp32 on the CPU, so its losses and weights equal a plain run's."""
    args = _args(text_corpus, fast) + ["--batch_size", "4"]
    plain, off = tmp_path / "plain", tmp_path / "offload"
    # both in this process (no torchrun: the offloaded run joins a process group of one and leaves it)
    here(["train", "--out", str(plain), *args])
    stdout = here(["train", "--out", str(off), *args, "--parallel.cpu_offload", "true"])
    _close(_losses(plain), _losses(off))
    run = json.loads((off / "run.json").read_text())
    assert "cpu offload" in json.dumps(run)
    a = load_file(str(plain / "checkpoints" / "step_000003" / "model.safetensors"))
    # an offloaded run is sharded (FSDP2): its checkpoint is DCP's, consolidated on one process
    b = sharded.consolidated_weights(off / "checkpoints" / "step_000003")
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)
    assert "CPU memory (offload)" in stdout  # the plan says where the state lives


@pytest.mark.distributed
@pytest.mark.slow
def test_two_nodes_through_c10d_rendezvous_train_like_one_process(tmp_path, text_corpus, cache_dir, fast):
    """Two "nodes" of 2 processes each (two torchrun launchers meeting through c10d rendezvous on 127.0.0.1,
    as on two machines with --rdzv-endpoint HEAD:PORT), DDP over 4 ranks x batch 1, train like one process at
    batch 4; the second node's run directory is the same (shared filesystem), written by global rank 0 only."""
    args = _args(text_corpus, fast)
    single, multi = tmp_path / "single", tmp_path / "multi"
    here(["train", "--out", str(single), *args, "--batch_size", "4"])  # the reference, in this process
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launcher = [
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc_per_node=2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=gptoughts-test",
        "--max-restarts=0",
    ]
    train = ["-m", "gptoughts", "train", "--out", str(multi), *args, "--batch_size", "1"]
    # On one machine both launchers would race to host the rendezvous store on the endpoint's port: the first
    # node hosts it, as the head node of a cluster does.
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", *launcher, f"--rdzv-conf=is_host={int(i == 0)}", *train],
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    for p in nodes:
        try:
            _, err = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for q in nodes:
                q.kill()
            outs = [q.communicate() for q in nodes]
            raise AssertionError("\n".join(o[1][-2500:] for o in outs)) from None
        assert p.returncode == 0, err[-3000:]
    assert json.loads((multi / "run.json").read_text())["world_size"] == 4
    _close(_losses(single), _losses(multi))


def test_offload_refuses_strategies_that_do_not_shard():
    from gptoughts.parallel import dist

    with pytest.raises(ConfigError, match="use --parallel.strategy fsdp"):
        dist.init(torch.device("cpu"), strategy="ddp", cpu_offload=True)
    with pytest.raises(ConfigError, match="gpu_memory_gib must be > 0"):
        load_config(None, {"model.size": "debug", "perf.gpu_memory_gib": 0})


def test_estimate_moves_the_training_state_to_host_memory():
    """Offloaded, the GPU holds gathered blocks, one block's gradient, logits and activations; the fp32 weights,
    gradients and AdamW state (16 bytes a parameter) are in CPU memory, split over the processes."""
    on = estimate("llama", "3b", batch_size=1, block_size=2048, cpu_offload=True, num_gpus=2)
    off = estimate("llama", "3b", batch_size=1, block_size=2048, strategy="fsdp", num_gpus=2)
    assert on.weights_gib == on.optimizer_gib == 0
    assert on.host_gib == pytest.approx(16 * on.params / 2 / 2**30)
    assert on.total_gib < off.total_gib - 0.9 * on.host_gib
    assert on.strategy == "fsdp"
