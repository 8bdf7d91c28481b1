"""The GPU utilisation a run logs (and the advice it gives from it) is its own GPU's under CUDA_VISIBLE_DEVICES. On a
4-GPU machine a run on `CUDA_VISIBLE_DEVICES=2` logged 0% utilisation while it ran at MFU 0.73, and advised a larger
batch: NVML numbers all GPUs, and the monitor asked NVML for torch's index 0."""

import sys
from types import SimpleNamespace

import torch

from gptoughts.perf.timing import GpuMonitor, nvml_index


def _fake_nvml(monkeypatch, utils):
    asked = []

    def handle(i):
        asked.append(i)
        return i

    nvml = SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlDeviceGetHandleByIndex=handle,
        nvmlDeviceGetUtilizationRates=lambda h: SimpleNamespace(gpu=utils[h]),
        nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(used=2**30 * (h + 1)),
    )
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    return asked


def test_the_monitor_reads_the_gpu_the_run_is_on(monkeypatch):
    asked = _fake_nvml(monkeypatch, utils=[0, 0, 97, 0])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    reading = GpuMonitor(torch.device("cuda", 0)).read()
    assert asked == [2]
    assert reading == {"gpu/util_pct": 97.0, "gpu/mem_used_gib": 3.0}


def test_without_visible_devices_the_indices_agree(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert [nvml_index(i) for i in range(3)] == [0, 1, 2]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert [nvml_index(0), nvml_index(1)] == [3, 1]
