"""PNG plots of a run's ``metrics.jsonl`` (one run) and side-by-side comparisons of several runs.

``write_run_plots(run_dir)`` writes ``run_dir/plots/{loss,lr,throughput,grad_norm,memory,overview}.png``;
``compare_runs([a, b], out)`` overlays runs in one PNG. Both read the file the trainer appends to, so they may be
called while the run is going (at every evaluation): unparsable lines (a crash mid-write) are skipped, and each
PNG is written to a temporary name in the same folder and moved into place with ``os.replace``, so a reader never
sees half a file.

Reading a series: rows come in file order; a row whose step is not greater than an earlier one's (a resume or a
NaN rollback that re-runs steps) simply rewrites that step, so each metric keeps the *last* value written for
each step, and is drawn sorted by step. Non-finite values (written as ``"nan"``/``"inf"`` strings) are gaps in
the lines; on the loss panel they are marked with crosses along the bottom (red, or the run's colour in a
comparison), and a rollback with a dashed line at the step it went back to.

Matplotlib is used through its object API on the Agg canvas (``Figure`` + ``FigureCanvasAgg``), never
``pyplot``: no global figure registry, nothing needs a display, and plots can be drawn from a background thread
while training. It is imported lazily: without it ``write_run_plots`` logs one line and returns ``[]``.
"""

from __future__ import annotations

import json
import logging
import math
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gptoughts.errors import UserError
from gptoughts.training.rundir import output_file, place_file

log = logging.getLogger("gptoughts.training")

METRICS_FILE = "metrics.jsonl"
_MEMORY_PREFIXES = ("gpu/mem", "memory/")
_TASK_PREFIX = "tasks/"
_NON_FINITE = {
    "nan": math.nan,
    "inf": math.inf,
    "-inf": -math.inf,
    "infinity": math.inf,
    "-infinity": -math.inf,
}
_DPI = 100
# zlib level 1 instead of PIL's default 6: write_run_plots at 10,000 rows used 0.76 s of CPU instead of 0.83 s
# (best of 7), for files ~12% larger.
_PNG_COMPRESSION = 1
_MAX_POINTS = 1200  # ~2 per pixel column of a panel: enough for the min/max envelope
# Fixed margins rather than a layout engine: constrained layout makes savefig draw every figure twice (a layout
# pass, then the render); write_run_plots at 10,000 rows took 1.20-1.33 s with it, 0.98 s without (best of 7,
# shared 2-core CPU). The margins leave room for a second y axis on the right.
_SINGLE_MARGINS = dict(left=0.11, right=0.89, top=0.88, bottom=0.13)
_GRID_MARGINS = dict(left=0.05, right=0.95, top=0.91, bottom=0.07, wspace=0.32, hspace=0.3)


# ------------------------------------------------------------------------------------------ reading


