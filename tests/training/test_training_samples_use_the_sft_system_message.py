"""The samples an SFT run takes while it trains (``--sample_prompts``, and the end-of-run sample) open with the system
message every training conversation opened with: the model never saw a chat prompt without it. Conversations that
each have their own system message have no one text to stand for them all: the samples have none."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_helpers import QUIET_CPU, ok

from gptoughts.data.sft import render_prompt
from gptoughts.data.tokenizer import bytes_tokenizer


def _sft(path: Path, systems: list[str]) -> Path:
    rows = [
        {"system": s, "prompt": f"add {i} {i}", "response": str(2 * i)} for i, s in enumerate(systems * 8)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    "systems", [["Be brief."], ["Be brief.", "Be kind."]], ids=["shared", "each-its-own"]
)
def test_the_training_samples_of_an_sft_run_open_with_its_shared_system_message(
    tmp_path, cache_dir, capsys, sampled_ids, systems
):
    data = _sft(tmp_path / "chat.jsonl", systems)
    ok(["train", "--data", str(data), "--tokenizer", "bytes", "--size", "debug", "--out", str(tmp_path / "run"),
        *QUIET_CPU, "--block_size", "96", "--batch_size", "2", "--max_steps", "1", "--sample_prompts", "add 5 5"], capsys)  # fmt: skip
    user = [{"role": "user", "content": "add 5 5"}]
    shared = [{"role": "system", "content": systems[0]}] if len(systems) == 1 else []
    assert json.loads((tmp_path / "run" / "run.json").read_text())["sft_system"] == (
        systems[0] if shared else True
    )
    expected = render_prompt(bytes_tokenizer(), shared + user)
    assert sampled_ids and all(c == expected for c in sampled_ids), sampled_ids
