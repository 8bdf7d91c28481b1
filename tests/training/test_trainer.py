"""The training loop end to end on CPU: exact resume, accumulation, interruption, fallback, DDP, presets."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from cli_helpers import FAST as FAST_SETTINGS
from safetensors.torch import load_file
from torchrun_runs import here, launch

from gptoughts import api
from gptoughts.config import list_presets, load_config
from gptoughts.training.checkpoint import savers
from gptoughts.training.checkpoint import store as ckpt
from gptoughts.training.checkpoint.sharded import consolidated_weights
from gptoughts.training.trainer import Trainer


def _losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


FAST: dict = {}


@pytest.fixture(autouse=True)
def _fast(fast):
    FAST.clear()
    FAST.update(fast)


def _cfg(corpus: Path, out: Path, **kw):
    o = dict(FAST)
    o.update({"data.sources": [str(corpus)], "run.out": str(out)})
    o.update(kw)
    return load_config("default", o)


def _stop_after(monkeypatch: pytest.MonkeyPatch, step: int) -> None:
    """Simulate SIGTERM arriving during step `step` (1-based)."""
    original = Trainer.train_step

    def patched(self):
        out = original(self)
        if self.state.step + 1 == step:
            self.stop_requested = True
        return out

    monkeypatch.setattr(Trainer, "train_step", patched)


def _uninterrupted_and_resumed(corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, common: dict):
    """Losses of a whole run (``a``) and of the same run stopped during step 10 then resumed (``b``), with the
    stopped run's history."""
    api.run_training(_cfg(corpus, tmp_path / "a", **common))
    with monkeypatch.context() as m:
        _stop_after(m, 10)
        _, _, hist = api.run_training(_cfg(corpus, tmp_path / "b", **common))
    api.run_training(_cfg(corpus, tmp_path / "b", **common, **{"run.resume": "auto"}))
    return _losses(tmp_path / "a"), _losses(tmp_path / "b"), hist


@pytest.mark.slow
@pytest.mark.parametrize(
    "optimizer,states",
    [("adamw", "fp32"), ("muon", "fp32"), ("adamw", "bf16"), ("muon", "bf16"), ("adamw", "8bit")],
)
def test_exact_resume_bit_identical(optimizer, states, tmp_path, text_corpus, cache_dir, monkeypatch):
    """bf16 states: the stochastic rounding draws from the RNG the checkpoint restores. 8bit: torchao's
    quantized states through state.pt (skipped without torchao)."""
    if states == "8bit":
        pytest.importorskip("torchao.optim")
    common = {
        "train.optimizer": optimizer,
        "train.optimizer_states": states,
        "train.max_steps": 20,
        "train.log_interval": 1,
        "train.eval_interval": 0,
        "train.save_interval": 0,
        "train.sample_interval": 0,
    }
    full, resumed, hist = _uninterrupted_and_resumed(text_corpus, tmp_path, monkeypatch, common)
    assert sorted(full) == list(range(1, 21))
    assert hist.steps == 10 and "interrupted" in hist.stop_reason
    # the stop's checkpoint, and the resumed run's last (no interval saves)
    assert ckpt.list_steps(tmp_path / "b" / "checkpoints") == [10, 20]
    assert sorted(resumed) == list(range(1, 21))  # lines after the checkpoint were not duplicated
    for step in range(1, 21):
        assert resumed[step] == full[step], f"step {step}: {resumed[step]} != {full[step]}"
    last = ckpt.list_steps(tmp_path / "b" / "checkpoints")[-1]
    saved = torch.load(tmp_path / "b" / "checkpoints" / f"step_{last:06d}" / "state.pt", weights_only=True)
    kinds = {
        str(s["exp_avg"].dtype) if states != "8bit" else type(s["exp_avg"]).__name__
        for s in saved["optimizer"]["state"].values()
        if "exp_avg" in s
    }
    assert {"fp32": "torch.float32", "bf16": "torch.bfloat16", "8bit": "OptimState8bit"}[states] in kinds


