"""``train.optimizer_states``: AdamW's moments in fp32, bf16 (our step, stochastic rounding) or 8 bits (torchao)."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from gptoughts.errors import ConfigError, UserError
from gptoughts.training.optim import (
    AdamWBf16States,
    Muon,
    bf16_stochastic_round,
    build_adamw,
    build_muon,
    clip_and_step,
    set_lr,
    with_states,
)

HYPER = dict(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))


def _batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(6, 16, generator=g) for _ in range(n)]


def _train(
    model: nn.Module, opt: torch.optim.Optimizer, steps: int, max_norm: float = math.inf
) -> list[float]:
    """``steps`` steps through clip_and_step (as the trainer calls it); the losses."""
    fused = bool(opt.defaults.get("fused"))
    losses = []
    for x in _batches(steps):
        loss = model(x).pow(2).mean()
        loss.backward()
        clip_and_step(opt, list(model.parameters()), max_norm, loss.detach(), fused=fused)
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_stochastic_rounding_is_unbiased_where_rounding_to_nearest_is_not():
    x = torch.full((200_000,), 1.0 + 2**-10)  # 1/8 of the way from 1 to the next bf16 (1 + 2**-7)
    torch.manual_seed(0)
    r = bf16_stochastic_round(x)
    assert r.dtype == torch.bfloat16
    assert set(r.float().unique().tolist()) == {1.0, 1.0 + 2**-7}  # only the two neighbours
    assert r.float().mean().item() == pytest.approx(1.0 + 2**-10, abs=2e-5)
    assert x.bfloat16().float().mean().item() == 1.0  # what a plain cast would keep: the increment lost
    exact = torch.randn(1000).bfloat16().float()  # values bf16 holds exactly are kept as they are
    assert torch.equal(bf16_stochastic_round(exact).float(), exact)
    neg = torch.full((200_000,), -(1.0 + 2**-10))
    assert bf16_stochastic_round(neg).float().mean().item() == pytest.approx(-(1.0 + 2**-10), abs=2e-5)


@pytest.mark.parametrize("max_norm", [math.inf, 0.05])
def test_bf16_states_follow_fp32_adamw(max_norm):
    """Same update as torch's AdamW (clipping folded in through grad_scale) up to the bf16 rounding of the moments;
    the moments are bf16, the weights stay fp32."""
    ref_model, model = _model(), _model()
    ref = build_adamw(ref_model, fused=False, **HYPER)
    opt = build_adamw(model, fused=False, states="bf16", **HYPER)
    assert isinstance(opt, AdamWBf16States) and opt.defaults["fused"]  # the trainer's device-side path
    assert [len(g["params"]) for g in opt.param_groups] == [len(g["params"]) for g in ref.param_groups]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    start = _flat(model)
    ref_losses = _train(ref_model, ref, 6, max_norm)
    losses = _train(model, opt, 6, max_norm)
    moved = (_flat(ref_model) - start).abs().max()
    assert (_flat(model) - _flat(ref_model)).abs().max() < 0.01 * moved  # bf16 has 8 bits of mantissa
    assert losses == pytest.approx(ref_losses, rel=1e-3)
    for p in model.parameters():
        s = opt.state[p]
        assert p.dtype == torch.float32
        assert s["exp_avg"].dtype == s["exp_avg_sq"].dtype == torch.bfloat16
        assert s["step"].item() == 6
    for key in ("exp_avg", "exp_avg_sq"):
        ours, theirs = opt.state[model[0].weight][key].float(), ref.state[ref_model[0].weight][key]
        assert (ours - theirs).abs().max() < 0.02 * theirs.abs().max()


def test_bf16_second_moment_keeps_increments_below_half_a_bf16_step():
    """beta2 = 0.999, gradient 1 at every step: the second moment is 1 - 0.999**t. Stored rounded to nearest,
    it would stop growing near 0.25 (where its 0.001 * (1 - v) increments fall under half a bf16 step); stored
    with stochastic rounding it follows on average."""
    p = nn.Parameter(torch.zeros(4096))
    opt = AdamWBf16States([p], lr=0.0, betas=(0.9, 0.999))
    torch.manual_seed(0)
    for _ in range(1000):
        p.grad = torch.ones(4096)
        opt.step()
    v = opt.state[p]["exp_avg_sq"].float().mean().item()
    assert v == pytest.approx(1 - 0.999**1000, rel=0.01)


@pytest.mark.slow
def test_compiled_step_is_one_graph_and_matches_eager():
    """The step CUDA runs (torch.compile, fullgraph: a graph break is an error), here through inductor on the
    CPU: the same update as eager up to the stochastic rounding, and a skipped step leaves everything alone."""
    from gptoughts.training.optim import _adamw_bf16_step, _compiled_bf16_step

    torch.manual_seed(0)
    w, m0, v0 = torch.randn(64, 32), torch.randn(64, 32).bfloat16(), torch.rand(64, 32).bfloat16()
    g = torch.randn(64, 32)
    outs = []
    for fn in (_adamw_bf16_step, _compiled_bf16_step()):
        p, m, v, step = w.clone(), m0.clone(), v0.clone(), torch.tensor(3.0)
        args = (torch.tensor(1e-2), 0.9, 0.95, 0.1, 1e-8, torch.tensor(2.0))
        fn(p, g, m, v, step, *args, torch.tensor(0.0))
        outs.append((p.clone(), m.float(), v.float(), step.clone()))
        fn(p, g, m, v, step, *args, torch.tensor(1.0))  # skipped
        assert all(torch.equal(a, b) for a, b in zip((p, m.float(), v.float(), step), outs[-1]))
        assert step.item() == 4
    for a, b in zip(*outs):
        assert torch.allclose(a, b, rtol=1e-2, atol=1e-6)


def test_bf16_states_skip_a_nonfinite_step_on_the_device():
    model = _model()
    opt = build_adamw(model, fused=False, states="bf16", **HYPER)
    _train(model, opt, 2)
    before = _flat(model)
    state = {k: v.clone() for k, v in opt.state[model[0].weight].items()}
    loss = model(_batches(1)[0]).pow(2).mean() * float("nan")
    loss.backward()
    _, found_inf = clip_and_step(opt, list(model.parameters()), 1.0, loss.detach(), fused=True)
    assert found_inf.item() == 1
    assert torch.equal(_flat(model), before)
    for k, v in opt.state[model[0].weight].items():
        assert torch.equal(v, state[k]), k  # moments and step count untouched
    opt.zero_grad(set_to_none=True)
    _train(model, opt, 1)
    assert opt.state[model[0].weight]["step"].item() == 3


def test_bf16_states_round_trip_through_a_state_dict():
    """torch's load_state_dict casts state to the parameters' dtype (fp32): ours casts the moments back, and
    the resumed optimizer continues exactly as the one that saved."""
    model = _model()
    opt = build_adamw(model, fused=False, states="bf16", **HYPER)
    _train(model, opt, 2)
    saved_weights = {k: v.clone() for k, v in model.state_dict().items()}
    saved = copy.deepcopy(opt.state_dict())  # the step updates the state in place
    rng = torch.get_rng_state()
    _train(model, opt, 2)
    after = _flat(model)

    model2 = _model(seed=5)
    model2.load_state_dict(saved_weights)
    opt2 = build_adamw(model2, fused=False, states="bf16", **HYPER)
    opt2.load_state_dict(saved)
    s = opt2.state[model2[0].weight]
    assert s["exp_avg"].dtype == torch.bfloat16 and s["exp_avg_sq"].dtype == torch.bfloat16
    torch.set_rng_state(rng)  # the checkpoint restores the RNG the stochastic rounding draws from
    _train(model2, opt2, 2)
    assert torch.equal(_flat(model2), after)


def test_muon_adamw_groups_take_bf16_states():
    from gptoughts import models

    def build(states: str) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        m = models.build_model("llama", models.model_args("llama", "debug", {"vocab_size": 64}))
        opt = build_muon(m, fused=False, **HYPER)
        return m, with_states(opt, states)

    def steps(m: nn.Module, opt: torch.optim.Optimizer) -> None:
        g = torch.Generator().manual_seed(0)
        for _ in range(3):
            x = torch.randint(0, 64, (2, 16), generator=g)
            loss = m(x).float().logsumexp(-1).mean()
            loss.backward()
            clip_and_step(opt, list(m.parameters()), 1.0, loss.detach(), fused=opt.defaults["fused"])
            opt.zero_grad(set_to_none=True)

    ref_m, ref = build("fp32")
    m, opt = build("bf16")
    assert isinstance(opt, Muon) and opt.adamw_states == "bf16"
    steps(ref_m, ref)
    steps(m, opt)
    for g in opt.param_groups:
        for p in g["params"]:
            s = opt.state[p]
            if g["muon"]:
                assert s["momentum_buffer"].dtype == torch.float32
            else:
                assert s["exp_avg"].dtype == s["exp_avg_sq"].dtype == torch.bfloat16
    # The AdamW groups' weights follow the fp32 run within the bf16 rounding. (Muon's matrices drift further:
    # its bf16 Newton-Schulz amplifies the loss's last-bit differences from the second step on.)
    start = build("fp32")[0]
    adamw = {id(p) for g in opt.param_groups if not g["muon"] for p in g["params"]}
    for p0, p1, p2 in zip(start.parameters(), ref_m.parameters(), m.parameters()):
        if id(p2) in adamw:
            assert (p2 - p1).abs().max() < 0.01 * (p1 - p0).abs().max()
    saved = opt.state_dict()
    _, opt2 = build("bf16")
    opt2.load_state_dict(saved)
    assert any(s.get("exp_avg", torch.empty(0)).dtype == torch.bfloat16 for s in opt2.state.values())
    with pytest.raises(UserError, match="optimizer_states bf16"):
        with_states(build_muon(m, fused=False, **HYPER), "8bit")


def test_8bit_states_are_torchaos_adamw8bit():
    pytest.importorskip("torchao.optim")
    from torchao.optim import AdamW8bit

    torch.manual_seed(0)
    # A matrix large enough to be quantized (torchao keeps tensors under 4096 values in fp32).
    big = lambda: nn.Sequential(nn.Linear(128, 64), nn.GELU(), nn.Linear(64, 8))  # noqa: E731
    model, ref_model = big(), big()
    ref_model.load_state_dict(model.state_dict())
    opt = build_adamw(model, fused=False, states="8bit", **HYPER)
    assert isinstance(opt, AdamW8bit) and not opt.defaults.get("fused")  # clip_and_step's host-checked path
    from gptoughts.training.optim import param_groups

    ref = AdamW8bit(param_groups(ref_model, 0.1), lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(3))
    xs = [x] * 15  # one batch, learnt
    losses = []
    for x in xs:
        for m, o in ((model, opt), (ref_model, ref)):
            set_lr(o, 1e-2)  # lr is a tensor in torchao's groups: set_lr fills it
            loss = m(x).pow(2).mean()
            loss.backward()
            clip_and_step(o, list(m.parameters()), 1.0, loss.detach(), fused=False)
            o.zero_grad(set_to_none=True)
            if o is opt:
                losses.append(loss.item())
    assert torch.equal(_flat(model), _flat(ref_model))
    assert type(opt.state[model[0].weight]["exp_avg"]).__name__ == "OptimState8bit"
    assert losses[-1] < 0.5 * losses[0]


def test_8bit_without_torchao_is_one_line(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torchao.optim", None)  # import fails as if torchao were absent
    with pytest.raises(UserError, match="pip install torchao"):
        build_adamw(_model(), fused=False, states="8bit", **HYPER)


def test_config_refusals():
    from gptoughts.config import load_config

    cfg = load_config("default", {"train.optimizer_states": "bf16"})
    assert cfg.train.optimizer_states == "bf16"
    with pytest.raises(ConfigError, match="optimizer_states"):
        load_config("default", {"train.optimizer_states": "fp16"})
    with pytest.raises(ConfigError, match="optimizer_states bf16"):
        load_config("default", {"train.optimizer_states": "8bit", "train.optimizer": "muon"})


def test_8bit_is_refused_where_it_was_never_checked(monkeypatch):
    import importlib.util
    from types import SimpleNamespace

    from gptoughts.config import TrainConfig
    from gptoughts.parallel.dist import DistInfo
    from gptoughts.training.environment import check_optimizer_states

    find_spec = importlib.util.find_spec  # as if torchao were installed
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: name == "torchao" or find_spec(name, *a)
    )
    t = TrainConfig(optimizer_states="8bit")
    check_optimizer_states(t, DistInfo())  # one process: fine
    fsdp = SimpleNamespace(sharded=True, tp=1, pp=1)
    with pytest.raises(UserError, match="optimizer_states bf16"):
        check_optimizer_states(t, fsdp)
    check_optimizer_states(TrainConfig(optimizer_states="bf16"), fsdp)


def test_estimate_counts_the_state_bytes():
    from gptoughts import models
    from gptoughts.perf.estimate import estimate

    e = {
        s: estimate("llama", "1b", batch_size=1, block_size=256, optimizer_states=s)
        for s in ("fp32", "bf16", "8bit")
    }
    n = e["fp32"].params
    assert e["fp32"].optimizer_gib * 2**30 == pytest.approx(8 * n)
    assert e["bf16"].optimizer_gib * 2**30 == pytest.approx(4 * n)
    assert e["8bit"].optimizer_gib * 2**30 == pytest.approx(2.03125 * n)
    assert e["bf16"].total_gib == pytest.approx(e["fp32"].total_gib - 4 * n / 2**30)
    muon = estimate("llama", "1b", batch_size=1, block_size=256, optimizer="muon", optimizer_states="bf16")
    with torch.device("meta"):
        model = models.build_model("llama", models.model_args("llama", "1b"))
    hidden = models.hidden_matrices(model)
    n_hidden = sum(p.numel() for p in model.parameters() if id(p) in hidden)
    # Muon's fp32 momentum for the hidden matrices, bf16 moments for the rest
    assert muon.optimizer_gib * 2**30 == pytest.approx(4 * n_hidden + 4 * (n - n_hidden))
    with pytest.raises(ConfigError):
        estimate("llama", "debug", batch_size=1, block_size=32, optimizer_states="fp16")


def test_plan_and_estimate_name_the_states(tmp_path, text_corpus, cache_dir, capsys):
    from cli_helpers import FASTRUN, ok

    base = ["train", "--data", str(text_corpus), "--out", str(tmp_path / "r"), *FASTRUN, "--dry_run"]
    text = ok([*base, "--train.optimizer_states", "bf16"], capsys)
    assert "optimizer: adamw (bf16 moments, stochastic rounding)" in text
    text = ok([*base, "--optimizer", "muon", "--optimizer_states", "bf16"], capsys)
    assert "optimizer: muon (bf16 moments, stochastic rounding for the AdamW groups)" in text
    assert "optimizer: adamw (fp32 moments)" in ok(base, capsys)
    gib = {}
    for states in ("fp32", "bf16"):
        text = ok(["estimate", "--size", "1b", "--batch_size", "1", "--optimizer_states", states], capsys)
        gib[states] = float(next(line for line in text.splitlines() if "optimizer" in line).split()[-1])
    assert gib["bf16"] == pytest.approx(gib["fp32"] / 2, abs=0.01)
    assert "optimizer (bf16)" in text  # the estimate says what its optimizer figure assumes


@pytest.mark.distributed
def test_bf16_states_under_fsdp_checkpoint_and_resume(tmp_path, text_corpus, cache_dir, fast):
    """2 gloo ranks under FSDP2: the bf16 moments are sharded like their parameters (DTensors), saved in the
    sharded checkpoint as bf16, and a resume from it continues exactly as the uninterrupted run (the stochastic
    rounding draws from each rank's RNG, which the checkpoint restores); a one-process run resumes from it too."""
    import json

    from torchrun_runs import here, launch

    from gptoughts.training.checkpoint import store as ckpt

    skip = ("train.batch_size", "train.sample_prompts")
    args = ["--data", str(text_corpus), "--log_interval", "1", "--eval_interval", "0", "--save_interval", "3"]
    args += [f"--{k}={v}" for k, v in fast.items() if k not in skip]
    args += ["--optimizer_states", "bf16", "--sample_interval", "0"]

    def losses(out: Path) -> dict[int, float]:
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in rows if "loss" in r}

    def argv(out: Path, batch: str, *extra: str) -> list[str]:
        return ["train", "default", "--out", str(out), "--batch_size", batch, *args, *extra]

    # the uninterrupted run and the resume from its step 3, in turn in one torchrun launch
    fsdp = ["--parallel.strategy", "fsdp", "--max_steps", "5"]
    step3 = tmp_path / "a" / "checkpoints" / "step_000003"
    launch(
        [argv(tmp_path / "a", "2", *fsdp), argv(tmp_path / "b", "2", *fsdp, "--resume", str(step3))],
        tmp=tmp_path,
    )
    full, resumed = losses(tmp_path / "a"), losses(tmp_path / "b")
    index = ckpt.read_dcp_metadata(step3)
    moments = [md for k, md in index.state_dict_metadata.items() if k.endswith(".exp_avg_sq")]
    assert moments and all(md.properties.dtype == torch.bfloat16 for md in moments)
    assert [resumed[s] for s in (4, 5)] == [full[s] for s in (4, 5)]
    here(argv(tmp_path / "c", "4", "--max_steps", "5", "--resume", str(step3)))  # one process: this one
    one = losses(tmp_path / "c")
    assert one[5] == pytest.approx(full[5], rel=1e-2)


