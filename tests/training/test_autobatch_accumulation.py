"""``batch_size = auto`` under gradient accumulation: every micro-batch after the first runs beside the whole
gradient, so the probe's second step keeps the first one's gradients allocated (zeroed in place); without
accumulation it frees them, as the run does."""

from __future__ import annotations

import pytest
import torch

from gptoughts.config import PerfConfig, TrainConfig, load_config
from gptoughts.models import build_model, model_args
from gptoughts.parallel.dist import DistInfo
from gptoughts.training.batches import _accumulates
from gptoughts.training.objectives import build_objective
from gptoughts.training.setup import Built, auto_micro_batch


@pytest.mark.parametrize("accumulates", [False, True])
def test_the_probe_runs_its_second_step_beside_the_gradients_it_will_keep(accumulates, tmp_path):
    torch.manual_seed(0)
    model = build_model("llama", model_args("llama", "debug", {"n_layers": 2}))
    seen: list[tuple[int, bool]] = []  # (rows, gradients allocated) at each forward of the first block

    def watch(module: torch.nn.Module, args: object, out: torch.Tensor) -> None:
        if out.shape[0] > 2:
            raise torch.OutOfMemoryError("simulated: CUDA out of memory")
        seen.append((out.shape[0], any(p.grad is not None for p in model.parameters())))

    model.layers[0].register_forward_hook(watch)
    best, _ = auto_micro_batch(
        Built(model=model, raw=model),
        build_objective("causal"),
        vocab_size=256,
        block_size=16,
        precision="fp32",
        perf=PerfConfig(),
        t=TrainConfig(learning_rate=1e-2),
        device=torch.device("cpu"),
        dist=DistInfo(),
        parts={"test": f"accumulates={accumulates}"},
        cache_path=str(tmp_path / "autobatch.json"),
        accumulates=accumulates,
    )
    assert best == 2
    assert seen == [(1, False), (1, accumulates), (2, False), (2, accumulates)]


def test_a_run_accumulates_by_its_flag_or_its_global_batch():
    assert _accumulates(load_config(None, {"train.grad_accum": 4}))
    assert not _accumulates(load_config(None, {"train.grad_accum": 1}))
    assert not _accumulates(load_config(None, {}))  # no global batch to reach: one micro-batch a step
    assert _accumulates(load_config(None, {"model.size": "1b"}))  # the size's global batch
    assert not _accumulates(load_config(None, {"model.size": "1b", "train.grad_accum": 1}))
