"""The plan is of the run that starts, not of the config's first guess at it:

1. the memory layout (checkpointing, optimizer states, offload) is chosen for the micro-batch the run trains with:
   a size's default micro-batch cut for a small corpus (``batches.given_batch``), not the default before the cut;
2. ``compile_mode = auto`` times what a resumed run still has to train (its steps left), not the whole run;
3. a resume of a run that early stopping ended says that the patience's count carries over (the run stops again
   at its next evaluation without improvement) and how to train on; and it does just that."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from types import SimpleNamespace

import cli_helpers
import pytest
import torch
from cli_helpers import FASTRUN, ok

import gptoughts
from gptoughts import models
from gptoughts.config import load_config
from gptoughts.errors import UserError
from gptoughts.parallel.dist import DistInfo
from gptoughts.perf import hardware
from gptoughts.perf.layout import FIT
from gptoughts.training import build, resolve, setup


@pytest.fixture
def pretend_gpu(monkeypatch):
    cli_helpers.pretend_gpu(monkeypatch)


# --------------------------------------------------------------------- 1. the layout of the batch that runs
def _dry_run(tmp_path: Path, corpus: Path, capsys, **overrides) -> tuple[dict, str]:
    _, _, history = gptoughts.train(
        data_path=str(corpus),
        save_dir=str(tmp_path / "run"),
        dry_run=True,
        **{"data.tokenizer": "bytes", "train.block_size": 1024, "perf.compile": False, **overrides},
    )
    return history.plan, capsys.readouterr().out


def test_the_layout_is_chosen_for_the_default_batch_as_cut_for_a_small_corpus(
    tmp_path, text_corpus, cache_dir, capsys, pretend_gpu
):
    """~100,000 tokens at block 1,024: the debug size's default 8 rows a step are cut to 4 (one epoch of at least
    20 steps). Under a cap that 4 rows fit without checkpointing and 8 do not, the run trains without it: the layout
    was chosen for 4 rows (it was chosen for 8, and switched on checkpointing the 4 rows do not need)."""
    at4, _ = _dry_run(tmp_path, text_corpus, capsys, **{"train.batch_size": 4})
    at8, _ = _dry_run(tmp_path, text_corpus, capsys, **{"train.batch_size": 8})
    assert at4["memory_gib"] < at8["memory_gib"]
    cap = (at4["memory_gib"] + at8["memory_gib"]) / 2 / FIT  # 4 rows fit under FIT, 8 rows do not
    plan, text = _dry_run(tmp_path, text_corpus, capsys, **{"perf.gpu_memory_gib": cap})
    assert plan["batch"]["micro_batch"] == 4 and "the default 8" in plan["resolved"]["batch_size"], text
    assert plan["resolved"]["activation_checkpointing"].startswith("none"), text
    assert not {"optimizer_states", "cpu_offload"} & set(plan["resolved"]), text
    assert "activation checkpointing:" not in text and "CPU offload:" not in text, text
    assert plan["memory_gib"] == pytest.approx(at4["memory_gib"]) and plan["memory_gib"] <= FIT * cap


def test_a_layout_refusal_names_the_micro_batch_the_run_would_train_with(
    tmp_path, text_corpus, cache_dir, capsys, pretend_gpu
):
    """Nothing fits a cap far below the model: the run is refused before anything heavy, for the cut micro-batch
    (4 rows), not the default (8) it never trains with."""
    with pytest.raises(UserError) as e:
        gptoughts.train(
            data_path=str(text_corpus),
            save_dir=str(tmp_path / "run"),
            **{"data.tokenizer": "bytes", "train.block_size": 1024, "perf.gpu_memory_gib": 1e-5},
        )
    assert "llama/debug at micro-batch 4 x 1,024 tokens needs" in str(e.value), e.value


# --------------------------------------------------------------------- 2. whole-model compile: the steps left
def _meta_free_model():
    """The debug Llama with its transforms resolved as on a GPU in one process (compile_mode auto: the whole
    model), built on this CPU with a recording compile backend (nothing is traced here)."""
    args = models.model_args("llama", "debug", {"vocab_size": 256})
    raw = setup.build_raw_model("llama", args, torch.device("cpu"), seed=0)
    perf = load_config("default", {"perf.compile": True}).perf
    hw = dataclasses.replace(hardware.detect("cpu"), compile=True)
    spec = resolve.resolve_transforms(
        raw, perf=perf, hw=hw, device=torch.device("cpu"), dist=DistInfo(), family="llama"
    )
    built = setup.apply_transforms(raw, spec, device=torch.device("cpu"), dist=DistInfo(), family="llama")
    return SimpleNamespace(raw=raw, args=raw.args, built=built, transforms=built.spec)


@pytest.fixture
def whole_model_auto(monkeypatch):
    """compile_mode auto decides as on a GPU (the rule keeps CPUs per-block), and torch.compile traces nothing."""
    rule = resolve.compile_mode_rule
    monkeypatch.setattr(resolve, "compile_mode_rule", lambda *a: rule(*a[:5], torch.device("cuda"), *a[6:]))
    monkeypatch.setattr(torch, "compile", lambda fn, *a, **k: fn)


def test_a_resumed_run_near_its_end_is_timed_by_its_steps_left(whole_model_auto, monkeypatch, tmp_path):
    """The assembly's plan step (build._plan) for a run of 10^10 steps: new, it is long (the whole model's compile
    repays); resumed 10 steps from its end, what is left is a minute at most: per-block graphs, and why."""
    env = SimpleNamespace(
        device=torch.device("cuda"),
        hw=SimpleNamespace(peak_bf16_flops=1e15, name="GPU"),
        dist=DistInfo(),
        resolved={},
    )
    batch = SimpleNamespace(block_size=256, micro_batch=8, total_steps=10**10, tokens_per_step=2048)
    monkeypatch.setattr(
        resolve, "resolve_run", lambda *a, **k: SimpleNamespace(pipeline_micro=None, resolved={})
    )
    monkeypatch.setattr(build, "make_plan", lambda *a, **k: None)
    chosen = {}
    for name, resume_from in (
        ("new", None),
        ("resumed", tmp_path / "checkpoints" / f"step_{10**10 - 10:06d}"),
    ):
        model = _meta_free_model()
        assert model.transforms.whole_model_auto and model.transforms.compile_mode == "model"
        build._plan(None, env, None, model, batch, tmp_path, resume_from, None, None)
        chosen[name] = (
            model.transforms.compile_mode,
            model.built.spec.compile_mode,
            model.built.why["compile"],
        )
    assert chosen["new"][:2] == ("model", "model"), chosen
    assert chosen["resumed"][:2] == ("blocks", "blocks"), chosen
    assert "the 10 steps left after step 9,999,999,990 estimated at ~1 min" in chosen["resumed"][2], chosen


# ----------------------------------------------------------------------- 3. a resume after an early stop
# Every evaluation lowers the val loss, none by the huge min_delta: step 2's evaluation resets the patience (from
# nothing), those at 4 and 6 count, and patience 2 ends the run at step 6 of 20.
EARLY = ["--max_steps", "20", "--eval_interval", "2", "--save_interval", "2", "--early_stopping_patience", "2",
         "--early_stopping_min_delta", "100", "--learning_rate", "3e-3"]  # fmt: skip


def _train(out: Path, corpus: Path, capsys, *flags: str) -> str:
    argv = ["train", "--data", str(corpus), "--out", str(out), "--size", "debug", "--tokenizer", "bytes"]
    return ok([*argv, *flags, *FASTRUN], capsys)


def _resume(out: Path, capsys, *flags: str) -> str:
    return ok(["train", "--resume", "auto", "--out", str(out), *flags], capsys)


def _line(text: str, start: str) -> str | None:
    return next((ln.strip() for ln in text.splitlines() if ln.strip().startswith(start)), None)


def _summary(out: Path) -> tuple[int, str]:
    s = json.loads((out / "summary.json").read_text())
    return s["steps"], s["stop_reason"]


@pytest.mark.slow  # whole runs: seconds on 2 cores
def test_resuming_an_early_stopped_run_says_the_patience_is_used_up_and_does_that(
    tmp_path, text_corpus, cache_dir, capsys
):
    out = tmp_path / "run"
    ended = _train(out, text_corpus, capsys, *EARLY)
    assert _summary(out) == (6, "early stopping")
    # the summary's next step trains on: more steps alone would stop again at the next evaluation
    assert f"--resume auto --out {out} --early_stopping_patience none" in ended, ended[-800:]
    # The plan of the resume as the user types it: 20 steps, and the early stop that ends it at its next evaluation
    text = _resume(out, capsys, "--dry_run")
    assert "steps: 20 " in text, text
    line = _line(text, "early stopping:")
    assert line is not None, text
    assert "patience of 2 was used up at step 6 (early stopping ended the run there)" in line, line
    assert re.search(
        r"2 evaluation\(s\) without improving by more than min_delta 100 on val loss [\d.]+ of step 2", line
    )
    assert "stops at its next evaluation (step 8)" in line, line
    assert "--early_stopping_patience none turns it off" in line and "--early_stopping_patience 4" in line, (
        line
    )
    # ... and the run does exactly that
    _resume(out, capsys)
    assert _summary(out) == (8, "early stopping")
    # A larger patience: the count (3 by step 8) carries over; 2 more evaluations without improvement end the run
    text = _resume(out, capsys, "--early_stopping_patience", "5", "--dry_run")
    line = _line(text, "early stopping:")
    assert line is not None and line.startswith("early stopping: 3 of its patience of 5 used by step 8"), text
    assert (
        "2 more evaluation(s) in a row without val loss below" in line and "(the next at step 10)" in line
    ), line
    _resume(out, capsys, "--early_stopping_patience", "5")
    assert _summary(out) == (12, "early stopping")
    # Off: nothing to say, and the run trains to its end
    text = _resume(out, capsys, "--early_stopping_patience", "none", "--dry_run")
    assert _line(text, "early stopping:") is None, text
    _resume(out, capsys, "--early_stopping_patience", "none")
    assert _summary(out)[0] == 20


def test_a_new_run_with_patience_has_no_carried_over_line(tmp_path, text_corpus, cache_dir, capsys):
    text = _train(tmp_path / "run", text_corpus, capsys, *EARLY, "--dry_run")
    assert _line(text, "early stopping:") is None, text