@pytest.mark.parametrize("saved_states", ["fp32", "bf16"])
def test_8bit_resumes_a_plain_checkpoint(saved_states):
    """A run resumed with --optimizer_states 8bit from an fp32 or bf16 checkpoint: the moments are quantized as
    they load and the schedule's learning rate still reaches torchao's step (which raised on a float lr)."""
    pytest.importorskip("torchao.optim")
    big = lambda: nn.Sequential(nn.Linear(128, 64), nn.GELU(), nn.Linear(64, 8))  # noqa: E731
    torch.manual_seed(0)
    model = big()
    opt = build_adamw(model, fused=False, states=saved_states, **HYPER)
    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(3))
    model(x).pow(2).mean().backward()
    clip_and_step(
        opt, list(model.parameters()), 1.0, torch.tensor(1.0), fused=bool(opt.defaults.get("fused"))
    )
    saved = opt.state_dict()
    eight = build_adamw(model, fused=False, states="8bit", **HYPER)
    eight.load_state_dict(saved)
    assert type(eight.state[model[0].weight]["exp_avg"]).__name__ == "OptimState8bit"
    m_saved = saved["state"][0]["exp_avg"].float()
    assert torch.allclose(
        eight.state[model[0].weight]["exp_avg"].dequantize(), m_saved, atol=0.02 * m_saved.abs().max()
    )
    set_lr(eight, 5e-3)
    model.zero_grad()
    model(x).pow(2).mean().backward()
    clip_and_step(eight, list(model.parameters()), 1.0, torch.tensor(1.0), fused=False)
    assert all(
        isinstance(g["lr"], torch.Tensor) and g["lr"].item() == pytest.approx(5e-3)
        for g in eight.param_groups
    )