class Series(dict):
    """``{metric: {step: value}}`` built in file order (a later row for a step replaces the earlier value)."""

    def points(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of ``key`` sorted by step; non-finite values are NaN (a gap when drawn)."""
        by_step = self.get(key) or {}
        steps = sorted(by_step)
        values = np.array([by_step[s] for s in steps], dtype=np.float64)
        values[~np.isfinite(values)] = np.nan
        return steps, values.tolist()

    def prepared(
        self, key: str, smooth: bool
    ) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray] | None, list[float]]:
        """What ``_line`` draws for ``key``: the thinned (steps, values), the thinned trailing mean when ``smooth``
        and the series is long (else None), and the finite values (for the y scale). Cached: the overview and the
        single-panel PNGs draw the same series."""
        cache = self.__dict__.setdefault("_prepared", {})
        if (key, smooth) not in cache:
            steps, values = self.points(key)
            x, y = np.asarray(steps, dtype=np.int64), np.asarray(values, dtype=np.float64)
            smoothed = None
            if smooth and len(x) > 200:
                smoothed = _thin(x, _smooth(y, max(2, len(x) // 50)), _MAX_POINTS)
            cache[(key, smooth)] = (_thin(x, y, _MAX_POINTS), smoothed, y[np.isfinite(y)].tolist())
        return cache[(key, smooth)]

    def non_finite_steps(self, key: str) -> list[int]:
        by_step = self.get(key) or {}
        return sorted(s for s, v in by_step.items() if not math.isfinite(v))

    def has(self, key: str) -> bool:
        return bool(self.get(key))

    def last(self, key: str) -> float | None:
        """The finite value of ``key`` at its highest step, or None."""
        by_step = self.get(key) or {}
        for s in sorted(by_step, reverse=True):
            if math.isfinite(by_step[s]):
                return by_step[s]
        return None


def _thin(x: np.ndarray, y: np.ndarray, max_points: int) -> tuple[np.ndarray, np.ndarray]:
    """About ``max_points`` points that draw like the whole series: per bucket of consecutive points, its lowest
    and highest values (in step order), so spikes survive; a bucket holding a NaN ends with one, so gaps survive.

    A PNG 700-1,600 px wide shows no more than ~2,000 points. At 100,000 rows thinning took ``write_run_plots``
    from 3.1 s to 2.3 s (best of 2, shared 2-core CPU); at 10,000 rows the gain is within that machine's noise.
    """
    n = len(x)
    if n <= max_points:
        return x, y
    size = -(-n // (max_points // 2))
    rows = -(-n // size)
    pad = rows * size - n
    yp = np.concatenate([y, np.full(pad, np.nan)]).reshape(rows, size)
    xp = np.concatenate([x, np.full(pad, x[-1])]).reshape(rows, size)
    real = (np.arange(rows * size) < n).reshape(rows, size)
    nan = np.isnan(yp)
    lo = np.where(nan, np.inf, yp).argmin(axis=1)
    hi = np.where(nan, -np.inf, yp).argmax(axis=1)
    first, second = np.minimum(lo, hi), np.maximum(lo, hi)
    r = np.arange(rows)
    all_nan = (nan | ~real).all(axis=1)
    has_nan = (nan & real).any(axis=1)
    last = np.where(real, np.arange(size), 0).max(axis=1)
    xs = np.stack([xp[r, first], xp[r, second], xp[r, last]], axis=1)
    ys = np.stack([yp[r, first], yp[r, second], np.full(rows, np.nan)], axis=1)
    keep = np.stack([np.ones(rows, bool), (second != first) & ~all_nan, has_nan & ~all_nan], axis=1)
    return xs[keep], ys[keep]


def _smooth(y: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over the last ``window`` points, NaNs left out (NaN where the window holds no number)."""
    finite = ~np.isnan(y)
    sums = np.concatenate([[0.0], np.cumsum(np.where(finite, y, 0.0))])
    counts = np.concatenate([[0], np.cumsum(finite)])
    i = np.arange(1, len(y) + 1)
    j = np.maximum(i - window, 0)
    n = counts[i] - counts[j]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 0, (sums[i] - sums[j]) / n, np.nan)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        return _NON_FINITE.get(value.strip().lower())
    return None


def read_series(path: Path | str) -> Series:
    """Every numeric metric of ``path`` (a ``metrics.jsonl``) as ``{metric: {step: value}}``; {} if none.

    Lines that are not a JSON object with an integer ``step`` are skipped (a truncated last line after a crash).
    """
    series = Series()
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return series
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if not isinstance(row, dict):
            continue
        step = row.get("step")
        if isinstance(step, float) and step.is_integer():
            step = int(step)
        if not isinstance(step, int) or isinstance(step, bool):
            continue
        for key, value in row.items():
            if key == "step" or key == "time":
                continue
            kind = type(value)
            # Numbers first: this runs once per value in the file (150,000 times for 10,000 rows).
            if kind is float or kind is int:
                series.setdefault(key, {})[step] = float(value)
            elif kind is str and (x := _number(value)) is not None:
                series.setdefault(key, {})[step] = x
    return series


# ------------------------------------------------------------------------------------------ drawing


