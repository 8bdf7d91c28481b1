"""TRL's record shapes, which Hugging Face data sets are published in, read as our own: ``{"prompt", "completion"}``
as SFT (it was taken for plain text and refused for its missing "text" field), prompts and completions given as
lists of messages, and conversational preference pairs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gptoughts.data.prefs import read_pairs
from gptoughts.data.sft import read_conversations, resolve_format
from gptoughts.errors import DataError


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_prompt_completion_records_are_chat_examples(tmp_path):
    ours = _jsonl(tmp_path / "a.jsonl", [{"prompt": "add 1 2", "response": "3", "system": "be brief"}])
    trl = _jsonl(tmp_path / "b.jsonl", [{"prompt": "add 1 2", "completion": "3", "system": "be brief"}])
    listed = _jsonl(
        tmp_path / "c.jsonl",
        [
            {
                "prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "add 1 2"}],
                "completion": [{"role": "assistant", "content": "3"}],
            }
        ],
    )
    assert [resolve_format("auto", [f]) for f in (trl, listed)] == ["sft", "sft"]
    expected = read_conversations([ours])
    assert expected[0][-1] == {"role": "assistant", "content": "3"}
    assert read_conversations([trl]) == expected
    assert read_conversations([listed]) == expected


def test_a_bad_prompt_or_completion_names_the_line_and_field(tmp_path):
    bad = _jsonl(tmp_path / "d.jsonl", [{"prompt": "x", "completion": [{"role": "assistant"}]}])
    with pytest.raises(DataError, match=r'd.jsonl:1: completion\[0\] needs string "role" and "content"'):
        read_conversations([bad])
    bad = _jsonl(tmp_path / "e.jsonl", [{"prompt": 3, "completion": "x"}])
    with pytest.raises(
        DataError, match='e.jsonl:1: "prompt" must be a string or a list of messages, not int'
    ):
        read_conversations([bad])


def test_conversational_preference_pairs_read_as_plain_ones(tmp_path):
    plain = _jsonl(tmp_path / "p.jsonl", [{"prompt": "add 1 2", "chosen": "3", "rejected": "4"}])
    conv = _jsonl(
        tmp_path / "q.jsonl",
        [
            {
                "prompt": [{"role": "user", "content": "add 1 2"}],
                "chosen": [{"role": "assistant", "content": "3"}],
                "rejected": [{"role": "assistant", "content": "4"}],
            }
        ],
    )
    assert read_pairs([conv]) == read_pairs([plain]) == [([{"role": "user", "content": "add 1 2"}], "3", "4")]


def test_pairs_whose_completions_hold_the_whole_conversation(tmp_path):
    """ultrafeedback_binarized's shape: a prompt string, and each completion the conversation with its answer."""

    def conv(answer: str) -> list[dict]:
        return [{"role": "user", "content": "add 1 2"}, {"role": "assistant", "content": answer}]

    f = _jsonl(tmp_path / "u.jsonl", [{"prompt": "add 1 2", "chosen": conv("3"), "rejected": conv("4")}])
    assert read_pairs([f]) == [([{"role": "user", "content": "add 1 2"}], "3", "4")]
    other = [{"role": "user", "content": "add 2 2"}, {"role": "assistant", "content": "4"}]
    bad = _jsonl(tmp_path / "v.jsonl", [{"chosen": conv("3"), "rejected": other}])
    with pytest.raises(
        DataError, match='v.jsonl:1: "chosen" and "rejected" differ before their last message'
    ):
        read_pairs([bad])
