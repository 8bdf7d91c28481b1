"""A run fine-tuned from a hub id records the base as its snapshot in the Hugging Face cache. Once that snapshot
is gone (the cache cleaned, offline), what needs the base again says in one line how to get that very revision
back, and writes nothing; what does not need it (sampling a full fine-tune) still works."""

from __future__ import annotations

import json
import shutil

import pytest
from cli_helpers import FASTRUN, ok, refused_leaving
from hf_helpers import put_in_hub_cache, sft_rows

from gptoughts.errors import UserError
from gptoughts.models.hf import read_config, restore_hint

REPO = "tiny-org/tiny-llama"


def test_a_missing_snapshot_names_the_download_of_its_revision(tmp_path):
    commit = "89abcdef" * 5
    gone = tmp_path / "hub" / "models--tiny-org--tiny-llama" / "snapshots" / commit
    with pytest.raises(UserError) as e:
        read_config(gone)
    assert f"`hf download {REPO} --revision {commit}`" in str(e.value) and "\n" not in str(e.value)
    # any other folder: put back where it was
    assert restore_hint(tmp_path / "my-base") == "put the base model folder back at that path"


@pytest.mark.slow
def test_export_and_sample_after_the_base_left_the_cache(hf_model, hub_cache, tmp_path, ft_cache, capsys):
    snapshot = put_in_hub_cache(hub_cache, REPO, hf_model("llama"))
    data = sft_rows(tmp_path / "chat.jsonl")
    full, lora = tmp_path / "full", tmp_path / "lora"
    for run, extra in ((full, []), (lora, ["--lora"])):
        ok(["finetune", "--model", REPO, "--data", str(data), "--out", str(run), "--max_steps", "2", *FASTRUN, *extra],
           capsys)  # fmt: skip
    assert json.loads((full / "run.json").read_text())["init_from"] == str(snapshot)
    shutil.rmtree(hub_cache / "models--tiny-org--tiny-llama")
    fix = f"hf download {REPO} --revision {snapshot.name}"
    sample = ["--prompt", "add 1 2", "--max_new_tokens", "2", "--device", "cpu"]
    ok(["sample", str(full), *sample], capsys)  # a full fine-tune's checkpoint holds the whole model
    # the export reads the base's config and tokenizer files; LoRA adapters need the base's weights
    refused_leaving(tmp_path, ["export", str(full), "--format", "hf", str(tmp_path / "out")], capsys, fix)
    refused_leaving(tmp_path, ["export", str(lora), "--format", "hf", str(tmp_path / "out")], capsys, fix)
    refused_leaving(tmp_path, ["sample", str(lora), *sample], capsys, fix)
