"""The token ids of an export's ``config.json``: the tokenizer's where it has the token, the base model's where it
has none. A Qwen-style base declares ``bos_token_id`` in its config while its tokenizer has no bos token; the export
wrote ``bos_token_id: null`` over the base's id, which transformers then used (no bos for generation's defaults)."""

from __future__ import annotations

import json

import pytest

from gptoughts import api

pytest.importorskip("transformers")


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_export_keeps_the_base_token_ids_the_tokenizer_has_not(kind, hf_model, tmp_path, ft_cache):
    base = hf_model(kind, bos_token_id=2)  # the test tokenizer has eos (0) and pad (1) but no bos
    assert json.loads((base / "config.json").read_text())["bos_token_id"] == 2
    out = api.export(base, tmp_path / "out")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["bos_token_id"] == 2
    assert (cfg["eos_token_id"], cfg["pad_token_id"]) == (0, 1)  # the tokenizer's, where it has them


def test_export_takes_the_tokenizer_ids_over_the_base(hf_model, tmp_path, ft_cache):
    base = hf_model(
        "llama", eos_token_id=5, pad_token_id=6
    )  # ids the tokenizer (eos 0, pad 1) disagrees with
    cfg = json.loads((api.export(base, tmp_path / "out") / "config.json").read_text())
    assert (cfg["eos_token_id"], cfg["pad_token_id"]) == (0, 1)
