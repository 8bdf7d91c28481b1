"""Run plots from metrics.jsonl: robust reading (NaN strings, truncated lines, rollbacks) and valid PNG output."""

from __future__ import annotations

import importlib
import json
import logging
import math
import sys
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest

from gptoughts.errors import UserError
from gptoughts.training.plots import compare_runs, read_series, write_run_plots

pytestmark = pytest.mark.plots  # these tests read the plots the runs draw

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SINGLE_PNGS = {"loss.png", "lr.png", "throughput.png", "grad_norm.png"}


def _train_row(step: int, *, memory: bool = True, loss: float | str | None = None) -> dict:
    row = {
        "step": step,
        "time": 1732280000.0 + step,
        "loss": 8.0 * math.exp(-step / 40) + 2.0 if loss is None else loss,
        "lr": 3e-4 * min(1.0, step / 10),
        "tokens_per_s": 12000.0 + 10 * (step % 7),
        "grad_norm": 0.8 + 0.01 * (step % 5),
        "tokens": 4096 * step,
        "epoch": step / 1000,
        "skipped_steps": 0,
    }
    if memory:
        row |= {
            "mfu": 0.41,
            "time/step_ms": 120.0,
            "time/data_pct": 0.5,
            "gpu/util_pct": 97.0,
            "gpu/mem_used_gib": 30.2,
            "memory/peak_gib": 28.1,
        }
    return row


def _write_run(run: Path, *, memory: bool = True, steps: int = 120) -> Path:
    """A run with NaN/inf strings, a missing key, a rollback that re-runs steps 61-80, and a truncated last line."""
    run.mkdir(parents=True, exist_ok=True)
    lines = []
    for step in range(1, steps + 1):
        row = _train_row(step, memory=memory)
        if step == 30:
            row["loss"] = "nan"
            row["grad_norm"] = "inf"
        if step == 31:
            del row["lr"]  # a missing key
        lines.append(json.dumps(row))
        if step % 20 == 0:
            lines.append(
                json.dumps(
                    {
                        "step": step,
                        "time": 1732280000.0 + step,
                        "val_loss": 3.1 - step / 1000,
                        "val_ppl": 22.2,
                    }
                )
            )
        if step == 90:  # rollback: steps 61..80 are run again with a different loss
            for again in range(61, 81):
                lines.append(json.dumps(_train_row(again, memory=memory, loss=1.5)))
    text = "\n".join(lines) + "\n" + json.dumps(_train_row(steps + 1, memory=memory))[:37]  # crash mid-write
    (run / "metrics.jsonl").write_text(text)
    return run


def _assert_png(path: Path, min_w: int = 200, min_h: int = 150) -> None:
    assert path.is_file(), path
    assert path.read_bytes()[:8] == PNG_SIGNATURE, path
    img = matplotlib.image.imread(path)
    assert img.ndim == 3 and img.shape[2] in (3, 4), img.shape
    assert img.shape[0] >= min_h and img.shape[1] >= min_w, img.shape
    assert img.std() > 0.01  # not a blank canvas


def test_read_series_skips_bad_lines_and_keeps_the_last_value_per_step(tmp_path):
    run = _write_run(tmp_path / "run")
    s = read_series(run / "metrics.jsonl")
    steps, loss = s.points("loss")
    assert steps == list(range(1, 121))  # sorted by step, no duplicates, truncated step 121 skipped
    assert math.isnan(loss[steps.index(30)])  # "nan" string -> NaN (a gap)
    assert s["grad_norm"][30] == math.inf and s.non_finite_steps("grad_norm") == [30]
    assert s["loss"][70] == 1.5  # the rolled-back step: the value written last wins
    assert s["loss"][90] == pytest.approx(8.0 * math.exp(-90 / 40) + 2.0)  # untouched after the rollback
    assert 31 not in s["lr"] and 32 in s["lr"]
    assert sorted(s["val_loss"]) == [20, 40, 60, 80, 100, 120]
    assert "time" not in s  # wall clock is not a metric
    assert s.last("tokens") == 4096 * 120


def test_write_run_plots_writes_valid_pngs(tmp_path):
    run = _write_run(tmp_path / "run")
    paths = write_run_plots(run)
    names = {p.name for p in paths}
    assert names == SINGLE_PNGS | {"memory.png", "overview.png"}
    for p in paths:
        assert p.parent == run / "plots"
        _assert_png(p)
    overview = matplotlib.image.imread(run / "plots" / "overview.png")
    single = matplotlib.image.imread(run / "plots" / "loss.png")
    assert overview.shape[1] > 1.5 * single.shape[1]  # the 2x3 grid is wider than one panel
    assert not [p for p in (run / "plots").iterdir() if p.suffix != ".png"]  # no temp files left behind


