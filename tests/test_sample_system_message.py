"""A system message for a chat prompt: ``gptoughts sample RUN --system TEXT`` and ``gptoughts.generate(loaded, PROMPT,
system=TEXT)`` render it before the user's message with the chat template, as SFT data that opens its conversations
with one trained the model; refused in one line where the prompt is plain text."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cli_helpers import run_cli

import gptoughts
from gptoughts import api
from gptoughts.config import load_config
from gptoughts.data.sft import render_prompt
from gptoughts.data.tokenizer import EOS_TOKEN, MASK_TOKEN, PAD_TOKEN, Tokenizer, _bytes_backend
from gptoughts.errors import UserError
from gptoughts.models import build_model, model_args

# Gemma's way of refusing a system turn
NO_SYSTEM = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _loaded(chat: bool, template: str | None = None) -> api.Loaded:
    torch.manual_seed(0)
    model = build_model("llama", model_args("llama", "debug", {"max_seq_len": 128}), device="cpu")
    backend = _bytes_backend()
    backend.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok = Tokenizer(
        backend,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        mask_token=MASK_TOKEN,
        chat_template=template,
        spec="t",
    )
    return api.Loaded(model, tok, load_config("default"), Path("run"), "llama", chat=chat, args=model.args)


def test_generate_renders_the_system_message_before_the_prompt(sampled_ids):
    loaded = _loaded(chat=True)
    gptoughts.generate(loaded, "add 2 3", system="You are a calculator.", max_new_tokens=4)
    gptoughts.generate(loaded, "add 2 3", max_new_tokens=4)
    system = [{"role": "system", "content": "You are a calculator."}]
    user = [{"role": "user", "content": "add 2 3"}]
    assert sampled_ids == [
        render_prompt(loaded.tokenizer, system + user),
        render_prompt(loaded.tokenizer, user),
    ]
    assert "<|system|>\nYou are a calculator.\n<|user|>\nadd 2 3" in loaded.tokenizer.decode(sampled_ids[0])


def test_a_system_message_for_plain_text_is_refused_in_one_line(sampled_ids):
    with pytest.raises(
        UserError, match="system is a turn of a chat prompt and this model samples plain text"
    ):
        gptoughts.generate(_loaded(chat=False), "add 2 3", system="Be brief.")
    with pytest.raises(UserError, match="chat=False samples plain text"):
        gptoughts.generate(_loaded(chat=True), "add 2 3", system="Be brief.", chat=False)
    with pytest.raises(UserError, match="system must be a string"):
        gptoughts.generate(_loaded(chat=True), "add 2 3", system=["Be brief."])
    assert sampled_ids == []


def test_a_template_that_refuses_a_system_turn_is_one_line(sampled_ids):
    loaded = _loaded(chat=True, template=NO_SYSTEM)
    with pytest.raises(UserError, match=r"refuses a system message \(System role not supported\)"):
        gptoughts.generate(loaded, "add 2 3", system="Be brief.")
    gptoughts.generate(loaded, "add 2 3", max_new_tokens=4)  # without one, as before
    assert len(sampled_ids) == 1


def test_sample_system_reaches_the_prompt_and_its_length_is_counted(monkeypatch, sampled_ids, capsys):
    loaded = _loaded(chat=True)
    monkeypatch.setattr(api, "load", lambda *a, **k: loaded)
    monkeypatch.setattr(api, "check_model_path", lambda p: p)
    argv = ["sample", "run", "--prompt", "hi", "--system", "Be brief.", "--max_new_tokens", "2"]
    code, text = run_cli(argv, capsys)
    assert code == 0, text
    assert loaded.tokenizer.decode(sampled_ids[0]).endswith(
        "<|system|>\nBe brief.\n<|user|>\nhi\n<|assistant|>\n"
    )
    # the most new tokens that fit beside the prompt with its system message (the last one is not fed back)
    most = loaded.args.max_seq_len - len(sampled_ids[0]) + 1
    argv = ["sample", "run", "--prompt", "hi", "--system", "Be brief.", "--max_new_tokens", str(most + 1)]
    code, text = run_cli(argv, capsys)
    assert code == 2 and f"pass --max_new_tokens {most} or less" in text, text


def test_sample_system_with_chat_off_is_refused_before_the_model_loads(monkeypatch, capsys):
    monkeypatch.setattr(api, "load", lambda *a, **k: pytest.fail("loaded the model"))
    code, text = run_cli(["sample", "run", "--system", "Be brief.", "--chat", "off"], capsys)
    assert (
        code == 2 and "error: --system is a turn of a chat prompt and --chat off samples plain text" in text
    )
    assert "Traceback" not in text


@pytest.mark.parametrize(
    ("trained", "flags", "note"),
    [
        (
            "You are a calculator.",
            [],
            "opens with the system message 'You are a calculator.'; pass it with --system",
        ),
        (True, [], "opens with a system message; pass one with --system"),
        ("You are a calculator.", ["--system", "You are a calculator."], None),
        ("You are a calculator.", ["--chat", "off"], None),
        (None, [], None),
    ],
)
def test_sample_notes_the_system_message_every_training_conversation_opened_with(
    trained, flags, note, monkeypatch, sampled_ids, capsys
):
    loaded = _loaded(chat=True)
    loaded.trained_system = trained  # (run.json's sft_system)
    monkeypatch.setattr(api, "load", lambda *a, **k: loaded)
    monkeypatch.setattr(api, "check_model_path", lambda p: p)
    assert gptoughts.cli.main(["sample", "run", "--prompt", "add 2 3", "--max_new_tokens", "2", *flags]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
    assert notes == ([] if note is None else [notes[0]]) and (note is None or note in notes[0]), notes
