"""Per-block compile keeps a graph per kind of block, grad mode and shape: dynamo's recompile limit must cover them."""

from __future__ import annotations

import pytest
import torch

from gptoughts import models
from gptoughts.training.setup import _graphs_per_block_kind


@pytest.mark.parametrize(("family", "size", "kinds"), [("llama", "125m", 1), ("deepseek", "small", 2)])
def test_the_recompile_limit_covers_each_kind_of_block(family, size, kinds, monkeypatch):
    # Seen on an H200: deepseek small's dense and MoE blocks share Block.forward; at the first evaluation dynamo
    # hit its limit of 8 graphs and ran the blocks eagerly.
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    monkeypatch.setattr(config, name, 8)
    model = models.build_model(family, models.model_args(family, size), device="meta")
    _graphs_per_block_kind(model.layers)
    assert getattr(config, name) == 8 * kinds
