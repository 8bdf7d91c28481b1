"""Expert parallelism where it meets the other features of a run (gloo, 2 processes): activation checkpointing.

Under EP the experts are an FSDP2 unit of their own inside each (checkpointed) block, so FSDP2's hooks run inside
the checkpointed region, where selective checkpointing replays the forward's ops by count."""

from __future__ import annotations

import pytest
from test_ep import _close, _ok, _rows, _train


@pytest.mark.slow
@pytest.mark.distributed
def test_ep2_trains_under_activation_checkpointing_like_one_process(tmp_path, text_corpus, cache_dir):
    one = tmp_path / "one"
    _ok(_train(one, text_corpus, "--batch_size", "4", "--max_steps", "3"))
    for mode in ("selective", "full"):
        ep = tmp_path / mode
        r = _train(
            ep, text_corpus, "--batch_size", "2", "--max_steps", "3", "--parallel.ep", "2",
            "--perf.activation_checkpointing", mode, procs=2,
        )  # fmt: skip
        _ok(r)
        assert f"activation checkpointing: {mode} (asked)" in r.stdout
        _close(_rows(one), _rows(ep), [1, 2, 3])
