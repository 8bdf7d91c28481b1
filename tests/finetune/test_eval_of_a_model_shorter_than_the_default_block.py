"""``gptoughts eval MODEL --data TEXT`` (or ``--prefs PAIRS``) of a model folder with fewer positions than the default
block (256): scored in windows of the model's length (--data was refused, asking for a --block_size the user never
gave; --prefs ran the forward past the positions: a traceback)."""

from __future__ import annotations

import json

from cli_helpers import ok, refused


def test_eval_of_a_short_model_scores_windows_of_its_length(hf_model, tmp_path, ft_cache, capsys):
    model = hf_model("llama", max_position_embeddings=64)
    text = tmp_path / "notes.txt"
    text.write_text("plain text to score, line after line.\n" * 20)
    printed = ok(["eval", str(model), "--data", str(text), "--device", "cpu"], capsys)
    assert "in windows of 64 tokens" in printed, printed[-500:]


def test_preferences_of_a_short_model_fit_its_positions(hf_model, tmp_path, ft_cache, capsys):
    model = hf_model("llama", max_position_embeddings=64)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "q" * 10, "chosen": "a" * 10, "rejected": "b" * 10}) + "\n")
    argv = ["eval", str(model), "--prefs", str(pairs), "--device", "cpu"]
    assert "preference accuracy" in ok(argv, capsys)
    refused([*argv, "--block_size", "65"], capsys, "pass --block_size 64 or less")
