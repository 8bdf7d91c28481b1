"""A LoRA dry run plans the model the run trains: the adapters counted, target modules that match no layer
and QLoRA without a CUDA GPU refused as the run refuses them."""

from __future__ import annotations

import pytest
from cli_helpers import QUIET_CPU, run_cli
from hf_helpers import sft_rows


def _plan_line(text: str) -> str:
    return next(line for line in text.splitlines() if line.startswith("plan:"))


@pytest.mark.slow  # a real run beside the dry run: ~3.5 s on 2 cores
def test_a_lora_dry_run_plans_the_adapters_the_run_trains(hf_model, tmp_path, ft_cache, capsys):
    base, data = hf_model("llama"), sft_rows(tmp_path / "d.jsonl", 16)
    cmd = ["finetune", "--model", str(base), "--data", str(data), "--lora", "--max_steps", "1",
           "--block_size", "32", "--batch_size", "2", *QUIET_CPU]  # fmt: skip
    code, dry = run_cli([*cmd, "--out", str(tmp_path / "dry"), "--dry_run"], capsys)
    assert code == 0 and not (tmp_path / "dry").exists()
    code, real = run_cli([*cmd, "--out", str(tmp_path / "run")], capsys)
    assert code == 0, real[-2000:]
    assert "32,768 trainable" in _plan_line(real)
    assert _plan_line(dry) == _plan_line(real)
    # target modules that match no layer: the dry run refuses as the run does
    code, text = run_cli(
        [*cmd, "--out", str(tmp_path / "tm"), "--target_modules", "foo", "--dry_run"], capsys
    )
    assert code == 2 and "lora.target_modules foo match no linear layer" in text
    # QLoRA on a CPU: the dry run refuses as the run does
    code, text = run_cli([*cmd, "--out", str(tmp_path / "q"), "--qlora", "--dry_run"], capsys)
    assert code != 0 and "QLoRA (4-bit) needs a CUDA GPU" in text and "Traceback" not in text