@pytest.mark.slow
def test_exact_resume_from_checkpoints_written_in_the_background(
    tmp_path, text_corpus, cache_dir, monkeypatch
):
    """The background path of savers.FileSaver (taken on GPUs; forced here on the CPU): checkpoints every 3 steps
    written by the thread while training goes on, a stop at step 10, and the resumed run's losses equal the
    uninterrupted run's, step for step."""
    monkeypatch.setattr(savers.FileSaver, "_worth_it", lambda self, weights, state: self.background)
    written = []
    real_save = savers.FileSaver.save

    def spy(self, step, *args, **kwargs):
        real_save(self, step, *args, **kwargs)
        written.append((step, self.last_in_background))

    monkeypatch.setattr(savers.FileSaver, "save", spy)
    common = {
        "train.max_steps": 16,
        "train.log_interval": 1,
        "train.eval_interval": 0,
        "train.save_interval": 3,
        "train.sample_interval": 0,
    }
    full, resumed, hist = _uninterrupted_and_resumed(text_corpus, tmp_path, monkeypatch, common)
    assert hist.steps == 10 and "interrupted" in hist.stop_reason
    assert all(resumed[step] == full[step] for step in range(1, 17)), (resumed, full)
    assert written and all(background for _, background in written)
    assert {3, 6, 9, 10, 12, 15, 16} <= {step for step, _ in written}


@pytest.mark.slow
def test_corrupt_newest_checkpoint_falls_back(tmp_path, text_corpus, cache_dir):
    common = {
        "train.max_steps": 6,
        "train.log_interval": 1,
        "train.eval_interval": 0,
        "train.save_interval": 3,
        "train.sample_interval": 0,
    }
    api.run_training(_cfg(text_corpus, tmp_path / "r", **common))
    root = tmp_path / "r" / "checkpoints"
    assert ckpt.list_steps(root) == [3, 6]
    f = root / "step_000006" / ckpt.MODEL_FILE
    f.write_bytes(f.read_bytes()[:100])  # truncated, as by a crash or a full disk
    with pytest.warns(UserWarning, match="unusable"):
        _, _, hist = api.run_training(_cfg(text_corpus, tmp_path / "r", **common, **{"run.resume": "auto"}))
    assert hist.steps == 6  # resumed from step 3 and ran 3 more


def _bare_trainer(model, optimizer, batches, *, batch: int, accum: int, steps: int, **kw) -> Trainer:
    """A Trainer over in-memory batches: CPU, fp32, no run directory, metrics or evaluation."""
    from gptoughts.config import TrainConfig
    from gptoughts.parallel.dist import DistInfo
    from gptoughts.training.metrics import MetricsLogger
    from gptoughts.training.objectives import build_objective
    from gptoughts.training.optim import Schedule

    lr = optimizer.param_groups[0]["lr"]
    return Trainer(
        model=model,
        objective=build_objective("causal"),
        optimizer=optimizer,
        schedule=Schedule("constant", lr, steps, 0),
        loader=iter(batches),
        cfg=TrainConfig(batch_size=batch, grad_accum=accum, **kw.pop("train", {})),
        dist=DistInfo(),
        device=torch.device("cpu"),
        precision="fp32",
        metrics=MetricsLogger(Path("."), enabled=False),
        total_steps=steps,
        tokens_per_step=batch * accum * 16,
        **kw,
    )


def test_gradient_accumulation_equivalence():
    """1 micro-batch of 8 rows == 8 micro-batches of 1 row (same rows): same update within fp32 tolerance."""
    from gptoughts import models

    torch.manual_seed(0)
    data = torch.randint(0, 256, (8, 17))
    params = []
    for batch, accum in ((8, 1), (1, 8)):
        torch.manual_seed(1)
        model = models.build_model("llama", models.model_args("llama", "debug", {"vocab_size": 256}))
        batches = [(data[i : i + batch, :-1], data[i : i + batch, 1:]) for i in range(0, 8, batch)]
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        t = _bare_trainer(model, opt, batches, batch=batch, accum=accum, steps=1, train={"grad_clip": 0.0})
        loss_sum, n_tokens, found_inf = t.train_step()
        assert float(n_tokens) == 8 * 16 and float(found_inf) == 0
        params.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.allclose(params[0], params[1], atol=1e-6, rtol=0), (params[0] - params[1]).abs().max()


