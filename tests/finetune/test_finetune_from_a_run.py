"""A gptoughts run as a fine-tune's model (`gptoughts finetune --model runs/sft --objective dpo ...`): the run's newest
checkpoint is exported as `gptoughts export RUN` writes it (LoRA merged, with its tokenizer and chat template) into the
new run's `base/` folder, which the new run starts from, resumes over and exports over whatever the source run does
next; the plan names the run and step. A run with no checkpoint, or of a family without export, is refused first."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from cli_helpers import QUIET_CPU, ok, refused_leaving
from hf_helpers import sft_rows, transformers
from test_dpo import prefs_file

from gptoughts import api, models
from gptoughts.errors import UserError
from gptoughts.models.hf_export import export_config, run_config

FT = [*QUIET_CPU, "--block_size", "48", "--batch_size", "4", "--warmup_steps", "1", "--save_interval", "0",
      "--eval_interval", "0", "--sample_interval", "0", "--data.val_fraction", "0", "--precision", "fp32",
      "--perf.compile", "false"]  # fmt: skip


def _fake_run(folder: Path, family: str = "llama") -> Path:
    """A run folder as training writes it before its first checkpoint: run.json with the family's debug args."""
    args = models.model_args(family, "debug", {})
    folder.mkdir(parents=True)
    (folder / "run.json").write_text(json.dumps({"family": family, "args": dataclasses.asdict(args)}))
    return folder


def test_a_run_without_a_checkpoint_is_no_base(tmp_path):
    run = _fake_run(tmp_path / "sft")
    with pytest.raises(UserError, match="before its first checkpoint"):
        api.run_base(str(run))
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "llama"}')
    assert api.run_base(str(hf)) is None and api.run_base(None) is None  # a model folder: read as it is


def test_a_runs_config_is_the_one_its_export_writes(tmp_path):
    run = _fake_run(tmp_path / "pre")
    args = models.model_args("llama", "debug", {})
    cfg = run_config(run)  # what validating `finetune --model RUN` reads, before anything is exported
    assert cfg == export_config("llama", args)
    assert cfg["model_type"] == "llama" and cfg["max_position_embeddings"] == args.max_seq_len


def test_a_run_of_a_family_without_export_is_refused_as_a_base(tmp_path):
    run = _fake_run(tmp_path / "diffusion", family="llada")
    with pytest.raises(UserError, match="llada family has no transformers export"):
        run_config(run)


@pytest.mark.slow
def test_dpo_from_an_sft_lora_run_resumes_and_exports(hf_model, tmp_path, ft_cache, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    base, sft_data, prefs = (
        hf_model("llama"),
        sft_rows(tmp_path / "sft.jsonl"),
        prefs_file(tmp_path / "p.jsonl", n=32),
    )
    sft = ["finetune", "--model", str(base), "--data", str(sft_data), "--lora", "--out", "sft", *FT]
    ok([*sft, "--max_steps", "3"], capsys)
    dpo = [
        "finetune",
        "--model",
        "sft",
        "--objective",
        "dpo",
        "--data",
        str(prefs),
        "--lora",
        "--out",
        "dpo",
        *FT,
    ]

    text = ok([*dpo, "--max_steps", "2", "--dry_run"], capsys)
    assert re.search(
        r"plan: llama from sft at step 3 \(its export, in a temporary folder for this dry run; a run keeps it in dpo/base\)",
        text,
    ), text[-1500:]
    assert not Path("dpo").exists()  # a dry run writes nothing

    text = ok([*dpo, "--max_steps", "2"], capsys)
    assert re.search(r"plan: llama from sft at step 3 \(its export, in dpo/base\) \+ LoRA", text), text[
        -1500:
    ]
    record = json.loads(Path("dpo/run.json").read_text())
    assert record["init_from"] == str(Path("dpo/base").resolve())
    assert json.loads(Path("dpo/base/gptoughts_source.json").read_text())["step"] == 3
    merged = api.load(
        "sft"
    ).model.merge_and_unload()  # the SFT run's weights, LoRA merged, are the DPO's base
    kept = transformers.AutoModelForCausalLM.from_pretrained("dpo/base", dtype=torch.float32)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(kept(input_ids=ids).logits, merged(ids))

    ok(
        [*sft, "--max_steps", "5", "--resume", "auto"], capsys
    )  # the SFT run trains on: the DPO run keeps its base
    text = ok([*dpo, "--max_steps", "4", "--resume", "auto"], capsys)
    assert "sft at step 3 (its export, kept in dpo/base; sft is at step 5 now) + LoRA" in text, text[-1500:]
    assert max(json.loads(line)["step"] for line in Path("dpo/metrics.jsonl").read_text().splitlines()) == 4

    out = api.export("dpo", tmp_path / "dpo-hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    assert model(input_ids=ids).logits.shape[-1] == model.config.vocab_size
    assert (out / "chat_template.jinja").is_file() or "chat_template" in (
        out / "tokenizer_config.json"
    ).read_text()


@pytest.mark.slow
def test_a_run_trained_from_scratch_is_a_base(tmp_path, ft_cache, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    corpus = tmp_path / "c.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 400)
    ok(["train", "--data", str(corpus), "--size", "debug", "--tokenizer", "bytes", "--max_steps", "2", "--out",
        "pre", *FT], capsys)  # fmt: skip
    text = ok(["finetune", "--model", "pre", "--data", str(sft_rows(tmp_path / "d.jsonl")), "--max_steps", "1",
               "--out", "ft", *FT], capsys)  # fmt: skip
    assert "plan: llama from pre at step 2 (its export, in ft/base)," in text, text[-1500:]
    assert Path("ft/base/config.json").is_file() and Path("ft/checkpoints").is_dir()


@pytest.mark.slow
def test_a_run_before_its_first_checkpoint_is_refused_leaving_everything(
    tmp_path, ft_cache, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    _fake_run(tmp_path / "sft")
    refused_leaving(
        tmp_path,
        ["finetune", "--model", "sft", "--data", str(sft_rows(tmp_path / "d.jsonl")), "--out", "ft", *FT],
        capsys,
        "sft stopped before its first checkpoint",
    )
