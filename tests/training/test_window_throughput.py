"""A logged window's tokens/s is training's: an evaluation (or sample, save, task scoring) between two windows is
not counted in the next one. Seen on an H200: deepseek small logged 38,562 tokens/s at the step after its first
evaluation (which compiled its no-grad graphs) between steps at 230,000."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import pytest
from cli_helpers import FASTRUN, run_cli

from gptoughts.training.evaluation import Evaluator


@pytest.mark.slow  # whole runs: seconds on 2 cores
def test_an_evaluation_is_not_counted_in_the_next_windows_throughput(
    tmp_path, text_corpus, cache_dir, capsys, monkeypatch
):
    real = Evaluator.evaluate_and_track

    def slow(self):
        time.sleep(3.0)  # far longer than a debug step on a CPU
        return real(self)

    monkeypatch.setattr(Evaluator, "evaluate_and_track", slow)
    out = tmp_path / "run"
    argv = ["train", "--data", str(text_corpus), "--out", str(out), "--size", "debug", "--tokenizer", "bytes",
            "--max_steps", "6", "--eval_interval", "3", "--log_interval", "1", "--threads", "1"]  # fmt: skip
    code, text = run_cli([*argv, *FASTRUN], capsys)
    assert code == 0, text[-2000:]
    rows = [json.loads(line) for line in Path(out / "metrics.jsonl").read_text().splitlines()]
    tps = {r["step"]: r["tokens_per_s"] for r in rows if "tokens_per_s" in r}
    assert set(tps) >= {2, 3, 4, 5, 6}, tps
    # Counted, the 3 s evaluation would hold step 4's window to under 2 * 32 tokens / 3 s = 21 tokens/s; a debug
    # step on a CPU takes milliseconds (CPU timings are noisy: the bound is far from both).
    assert tps[4] > 10 * (2 * 32) / 3.0, tps
    assert tps[4] > 0.05 * statistics.median(tps[s] for s in (2, 3, 5, 6)), tps