def test_no_memory_data_means_no_memory_png(tmp_path):
    run = _write_run(tmp_path / "cpu_run", memory=False)
    names = {p.name for p in write_run_plots(run)}
    assert names == SINGLE_PNGS | {"overview.png"}
    assert not (run / "plots" / "memory.png").exists()
    _assert_png(run / "plots" / "overview.png")


@pytest.mark.slow
def test_rewriting_replaces_files(tmp_path):
    run = _write_run(tmp_path / "run", steps=60)
    loss_png = run / "plots" / "loss.png"
    assert loss_png in write_run_plots(run)
    before = loss_png.read_bytes()
    _write_run(run, steps=120)
    assert loss_png in write_run_plots(run)
    assert loss_png.read_bytes() != before
    _assert_png(loss_png)


def test_missing_or_empty_metrics_give_nothing(tmp_path):
    assert write_run_plots(tmp_path / "does_not_exist") == []
    run = tmp_path / "empty"
    run.mkdir()
    assert write_run_plots(run) == []  # no metrics.jsonl
    (run / "metrics.jsonl").write_text("")
    assert write_run_plots(run) == []
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.5, "lr"')  # only a truncated line
    assert write_run_plots(run) == []
    assert not (run / "plots").exists()


def test_only_eval_rows(tmp_path):
    run = tmp_path / "eval_only"
    run.mkdir()
    rows = [{"step": s, "time": 0.0, "val_loss": 3.0 - s / 100, "val_ppl": 20.0} for s in (50, 100)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    names = {p.name for p in write_run_plots(run)}
    assert names == {"loss.png", "overview.png"}
    _assert_png(run / "plots" / "loss.png")


def test_loss_spanning_more_than_10x_uses_log_scale(tmp_path, monkeypatch):
    plots = importlib.import_module("gptoughts.training.plots")
    scales = {}
    real = plots._panel_loss

    def spy(ax, s):
        real(ax, s)
        scales[len(scales)] = ax.get_yscale()

    monkeypatch.setattr(plots, "_panel_loss", spy)
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": s, "loss": 100.0 / s} for s in range(1, 101)]  # 100 -> 1
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    plots.write_run_plots(run)
    assert set(scales.values()) == {"log"}
    scales.clear()
    rows = [{"step": s, "loss": 3.0 - s / 100} for s in range(1, 101)]  # 2.99 -> 2.0
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    plots.write_run_plots(run)
    assert set(scales.values()) == {"linear"}


def test_without_matplotlib_plots_are_skipped_with_one_warning(tmp_path, monkeypatch, caplog):
    run = _write_run(tmp_path / "run", steps=30)
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)  # import of a None entry raises ImportError
    log = logging.getLogger(
        "gptoughts.training"
    )  # (the CLI stops "gptoughts" propagating to the root logger)
    log.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="gptoughts.training"):
            assert write_run_plots(run) == []
    finally:
        log.removeHandler(caplog.handler)
    # (one record, maybe seen twice: by our handler and, where "gptoughts" propagates, by caplog's at the root)
    warnings = list({id(r): r for r in caplog.records if r.name == "gptoughts.training"}.values())
    assert len(warnings) == 1 and "pip install matplotlib" in warnings[0].getMessage()
    with pytest.raises(UserError, match="pip install matplotlib"):
        compare_runs([run], tmp_path / "cmp.png")


def test_compare_runs_overlays_two_runs(tmp_path):
    a = _write_run(tmp_path / "a" / "run")
    b = _write_run(tmp_path / "b" / "run", memory=False, steps=80)  # same folder name as a
    out = compare_runs([a, b], tmp_path / "out" / "compare.png")
    assert out == tmp_path / "out" / "compare.png"
    _assert_png(out, min_w=800, min_h=400)
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["compare.png"]
    # An existing directory as `out`: compare.png inside it (replacing the one drawn above: overwrite=True).
    assert compare_runs([a, str(b)], tmp_path / "out", overwrite=True) == tmp_path / "out" / "compare.png"


def test_compare_runs_keeps_an_existing_file(tmp_path):
    a = _write_run(tmp_path / "a")
    b = _write_run(tmp_path / "b")
    mine = tmp_path / "compare.png"
    mine.write_bytes(b"my own figure")
    for out in (mine, tmp_path):  # named, and as compare.png in a named folder
        with pytest.raises(
            UserError, match=r"compare.png already exists; .*--out .*--overwrite .*overwrite=True"
        ) as e:
            compare_runs([a, b], out)
        assert "\n" not in str(e.value)
    assert mine.read_bytes() == b"my own figure"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "compare.png"]  # no temporary file left
    _assert_png(compare_runs([a, b], mine, overwrite=True), min_w=800, min_h=400)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "compare.png"]
    # a folder named with a trailing separator that does not exist yet: compare.png inside it
    new = compare_runs([a, b], f"{tmp_path}/figs/")
    assert new == tmp_path / "figs" / "compare.png" and new.is_file()


