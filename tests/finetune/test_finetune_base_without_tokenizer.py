"""A model folder without tokenizer files, given to finetune: one line naming the folder and what it lacks (not the
--tokenizer flag, which fine-tuning does not read)."""

from __future__ import annotations

import shutil

from cli_helpers import QUIET_CPU, run_cli
from hf_helpers import sft_rows


def test_a_model_folder_without_tokenizer_is_named_not_a_tokenizer_flag(hf_model, tmp_path, capsys):
    base = hf_model("llama")
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy2(base / name, bare / name)
    data = sft_rows(tmp_path / "d.jsonl", 8)
    for extra in ([], ["--dry_run"]):
        code, text = run_cli(
            ["finetune", "--model", str(bare), "--data", str(data), "--out", str(tmp_path / "run"), *QUIET_CPU,
             *extra],
            capsys,
        )  # fmt: skip
        assert code == 2 and "Traceback" not in text
        assert f"{bare} has no tokenizer files" in text and "--tokenizer" not in text, text
    assert not (tmp_path / "run").exists()