def _matplotlib() -> tuple[Any, Any] | None:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    return Figure, FigureCanvasAgg


def _human(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def _finite(values: Sequence[float]) -> list[float]:
    return [v for v in values if math.isfinite(v)]


def _maybe_log_y(ax: Any, values: Sequence[float]) -> None:
    """Log scale when the positive values span more than 10x (a loss curve from ~10 down to ~2 does not)."""
    pos = [v for v in _finite(values) if v > 0]
    if pos and min(pos) * 10 < max(pos):
        ax.set_yscale("log")


def _style(ax: Any, title: str, ylabel: str) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_title(title, fontsize=10)
    ax.set_xlabel("optimizer step")
    # whole steps only (matplotlib ticks a single step at fractions of it)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)


def _no_data(ax: Any, title: str) -> None:
    ax.set_title(title, fontsize=10)
    ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="0.5")
    ax.set_xticks([])
    ax.set_yticks([])


def _line(
    ax: Any,
    s: Series,
    key: str,
    *,
    label: str | None = None,
    color: str | None = None,
    smooth: bool = False,
    scale: float = 1.0,
) -> list[float]:
    """Draw ``key`` of ``s`` (thinned); return its finite values. Sparse series (evaluations) get markers; with
    ``smooth``, a long series is drawn faint with its trailing mean (1/50 of the run) on top, which is what a
    reader of noisy per-step losses, throughputs and gradient norms wants to see."""
    raw, smoothed, finite = s.prepared(key, smooth)
    (x, y), k = raw, scale
    if smoothed is not None:
        (line,) = ax.plot(x, y * k, lw=0.8, alpha=0.3, color=color)
        ax.plot(smoothed[0], smoothed[1] * k, lw=1.4, color=line.get_color(), label=label)
    else:
        ax.plot(x, y * k, "o-" if len(x) <= 50 else "-", ms=3, lw=1.2, color=color, label=label)
    return [v * k for v in finite]


def _legend(ax: Any, *others: Any, **kw: Any) -> None:
    """One legend on ``ax`` for the labelled lines of ``ax`` and its twin axes (faint raw lines have none)."""
    lines = [
        ln
        for a in (ax, *others)
        if a is not None
        for ln in a.get_lines()
        if not ln.get_label().startswith("_")
    ]
    ax.legend(handles=lines, fontsize=8, **kw)


def _panel_loss(ax: Any, s: Series) -> None:
    if not (s.has("loss") or s.has("val_loss")):
        return _no_data(ax, "loss")
    values: list[float] = []
    if s.has("loss"):
        values += _line(ax, s, "loss", label="train loss", color="C0", smooth=True)
    if s.has("val_loss"):
        values += _line(ax, s, "val_loss", label="val loss", color="C1")
    _mark_non_finite(ax, s, ("loss", "val_loss"), color="red", label="non-finite")
    # A rollback's row names the step it went back to: the steps after it were run again and their new values
    # replaced the old (the non-finite ones included), so only this line says it happened.
    back_to = sorted(s.get("to_step") or {})
    for i, step in enumerate(back_to):
        ax.axvline(step, color="0.4", ls="--", lw=1, label=f"rollback ({len(back_to)})" if i == 0 else None)
    _maybe_log_y(ax, values)
    _style(ax, "loss", "loss (nats/token)")
    ax.legend(fontsize=8)


def _mark_non_finite(ax: Any, s: Series, keys: Sequence[str], *, color: str, label: str) -> None:
    """Crosses along the bottom edge at the steps where any of ``keys`` is non-finite (a line only has a gap
    there, which reads like a run that stopped), whatever the y scale: x in data units, y in axes units."""
    bad = sorted({step for key in keys for step in s.non_finite_steps(key)})
    if bad:
        ax.plot(
            bad,
            [0.0] * len(bad),
            "x",
            color=color,
            ms=5,
            clip_on=False,
            transform=ax.get_xaxis_transform(),
            label=f"{label} ({len(bad)})",
        )


