"""A user error under torchrun is one line: every rank checks the same config, so every rank raised it and printed
it (N identical lines). Rank 0 prints an error all ranks share; a rank that alone sees one prints it with its rank.
The fast test plays the ranks in turn in this process, against a store standing in for torchrun's; the distributed
ones launch two gloo ranks that fail after joining their process group."""

from __future__ import annotations

import datetime
import socket

import pytest
import torch.distributed as dist
from cli_helpers import QUIET_CPU
from torchrun_runs import by_rank, process

from gptoughts import cli

FA4 = [
    "--perf.sdpa_backend",
    "fa4",
]  # refused on a CPU after the process group is joined (training/environment.py)


def _argv(tmp_path, corpus, *extra: str) -> list[str]:
    return ["train", "--data", str(corpus), "--out", str(tmp_path / "run"), "--size", "debug", "--tokenizer",
            "bytes", "--block_size", "32", "--batch_size", "2", "--max_steps", "2", *QUIET_CPU, *extra]  # fmt: skip


def _errors(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


def test_ranks_say_a_shared_error_once_and_their_own_with_their_rank(tmp_path, monkeypatch, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=5))
    for key, value in {"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), "WORLD_SIZE": "2"}.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    # (refused as the flags are read, before any process group would be joined)
    bad = ["train", "--out", str(tmp_path / "run"), "--max_stepz", "2"]
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        assert cli.main(bad) == 2
    lines = _errors(capsys.readouterr().err)
    assert len(lines) == 1 and "rank" not in lines[0] and "max_stepz" in lines[0], lines
    # another error on rank 1 than rank 0's: rank 1 says its own, named as rank 1's
    other = ["train", "--out", str(tmp_path / "run"), "--max_stepx", "2"]
    assert cli.main(other) == 2
    lines = _errors(capsys.readouterr().err)
    assert len(lines) == 1 and lines[0].startswith("error: rank 1: ") and "max_stepx" in lines[0], lines
    del server


@pytest.mark.distributed
def test_an_error_every_rank_raises_is_printed_once(tmp_path, text_corpus, cache_dir):
    r = process(_argv(tmp_path, text_corpus, *FA4), procs=2)
    assert r.returncode != 0
    lines = _errors(r.stdout + r.stderr)
    assert len(lines) == 1 and "perf.sdpa_backend = fa4" in lines[0] and "rank" not in lines[0], lines


@pytest.mark.distributed
def test_an_error_one_rank_alone_sees_is_printed_by_it_with_its_rank(tmp_path, text_corpus, cache_dir):
    r = by_rank([_argv(tmp_path, text_corpus), _argv(tmp_path, text_corpus, *FA4)], tmp=tmp_path)
    assert r.returncode != 0
    lines = _errors(r.stdout + r.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: rank 1: perf.sdpa_backend = fa4"), lines
