"""A golden loss curve: 30 steps of the debug Llama on a fixed synthetic corpus (CPU, fp32, one thread) must
reproduce the committed losses. Any silent change of numerics (init, data order, loss, optimizer, schedule)
shows here. After an intended change, regenerate with ``GPTOUGHTS_WRITE_GOLDEN=1 pytest tests/training/test_golden.py``
and say why in the commit."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from gptoughts import cli

GOLDEN = Path(__file__).parent / "golden_loss.json"
STEPS = 30


def synthetic_corpus(folder: Path) -> Path:
    """~60 KB of Python-like text from a seeded generator (no dependence on this machine's stdlib)."""
    rng = random.Random(1234)
    names = ["alpha", "beta", "gamma", "delta", "value", "count", "total", "index", "item", "result"]
    ops = ["+", "-", "*", "//", "%"]
    folder.mkdir(parents=True, exist_ok=True)
    for f in range(6):
        lines = []
        for i in range(220):
            a, b = rng.choice(names), rng.choice(names)
            lines.append(f"def {a}_{i}({b}, n={rng.randint(0, 99)}):")
            lines.append(f"    return {b} {rng.choice(ops)} n  # {rng.choice(names)} {rng.randint(0, 9)}")
        (folder / f"part{f}.py").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return folder


@pytest.mark.slow
def test_golden_loss_curve(tmp_path, monkeypatch):
    monkeypatch.setenv("GPTOUGHTS_CACHE", str(tmp_path / "cache"))
    corpus = synthetic_corpus(tmp_path / "corpus")
    out = tmp_path / "run"
    code = cli.main(
        [
            "train",
            "default",
            "--data",
            str(corpus),
            "--out",
            str(out),
            "--max_steps",
            str(STEPS),
            "--tokenizer",
            "bytes",
            "--block_size",
            "32",
            "--batch_size",
            "4",
            "--learning_rate",
            "1e-3",
            "--warmup_steps",
            "2",
            "--train.schedule",
            "constant",
            "--log_interval",
            "1",
            "--eval_interval",
            "10",
            "--train.eval_batches",
            "2",
            "--train.checkpoints",
            "false",
            "--train.sample_prompts=",
            "--seed",
            "0",
            "--device",
            "cpu",
            "--precision",
            "fp32",
            "--threads",
            "1",
            "--no_progress",
            "--run.tensorboard",
            "false",
        ]
    )
    assert code == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in rows if "loss" in r}
    val = {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}
    got = {"loss": [losses[s] for s in range(1, STEPS + 1)], "val_loss": [val[s] for s in (10, 20, 30)]}
    if os.environ.get("GPTOUGHTS_WRITE_GOLDEN"):
        GOLDEN.write_text(json.dumps(got, indent=1) + "\n")
    golden = json.loads(GOLDEN.read_text())
    assert got["loss"][-1] < got["loss"][0] - 0.5  # it learns
    for key in ("loss", "val_loss"):
        assert got[key] == pytest.approx(golden[key], rel=1e-4, abs=1e-5), key
