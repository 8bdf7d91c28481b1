"""Run a matrix of `gptoughts bench` configurations in one process and write every result as JSON lines.

Usage (on the GPU machine):  python bench/gpu_matrix.py --out $OUT/matrix.jsonl --only 1b,125m
Each row is one configuration; a failing configuration is recorded with its error and the matrix goes on.
The configurations are the ones bench/BENCHMARKS.md reports (issue: GPU speed).
"""

from __future__ import annotations

import argparse
import json
import time
import traceback

import torch

from gptoughts.config import load_config
from gptoughts.tools.bench import format_result, run_bench

SHAPES = {
    # name: (size, block, batch)
    "125m": ("125m", 1024, 32),
    "1b": ("1b", 2048, 8),
    "3b": ("3b", 2048, 4),
}

MATRIX = {
    "1b": [
        {"compare": "hf"},
        {"perf.loss": "plain"},
        {"perf.loss": "liger"},
        {"perf.compile_mode": "model"},
        {"perf.sdpa_backend": "flash"},
        {"train.batch_size": 16},
        {"perf.fp8": True},
    ],
    "125m": [{"compare": "hf"}, {"train.batch_size": 64}],
    "3b": [
        {},
        {"perf.fp8": True},
        {"perf.fp8": True, "perf.fp8_recipe": "rowwise"},
        {"perf.activation_checkpointing": "selective"},
        {"perf.activation_checkpointing": "full"},
    ],
    # Each family's ~1B preset; the first row is a Llama of exactly LLaDA-medium's shape (same kernels claim).
    "families": [
        {
            "model.family": "llama",
            "model.n_layers": 22,
            "model.n_heads": 32,
            "model.n_kv_heads": 4,
            "model.ffn_dim": 5632,
        },
        {"model.family": "llada", "model.size": "medium"},
        {"model.family": "deepseek", "model.size": "small"},
        {"model.family": "gpt2", "model.size": "large", "train.block_size": 1024, "train.batch_size": 16},
        {"model.family": "inl", "model.size": "3b", "train.batch_size": 2},
    ],
    # Levers against the bf16 MFU targets (2026-11-22): residual stream in bf16, CUDA graphs, batch, autotune.
    "1b-levers": [
        {},
        {"perf.residual_dtype": "bf16"},
        {"perf.cuda_graphs": True},
        {"train.batch_size": 16},
        {"train.batch_size": 16, "perf.residual_dtype": "bf16"},
        {"train.batch_size": 24, "perf.residual_dtype": "bf16"},
    ],
    "1b-autotune": [{"perf.max_autotune": True}, {"perf.max_autotune": True, "perf.residual_dtype": "bf16"}],
    "125m-levers": [
        {"perf.compile_mode": "model"},
        {"perf.compile_mode": "model", "perf.residual_dtype": "bf16"},
        {"perf.compile_mode": "model", "perf.residual_dtype": "bf16", "train.batch_size": 128},
        {"perf.compile_mode": "model", "perf.cuda_graphs": True},
    ],
    # After removing the per-step host sync (2026-11-22): the bf16 targets side by side with transformers.
    "1b-confirm": [
        {"compare": "hf"},
        {"compare": "hf", "train.batch_size": 16, "perf.residual_dtype": "bf16"},
        {"train.batch_size": 32, "perf.residual_dtype": "bf16"},
        {"train.batch_size": 32},
    ],
    "125m-confirm": [
        {"perf.compile_mode": "model", "perf.residual_dtype": "bf16", "train.batch_size": 128},
        {"perf.compile_mode": "model", "perf.residual_dtype": "bf16", "train.batch_size": 256},
        {"perf.compile_mode": "model", "train.batch_size": 256},
    ],
    # 3b bf16 vs fp8 with the residual stream in bf16 (the default on CUDA since 2026-11-22).
    "3b-confirm": [{}, {"perf.fp8": True}],
    # fp8 with fast accumulation in the backward matmuls too (issue 13 item 5), twice each, side by side.
    "3b-fp8-levers": [{}, {"perf.fp8": True}, {"perf.fp8": True, "perf.fp8_fast_accum": True}] * 2,
    # Where the 3b fp8 step goes against bf16 (run with --kernels 2: the top kernels name torchao's casts).
    "3b-fp8-kernels": [{}, {"perf.fp8": True}],
    # fp8 with the casts fused into their producers beside torchao's (issue 33; bf16's table: 3b-fp8-kernels).
    "3b-fp8-fused-kernels": [
        {"perf.fp8": True},
        {"perf.fp8": True, "perf.fp8_recipe": "fused_rowwise"},
        {"perf.fp8": True, "perf.fp8_recipe": "fused_rowwise", "perf.fp8_wgrad": "fp8"},
    ],
    # The 1b target shape with today's defaults beside transformers (run with --kernels 2).
    "1b-now": [{"compare": "hf"}],
    # Final side-by-side of the 1b target after every change of 2026-11-22 (defaults: bf16 residual on CUDA).
    "1b-final": [{"compare": "hf"}, {"compare": "hf", "train.batch_size": 16}],
    "3b-residual": [
        {"perf.residual_dtype": "fp32"},
        {"perf.residual_dtype": "bf16"},
        {"perf.residual_dtype": "fp32"},
        {"perf.residual_dtype": "bf16"},
    ],
}
# The seeds' families against Llama (issue 31): the MoE and INL steps with kernel tables, and Muon's step cost
# beside AdamW's at the 47M shape, 125m and 1b.
_S47M = {
    "model.d_model": 512,
    "model.n_layers": 12,
    "model.n_heads": 8,
    "model.n_kv_heads": 8,
    "model.ffn_dim": 1408,
    "data.tokenizer": "bpe:8192",
    "train.block_size": 512,
    "train.batch_size": 32,
}
MATRIX["moe-inl"] = [
    {"model.family": "deepseek", "model.size": "small"},
    {"model.family": "inl", "model.size": "3b", "train.batch_size": 2},
]
MATRIX["muon"] = [
    {**_S47M, "model.size": "125m"},
    {**_S47M, "model.size": "125m", "train.optimizer": "muon"},
    {"model.size": "125m"},
    {"model.size": "125m", "train.optimizer": "muon"},
    {"model.size": "1b", "train.block_size": 2048, "train.batch_size": 8},
    {"model.size": "1b", "train.block_size": 2048, "train.batch_size": 8, "train.optimizer": "muon"},
]
_DS = {"model.family": "deepseek", "model.size": "small"}
MATRIX["moe-levers"] = [
    _DS,
    {**_DS, "model.moe_combine": "sum"},
    {**_DS, "model.moe_combine": "hidden"},
    {**_DS, "model.moe_permute": "gather", "model.moe_combine": "hidden"},
    {**_DS, "model.moe_permute": "gather", "model.moe_combine": "sum"},
    {**_DS, "model.moe_shared": "before"},
    {**_DS, "model.moe_combine": "hidden", "model.moe_permute": "gather", "model.moe_shared": "before"},
    _DS,
]
SHAPES["moe-levers"] = ("1b", 2048, 8)
_INL = {"model.family": "inl", "model.size": "3b", "train.batch_size": 2}
MATRIX["inl-levers"] = [
    _INL,
    {**_INL, "model.integrator_impl": "fused"},
    {**_INL, "model.integrator_impl": "fused", "perf.activation_checkpointing": "none"},
    {
        **_INL,
        "model.integrator_impl": "fused",
        "perf.activation_checkpointing": "none",
        "train.batch_size": 4,
    },
    {**_INL, "model.integrator_impl": "reference", "perf.activation_checkpointing": "none"},
]
SHAPES["inl-levers"] = ("1b", 2048, 8)
# The Triton integrator against the preset and the fused Function, side by side (the order alternates).
MATRIX["inl-triton"] = [
    _INL,
    {**_INL, "model.integrator_impl": "triton"},
    {
        **_INL,
        "model.integrator_impl": "fused",
        "perf.activation_checkpointing": "none",
        "train.batch_size": 4,
    },
    {
        **_INL,
        "model.integrator_impl": "triton",
        "perf.activation_checkpointing": "none",
        "train.batch_size": 4,
    },
    {**_INL, "model.integrator_impl": "triton", "perf.activation_checkpointing": "none"},
    _INL,
]
SHAPES["inl-triton"] = ("1b", 2048, 8)
# Kernel tables (run with --kernels 2): the INL preset and its fastest layout, and the MoE default.
MATRIX["inl-kernels"] = [MATRIX["inl-triton"][1], MATRIX["inl-triton"][3]]
SHAPES["inl-kernels"] = SHAPES["inl-triton"]
MATRIX["moe-kernels"] = [_DS]
SHAPES["moe-kernels"] = SHAPES["moe-levers"]
# The gate and up projections as one grouped GEMM, between two rows of the default (run with --kernels 2).
MATRIX["moe-w13"] = [_DS, {**_DS, "model.moe_w13": "fused"}, _DS]
SHAPES["moe-w13"] = SHAPES["moe-levers"]
MATRIX["muon-compile"] = [
    {**_S47M, "model.size": "125m"},
    {**_S47M, "model.size": "125m", "train.optimizer": "muon"},
    {**_S47M, "model.size": "125m", "train.optimizer": "muon", "perf.muon_compile": True},
    {"model.size": "125m"},
    {"model.size": "125m", "train.optimizer": "muon"},
    {"model.size": "125m", "train.optimizer": "muon", "perf.muon_compile": True},
    {"model.size": "1b", "train.block_size": 2048, "train.batch_size": 8},
    {"model.size": "1b", "train.block_size": 2048, "train.batch_size": 8, "train.optimizer": "muon"},
    {
        "model.size": "1b",
        "train.block_size": 2048,
        "train.batch_size": 8,
        "train.optimizer": "muon",
        "perf.muon_compile": True,
    },
]
SHAPES["muon-compile"] = SHAPES["125m"]
# The 47M rows alone (run with --kernels 2): where the compiled Muon's step loses time at this shape.
MATRIX["muon-47m"] = MATRIX["muon-compile"][:3]
SHAPES["muon-47m"] = SHAPES["125m"]
# The same rows with the model's steps replayed as CUDA graphs: does the host's launch time hide Muon's?
MATRIX["muon-47m-graphs"] = [{**r, "perf.cuda_graphs": True} for r in MATRIX["muon-47m"]]
SHAPES["muon-47m-graphs"] = SHAPES["125m"]