def test_keep_grads_accumulates_in_place_with_the_same_updates():
    """CUDA graphs (setup.Built.keep_grads): gradients are allocated once and zeroed in place, so a backward adds
    into them instead of its output becoming the .grad a later micro-batch's graph replay would overwrite. The
    updates equal the freed-gradient path's (AdamW, accumulation 2, two steps), and each .grad stays one tensor."""
    from gptoughts import models

    torch.manual_seed(0)
    data = torch.randint(0, 256, (8, 17))
    batches = [(data[i : i + 2, :-1], data[i : i + 2, 1:]) for i in range(0, 8, 2)]
    results = []
    for keep in (False, True):
        torch.manual_seed(1)
        model = models.build_model("llama", models.model_args("llama", "debug", {"vocab_size": 256}))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        t = _bare_trainer(model, opt, batches, batch=2, accum=2, steps=2, keep_grads=keep)
        # nothing allocated before the first step (a resume loads the optimizer state after the trainer is made)
        assert all(p.grad is None for p in model.parameters())
        t.train_step()
        grads = [p.grad for p in model.parameters()]
        assert all(g is None for g in grads) != keep
        t.train_step()
        if keep:
            assert all(p.grad is g for p, g in zip(model.parameters(), grads))  # the same tensors, zeroed
            assert all(not p.grad.any() for p in model.parameters())
        else:
            assert all(p.grad is None for p in model.parameters())
        results.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.equal(results[0], results[1]), (results[0] - results[1]).abs().max()


def test_nonfinite_step_is_skipped(tmp_path):
    """A NaN loss leaves the weights untouched and is counted, instead of poisoning the model."""
    from gptoughts import models
    from gptoughts.config import TrainConfig
    from gptoughts.parallel.dist import DistInfo
    from gptoughts.training.metrics import MetricsLogger
    from gptoughts.training.optim import Schedule

    model = models.build_model("llama", models.model_args("llama", "debug", {"vocab_size": 256}))
    before = [p.detach().clone() for p in model.parameters()]

    def nan_objective(m, batch):
        out = m(batch[0]).float()
        return out.sum() * float("nan"), torch.tensor(batch[1].numel())

    x = torch.randint(0, 256, (2, 9))
    t = Trainer(
        model=model,
        objective=nan_objective,
        optimizer=torch.optim.AdamW(model.parameters()),
        schedule=Schedule("constant", 1e-3, 1, 0),
        loader=iter([(x[:, :-1], x[:, 1:])]),
        cfg=TrainConfig(batch_size=2),
        dist=DistInfo(),
        device=torch.device("cpu"),
        precision="fp32",
        metrics=MetricsLogger(tmp_path, enabled=False),
        total_steps=1,
        tokens_per_step=16,
    )
    _, _, found_inf = t.train_step()
    assert float(found_inf) == 1.0
    for a, b in zip(before, model.parameters()):
        assert torch.equal(a, b)


def test_oom_backoff_halves_micro_batch(tmp_path):
    """An OOM in a step splits each micro-batch in two and retries the same data (same global batch)."""
    from gptoughts import models
    from gptoughts.config import TrainConfig
    from gptoughts.parallel.dist import DistInfo
    from gptoughts.training.metrics import MetricsLogger
    from gptoughts.training.objectives import build_objective
    from gptoughts.training.optim import Schedule

    model = models.build_model("llama", models.model_args("llama", "debug", {"vocab_size": 256}))
    causal = build_objective("causal")
    rows_seen = []

    def objective(m, batch):
        rows_seen.append(batch[0].shape[0])
        if batch[0].shape[0] > 2:
            raise torch.OutOfMemoryError("fake: more than 2 rows do not fit")
        return causal(m, batch)

    x = torch.randint(0, 256, (8, 9))
    t = Trainer(
        model=model,
        objective=objective,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        schedule=Schedule("constant", 0.1, 1, 0),
        loader=iter([(x[:, :-1], x[:, 1:])]),
        cfg=TrainConfig(batch_size=8),
        dist=DistInfo(),
        device=torch.device("cpu"),
        precision="fp32",
        metrics=MetricsLogger(tmp_path, enabled=False),
        total_steps=1,
        tokens_per_step=64,
    )
    _, n_tokens, found_inf = t.train_step()
    assert t.split == 4 and rows_seen == [8, 4, 2, 2, 2, 2]
    assert float(n_tokens) == 64 and float(found_inf) == 0


