"""``gptoughts eval --data TEXT MODEL`` of a model folder whose tokenizer only its own code loads (no tokenizer.json):
with ``--trust_remote_code`` the text is tokenized by that tokenizer (it was refused, asking for the flag given),
without it the refusal is one line naming the flag."""

from __future__ import annotations

from pathlib import Path

from cli_helpers import ok, refused_leaving
from test_trust_remote_code_tokenizer import CLASS, _own_modules_cache, own_tokenizer_class  # noqa: F401

import gptoughts


def code_only_tokenizer(folder: Path) -> Path:
    """``folder``'s tokenizer as a class that builds itself from a file of its own name: only its code loads it."""
    own_tokenizer_class(folder)
    (folder / "tokenizer.json").rename(folder / "custom.json")
    (folder / "tokenization_custom.py").write_text(
        f"import os\n\nfrom transformers import PreTrainedTokenizerFast\n\n\nclass {CLASS}(PreTrainedTokenizerFast):\n"
        "    def __init__(self, *args, **kwargs):\n"
        '        kwargs["tokenizer_file"] = os.path.join(kwargs["name_or_path"], "custom.json")\n'
        "        super().__init__(*args, **kwargs)\n"
    )
    return folder


def test_eval_of_a_model_whose_tokenizer_runs_its_code(hf_model, tmp_path, ft_cache, capsys):
    model = code_only_tokenizer(hf_model("llama"))
    text = tmp_path / "notes.txt"
    text.write_text("plain text to score, line after line.\n" * 40)
    argv = ["eval", str(model), "--data", str(text), "--block_size", "32", "--device", "cpu", "--json"]
    refused_leaving(tmp_path, argv, capsys, "--trust_remote_code")
    printed = ok([*argv, "--trust_remote_code"], capsys)
    loaded = gptoughts.load(model, device="cpu", trust_remote_code=True)
    res = gptoughts.evaluate(loaded, text, block_size=32)
    assert f'"loss": {res["loss"]}' in printed and res["tokens"] > 0
    # the corpus tokenized by the model's own tokenizer (one document, then its end)
    assert res["corpus_tokens"] == len(loaded.tokenizer.encode(text.read_text())) + 1
