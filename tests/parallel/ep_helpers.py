"""What the expert-parallel tests share (test_ep, test_ep_seams, test_ep_combine): the debug DeepSeek's settings,
its runs' metrics, and the tolerance two layouts of one run keep. Imported by name (``from ep_helpers import``)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from torchrun_runs import process

ARGS = [
    "--model.size", "debug", "--data.tokenizer", "bytes", "--eval_batches", "2",
    "--perf.device", "cpu", "--precision", "fp32", "--compile", "false", "--perf.threads", "1",
    "--run.progress", "false", "--log_interval", "1", "--eval_interval", "3", "--save_interval", "3",
    "--train.schedule", "constant", "--warmup_steps", "0", "--sample_prompts", "def ",
    "--sample_max_new_tokens", "4", "--block_size", "32",
]  # fmt: skip


def argv(out: Path, corpus: Path, *extra: str, family: str = "deepseek") -> list[str]:
    """``gptoughts ARGV`` of a debug run (without the launch)."""
    return [
        "train",
        "default",
        "--out",
        str(out),
        "--data",
        str(corpus),
        "--model.family",
        family,
        *ARGS,
        *extra,
    ]


def _train(
    out: Path, corpus: Path, *extra: str, procs: int = 1, family: str = "deepseek"
) -> subprocess.CompletedProcess:
    return process(argv(out, corpus, *extra, family=family), procs=procs)


def _rows(run: Path) -> dict[int, dict]:
    """The last logged row of each step (a resumed run appends its own)."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "loss" in r}


def _close(a: dict[int, dict], b: dict[int, dict], steps: list[int]) -> None:
    # fp32 on both sides; the only differences are summation orders (all-reduces, row order in the experts' GEMMs)
    for s in steps:
        assert abs(a[s]["loss"] - b[s]["loss"]) < 1e-5 * abs(a[s]["loss"]), (s, a[s]["loss"], b[s]["loss"])
