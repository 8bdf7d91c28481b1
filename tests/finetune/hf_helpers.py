"""Helpers of the fine-tuning tests: tiny random Hugging Face models saved to folders (no hub), a tokenizer.

Imported by name from the tests (``from hf_helpers import ...``): conftest modules share one name across
folders and cannot be imported that way."""

from __future__ import annotations

import inspect
import json
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Fast, quiet CPU settings for fine-tuning runs (dotted keys).
FT_FAST = {
    "train.block_size": 32,
    "train.batch_size": 4,
    "train.grad_accum": 1,
    "train.eval_batches": 2,
    "train.sample_max_new_tokens": 4,
    "train.sample_prompts": ["hi"],
    "train.warmup_steps": 2,
    "train.log_interval": 1,
    "train.eval_interval": 0,
    "train.save_interval": 0,
    "train.sample_interval": 0,
    "perf.device": "cpu",
    "perf.precision": "fp32",
    "perf.compile": False,
    "run.progress": False,
    "run.tensorboard": False,
}


def make_tokenizer(chat_template: str | None = CHATML):
    """Bytes tokenizer (ids 0-258) plus ChatML markers as special tokens (259, 260)."""
    from gptoughts.data.tokenizer import EOS_TOKEN, MASK_TOKEN, PAD_TOKEN, Tokenizer, _bytes_backend

    backend = _bytes_backend()
    backend.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    return Tokenizer(
        backend,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        mask_token=MASK_TOKEN,
        chat_template=chat_template,
        spec="test",
    )


def _rope_kwargs(cls, theta: float) -> dict:
    if "rope_parameters" in inspect.signature(cls.__init__).parameters or hasattr(cls, "rope_parameters"):
        return {"rope_parameters": {"rope_type": "default", "rope_theta": theta}}
    return {"rope_theta": theta}


def hf_config(kind: str, **kw):
    common = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=320,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=0,
        pad_token_id=1,
    )
    common.update(kw)
    if kind == "llama":
        cls = transformers.LlamaConfig
    elif kind == "mistral":
        cls = transformers.MistralConfig
        common.setdefault("sliding_window", None)
    elif kind == "qwen2":
        cls = transformers.Qwen2Config
    elif kind == "qwen3":
        cls = transformers.Qwen3Config
        common.setdefault("head_dim", 32)
    elif kind == "gpt_neox":
        cls = transformers.GPTNeoXConfig
        for k in ("num_key_value_heads", "rms_norm_eps"):
            common.pop(k)
    else:
        raise ValueError(kind)
    return cls(**common, **({} if kind == "gpt_neox" else _rope_kwargs(cls, 10000.0)))


def randomize(model: torch.nn.Module, seed: int = 7) -> None:
    """HF inits norms to 1 and biases to 0, which would hide a mis-mapped norm or bias: perturb everything."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.2 * noise if "norm" in name else 0.05 * noise)


def save_hf_model(folder: Path, kind: str, *, chat_template: str | None = CHATML, **kw) -> Path:
    cfg = hf_config(kind, **kw)
    cls = {
        "llama": transformers.LlamaForCausalLM,
        "mistral": transformers.MistralForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
        "qwen3": transformers.Qwen3ForCausalLM,
        "gpt_neox": transformers.GPTNeoXForCausalLM,
    }[kind]
    torch.manual_seed(0)
    model = cls(cfg)
    randomize(model)
    model.save_pretrained(str(folder))
    make_tokenizer(chat_template).save(folder)
    return folder


def hf_logits(folder: Path, ids: torch.Tensor, attn: str = "eager") -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, attn_implementation=attn
    ).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def sft_rows(path: Path, n: int = 48) -> Path:
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(n):
        a, b = torch.randint(0, 10, (2,), generator=g).tolist()
        rows.append({"prompt": f"add {a} {b}", "response": f"{a + b}"})
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def put_in_hub_cache(cache: Path, repo_id: str, folder: Path) -> Path:
    """``folder`` as huggingface_hub caches a download of ``repo_id``: models--ORG--NAME/snapshots/<commit>/...
    with refs/main naming the commit. Returns the snapshot folder."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    shutil.copytree(folder, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot
