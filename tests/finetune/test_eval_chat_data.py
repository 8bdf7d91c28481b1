"""`gptoughts eval RUN --data chat.jsonl`: chat examples and preference pairs given to --data, which scores plain
text, are one line naming what the file holds and where it is scored, before any model loads (not a missing
"text" field with a hint to --text_field, a flag eval does not take)."""

from __future__ import annotations

import json

from cli_helpers import run_cli


def test_eval_data_names_chat_examples_and_pairs_before_loading(tmp_path, capsys):
    chat = tmp_path / "chat.jsonl"
    chat.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
        + "\n"
    )
    prefs = tmp_path / "prefs.jsonl"
    prefs.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n")
    run = tmp_path / "model"  # a model folder without weights: the refusal comes before any load
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"model_type": "llama"}))
    code, text = run_cli(["eval", str(run), "--data", str(chat)], capsys)
    assert code == 2 and "Traceback" not in text and "--text_field" not in text
    assert "holds chat examples" in text and "--tasks" in text
    code, text = run_cli(["eval", str(run), "--data", str(prefs)], capsys)
    assert code == 2 and "holds preference pairs" in text and "--prefs" in text
