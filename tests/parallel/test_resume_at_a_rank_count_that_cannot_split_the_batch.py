"""A run saved with a global batch of 3 rows (one process, --batch_size 3), resumed under torchrun on 2 ranks: no
micro-batch and accumulation keep 3 rows over 2 ranks, yet the refusal asked for "batch x grad_accum x 2 x 32 = 96",
which no whole numbers give. It says the rows do not split and what does."""

from __future__ import annotations

import pytest

from gptoughts.config import load_config
from gptoughts.errors import ConfigError
from gptoughts.parallel.dist import DistInfo
from gptoughts.training.batches import _resumed_global_batch

BLOCK = 32


def _resume(saved_rows: int, micro: int, dp: int) -> tuple[int, int]:
    cfg = load_config(None, {"train.block_size": BLOCK, "train.batch_size": micro})
    saved = {"dp_size": 1, "world_size": 1, "tokens_per_step": saved_rows * BLOCK}
    return _resumed_global_batch(cfg, saved, micro, 1, BLOCK, DistInfo(world_size=dp, strategy="ddp"), {})


def test_rows_that_do_not_split_over_the_ranks_are_named_with_what_resumes_them():
    with pytest.raises(ConfigError) as e:
        _resume(saved_rows=3, micro=3, dp=2)
    text = str(e.value)
    assert "3 rows" in text and "2" in text and "batch x grad_accum" not in text, text
    assert "--grad_accum" in text, text  # typed, it trains on at the new global batch


def test_rows_that_split_but_not_by_this_micro_batch_keep_the_formula():
    with pytest.raises(ConfigError, match=r"batch x grad_accum x 2 x 32 = 192"):
        _resume(saved_rows=6, micro=2, dp=2)  # 6 rows = 2 ranks x 3: --batch_size 3 (or 1 x 3) keeps them
    assert _resume(saved_rows=8, micro=2, dp=2) == (2, 8 * BLOCK)
