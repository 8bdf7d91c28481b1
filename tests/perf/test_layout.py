"""The memory layout chooser (issue 36, items 1 and 4): when a model's training state does not fit the GPU (or
``--gpu_memory_gib``), the settings the user left to their defaults change in a fixed order (activation
checkpointing, optimizer states, CPU offload) until the estimate fits; where nothing does, the refusal names every
option with the memory it needs. Everything here runs on estimates (meta-device models): no GPU, no allocation.
A GPU run is rehearsed on this CPU machine by a pretend H100 profile (the cap is a GPU's: on a CPU the plan is
bounded by the host's available memory instead, and no layout is chosen)."""

from __future__ import annotations

import functools
import re

import cli_helpers
import pytest
import torch
from cli_helpers import GIB, HOST_GIB, run_cli
from cli_helpers import h100 as _h100

import gptoughts
from gptoughts import models
from gptoughts.config import load_config
from gptoughts.errors import UserError
from gptoughts.perf import autobatch
from gptoughts.perf.estimate import estimate
from gptoughts.perf.layout import FIT, Layout, LayoutSearch, Need
from gptoughts.training import batches as batches_mod
from gptoughts.training import build as build_mod
from gptoughts.training import corpus as corpus_mod
from gptoughts.training import environment as environment_mod
from gptoughts.training import modeling as modeling_mod
from gptoughts.training.checkpoint import staging

CAPS = (16, 24, 40, 80)
# The seeds' sizes (the INL guide's 3b and 4b, the textbook's Llamas) and each other family's sizes.
SEED_SIZES = [("inl", "3b"), ("inl", "4b"), ("llama", "1b"), ("llama", "3b"), ("llama", "8b"), ("deepseek", "small"),
              ("deepseek", "16b"), ("llada", "medium"), ("llada", "8b"), ("gpt2", "small"), ("gpt2", "xl")]  # fmt: skip
OFFLOAD_FLAG = "--parallel.cpu_offload true"


@pytest.fixture
def pretend_gpu(monkeypatch):
    cli_helpers.pretend_gpu(monkeypatch)


