"""`gptoughts estimate` and the plan `gptoughts train --dry_run` prints agree for the same flags: the run's token
count, the layout the launch takes, the loss the run computes and what an offloaded or pipelined run can be
estimated at."""

from __future__ import annotations

import json
import math
import re
from types import SimpleNamespace

import pytest
import torch
from cli_helpers import h100, refused

from gptoughts import cli
from gptoughts.config import load_config
from gptoughts.models import model_args
from gptoughts.perf.estimate import estimate_config
from gptoughts.training.estimates import estimate_peak


def _estimate(capsys, *flags: str) -> dict:
    assert cli.main(["estimate", "--size", "1b", "--batch_size", "4", *flags, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


STEP = 4 * 2048  # micro-batch 4 x block 2048, no accumulation, on each data-parallel rank


@pytest.mark.parametrize(
    ("flags", "tokens"),
    [
        (["--max_steps", "1000"], 1000 * STEP),
        # train rounds a token budget up to whole steps (batches._total_steps)
        (["--max_tokens", "1e9"], math.ceil(1e9 / STEP) * STEP),
        # each data-parallel rank reads its own rows
        (["--max_steps", "1000", "--num_gpus", "2"], 2 * 1000 * STEP),
    ],
)
def test_the_time_is_of_the_tokens_the_runs_stopping_rule_trains(flags, tokens, capsys):
    # --max_tokens and --max_steps set the run's length in train; the estimate printed no time for them
    e = _estimate(capsys, *flags)
    assert e["tokens"] == tokens
    assert e["hours"] == pytest.approx(tokens / e["tokens_per_s"] / 3600)


@pytest.mark.parametrize("rule", [["--max_steps", "1000"], ["--max_tokens", "2e9"], ["--epochs", "2"]])
def test_tokens_beside_a_stopping_rule_is_refused(rule, capsys):
    refused(
        ["estimate", "--size", "1b", "--batch_size", "4", *rule, "--tokens", "1e9"],
        capsys,
        "--tokens",
        rule[0],
    )


def test_tensor_parallel_ranks_shard_as_the_launch_does():
    # with --parallel.tp and several data-parallel ranks the launch takes FSDP2 (parallel/dist.py): strategy auto
    # was estimated as DDP, ~19 GiB more a GPU at 8b than the dry run's plan
    flags = {"model.size": "8b", "train.batch_size": 4, "parallel.tp": 2}
    auto = estimate_config(load_config(None, flags), num_gpus=4)[0]
    fsdp = estimate_config(load_config(None, {**flags, "parallel.strategy": "fsdp"}), num_gpus=4)[0]
    assert auto.strategy == "fsdp" and auto.total_gib == fsdp.total_gib


def test_an_offloaded_run_has_no_speed_estimate_as_in_the_plan(capsys):
    # the plan says "time: measured once the run starts" (host-device copies and the CPU's optimizer step bound
    # it); the estimate printed the GPU's FLOP-bound speed and a cost from it
    e = _estimate(capsys, "--parallel.cpu_offload", "true", "--tokens", "1e9")
    assert e["tokens_per_s"] is None and e["hours"] is None and e["cost"] is None
    assert cli.main(["estimate", "--size", "1b", "--batch_size", "4", "--parallel.cpu_offload", "true"]) == 0
    assert "measured once the run starts" in capsys.readouterr().out


def test_a_pipeline_is_refused_as_the_plan_does_not_estimate_it(capsys):
    # the estimate knows no pipeline stages (the plan prints "memory: not estimated"); it printed a whole model's
    refused(["estimate", "--size", "8b", "--batch_size", "4", "--parallel.pp", "2", "--num_gpus", "2"], capsys,
            "--parallel.pp")  # fmt: skip


SHAPE = {"model.size": "debug", "data.tokenizer": "bytes", "train.batch_size": 8, "train.block_size": 256}


def _plan_peak(**perf: object) -> float:
    base = load_config(None, {**SHAPE, **{f"perf.{k}": v for k, v in perf.items()}})
    env = SimpleNamespace(
        device=torch.device("cuda", 0),
        hw=SimpleNamespace(name="NVIDIA H100 80GB HBM3"),
        precision="bf16",
        dist=SimpleNamespace(pp=1, strategy="none", cpu_offload=False, reshard_after_forward=True),
    )
    args = model_args("llama", "debug", {"vocab_size": 320})  # what --tokenizer bytes trains with
    model = SimpleNamespace(args=args, family=SimpleNamespace(name="llama"), pretrained=None)
    e = estimate_peak(base, env, model, 8, 256, 1)
    assert e is not None
    return e.total_gib


def test_the_plans_memory_counts_the_loss_the_run_computes():
    # --perf.loss plain on a GPU keeps the whole batch's logits; the plan counted the chunked loss's (estimate did not)
    chunked = _plan_peak()
    assert _plan_peak(loss="plain") > chunked
    assert _plan_peak(loss_chunk=256) < chunked
    # and the plan's figures are the estimate's
    assert estimate_config(load_config(None, {**SHAPE, "perf.loss": "plain"}))[0].total_gib == _plan_peak(
        loss="plain"
    )
    assert estimate_config(load_config(None, SHAPE))[0].total_gib == chunked


def test_an_automatic_batch_reaches_the_global_batch_as_train_plans_it():
    # train takes the smallest micro-batch that reaches the global batch with the fewest accumulation steps
    # (batches._auto_accumulation); the estimate kept the largest that fits: 64 x 3 rows, 31% over 300,000 tokens
    cfg = load_config(None, {"model.size": "125m", "train.global_batch_tokens": 300_000})
    _, micro, accum = estimate_config(cfg)
    assert accum > 1
    assert abs(micro * accum * cfg.train.block_size - 300_000) < 0.02 * 300_000


def _trains_layout(flags: dict, gpu_gib: float) -> dict[str, str]:
    """What train's memory layout chooser (training/estimates.py) changes for ``flags`` on one H100 of ``gpu_gib``."""
    from gptoughts.parallel.dist import DistInfo
    from gptoughts.training.environment import Environment
    from gptoughts.training.estimates import layout_search

    cfg = load_config(None, flags)
    env = Environment(torch.device("cuda", 0), DistInfo(), h100(gpu_gib), "bf16")
    vocab = -(-int(cfg.data.tokenizer.split(":")[1]) // 64) * 64  # what the size's BPE tokenizer plans
    args = model_args(cfg.model.family, cfg.model.size, {"vocab_size": vocab})
    model = SimpleNamespace(args=args, family=SimpleNamespace(name=cfg.model.family), pretrained=None)
    search = layout_search(cfg, env, model)  # (the environment caps the GPU's memory at --gpu_memory_gib)
    return search.choose().why


def test_the_estimate_takes_the_memory_layout_train_chooses():
    # under --gpu_memory_gib 40 train turns on full checkpointing and bf16 optimizer states for llama/3b; the estimate
    # printed the defaults' 56 GiB "DOES NOT FIT" and a micro-batch train never plans
    flags = {"model.size": "3b", "perf.gpu_memory_gib": 40}
    trains = _trains_layout(flags, 40)
    e = estimate_config(load_config(None, flags))[0]
    assert trains and e.layout == trains
    assert e.activation_checkpointing == trains["activation_checkpointing"].split(" ")[0]
    assert e.fits and e.refusal is None


def test_a_short_runs_time_and_cost_are_in_units_that_show_them(capsys):
    # a few minutes of training printed "0.0 h, $0"; the plan says "~3 min"
    for tokens in ("3e6", "1e8"):
        assert cli.main(["estimate", "--size", "125m", "--batch_size", "8", "--tokens", tokens]) == 0
        line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("time for"))
        cost = r"(\$\d+\.\d\d|under \$0\.01)"
        assert re.fullmatch(rf"time for [\d,]+ tokens: \d+ (s|min), {cost} at \$2\.5/h per GPU", line), line


def test_fp8_auto_is_counted_where_the_run_turns_it_on(monkeypatch):
    # perf.fp8 = auto (llada's sizes) turns torchao's float8 on on Hopper at d_model >= 2048 (training/resolve.py);
    # the estimate counted bf16 whatever the GPU
    import importlib.machinery
    import sys
    import types

    from gptoughts.perf.hardware import fp8_auto

    torchao = types.ModuleType("torchao")  # as on a machine that has it
    torchao.__spec__ = importlib.machinery.ModuleSpec("torchao", None)
    monkeypatch.setitem(sys.modules, "torchao", torchao)
    flags = {"model.family": "llama", "model.size": "3b", "train.batch_size": 4, "perf.fp8": "auto"}
    auto = {gpu: estimate_config(load_config(None, flags), gpu=gpu)[0] for gpu in ("H100", "A100")}
    asked = {
        v: estimate_config(load_config(None, {**flags, "perf.fp8": v}), gpu="H100")[0] for v in (True, False)
    }
    assert fp8_auto("hopper", 3072, "tensorwise")[0] and not fp8_auto("ampere", 3072, "tensorwise")[0]
    assert auto["H100"].total_gib == asked[True].total_gib < asked[False].total_gib
    assert auto["H100"].tokens_per_s == asked[True].tokens_per_s > asked[False].tokens_per_s
    assert auto["A100"].tokens_per_s < auto["H100"].tokens_per_s  # (A100: off, and a lower peak)


@pytest.mark.parametrize("device", ["cpu", "mps"])
def test_a_run_on_a_cpu_is_not_estimated_on_a_gpu(device, capsys):
    # `--device cpu` (a run train makes on this CPU) was estimated on an H100, with its speed and a cost
    refused(["estimate", "--size", "125m", "--device", device], capsys, f"--device {device} --dry_run")