def _panel_single(
    ax: Any, s: Series, key: str, title: str, ylabel: str, log_y: bool = False, smooth: bool = False
) -> None:
    if not s.has(key):
        return _no_data(ax, title)
    values = _line(ax, s, key, smooth=smooth)
    if log_y:
        _maybe_log_y(ax, values)
    _style(ax, title, ylabel)


def _panel_throughput(ax: Any, s: Series) -> None:
    if not s.has("tokens_per_s"):
        return _no_data(ax, "throughput")
    _line(ax, s, "tokens_per_s", label="tokens/s", color="C0", smooth=True)
    _style(ax, "throughput", "tokens / s")
    if s.has("mfu"):
        twin = ax.twinx()
        _line(twin, s, "mfu", label="MFU", color="C1", smooth=True, scale=100.0)
        twin.set_ylabel("MFU (%)", color="C1")
        twin.set_ylim(bottom=0)
        _legend(ax, twin, loc="lower right")


def _memory_keys(s: Series) -> list[str]:
    return sorted(k for k in s if k.startswith(_MEMORY_PREFIXES) and s.has(k))


def _panel_memory(ax: Any, s: Series) -> None:
    keys = _memory_keys(s)
    if not keys:
        return _no_data(ax, "memory")
    top = 0.0
    for key in keys:
        top = max([top, *_finite(_line(ax, s, key, label=key))])
    ax.set_ylim(0, top * 1.1 or 1.0)
    _style(ax, "memory", "GiB")
    ax.legend(fontsize=8)


def _task_keys(s: Series) -> list[str]:
    """The ``tasks/NAME/METRIC`` series (periodic task evaluation, ``eval.eval_tasks``), sorted; not the harness's
    standard errors (``METRIC_stderr``), which are not scores."""
    return sorted(k for k in s if k.startswith(_TASK_PREFIX) and not k.endswith("_stderr") and s.has(k))


def _unit_range(ax: Any, values: list[float]) -> None:
    """Scores that are fractions (accuracies) on a fixed [0, 1] axis, so runs and steps compare at a glance."""
    if all(0.0 <= v <= 1.0 for v in values):
        ax.set_ylim(-0.02, 1.02)


def _panel_tasks(ax: Any, s: Series) -> None:
    """One line per task and metric (accuracy-like values in [0, 1])."""
    keys = _task_keys(s)
    if not keys:
        return _no_data(ax, "tasks")
    values: list[float] = []
    for i, key in enumerate(keys):
        values += _line(ax, s, key, label=key[len(_TASK_PREFIX) :], color=f"C{i % 10}")
    _unit_range(ax, values)
    _style(ax, "tasks", "score")
    ax.legend(fontsize=8)


def _preference_keys(s: Series) -> list[str]:
    """Preference tuning's series (``dpo/*`` of training windows, ``val_dpo/*`` of evaluations), sorted."""
    return sorted(k for k in s if k.startswith(("dpo/", "val_dpo/")) and s.has(k))


def _panel_preference(ax: Any, s: Series) -> None:
    """Preference accuracy on [0, 1] (left axis) and reward margins (right axis), train and held out."""
    keys = _preference_keys(s)
    if not keys:
        return _no_data(ax, "preference")
    twin = ax.twinx()
    for i, key in enumerate(keys):
        _line(twin if key.endswith("reward_margin") else ax, s, key, label=key, color=f"C{i % 10}")
    ax.set_ylim(-0.02, 1.02)
    _style(ax, "preference", "accuracy")
    twin.set_ylabel("reward margin")
    _legend(ax, twin, loc="lower right")


def _panel_step_time(ax: Any, s: Series) -> None:
    pct = [k for k in ("time/data_pct", "gpu/util_pct") if s.has(k)]
    if not (s.has("time/step_ms") or pct):
        return _no_data(ax, "step time")
    twin = None
    if s.has("time/step_ms"):
        _line(ax, s, "time/step_ms", label="step ms", color="C0", smooth=True)
    _style(ax, "step time", "ms / step")
    if pct:
        twin = ax.twinx()
        for i, key in enumerate(pct):
            _line(twin, s, key, label=key, color=f"C{i + 1}", smooth=True)
        twin.set_ylabel("%")
        twin.set_ylim(0, 105)
    _legend(ax, twin)


