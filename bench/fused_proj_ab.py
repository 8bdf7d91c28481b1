"""A/B in one process: q/k/v and gate/up projections as one matmul each (fused) vs separate matmuls."""

from __future__ import annotations

import json
import sys

from gptoughts.config import load_config
from gptoughts.models import layers
from gptoughts.perf.bench import run_bench

CONFIGS = [("1b", 2048, 8), ("125m", 1024, 64)]
rows = []
for size, block, batch in CONFIGS:
    for fused in (False, True, False, True):  # twice each, interleaved: the spread shows the noise
        layers.FUSED_PROJECTIONS = fused
        cfg = load_config("default", {"model.size": size, "train.block_size": block, "train.batch_size": batch,
                                      "perf.precision": "bf16", "perf.compile": True})
        r = run_bench(cfg, steps=15, warmup=5)
        rows.append({"size": size, "fused": fused, "tokens_per_s": r["tokens_per_s"], "mfu": r["mfu"],
                     "peak_memory_gib": r["peak_memory_gib"]})
        print(json.dumps(rows[-1]), flush=True)
with open(sys.argv[1], "w") as f:
    json.dump(rows, f, indent=1)
