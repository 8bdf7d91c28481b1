"""What the loss plots mark (plots.py): non-finite losses, in a run's own plot and in a comparison of runs (a line
only has a gap there, which reads like a run that stopped), and where a rollback went back to."""

from __future__ import annotations

import json
import math

import numpy as np
from matplotlib.figure import Figure

from gptoughts.training.plots import _compare_panels, _panel_loss, read_series


def _series(tmp_path, name, losses):
    path = tmp_path / f"{name}.jsonl"
    rows = [{"step": s, "loss": v if math.isfinite(v) else "nan"} for s, v in losses]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return read_series(path)


def _crosses(ax):
    return [ln for ln in ax.get_lines() if ln.get_marker() == "x"]


def test_a_compared_run_with_nan_losses_marks_them_in_its_colour(tmp_path):
    good = _series(tmp_path, "good", [(s, 5.0 - s / 10) for s in range(1, 9)])
    bad = _series(tmp_path, "bad", [(s, 5.0 - s / 10 if s < 6 else math.nan) for s in range(1, 9)])
    fig = Figure()
    axes = np.array([[fig.add_subplot(2, 3, 1 + 3 * r + c) for c in range(3)] for r in range(2)])
    _compare_panels(axes, [good, bad], ["good", "bad"])

    marks = _crosses(axes[0, 0])
    assert len(marks) == 1, "one mark, for the run that went non-finite"
    assert list(marks[0].get_xdata()) == [6, 7, 8]
    line_of_bad = next(ln for ln in axes[0, 0].get_lines() if ln.get_label() == "bad")
    assert marks[0].get_color() == line_of_bad.get_color()


def test_the_loss_panel_of_one_run_still_marks_them(tmp_path):
    bad = _series(tmp_path, "bad", [(s, 5.0 if s < 3 else math.nan) for s in range(1, 5)])
    ax = Figure().add_subplot()
    _panel_loss(ax, bad)
    assert [list(m.get_xdata()) for m in _crosses(ax)] == [[3, 4]]


def test_the_loss_panel_marks_where_a_rollback_went_back_to(tmp_path):
    """The re-run replaces the rolled-back steps' values (NaN ones included); a dashed line says it happened."""
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "loss": 5.0 - s / 10} for s in range(1, 9)]
    rows.append({"step": 4, "event": "rollback", "from_step": 8, "to_step": 4, "skipped_steps": 4})
    rows += [{"step": s, "loss": 4.0 - s / 10} for s in range(5, 11)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ax = Figure().add_subplot()
    _panel_loss(ax, read_series(path))
    marks = [ln for ln in ax.get_lines() if ln.get_linestyle() == "--"]
    assert [list(m.get_xdata()) for m in marks] == [[4, 4]]
    assert "rollback (1)" in [t.get_text() for t in ax.get_legend().get_texts()]
