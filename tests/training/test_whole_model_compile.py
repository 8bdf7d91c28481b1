"""Whole-model compile (``perf.compile_mode``): its auto rule, decided before the build (``training/resolve.py``),
and the split between the whole-model graph (training, compiled once the batch is planned) and the per-block
graphs (evaluations, and every step before: the auto-batch probe's).

On CPU, torch.compile is replaced by a recording ``eager`` backend: what is checked is which graphs get
traced, and that the values are the model's."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gptoughts import models
from gptoughts.config import load_config
from gptoughts.parallel.dist import DistInfo
from gptoughts.perf import hardware
from gptoughts.perf.hardware import HardwareProfile
from gptoughts.training import resolve, setup

ONE = DistInfo()
GPU = torch.device("cuda")  # the rule only reads the device's type


def _meta(family: str, **overrides: object) -> torch.nn.Module:
    args = models.model_args(family, "debug", overrides)
    with torch.device("meta"):
        return models.build_model(family, args, device="meta")


def _perf(**kw: object):
    return load_config("default", {f"perf.{k}": v for k, v in kw.items()}).perf


def test_auto_compiles_small_dense_models_whole_in_one_process():
    small = _meta("llama")
    mode, why = resolve.compile_mode_rule(_perf(), True, small, "llama", ONE, GPU)
    assert mode == "model" and why.startswith("auto: whole model")
    assert resolve.compile_mode_rule(_perf(), True, _meta("gpt2"), "gpt2", ONE, GPU)[0] == "model"
    # each exception, with its reason
    cases = [
        ((_perf(), False, small, "llama", ONE, GPU), "not compiled"),
        ((_perf(), True, small, "llama", ONE, torch.device("cpu")), "per-block on cpu"),
        ((_perf(), True, small, "llama", DistInfo(world_size=2, strategy="ddp"), GPU), "several processes"),
        ((_perf(), True, small, "llama", DistInfo(strategy="fsdp", cpu_offload=True), GPU), "offload"),
        ((_perf(), True, _meta("deepseek"), "deepseek", ONE, GPU), "per-block for deepseek"),
    ]
    for args, reason in cases:
        mode, why = resolve.compile_mode_rule(*args)
        assert mode == "blocks" and reason in why, (args[3], why)
    frozen = _meta("llama")
    for p in list(frozen.parameters())[:-1]:
        p.requires_grad_(False)
    assert resolve.compile_mode_rule(_perf(), True, frozen, "llama", ONE, GPU)[0] == "blocks"
    # size: the threshold on non-embedding parameters
    wide = _meta("llama", d_model=2048, n_layers=12, n_heads=16, n_kv_heads=16, ffn_dim=5632)
    assert wide.num_params(non_embedding=True) > resolve.WHOLE_MODEL_MAX_PARAMS
    assert resolve.compile_mode_rule(_perf(), True, wide, "llama", ONE, GPU)[0] == "blocks"
    mid = _meta("llama", d_model=1024, n_layers=24, n_heads=16, n_kv_heads=16, ffn_dim=2816)
    assert mid.num_params(non_embedding=True) < resolve.WHOLE_MODEL_MAX_PARAMS
    assert resolve.compile_mode_rule(_perf(), True, mid, "llama", ONE, GPU)[0] == "model"
    # asked settings stand
    assert resolve.compile_mode_rule(_perf(compile_mode="blocks"), True, small, "llama", ONE, GPU) == (
        "blocks",
        "asked",
    )
    assert resolve.compile_mode_rule(_perf(compile_mode="model"), True, wide, "llama", ONE, GPU) == (
        "model",
        "asked",
    )


def _cpu_hw() -> HardwareProfile:
    """This CPU's profile, with a working torch.compile (the tests replace its backend)."""
    return dataclasses.replace(hardware.detect("cpu"), compile=True)


@pytest.fixture
def auto_picks_model(monkeypatch):
    """compile_mode auto as on a GPU (the rule leaves CPUs per-block) for the CPU model of these tests."""
    rule = resolve.compile_mode_rule
    monkeypatch.setattr(resolve, "compile_mode_rule", lambda *a: rule(*a[:5], GPU, *a[6:]))


