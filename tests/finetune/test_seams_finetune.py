"""Fine-tuning, exports and families at their seams: the defaults follow the model and the method, a Hugging Face
hub id loads from the Hugging Face cache, exports keep the chat template, and `--model mistral|qwen2|qwen3`
trains those architectures from scratch and exports them to their transformers classes."""

from __future__ import annotations

import json
from collections.abc import Mapping

import pytest
import torch
from cli_helpers import FASTRUN, QUIET_CPU, ok, run_cli
from hf_helpers import CHATML, FT_FAST, hf_logits, make_tokenizer, put_in_hub_cache, sft_rows, transformers

from gptoughts import api, models
from gptoughts.config import load_config
from gptoughts.errors import UserError

# The same settings as the other fine-tuning tests, without a block size (the default is under test here).
FT = {
    **{k: v for k, v in FT_FAST.items() if k != "train.block_size"},
    "train.sample_prompts": [],
    "data.val_fraction": 0.0,
    "perf.threads": 1,
}


def _error_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in text, text[-2000:]
    return lines[0]


# ------------------------------------------------------------------- defaults that follow the model and method


def test_finetune_defaults_follow_a_short_model_and_lora(hf_model, tmp_path, ft_cache, capsys):
    """The finetune defaults on a model of 64 positions: the block is the model's 64 (not 1024), LoRA trains at
    its own 2e-4 (no hint to raise it), and the plan says both."""
    base = hf_model("llama", max_position_embeddings=64)
    _, _, hist = api.finetune(
        model_path=str(base),
        data_path=str(sft_rows(tmp_path / "d.jsonl")),
        lora=True,
        save_dir=str(tmp_path / "run"),
        **FT,
        **{"train.max_steps": 2},
    )
    out = capsys.readouterr().out
    assert hist.steps == 2 and hist.plan["block_size"] == 64
    assert "block 64 (the model's 64 positions; finetune's default is 1,024)" in out
    assert "peak lr 2.0e-04 (LoRA's default; full fine-tuning's is 2e-05)" in out
    assert "LoRA usually wants a larger learning rate" not in out
    saved = (tmp_path / "run" / "config.toml").read_text()
    assert "block_size = 64" in saved and "learning_rate = 0.0002" in saved  # a resume keeps them


def test_finetune_defaults_and_what_the_user_sets(hf_model, tmp_path, capsys):
    long_model = hf_model("llama", name="long", max_position_embeddings=4096)
    short_model = hf_model("llama", name="short", max_position_embeddings=64)
    full = load_config("finetune", {"model.init_from": str(long_model)})
    assert full.train.block_size == 1024 and full.train.learning_rate == 2e-5
    assert "finetune's default" in full.resolved["block_size"]
    lora = load_config("finetune", {"model.init_from": str(short_model), "lora.enabled": True})
    assert lora.train.block_size == 64 and lora.train.learning_rate == 2e-4
    asked = load_config(
        "finetune",
        {
            "model.init_from": str(short_model),
            "lora.enabled": True,
            "train.learning_rate": "5e-5",
            "train.block_size": "32",
        },
    )
    assert asked.train.learning_rate == 5e-5 and asked.train.block_size == 32 and not asked.resolved
    # a block the user asks for over the model's positions stays a one-line error, before anything is written
    run = tmp_path / "run"
    code, text = run_cli(
        ["finetune", "--model", str(short_model), "--data", str(sft_rows(tmp_path / "d.jsonl")),
         "--out", str(run), "--block_size", "128", *QUIET_CPU],
        capsys,
    )  # fmt: skip
    assert code == 2 and "--block_size 128 exceeds the 64 positions" in _error_line(text)
    assert not run.exists()


# ------------------------------------------------------------------------------------ Hugging Face hub ids


def test_finetune_a_hub_id_from_the_hugging_face_cache_offline(
    hf_model, hub_cache, tmp_path, ft_cache, capsys
):
    snapshot = put_in_hub_cache(hub_cache, "tiny-org/tiny-llama", hf_model("llama"))
    run = tmp_path / "run"
    # --model_name: the spelling of the user's own first command (`run_train.py --model_name huggyllama/llama-7b`)
    text = ok(
        ["finetune", "--model_name", "tiny-org/tiny-llama", "--data", str(sft_rows(tmp_path / "d.jsonl")),
         "--out", str(run), "--max_steps", "2", *FASTRUN],
        capsys,
    )  # fmt: skip
    assert "llama from tiny-org/tiny-llama" in text
    info = json.loads((run / "run.json").read_text())
    assert info["init_from"] == str(snapshot) and info["plan"]["batch"]["total_steps"] == 2
    assert api.load(run).model is not None
    # in a config file too, ORG/NAME stays a hub id (relative paths of a file are relative to the file)
    toml = tmp_path / "ft.toml"
    toml.write_text('base = "finetune"\n[model]\ninit_from = "tiny-org/tiny-llama"\n')
    assert load_config(str(toml)).model.init_from == "tiny-org/tiny-llama"


