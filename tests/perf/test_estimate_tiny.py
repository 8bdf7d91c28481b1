"""`gptoughts estimate` of a tiny model: its speed is bound by each step's kernel launches, not its FLOPs (llama
debug at 8 x 256 tokens measured 369k tokens/s on an H200, where MFU 0.45 said 111.7M), and says so."""

from __future__ import annotations

import json

import pytest

from gptoughts import cli
from gptoughts.perf.estimate import MIN_STEP_S, estimate


def test_a_tiny_model_is_bound_by_the_step_floor():
    e = estimate("llama", "debug", batch_size=8, block_size=256)
    assert e.tokens_per_s == pytest.approx(8 * 256 / MIN_STEP_S)
    assert e.tokens_per_s < 1e6 < e.flops_tokens_per_s  # the FLOP bound is ~100x off
    two = estimate("llama", "debug", batch_size=8, block_size=256, num_gpus=2)
    assert two.tokens_per_s == pytest.approx(2 * e.tokens_per_s)  # one step at a time on each GPU
    assert estimate(
        "llama", "debug", batch_size=8, block_size=256, num_gpus=2, tp=2
    ).tokens_per_s == pytest.approx(
        e.tokens_per_s
    )  # the two GPUs of a tensor-parallel group share one micro-batch


@pytest.mark.parametrize(("family", "size"), [("llama", "125m"), ("llama", "1b"), ("gpt2", "small")])
def test_models_of_real_size_keep_their_flop_bound(family, size):
    e = estimate(family, size, batch_size=8, block_size=2048)
    assert e.tokens_per_s == e.flops_tokens_per_s


def test_estimate_cli_says_the_bound(capsys):
    assert cli.main(["estimate", "--size", "debug", "--tokens", "1e9"]) == 0
    out = capsys.readouterr().out
    speed = next(line for line in out.splitlines() if line.startswith("speed:"))
    assert "at most 455,111 tokens/s on H100" in speed and "kernel launches" in speed, out
    assert "111,730,876" in speed and "tokens/s at MFU" not in speed  # the FLOP bound, named as such
    assert "time for 1,000,000,000 tokens: at least" in out
    assert "4.0 MFLOP/token" in out and "0.00 GFLOP" not in out

    assert cli.main(["estimate", "--size", "debug", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["tokens_per_s"] < d["flops_tokens_per_s"]

    assert cli.main(["estimate", "--size", "125m"]) == 0
    assert "tokens/s at MFU 0.45 on H100" in capsys.readouterr().out
