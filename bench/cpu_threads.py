"""CPU thread count: speed and losses of the same short run at each count, on idle and busy cores.

    python bench/cpu_threads.py --out results.jsonl                    # the default matrix (below)
    python bench/cpu_threads.py --cpus 0,1 --threads 1,2,auto --load 1 # one condition

Each case is a fresh ``gptoughts train`` process pinned with ``taskset`` to ``--cpus`` (``auto``: no --threads,
the run's own choice); ``--load 1`` keeps one busy-looping process on the last of those cores meanwhile (another
user's job). One JSON line per case: the thread count the run used, its training tokens/s (``summary.json``),
wall time and its per-step losses, so that two counts can be compared step by step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RUNS = {
    # ~1M parameters, 8 x 128 tokens a step
    "debug": ["--size", "debug", "--data", "@stdlib", "--tokenizer", "bytes", "--data.max_bytes", "2000000",
              "--block_size", "128", "--batch_size", "8"],
    # the quickstart preset: ~10M parameters, 8 x 128 tokens a step
    "quickstart": ["quickstart"],
}  # fmt: skip
COMMON = ["--device", "cpu", "--log_interval", "1", "--no_progress", "--run.tensorboard", "false",
          "--eval_interval", "0", "--checkpoint.save_interval", "0", "--sample_max_new_tokens", "1"]  # fmt: skip


def run_case(model: str, cpus: str, threads: str, steps: int, load: bool, cache: Path) -> dict:
    out = Path(tempfile.mkdtemp(prefix="threads-")) / "run"
    argv = [*RUNS[model], *COMMON, "--max_steps", str(steps), "--out", str(out)]
    if threads != "auto":
        argv += ["--threads", threads]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["GPTOUGHTS_CACHE"] = str(cache)
    busy = None
    if load:
        core = cpus.split(",")[-1].split("-")[-1]
        busy = subprocess.Popen(["taskset", "-c", core, sys.executable, "-c", "while True: pass"])
    t0 = time.perf_counter()
    try:
        r = subprocess.run(
            ["taskset", "-c", cpus, sys.executable, "-m", "gptoughts", "train", *argv],
            env=env, capture_output=True, text=True, timeout=900,
        )  # fmt: skip
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    wall = time.perf_counter() - t0
    row: dict = {"model": model, "cpus": cpus, "threads_asked": threads, "load": load, "steps": steps}
    if r.returncode != 0:
        return {**row, "error": r.stderr[-500:]}
    run = json.loads((out / "run.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    losses = [
        json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in x
    ]
    return {
        **row,
        "threads": run["resolved"].get("threads"),
        "tokens_per_s": summary["tokens_per_s"],
        "fit_s": summary["wall_s"],
        "process_s": round(wall, 1),
        "losses": losses,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="cpu_threads.jsonl")
    ap.add_argument("--models", default="debug,quickstart")
    ap.add_argument("--cpus", default="0,1")
    ap.add_argument("--threads", default="1,2,auto")
    ap.add_argument("--load", default="0,1", help="0: idle cores, 1: one busy core among them")
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()
    cache = Path(tempfile.mkdtemp(prefix="threads-cache-"))
    with open(a.out, "a") as f:
        for load in (bool(int(x)) for x in a.load.split(",")):
            for model in a.models.split(","):
                for threads in a.threads.split(","):
                    row = run_case(model, a.cpus, threads, a.steps, load, cache)
                    print(json.dumps({k: v for k, v in row.items() if k != "losses"}), flush=True)
                    f.write(json.dumps(row) + "\n")
                    f.flush()


if __name__ == "__main__":
    main()
