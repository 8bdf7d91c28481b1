"""A signal that only some ranks of a multi-process run receive (one process killed by hand, a scheduler's SIGTERM
to one node): every rank stops as interrupted, and rank 0 writes its summary before any rank exits."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
from cli_helpers import FASTRUN

# Rank 1 sends itself SIGTERM before its third step; rank 0 never sees a signal.
DRIVER = """
import os, signal, sys
from gptoughts import cli
from gptoughts.training.trainer import Trainer
step, calls = Trainer.train_step, [0]
def train_step(self):
    calls[0] += 1
    if os.environ["RANK"] == "1" and calls[0] == 3:
        os.kill(os.getpid(), signal.SIGTERM)
    return step(self)
Trainer.train_step = train_step
sys.exit(cli.main(sys.argv[1:]))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_signal_to_one_rank_stops_every_rank_as_interrupted(strategy, tmp_path, text_corpus, cache_dir):
    """Rank 0 agreed to stop with rank 1 at the next log step, but reported "done (max steps)" at step 4 of 40 and
    exited 0 (its summary.json too), while rank 1 exited 143."""
    out = tmp_path / "run"
    argv = ["train", "--data", str(text_corpus), "--size", "debug", "--tokenizer", "bytes", *FASTRUN,
            "--max_steps", "40", "--log_interval", "2", "--eval_interval", "0", "--sample_interval", "0",
            "--parallel.strategy", strategy, "--out", str(out)]  # fmt: skip
    port = _free_port()
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2"}  # fmt: skip
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", DRIVER, *argv],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    results = [p.communicate(timeout=300) for p in procs]
    codes = [p.returncode for p in procs]
    assert codes == [143, 143], (codes, results[0][1][-2000:], results[1][1][-2000:])
    assert "done (interrupted" in results[0][0], results[0][0][-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["stop_reason"].startswith("interrupted"), summary
