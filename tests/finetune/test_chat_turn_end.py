"""A chat answer ends where the chat template closes it: over a base whose eos is ``<|endoftext|>``, ChatML closes
answers with ``<|im_end|>``, which SFT teaches the model to write. ``gptoughts sample`` ran past it to
max_new_tokens and printed the next turns the model went on to play ("user\\n...") as part of the answer."""

from __future__ import annotations

import torch
from hf_helpers import make_tokenizer

from gptoughts import sampling


def test_a_chat_answer_ends_at_the_templates_end_of_turn(monkeypatch):
    tok = make_tokenizer()
    end = tok.token_to_id("<|im_end|>")
    ends = []

    def generate(model, x, n, *, end_ids=(), **kw):
        ends.append(tuple(end_ids))
        more = tok.encode("4") + [end] + tok.encode("<|im_start|>user\nagain<|im_end|>", special=True)
        return torch.cat([x, torch.tensor([more])], dim=1)

    monkeypatch.setattr(sampling, "generate", generate)
    sampler = sampling.Sampler(torch.nn.Linear(1, 1), tok, chat=True)
    assert sampler("add 1 3") == "4"
    assert ends[0] == (end,)  # generation itself stops there (native and transformers models alike)
    assert sampler("add 1 3", chat=False).endswith("again<|im_end|>")  # plain continuation: no turns to end
