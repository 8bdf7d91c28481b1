"""Expert parallelism where it meets the other features of a run (gloo, 2 processes): activation checkpointing.

Under EP the experts are an FSDP2 unit of their own inside each (checkpointed) block, so FSDP2's hooks run inside
the checkpointed region, where selective checkpointing replays the forward's ops by count."""

from __future__ import annotations

import pytest
from ep_helpers import _close, _rows


@pytest.mark.slow
@pytest.mark.distributed
def test_ep2_trains_under_activation_checkpointing_like_one_process(ep_runs):
    """Selective and full checkpointing on two ranks (3 steps each, in the launch of tests/parallel/conftest.py)
    against the one-process run's first 3 steps."""
    tmp, stdout = ep_runs
    for mode in ("selective", "full"):
        assert f"activation checkpointing: {mode} (asked)" in stdout[mode]
        _close(_rows(tmp / "one"), _rows(tmp / mode), [1, 2, 3])