@pytest.fixture
def recorded(monkeypatch):
    """torch.compile with an eager backend that records the size of each graph it is handed."""
    graphs: list[int] = []
    real = torch.compile

    def backend(gm, example_inputs):
        graphs.append(sum(1 for n in gm.graph.nodes if n.op == "call_function"))
        return gm.forward

    def fake_compile(fn, *args, mode=None, **kw):
        return real(fn, backend=backend)

    monkeypatch.setattr(torch, "compile", fake_compile)
    torch._dynamo.reset()
    yield graphs
    torch._dynamo.reset()


def _built(raw, perf, family="llama"):
    """The transforms as the assembly applies them on this CPU (a working compile backend)."""
    cpu = torch.device("cpu")
    spec = resolve.resolve_transforms(raw, perf=perf, hw=_cpu_hw(), device=cpu, dist=ONE, family=family)
    return setup.apply_transforms(raw, spec, device=cpu, dist=ONE, family=family)


def _raw(n_layers: int = 2):
    args = models.model_args("llama", "debug", {"vocab_size": 256, "n_layers": n_layers})
    return setup.build_raw_model("llama", args, torch.device("cpu"), seed=0)


def test_whole_model_graph_trains_and_per_block_graphs_evaluate(recorded):
    raw, reference = _raw(3), _raw(3)
    built = _built(raw, _perf(compile=True, compile_mode="model", cuda_graphs=False))
    assert built.resolved["compile"] == "model" and "cuda_graphs" not in built.resolved
    assert setup.whole_model_later(built.spec, ONE)
    x = torch.randint(0, 256, (2, 16))
    with built.forward_context():  # before the batch is planned (the probe's steps): the per-block graphs
        built.model(x).float().sum().backward()
    assert len(recorded) == 1, recorded
    block = recorded[0]
    setup.apply_whole_model_compile(built)
    with built.forward_context():
        out = built.model(x)
    out.float().sum().backward()
    assert len(recorded) == 2 and recorded[1] > 2 * block, recorded  # the whole model, blocks inlined
    with torch.no_grad(), built.forward_context():
        ev = built.model(x)
    assert len(recorded) == 3 and recorded[2] < recorded[1] / 2, recorded  # one block's inference graph
    with torch.no_grad():
        torch.testing.assert_close(ev, reference(x))
        torch.testing.assert_close(out, reference(x))
    with built.forward_context():  # training again: the whole-model graph, nothing new traced
        built.model(x).float().sum().backward()
    with torch.no_grad(), built.forward_context():
        built.model(x)
    assert len(recorded) == 3, recorded
    # the weights are the plain model's, under their own names
    assert {n for n, _ in raw.named_parameters()} == {
        n.removeprefix("module.") for n, _ in built.model.named_parameters()
    }


def test_blocks_mode_compiles_blocks_only(recorded):
    built = _built(_raw(), _perf(compile=True, compile_mode="blocks"))
    assert built.resolved["compile"] == "blocks" and not setup.whole_model_later(built.spec, ONE)
    x = torch.randint(0, 256, (2, 16))
    with built.forward_context():
        built.model(x).float().sum().backward()
    assert len(recorded) == 1 and built.model is built.raw


def test_a_short_run_keeps_the_blocks_of_an_auto_whole_model_compile(recorded, auto_picks_model):
    spec = _built(_raw(), _perf(compile=True)).spec
    assert spec.whole_model_auto and spec.compile_mode == "model" and not spec.cuda_graphs
    blocks = spec.with_blocks("auto: a short run")
    assert blocks.compile_mode == "blocks" and blocks.why["compile"].endswith("; blocks: auto: a short run")
    assert not blocks.whole_model_auto and not setup.whole_model_later(blocks, ONE)
    assert blocks.resolved()["compile"] == "blocks" and spec.resolved()["compile"] == "model"
    asked = _built(_raw(), _perf(compile=True, compile_mode="model")).spec
    assert asked.compile_mode == "model" and not asked.whole_model_auto  # asked: kept whatever the length
    graphs = _built(_raw(), _perf(compile=True, cuda_graphs=True))
    # auto chose the whole model and CUDA graphs are asked: they replay the whole-model graph, kept at any length
    assert graphs.spec.compile_mode == "model" and not graphs.spec.whole_model_auto
    assert graphs.resolved["cuda_graphs"] is True and graphs.keep_grads


