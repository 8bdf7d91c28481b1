"""``--epochs N`` plans the windows its loader draws, not the corpus's tokens: windows of block_size+1 tokens never
cross a shard file, so each shard's tail shorter than a window is never drawn. Counted in tokens, ``--epochs 2`` on
four sources of ~1.9 windows each planned 16 steps of one row, which the loader logged as epoch 4.0 (one window a
source); the plan's "= 2.00 epoch(s) over the data" said otherwise. Checked for a plain corpus, a curriculum, a dry
run before the corpus is tokenized, and a resume that extends the epochs (at the run's batch and at another)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from cli_helpers import QUIET_CPU, ok

from gptoughts.data.loader import BatchLoader, Phase
from gptoughts.data.prepare import cached_prepare

BLOCK = 256
SEED = 1337  # (the default train.seed, which the cache key and the loader's stream take)
FLAGS = ["--tokenizer", "bytes", "--block_size", str(BLOCK), "--size", "debug", *QUIET_CPU]


def _sources(tmp_path: Path) -> list[Path]:
    """Four sources of one line each, of ~1.8 windows of train tokens: one window each is drawn. Each is over a fifth
    of the corpus, so the split holds out its tail (the same share of every source, cut where it falls: no line
    start to move it) rather than one whole."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    out = []
    for i, name in enumerate("abcd"):
        line = " ".join(f"{name}{k * 7 % 13}" for k in range(200))
        (folder / f"{name}.txt").write_text(line[: 515 + 3 * i])
        out.append(folder / f"{name}.txt")
    return out


def _toml(tmp_path: Path, sources: list[Path], phases: bool) -> Path:
    text = "[data]\nsources = [" + ", ".join(f'"{p}"' for p in sources) + "]\n"
    if phases:  # a first phase of source a alone, then all four
        text += f'[[data.phases]]\nname = "first"\nsources = ["{sources[0]}"]\ntokens = {2 * BLOCK}\n'
        text += '[[data.phases]]\nname = "rest"\nsources = [' + ", ".join(f'"{p}"' for p in sources) + "]\n"
    (tmp_path / "run.toml").write_text(text)
    return tmp_path / "run.toml"


def _prepared(sources: list[Path]) -> Path:
    m = cached_prepare([str(p) for p in sources], "bytes", val_fraction=0.005, seed=SEED, progress=False)
    return m.dir


def _plan(text: str) -> tuple[int, int, int, str]:
    """(steps, micro-batch, accumulation, the epochs it says) of a printed plan."""
    batch = re.search(r"batch: (\d+) x [\d,]+ tokens x accumulation (\d+)", text)
    steps = re.search(r"steps: ([\d,]+) \([^)]*\) = ([\d.]+) epoch\(s\)", text)
    assert batch and steps, text[-2000:]
    return int(steps.group(1).replace(",", "")), int(batch.group(1)), int(batch.group(2)), steps.group(2)


def _epoch_after(
    shards: Path, micro: int, batches: int, phases: list[Phase] | None = None
) -> tuple[float, int]:
    """(the loader's epoch after ``batches`` micro-batches, its windows an epoch): what the run's last row logs."""
    with BatchLoader(
        shards, batch_size=micro, block_size=BLOCK, seed=SEED, phases=phases, prefetch=0
    ) as loader:
        for _ in range(batches):
            next(loader)
        return loader.epoch, loader.windows_per_epoch


@pytest.mark.parametrize("phases", [False, True], ids=["corpus", "curriculum"])
def test_the_planned_steps_draw_the_epochs_asked(phases, tmp_path, cache_dir, capsys):
    sources = _sources(tmp_path)
    shards = _prepared(sources)  # the plan counts the shards' windows
    toml = _toml(tmp_path, sources, phases)
    text = ok(["train", str(toml), "--epochs", "2", "--batch_size", "1", "--dry_run", *FLAGS], capsys)
    steps, micro, accum, said = _plan(text)
    loader_phases = [Phase("first", [0], 2 * BLOCK), Phase("rest", [0, 1, 2, 3])] if phases else None
    epoch, windows = _epoch_after(shards, micro, steps * accum, loader_phases)
    assert windows < 2 * len(sources)  # (the tails are a large share here)
    # the nearest whole number of steps to the epochs asked: within half a step's rows of them
    assert abs(epoch - 2) <= micro * accum / (2 * windows), (epoch, steps, windows, text[-1500:])
    assert said == f"{epoch:.2f}", (said, epoch)


def test_a_dry_run_before_the_corpus_is_tokenized_counts_windows_too(tmp_path, cache_dir, capsys):
    sources = _sources(tmp_path)
    toml = _toml(tmp_path, sources, False)
    text = ok(["train", str(toml), "--epochs", "2", "--batch_size", "1", "--dry_run", *FLAGS], capsys)
    assert "estimated: not tokenized yet" in text, text[-1500:]
    estimated = _plan(text)
    shards = _prepared(sources)
    epoch, windows = _epoch_after(shards, estimated[1], estimated[0] * estimated[2])
    # the estimate shares the tokens out by bytes: here each source's windows are the run's
    assert abs(epoch - 2) <= estimated[1] * estimated[2] / (2 * windows), (
        epoch,
        estimated,
        windows,
        text[-1500:],
    )


def _last_epoch(run: Path) -> float:
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    return [r["epoch"] for r in rows if r.get("epoch") is not None][-1]


@pytest.mark.slow
@pytest.mark.parametrize("batch", [None, "3"], ids=["same-batch", "another-batch"])
def test_a_resume_that_extends_the_epochs_ends_at_them(batch, tmp_path, cache_dir, capsys):
    sources = _sources(tmp_path)
    toml, out = _toml(tmp_path, sources, False), tmp_path / "run"
    text = ok(
        ["train", str(toml), "--epochs", "1.25", "--batch_size", "1", "--out", str(out), *FLAGS], capsys
    )
    assert _plan(text)[3] == f"{_last_epoch(out):.2f}" == "1.25", text[-1500:]
    more = ["--batch_size", batch, "--grad_accum", "1"] if batch else []
    text = ok(["train", "--resume", "auto", "--out", str(out), "--epochs", "3", *more, *QUIET_CPU], capsys)
    steps, micro, accum, said = _plan(text)
    windows = _epoch_after(_prepared(sources), 1, 0)[1]
    # at another batch too, the steps left are the nearest to the epochs asked (they were rounded up: 3.5 epochs)
    assert abs(_last_epoch(out) - 3) <= micro * accum / (2 * windows), (_last_epoch(out), text[-1500:])
    assert said == f"{_last_epoch(out):.2f}", (said, text[-1500:])
