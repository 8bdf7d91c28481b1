"""Under torchrun each rank ran the data step and logged it: rank 0 "prepared ... shards", then every other rank
"reusing cached shards" (N-1 more lines saying nothing new), and each rank warned of the same source too short to be
drawn. Rank 0 tells how the run goes; a warning every rank finds alike is said once."""

from __future__ import annotations

import pytest
from cli_helpers import QUIET_CPU
from torchrun_runs import ok, process


@pytest.fixture(scope="module")
def two_ranks(shared_corpus, tmp_path_factory) -> str:
    """The stdout and stderr of a 2-rank run on a fresh cache, of two sources: the corpus and one shorter than a
    block."""
    tmp = tmp_path_factory.mktemp("once")
    short = tmp / "short"
    short.mkdir()
    (short / "one.py").write_text("x = 1\n", encoding="utf-8")
    config = tmp / "run.toml"
    config.write_text(f'[data]\nsources = ["{shared_corpus}", "{short}"]\n', encoding="utf-8")
    argv = ["train", "--config", str(config), "--out", str(tmp / "run"), "--size", "debug", "--tokenizer", "bytes",
            "--block_size", "32", "--batch_size", "2", "--max_steps", "2", *QUIET_CPU]  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GPTOUGHTS_CACHE", str(tmp / "cache"))
        r = process(argv, procs=2)
    ok(r)
    return r.stdout + r.stderr


@pytest.mark.slow
@pytest.mark.distributed
def test_the_data_step_and_the_plan_are_told_once(two_ranks):
    lines = two_ranks.splitlines()
    assert sum(line.startswith("INFO prepared") for line in lines) == 1, two_ranks[-3000:]
    assert not [line for line in lines if "reusing cached shards" in line], two_ranks[-3000:]
    assert sum(line.startswith("plan: ") for line in lines) == 1, two_ranks[-3000:]


@pytest.mark.slow
@pytest.mark.distributed
def test_a_source_never_drawn_is_warned_of_once(two_ranks):
    warned = [line for line in two_ranks.splitlines() if "it is never drawn" in line]
    assert len(warned) == 1 and "short" in warned[0], two_ranks[-3000:]
