"""`gptoughts finetune --resume auto` resumes its own run: with the same --model given as the relative path it was
started with (config.toml holds it absolute), and with the model flags left out (the run's config.toml names it)."""

from __future__ import annotations

import json

from cli_helpers import QUIET_CPU, ok, refused
from hf_helpers import sft_rows

FAST = [*QUIET_CPU, "--block_size", "32", "--batch_size", "4", "--grad_accum", "1", "--warmup_steps", "2",
        "--log_interval", "1", "--eval_interval", "0", "--sample_interval", "0", "--precision", "fp32",
        "--compile", "false", "--val_fraction", "0"]  # fmt: skip


def _steps(run) -> list[int]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return sorted(r["step"] for r in rows if "loss" in r)


def test_finetune_resume_auto_with_a_relative_model_or_none(
    hf_model, tmp_path, ft_cache, monkeypatch, capsys
):
    hf_model("llama", name="exported_a")
    sft_rows(tmp_path / "chat.jsonl")
    monkeypatch.chdir(tmp_path)
    first = ["finetune", "--model", "exported_a", "--data", "chat.jsonl", "--lora", "--out", "runs/ft", *FAST]
    ok([*first, "--max_steps", "2", "--save_interval", "2"], capsys)
    saved = (tmp_path / "runs/ft/config.toml").read_text()
    assert f'init_from = "{tmp_path / "exported_a"}"' in saved  # stored absolute: resumes from any folder

    # the same command (relative --model) with --resume auto: the same base model, resumed at step 2
    text = ok([*first, "--max_steps", "4", "--save_interval", "2", "--resume", "auto"], capsys)
    assert "holds a fine-tune of" not in text
    assert _steps(tmp_path / "runs/ft") == [1, 2, 3, 4]

    # the model flags left out: the run's config.toml names its base model and LoRA, as `train --resume auto`
    ok(["finetune", "--resume", "auto", "--out", "runs/ft", "--max_steps", "6", *QUIET_CPU], capsys)
    assert _steps(tmp_path / "runs/ft") == [1, 2, 3, 4, 5, 6]

    # another base model is still refused, by name
    hf_model("llama", name="exported_b")
    refused(
        ["finetune", "--model", "exported_b", "--lora", "--resume", "auto", "--out", "runs/ft", *QUIET_CPU],
        capsys,
        "holds a fine-tune of",
        "exported_a",
    )


def test_finetune_resume_auto_without_a_run_or_of_a_pretraining_run(
    tmp_path, monkeypatch, capsys, text_corpus
):
    monkeypatch.chdir(tmp_path)
    # no run there: the refusal of --resume auto, not "finetune needs a pretrained model"
    refused(["finetune", "--resume", "auto", "--out", "runs/none", *QUIET_CPU], capsys, "nothing to resume")
    # a run trained from scratch: not a fine-tune; its own command resumes it
    ok(["train", "--data", str(text_corpus), "--size", "debug", "--tokenizer", "bytes", "--out", "runs/pre",
        "--max_steps", "1", "--block_size", "32", "--batch_size", "2", "--sample_prompts", "[]", *QUIET_CPU],
       capsys)  # fmt: skip
    refused(
        ["finetune", "--resume", "auto", "--out", "runs/pre", *QUIET_CPU],
        capsys,
        "trained from scratch",
        "gptoughts train --resume auto --out runs/pre",
    )


def test_same_base_model_resolves_paths_and_keeps_hub_ids(tmp_path, monkeypatch):
    from gptoughts.training.rundir import same_base_model

    (tmp_path / "m").mkdir()
    monkeypatch.chdir(tmp_path)
    assert same_base_model(str(tmp_path / "m"), "m")
    assert same_base_model("./m/", str(tmp_path / "m"))
    assert not same_base_model("m", str(tmp_path / "other"))
    assert same_base_model("org/name", "org/name")
    assert not same_base_model("org/name", "org/other")
    assert same_base_model(None, None) and not same_base_model(None, "m")


def test_a_resume_whose_base_folder_is_gone_says_to_put_it_back(hf_model, tmp_path, ft_cache, capsys):
    """The base folder moved away: the resume said "is not a folder; pass a local Hugging Face model folder", advice
    a resume refuses (another --model is another base)."""
    import shutil

    from cli_helpers import QUIET_CPU, run_cli
    from hf_helpers import sft_rows

    base, data, out = hf_model("llama"), sft_rows(tmp_path / "d.jsonl", 8), tmp_path / "ft"
    cmd = ["finetune", "--model", str(base), "--data", str(data), "--lora", "--max_steps", "1", "--block_size", "32",
           "--batch_size", "2", "--out", str(out), *QUIET_CPU]  # fmt: skip
    assert run_cli(cmd, capsys)[0] == 0
    shutil.move(base, tmp_path / "moved")
    code, text = run_cli(
        ["finetune", "--resume", "auto", "--out", str(out), "--max_steps", "2", *QUIET_CPU], capsys
    )
    assert (
        code == 2 and f"fine-tuned from {base}, which is missing; put the base model folder back" in text
    ), text
