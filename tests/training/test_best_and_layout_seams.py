"""Two seams where a run said one thing in two ways: "best" under --early_stopping_min_delta (best.json, the
"(best)" marks and the summary name one step: the lowest val loss; min_delta only decides what resets early
stopping's patience), and a Llama variant no transformers class computes (the plan says so; export refuses in one
line; neither crashes)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from cli_helpers import FASTRUN, refused, run_cli

from gptoughts.training.checkpoint import store as ckpt

# The brief's run: every evaluation is lower than the last, none by the huge min_delta.
MIN_DELTA = ["--eval_interval", "2", "--save_interval", "2", "--early_stopping_min_delta", "100",
             "--learning_rate", "3e-3"]  # fmt: skip


def _train(out: Path, corpus: Path, capsys, *flags: str) -> str:
    argv = ["train", "--data", str(corpus), "--out", str(out), "--size", "debug", "--tokenizer", "bytes"]
    code, text = run_cli([*argv, *flags, *FASTRUN], capsys)
    assert code == 0 and "Traceback" not in text, text[-2000:]
    return text


def _evals(text: str) -> list[tuple[int, float, bool]]:
    """(step, val loss, marked best) of each evaluation line."""
    return [
        (int(m.group(1)), float(m.group(2)), m.group(3) is not None)
        for m in re.finditer(r"step (\d+): val loss ([\d.]+), perplexity [\d.]+( \(best\))?", text)
    ]


def _lowest(evals: list[tuple[int, float, bool]]) -> int:
    return min(evals, key=lambda e: e[1])[0]


def test_min_delta_leaves_best_to_the_lowest_val_loss(tmp_path, text_corpus, cache_dir, capsys):
    out = tmp_path / "run"
    text = _train(out, text_corpus, capsys, "--max_steps", "6", "--early_stopping_patience", "10", *MIN_DELTA)
    evals = _evals(text)
    lowest = _lowest(evals)
    assert [s for s, _, _ in evals] == [2, 4, 6] and lowest != 2, evals  # the case: a later, lower val loss
    summary = json.loads((out / "summary.json").read_text())
    assert summary["best_step"] == lowest
    assert ckpt.best_step(out / "checkpoints") == lowest
    # Marked at each new lowest, the last of them the best step
    running = [v == min(x for _, x, _ in evals[: i + 1]) for i, (_, v, _) in enumerate(evals)]
    assert [best for _, _, best in evals] == running and [s for s, _, b in evals if b][-1] == lowest


def test_min_delta_still_decides_patience_across_a_resume(tmp_path, text_corpus, cache_dir, capsys):
    """Step 2 resets the patience (from nothing); 4 and 6 are lower but not by min_delta: patience 2 ends the
    run at step 6, also when it was resumed in between (the patience's reference comes back with the run), and
    step 6 is its best."""
    out = tmp_path / "run"
    flags = ["--early_stopping_patience", "2", *MIN_DELTA]
    first = _train(out, text_corpus, capsys, "--max_steps", "4", *flags)
    text = _train(out, text_corpus, capsys, "--resume", "auto", "--max_steps", "20", *flags)
    evals = _evals(first) + _evals(text)
    assert [s for s, _, _ in evals] == [2, 4, 6], evals
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stop_reason"] == "early stopping" and summary["steps"] == 6
    assert summary["best_step"] == _lowest(evals) == ckpt.best_step(out / "checkpoints") == 6
    assert evals[-1][2]  # marked "(best)"


# ------------------------------------------------------------------------------------- a layout with no class

SWA_FULL_FIRST = ["--model.sliding_window", "8", "--model.full_attention_layers", "1"]


def test_windowed_llama_with_full_first_layers_plans_and_says_it_does_not_export(
    tmp_path, text_corpus, cache_dir, capsys
):
    """Mistral windows every layer and Qwen2/Qwen3 (which keep their first layers full) have q/k/v biases or q/k
    norms: no class computes this model. The plan says so on its model line; training runs; export refuses."""
    out = tmp_path / "run"
    text = _train(out, text_corpus, capsys, "--dry_run", *SWA_FULL_FIRST)
    model_line = next(ln for ln in text.splitlines() if ln.startswith("plan:"))
    assert "model.full_attention_layers" in model_line and "export" in model_line, model_line
    _train(out, text_corpus, capsys, "--max_steps", "1", *SWA_FULL_FIRST)
    refused(
        ["export", str(out), "--format", "hf", str(tmp_path / "hf")],
        capsys,
        "model.full_attention_layers",
        "model.sliding_window",
    )
    assert not (tmp_path / "hf").exists()
