"""The export of a model of an architecture without native code (the generic transformers path) ships the base's
own tokenizer files, as a native family's export does: transformers loads the folder's tokenizer with the base's
settings and chat template, and its model."""

from __future__ import annotations

import json

import pytest
import torch
from hf_helpers import CHATML

from gptoughts import api

transformers = pytest.importorskip("transformers")


def test_generic_export_keeps_the_base_tokenizer_files_and_chat_template(hf_model, tmp_path, ft_cache):
    base = hf_model("gpt_neox", chat_template=None)
    # As a hub folder often is: the template and the tokenizer's own settings inside tokenizer_config.json.
    cfg = json.loads((base / "tokenizer_config.json").read_text())
    cfg.update(chat_template=CHATML, model_max_length=256, clean_up_tokenization_spaces=True)
    (base / "tokenizer_config.json").write_text(json.dumps(cfg))
    out = api.export(base, tmp_path / "out")

    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    want = transformers.AutoTokenizer.from_pretrained(str(base))
    assert tok.model_max_length == want.model_max_length == 256
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    rendered = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered == want.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert model.config.model_type == "gpt_neox"
