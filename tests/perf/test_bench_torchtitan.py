"""`gptoughts bench --compare torchtitan` on CPU: the one-line refusal when torchtitan is missing (always run), and,
where torchtitan is importable (CI does not install it: skipped there), a tiny compare whose model has our
parameter count."""

from __future__ import annotations

import sys

import pytest
from test_perf import BENCH

from gptoughts import cli
from gptoughts.config import load_config
from gptoughts.errors import ConfigError, UserError
from gptoughts.tools import bench, bench_torchtitan
from gptoughts.training import modeling


def test_missing_torchtitan_is_one_line_and_exit_2_before_our_run(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torchtitan", None)  # `import torchtitan` raises ImportError
    monkeypatch.setattr(bench_torchtitan, "_TT", None)

    def never(*a, **k):
        raise AssertionError("our model was built before the missing peer was reported")

    monkeypatch.setattr(modeling, "build_model", never)
    args = [f"--{k}={v}" for k, v in BENCH.items()]
    assert cli.main(["bench", *args, "--steps", "1", "--warmup", "0", "--compare", "torchtitan"]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: --compare torchtitan needs torchtitan 0.3.0")
    assert "pip install torchtitan==0.3.0" in lines[0] and "bench/peer_wheels.sh" in lines[0]
    assert "Traceback" not in out + err


def test_compare_words():
    assert bench_torchtitan.parse_torchtitan_compare("torchtitan") == (("flex", "sdpa"), True)
    assert bench_torchtitan.parse_torchtitan_compare("torchtitan:sdpa,nographs") == (("sdpa",), False)
    assert bench_torchtitan.parse_torchtitan_compare("torchtitan:nographs") == (("flex", "sdpa"), False)
    with pytest.raises(ConfigError, match="unknown 'fast'"):
        bench_torchtitan.parse_torchtitan_compare("torchtitan:fast")
    with pytest.raises(ConfigError, match="`hf` or `torchtitan`"):
        bench.run_bench(load_config("default", BENCH), steps=1, warmup=0, compare="megatron")


@pytest.fixture
def torchtitan():
    try:
        return bench_torchtitan.import_torchtitan()
    except UserError as e:
        pytest.skip(str(e))


def test_tiny_compare_runs_the_same_model(torchtitan):
    r = bench.run_bench(load_config("default", BENCH), steps=2, warmup=1, compare="torchtitan:sdpa")
    tt = r["torchtitan"]["sdpa"]
    assert "error" not in tt, tt.get("error")
    assert tt["params"] == r["params"]  # same d_model, layers, heads, kv heads, FFN width, vocab
    assert tt["tokens_per_s"] > 0 and tt["speedup"] == pytest.approx(r["tokens_per_s"] / tt["tokens_per_s"])
    assert tt["tokens_per_s"] == pytest.approx(2 * 32 / (tt["step_ms"] / 1e3))
    assert tt["mfu"] is None  # no known peak on a CPU, as for ours
    assert "parallelize_llama" in tt["label"] and "sdpa attention" in tt["label"]
    text = bench.format_result(r)
    assert "torchtitan sdpa: tokens/s" in text and "params, ours" not in text


def test_bf16_compare_reduces_uniform_gradient_dtypes(torchtitan):
    # FSDP2 mixed precision (param bf16, reduce fp32) with the chunked loss: on torch 2.11 the [norm, lm_head]
    # unit once reduced norm's bf16 gradient with lm_head's fp32 no-sync accumulation, and FSDP refused the mix
    r = bench.run_bench(
        load_config("default", {**BENCH, "perf.precision": "bf16"}),
        steps=1,
        warmup=1,
        compare="torchtitan:sdpa",
    )
    tt = r["torchtitan"]["sdpa"]
    assert "error" not in tt, tt.get("error")
    assert "FSDP2 x1 bfloat16" in tt["label"]
    if bench_torchtitan._torch_version() < (2, 13):
        assert "no-sync chunks skipped" in tt["label"]


def test_flex_on_cpu_is_reported_not_fatal(torchtitan):
    r = bench.run_bench(load_config("default", BENCH), steps=1, warmup=0, compare="torchtitan:flex")
    assert r["tokens_per_s"] > 0  # our measurement survives the peer's failure
    assert "no backward on cpu" in r["torchtitan"]["flex"]["error"]
    assert "torchtitan flex: failed:" in bench.format_result(r)
