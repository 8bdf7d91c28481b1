"""LoRA fine-tuning on a GPU runs as CUDA graphs by default (``perf.cuda_graphs = auto``: LoRA 1b past 2x
transformers + PEFT, bench/BENCHMARKS.md session 12), with and without adapter dropout: the run says so, trains,
evaluates, samples, checkpoints and exports. Skipped without CUDA."""

from __future__ import annotations

import json

import pytest
import torch
from hf_helpers import FT_FAST, hf_logits

from gptoughts import api

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("dropout", [0.0, 0.05])
def test_lora_with_cuda_graphs_trains_evaluates_and_exports(hf_model, tmp_path, ft_cache, dropout):
    rows = [{"prompt": f"add {a} {b}", "response": f"{a + b}"} for a in range(8) for b in range(6)]
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    base = hf_model("llama")
    run = tmp_path / "run"
    o = dict(FT_FAST)
    o.update(
        {
            "train.block_size": 64,
            "train.sample_prompts": ["add 1 2"],
            "train.sample_interval": 15,
            "train.eval_interval": 10,
            "data.val_fraction": 0.1,
            "perf.device": "cuda",
            "perf.precision": "bf16",
            "perf.compile": True,
            "lora.dropout": dropout,
            "train.max_steps": 30,
            "train.learning_rate": 1e-2,
        }
    )
    model, _, _ = api.finetune(model_path=str(base), data_path=str(data), lora=True, save_dir=str(run), **o)
    resolved = json.loads((run / "run.json").read_text())["resolved"]
    assert resolved["cuda_graphs"].startswith("True (auto: LoRA"), resolved
    records = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    assert [r["step"] for r in records if "val_loss" in r][:3] == [10, 20, 30]
    first, last = sum(losses[s] for s in range(1, 6)) / 5, sum(losses[s] for s in range(26, 31)) / 5
    assert last < 0.8 * first, (first, last)
    out = api.export(run, tmp_path / "out")
    merged = api.load(run, device="cpu").model.merge_and_unload()
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = merged(ids)
    assert (ours - hf_logits(out, ids)).abs().max().item() <= 1e-4


def test_dropout_masks_are_new_at_each_graph_replay_and_the_backward_applies_the_forwards():
    """Replayed CUDA graphs draw new seeds (a mask frozen at capture would pass the training test above): over
    identity adapters on a zero base the layer's output is the dropped input, and the input's gradient is non-zero
    exactly where the forward kept it."""
    from gptoughts.perf import dropout, lora

    d = 256
    w = torch.zeros(d, d, device="cuda", dtype=torch.bfloat16)
    eye = torch.eye(d, device="cuda", dtype=torch.bfloat16)

    def layer(x):
        return lora._LoraLinear.apply(x, dropout.new_seed(x.device), w, None, eye, eye.clone(), 1.0, 0.3)

    graphed = torch.compile(layer, mode="reduce-overhead", fullgraph=True)  # no eager fallback
    masks = []
    for _ in range(5):  # warm-up, recording, then replays
        torch.compiler.cudagraph_mark_step_begin()
        x = torch.ones(64, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        y = graphed(x)
        y.float().sum().backward()
        kept = (y != 0).clone()
        assert 0.6 < kept.float().mean().item() < 0.8
        assert torch.equal(kept, x.grad != 0)
        masks.append(kept)
    assert not torch.equal(masks[-1], masks[-2]) and not torch.equal(masks[-2], masks[-3])
