"""The ``generation_config.json`` of an export stops where the model's answers end: at every stop token of the base
model's own (instruct models list their end-of-turn token beside end-of-text: ``[128001, 128008, 128009]``), and at
the token the chat template closes an answer with (ChatML's ``<|im_end|>`` over a base whose eos is
``<|endoftext|>``: what SFT on that template teaches the model to end with). An export that kept only the
tokenizer's eos generated past the end of every answer in transformers."""

from __future__ import annotations

import json

import pytest
from hf_helpers import make_tokenizer

from gptoughts import api
from gptoughts.data.sft import DEFAULT_CHAT_TEMPLATE, turn_end_id

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("kind", ["llama", "gpt_neox"])  # a native family's export, and the generic path's
def test_export_keeps_the_base_stop_tokens(kind, hf_model, tmp_path, ft_cache):
    base = hf_model(kind, chat_template=None)
    gen = json.loads((base / "generation_config.json").read_text())
    gen.update(eos_token_id=[260, 0], temperature=0.6)  # <|im_end|>, then the tokenizer's eos
    (base / "generation_config.json").write_text(json.dumps(gen))
    out = api.export(base, tmp_path / "out")
    exported = transformers.GenerationConfig.from_pretrained(str(out))
    assert exported.eos_token_id == [260, 0]
    assert exported.temperature == 0.6  # the base's other defaults survive too


def test_export_stops_where_the_chat_template_ends_an_answer(hf_model, tmp_path, ft_cache):
    base = hf_model("llama")  # ChatML template; eos <|endoftext|> (0); its generation_config lists 0 only
    assert json.loads((base / "generation_config.json").read_text())["eos_token_id"] == 0
    out = api.export(base, tmp_path / "out")
    assert transformers.GenerationConfig.from_pretrained(str(out)).eos_token_id == [0, 260]


def test_turn_end_of_templates():
    im_end = make_tokenizer().token_to_id("<|im_end|>")
    assert turn_end_id(make_tokenizer()) == im_end
    assert (
        turn_end_id(make_tokenizer(chat_template=None)) is None
    )  # the default template ends answers with eos
    assert turn_end_id(make_tokenizer(chat_template=DEFAULT_CHAT_TEMPLATE)) is None
    plain = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    assert turn_end_id(make_tokenizer(chat_template=plain)) is None  # ends with text, no special token
    # a template that never renders the answer: no token follows it (the search once read unrelated text)
    asks = "{% for m in messages %}{% if m['role'] == 'user' %}Q: {{ m['content'] }}   <|im_start|>{% endif %}{% endfor %}"
    assert turn_end_id(make_tokenizer(chat_template=asks)) is None
