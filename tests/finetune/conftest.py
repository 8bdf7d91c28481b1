"""Fixtures of the fine-tuning tests (helpers live in hf_helpers.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from hf_helpers import FT_FAST, save_hf_model


@pytest.fixture
def hf_model(tmp_path: Path) -> Callable[..., Path]:
    """``hf_model(kind, **config_overrides)`` -> a folder with config.json, safetensors and tokenizer files."""

    def make(kind: str = "llama", name: str | None = None, **kw) -> Path:
        return save_hf_model(tmp_path / (name or f"hf-{kind}"), kind, **kw)

    return make


@pytest.fixture
def ft_fast() -> dict:
    return dict(FT_FAST)


@pytest.fixture
def ft_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "cache"
    monkeypatch.setenv("GPTOUGHTS_CACHE", str(d))
    return d


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hugging Face cache in tmp_path, offline."""
    import huggingface_hub.constants as hf_constants

    cache = tmp_path / "hf-home" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(cache.parent))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads these variables once, when it is imported (transformers imported it already)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    return cache


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy 2-core machine OpenMP's spinning threads
    make each tiny matmul ~10x slower (measured); restored after each test."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
