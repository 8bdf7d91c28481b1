"""A base model whose tokenizer is a class of its own (``auto_map`` in tokenizer_config.json, Python beside it):
``--trust_remote_code`` reaches every load of that tokenizer (fine-tuning, resuming, the export and what loads
the export), and without it the refusal is one line naming the flag."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from cli_helpers import FASTRUN, ok, refused_leaving
from hf_helpers import make_tokenizer, sft_rows

from gptoughts.data.tokenizer import Tokenizer, build_tokenizer
from gptoughts.errors import ConfigError
from gptoughts.models.hf import load_tokenizer
from gptoughts.models.hf_export import copy_tokenizer_files

CLASS = "CustomTokenizerFast"


def own_tokenizer_class(folder: Path) -> Path:
    """Make the tokenizer of ``folder`` a class of the folder's own, as a model on the hub with custom code has."""
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = CLASS
    config["auto_map"] = {"AutoTokenizer": [None, f"tokenization_custom.{CLASS}"]}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "tokenization_custom.py").write_text(
        f"from transformers import PreTrainedTokenizerFast\n\n\nclass {CLASS}(PreTrainedTokenizerFast):\n    pass\n"
    )
    return folder


@pytest.fixture(autouse=True)
def _own_modules_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers copies a folder's own code into its modules cache (under ~/.cache, read once at import) and
    puts that on sys.path: both kept to this test."""
    from transformers import dynamic_module_utils

    monkeypatch.setattr(dynamic_module_utils, "HF_MODULES_CACHE", str(tmp_path / "hf-modules"))
    monkeypatch.setattr(sys, "path", list(sys.path))


def test_the_tokenizer_class_of_a_folder_runs_only_when_trusted(tmp_path):
    folder = own_tokenizer_class(make_tokenizer().save(tmp_path / "tok"))
    with pytest.raises(ConfigError) as e:
        Tokenizer.load(folder).hf  # noqa: B018 - the property loads
    assert "--trust_remote_code" in str(e.value) and "\n" not in str(e.value)
    trusted = build_tokenizer(str(folder), trust_remote_code=True)
    assert type(trusted.hf).__name__ == CLASS
    # what load_pretrained reads a model folder's tokenizer with (sample, eval and export of an HF folder)
    assert type(load_tokenizer(folder, trust_remote_code=True).hf).__name__ == CLASS
    # the export ships that code beside the tokenizer_config.json that names it
    out = tmp_path / "out"
    out.mkdir()
    copy_tokenizer_files(folder, out)
    assert (out / "tokenization_custom.py").read_text() == (folder / "tokenization_custom.py").read_text()
    assert type(Tokenizer.load(out, trust_remote_code=True).hf).__name__ == CLASS


@pytest.mark.slow
def test_finetune_resume_export_and_sample_with_the_flag(hf_model, tmp_path, ft_cache, capsys):
    base = own_tokenizer_class(hf_model("llama"))
    data = sft_rows(tmp_path / "chat.jsonl")
    run, out = tmp_path / "run", tmp_path / "out"
    train = [
        "finetune",
        "--model",
        str(base),
        "--data",
        str(data),
        "--out",
        str(run),
        "--max_steps",
        "2",
        *FASTRUN,
    ]
    # SFT renders every conversation with the base's chat template, through its own tokenizer class
    refused_leaving(tmp_path, train, capsys, "--trust_remote_code", str(base))
    ok([*train, "--trust_remote_code"], capsys)
    ok(["finetune", "--resume", "auto", "--out", str(run), "--max_steps", "3", *FASTRUN], capsys)
    ok(["export", str(run), "--format", "hf", str(out)], capsys)
    sample = ["sample", str(out), "--prompt", "add 1 2", "--max_new_tokens", "2", "--device", "cpu"]
    refused_leaving(tmp_path, sample, capsys, "--trust_remote_code")
    ok([*sample, "--trust_remote_code"], capsys)


def test_a_base_whose_tokenizer_only_its_code_loads_fine_tunes_on_text_when_trusted(
    hf_model, tmp_path, ft_cache, capsys
):
    base = own_tokenizer_class(hf_model("llama"))
    # no tokenizer.json: the class builds itself from a file of its own name, so only its code loads it
    (base / "tokenizer.json").rename(base / "custom.json")
    (base / "tokenization_custom.py").write_text(
        f"import os\n\nfrom transformers import PreTrainedTokenizerFast\n\n\nclass {CLASS}(PreTrainedTokenizerFast):\n"
        "    def __init__(self, *args, **kwargs):\n"
        '        kwargs["tokenizer_file"] = os.path.join(kwargs["name_or_path"], "custom.json")\n'
        "        super().__init__(*args, **kwargs)\n"
    )
    text = tmp_path / "notes.txt"
    text.write_text("plain text to fine-tune on, line after line.\n" * 200)
    argv = [
        "finetune",
        "--model",
        str(base),
        "--data",
        str(text),
        "--out",
        str(tmp_path / "run"),
        "--dry_run",
    ]
    refused_leaving(tmp_path, argv, capsys, "--trust_remote_code")
    assert "plan:" in ok([*argv, "--trust_remote_code"], capsys)
