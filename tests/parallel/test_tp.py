"""Tensor parallelism (+ sequence parallelism, parallel/tp.py), alone and under FSDP2 on a 2-D mesh, on gloo.

The distributed runs train the debug models for a few steps and compare their losses with one process reading
the same global batch: the ranks of a tensor-parallel group read the same rows, so TP=2 with batch 4 and
FSDP 2 x TP 2 with batch 2 per data-parallel rank both train like one process with batch 4.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from torchrun_runs import here, launch, ok, process

from gptoughts.errors import ConfigError
from gptoughts.models import model_args
from gptoughts.parallel.tp import check_tp
from gptoughts.training.checkpoint import store as ckpt

ARGS = [
    "--model.size", "debug", "--data.tokenizer", "bytes", "--eval_batches", "2",
    "--perf.device", "cpu", "--precision", "fp32", "--compile", "false", "--perf.threads", "1",
    "--run.progress", "false", "--log_interval", "1", "--eval_interval", "3", "--save_interval", "3",
    "--train.schedule", "constant", "--warmup_steps", "0", "--sample_prompts", "def ",
    "--sample_max_new_tokens", "4",
]  # fmt: skip


def _losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _argv(out: Path, corpus: Path, *extra: str, block: int = 32) -> list[str]:
    return [
        "train",
        "default",
        "--out",
        str(out),
        "--data",
        str(corpus),
        "--block_size",
        str(block),
        *ARGS,
        *extra,
    ]


def _train(
    out: Path, corpus: Path, *extra: str, procs: int = 1, block: int = 32
) -> subprocess.CompletedProcess:
    return process(_argv(out, corpus, *extra, block=block), procs=procs)


def _close(a: dict[int, float], b: dict[int, float], steps: list[int]) -> None:
    for s in steps:
        assert abs(a[s] - b[s]) < 1e-4 * abs(a[s]), (s, a[s], b[s])


LLAMA = ["--model.family", "llama", "--batch_size", "4"]
INL = ["--model.family", "inl", "--optimizer", "muon", "--batch_size", "4", "--max_steps", "4"]


@pytest.fixture(scope="module")
def tp_runs(shared_corpus, tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """The one-process references (in this process) and the two TP=2 runs (one torchrun launch, in turn):
    ``one``/``tp``: Llama, 7 steps / 5 steps; ``inl_one``/``inl_tp``: INL with Muon on blocks of 31, 4 steps."""
    tmp = tmp_path_factory.mktemp("tp")
    env = {"GPTOUGHTS_CACHE": str(tmp / "cache")}
    c = shared_corpus
    out = {"one": here(_argv(tmp / "one", c, *LLAMA, "--max_steps", "7"), env=env)}
    out["inl_one"] = here(_argv(tmp / "inl_one", c, *INL, block=31), env=env)
    tp = ["--parallel.tp", "2"]
    runs = {
        "tp": _argv(tmp / "tp", c, *LLAMA, "--max_steps", "5", *tp),
        "inl_tp": _argv(tmp / "inl_tp", c, *INL, *tp, block=31),
    }
    out.update(zip(runs, launch(list(runs.values()), tmp=tmp, env=env)))
    return tmp, out


@pytest.mark.distributed
def test_tp_and_fsdp_x_tp_match_one_process_and_checkpoints_move(tp_runs, shared_corpus):
    """Llama: TP=2 (2 ranks, no data-parallel wrapper) and FSDP 2 x TP 2 (4 ranks, 2-D mesh) give the losses of
    one process over 5 steps; the TP run's checkpoint (full weights gathered from the DTensor shards, optimizer
    state by name) resumes on one process and continues like the one-process run."""
    base, stdout = tp_runs
    one, tp, fsdp_tp = base / "one", base / "tp", base / "fsdp_tp"
    assert "x 1 data-parallel rank(s) (tensor parallel x2: 2 processes)" in stdout["tp"]
    run = json.loads((tp / "run.json").read_text())
    assert run["world_size"] == 2 and run["dp_size"] == 1
    a, b = _losses(one), _losses(tp)
    _close(a, b, [1, 2, 3, 4, 5])
    # Sampling under TP: every rank decodes (token by token with a KV cache of its own heads), the same tokens
    steps = (tp / "samples.txt").read_text().split("=== step ")
    assert steps[1].startswith("3\n") and steps[1] in (one / "samples.txt").read_text()
    assert ckpt.list_steps(tp / "checkpoints") == [3, 5]

    env = {"GPTOUGHTS_CACHE": str(base / "cache")}
    here(_argv(tp, shared_corpus, "--batch_size", "4", "--max_steps", "7", "--run.resume", "auto"), env=env)
    _close(a, _losses(tp), [6, 7])

    r = _train(
        fsdp_tp, shared_corpus, "--model.family", "llama", "--batch_size", "2", "--max_steps", "5",
        "--parallel.tp", "2", procs=4,
    )  # fmt: skip
    ok(r)
    assert "x 2 data-parallel rank(s) (tensor parallel x2: 4 processes) = 128 tokens per step" in r.stdout
    run = json.loads((fsdp_tp / "run.json").read_text())
    assert run["dp_size"] == 2 and "fsdp x2, tp x2" in run["resolved"]["parallel"]
    _close(a, _losses(fsdp_tp), [1, 2, 3, 4, 5])


@pytest.mark.distributed
def test_tp_inl_with_muon_matches_one_process(tp_runs):
    """INL (its integrator on each rank's positions with replicated weights) under TP=2 with Muon (each
    TP-sharded matrix orthogonalized whole) trains like one process, on blocks of 31 tokens (split 16 + 15)."""
    base, _ = tp_runs
    _close(_losses(base / "inl_one"), _losses(base / "inl_tp"), [1, 2, 3, 4])


@pytest.mark.distributed
def test_tp_refuses_deepseek_and_auto_batch_in_one_line_before_writing(tmp_path, text_corpus, cache_dir):
    """DeepSeek has no tensor-parallel plan; ``batch_size = auto`` would probe memory rank by rank (one rank out of
    memory would leave the others waiting in a collective)."""
    out = tmp_path / "auto"
    r = _train(out, text_corpus, "--batch_size", "auto", "--max_steps", "2", "--parallel.tp", "2", procs=2)
    assert r.returncode != 0
    lines = [line for line in (r.stdout + r.stderr).splitlines() if line.startswith("error:")]
    assert lines and "train.batch_size = auto" in lines[0] and "tensor-parallel" in lines[0]
    assert not (out / "run.json").exists()
    out = tmp_path / "ds"
    r = _train(
        out, text_corpus, "--model.family", "deepseek", "--max_steps", "2", "--parallel.tp", "2", procs=2
    )
    assert r.returncode != 0
    lines = [line for line in (r.stdout + r.stderr).splitlines() if line.startswith("error:")]
    assert lines and "--parallel.tp 2: DeepSeek" in lines[0] and "Traceback" not in r.stdout
    assert not out.exists()


@pytest.mark.parametrize(
    ("family", "overrides", "needle"),
    [
        ("deepseek", {}, "DeepSeek's MoE experts"),
        ("gpt2", {}, "fused q/k/v"),
        ("llama", {"n_heads": 6, "n_kv_heads": 2, "d_model": 96}, "n_heads (6) is not divisible by 4"),
        ("llama", {"n_heads": 8, "n_kv_heads": 2}, "key/value heads (2) is not divisible by 4"),
        ("llama", {"ffn_dim": 130, "n_kv_heads": 4}, "MLP width (130) is not divisible by 4"),
    ],
)
def test_check_tp_refusals(family, overrides, needle):
    args = model_args(family, "debug", overrides)
    with pytest.raises(ConfigError) as e:
        check_tp(family, args, 4)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_check_tp_accepts_the_llama_layouts():
    for family in ("llama", "llada", "inl"):
        check_tp(family, model_args(family, "debug", {"n_heads": 4, "n_kv_heads": 4}), 4)
    with pytest.raises(ConfigError, match="LoRA"):
        check_tp("llama", model_args("llama", "debug", {}), 2, lora=True)
    with pytest.raises(ConfigError, match="generic transformers"):
        check_tp(None, None, 2, generic=True)


def test_ddp_with_several_data_parallel_ranks_is_refused_before_joining(monkeypatch):
    """DDP does not reduce DTensor gradients: 4 ranks with tp 2 (2 data-parallel) and strategy ddp are refused
    in one line, before the process group is joined; auto means FSDP there."""
    from gptoughts.parallel import dist as pdist

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match="ddp does not combine with --parallel.tp"):
        pdist.init(torch.device("cpu"), "gloo", "ddp", tp=2)


def test_estimate_divides_the_blocks_by_tp():
    """``estimate(tp=...)``: a rank holds 1/tp of the blocks (the embeddings and head whole) and 1/tp of the
    activations, except the all-gathered inputs of the column-parallel projections (2 x 2d bytes a token and block,
    whole on every rank: counted by the formula without checkpointing, added to it under selective, absent under
    full); FSDP then shards over the data-parallel ranks only."""
    from gptoughts.perf.estimate import estimate

    one = estimate("llama", "1b", batch_size=4, block_size=2048)
    tp2 = estimate("llama", "1b", batch_size=4, block_size=2048, num_gpus=2, tp=2)
    blocks = one.params_non_embedding - 2048 * 32768 - 2048  # the untied head and the final norm are not
    kept = (one.params - blocks / 2) / one.params
    assert abs(tp2.weights_gib - one.weights_gib * kept) < 1e-6
    gathered = 4 * 2048 * 16 * 4 * 2048 / 2**30  # 4d bytes, 16 blocks, 4 x 2048 tokens
    assert abs(tp2.activations_gib - ((one.activations_gib - gathered) / 2 + gathered)) < 1e-6
    for mode, whole in (("selective", gathered), ("full", 0.0)):
        one_m = estimate("llama", "1b", batch_size=4, block_size=2048, activation_checkpointing=mode)
        tp4 = estimate(
            "llama", "1b", batch_size=4, block_size=2048, num_gpus=4, tp=4, activation_checkpointing=mode
        )
        assert abs(tp4.activations_gib - (one_m.activations_gib / 4 + whole)) < 1e-6, mode
    fsdp_tp = estimate("llama", "1b", batch_size=4, block_size=2048, num_gpus=4, tp=2, strategy="fsdp")
    assert abs(fsdp_tp.weights_gib - tp2.weights_gib / 2) < 1e-6