def test_a_hub_id_not_in_the_cache_offline_is_one_line(hub_cache, tmp_path, capsys):
    run = tmp_path / "run"
    code, text = run_cli(
        ["finetune", "--model", "tiny-org/absent", "--data", str(sft_rows(tmp_path / "d.jsonl")),
         "--out", str(run), *FASTRUN],
        capsys,
    )  # fmt: skip
    line = _error_line(text)
    assert code == 2 and "tiny-org/absent" in line and "hf download tiny-org/absent" in line
    assert "local folder" in line and not run.exists()


# ------------------------------------------------------------------------------------------------- exports


@pytest.mark.parametrize("template", [None, CHATML], ids=["no-template", "chatml"])
def test_export_keeps_the_chat_template_fine_tuning_used(template, hf_model, tmp_path, ft_cache):
    from gptoughts.data.sft import encode_conversations, render_prompt

    base = hf_model("llama", chat_template=template)
    run = tmp_path / "run"
    api.finetune(
        model_path=str(base),
        data_path=str(sft_rows(tmp_path / "d.jsonl")),
        save_dir=str(run),
        **FT,
        **{"train.max_steps": 1, "train.block_size": 64},
    )
    out = tmp_path / "hf"
    api.export(run, out)
    exported = transformers.AutoTokenizer.from_pretrained(str(out))
    trained = api.load(run).tokenizer  # what fine-tuning rendered its examples with
    conversation = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "add 1 2"},
        {"role": "assistant", "content": "3"},
    ]

    def ids(x) -> list[int]:
        return list(x["input_ids"] if isinstance(x, Mapping) else x)

    assert ids(exported.apply_chat_template(conversation, tokenize=True)) == list(
        encode_conversations([conversation], trained)[0][0]
    )
    prompt = conversation[:2]
    assert ids(exported.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True)) == list(
        render_prompt(trained, prompt)
    )


def test_export_refusal_lists_the_families_that_export(tmp_path):
    from gptoughts.models.hf_export import save_hf

    exporting = [name for name, fam in models.FAMILIES.items() if fam.hf is not None]
    assert {"llama", "gpt2", "deepseek"} <= set(exporting)
    for family in ("llada", "inl"):
        args = models.model_args(family, "debug")
        model = models.build_model(family, args, device="cpu")
        with pytest.raises(UserError) as e:
            save_hf(model, family, args, make_tokenizer(), tmp_path / "out")
        listed = str(e.value).split("export:", 1)[1]
        assert all(name in listed for name in exporting), str(e.value)
        assert "llada" not in listed and "inl" not in listed, str(e.value)
        assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------- mistral, qwen2, qwen3 from scratch


@pytest.mark.parametrize(
    "name, hf_class",
    [("mistral", "MistralForCausalLM"), ("qwen2", "Qwen2ForCausalLM"), ("qwen3", "Qwen3ForCausalLM")],
)
def test_train_mistral_qwen2_qwen3_from_scratch_and_export_to_their_class(
    name, hf_class, tmp_path, cache_dir, capsys
):
    corpus = tmp_path / "c.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 200)
    run, out = tmp_path / "run", tmp_path / "hf"
    text = ok(
        ["train", "--model", name, "--size", "debug", "--data", str(corpus), "--tokenizer", "bytes",
         "--out", str(run), "--max_steps", "2", *FASTRUN],
        capsys,
    )  # fmt: skip
    assert f"{name} layout (exports as {hf_class})" in text  # the plan names what --model asked for
    ok(["export", str(run), "--format", "hf", str(out)], capsys)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert type(hf).__name__ == hf_class
    ids = torch.randint(0, 259, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = api.load(run).model(ids)
    assert (ours - hf_logits(out, ids)).abs().max().item() <= 1e-4


def test_family_names_of_transformers_architectures_are_accepted_where_families_are():
    cfg = load_config(None, {"model.family": "qwen2", "model.size": "125m", "data.sources": ["x"]})
    assert cfg.model.family == "llama" and cfg.model.overrides["qkv_bias"] is True
    assert cfg.train.block_size == 2048  # the llama size's training defaults, as --model llama --size 125m
    assert cfg.run.out == "runs/qwen2-125m"
    assert models.model_args("qwen3", "debug").qk_norm and "125m" in models.list_sizes("mistral")
    with pytest.raises(UserError, match="did you mean `qwen[23]`"):
        models.get_family("qwen")
