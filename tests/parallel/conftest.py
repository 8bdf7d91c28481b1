"""The expert-parallel runs that test_ep, test_ep_seams and test_ep_combine assert on: the one-process references
train in the test process, every two-rank run in ONE torchrun launch (tests/torchrun_runs.py), once a session."""

from __future__ import annotations

from pathlib import Path

import pytest
from ep_helpers import argv
from torchrun_runs import here, launch

BMM = ["--model.moe_combine", "bmm", "--model.moe_permute", "index_put"]  # test_ep_combine's two-rank setting


@pytest.fixture(scope="session")
def ep_runs(shared_corpus, tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """(folder, rank-0 stdout by run name). ``one``: one process, batch 4, 7 steps (checkpoints at 3, 6 and 7).
    Two ranks, batch 2 each, ``--parallel.ep 2``: ``ep`` (5 steps); ``one_then_ep`` (``one``'s step 3 resumed,
    to 5); ``selective`` and ``full`` (activation checkpointing, 3 steps). ``one_bmm`` / ``ep_bmm``: the bmm
    combine with index_put permutation, 5 steps on one process and on two ranks."""
    tmp = tmp_path_factory.mktemp("ep")
    env = {"GPTOUGHTS_CACHE": str(tmp / "cache")}
    c = shared_corpus
    out = {"one": here(argv(tmp / "one", c, "--batch_size", "4", "--max_steps", "7"), env=env)}
    out["one_bmm"] = here(argv(tmp / "one_bmm", c, "--batch_size", "4", "--max_steps", "5", *BMM), env=env)
    ep = ["--batch_size", "2", "--parallel.ep", "2"]
    runs = {
        "ep": argv(tmp / "ep", c, *ep, "--max_steps", "5"),
        "one_then_ep": argv(
            tmp / "one_then_ep",
            c,
            *ep,
            "--max_steps",
            "5",
            "--run.resume",
            str(tmp / "one/checkpoints/step_000003"),
        ),
        **{
            mode: argv(tmp / mode, c, *ep, "--max_steps", "3", "--perf.activation_checkpointing", mode)
            for mode in ("selective", "full")
        },
        "ep_bmm": argv(tmp / "ep_bmm", c, *ep, "--max_steps", "5", *BMM),
    }
    out.update(zip(runs, launch(list(runs.values()), tmp=tmp, env=env)))
    return tmp, out
