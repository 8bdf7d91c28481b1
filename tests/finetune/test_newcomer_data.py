"""Chat and preference files as a newcomer writes them, against a real model's chat template: a template that
refuses a conversation, pairs whose two completions are the same. Each is one line naming the problem (and the
file and line where there is one), or a count in the data's summary, never a traceback or a silent no-op."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hf_helpers import make_tokenizer

from gptoughts.data.prefs import PrefData
from gptoughts.data.sft import SFTData
from gptoughts.errors import DataError

# Gemma-style: no system role, user and assistant turns must alternate (raise_exception, as those templates do).
STRICT = (
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_a_chat_template_that_refuses_a_conversation_is_one_line_naming_it(tmp_path):
    ok = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    system = {"messages": [{"role": "system", "content": "be nice"}, *ok["messages"]]}
    src = _write(tmp_path / "chat.jsonl", [ok, system, ok])
    with pytest.raises(
        DataError, match=r"chat\.jsonl:2: the tokenizer's chat template refuses .*System role"
    ):
        SFTData([str(src)], make_tokenizer(STRICT), block_size=64)
    # The same template takes the conversations it accepts.
    data = SFTData([str(_write(tmp_path / "ok.jsonl", [ok, ok]))], make_tokenizer(STRICT), block_size=64)
    assert data.stats["examples"] == 2

    pairs = [
        {"prompt": "a", "chosen": "b", "rejected": "c"},
        {"system": "s", "prompt": "a", "chosen": "b", "rejected": "c"},
    ]
    with pytest.raises(
        DataError, match=r"prefs\.jsonl:2: the tokenizer's chat template refuses .*System role"
    ):
        PrefData([str(_write(tmp_path / "prefs.jsonl", pairs))], make_tokenizer(STRICT), block_size=64)


def test_pairs_whose_chosen_is_the_rejected_are_dropped_and_counted(tmp_path):
    same = {"prompt": "add 1 2", "chosen": "3", "rejected": "3"}
    real = {"prompt": "add 1 2", "chosen": "3", "rejected": "4"}
    with pytest.raises(DataError, match="10 of 10 have the same chosen and rejected"):
        PrefData([str(_write(tmp_path / "same.jsonl", [same] * 10))], make_tokenizer(), block_size=64)

    data = PrefData(
        [str(_write(tmp_path / "mixed.jsonl", [same] * 3 + [real] * 10))], make_tokenizer(), block_size=64
    )
    assert len(data) == 10 and data.stats["dropped_identical"] == 3
    assert "3 dropped with chosen = rejected" in data.summary()

    # Two completions that differ only beyond the row are the same pair once cut to it.
    long_same = {"prompt": "p", "chosen": "x" * 80 + "A", "rejected": "x" * 80 + "B"}
    data = PrefData([str(_write(tmp_path / "cut.jsonl", [long_same, real]))], make_tokenizer(), block_size=32)
    assert len(data) == 1 and data.stats["dropped_identical"] == 1


def test_an_answer_that_opens_the_conversation_is_trained_without_its_header(tmp_path):
    """A greeting bot's data opens with the assistant: its role header is the prompt's, never a target (as with
    every later answer, and as the default template has it)."""
    from gptoughts.data.sft import IGNORE_INDEX

    greet = {
        "messages": [
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "add 1 2"},
            {"role": "assistant", "content": "3"},
        ]
    }
    tok = make_tokenizer()
    data = SFTData([str(_write(tmp_path / "greet.jsonl", [greet]))], tok, block_size=64)
    targets = [int(t) for t in data.y_tokens if t != IGNORE_INDEX]
    assert tok.decode(targets) == "Hello!<|im_end|>\n3<|im_end|>\n"


def _sentencepiece_like(tmp_path: Path, template: str | None):
    """A Metaspace BPE (Llama-2/Mistral's layout: a word boundary ``▁`` begins the text) with ``<s>``/``</s>``."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from gptoughts.data.tokenizer import Tokenizer

    tk = tokenizers.Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tk.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tk.train_from_iterator(["Hello there", "[INST] hi [/INST] Hello", "three"] * 20, trainer)
    folder = tmp_path / "sp"
    folder.mkdir()
    tk.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "tokenizer_class": "PreTrainedTokenizerFast"}
    if template:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer.load(folder)