@pytest.mark.slow
def test_early_stopping(tmp_path, text_corpus, cache_dir):
    # A zero learning-rate run never improves after its first evaluation: patience 2 stops it at the 3rd.
    cfg = _cfg(
        text_corpus,
        tmp_path / "es",
        **{
            "train.max_steps": 50,
            "train.eval_interval": 2,
            "train.early_stopping_patience": 2,
            "train.learning_rate": 1e-12,
            "train.early_stopping_min_delta": 0.01,
        },
    )
    _, _, hist = api.run_training(cfg)
    assert hist.stop_reason == "early stopping" and hist.steps == 6


def test_outputs_of_a_run(tmp_path, text_corpus, cache_dir):
    out = tmp_path / "run"
    cfg = _cfg(
        text_corpus,
        out,
        **{"train.max_steps": 4, "train.eval_interval": 2, "train.log_interval": 2, "run.tensorboard": True},
    )
    called = time.perf_counter()
    model, tok, hist = api.run_training(cfg)
    wall = time.perf_counter() - called
    for name in ("config.toml", "metrics.jsonl", "samples.txt", "run.json", "tokenizer"):
        assert (out / name).exists(), name
    assert list((out / "tensorboard").iterdir())
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r]
    assert train_rows and all({"step", "loss", "lr", "tokens_per_s"} <= set(r) for r in train_rows)
    assert any("val_loss" in r and "val_ppl" in r for r in rows)
    assert "time/forward_ms" in train_rows[-1]
    assert hist.val_loss and hist.sample.startswith("def ")
    assert load_config(str(out / "config.toml")).train.max_steps == 4
    startup = json.loads((out / "summary.json").read_text())["startup"]  # command -> first finished step
    parts = startup["imports_s"] + startup["assembly_s"] + startup["first_step_s"]
    # a Python API call: the clock starts at the call, not the process (which started before this test did)
    assert startup["to_first_step_s"] < wall
    assert startup["assembly_s"] > 0 and startup["first_step_s"] > 0
    assert startup["to_first_step_s"] == pytest.approx(parts, abs=0.02)
    loaded = api.load(out)
    text = api.generate_text(loaded, "def ", max_new_tokens=5, seed=0)
    assert text.startswith("def ")


@pytest.mark.slow
def test_python_api_mirrors_inl_guide(tmp_path, text_corpus, cache_dir):
    model, tokenizer, history = api.train(
        "default",
        data_path=str(text_corpus),
        model="llama",
        size="debug",
        num_epochs=0.05,
        batch_size=4,
        learning_rate=1e-3,
        save_dir=str(tmp_path / "inl"),
        device="cpu",
        **{
            k: v
            for k, v in FAST.items()
            if k not in ("model.family", "model.size", "train.batch_size", "perf.device")
        },
    )
    assert history.steps >= 1 and tokenizer.vocab_size > 256 and isinstance(model, torch.nn.Module)


@pytest.mark.slow
@pytest.mark.parametrize("preset", list_presets())
def test_every_preset_runs_one_step_at_debug_size(preset, tmp_path, text_corpus, cache_dir):
    o = dict(FAST)
    o.pop("model.family")
    o.update(
        {
            "data.sources": [str(text_corpus)],
            "run.out": str(tmp_path / "p"),
            "train.max_steps": 1,
            "train.eval_interval": 1,
            "perf.fp8": False,
            "model.init_from": None,
        }
    )
    cfg = load_config(preset, o)
    if cfg.model.overrides:  # presets that pin a custom shape keep it; keep it small enough for CPU
        cfg.model.overrides = {k: v for k, v in cfg.model.overrides.items() if k in ("tie_embeddings",)}
    _, _, hist = api.run_training(cfg)
    assert hist.steps == 1 and hist.val_loss


def _flags(*skip: str) -> list[str]:
    return [f"--{k}={v}" for k, v in FAST_SETTINGS.items() if k not in skip]


