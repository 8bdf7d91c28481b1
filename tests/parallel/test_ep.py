"""Expert parallelism (parallel/ep.py) on gloo: the routed experts split over 2 ranks, tokens exchanged by
all-to-all, FSDP2 over the rest. Two ranks with batch 2 each read the rows one process reads with batch 4, so
both train alike; checkpoints move between the two layouts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gptoughts.config import ParallelConfig
from gptoughts.config.validation import check_parallel
from gptoughts.errors import ConfigError
from gptoughts.models import model_args
from gptoughts.parallel import dist as pdist
from gptoughts.parallel.ep import check_ep
from gptoughts.training.checkpoint import store as ckpt

ARGS = [
    "--model.size", "debug", "--data.tokenizer", "bytes", "--eval_batches", "2",
    "--perf.device", "cpu", "--precision", "fp32", "--compile", "false", "--perf.threads", "1",
    "--run.progress", "false", "--log_interval", "1", "--eval_interval", "3", "--save_interval", "3",
    "--train.schedule", "constant", "--warmup_steps", "0", "--sample_prompts", "def ",
    "--sample_max_new_tokens", "4", "--block_size", "32",
]  # fmt: skip
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _train(
    out: Path, corpus: Path, *extra: str, procs: int = 1, family: str = "deepseek"
) -> subprocess.CompletedProcess:
    launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}"] if procs > 1 else []
    return subprocess.run(
        [sys.executable, *launch, "-m", "gptoughts", "train", "default", "--out", str(out),
         "--data", str(corpus), "--model.family", family, *ARGS, *extra],
        env=ENV, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def _ok(r: subprocess.CompletedProcess) -> None:
    assert r.returncode == 0, r.stderr[-3000:]


def _rows(run: Path) -> dict[int, dict]:
    """The last logged row of each step (a resumed run appends its own)."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "loss" in r}


def _close(a: dict[int, dict], b: dict[int, dict], steps: list[int]) -> None:
    # fp32 on both sides; the only differences are summation orders (all-reduces, row order in the experts' GEMMs)
    for s in steps:
        assert abs(a[s]["loss"] - b[s]["loss"]) < 1e-5 * abs(a[s]["loss"]), (s, a[s]["loss"], b[s]["loss"])


@pytest.mark.distributed
def test_ep2_trains_like_one_process_and_checkpoints_move_both_ways(tmp_path, text_corpus, cache_dir):
    one, ep, one_then_ep = tmp_path / "one", tmp_path / "ep", tmp_path / "one_then_ep"
    _ok(_train(one, text_corpus, "--batch_size", "4", "--max_steps", "7"))
    r = _train(ep, text_corpus, "--batch_size", "2", "--max_steps", "5", "--parallel.ep", "2", procs=2)
    _ok(r)
    assert "fsdp x2, expert parallel x2: 4 of 8 experts a rank, tokens all-to-all" in r.stdout
    a, b = _rows(one), _rows(ep)
    _close(a, b, [1, 2, 3, 4, 5])
    # the logged loads are all ranks' (summed before logging), and so are the bias updates (else routing, and the
    # losses above, would part ways)
    loads = [k for k in a[1] if k.startswith("moe/l")]
    assert loads and all(abs(a[s][k] - b[s][k]) < 1e-6 for s in (1, 5) for k in [*loads, "moe/load_max"])
    assert ckpt.list_steps(ep / "checkpoints") == [3, 5]

    # the expert-parallel (sharded) checkpoint resumes in one process ...
    r = _train(ep, text_corpus, "--batch_size", "4", "--max_steps", "7", "--run.resume", "auto")
    _ok(r)
    _close(a, _rows(ep), [6, 7])

    # ... and a one-process checkpoint resumes under expert parallelism (its index-keyed optimizer state mapped
    # onto the groups that the DTensor experts split off)
    r = _train(
        one_then_ep, text_corpus, "--batch_size", "2", "--max_steps", "5", "--parallel.ep", "2",
        "--run.resume", str(one / "checkpoints" / "step_000003"), procs=2,
    )  # fmt: skip
    _ok(r)
    assert "resumed from" in r.stdout
    _close(a, _rows(one_then_ep), [4, 5])


@pytest.mark.distributed
def test_ep_refusals_under_torchrun_are_one_line_and_write_nothing(tmp_path, text_corpus, cache_dir):
    cases = [
        ("llama", [], "the llama family has no routed experts"),
        ("deepseek", ["--model.n_routed_experts", "7"], "the 7 routed experts do not split over 2"),
    ]
    for i, (family, extra, needle) in enumerate(cases):
        out = tmp_path / f"r{i}"
        r = _train(out, text_corpus, "--max_steps", "1", "--parallel.ep", "2", *extra, procs=2, family=family)
        assert r.returncode != 0
        lines = [line for line in (r.stdout + r.stderr).splitlines() if line.startswith("error:")]
        assert lines and needle in lines[0] and "Traceback" not in r.stdout, r.stdout + r.stderr[-2000:]
        assert not (out / "run.json").exists()


@pytest.mark.parametrize(
    ("family", "overrides", "needle"),
    [
        ("llama", {}, "the llama family has no routed experts"),
        ("deepseek", {"n_routed_experts": 6}, "the 6 routed experts do not split over 4"),
        ("deepseek", {"n_dense_layers": 3}, "no MoE layer"),
    ],
)
def test_check_ep_refusals(family, overrides, needle):
    args = model_args(family, "debug", overrides)
    with pytest.raises(ConfigError) as e:
        check_ep(family, args, 4)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_check_ep_accepts_a_divisor_and_refuses_lora_and_generic_models():
    check_ep("deepseek", model_args("deepseek", "debug"), 4)  # 8 experts
    for kw, needle in (({"lora": True}, "LoRA"), ({"generic": True}, "generic transformers")):
        with pytest.raises(ConfigError, match=needle):
            check_ep("deepseek", model_args("deepseek", "debug"), 2, **kw)


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"ep": 0}, "parallel.ep must be >= 1"),
        ({"ep": 2, "tp": 2}, "does not combine with --parallel.tp"),
        ({"ep": 2, "pp": 2}, "does not combine with --parallel.tp / --parallel.pp"),
        ({"ep": 2, "cpu_offload": True}, "--parallel.cpu_offload"),
        ({"ep": 2, "strategy": "ddp"}, "runs under FSDP2"),
    ],
)
def test_parallel_ep_config_refusals(fields, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        check_parallel(ParallelConfig(**fields))


def test_ep_without_torchrun_says_how_to_launch(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match=r"torchrun --nproc_per_node=2"):
        pdist.init(torch.device("cpu"), ep=2)
