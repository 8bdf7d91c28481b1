"""Shared fixtures: a tiny text corpus and fast, quiet training settings."""

from __future__ import annotations

import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from cli_helpers import FAST  # one definition, importable by name from any test (not from "conftest")


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """Tiny test models run fastest on one thread; with OpenMP's spin-waiting threads, any other load on a
    2-core machine can make them 20x slower (measured: the quickstart test took 7.5 s on 1 thread, 189 s on 2
    while another process used a core)."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(autouse=True)
def _own_logger_state():
    """The CLI gives the ``gptoughts`` logger a handler and stops its propagation, once per process: undone after
    each test, or a later test's ``caplog`` (which listens at the root) would hear nothing, depending on order."""
    import logging

    log = logging.getLogger("gptoughts")
    saved = (list(log.handlers), log.level, log.propagate)
    yield
    log.handlers[:], log.level, log.propagate = saved[0], saved[1], saved[2]


@pytest.fixture(autouse=True, scope="session")
def _no_plots_drawn() -> Iterator[Callable]:
    """A run draws RUN/plots/ (matplotlib, five PNGs) after its evaluations and at its end: ~0.7 s, about half of
    a debug run, and no assertion reads them outside the tests marked ``plots`` (test_plots.py, and each test
    that opens a run's PNG files). Elsewhere, module fixtures included, the drawing is skipped as if matplotlib
    were missing: the runs, their metrics and summaries are the same (a plot never stops a run). Measured: the
    fast tier's in-process runs take half the time. Yields the real drawing function."""
    from gptoughts.training import plots

    draw = plots.write_run_plots
    plots.write_run_plots = lambda run_dir, *args, **kwargs: []
    yield draw
    plots.write_run_plots = draw


@pytest.fixture(autouse=True)
def _plots_drawn_where_checked(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, _no_plots_drawn: Callable
) -> None:
    """The tests marked ``plots`` draw them (the function :func:`_no_plots_drawn` set aside)."""
    if request.node.get_closest_marker("plots") is not None:
        from gptoughts.training import plots

        monkeypatch.setattr(plots, "write_run_plots", _no_plots_drawn)


@pytest.fixture(autouse=True, scope="session")
def _own_hugging_face_caches(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The evaluation harness loads local task files through ``datasets``, which caches (and would read back)
    under ~/.cache/huggingface: the session gets caches of its own. Set before the first ``datasets`` import,
    which reads them (the package imports it lazily)."""
    home = tmp_path_factory.mktemp("hf-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HOME", str(home))
        mp.setenv("HF_DATASETS_CACHE", str(home / "datasets"))
        yield home


@pytest.fixture(autouse=True)
def _own_working_directory(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test runs in an empty folder of its own, with its own cache: what a test writes to a relative path
    (`runs/quickstart`, the default cache) never meets the user's checkout or another test's files."""
    cwd = tmp_path_factory.mktemp("cwd")
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("GPTOUGHTS_CACHE", str(cwd / ".gptoughts-cache"))
    monkeypatch.delenv(
        "TORCHINDUCTOR_CACHE_DIR", raising=False
    )  # a run sets it in-process: undone after each test
    return cwd


def _write_text_corpus(out: Path) -> Path:
    src = Path(sysconfig.get_paths()["stdlib"])
    out.mkdir()
    total = 0
    for name in (
        "textwrap.py",
        "string.py",
        "shlex.py",
        "bisect.py",
        "heapq.py",
        "fnmatch.py",
        "glob.py",
        "colorsys.py",
        "keyword.py",
        "numbers.py",
    ):
        p = src / name
        if p.exists():
            data = p.read_text(encoding="utf-8", errors="replace")
            (out / name).write_text(data, encoding="utf-8")
            total += len(data)
    assert total > 20_000
    return out


@pytest.fixture
def text_corpus(tmp_path: Path) -> Path:
    """~60 KB of real Python source from the standard library, as a folder of .py files."""
    return _write_text_corpus(tmp_path / "corpus")


@pytest.fixture(scope="session")
def shared_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same corpus, for a module- or session-scoped fixture: the runs (one launch) that several tests assert
    on. Read only."""
    return _write_text_corpus(tmp_path_factory.mktemp("shared") / "corpus")


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Keep token-shard and autobatch caches out of the user's home."""
    d = tmp_path / "cache"
    monkeypatch.setenv("GPTOUGHTS_CACHE", str(d))
    return d


@pytest.fixture
def fast() -> dict:
    """Fast, quiet CPU training overrides (dotted keys)."""
    return dict(FAST)


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    """torch.compile's caches emptied before and after a test: Muon's compiled step graphs (one per batch shape,
    cached by ``newton_schulz.compiled``) and dynamo's, so that a test counts or compares its own compilations."""
    import torch

    from gptoughts.training import newton_schulz

    torch._dynamo.reset()
    newton_schulz.compiled.cache_clear()
    yield
    torch._dynamo.reset()
    newton_schulz.compiled.cache_clear()


@pytest.fixture
def sampled_ids(monkeypatch) -> list[list[int]]:
    """The ids each generation continues, recorded in place of generating (the model is not run)."""
    from gptoughts import sampling

    seen: list[list[int]] = []

    def generate(model, x, n, **kw):
        seen.append(x[0].tolist())
        return x

    monkeypatch.setattr(sampling, "generate", generate)
    return seen
