"""Expert parallelism (parallel/ep.py) on gloo: the routed experts split over 2 ranks, tokens exchanged by
all-to-all, FSDP2 over the rest. Two ranks with batch 2 each read the rows one process reads with batch 4, so
both train alike; checkpoints move between the two layouts."""

from __future__ import annotations

import pytest
import torch
from ep_helpers import _close, _rows, _train, argv
from torchrun_runs import here

from gptoughts.config import ParallelConfig
from gptoughts.config.validation import check_parallel
from gptoughts.errors import ConfigError
from gptoughts.models import model_args
from gptoughts.parallel import dist as pdist
from gptoughts.parallel.ep import check_ep
from gptoughts.training.checkpoint import store as ckpt


@pytest.mark.distributed
def test_ep2_trains_like_one_process_and_checkpoints_move_both_ways(ep_runs, shared_corpus):
    """The runs: tests/parallel/conftest.py (the two-rank ones in one launch)."""
    tmp, stdout = ep_runs
    one, ep, one_then_ep = tmp / "one", tmp / "ep", tmp / "one_then_ep"
    assert "fsdp x2, expert parallel x2: 4 of 8 experts a rank, tokens all-to-all" in stdout["ep"]
    a, b = _rows(one), _rows(ep)
    _close(a, b, [1, 2, 3, 4, 5])
    # the logged loads are all ranks' (summed before logging), and so are the bias updates (else routing, and the
    # losses above, would part ways)
    loads = [k for k in a[1] if k.startswith("moe/l")]
    assert loads and all(abs(a[s][k] - b[s][k]) < 1e-6 for s in (1, 5) for k in [*loads, "moe/load_max"])
    assert ckpt.list_steps(ep / "checkpoints") == [3, 5]

    # the expert-parallel (sharded) checkpoint resumes in one process ...
    env = {"GPTOUGHTS_CACHE": str(tmp / "cache")}
    text = here(
        argv(ep, shared_corpus, "--batch_size", "4", "--max_steps", "7", "--run.resume", "auto"), env=env
    )
    assert "resumed from" in text
    _close(a, _rows(ep), [6, 7])

    # ... and a one-process checkpoint resumes under expert parallelism (its index-keyed optimizer state mapped
    # onto the groups that the DTensor experts split off)
    assert "resumed from" in stdout["one_then_ep"]
    _close(a, _rows(one_then_ep), [4, 5])


@pytest.mark.distributed
def test_ep_refusals_under_torchrun_are_one_line_and_write_nothing(tmp_path, text_corpus, cache_dir):
    cases = [
        ("llama", [], "the llama family has no routed experts"),
        ("deepseek", ["--model.n_routed_experts", "7"], "the 7 routed experts do not split over 2"),
    ]
    for i, (family, extra, needle) in enumerate(cases):
        out = tmp_path / f"r{i}"
        r = _train(out, text_corpus, "--max_steps", "1", "--parallel.ep", "2", *extra, procs=2, family=family)
        assert r.returncode != 0
        lines = [line for line in (r.stdout + r.stderr).splitlines() if line.startswith("error:")]
        assert lines and needle in lines[0] and "Traceback" not in r.stdout, r.stdout + r.stderr[-2000:]
        assert not (out / "run.json").exists()


@pytest.mark.parametrize(
    ("family", "overrides", "needle"),
    [
        ("llama", {}, "the llama family has no routed experts"),
        ("deepseek", {"n_routed_experts": 6}, "the 6 routed experts do not split over 4"),
        ("deepseek", {"n_dense_layers": 3}, "no MoE layer"),
    ],
)
def test_check_ep_refusals(family, overrides, needle):
    args = model_args(family, "debug", overrides)
    with pytest.raises(ConfigError) as e:
        check_ep(family, args, 4)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_check_ep_accepts_a_divisor_and_refuses_lora_and_generic_models():
    check_ep("deepseek", model_args("deepseek", "debug"), 4)  # 8 experts
    for kw, needle in (({"lora": True}, "LoRA"), ({"generic": True}, "generic transformers")):
        with pytest.raises(ConfigError, match=needle):
            check_ep("deepseek", model_args("deepseek", "debug"), 2, **kw)


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"ep": 0}, "parallel.ep must be >= 1"),
        ({"ep": 2, "tp": 2}, "does not combine with --parallel.tp"),
        ({"ep": 2, "pp": 2}, "does not combine with --parallel.tp / --parallel.pp"),
        ({"ep": 2, "cpu_offload": True}, "--parallel.cpu_offload"),
        ({"ep": 2, "strategy": "ddp"}, "runs under FSDP2"),
    ],
)
def test_parallel_ep_config_refusals(fields, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        check_parallel(ParallelConfig(**fields))


def test_ep_without_torchrun_says_how_to_launch(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match=r"torchrun --nproc_per_node=2"):
        pdist.init(torch.device("cpu"), ep=2)