def test_a_conversation_is_tokenized_whole_as_its_template_renders_it(tmp_path):
    """SentencePiece-style tokenizers begin every separately tokenized text with a word boundary: the answer must
    be tokenized inside its conversation (``He llo``, what apply_chat_template and the prompt at sampling time
    give), not alone (``▁Hello``), and its targets are the tokens of the answer's text."""
    from gptoughts.data.sft import _render, encode_conversations

    mistral = (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + "
        "' [/INST]' }}{% else %}{{ m['content'] + eos_token }}{% endif %}{% endfor %}"
    )
    tok = _sentencepiece_like(tmp_path, mistral)
    conv = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello there"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "three"},
    ]
    ((ids, tgt),) = encode_conversations([conv], tok)
    assert ids.tolist() == tok.encode(_render(tok, conv, False), special=True)
    assert tok.decode(ids[tgt].tolist()) == "Hello there</s>three</s>"
    # preference pairs are rendered the same way
    pairs = _write(tmp_path / "p.jsonl", [{"prompt": "hi", "chosen": "Hello there", "rejected": "three"}])
    data = PrefData([str(pairs)], tok, block_size=64)
    x, _ = data.rows[0]
    whole = tok.encode(_render(tok, conv[:2], False), special=True)
    assert x.tolist() == whole[:-1]


def test_chat_examples_in_a_json_file_are_chat_examples_not_text(tmp_path):
    """``datasets``' ``to_json`` writes JSON lines to ``.json``, and people write JSON arrays: both are SFT examples
    (or preference pairs), never plain text to continue pretraining on with the loss on every character."""
    from gptoughts.data.prefs import looks_like_prefs, read_pairs
    from gptoughts.data.sft import read_conversations, resolve_format

    rows = [{"messages": [{"role": "user", "content": f"add {i} 1"}, {"role": "assistant", "content": f"{i + 1}"}]}
            for i in range(3)]  # fmt: skip
    lines = _write(tmp_path / "chat.json", rows)
    array = tmp_path / "array.json"
    array.write_text(json.dumps(rows, indent=2))
    for src in (lines, array):
        assert resolve_format("auto", [str(src)]) == "sft"
        assert read_conversations([str(src)]) == [r["messages"] for r in rows]
    pairs = tmp_path / "pairs.json"
    pairs.write_text(json.dumps([{"prompt": "a", "chosen": "b", "rejected": "c"}]))
    assert looks_like_prefs([str(pairs)]) and read_pairs([str(pairs)])[0][1:] == ("b", "c")
    # a bad element is named by its index
    array.write_text(json.dumps([rows[0], {"messages": []}]))
    with pytest.raises(DataError, match=r"array\.json\[1\]: \"messages\" must be a non-empty list"):
        read_conversations([str(array)])
    # a .json file of other records stays text
    other = tmp_path / "config.json"
    other.write_text(json.dumps({"name": "x", "values": [1, 2]}))
    assert resolve_format("auto", [str(other)]) == "text"


def test_targets_do_not_depend_on_trimmed_offsets(tmp_path):
    """GPT-2-style tokenizers trim their offsets (a ByteLevel post-processor): a whitespace token of the prompt
    just before an answer gets offsets of no characters, at the answer's start. It stays the prompt's."""
    import random

    from tokenizers import processors

    from gptoughts.data.sft import encode_conversations
    from gptoughts.data.tokenizer import train_bpe

    rng = random.Random(0)
    words = ["alpha", "beta", "the", "cat", "  ", "\n", " "]
    convs = [
        [
            {"role": "user", "content": " ".join(rng.choices(words, k=6))},
            {"role": "assistant", "content": rng.choice(["", " ", "\n"]) + " ".join(rng.choices(words, k=6))},
        ]
        for _ in range(60)
    ]
    tok = train_bpe((m["content"] for c in convs for m in c), 300)
    tok._chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    plain = encode_conversations(convs, tok)
    tok.backend.post_processor = processors.ByteLevel(trim_offsets=True)
    trimmed = encode_conversations(convs, tok)
    for (ids, tgt), (ids2, tgt2) in zip(plain, trimmed):
        assert ids.tolist() == ids2.tolist() and tgt.tolist() == tgt2.tolist()
