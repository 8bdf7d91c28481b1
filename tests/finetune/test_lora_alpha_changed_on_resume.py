"""`gptoughts finetune --resume auto --lora_alpha 64` on a LoRA run trained at another alpha: allowed (a typed flag
wins on a resume, and the adapters' shapes are the same), but the adapters the checkpoint holds act at another scale
(alpha / r) from the resumed step on, which the loss alone would not explain: the plan says it in one line. A resume
at the run's own alpha says nothing of it."""

from __future__ import annotations

import pytest
from cli_helpers import QUIET_CPU, ok
from hf_helpers import sft_rows

FAST = [*QUIET_CPU, "--block_size", "32", "--batch_size", "4", "--grad_accum", "1", "--warmup_steps", "1",
        "--eval_interval", "0", "--sample_interval", "0", "--precision", "fp32", "--compile", "false",
        "--val_fraction", "0", "--save_interval", "1"]  # fmt: skip
SAID = "lora alpha 32 -> 64: the adapters' scale changes from this step (alpha/r 2 -> 4)"


@pytest.mark.slow
def test_a_resume_at_another_lora_alpha_says_the_scale_changes(
    hf_model, tmp_path, ft_cache, monkeypatch, capsys
):
    hf_model("llama", name="base")
    sft_rows(tmp_path / "chat.jsonl")
    monkeypatch.chdir(tmp_path)
    first = [
        "finetune",
        "--model",
        "base",
        "--data",
        "chat.jsonl",
        "--lora",
        "--lora_r",
        "16",
        "--out",
        "ft",
        *FAST,
    ]
    ok([*first, "--max_steps", "1", "--lora_alpha", "32"], capsys)
    same = ok(["finetune", "--resume", "auto", "--out", "ft", "--max_steps", "2", *QUIET_CPU], capsys)
    assert "lora alpha" not in same
    text = ok(["finetune", "--resume", "auto", "--out", "ft", "--max_steps", "3", "--lora_alpha", "64", *QUIET_CPU],
              capsys)  # fmt: skip
    assert sum(SAID in line for line in text.splitlines()) == 1, text[-3000:]