# Muon's whole step replayed as one CUDA graph (perf.muon_graph) against the step launched kernel by kernel, under
# the model's CUDA graphs, at 47M and at 125m (bench's 32 x 1024).
_GRAPHS = {"perf.cuda_graphs": True, "perf.muon_compile": True}
MATRIX["muon-graph"] = [
    {**_S47M, "model.size": "125m", "perf.cuda_graphs": True},
    {**_S47M, "model.size": "125m", "train.optimizer": "muon", **_GRAPHS, "perf.muon_graph": False},
    {**_S47M, "model.size": "125m", "train.optimizer": "muon", **_GRAPHS, "perf.muon_graph": True},
    {
        **_S47M,
        "model.size": "125m",
        "train.optimizer": "muon",
        "perf.cuda_graphs": True,
        "perf.muon_graph": True,
    },
    {"model.size": "125m", "perf.cuda_graphs": True},
    {"model.size": "125m", "train.optimizer": "muon", **_GRAPHS, "perf.muon_graph": False},
    {"model.size": "125m", "train.optimizer": "muon", **_GRAPHS, "perf.muon_graph": True},
]
SHAPES["muon-graph"] = SHAPES["125m"]
MATRIX["muon-graph-47m"] = MATRIX["muon-graph"][:3]  # with --kernels 2: where the recorded step's time goes
MATRIX["muon-graph-125m"] = [MATRIX["muon-graph"][i] for i in (4, 6)]  # AdamW and Muon recorded
SHAPES["muon-graph-47m"] = SHAPES["muon-graph-125m"] = SHAPES["125m"]
# Issue 31 item 5: the dense families (Llama of LLaDA-medium's shape, LLaDA, GPT-2) against an older checkout.
MATRIX["families-dense"] = [MATRIX["families"][i] for i in (0, 1, 3)]