def _save(fig: Any, canvas_cls: Any, path: Path, overwrite: bool = True) -> Path:
    """Render ``fig`` to a temporary file beside ``path``, then place it (``rundir.place_file``: without
    ``overwrite`` a file already at ``path`` is kept and the PNG goes to the first free name). Returns where."""
    canvas_cls(fig)
    # A unique name per call (two writers never share a temp file); opened like any new file, so it gets the
    # usual permissions (mkstemp's would be 0600).
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        with open(tmp, "xb") as f:
            fig.savefig(f, format="png", dpi=_DPI, pil_kwargs={"compress_level": _PNG_COMPRESSION})
        return place_file(tmp, path, overwrite)
    finally:
        tmp.unlink(missing_ok=True)


def _tokens_title(s: Series) -> str:
    tokens = s.last("tokens")
    last_step = max((max(by_step) for by_step in s.values() if by_step), default=None)
    text = f"step {last_step:,}" if last_step is not None else ""
    if tokens is not None:
        text += f" — {_human(tokens)} tokens seen"
    return text


def write_run_plots(run_dir: Path | str) -> list[Path]:
    """Write ``run_dir/plots/*.png`` from ``run_dir/metrics.jsonl``; return the paths written.

    ``loss.png`` (train and val loss, log y when the values span more than 10x, non-finite losses marked),
    ``lr.png``, ``throughput.png`` (tokens/s; MFU on a second axis when logged), ``grad_norm.png``,
    ``memory.png`` (every ``gpu/mem*`` and ``memory/*`` metric; not written without them), ``tasks.png`` (every
    ``tasks/NAME/METRIC`` of periodic task evaluation, one line each; not written without them), ``preference.png``
    (DPO's accuracy and reward margin, train and held out; not written without them) and ``overview.png``
    (those five panels and the step time with data-wait and GPU-utilisation percentages, 2x3). A single-metric
    file is written only when its metric appears in the file. No metrics file, no rows, or no matplotlib: [].
    """
    run_dir = Path(run_dir)
    series = read_series(run_dir / METRICS_FILE)
    if not series:
        return []
    mpl = _matplotlib()
    if mpl is None:
        log.warning("plots skipped: pip install matplotlib")
        return []
    Figure, Canvas = mpl
    out = run_dir / "plots"
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    title = _tokens_title(series)

    # (file, has data, draw); the figures are built one at a time and dropped after saving.
    single = [
        ("loss", series.has("loss") or series.has("val_loss"), lambda ax: _panel_loss(ax, series)),
        ("lr", series.has("lr"), lambda ax: _panel_single(ax, series, "lr", "learning rate", "lr")),
        ("throughput", series.has("tokens_per_s"), lambda ax: _panel_throughput(ax, series)),
        (
            "grad_norm",
            series.has("grad_norm"),
            lambda ax: _panel_single(
                ax, series, "grad_norm", "gradient norm", "‖g‖ (before clipping)", log_y=True, smooth=True
            ),
        ),
        ("memory", bool(_memory_keys(series)), lambda ax: _panel_memory(ax, series)),
        ("tasks", bool(_task_keys(series)), lambda ax: _panel_tasks(ax, series)),
        ("preference", bool(_preference_keys(series)), lambda ax: _panel_preference(ax, series)),
    ]
    for name, present, draw in single:
        if not present:
            continue
        fig = Figure(figsize=(7, 4))
        fig.subplots_adjust(**_SINGLE_MARGINS)
        draw(fig.add_subplot())
        fig.suptitle(f"{run_dir.name}: {title}", fontsize=9)
        written.append(_save(fig, Canvas, out / f"{name}.png"))

    fig = Figure(figsize=(16, 8.5))
    axes = fig.subplots(2, 3, gridspec_kw=_GRID_MARGINS)
    _panel_loss(axes[0, 0], series)
    _panel_single(axes[0, 1], series, "lr", "learning rate", "lr")
    _panel_throughput(axes[0, 2], series)
    _panel_single(
        axes[1, 0], series, "grad_norm", "gradient norm", "‖g‖ (before clipping)", log_y=True, smooth=True
    )
    _panel_memory(axes[1, 1], series)
    _panel_step_time(axes[1, 2], series)
    fig.suptitle(f"{run_dir.name} — {title}", fontsize=12)
    written.append(_save(fig, Canvas, out / "overview.png"))
    return written


