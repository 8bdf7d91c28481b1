"""The plan each kind of run resolves to, recorded: a restructuring of the assembly must leave every resolved value,
reason and ``run.json`` field as it was.

Each case is a dry run (the model on the meta device; GPU cases on a pretend H100, nothing allocated) or, for the
``run.json`` fields, a short CPU run. The record is ``plan_snapshot.json`` beside this file; after a change that
is meant to change plans, rewrite it with ``GPTOUGHTS_UPDATE_SNAPSHOT=1 pytest tests/training/test_plan_snapshot.py``
and read the diff before committing it."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from cli_helpers import FAST, pretend_gpu

from gptoughts.config import load_config
from gptoughts.training import build as build_mod
from gptoughts.training import environment as environment_mod

SNAPSHOT = Path(__file__).with_name("plan_snapshot.json")
# Measured or machine-dependent: the CPU's speed, paths, the clock, the host's memory and torch's version.
VOLATILE_PLAN = {"tokens_per_s", "hours", "speed_basis", "out", "host_memory_gib", "checkpoint_staging_gib"}
VOLATILE_RUN = {"started", "torch", "hardware", "device", "data", "threads", "plan"}
VOLATILE_RESOLVED = {"threads"}

HF, SFT = "<a Hugging Face model>", "<prompt/response rows>"  # made by the test: _materialise
# name: (overrides, pretend GPU memory in GiB or None for a CPU run, the process group's shape)
CASES: dict[str, tuple[dict, float | None, dict]] = {
    "llama-debug-cpu": ({"model.family": "llama", "model.size": "debug", "perf.device": "cpu"}, None, {}),
    "llama-1b": ({"model.family": "llama", "model.size": "1b"}, 80, {}),
    "llama-8b-40g": ({"model.family": "llama", "model.size": "8b", "perf.gpu_memory_gib": 40}, 80, {}),
    "inl-3b-24g": ({"model.family": "inl", "model.size": "3b", "perf.gpu_memory_gib": 24}, 80, {}),
    "inl-4b-40g": ({"model.family": "inl", "model.size": "4b", "perf.gpu_memory_gib": 40}, 80, {}),
    "deepseek-small": ({"model.family": "deepseek", "model.size": "small"}, 80, {}),
    "deepseek-16b": ({"model.family": "deepseek", "model.size": "16b"}, 80, {}),
    "llada-medium": ({"model.family": "llada", "model.size": "medium"}, 80, {}),
    "gpt2-small": ({"model.family": "gpt2", "model.size": "small"}, 80, {}),
    "gpt2-xl-16g": ({"model.family": "gpt2", "model.size": "xl", "perf.gpu_memory_gib": 16}, 80, {}),
    "llama-1b-fp8": ({"model.family": "llama", "model.size": "1b", "perf.fp8": True}, 80, {}),
    "llama-125m-whole-compile": (
        {"model.family": "llama", "model.size": "125m", "perf.compile_mode": "model"},
        80,
        {},
    ),
    "llama-125m-long": ({"model.family": "llama", "model.size": "125m", "train.max_steps": 100000}, 80, {}),
    # fine-tuning a (tiny, random) Hugging Face model on prompt/response rows: SFT, full and LoRA
    "finetune-sft-cpu": ({"model.init_from": HF, "data.sources": SFT, "perf.device": "cpu"}, None, {}),
    "finetune-lora-sft": ({"model.init_from": HF, "data.sources": SFT, "lora.enabled": True}, 80, {}),
    "llama-1b-fixed-batch": (
        {"model.family": "llama", "model.size": "1b", "train.batch_size": 4, "train.grad_accum": 2},
        80,
        {},
    ),
    "llama-8b-fsdp4": (
        {"model.family": "llama", "model.size": "8b", "parallel.strategy": "fsdp", "train.batch_size": 4},
        80,
        {"world_size": 4, "strategy": "fsdp"},
    ),
    "llama-8b-tp2-dp2": (
        {"model.family": "llama", "model.size": "8b", "parallel.tp": 2, "train.batch_size": 4},
        80,
        {"world_size": 4, "strategy": "fsdp", "tp": 2},
    ),
    "llama-8b-pp2": (
        {"model.family": "llama", "model.size": "8b", "parallel.pp": 2, "train.batch_size": 4},
        80,
        {"world_size": 2, "strategy": "ddp", "pp": 2},
    ),
    "inl-3b-offload-16g": (
        {"model.family": "inl", "model.size": "3b", "parallel.cpu_offload": True, "perf.gpu_memory_gib": 16},
        80,
        {"strategy": "fsdp", "cpu_offload": True},
    ),
    "llama-1b-epochs-schedule": (
        {"model.family": "llama", "model.size": "1b", "train.epochs": 3, "train.schedule": "wsd"},
        80,
        {},
    ),
}


def _corpus(tmp_path: Path) -> Path:
    """A corpus that is the same on every machine (the stdlib's files differ between Python builds)."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.txt").write_text(
        "".join(f"line {i}: the quick brown fox {i * 7 % 13} jumps\n" for i in range(3000))
    )
    return folder


