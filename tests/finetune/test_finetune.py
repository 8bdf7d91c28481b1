"""Fine-tuning end to end on CPU: LoRA and full, SFT masks and packing, resume, export, sample, generic path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_helpers import hf_logits, sft_rows, transformers
from hf_helpers import losses as run_losses
from safetensors.torch import load_file

from gptoughts import api, cli
from gptoughts.cli import options as cli_options
from gptoughts.cli import train as cli_train
from gptoughts.config import load_config
from gptoughts.errors import ConfigError, HardwareError, UserError
from gptoughts.training.trainer import Trainer


def _o(fast: dict, **kw) -> dict:
    o = dict(fast)
    o.update({"train.block_size": 64, "train.sample_prompts": [], "data.val_fraction": 0.0})
    o.update(kw)
    return o


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "qwen3"])
def test_lora_finetune_then_export_matches_transformers(kind, hf_model, tmp_path, ft_fast, ft_cache):
    base = hf_model(kind, **({"sliding_window": 16} if kind == "mistral" else {}))
    run = tmp_path / "run"
    api.finetune(
        model_path=str(base),
        data_path=str(sft_rows(tmp_path / "d.jsonl")),
        lora=True,
        save_dir=str(run),
        **_o(ft_fast, **{"train.max_steps": 30, "train.learning_rate": 1e-2}),
    )
    losses = run_losses(run)
    first, last = sum(losses[s] for s in range(1, 6)) / 5, sum(losses[s] for s in range(26, 31)) / 5
    assert last < 0.8 * first, (first, last)
    # the checkpoint holds the adapters only: the base is reloaded from model.init_from
    weights = load_file(str(run / "checkpoints" / "step_000030" / "model.safetensors"))
    assert weights and all(".lora_A." in k or ".lora_B." in k for k in weights)

    out = tmp_path / "out"
    api.export(run, out)
    merged = api.load(run).model.merge_and_unload()
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = merged(ids)
    assert (ours - hf_logits(out, ids)).abs().max().item() <= 1e-4
    assert (ours - hf_logits(base, ids)).abs().max().item() > 1e-3  # the adapters did change the model
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == kind and cfg["torch_dtype"] == "float32"
    stops = json.loads((out / "generation_config.json").read_text())["eos_token_id"]
    assert stops == [0, 260]  # eos, and <|im_end|> that closes the template's answers
    assert (out / "tokenizer_config.json").read_bytes() == (base / "tokenizer_config.json").read_bytes()
    assert isinstance(api.generate_text(api.load(run), "add 1 2", max_new_tokens=3, temperature=0), str)


@pytest.mark.slow
def test_lora_resume_matches_uninterrupted_run(hf_model, tmp_path, ft_fast, ft_cache, monkeypatch):
    base, data = hf_model("llama"), sft_rows(tmp_path / "d.jsonl")
    o = _o(ft_fast, **{"train.max_steps": 12, "train.learning_rate": 1e-2, "lora.dropout": 0.1})

    def go(out: Path, **kw) -> None:
        api.finetune(model_path=str(base), data_path=str(data), lora=True, save_dir=str(out), **o, **kw)

    go(tmp_path / "a")
    original = Trainer.train_step

    def stop_at_6(self):  # a SIGTERM during step 6: the trainer saves and stops
        out = original(self)
        if self.state.step + 1 == 6:
            self.stop_requested = True
        return out

    monkeypatch.setattr(Trainer, "train_step", stop_at_6)
    go(tmp_path / "b")
    monkeypatch.setattr(Trainer, "train_step", original)
    assert sorted(run_losses(tmp_path / "b")) == list(range(1, 7))
    go(tmp_path / "b", **{"run.resume": "auto"})
    full, resumed = run_losses(tmp_path / "a"), run_losses(tmp_path / "b")
    assert sorted(resumed) == list(range(1, 13))
    for step in range(1, 13):
        assert resumed[step] == pytest.approx(full[step], rel=1e-5, abs=1e-6), step


def test_packed_document_logits_equal_its_logits_alone(hf_model, tmp_path):
    from gptoughts.data.sft import SFTData, SFTLoader
    from gptoughts.models.hf import load_pretrained

    pre = load_pretrained(hf_model("qwen3"))
    data = SFTData([str(sft_rows(tmp_path / "d.jsonl"))], pre.tokenizer, block_size=96)
    x, y, pos, doc = next(SFTLoader(data, batch_size=2, seed=0))
    assert int(doc[0].max()) >= 2  # at least two examples (plus padding) in the row
    with torch.no_grad():
        packed = pre.model(x, position_ids=pos, doc_ids=doc)
        unmasked = pre.model(x)
        for b in range(2):
            for k in range(int(doc[b].max()) + 1):
                sel = doc[b] == k
                alone = pre.model(x[b, sel][None])[0]
                assert (packed[b, sel] - alone).abs().max().item() <= 1e-5
    assert (packed - unmasked).abs().max() > 1e-3  # without the mask, later documents would see earlier ones


def test_generic_architecture_trains_through_the_trainer(hf_model, tmp_path, ft_fast, ft_cache, capsys):
    base = hf_model("gpt_neox")
    run = tmp_path / "run"
    model, _, hist = api.finetune(
        model_path=str(base),
        data_path=str(sft_rows(tmp_path / "d.jsonl")),
        lora=True,
        save_dir=str(run),
        **_o(ft_fast, **{"train.max_steps": 4, "train.learning_rate": 1e-2}),
    )
    out = capsys.readouterr().out
    assert "gpt_neox" in out and "native fast path" in out and "one SFT example per row" in out
    assert "activation checkpointing: selective (auto: LoRA" in out  # the plan names LoRA's default
    losses = run_losses(run)
    assert sorted(losses) == [1, 2, 3, 4] and all(v == v for v in losses.values())
    assert json.loads((run / "run.json").read_text())["generic"] is True
    exported = api.export(run, tmp_path / "out")
    ids = torch.randint(0, 300, (1, 12))
    with torch.no_grad():
        ours = api.load(run).model.merge_and_unload()(ids)
    assert (ours - hf_logits(exported, ids)).abs().max().item() <= 1e-4


def test_qlora_is_refused_without_a_gpu(hf_model, tmp_path, ft_fast, ft_cache):
    with pytest.raises(HardwareError, match="QLoRA .* needs a CUDA GPU"):
        api.finetune(
            model_path=str(hf_model("llama")),
            data_path=str(sft_rows(tmp_path / "d.jsonl")),
            lora=True,
            save_dir=str(tmp_path / "run"),
            **_o(ft_fast, **{"lora.quantize": "4bit"}),
        )


def test_full_finetune_chat_sample_and_hf_folder_sample(hf_model, tmp_path, ft_fast, ft_cache, capsys):
    base = hf_model("qwen3")
    run = tmp_path / "run"
    api.finetune(
        model_path=str(base),
        data_path=str(sft_rows(tmp_path / "d.jsonl")),
        save_dir=str(run),
        **_o(ft_fast, **{"train.max_steps": 3, "train.learning_rate": 1e-3}),
    )
    assert len(load_file(str(run / "checkpoints" / "step_000003" / "model.safetensors"))) > 20  # full weights
    loaded = api.load(run)
    assert loaded.chat and loaded.family == "llama"
    capsys.readouterr()
    for path in (run, base):
        assert (
            cli.main(
                ["sample", str(path), "--prompt", "add 1 2", "--max_new_tokens", "4", "--temperature", "0"]
            )
            == 0
        )
    assert api.load(base).chat  # the folder's tokenizer has a chat template
    # chat rendering: the answer is the continuation of the templated prompt, prompt not echoed
    from gptoughts.data.sft import render_prompt

    ids = render_prompt(loaded.tokenizer, [{"role": "user", "content": "add 1 2"}])
    assert loaded.tokenizer.decode(ids).startswith("<|im_start|>user\nadd 1 2<|im_end|>")
    answer = api.generate_text(loaded, "add 1 2", max_new_tokens=4, temperature=0)
    echoed = api.generate_text(loaded, "add 1 2", max_new_tokens=4, temperature=0, chat=False)
    assert "add 1 2" not in answer and echoed.startswith("add 1 2")


def test_export_of_a_from_scratch_llama_run_shards(tmp_path, ft_fast, ft_cache):
    corpus = tmp_path / "c.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 300)
    run = tmp_path / "run"
    o = dict(ft_fast)
    o.update(
        {
            "model.tie_embeddings": True,
            "data.tokenizer": "bytes",
            "train.max_steps": 3,
            "data.sources": [str(corpus)],
            "run.out": str(run),
            "train.sample_prompts": [],
        }
    )
    api.run_training(load_config("default", o))
    out = tmp_path / "out"
    assert cli.main(["export", str(run), "--format", "hf", str(out), "--max_shard_size", "30KB"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert "lm_head.weight" not in index["weight_map"]  # tied: transformers ties it on load
    assert cli.main(["export", str(run), "--out", str(out)]) == 2  # not empty: refuse to mix two exports
    ours = api.load(run).model
    ids = torch.randint(0, 259, (2, 20))
    with torch.no_grad():
        assert (ours(ids) - hf_logits(out, ids)).abs().max().item() <= 1e-4
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tok("def")["input_ids"] == [3 + ord(c) for c in "def"]


def test_plain_text_continues_pretraining_with_the_model_tokenizer(hf_model, tmp_path, ft_fast, ft_cache):
    base = hf_model("llama")
    corpus = tmp_path / "c.txt"
    corpus.write_text("the cat sat on the mat. " * 400)
    run = tmp_path / "run"
    _, tok, hist = api.finetune(
        model_path=str(base),
        data_path=str(corpus),
        save_dir=str(run),
        **_o(ft_fast, **{"train.max_steps": 3, "data.val_fraction": 0.1}),
    )
    info = json.loads((run / "run.json").read_text())
    assert info["data_format"] == "text" and info["init_from"] == str(base) and hist.steps == 3
    from gptoughts.data.tokenizer import Tokenizer

    assert tok.fingerprint() == Tokenizer.load(base).fingerprint()
    res = api.evaluate(
        api.load(base), [str(corpus)], batch_size=2, block_size=32, max_batches=2
    )  # an HF folder
    assert 0 < res["loss"] < 20 and res["tokens"] > 0


def test_finetune_command_line_and_config_checks(tmp_path, hf_model):
    preset, o, _ = cli_options.parse_overrides(
        [
            "--model",
            "M",
            "--lora",
            "--trust_remote_code",
            "--lora_r",
            "8",
            "--target_modules",
            "wq,wv",
            "--data",
            "d.jsonl",
        ],
        cli_train.FINETUNE_ALIASES,
        cli_train.FINETUNE_FLAGS,
    )
    assert o == {
        "model.init_from": "M",
        "lora.enabled": True,
        "model.trust_remote_code": True,
        "lora.r": "8",
        "lora.target_modules": "wq,wv",
        "data.sources": ["d.jsonl"],
    }
    # the config of a fine-tuning run is read from its model (family, positions): a folder that exists
    folder = str(hf_model("llama"))
    cfg = load_config("finetune", {**o, "model.init_from": folder})
    assert cfg.lora.r == 8 and cfg.lora.target_modules == ["wq", "wv"] and cfg.model.trust_remote_code
    assert load_config("finetune", {"model.init_from": folder}).model.trust_remote_code is False
    with pytest.raises(UserError, match="M is not a folder"):
        load_config("finetune", {"model.init_from": "M"})
    assert cli.main(["finetune", "--data", "d.jsonl"]) == 2  # no --model
    with pytest.raises(ConfigError, match="--model HF_DIR"):
        load_config("default", {"lora.enabled": True})
    with pytest.raises(
        UserError, match="M is not a folder"
    ):  # overrides are checked against the folder's family
        load_config("finetune", {"model.init_from": "M", "model.n_layers": 4})
    with pytest.raises(ConfigError, match="model.n_layers changes the architecture"):
        api.finetune(
            model_path=str(hf_model("llama")),
            data_path=str(sft_rows(tmp_path / "d.jsonl")),
            save_dir=str(tmp_path / "arch"),
            **{"model.n_layers": 4, "perf.device": "cpu", "run.progress": False, "train.block_size": 64},
        )
    with pytest.raises(ConfigError, match="lora.target_modules"):
        api.finetune(
            model_path=str(hf_model("llama")),
            data_path=str(sft_rows(tmp_path / "d.jsonl")),
            lora=True,
            save_dir=str(tmp_path / "run"),
            **{
                "lora.target_modules": ["nope"],
                "perf.device": "cpu",
                "run.progress": False,
                "train.block_size": 64,
            },
        )


@pytest.mark.slow
def test_lora_keeps_the_frozen_base_in_bf16_under_bf16_training(hf_model, tmp_path, ft_fast, ft_cache):
    model, _, hist = api.finetune(
        model_path=str(hf_model("qwen2")),
        data_path=str(sft_rows(tmp_path / "d.jsonl")),
        lora=True,
        save_dir=str(tmp_path / "run"),
        **_o(ft_fast, **{"train.max_steps": 3, "perf.precision": "bf16", "train.learning_rate": 1e-2}),
    )
    frozen = {p.dtype for p in model.parameters() if not p.requires_grad}
    trainable = {p.dtype for p in model.parameters() if p.requires_grad}
    assert frozen == {torch.bfloat16} and trainable == {torch.float32}  # no fp32 copy of the base at all
    assert hist.steps == 3 and all(v == v for v in run_losses(tmp_path / "run").values())
    with pytest.raises(ConfigError, match="base_dtype = bf16 needs --precision bf16"):
        api.finetune(
            model_path=str(hf_model("qwen2", name="b")),
            data_path=str(sft_rows(tmp_path / "e.jsonl")),
            lora=True,
            save_dir=str(tmp_path / "run2"),
            **_o(ft_fast, **{"lora.base_dtype": "bf16"}),
        )
