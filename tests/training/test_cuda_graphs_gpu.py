"""CUDA graphs (``perf.cuda_graphs``) in a training run with gradient accumulation: it finishes, and its losses
follow the same run without graphs. Session 5 saw the first step fail ("accessing tensor output of CUDAGraphs that
has been overwritten by a subsequent run"); gradients are now kept allocated under graphs (setup.Built.keep_grads).
Skipped without CUDA."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cli_helpers import FAST

from gptoughts import api
from gptoughts.config import load_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _losses(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def _six_steps(corpus: Path, out: Path, *, graphs: bool, accum: int, mode: str = "auto", **extra: object):
    """Six compiled steps on CUDA, evaluated at 3 and 6, no checkpoints."""
    return load_config(
        "default",
        {
            **FAST,
            "data.sources": [str(corpus)],
            "run.out": str(out),
            "perf.device": "cuda",
            "perf.compile": True,
            "perf.compile_mode": mode,
            "perf.cuda_graphs": graphs,
            "train.grad_accum": accum,
            "train.max_steps": 6,
            "train.log_interval": 1,
            "train.eval_interval": 3,
            "train.sample_interval": 0,
            "checkpoint.checkpoints": False,
            **extra,
        },
    )


@pytest.mark.parametrize("mode", ["blocks", "model"])
def test_cuda_graphs_with_accumulation(mode, tmp_path, text_corpus, cache_dir):
    runs = {}
    for graphs in (False, True):
        out = tmp_path / f"graphs-{graphs}"
        cfg = _six_steps(text_corpus, out, mode=mode, graphs=graphs, accum=3)
        api.run_training(cfg)
        runs[graphs] = _losses(out)
    plain, graphed = runs[False], runs[True]
    assert len(plain) == len(graphed) == 6
    # The same kernels replayed: the same losses up to fp32 reduction order.
    assert graphed == pytest.approx(plain, rel=1e-3), (plain, graphed)


def test_whole_model_and_graphs_with_auto_batch(tmp_path, text_corpus, cache_dir):
    """Whole-model compile with CUDA graphs on a small llama, the auto batch probed on the per-block graphs; a run
    with evaluations, a checkpoint and a resume, its losses as per-block compile's."""
    runs = {}
    for name, extra in (
        ("blocks", {"perf.compile_mode": "blocks", "perf.cuda_graphs": False}),
        ("auto", {"perf.cuda_graphs": True}),
    ):
        out = tmp_path / name
        base = {
            **FAST,
            "data.sources": [str(text_corpus)],
            "run.out": str(out),
            "perf.device": "cuda",
            "perf.precision": "fp32",
            "perf.compile": True,
            "train.batch_size": "auto",
            "train.grad_accum": 2,
            "train.log_interval": 1,
            "train.eval_interval": 2,
            "train.sample_interval": 0,
            **extra,
        }
        api.run_training(load_config("default", {**base, "train.max_steps": 4}))
        api.run_training(load_config("default", {**base, "train.max_steps": 6, "run.resume": "auto"}))
        runs[name] = _losses(out)
        resolved = json.loads((out / "run.json").read_text())["resolved"]
        if name == "auto":
            assert resolved["compile"].startswith("model (") and resolved["cuda_graphs"] == "True"
    assert len(runs["auto"]) == len(runs["blocks"]) == 6
    assert runs["auto"] == pytest.approx(runs["blocks"], rel=1e-3), runs


def test_muon_step_as_a_graph_in_a_training_run(tmp_path, text_corpus, cache_dir):
    """Muon under the model's CUDA graphs: its step replayed as one graph (perf.muon_graph auto) gives the losses
    of the step launched kernel by kernel, and the plan says so."""
    runs, lines = {}, {}
    for graph in ("auto", False):
        out = tmp_path / f"muon-graph-{graph}"
        cfg = _six_steps(
            text_corpus, out, graphs=True, accum=2, **{"perf.muon_graph": graph, "train.optimizer": "muon"}
        )
        api.run_training(cfg)
        runs[graph] = _losses(out)
        lines[graph] = json.loads((out / "run.json").read_text())["resolved"]["optimizer"]
    assert len(runs["auto"]) == 6 and runs["auto"] == pytest.approx(runs[False], rel=1e-5), runs
    assert "one CUDA graph" in lines["auto"] and "CUDA graph" not in lines[False]
