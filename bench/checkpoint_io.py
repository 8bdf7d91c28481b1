"""Checkpoint save/load times on one process: the single-file format (model.safetensors + state.pt) against the
sharded DCP format (sync and async), for a Llama of a given size in fp32 with its AdamW state.

    PYTHONPATH=$PWD python bench/checkpoint_io.py --size 125m --repeats 3 --dir /tmp/ckbench
    PYTHONPATH=$PWD python bench/checkpoint_io.py --size 1b --repeats 1 --async_state model --dir /tmp/ckbench

Every time includes what a run pays: fsync of each file and the sha256 of every file for meta.json (the
checksums are part of both formats). Loads read files that were just written (the page cache holds what fits:
this measures the formats' CPU cost, not the disk). ``--async_state model``: the async save stages only the
weights (where a second copy of the weights and optimizer state does not fit in memory); the blocked time is
the staging copy (into host buffers the saver keeps from one save to the next, as in a run: the first save
allocates them), the rest runs in the background thread. Prints one JSON line per measurement.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import time
from pathlib import Path

import torch

from gptoughts import models
from gptoughts.training.checkpoint import restore, savers, sharded
from gptoughts.training.checkpoint import store as ckpt


def build(size: str, with_state: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    args = models.model_args("llama", size, {"vocab_size": 32768})
    with torch.device("meta"):
        model = models.build_model("llama", args, device="meta")
    model.to_empty(device="cpu")
    if with_state:
        torch.manual_seed(0)
        model.init_weights()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, foreach=False)
    if with_state:  # the AdamW state of a step taken (allocated directly: no gradients, less peak memory)
        for p in model.parameters():
            opt.state[p] = {
                "step": torch.tensor(1.0),
                "exp_avg": torch.randn_like(p) * 1e-3,
                "exp_avg_sq": torch.rand_like(p) * 1e-6,
            }
    return model, opt


def trainer_state(opt: torch.optim.Optimizer | None) -> dict:
    st = {"trainer": {"step": 1}, "rng": {"torch": torch.get_rng_state()}, "loader": {"rows": 0}}
    if opt is not None:
        st["optimizer"] = opt.state_dict()
    return st


def gib(model: torch.nn.Module, opt: torch.optim.Optimizer) -> float:
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    n += sum(
        t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t)
    )
    return n / 2**30


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="125m")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/ckbench")
    ap.add_argument("--async_state", choices=("all", "model", "none"), default="all")
    a = ap.parse_args()
    root = Path(a.dir)
    shutil.rmtree(root, ignore_errors=True)
    times: dict[str, list[float]] = {}

    def record(name: str, seconds: float) -> None:
        times.setdefault(name, []).append(seconds)

    model, opt = build(a.size, True)
    params = sum(p.numel() for p in model.parameters())
    print(json.dumps({"size": a.size, "params": params, "state_gib": round(gib(model, opt), 2)}), flush=True)
    async_saver = savers.ShardedSaver(root / "dcp_async", async_save=True, keep_last=1)
    for r in range(a.repeats):
        t = time.perf_counter()
        ckpt.save(root / "file", 1, model, trainer_state(opt), keep_last=1)
        record("file_save_s", time.perf_counter() - t)
        gc.collect()
        saver = savers.ShardedSaver(root / "dcp", async_save=False, keep_last=1)
        t = time.perf_counter()
        saver.save(1, sharded.sharded_state(model, opt), trainer_state(None))
        record("dcp_sync_save_s", time.perf_counter() - t)
        if a.async_state != "none":  # one saver for all repeats, as in a run: its staging buffers are kept
            state = sharded.sharded_state(model, opt if a.async_state == "all" else None)
            t = time.perf_counter()
            async_saver.save(r + 1, state, trainer_state(None))
            record(f"dcp_async_{a.async_state}_blocked_s", async_saver.blocked_s)
            del state
            async_saver.wait()
            record(f"dcp_async_{a.async_state}_total_s", time.perf_counter() - t)
        gc.collect()
    async_saver.close()
    del model, opt
    gc.collect()
    for _r in range(a.repeats):
        model, opt = build(a.size, False)
        t = time.perf_counter()
        path = ckpt.step_dir(root / "file", 1)
        restore.load_weights(model, path)
        opt.load_state_dict(restore.load_state(path)["optimizer"])
        record("file_load_s", time.perf_counter() - t)
        del model, opt
        gc.collect()
        model, opt = build(a.size, False)
        t = time.perf_counter()
        path = ckpt.step_dir(root / "dcp", 1)
        restore.load_weights(model, path)
        sharded.load_dcp(path, model, opt, weights=False)
        record("dcp_load_s", time.perf_counter() - t)
        del model, opt
        gc.collect()
    for name, v in times.items():
        print(
            json.dumps(
                {
                    "size": a.size,
                    "what": name,
                    "median": round(statistics.median(v), 3),
                    "all": [round(x, 3) for x in v],
                }
            ),
            flush=True,
        )
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