SHAPES["moe-inl"] = ("1b", 2048, 8)
SHAPES["muon"] = SHAPES["125m"]
SHAPES["families"] = SHAPES["families-dense"] = ("1b", 2048, 8)
SHAPES["3b-confirm"] = SHAPES["3b-residual"] = SHAPES["3b-fp8-levers"] = SHAPES["3b-fp8-kernels"] = SHAPES[
    "3b-fp8-fused-kernels"
] = SHAPES["3b"]
SHAPES["1b-confirm"] = SHAPES["1b-final"] = SHAPES["1b-now"] = SHAPES["1b"]
SHAPES["125m-confirm"] = SHAPES["125m"]
SHAPES["1b-levers"] = SHAPES["1b-autotune"] = SHAPES["1b"]
SHAPES["125m-levers"] = ("125m", 1024, 64)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--only", default="1b,125m,3b,families")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument(
        "--kernels", type=int, default=0, help="profile this many extra steps per row (kernel table)"
    )
    a = p.parse_args()
    with open(a.out, "a") as f:
        for shape in a.only.split(","):
            size, block, batch = SHAPES[shape]
            for variant in MATRIX[shape]:
                variant = dict(variant)
                compare = variant.pop("compare", None)
                overrides = {
                    "model.size": size,
                    "train.block_size": block,
                    "train.batch_size": batch,
                    "perf.precision": "bf16",
                    "perf.compile": True,
                    "run.progress": False,
                    **variant,
                }
                t0 = time.time()
                try:
                    res = run_bench(
                        load_config("default", overrides),
                        steps=a.steps,
                        warmup=a.warmup,
                        compare=compare,
                        kernel_steps=a.kernels,
                    )
                    res["variant"] = variant
                    print(format_result(res), flush=True)
                except Exception as e:  # noqa: BLE001 - record and go on
                    res = {
                        "size": size,
                        "variant": variant,
                        "error": f"{type(e).__name__}: {e}",
                        "trace": traceback.format_exc()[-2000:],
                    }
                    print(f"FAILED {size} {variant}: {res['error']}", flush=True)
                res["wall_s"] = round(time.time() - t0, 1)
                f.write(json.dumps(res, default=str) + "\n")
                f.flush()
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