# DDP: 2 gloo ranks x batch 2 against 1 process x batch 4, llama, 3 steps
DDP = ["--max_steps", "3", "--log_interval", "1", "--eval_interval", "3", "--save_interval", "3",
       *_flags("train.batch_size", "train.sample_prompts")]  # fmt: skip
# FSDP2: DeepSeek (MoE, MLA), bias updates on, constant schedule
FSDP = ["--log_interval", "1", "--eval_interval", "3", "--save_interval", "3", "--train.schedule", "constant",
        *_flags("train.batch_size", "train.sample_prompts", "train.warmup_steps", "model.family"),
        "--warmup_steps", "0", "--model.family", "deepseek", "--model.bias_update_rate", "0.01"]  # fmt: skip
OPTIMIZERS = ("adamw", "muon")


def _run(out: Path, corpus: Path, *args: str) -> list[str]:
    return ["train", "default", "--out", str(out), "--data", str(corpus), *args]


@pytest.fixture(scope="module")
def two_rank_runs(shared_corpus, tmp_path_factory) -> Path:
    """The one-process runs (in this process) and every two-rank run of the tests below, in ONE torchrun launch
    (tests/torchrun_runs.py): ``single``/``ddp`` (DDP test); per optimizer, ``single-OPT`` (5 steps),
    ``fsdp-OPT`` (3 steps) and ``f2-OPT`` (``single-OPT``'s step 3 resumed under FSDP2, to step 5)."""
    tmp, c = tmp_path_factory.mktemp("two_ranks"), shared_corpus
    env = {"GPTOUGHTS_CACHE": str(tmp / "cache")}
    here(_run(tmp / "single", c, "--batch_size", "4", *DDP), env=env)
    runs = [_run(tmp / "ddp", c, "--batch_size", "2", *DDP)]
    for opt in OPTIMIZERS:
        one = [*FSDP, "--optimizer", opt, "--batch_size", "4", "--max_steps", "5"]
        here(_run(tmp / f"single-{opt}", c, *one), env=env)
        fsdp = [*FSDP, "--optimizer", opt, "--batch_size", "2", "--parallel.strategy", "fsdp"]
        runs.append(_run(tmp / f"fsdp-{opt}", c, *fsdp, "--max_steps", "3"))
        step3 = str(tmp / f"single-{opt}" / "checkpoints" / "step_000003")
        runs.append(_run(tmp / f"f2-{opt}", c, *fsdp, "--max_steps", "5", "--resume", step3))
    launch(runs, tmp=tmp, env=env)
    return tmp


@pytest.mark.distributed
def test_ddp_two_processes_match_single_process(two_rank_runs):
    """2 gloo ranks x batch 2 see the same global rows as 1 process x batch 4: same losses."""
    single, ddp = two_rank_runs / "single", two_rank_runs / "ddp"
    a, b = _losses(single), _losses(ddp)
    assert sorted(a) == sorted(b) == [1, 2, 3]
    for s in a:
        assert abs(a[s] - b[s]) < 1e-4 * abs(a[s]), (s, a[s], b[s])
    assert ckpt.list_steps(ddp / "checkpoints") == [3]
    run = json.loads((ddp / "run.json").read_text())
    assert run["world_size"] == 2