def test_cuda_graphs_rule_decides_the_compile_mode_and_says_why(monkeypatch):
    """``perf.cuda_graphs = auto`` as the rule resolves it: reduce-overhead blocks, gradients kept, the reason in the
    plan; or nothing of it."""

    def built(rule):
        monkeypatch.setattr(resolve, "cuda_graphs_rule", lambda *a: rule)
        return _built(_raw(), _perf(compile=True, compile_mode="blocks"))

    on = built((True, "auto: LoRA test"))
    assert on.resolved["cuda_graphs"] is True and on.why["cuda_graphs"] == "auto: LoRA test"
    assert on.resolved["inductor_mode"] == "reduce-overhead" and on.keep_grads
    off = built((False, "auto"))
    assert "cuda_graphs" not in off.resolved and "inductor_mode" not in off.resolved and not off.keep_grads


def test_the_assembly_keeps_the_whole_model_for_long_runs_only(recorded, auto_picks_model):
    from types import SimpleNamespace

    from gptoughts.training.build import _whole_model_for_long_runs

    env = SimpleNamespace(
        device=torch.device("cuda"),
        hw=SimpleNamespace(peak_bf16_flops=1e15, name="GPU"),
        dist=ONE,
    )
    kept = {}
    for steps in (10, 10**10):
        raw = _raw()
        built = _built(raw, _perf(compile=True))
        model = SimpleNamespace(raw=raw, args=raw.args, built=built, transforms=built.spec)
        batch = SimpleNamespace(block_size=256, micro_batch=8, total_steps=steps, tokens_per_step=2048)
        _whole_model_for_long_runs(env, model, batch)
        kept[steps] = (built.resolved["compile"], model.transforms.compile_mode, built.spec.compile_mode)
        if steps == 10:
            assert "blocks: auto: a run estimated at ~1 min" in built.why["compile"], built.why
    assert kept == {10: ("blocks",) * 3, 10**10: ("model",) * 3}


def test_activation_checkpointing_auto_is_selective_for_lora_only():
    from gptoughts.config import LoraConfig
    from gptoughts.perf.checkpointing import resolve

    assert resolve("auto", LoraConfig(enabled=True))[0] == "selective"
    assert (
        resolve("auto", LoraConfig(enabled=True, quantize="4bit"))[0] == "none"
    )  # would recompute 4-bit matmuls
    assert resolve("auto", LoraConfig(enabled=False))[0] == "none"
    assert resolve("auto", None)[0] == "none"
    assert resolve("full", LoraConfig(enabled=True)) == ("full", "asked")
    assert load_config("default", {}).perf.activation_checkpointing == "auto"


def test_timing_runs_train_the_whole_model_graph_the_plan_reports(recorded):
    """``bench`` (and every timing run built on ``timing_trainer``) times the graph ``train`` runs: with the compile
    resolved to ``model``, its steps go through the whole-model graph, not the per-block graphs compiled before the
    batch was planned (which ran without CUDA graphs while the result said ``model``)."""
    from gptoughts.tools.bench import run_bench

    cfg = load_config(
        "default",
        {
            "model.size": "debug",
            "model.n_layers": 3,
            "train.block_size": 16,
            "train.batch_size": 2,
            "perf.device": "cpu",
            "perf.precision": "fp32",
            "perf.compile": True,
            "perf.compile_mode": "model",
            "run.progress": False,
        },
    )
    one = _built(_raw(3), _perf(compile=True, compile_mode="blocks"))
    with one.forward_context():
        one.model(torch.randint(0, 256, (2, 16))).float().sum().backward()
    block = recorded.pop()  # one block's graph, for scale
    torch._dynamo.reset()
    r = run_bench(cfg, steps=1, warmup=1)
    assert r["resolved"]["compile"] == "model"
    assert recorded and recorded[-1] > 2 * block, (
        recorded,
        block,
    )  # the steps ran the whole model, blocks inlined