def test_compare_labels_are_disambiguated(tmp_path):
    plots = importlib.import_module("gptoughts.training.plots")
    paths = [tmp_path / "x" / "run", tmp_path / "y" / "run", tmp_path / "solo"]
    assert plots._labels(paths) == ["x/run", "y/run", "solo"]
    assert plots._labels([tmp_path / "x" / "run", tmp_path / "x" / "run"]) == ["x/run", "x/run #2"]


def test_compare_runs_rejects_a_folder_without_metrics(tmp_path):
    a = _write_run(tmp_path / "a")
    empty = tmp_path / "not_a_run"
    empty.mkdir()
    with pytest.raises(UserError, match=r"not_a_run has no metrics.jsonl; pass a run directory") as e:
        compare_runs([a, empty], tmp_path / "cmp.png")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "cmp.png").exists()
    with pytest.raises(UserError):
        compare_runs([], tmp_path / "cmp.png")


def test_thin_keeps_spikes_and_gaps():
    plots = importlib.import_module("gptoughts.training.plots")
    n = 10_007  # not a multiple of the bucket size
    steps = np.arange(n)
    values = np.sin(steps / 300.0)
    values[5_000] = 50.0  # a loss spike
    values[100] = -20.0
    values[7_000] = np.nan  # a non-finite step
    values[9_000:9_040] = np.nan  # a whole bucket of them
    x, y = plots._thin(steps, values, 2000)
    assert len(x) <= 3000 and np.all(np.diff(x) >= 0)
    assert np.nanmax(y) == 50.0 and np.nanmin(y) == -20.0
    assert x[np.nanargmax(y)] == 5_000
    gaps = x[np.isnan(y)]
    assert any(6_990 <= g <= 7_010 for g in gaps) and any(9_000 <= g < 9_040 for g in gaps)
    assert x[-1] >= n - 11  # the last bucket (11 points here) is kept
    short_x, short_y = plots._thin(steps[:100], values[:100], 2000)  # short series: unchanged
    assert np.array_equal(short_x, steps[:100]) and np.array_equal(short_y, values[:100], equal_nan=True)


def test_smooth_is_a_trailing_mean_ignoring_nans():
    plots = importlib.import_module("gptoughts.training.plots")
    y = np.array([1.0, 3.0, np.nan, 5.0, np.nan, np.nan, np.nan])
    out = plots._smooth(y, 2)
    np.testing.assert_allclose(out[:5], [1.0, 2.0, 3.0, 5.0, 5.0])
    assert np.isnan(out[5]) and np.isnan(out[6])


def test_plot_writer_draws_at_most_once_per_interval_and_at_close(tmp_path, monkeypatch):
    """Requests after each evaluation merge into at most one drawing per min_interval_s, the first one interval
    after the writer was made (drawing holds the GIL the training loop needs); close() ends the pause at once and
    draws the final plots."""
    import threading
    import time

    from gptoughts.training import plots

    calls: list[tuple[str, float]] = []

    def fake_write(run_dir):
        calls.append((threading.current_thread().name, time.monotonic()))
        return []

    monkeypatch.setattr(plots, "write_run_plots", fake_write)
    made = time.monotonic()
    writer = plots.PlotWriter(tmp_path, min_interval_s=0.3)
    while time.monotonic() - made < 1.2:  # an evaluation every few milliseconds
        writer.request()
        time.sleep(0.002)
    drawn = [t for name, t in calls if name == "gptoughts-plots"]
    assert 1 <= len(drawn) <= 4, drawn
    assert drawn[0] - made >= 0.3  # none before the first interval is over
    assert all(b - a >= 0.3 for a, b in zip(drawn, drawn[1:]))
    writer.close()

    calls.clear()
    writer = plots.PlotWriter(tmp_path, min_interval_s=60.0)
    for _ in range(20):
        writer.request()
        time.sleep(0.002)
    time.sleep(0.2)
    assert writer.drawings == 0 and calls == []  # a run shorter than the interval: no drawing while it runs
    t0 = time.monotonic()
    writer.close()
    assert time.monotonic() - t0 < 5  # not the 60 s pause
    assert [name for name, _ in calls] == [threading.current_thread().name]  # the final plots, at close