# ------------------------------------------------------------------------------------------ comparing


def _labels(paths: list[Path]) -> list[str]:
    """Each run's folder name; where names collide, with its parent folder's name, then a number."""
    names = [p.resolve().name for p in paths]
    labels = [
        f"{p.resolve().parent.name}/{name}" if names.count(name) > 1 else name
        for p, name in zip(paths, names)
    ]
    seen: dict[str, int] = {}
    out = []
    for label in labels:
        seen[label] = seen.get(label, 0) + 1
        out.append(label if seen[label] == 1 else f"{label} #{seen[label]}")
    return out


def compare_runs(runs: Sequence[Path | str], out: Path | str, *, overwrite: bool = False) -> Path:
    """One PNG at ``out`` overlaying ``runs`` (run directories): train loss, val loss, learning rate, tokens/s and
    gradient norm, and when a run scored tasks during training a row of task scores (one colour per run, one line
    style per task and metric), the legend naming each run by its folder (disambiguated when two share a
    name). ``out`` may be an existing directory (the file is then ``compare.png`` in it). Returns the path.

    Raises ``UserError`` when a run has no ``metrics.jsonl``, without matplotlib, or when the file exists and
    ``overwrite`` is False (checked before anything is drawn, and again as the file is placed).
    """
    if not runs:
        raise UserError("compare_runs needs at least one run directory")
    paths = [Path(r) for r in runs]
    data = []
    for p in paths:
        if not (p / METRICS_FILE).is_file():
            raise UserError(f"{p} has no {METRICS_FILE}; pass a run directory")
        data.append(read_series(p / METRICS_FILE))
    out = output_file(out, "compare.png", overwrite)
    mpl = _matplotlib()
    if mpl is None:
        raise UserError("comparing runs needs matplotlib: pip install matplotlib")
    Figure, Canvas = mpl
    out.parent.mkdir(parents=True, exist_ok=True)

    task_keys = sorted({k for s in data for k in _task_keys(s)})
    rows = 3 if task_keys else 2
    fig = Figure(figsize=(16, 8.5 * rows / 2))
    grid = fig.add_gridspec(rows, 3, **_GRID_MARGINS)
    axes = np.array([[fig.add_subplot(grid[r, c]) for c in range(3)] for r in range(2)])
    labels = _labels(paths)
    _compare_panels(axes, data, labels)
    if task_keys:
        _compare_tasks(fig.add_subplot(grid[2, :]), data, labels, task_keys)
    _runs_legend(axes[1, 2], data, labels)
    fig.suptitle("comparison: " + ", ".join(labels), fontsize=12)
    return _save(fig, Canvas, out, overwrite=overwrite)


# The overlaid panels of a comparison: (row, column, metric, title, y label, log y when the values span > 10x).
_COMPARED = [
    (0, 0, "loss", "train loss", "loss (nats/token)", True),
    (0, 1, "val_loss", "val loss", "loss (nats/token)", True),
    (0, 2, "lr", "learning rate", "lr", False),
    (1, 0, "tokens_per_s", "throughput", "tokens / s", False),
    (1, 1, "grad_norm", "gradient norm", "‖g‖ (before clipping)", True),
]


