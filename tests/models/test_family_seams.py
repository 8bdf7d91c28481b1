"""Where the MoE, INL and Muon switches meet the rest of a run: resume, loading, sampling, export, the plan.

The speed switches of a family (DeepSeek's ``moe_*``, INL's ``integrator_impl``) change kernels, never the model,
so a run resumes across them; runs saved before the MoE defaults changed load and resume as they trained."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_helpers import FASTRUN, run_cli

from gptoughts import models
from gptoughts.config import load_config
from gptoughts.training.rundir import architecture_changes

RUN = [
    *FASTRUN,
    "--tokenizer",
    "bytes",
    "--train.schedule",
    "constant",
    "--warmup_steps",
    "0",
    "--log_interval",
    "1",
]


def _config(family: str, **model: object):
    return load_config(
        None, {"model.family": family, "model.size": "debug", **{f"model.{k}": v for k, v in model.items()}}
    )


@pytest.mark.parametrize(
    ("family", "switches"),
    [
        ("deepseek", dict(moe_combine="bmm", moe_permute="index_put")),
        ("deepseek", dict(moe_combine="sum", moe_router="gather", moe_shared="before")),
        ("inl", dict(integrator_impl="fused")),
    ],
)
def test_speed_switches_are_no_architecture_change(family, switches):
    assert architecture_changes(_config(family), _config(family, **switches)) == []
    # ...while a field that changes the model still is one, named with its values
    changed = architecture_changes(_config(family), _config(family, **switches, n_layers=5))
    assert len(changed) == 1 and changed[0].startswith("n_layers") and changed[0].endswith("-> 5")


def test_every_declared_speed_switch_is_a_field():
    for family in ("deepseek", "inl"):
        cls = models.get_family(family).args_cls
        fields = set(cls.__dataclass_fields__)
        assert cls.KERNEL_FIELDS and cls.KERNEL_FIELDS <= fields, family


def _losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _train(capsys, *argv: str) -> str:
    code, text = run_cli(["train", *argv, *RUN], capsys)
    assert code == 0 and "Traceback" not in text, text[-2000:]
    return text


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "switches"),
    [
        ("deepseek", ["--model.moe_combine", "bmm", "--model.moe_permute", "index_put"]),
        ("inl", ["--model.integrator_impl", "fused"]),
    ],
)
def test_a_run_resumes_with_a_speed_switch_flipped_and_trains_alike(
    family, switches, tmp_path, text_corpus, cache_dir, capsys
):
    base = ["--data", str(text_corpus), "--model", family, "--size", "debug", "--save_interval", "2"]
    ref, flipped = tmp_path / "ref", tmp_path / "flipped"
    _train(capsys, *base, "--out", str(ref), "--max_steps", "4")
    _train(capsys, *base, "--out", str(flipped), "--max_steps", "2")
    text = _train(capsys, "--resume", "auto", "--out", str(flipped), "--max_steps", "4", *switches)
    assert "resumed from" in text
    a, b = _losses(ref), _losses(flipped)
    for step in (3, 4):  # fp32: only summation orders differ
        assert abs(a[step] - b[step]) < 1e-5 * a[step], (step, a[step], b[step])


@pytest.mark.slow
def test_a_deepseek_run_saved_before_the_moe_switches_loads_and_resumes_alike(
    tmp_path, text_corpus, cache_dir, capsys
):
    base = ["--data", str(text_corpus), "--model", "deepseek", "--size", "debug", "--save_interval", "2"]
    ref, old = tmp_path / "ref", tmp_path / "old"
    _train(capsys, *base, "--out", str(ref), "--max_steps", "4")
    _train(capsys, *base, "--out", str(old), "--max_steps", "2")
    # what such a run wrote: its model args without the moe_* fields
    run_json = json.loads((old / "run.json").read_text())
    for name in ("moe_combine", "moe_permute", "moe_router", "moe_shared", "moe_w13"):
        del run_json["args"][name]
    (old / "run.json").write_text(json.dumps(run_json))
    code, text = run_cli(
        ["sample", str(old), "--prompt", "def ", "--max_new_tokens", "4", "--device", "cpu"], capsys
    )
    assert code == 0 and "Traceback" not in text, text[-2000:]
    _train(capsys, "--resume", "auto", "--out", str(old), "--max_steps", "4")
    a, b = _losses(ref), _losses(old)
    for step in (3, 4):
        assert abs(a[step] - b[step]) < 1e-5 * a[step], (step, a[step], b[step])


def _optimizer_line(capsys, corpus: Path, *flags: str) -> str:
    argv = [
        "train",
        "--dry_run",
        "--data",
        str(corpus),
        "--model",
        "deepseek",
        "--size",
        "debug",
        *flags,
        *RUN,
    ]
    code, text = run_cli(argv, capsys)
    assert code == 0 and "Traceback" not in text, text[-2000:]
    return next(line for line in text.splitlines() if line.strip().startswith("optimizer:"))


def test_the_plan_says_how_muons_step_runs(text_corpus, cache_dir, capsys):
    line = _optimizer_line(capsys, text_corpus, "--optimizer", "muon")
    assert "Newton-Schulz" not in line  # the default step: nothing to say
    line = _optimizer_line(
        capsys,
        text_corpus,
        "--optimizer",
        "muon",
        "--perf.muon_compile",
        "true",
        "--perf.muon_distribute",
        "true",
    )
    # on the CPU the step stays eager, and one process has no sharded matrices to spread
    assert "Newton-Schulz eager (perf.muon_compile compiles on CUDA only" in line, line
    assert "whole on every rank (perf.muon_distribute: no sharded matrices)" in line, line
