"""The step axis of a run's plots is ticked at whole steps, however few the run logged."""

from __future__ import annotations

import importlib
import json

import pytest

pytestmark = pytest.mark.plots  # these tests draw the plots


@pytest.mark.parametrize("steps", [1, 3])
def test_a_short_run_is_plotted_at_whole_steps(tmp_path, monkeypatch, steps):
    # one logged step was ticked 0.96, 0.98, 1.00, 1.02, 1.04 "optimizer step"
    plots = importlib.import_module("gptoughts.training.plots")
    styled = []
    real = plots._style

    def spy(ax, title, ylabel):
        real(ax, title, ylabel)
        styled.append(ax)

    monkeypatch.setattr(plots, "_style", spy)
    run = tmp_path / "run"
    run.mkdir()
    rows = [
        {"step": s, "loss": 3.0 - s / 10, "lr": 1e-3, "tokens_per_s": 100.0, "grad_norm": 1.0}
        for s in range(1, steps + 1)
    ]
    rows.append({"step": steps, "val_loss": 3.0})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert plots.write_run_plots(run)
    ticks = [[t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]] for ax in styled]
    assert ticks and all(shown and all(float(t).is_integer() for t in shown) for shown in ticks), ticks
