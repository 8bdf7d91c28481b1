"""The CUDA path of the loader: pinned buffers, non_blocking copies, a thread bound to the right device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gptoughts.data import BatchLoader, eval_batches

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_cuda_batches_equal_cpu_batches(bytes_dataset: Path) -> None:
    kw = dict(batch_size=4, block_size=16, seed=1)
    with BatchLoader(bytes_dataset, device="cpu", prefetch=0, **kw) as cpu:
        expected = [next(cpu) for _ in range(6)]
    with BatchLoader(bytes_dataset, device="cuda", prefetch=3, **kw) as gpu:
        assert gpu.pin_memory and gpu.device.index == torch.cuda.current_device()
        got = [next(gpu) for _ in range(6)]
    for (x, y), (gx, gy) in zip(expected, got):
        assert gx.is_cuda and gy.is_cuda and gx.is_contiguous() and gy.is_contiguous()
        assert torch.equal(gx.cpu(), x) and torch.equal(gy.cpu(), y)


def test_cuda_eval_batches(bytes_dataset: Path) -> None:
    cpu = list(eval_batches(bytes_dataset, batch_size=2, block_size=8, max_batches=2))
    gpu = list(eval_batches(bytes_dataset, batch_size=2, block_size=8, max_batches=2, device="cuda"))
    assert all(torch.equal(a.cpu(), b) for (a, _), (b, _) in zip(gpu, cpu))
