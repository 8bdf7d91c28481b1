"""`gptoughts prepare` on chat examples or preference pairs said they had no field 'text' and to pass --text_field:
fine-tuning reads them whole with the model's tokenizer, so there is nothing to prepare, and the fix is finetune."""

from __future__ import annotations

import json

import pytest

from gptoughts import cli


@pytest.mark.parametrize(
    ("record", "said"),
    [
        ({"prompt": "2+2?", "response": "4"}, "holds chat examples"),
        (
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
            "chat examples",
        ),
        ({"prompt": "a", "chosen": "b", "rejected": "c"}, "holds preference pairs"),
    ],
)
def test_prepare_of_examples_points_to_finetune(record, said, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GPTOUGHTS_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(record) + "\n")
    assert cli.main(["prepare", "--data", str(data), "--tokenizer", "bytes"]) == 2
    err = capsys.readouterr().err
    assert said in err and "gptoughts finetune --model MODEL --data" in err and "--text_field" not in err, err
    assert not (tmp_path / "cache").exists()


def test_text_format_asked_prepares_the_field_named(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GPTOUGHTS_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "d.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"line {i} " * 20, "response": "x"}) + "\n" for i in range(40))
    )
    argv = [
        "prepare",
        "--data",
        str(data),
        "--tokenizer",
        "bytes",
        "--data.format",
        "text",
        "--text_field",
        "prompt",
    ]
    assert cli.main(argv) == 0, capsys.readouterr().err