def _materialise(overrides: dict, tmp_path: Path, monkeypatch) -> tuple[str | None, dict]:
    """The preset and the overrides with the test's own corpus (and Hugging Face model) in place."""
    if overrides.get("model.init_from") != HF:
        return None, {"data.sources": [str(_corpus(tmp_path))], **overrides}
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "finetune"))
    from hf_helpers import save_hf_model, sft_rows

    return "finetune", {
        **overrides,
        "model.init_from": str(save_hf_model(tmp_path / "hf", "llama")),
        "data.sources": [str(sft_rows(tmp_path / "d.jsonl"))],
    }


def _scrub(value, tmp: str):
    if isinstance(value, dict):
        return {k: _scrub(v, tmp) for k, v in value.items()}
    if isinstance(value, list):
        return [_scrub(v, tmp) for v in value]
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, str):
        return value.replace(tmp, "<tmp>")
    return value


def _plan_record(plan: dict, tmp: str) -> dict:
    plan = {k: v for k, v in plan.items() if k not in VOLATILE_PLAN}
    plan["resolved"] = {k: v for k, v in plan["resolved"].items() if k not in VOLATILE_RESOLVED}
    plan["batch"]["why"] = {k: v for k, v in plan["batch"]["why"].items() if k not in VOLATILE_RESOLVED}
    if plan.get("device_type") == "cpu":  # the host's free memory bounds a CPU plan
        plan.pop("device_memory_gib", None)
    return _scrub(plan, tmp)


def _dry_plan(name: str, tmp_path: Path, monkeypatch) -> dict:
    overrides, gpu_gib, group = CASES[name]
    if gpu_gib is not None:
        pretend_gpu(monkeypatch, gpu_gib)
    preset, overrides = _materialise(overrides, tmp_path, monkeypatch)
    cfg = load_config(preset, {"run.out": str(tmp_path / "run"), **overrides})
    env = environment_mod.setup_environment(replace(cfg, parallel=replace(cfg.parallel, strategy="none", tp=1, pp=1,
                                                                    cpu_offload=False)))  # fmt: skip
    if group:  # rank 0's view of a group that is not started: what it would broadcast, it keeps
        env = replace(env, dist=replace(env.dist, **group))
        monkeypatch.setattr(build_mod.pdist, "broadcast_object", lambda obj, dist, src=0: obj)
    asm = build_mod.build(cfg, dry_run=True, env=env)
    return _plan_record(asm.plan.to_dict(), str(tmp_path))


def _runs(tmp_path: Path) -> dict:
    """run.json of a short CPU run and of its resume to a later step."""
    corpus = _corpus(tmp_path)
    out = tmp_path / "run"
    base = {**FAST, "data.sources": [str(corpus)], "run.out": str(out), "model.size": "debug",
            "data.tokenizer": "bytes", "train.block_size": 32, "train.batch_size": 2, "perf.threads": 1}  # fmt: skip
    records = {}
    for name, extra in (
        ("cpu-run", {"train.max_steps": 2}),
        ("cpu-resume", {"train.max_steps": 4, "run.resume": "auto"}),
    ):
        asm = build_mod.build(load_config(None, {**base, **extra}))
        try:
            asm.trainer.fit()
        finally:
            asm.close()
        record = json.loads((out / "run.json").read_text())
        kept = {k: v for k, v in record.items() if k not in VOLATILE_RUN}
        kept["resolved"] = {k: v for k, v in kept["resolved"].items() if k not in VOLATILE_RESOLVED}
        kept["plan"] = _plan_record(record["plan"], str(tmp_path))
        records[name] = _scrub(kept, str(tmp_path))
    return records


def _check(name: str, got: dict) -> None:
    recorded = json.loads(SNAPSHOT.read_text()) if SNAPSHOT.exists() else {}
    if os.environ.get("GPTOUGHTS_UPDATE_SNAPSHOT"):
        recorded[name] = json.loads(json.dumps(got, default=str))
        SNAPSHOT.write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n")
        return
    assert name in recorded, f"no record of {name}: run with GPTOUGHTS_UPDATE_SNAPSHOT=1"
    assert json.loads(json.dumps(got, default=str)) == recorded[name]


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_dry_runs_plan_is_as_recorded(name, tmp_path, cache_dir, monkeypatch):
    _check(name, _dry_plan(name, tmp_path, monkeypatch))


def test_a_runs_and_its_resumes_run_json_are_as_recorded(tmp_path, cache_dir):
    torch.manual_seed(0)
    for name, record in _runs(tmp_path).items():
        _check(name, record)
