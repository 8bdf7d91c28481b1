"""A dry run's plan carries the same ``parallel:`` line as the run it describes: the process layout, FSDP's reshard
rule and, under accumulation, when the gradients are reduced. The line came from the built model, which a dry run
does not build, so a dry run under torchrun (or with CPU offload) printed no ``parallel:`` line at all."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_helpers import FASTRUN, ok

from gptoughts.config import load_config
from gptoughts.models import build_model, model_args
from gptoughts.parallel.dist import DistInfo
from gptoughts.training import build as build_mod
from gptoughts.training import environment as environment_mod
from gptoughts.training.setup import parallel_layout

# The same run, short: one step of two micro-batches (the reduction rule is printed only under accumulation).
ARGS = ["--size", "debug", "--tokenizer", "bytes", "--grad_accum", "2", "--max_steps", "1", "--eval_interval", "0",
        "--train.checkpoints", "false", "--train.sample_prompts=", "--precision", "fp32", "--compile", "false"]  # fmt: skip


def _parallel_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("  parallel: ")]


def _corpus(tmp_path: Path) -> Path:
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 400)
    return folder


def _meta_llama() -> torch.nn.Module:
    with torch.device("meta"):
        return build_model("llama", model_args("llama", "debug", {}))


def test_the_layout_is_decided_from_the_process_group_and_the_model():
    raw = _meta_llama()
    assert parallel_layout(DistInfo(), raw) is None  # one process: no line
    assert parallel_layout(DistInfo(world_size=2, strategy="fsdp"), raw) == "fsdp x2"
    assert parallel_layout(DistInfo(world_size=2, strategy="ddp"), raw) == "ddp x2"
    assert parallel_layout(DistInfo(world_size=4, strategy="fsdp", tp=2), raw) == "fsdp x2, tp x2"
    assert parallel_layout(DistInfo(world_size=2, strategy="ddp", pp=2), raw) == "ddp x1, pipeline x2"
    assert parallel_layout(DistInfo(strategy="fsdp", cpu_offload=True), raw) == "fsdp x1 + cpu offload"


@pytest.mark.parametrize(
    ("group", "expected"),
    [
        ({"world_size": 2, "strategy": "fsdp"}, "  parallel: fsdp x2; reshard_after_forward true ("),
        ({"world_size": 2, "strategy": "ddp"}, "  parallel: ddp x2"),
    ],
    ids=["fsdp", "ddp"],
)
def test_a_dry_run_of_two_processes_prints_the_parallel_line(
    group, expected, tmp_path, cache_dir, monkeypatch
):
    """Rank 0's view of a group of two that is not started (what it would broadcast, it keeps): the plan has the
    layout, and under FSDP with accumulation the reduction rule."""
    corpus = _corpus(tmp_path)
    cfg = load_config(None, {"data.sources": [str(corpus)], "run.out": str(tmp_path / "run"), "model.size": "debug",
                             "data.tokenizer": "bytes", "train.block_size": 32, "train.batch_size": 2,
                             "train.grad_accum": 2, "perf.device": "cpu", "perf.precision": "fp32",
                             "perf.compile": False, "parallel.strategy": group["strategy"]})  # fmt: skip
    # the process group's shape pretended, the environment's own FSDP rules applied to it
    monkeypatch.setattr(environment_mod.pdist, "init", lambda *a, **k: DistInfo(**group))
    env = environment_mod.setup_environment(cfg)
    monkeypatch.setattr(build_mod.pdist, "broadcast_object", lambda obj, dist, src=0: obj)
    asm = build_mod.build(cfg, dry_run=True, env=env)
    lines = _parallel_lines(asm.plan.format())
    assert len(lines) == 1 and lines[0].startswith(expected), asm.plan.format()
    assert ("gradients reduced after the last micro-batch" in lines[0]) == (group["strategy"] == "fsdp")
    assert not (tmp_path / "run").exists()


def test_a_dry_run_with_cpu_offload_prints_the_line_the_run_prints(tmp_path, cache_dir, capsys):
    """One process with CPU offload (FSDP2 in a process group of one): the dry run and the run, same arguments."""
    corpus = _corpus(tmp_path)
    argv = ["train", "--data", str(corpus), *ARGS, *FASTRUN, "--parallel.cpu_offload", "true"]
    dry = _parallel_lines(ok([*argv, "--out", str(tmp_path / "dry"), "--dry_run"], capsys))
    real = _parallel_lines(ok([*argv, "--out", str(tmp_path / "real")], capsys))
    assert real and real[0].startswith(
        "  parallel: fsdp x1 + cpu offload; gradients reduced every micro-batch"
    )
    assert dry == real
    assert not (tmp_path / "dry").exists()


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    ("strategy", "expected"),
    [
        ("fsdp", "  parallel: fsdp x2; reshard_after_forward true (auto: "),
        ("ddp", "  parallel: ddp x2"),
    ],
    ids=["fsdp", "ddp"],
)
def test_under_torchrun_the_dry_run_and_the_run_print_the_same_parallel_line(
    strategy, expected, tmp_path, text_corpus, cache_dir
):
    """2 gloo processes, accumulation 2: FSDP's line names the reshard and the reduction rules, DDP's its layout."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "gptoughts",
              "train", "--data", str(text_corpus), *ARGS, *FASTRUN, "--parallel.strategy", strategy]  # fmt: skip
    lines = {}
    for name, extra in (("dry", ["--dry_run"]), ("real", [])):
        out = tmp_path / name
        r = subprocess.run(
            [*launch, "--out", str(out), *extra], env=env, capture_output=True, text=True, timeout=300
        )
        assert r.returncode == 0, r.stderr[-3000:]
        lines[name] = _parallel_lines(r.stdout + r.stderr)
    assert len(lines["real"]) == 1 and lines["real"][0].startswith(expected), lines
    assert ("gradients reduced after the last micro-batch" in lines["real"][0]) == (strategy == "fsdp")
    assert lines["dry"] == lines["real"]
    assert not (tmp_path / "dry").exists()
