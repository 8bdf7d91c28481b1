"""QLoRA on a GPU: a 4-bit NF4 base (bitsandbytes) under LoRA adapters trains, checkpoints only the adapters,
and the run exports to a transformers folder that reloads with our logits. Skipped without CUDA/bitsandbytes
(the CPU suite checks the clear refusal instead: test_finetune.py::test_qlora_is_refused_without_a_gpu)."""

from __future__ import annotations

import json

import pytest
import torch
from hf_helpers import FT_FAST, hf_logits
from safetensors.torch import load_file

from gptoughts import api

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
bnb = pytest.importorskip("bitsandbytes")


@pytest.mark.parametrize("compile_", [False, True])
def test_qlora_trains_a_4bit_base_and_exports(hf_model, tmp_path, ft_cache, compile_):
    rows = [{"prompt": f"add {a} {b}", "response": f"{a + b}"} for a in range(8) for b in range(6)]
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    base = hf_model("llama")
    run = tmp_path / "run"
    o = dict(FT_FAST)
    o.update(
        {
            "train.block_size": 64,
            "train.sample_prompts": [],
            "data.val_fraction": 0.0,
            "perf.device": "cuda",
            "perf.precision": "bf16",
            "perf.compile": compile_,
            "lora.quantize": "4bit",
            "train.max_steps": 30,
            "train.learning_rate": 1e-2,
        }
    )
    model, _, _ = api.finetune(model_path=str(base), data_path=str(data), lora=True, save_dir=str(run), **o)
    quantized = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(quantized) == 2 * 7  # every projection of both blocks is 4-bit
    assert all(not p.requires_grad for m in quantized for p in m.parameters())  # frozen 4-bit base
    losses = {
        r["step"]: r["loss"]
        for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
        if "loss" in r
    }
    first, last = sum(losses[s] for s in range(1, 6)) / 5, sum(losses[s] for s in range(26, 31)) / 5
    assert last < 0.8 * first, (first, last)
    weights = load_file(str(run / "checkpoints" / "step_000030" / "model.safetensors"))
    assert weights and all(".lora_A." in k or ".lora_B." in k for k in weights)

    out = api.export(run, tmp_path / "out")  # on the CPU: adapters merged into the full-precision base
    merged = api.load(run, device="cpu").model.merge_and_unload()
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = merged(ids)
    assert (ours - hf_logits(out, ids)).abs().max().item() <= 1e-4
    assert (ours - hf_logits(base, ids)).abs().max().item() > 1e-3  # the adapters changed the model
