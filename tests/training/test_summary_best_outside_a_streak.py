"""The run summary's best evaluation is the one best.json names: an evaluation inside a streak of bad steps (whose
weights are never saved) is never the best, whatever its loss."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import torch

from gptoughts import api
from gptoughts.config import EvalConfig
from gptoughts.parallel.dist import DistInfo
from gptoughts.training.evaluation import Evaluator
from gptoughts.training.state import TrainState


def test_best_evaluation_passes_over_streak_and_non_finite_evaluations():
    from gptoughts.training.evaluation import best_evaluation

    history = [
        {"step": 2, "val_loss": 3.0, "val_ppl": 20.0},
        {"step": 4, "val_loss": 1.0, "val_ppl": 2.7, "in_streak": True},
        {"step": 6, "val_loss": math.nan, "val_ppl": math.nan},
        {"step": 8, "val_loss": 2.5, "val_ppl": 12.0},
        {"step": 10, "val_loss": 2.5, "val_ppl": 12.0},  # a tie: the first to reach it
    ]
    assert best_evaluation(history) == (2.5, 8)
    assert best_evaluation(history[1:3]) is None
    assert best_evaluation([]) is None


def _track(monkeypatch, state: TrainState, tmp_path, scripted: list[tuple[int, int, float]]) -> None:
    """The evaluator's evaluate_and_track at each (step, bad steps in a row, val loss) of ``scripted``."""
    ev = Evaluator(
        state,
        EvalConfig(),
        model=torch.nn.Linear(1, 1),
        objective=lambda m, b: (torch.zeros(()), torch.ones(())),
        batches=None,
        metrics=SimpleNamespace(log=lambda *a, **k: None),
        run_dir=tmp_path,
        dist=DistInfo(rank=1, world_size=2),  # (not the main rank: no log lines)
        device=torch.device("cpu"),
        precision="fp32",
    )
    for step, bad, loss in scripted:
        state.step, state.bad_steps = step, bad
        monkeypatch.setattr(ev, "evaluate", lambda loss=loss: (loss, math.exp(loss)))
        ev.evaluate_and_track()


def test_the_summary_names_the_best_that_best_json_names(monkeypatch, tmp_path):
    """Evaluated at steps 2, 4 (inside a streak of skipped steps: not best, so no checkpoint), 6: the summary said
    "best val loss 1.0 at step 4", a step with no checkpoint, where best.json named step 6."""
    state = TrainState()
    _track(monkeypatch, state, tmp_path, [(2, 0, 3.0), (4, 2, 1.0), (6, 0, 2.0)])
    assert state.best_val_loss == 2.0  # what best.json was written with
    trainer = SimpleNamespace(
        state=state,
        stop_reason="max steps",
        stop_signal=None,
        startup=SimpleNamespace(first_step_s=None),
        evaluator=SimpleNamespace(task_scores={}, last_pair_metrics={}),
    )
    asm = SimpleNamespace(
        trainer=trainer,
        cfg=SimpleNamespace(train=SimpleNamespace(max_steps=6), checkpoint=SimpleNamespace(checkpoints=True)),
        batch=SimpleNamespace(block_size=8, stop_rule="--max_steps 6"),
        env=SimpleNamespace(
            hw=SimpleNamespace(peak_bf16_flops=None), device=torch.device("cpu"), dist=DistInfo()
        ),
        model=SimpleNamespace(raw=SimpleNamespace(flops_per_token=lambda block: 1.0)),
        plots=None,
        run_dir=tmp_path,
    )
    history = api._history(asm, SimpleNamespace(step=6, tokens_seen=48, history=state.history), api.History())
    summary = api._summary(asm, history, 1.0, (0, 0))
    assert (summary["best_val_loss"], summary["best_step"]) == (2.0, 6)
    assert json.loads((tmp_path / "summary.json").read_text())["best_step"] == 6
    assert history.eval_steps == [2, 4, 6]  # the streak's evaluation is still in the history: it was made