def _args(family: str, size: str):
    cfg = load_config(None, {"model.family": family, "model.size": size})
    spec = str(cfg.data.tokenizer)
    vocab = int(spec.split(":")[1]) if spec.startswith("bpe:") else 320
    return cfg, {"vocab_size": -(-vocab // 64) * 64}


@functools.cache
def _need(family: str, size: str, layout: Layout) -> Need:
    """The estimate a run of ``family``/``size`` at its size defaults (micro-batch 1: the auto batch's smallest)
    makes for ``layout``: what the chooser sees (bf16 residual, chunked loss, one GPU)."""
    cfg, overrides = _args(family, size)
    e = estimate(
        family,
        size,
        overrides,
        batch_size=1,
        block_size=cfg.train.block_size,
        activation_checkpointing=layout.activation_checkpointing,
        optimizer_states=layout.optimizer_states,
        cpu_offload=layout.cpu_offload,
        residual_dtype="bf16",
    )
    staged = e.checkpoint_staging_gib  # background checkpoints' host copy (async_save, the default)
    return Need(e.total_gib, e.host_gib + staged, staged)


def _search(family: str, size: str, cap: float, **kw) -> LayoutSearch:
    cfg, _ = _args(family, size)
    ac = cfg.perf.activation_checkpointing
    start = Layout(activation_checkpointing="none" if ac == "auto" else ac)
    return LayoutSearch(
        start=start,
        measure=functools.partial(_need, family, size),
        gpu_gib=cap,
        host_gib=kw.pop("host_gib", HOST_GIB),
        what=f"{family}/{size}",
        where=f"this GPU's {cap:.1f} GiB",
        shape=f"micro-batch 1 x {cfg.train.block_size:,} tokens",
        **kw,
    )


# ------------------------------------------------------------------------------------------------ item 4
@pytest.mark.parametrize(("family", "size"), SEED_SIZES)
def test_the_chosen_layout_fits_each_cap_or_the_refusal_names_offload(family, size):
    for cap in CAPS:
        search = _search(family, size, cap)
        choice = search.choose()
        if choice.refusal is None:
            need = _need(family, size, choice.layout)  # the estimator's own figure, not the chooser's
            assert need.gpu_gib <= FIT * cap, (family, size, cap, choice)
            assert not choice.layout.cpu_offload or need.host_gib <= FIT * HOST_GIB
            if choice.layout == search.start:
                assert choice.why == {}
            else:  # each setting changed says why, with the figure it went by
                assert set(choice.why) == set(choice.layout.changes(search.start)), choice.why
                assert all("auto" in w and "GiB" in w for w in choice.why.values()), choice.why
        else:
            text = choice.refusal
            assert choice.layout == search.start and OFFLOAD_FLAG in text and "host" in text, text
            assert "\n" not in text and "--ignore_memory_estimate" in text
            # every option with the memory it would need
            assert text.count("GiB") >= 4 and "--activation_checkpointing full" in text, text
            assert "--train.optimizer_states bf16" in text, text


def test_the_guides_hardware_gets_a_layout_in_the_fixed_order():
    """inl/3b on 24 GiB: its states alone (~34 GiB) exceed the card, checkpointing and bf16 states are not
    enough, CPU offload is; inl/4b on 40 GiB without accumulation: its size's selective checkpointing with bf16
    states fits (the Triton integrator keeps nothing under it), no offload (under accumulation the kept gradients
    need more: the plan snapshot); llama/3b on 40 GiB: bf16 states alone, without the checkpointing that would
    not be needed."""
    three = _search("inl", "3b", 24).choose()
    assert three.refusal is None and three.layout.cpu_offload, three
    assert set(three.why) == {"cpu_offload"}, three.why  # the size's selective checkpointing fits offloaded
    assert "host" in three.why["cpu_offload"]
    four = _search("inl", "4b", 40).choose()
    assert four.layout == Layout("selective", "bf16", False), four
    llama = _search("llama", "3b", 40).choose()
    assert llama.layout == Layout("none", "bf16", False), llama


def test_nothing_changes_when_the_plain_layout_fits():
    for family, size in (("llama", "1b"), ("inl", "3b"), ("gpt2", "small")):
        search = _search(family, size, 80)
        choice = search.choose()
        assert choice.layout == search.start and choice.why == {} and choice.refusal is None


def test_a_value_the_user_set_is_kept():
    """perf.activation_checkpointing and train.optimizer_states set: the chooser goes straight to offload; with
    offload set false as well, nothing is left: refused, saying the offload it would have needed."""
    fixed = {"activation_checkpointing": "you set it", "optimizer_states": "you set it"}
    choice = _search("llama", "3b", 40, fixed=dict(fixed)).choose()
    assert choice.layout == Layout("none", "fp32", True), choice
    fixed["cpu_offload"] = "you set --parallel.cpu_offload false"
    choice = _search("llama", "3b", 40, fixed=fixed).choose()
    assert choice.layout == Layout() and choice.refusal is not None
    assert OFFLOAD_FLAG in choice.refusal and "you set --parallel.cpu_offload false" in choice.refusal


def test_the_host_must_hold_what_is_offloaded():
    """Offload moves the states to host memory: with too little of it, offload is not a layout that fits, and the
    refusal says how much host memory it would need and how much there is."""
    choice = _search("llama", "8b", 24, host_gib=32.0).choose()
    assert choice.refusal is not None, choice
    m = re.search(
        r"--parallel\.cpu_offload true ~[\d.]+ GiB and ~([\d.]+) GiB of host memory", choice.refusal
    )
    assert m and float(m.group(1)) > 32, choice.refusal
    assert "32.0 GiB available" in choice.refusal


def test_8bit_states_only_where_torchao_is():
    plain = _search("llama", "3b", 34).choose()
    assert plain.layout.optimizer_states != "8bit"
    eight = _search("llama", "3b", 34, eight_bit=True).choose()
    assert eight.layout.optimizer_states == "8bit" and not eight.layout.cpu_offload, eight
    offloaded = _search("llama", "3b", 16, eight_bit=True).choose()  # 8-bit states are not sharded (FSDP)
    assert offloaded.layout.cpu_offload and offloaded.layout.optimizer_states != "8bit", offloaded


# ------------------------------------------------------------------------------------------------ item 1
def test_the_config_records_what_the_user_set_not_the_sizes_defaults():
    cfg = load_config(None, {"model.family": "inl", "model.size": "3b", "perf.gpu_memory_gib": 24})
    assert cfg.perf.activation_checkpointing == "selective"  # the size's default: the chooser may raise it
    assert "perf.activation_checkpointing" not in cfg.given and "perf.gpu_memory_gib" in cfg.given
    cfg = load_config(
        None, {"model.size": "3b", "perf.activation_checkpointing": "none", "parallel.cpu_offload": False}
    )
    assert {"perf.activation_checkpointing", "parallel.cpu_offload"} <= cfg.given


def _dry_run(tmp_path, text_corpus, capsys, **overrides):
    _, _, history = gptoughts.train(
        data_path=str(text_corpus),
        save_dir=str(tmp_path / "run"),
        dry_run=True,
        **{"data.tokenizer": "bytes", "train.block_size": 64, "perf.compile": False, **overrides},
    )
    return history.plan, capsys.readouterr().out


def _debug_need(tmp_path, text_corpus, capsys, layout: Layout, batch: int = 4) -> float:
    plan, _ = _dry_run(
        tmp_path,
        text_corpus,
        capsys,
        **{
            "perf.activation_checkpointing": layout.activation_checkpointing,
            "train.optimizer_states": layout.optimizer_states,
            "train.batch_size": batch,
        },
    )
    return plan["memory_gib"]


def test_a_dry_run_on_a_small_gpu_plans_the_layout_and_says_why(
    tmp_path, text_corpus, cache_dir, capsys, pretend_gpu
):
    """End to end through gptoughts.train(dry_run=True): the debug model with a cap between its plain estimate and
    its estimate with selective checkpointing; the plan prints the layout chosen, one line each, with why; the
    returned plan records it; nothing is written."""
    plain = _debug_need(tmp_path, text_corpus, capsys, Layout())
    selective = _debug_need(tmp_path, text_corpus, capsys, Layout("selective"))
    assert selective < plain
    cap = (selective / FIT + plain / FIT) / 2  # selective fits under FIT, the plain layout does not
    plan, text = _dry_run(
        tmp_path, text_corpus, capsys, **{"perf.gpu_memory_gib": cap, "train.batch_size": 4}
    )
    line = next(ln for ln in text.splitlines() if "activation checkpointing:" in ln)
    assert re.search(r"activation checkpointing: (selective|full) \(auto: .*[MG]iB", line), line
    assert plan["memory_gib"] <= FIT * cap and plan["device_memory_gib"] == pytest.approx(cap)
    assert plan["resolved"]["activation_checkpointing"].split(" ")[0] in ("selective", "full")
    assert not (tmp_path / "run").exists()


def test_a_set_value_is_kept_end_to_end(tmp_path, text_corpus, cache_dir, capsys, pretend_gpu):
    """A cap where selective checkpointing would be chosen; with --activation_checkpointing none given, the next
    step, bf16 states, is chosen instead and checkpointing stays off."""
    # 16 rows: enough activations for selective checkpointing to save more than bf16 optimizer states
    plain = _debug_need(tmp_path, text_corpus, capsys, Layout(), batch=16)
    bf16 = _debug_need(tmp_path, text_corpus, capsys, Layout(optimizer_states="bf16"), batch=16)
    selective = _debug_need(tmp_path, text_corpus, capsys, Layout("selective"), batch=16)
    assert selective < bf16 < plain
    cap = (bf16 / FIT + plain / FIT) / 2
    plan, text = _dry_run(
        tmp_path, text_corpus, capsys, **{"perf.gpu_memory_gib": cap, "train.batch_size": 16}
    )
    assert plan["resolved"]["activation_checkpointing"].startswith("selective (auto")
    assert "optimizer_states" not in plan["resolved"]
    given = {"perf.gpu_memory_gib": cap, "train.batch_size": 16, "perf.activation_checkpointing": "none"}
    plan, text = _dry_run(tmp_path, text_corpus, capsys, **given)
    assert (
        plan["resolved"]["activation_checkpointing"] == "none (asked)"
        and "activation checkpointing:" not in text
    )
    assert re.search(r"optimizer states: bf16 \(auto: .*[MG]iB", text), text
    assert plan["memory_gib"] <= FIT * cap


def test_a_run_nothing_fits_is_refused_in_one_line_before_anything_is_written(
    tmp_path, text_corpus, cache_dir, capsys, pretend_gpu
):
    """The user's command with a cap nothing fits (and checkpointing set off): exit 2, one line naming each option
    with its memory, offload included, and what the user set; no traceback; no run directory."""
    plain = _debug_need(tmp_path, text_corpus, capsys, Layout())
    out = tmp_path / "run"
    argv = ["train", "--data", str(text_corpus), "--out", str(out), "--tokenizer", "bytes", "--block_size", "64",
            "--batch_size", "4", "--max_steps", "1", "--compile", "false", "--activation_checkpointing", "none",
            "--gpu_memory_gib", str(plain / 50)]  # fmt: skip
    code, text = run_cli(argv, capsys)
    errors = [ln for ln in text.splitlines() if ln.startswith("error:")]
    assert code == 2 and "Traceback" not in text and len(errors) == 1, text[-2000:]
    line = errors[0]
    for option in ("--activation_checkpointing full", "--train.optimizer_states bf16", OFFLOAD_FLAG):
        assert re.search(re.escape(option) + r" ~[\d.]+ [MG]iB", line), line
    assert "you set perf.activation_checkpointing = none" in line and "--ignore_memory_estimate" in line
    assert not out.exists()


def test_autobatch_finding_nothing_gives_the_layout_refusal(tmp_path, cache_dir, monkeypatch):
    """The real-step search finding not even one row (the estimate said one fits): the same informative refusal,
    naming offload and the memory figures, instead of a bare "lower --block_size"."""
    from types import SimpleNamespace

    from gptoughts.training import setup

    monkeypatch.setattr(autobatch, "search", lambda fits, max_batch=1024: 0)
    with pytest.raises(autobatch.NothingFits):
        autobatch.find_batch_size(lambda b: None, torch.device("cpu"), parts={"k": 1},
                                  cache=autobatch.BatchCache(tmp_path / "c.json"))  # fmt: skip

    def nothing_fits(*a, **k):
        raise autobatch.NothingFits()

    monkeypatch.setattr(setup, "auto_micro_batch", nothing_fits)
    monkeypatch.setattr(staging, "host_memory_available", lambda: int(HOST_GIB * GIB))
    cfg = load_config(None, {"model.family": "inl", "model.size": "3b", "perf.gpu_memory_gib": 24})
    env = environment_mod.Environment(
        device=torch.device("cuda", 0), dist=build_mod.pdist.DistInfo(), hw=_h100(24), precision="bf16"
    )
    args = models.model_args("inl", "3b", _args("inl", "3b")[1])
    model = modeling_mod.Model(family=models.get_family("inl"), args=args, raw=None, weights=None)
    model.built = SimpleNamespace(resolved={})
    with pytest.raises(UserError) as e:
        batches_mod.plan_batches(cfg, env, corpus_mod.synthetic_data(args.vocab_size), model)
    text = str(e.value)
    assert "not even one row of 2,048 tokens" in text and OFFLOAD_FLAG in text, text
    assert re.search(r"--train.optimizer_states bf16 ~[\d.]+ GiB", text) and "\n" not in text, text


def test_on_a_cpu_the_cap_is_a_gpus_and_no_layout_is_chosen(tmp_path, text_corpus, cache_dir, capsys):
    """--gpu_memory_gib bounds a GPU: a CPU run ignores it (its plan is bounded by the host's available memory) and
    keeps its layout as set."""
    plan, text = _dry_run(
        tmp_path,
        text_corpus,
        capsys,
        **{"perf.device": "cpu", "perf.gpu_memory_gib": 1e-4, "train.batch_size": 4},
    )
    assert plan["device_type"] == "cpu" and plan["device_memory_gib"] > 1e-3
    assert not {"optimizer_states", "cpu_offload"} & set(plan["resolved"])
    assert plan["resolved"]["activation_checkpointing"] == "none (auto)"  # the size's own, not the layout's
    assert "CPU offload:" not in text and "optimizer states:" not in text


def test_offload_chosen_for_a_real_run_starts_its_process_group(cache_dir, monkeypatch):
    """A run (not a dry one) that the chooser offloads gets the one-process group offload needs, as one given
    --parallel.cpu_offload true does, and trains with the layout it was given: the size's selective checkpointing
    and fp32 states kept, offload's reason in the config's resolved entries."""
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(staging, "host_memory_available", lambda: int(HOST_GIB * GIB))
    over = {"model.family": "inl", "model.size": "3b", "perf.gpu_memory_gib": 24, "parallel.backend": "gloo"}
    cfg = load_config(None, over)
    env = environment_mod.Environment(
        device=torch.device("cuda", 0), dist=build_mod.pdist.DistInfo(), hw=_h100(24), precision="bf16"
    )
    args = models.model_args("inl", "3b", _args("inl", "3b")[1])
    model = modeling_mod.Model(family=models.get_family("inl"), args=args, raw=None, weights=None)
    try:
        chosen, env = build_mod.choose_memory_layout(cfg, env, model, dry_run=False)
        assert torch.distributed.is_initialized() and env.dist.cpu_offload and env.dist.strategy == "fsdp"
    finally:
        build_mod.pdist.shutdown()
    assert chosen.parallel.cpu_offload and chosen.perf.activation_checkpointing == "selective"
    assert chosen.train.optimizer_states == "fp32" and chosen.resolved["cpu_offload"].startswith(
        "true (auto:"
    )
    assert not cfg.parallel.cpu_offload  # the caller's config is not changed in place


def test_the_probes_cached_micro_batch_is_keyed_by_what_changes_its_memory(cache_dir, monkeypatch):
    """The micro-batch found in real steps is cached per model and GPU. A run that differs in what fills the memory
    (optimizer, its states' storage, the GPU cap, offload) must probe again: reusing another
    layout's micro-batch runs out of memory at the first step, or wastes the GPU."""
    from dataclasses import replace
    from types import SimpleNamespace

    from gptoughts.training import setup

    keys: list[str] = []

    def record(*a, parts, **k):
        keys.append(autobatch.cache_key(parts))
        return 4, False

    monkeypatch.setattr(setup, "auto_micro_batch", record)
    monkeypatch.setattr(staging, "host_memory_available", lambda: int(HOST_GIB * GIB))
    args = models.model_args("llama", "125m", _args("llama", "125m")[1])
    dist = build_mod.pdist.DistInfo()

    def key_of(overrides: dict, gib: int = 80, offload: bool = False) -> str:
        cfg = load_config(None, {"model.size": "125m", "train.batch_size": "auto", **overrides})
        env = environment_mod.Environment(
            device=torch.device("cuda", 0),
            dist=replace(dist, cpu_offload=offload),
            hw=_h100(gib),
            precision="bf16",
        )
        model = modeling_mod.Model(family=models.get_family("llama"), args=args, raw=None, weights=None)
        model.built = SimpleNamespace(resolved={"activation_checkpointing": "none"})
        batches_mod._auto_batch(cfg, env, model, False, {})
        return keys[-1]

    base = key_of({})
    assert key_of({}) == base  # the same run: the cache serves it
    for other in (
        key_of({"train.optimizer_states": "bf16"}),
        key_of({"train.optimizer": "muon"}),
        key_of({}, gib=40),
        key_of({}, offload=True),
        key_of({"perf.loss_chunk": 256}),
    ):
        assert other != base


def test_the_probes_margin_is_of_the_capped_memory(cache_dir, monkeypatch):
    """Under --gpu_memory_gib the probe keeps its margin below the cap, not below the whole GPU: INL 4b capped at
    40 GiB on an H200 chose micro-batch 6 (planned at 39.7 GiB), and the run's first step ran out of memory."""
    from types import SimpleNamespace

    from gptoughts.perf.autobatch import find_batch_size
    from gptoughts.training import setup

    asked: list[int | None] = []

    def record(*a, capacity=None, **k):
        asked.append(capacity)
        return 4, False

    monkeypatch.setattr(setup, "auto_micro_batch", record)
    args = models.model_args("llama", "125m", _args("llama", "125m")[1])
    for gib in (80, 40):
        cfg = load_config(None, {"model.size": "125m", "train.batch_size": "auto"})
        env = environment_mod.Environment(
            device=torch.device("cuda", 0), dist=build_mod.pdist.DistInfo(), hw=_h100(gib), precision="bf16"
        )
        model = modeling_mod.Model(family=models.get_family("llama"), args=args, raw=None, weights=None)
        model.built = SimpleNamespace(resolved={"activation_checkpointing": "none"})
        batches_mod._auto_batch(cfg, env, model, False, {})
    assert asked == [80 * GIB, 40 * GIB]
    # and the search takes that margin: 36.5 GiB of 40 fails where it would pass against 80
    peak_gib = {5: 34.0, 6: 36.5}

    def search_with(capacity: int) -> int:
        seen = {"rows": 0}
        return find_batch_size(
            lambda rows: seen.update(rows=rows),
            torch.device("cpu"),
            parts={"cap": capacity},
            cache=autobatch.BatchCache(cache_dir / f"probe-{capacity}.json"),
            max_batch=6,
            capacity=capacity,
            peak=lambda: int(peak_gib.get(seen["rows"], 1.0) * GIB),
        )[0]

    assert (search_with(80 * GIB), search_with(40 * GIB)) == (6, 5)


def test_the_plans_estimate_uses_the_planned_accumulation_for_fsdps_unsharded_gradient():
    """An FSDP run's plan passes its planned accumulation (a resume on fewer ranks raises it above the config's):
    FSDP2 then keeps each rank's whole unsharded gradient between micro-batches, which the estimate must count."""
    from dataclasses import replace
    from types import SimpleNamespace

    from gptoughts.training.estimates import estimate_peak

    cfg = load_config(None, {"model.size": "125m", "train.batch_size": 4, "train.grad_accum": 1})
    dist = replace(build_mod.pdist.DistInfo(), world_size=4, strategy="fsdp", sync_every_microbatch=False)
    env = environment_mod.Environment(
        device=torch.device("cuda", 0), dist=dist, hw=_h100(80), precision="bf16"
    )
    args = models.model_args("llama", "125m", _args("llama", "125m")[1])
    model = modeling_mod.Model(family=models.get_family("llama"), args=args, raw=None, weights=None)
    model.built = SimpleNamespace(resolved={}, keep_grads=False)
    as_configured = estimate_peak(cfg, env, model, 4, cfg.train.block_size, 4)
    planned = estimate_peak(cfg, env, model, 4, cfg.train.block_size, 4, grad_accum=2)
    whole = 4 * as_configured.params / 2**30  # one rank's unsharded fp32 gradient
    assert abs(planned.gradients_gib - (as_configured.gradients_gib + whole)) < 1e-6