@pytest.mark.distributed
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_fsdp_matches_one_process_and_checkpoints_move_between_them(optimizer, two_rank_runs, shared_corpus):
    """2 gloo ranks under FSDP2 x batch 2 train like 1 process x batch 4; a checkpoint written by either
    resumes in the other (FSDP's sharded DCP checkpoint; the one process's single file, optimizer state keyed
    by index) and continues alike.
    DeepSeek (MoE): its expert-balancing biases only match the one-process run if the ranks' expert loads are
    summed before each bias update. Muon: each rank orthogonalizes the whole (gathered) matrix of its shards,
    MoE experts and MLA factors included."""

    def close(a: dict[int, float], b: dict[int, float], steps: list[int]) -> None:
        for s in steps:
            assert abs(a[s] - b[s]) < 1e-4 * abs(a[s]), (s, a[s], b[s])

    tmp = two_rank_runs
    single, sharded = tmp / f"single-{optimizer}", tmp / f"fsdp-{optimizer}"
    ref = _losses(single)
    close(ref, _losses(sharded), [1, 2, 3])
    assert json.loads((sharded / "run.json").read_text())["world_size"] == 2
    assert (sharded / "samples.txt").exists()  # every rank took part in generation; rank 0 wrote
    a = load_file(str(single / "checkpoints" / "step_000003" / ckpt.MODEL_FILE))
    b = consolidated_weights(sharded / "checkpoints" / "step_000003")  # FSDP: sharded (DCP) checkpoints
    # Muon orthogonalizes in bf16 (as torch.optim.Muon): the last-bit differences of the ranks' summed
    # gradients flip a few bf16 roundings (tests/training/test_muon.py checks the sharded step bit for bit).
    atol = 1e-5 if optimizer == "adamw" else 2e-4
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=atol) for k in a)
    biases = [k for k in a if k.endswith("expert_bias")]
    assert biases and any(a[k].abs().sum() > 0 for k in biases)  # the balancing did move them
    index = ckpt.read_dcp_metadata(sharded / "checkpoints" / "step_000003")
    assert any(k.startswith("optimizer.state.layers.0.") for k in index.state_dict_metadata)  # keyed by name
    # FSDP checkpoint (sharded, by name) -> one process; one-process checkpoint (single file, by index) -> FSDP
    s2 = tmp / f"s2-{optimizer}"
    one = [*FSDP, "--optimizer", optimizer, "--batch_size", "4", "--max_steps", "5"]
    step3 = str(sharded / "checkpoints" / "step_000003")
    here(_run(s2, shared_corpus, *one, "--resume", step3), env={"GPTOUGHTS_CACHE": str(tmp / "cache")})
    close(ref, _losses(s2), [4, 5])
    close(ref, _losses(tmp / f"f2-{optimizer}"), [4, 5])  # trained in the fixture's launch


@pytest.mark.slow
def test_profile_writes_a_trace(tmp_path, text_corpus, cache_dir):
    out = tmp_path / "prof"
    api.run_training(
        _cfg(text_corpus, out, **{"train.max_steps": 4, "train.profile": "2:3", "train.eval_interval": 0})
    )
    traces = list((out / "profile").glob("*.json"))
    assert len(traces) == 1
    trace = json.loads(traces[0].read_text())
    assert trace["traceEvents"], "empty trace"


def test_bad_profile_spec_is_a_config_error(tmp_path, text_corpus):
    from gptoughts.errors import ConfigError

    with pytest.raises(ConfigError, match="START:END"):
        _cfg(text_corpus, tmp_path / "x", **{"train.profile": "5"})


@pytest.mark.slow
def test_quickstart_pipeline_learns_on_a_stdlib_slice(tmp_path, cache_dir):
    """The embedded default end to end (stdlib corpus, BPE trained on it), on a small slice and a smaller model."""
    import math

    cfg = load_config(
        "quickstart",
        {
            "data.max_bytes": 300_000,
            "data.tokenizer": "bpe:2048",
            "model.d_model": 128,
            "model.n_heads": 4,
            "model.n_kv_heads": 2,
            "model.ffn_dim": 384,
            "model.n_layers": 2,
            "train.max_steps": 80,
            "train.batch_size": 8,
            "train.block_size": 64,
            "train.eval_interval": 10,
            "train.learning_rate": 3e-3,
            "train.warmup_steps": 5,
            "train.save_interval": 0,
            "run.out": str(tmp_path / "qs"),
            "run.progress": False,
            "run.tensorboard": False,
            "perf.device": "cpu",
            "train.sample_max_new_tokens": 16,
        },
    )
    _, tok, hist = api.run_training(cfg)
    assert cfg.data.sources == ["@stdlib"] and tok.vocab_size == 2048
    # An untrained model predicts ~uniformly: its val loss starts at ln(2048) = 7.6 nats.
    first, last = hist.val_loss[0], hist.val_loss[-1]
    assert last < math.log(2048) - 1.0, hist.val_loss
    assert last < first - 0.2, hist.val_loss
    assert hist.final_val_ppl == pytest.approx(math.exp(last))
    assert hist.sample.startswith("def fibonacci(n):")