def _compare_panels(axes: Any, data: list[Series], labels: list[str]) -> None:
    """Each metric of :data:`_COMPARED` in its panel, one line per run (colour ``C<i>``)."""
    for r, c, key, title, ylabel, log_y in _COMPARED:
        ax = axes[r, c]
        values: list[float] = []
        for i, s in enumerate(data):
            if s.has(key):
                smooth = key in ("loss", "tokens_per_s", "grad_norm")
                values += _line(ax, s, key, label=labels[i], color=f"C{i % 10}", smooth=smooth)
                if key in ("loss", "val_loss"):
                    _mark_non_finite(ax, s, [key], color=f"C{i % 10}", label=f"{labels[i]} non-finite")
        if values:
            if log_y:
                _maybe_log_y(ax, values)
            _style(ax, title, ylabel)
        else:
            _no_data(ax, title)


def _compare_tasks(ax: Any, data: list[Series], labels: list[str], task_keys: list[str]) -> None:
    """The task scores row: one colour per run, one line style per task and metric."""
    styles = ["-", "--", ":", "-."]
    scores: list[float] = []
    for i, s in enumerate(data):
        for j, key in enumerate(task_keys):
            if s.has(key):
                label = f"{labels[i]}: {key[len(_TASK_PREFIX) :]}"
                steps, values = s.points(key)
                ax.plot(steps, values, styles[j % 4], marker="o", ms=3, color=f"C{i % 10}", label=label)
                scores += _finite(values)
    _unit_range(ax, scores)
    _style(ax, "tasks", "score")
    ax.legend(fontsize=8, ncol=2)


def _runs_legend(ax: Any, data: list[Series], labels: list[str]) -> None:
    """The panel naming each run by its colour, with how far it went."""
    from matplotlib.lines import Line2D

    ax.axis("off")
    handles = [
        Line2D([], [], color=f"C{i % 10}", lw=2, label=f"{label}  ({_tokens_title(s)})")
        for i, (label, s) in enumerate(zip(labels, data))
    ]
    ax.legend(handles=handles, loc="center", fontsize=10, title="runs", frameon=False)


class PlotWriter:
    """Redraws ``RUN/plots/`` in a background thread when asked (the trainer asks after each evaluation): the
    training loop never waits for matplotlib, and requests that arrive while a drawing is under way are merged
    into one. :meth:`close` stops the thread and draws the final plots synchronously.

    At most one drawing every ``min_interval_s`` seconds, the first ``min_interval_s`` after this writer was made
    (the run's start): drawing holds Python's GIL for most of its second or more (the first one also imports
    matplotlib), and a run evaluating every few seconds had the thread drawing all the time, taking the GIL from
    the loop that launches the GPU's work (a 125m run with an evaluation every 2 s: GPU 17% busy; drawing at the
    first evaluation still cost 2.3 s of a 55 s run on an H100). A run shorter than that draws once, at its end."""

    def __init__(self, run_dir: Path | str, *, min_interval_s: float = 30.0) -> None:
        import threading
        import time

        self.run_dir = Path(run_dir)
        self.min_interval_s = min_interval_s
        self._first_at = time.monotonic() + min_interval_s
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.drawings = 0
        """Drawings made by the thread (for the tests)."""

    def request(self) -> None:
        import threading

        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="gptoughts-plots", daemon=True)
            self._thread.start()
        self._wake.set()

    def _loop(self) -> None:
        import time

        if self._stopping.wait(max(0.0, self._first_at - time.monotonic())):  # close() ends the wait
            return
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._stopping.is_set():
                return
            try:
                write_run_plots(self.run_dir)
            except Exception as e:  # noqa: BLE001 - a plot must never stop a run
                log.warning("plots skipped: %s", e)
            self.drawings += 1
            if self._stopping.wait(self.min_interval_s):  # requests meanwhile wait; close() ends the pause
                return

    def close(self) -> list[Path]:
        if self._thread is not None:
            self._stopping.set()
            self._wake.set()
            self._thread.join()
            self._thread = None
        try:
            return write_run_plots(self.run_dir)
        except Exception as e:  # noqa: BLE001 - a plot must never stop a run
            log.warning("plots skipped: %s", e)
            return []