@pytest.mark.parametrize("states", ["fp32", "bf16"])
def test_a_8bit_checkpoint_resumes_with_plain_states(states):
    """The other way: 8-bit moments (which torch's load would keep 8-bit) become plain fp32 / bf16 tensors."""
    pytest.importorskip("torchao.optim")
    big = lambda: nn.Sequential(nn.Linear(128, 64), nn.GELU(), nn.Linear(64, 8))  # noqa: E731
    torch.manual_seed(0)
    model = big()
    eight = build_adamw(model, fused=False, states="8bit", **HYPER)
    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(3))
    model(x).pow(2).mean().backward()
    clip_and_step(eight, list(model.parameters()), 1.0, torch.tensor(1.0), fused=False)
    saved = eight.state_dict()
    opt = build_adamw(model, fused=False, states=states, **HYPER)
    opt.load_state_dict(saved)
    for s in opt.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            assert type(s[key]) is torch.Tensor
            assert s[key].dtype == (torch.bfloat16 if states == "bf16" else torch.float32)
    expected = saved["state"][0]["exp_avg"].dequantize()
    assert torch.allclose(
        opt.state[model[0].weight]["exp_avg"].float(), expected, atol=0.01 * expected.abs().max()
    )
    set_lr(opt, 5e-3)
    model.zero_grad()
    model(x).pow(2).mean().backward()
    fused = bool(opt.defaults.get("fused"))
    clip_and_step(opt, list(model.parameters()), 1.0, torch.tensor(1.0), fused=fused)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_8bit_without_torchao_is_refused_before_the_data(tmp_path, monkeypatch, capsys):
    """Said at the environment step, as a missing attention kernel is: not after preparing the corpus."""
    import importlib.util

    from cli_helpers import FASTRUN, run_cli

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else find_spec(name, *a)
    )
    missing = tmp_path / "no-such-corpus"
    rc, text = run_cli(
        [
            "train",
            "--data",
            str(missing),
            "--out",
            str(tmp_path / "r"),
            *FASTRUN,
            "--optimizer_states",
            "8bit",
        ],
        capsys,
    )
    assert rc != 0 and "pip install torchao" in text and "no-such-corpus" not in text
