"""The plan first, threads, memory refusals, newcomer paths (issue 29, items 7, 9, 17, 18): a CPU run's thread count
is kept by its resume and honoured when the user sets it; a run the memory estimate says cannot fit is refused in
one line before anything heavy; the plan comes before the thread probe, which is bounded; the wizard checks each
answer as it is given; the README's Python block runs as written without a GPU; bench/tune build train's model."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path

import pytest
import torch
from cli_helpers import refused, run_cli

from gptoughts.cli import options as cli_options
from gptoughts.cli import train as cli_train
from gptoughts.config import load_config
from gptoughts.errors import ConfigError
from gptoughts.perf import hardware
from gptoughts.training import build as build_mod
from gptoughts.training import environment as environment_mod
from gptoughts.training.checkpoint import staging

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")

# CPU, quiet, short: like cli_helpers.FASTRUN but without --threads (the thread count is what is tested here)
QUIET_CPU = ["--device", "cpu", "--no_progress", "--run.tensorboard", "false", "--eval_batches", "2",
             "--sample_max_new_tokens", "4", "--tokenizer", "bytes"]  # fmt: skip
QUIET = [*QUIET_CPU, "--block_size", "32", "--batch_size", "2"]


@pytest.fixture(autouse=True)
def _threads_restored(monkeypatch):
    """A run chooses torch's thread count for the whole process: put it back for the next test; no OMP_NUM_THREADS
    from the environment unless a test sets it."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _ok(argv: list[str], capsys) -> str:
    code, text = run_cli(argv, capsys)
    assert code == 0, text[-2000:]
    assert "Traceback" not in text
    return text


def _probe_prefers(n: int, monkeypatch, calls: list | None = None) -> None:
    """Make the thread probe find ``n`` threads the faster (any other count sleeps) on a 2-core machine."""
    import time

    monkeypatch.setattr(hardware.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    real = build_mod._probe_step

    def probe_step(cfg, model, data):
        step, tokens = real(cfg, model, data)

        def timed() -> None:
            if calls is not None:
                calls.append(torch.get_num_threads())
            if torch.get_num_threads() != n:
                time.sleep(0.05)
            step()

        return timed, tokens

    monkeypatch.setattr(build_mod, "_probe_step", probe_step)


# ------------------------------------------------------------------------------------------------ item 7
@pytest.mark.parametrize("value", ["0", "-2"])
def test_threads_below_one_are_refused(value, tmp_path, text_corpus, cache_dir, capsys):
    out = tmp_path / "run"
    refused(
        [
            "train",
            "--data",
            str(text_corpus),
            "--out",
            str(out),
            "--threads",
            value,
            "--max_steps",
            "1",
            *QUIET,
        ],
        capsys,
        "threads",
        value,
    )
    assert not out.exists()
    with pytest.raises(ConfigError, match="threads"):
        load_config(None, {"data.sources": [str(text_corpus)], "perf.threads": int(value)})


@pytest.mark.slow
def test_resume_keeps_the_runs_measured_thread_count(tmp_path, text_corpus, cache_dir, capsys, monkeypatch):
    """The first run measures 1 thread the faster; its resume, measured now, would pick 2: it keeps 1, and the
    plan says the count at which the results reproduce."""
    out = tmp_path / "run"
    _probe_prefers(1, monkeypatch)
    text = _ok(["train", "--data", str(text_corpus), "--out", str(out), "--max_steps", "2", *QUIET], capsys)
    first = json.loads((out / "run.json").read_text())
    assert first["threads"] == 1 and "measured" in first["resolved"]["threads"]
    assert re.search(r"threads: 1 \(measured.*reproduce", text), text
    calls: list[int] = []
    _probe_prefers(2, monkeypatch, calls)
    text = _ok(["train", "--resume", "auto", "--out", str(out), "--max_steps", "3", *QUIET], capsys)
    resumed = json.loads((out / "run.json").read_text())
    assert resumed["threads"] == 1 and torch.get_num_threads() == 1
    assert calls == []  # nothing measured: the run's own count
    assert re.search(r"threads: 1 \(the run's own.*reproduce", text), text


def test_omp_num_threads_is_honoured(tmp_path, text_corpus, cache_dir, capsys, monkeypatch):
    calls: list[int] = []
    _probe_prefers(2, monkeypatch, calls)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "run"
    text = _ok(["train", "--data", str(text_corpus), "--out", str(out), "--max_steps", "1", *QUIET], capsys)
    run = json.loads((out / "run.json").read_text())
    assert run["threads"] == 1 and "OMP_NUM_THREADS" in run["resolved"]["threads"]
    assert calls == [] and torch.get_num_threads() == 1
    assert "threads: 1 (OMP_NUM_THREADS" in text


# ------------------------------------------------------------------------------------------------ item 9
def test_a_run_that_cannot_fit_is_refused_before_anything_heavy(
    tmp_path, text_corpus, cache_dir, capsys, monkeypatch
):
    """The estimate exceeds what this machine has available: one line naming the estimate, the limit and the flag
    that tries anyway; the plan was printed; nothing tokenized, built or written."""
    monkeypatch.setattr(staging, "host_memory_available", lambda: 2**20)  # 1 MiB available
    built = []
    from gptoughts.training import setup

    monkeypatch.setattr(setup, "build_raw_model", lambda *a, **k: built.append(a))
    out = tmp_path / "run"
    argv = [
        "train",
        "--data",
        str(text_corpus),
        "--out",
        str(out),
        "--max_steps",
        "2",
        "--threads",
        "1",
        *QUIET,
    ]
    err = refused(argv, capsys, "estimated peak", "available", "--ignore_memory_estimate")
    assert re.search(r"~[\d.]+ (G|M)iB", err) and "1 MiB" in err, err
    assert not out.exists() and not built
    assert not (cache_dir.exists() and any(cache_dir.rglob("*.bin"))), "the corpus was tokenized"


@pytest.mark.slow
def test_ignore_memory_estimate_tries_anyway(tmp_path, text_corpus, cache_dir, capsys, monkeypatch):
    monkeypatch.setattr(staging, "host_memory_available", lambda: 2**20)
    out = tmp_path / "run"
    text = _ok(
        ["train", "--data", str(text_corpus), "--out", str(out), "--max_steps", "1", "--threads", "1",
         "--ignore_memory_estimate", *QUIET],
        capsys,
    )  # fmt: skip
    assert "exceeds" in text and (out / "run.json").is_file()


def test_out_of_memory_in_training_is_one_line(tmp_path, text_corpus, cache_dir, capsys, monkeypatch):
    from gptoughts.training.trainer import Trainer

    def fit(self, startup=None):
        raise RuntimeError(
            "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you "
            "tried to allocate 68719476736 bytes. Error code 12 (Cannot allocate memory)"
        )

    monkeypatch.setattr(Trainer, "fit", fit)
    out = tmp_path / "run"
    refused(
        [
            "train",
            "--data",
            str(text_corpus),
            "--out",
            str(out),
            "--max_steps",
            "1",
            "--threads",
            "1",
            *QUIET,
        ],
        capsys,
        "out of memory",
        "--batch_size",
    )


def test_cpu_auto_batch_says_what_it_chose_and_why(tmp_path, text_corpus, cache_dir, capsys, monkeypatch):
    argv = ["train", "--data", str(text_corpus), "--out", str(tmp_path / "r"), "--dry_run", *QUIET_CPU,
            "--block_size", "32", "--batch_size", "auto"]  # fmt: skip
    text = _ok(argv, capsys)
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("batch:"))
    assert "auto" in line and "available" in line, line
    full = int(re.search(r"batch: (\d+) x", line).group(1))
    # With little memory available, auto takes fewer rows: room for the estimate at 1 row, not at 8.
    at = {}
    for rows in (1, 8):
        cfg = load_config(None, {**_overrides(argv), "train.batch_size": rows})
        at[rows] = build_mod.build(cfg, dry_run=True).plan.memory_gib
    capsys.readouterr()
    monkeypatch.setattr(staging, "host_memory_available", lambda: int((at[1] + at[8]) / 2 / 0.9 * 2**30))
    text = _ok(argv, capsys)
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("batch:"))
    assert 1 <= int(re.search(r"batch: (\d+) x", line).group(1)) < full, line


def test_an_accumulation_the_user_gives_is_kept_under_an_automatic_batch(
    tmp_path, text_corpus, cache_dir, capsys
):
    """A size's global batch (125m: 524,288 tokens) sets the accumulation of an automatic batch, unless the user
    gave --grad_accum: then theirs (it was overridden: asked 1, planned 128)."""
    argv = ["train", "--data", str(text_corpus), "--size", "125m", "--out", str(tmp_path / "r"), "--dry_run",
            *QUIET_CPU, "--max_steps", "10", "--grad_accum", "1"]  # fmt: skip
    text = _ok(argv, capsys)
    assert re.search(r"batch: \d+ x 2048 tokens x accumulation 1 ", text), text
    assert "(--grad_accum)" in text
    text = _ok(argv[:-2], capsys)
    assert not re.search(r"x accumulation 1 ", text), text  # the size's global batch otherwise
    code, out = run_cli([*argv, "--global_batch_tokens", "65536"], capsys)
    assert code == 2 and "give one of them" in out


def _overrides(argv: list[str]) -> dict:
    preset, overrides, _ = cli_options.parse_overrides(argv[1:])
    assert preset is None
    return overrides


# ------------------------------------------------------------------------------------------------ item 17
def test_the_plan_comes_before_a_bounded_thread_probe(tmp_path, text_corpus, cache_dir, capsys, monkeypatch):
    monkeypatch.setattr(hardware.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    real = build_mod._probe_step
    seen: list[tuple[tuple[int, ...], bool]] = []
    printed: list[str] = []

    def probe_step(cfg, model, data):
        step, tokens = real(cfg, model, data)

        def spied() -> None:
            printed.append(capsys.readouterr().out)
            h = model.raw.register_forward_pre_hook(
                lambda m, args: seen.append((tuple(args[0].shape), "plan:" in "".join(printed)))
            )
            try:
                step()
            finally:
                h.remove()

        return spied, tokens

    monkeypatch.setattr(build_mod, "_probe_step", probe_step)
    argv = ["train", "--data", str(text_corpus), "--out", str(tmp_path / "r"), "--max_steps", "1", *QUIET_CPU,
            "--batch_size", "8", "--block_size", "128"]  # fmt: skip
    out = _ok(argv, capsys)
    assert seen and all(plan_first for _, plan_first in seen), seen
    # the run's time, estimated again from the probe's speed once it is known
    assert re.search(r"threads: \d .*\n  time: ~.* at ~[\d,.]+ tokens/s \(the thread probe's", out), out
    # one time, the probe's, and the plan's last lines after it (a first matmul-based time had preceded "out:")
    whole = "".join(printed) + out  # (the spy took what was printed before the probe)
    heads = [ln.split(":")[0].strip() for ln in whole.splitlines() if ln.startswith("  ")]
    assert whole.count("time: ~") == 1 and heads[heads.index("memory") :][:4] == [
        "memory",
        "threads",
        "time",
        "out",
    ]
    # an untimed step and at most two rounds of two counts, each on a bounded probe, not the 8 x 128 micro-batch
    assert len(seen) <= 5 and all(rows * cols <= build_mod.PROBE_TOKENS < 8 * 128 for (rows, cols), _ in seen)


def test_the_wizard_checks_each_answer_when_given(tmp_path, text_corpus, capsys):
    answers = iter(
        ["huge", "debug", str(tmp_path / "missing"), str(text_corpus), "-1", "0.5", "zero", "auto"]
    )
    asked: list[str] = []

    def ask(question: str, default: str) -> str:
        asked.append(question.split(" (")[0].split(" [")[0])
        return next(answers)

    out = cli_train.ask_interactive({}, ask)
    assert asked == ["Model size", "Model size", "Training corpus", "Training corpus", "Epochs", "Epochs",
                     "Batch size", "Batch size"]  # fmt: skip
    assert out["model.size"] == "debug" and out["data.sources"] == [str(text_corpus)]
    assert out["train.epochs"] == "0.5" and out["train.batch_size"] == "auto"
    said = capsys.readouterr().out
    assert "huge" in said and "missing" in said and "-1" in said and "zero" in said


def test_the_bytecode_hint_is_one_short_line_once(cache_dir, monkeypatch):
    from types import SimpleNamespace

    from gptoughts.perf.startup import Startup

    monkeypatch.setattr(sys, "flags", SimpleNamespace(dont_write_bytecode=1))
    slow = Startup(imports_s=4.0, assembly_s=3.0, first_step_s=2.0)
    assert "bytecode" not in slow.line().lower()
    hint = slow.bytecode_hint()
    assert "PYTHONDONTWRITEBYTECODE" in hint and "\n" not in hint and len(hint) <= 100, hint
    assert Startup(imports_s=4.0, assembly_s=3.0, first_step_s=2.0).bytecode_hint() == ""  # once


def test_cpu_processes_are_not_gpus_in_the_plan(tmp_path, text_corpus, cache_dir):
    from dataclasses import replace

    cfg = load_config(None, {"data.sources": [str(text_corpus)], "perf.device": "cpu", "data.tokenizer": "bytes",
                             "run.out": str(tmp_path / "r"), "train.batch_size": 2, "train.block_size": 32})  # fmt: skip
    env = environment_mod.setup_environment(cfg)
    env = replace(env, dist=replace(env.dist, world_size=2))  # as under torchrun --nproc_per_node 2
    text = build_mod.build(cfg, dry_run=True, env=env).plan.format()
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("batch:"))
    assert "GPU" not in line and "x 2 processes" in line, line


# ------------------------------------------------------------------------------------------------ item 18
@pytest.mark.slow
def test_readme_python_block_runs_as_written_without_a_gpu(
    tmp_path, text_corpus, cache_dir, capsys, monkeypatch
):
    """The block as written (device included), with its paths in tmp_path and the debug size; on this CPU machine
    the device it names must work."""
    code = re.search(r"```python\n(.*?)```", README, re.S).group(1)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(p.read_text() for p in sorted(text_corpus.iterdir())), encoding="utf-8")
    code = code.replace('size="125m"', 'size="debug"').replace('"corpus.txt"', repr(str(corpus)))
    code = code.replace('"runs/mine"', repr(str(tmp_path / "mine")))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # a tiny model: one thread, nothing measured
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 - our own README, the point of the test
    history = scope["history"]
    assert history.final_val_ppl == history.final_val_ppl and history.final_val_ppl > 1
    assert "def fibonacci(n):" in capsys.readouterr().out


@pytest.mark.slow
def test_bench_and_tune_build_trains_model(tmp_path, text_corpus, cache_dir, capsys, monkeypatch):
    """`bench --size debug` and `tune --size debug` time the model `train --size debug` trains (same vocabulary,
    so the same parameters), at the tokenizer the size trains with."""
    from gptoughts.tools import bench, tune

    plan = _ok(["train", "--data", str(text_corpus), "--size", "debug", "--out", str(tmp_path / "r"), "--dry_run",
                "--device", "cpu"], capsys)  # fmt: skip
    params = int(re.search(r"plan: llama/debug, ([\d,]+) parameters", plan).group(1).replace(",", ""))
    cfg = load_config("default", {"model.size": "debug", "perf.device": "cpu", "perf.threads": 1,
                                  "train.block_size": 32, "train.batch_size": 2})  # fmt: skip
    assert bench.run_bench(cfg, steps=1, warmup=0)["params"] == params
    seen: list[int] = []
    real = bench.run_bench

    def spy(cfg, **kw):
        r = real(cfg, **kw)
        seen.append(r["params"])
        return r

    monkeypatch.setattr(bench, "run_bench", spy)
    tune.run_tune(cfg, steps=1, warmup=0, ac=["none"], compile_modes=["off"], fp8=["off"], batches=[2])
    assert seen and set(seen) == {params}


def test_the_plan_says_whose_default_a_value_is_and_never_that_a_batch_fits_when_none_does(
    tmp_path, text_corpus, cache_dir, capsys, monkeypatch
):
    """inl/3b's training defaults set selective checkpointing: the plan called it "asked" of a user who asked
    nothing; and on a CPU where no micro-batch fits it said the chosen one "fits 90%" of the memory."""
    from gptoughts.training import estimates

    monkeypatch.setattr(estimates, "host_memory_gib", lambda env: 8.0)  # a 3b micro-batch fits nowhere
    argv = ["train", "--data", str(text_corpus), "--tokenizer", "bytes", "--model", "inl", "--size", "3b",
            "--device", "cpu", "--out", str(tmp_path / "r"), "--dry_run"]  # fmt: skip
    text = _ok(argv, capsys)
    assert "activation checkpointing: selective (the inl/3b default)" in text, text
    batch = next(ln for ln in text.splitlines() if ln.startswith("  batch:"))
    assert "the smallest of 1, 2, 4, 8 rows" in batch and "over 90% of the 8.0 GiB" in batch, batch
    assert "fits" not in batch, batch
    asked = _ok([*argv, "--activation_checkpointing", "selective"], capsys)
    assert "activation checkpointing: selective (asked)" in asked, asked


def test_the_plan_names_the_quickstarts_shape_not_only_its_size(tmp_path, text_corpus, cache_dir, capsys):
    """The quickstart resizes the debug size (10M parameters where the README's debug row says 1.1M): the plan's
    first line names what it changed."""
    text = _ok(["train", "quickstart", "--data", str(text_corpus), "--tokenizer", "bytes", *QUIET_CPU[:2],
                "--out", str(tmp_path / "r"), "--dry_run"], capsys)  # fmt: skip
    line = next(ln for ln in text.splitlines() if ln.startswith("plan:"))
    assert line.startswith("plan: llama/debug resized (d_model 320, n_layers 6, "), line


def test_the_batch_line_and_the_memory_line_agree_when_the_epochs_cut_the_accumulation(
    tmp_path, text_corpus, cache_dir, capsys, monkeypatch
):
    """A small corpus cuts an automatic batch's accumulation to 1 (enough steps for its epoch): the micro-batch was
    chosen at the global batch's accumulation (gradients beside the activations, ~21.6 GiB at 1b) while the memory
    line, at the run's accumulation, said ~17.5: one plan, two peaks."""
    from gptoughts.training import estimates

    monkeypatch.setattr(estimates, "host_memory_gib", lambda env: 20.0)  # room for 2 rows, fewer than the cut
    text = _ok(["train", "--data", str(text_corpus), "--tokenizer", "bytes", "--size", "1b", "--device", "cpu",
                "--out", str(tmp_path / "r"), "--dry_run"], capsys)  # fmt: skip
    batch = next(ln for ln in text.splitlines() if ln.startswith("  batch:"))
    memory = next(ln for ln in text.splitlines() if ln.startswith("  memory:"))
    assert "accumulation 1 " in batch, batch
    chosen = re.search(r"estimated peak \(~([\d.]+ GiB)\)", batch)
    planned = re.search(r"memory: ~([\d.]+ GiB) peak", memory)
    assert chosen and planned and chosen.group(1) == planned.group(1), (batch, memory)


def test_the_test_sizes_warning_is_for_the_size_a_user_did_not_name(tmp_path, text_corpus, capsys):
    """A bare --data run gets the debug size and is told to name one; --size debug named it, and was told the same."""
    base = ["train", "--data", str(text_corpus), "--out", str(tmp_path / "r"), "--dry_run", "--device", "cpu"]
    assert "debug is the test size" in _ok(base, capsys)
    assert "debug is the test size" not in _ok([*base, "--size", "debug"], capsys)


def test_a_corpus_under_one_row_a_step_is_told_to_shorten_the_row(tmp_path, capsys):
    """An automatic batch cut to one row a step still leaves 2 steps of a 4,000-token corpus at block 1024: the plan
    promised "at least 20 steps" and suggested a smaller batch, which one row cannot be."""
    corpus = tmp_path / "tiny.txt"
    corpus.write_text("".join(f"line {i} of a tiny corpus, a few words each.\n" for i in range(90)))
    argv = ["train", "--data", str(corpus), "--out", str(tmp_path / "r"), "--dry_run", *QUIET_CPU,
            "--size", "125m", "--batch_size", "auto", "--block_size", "1024"]  # fmt: skip
    text = _ok(argv, capsys)
    batch = next(ln for ln in text.splitlines() if ln.startswith("  batch:"))
    assert batch.startswith("  batch: 1 x 1024 tokens x accumulation 1") and "at least 20 steps" not in batch
    warning = next(ln for ln in text.splitlines() if "optimizer step(s)" in ln)
    assert "lower --block_size" in warning and "--batch_size" not in warning


def test_a_dry_run_says_a_small_corpus_trains_a_smaller_vocabulary(tmp_path, text_corpus, capsys):
    """A dry run of a 17 KB file planned vocab 8,192 and 1.1M parameters; the run trained 329 tokens and 123K
    parameters: the plan's model and its warnings were sized on a vocabulary the corpus cannot train."""
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("".join(f"line {i} of a small corpus, a few words each.\n" for i in range(300)))
    base = ["train", "--out", str(tmp_path / "r"), "--dry_run", "--device", "cpu", "--size", "debug"]
    text = _ok([*base, "--data", str(tiny), "--tokenizer", "bpe:8192"], capsys)
    assert "the vocabulary is planned at the 8,192 asked, but a BPE trained on" in text, text
    text = _ok([*base, "--data", str(text_corpus), "--tokenizer", "bpe:512"], capsys)  # enough text for 512
    assert "the vocabulary is planned" not in text, text


def test_a_warmup_longer_than_the_run_says_the_warmup_the_plan_shows(tmp_path, text_corpus, capsys):
    # the plan's steps line showed the warmup cut to the run's 6 steps, its warning "the warmup (20 steps)"
    argv = ["train", "--data", str(text_corpus), "--out", str(tmp_path / "r"), "--dry_run", *QUIET_CPU,
            "--size", "debug", "--tokenizer", "bytes", "--max_steps", "6", "--warmup_steps", "20"]  # fmt: skip
    text = _ok(argv, capsys)
    assert "warmup 6," in next(ln for ln in text.splitlines() if ln.startswith("  steps:"))
    assert "the warmup (20 steps, cut to the run's 6) covers the whole 6-step run" in text, text


def _plan_at(memory_gib: float, why_batch: str):
    from gptoughts.training.plan import BatchPlan, RunPlan

    batch = BatchPlan(
        micro_batch=64, grad_accum=4, world_size=1, block_size=2048, tokens_per_step=524_288, total_steps=8,
        train_tokens=8_000_000, epochs=0.5, stop_rule="max_steps", warmup_steps=1, eval_interval=8,
        save_interval=0, why={"batch_size": why_batch},
    )  # fmt: skip
    return RunPlan(
        model="deepseek/small", params=1, params_non_embedding=1, trainable_params=1, vocab_size=320,
        block_size=2048, corpus={}, batch=dataclasses.asdict(batch), memory_gib=memory_gib,
        device_memory_gib=139.8, tokens_per_s=None, speed_basis="", hours=None, out="o", resume=None,
        resolved={}, warnings=[],
    ), batch  # fmt: skip


def test_a_micro_batch_measured_to_fit_is_neither_refused_nor_warned_by_the_formula():
    """Seen on an H200: deepseek small's auto micro-batch 64 fit in real steps (122.9 GiB peak) while the formula
    said 141.5 GiB of 139.8 and the plan told the user to lower the batch it had just chosen; 10% more and the run
    would have been refused. A measured micro-batch is what the run fits: the estimate stays, marked as such."""
    from gptoughts.training import plan as plan_mod

    measured, batch = _plan_at(141.5, "auto: largest that fits")
    assert plan_mod.memory_refusal(measured, on_cpu=False) is None
    assert "measured to fit" in measured._memory_figure()
    over, _ = _plan_at(160.0, "auto: largest that fits")
    assert plan_mod.memory_refusal(over, on_cpu=False) is None
    asked, _ = _plan_at(160.0, "asked (--batch_size 64)")
    assert "exceeds this GPU" in plan_mod.memory_refusal(asked, on_cpu=False)
    assert "measured" not in asked._memory_figure()

    for why, warned in (("auto: largest that fits", False), ("asked", True)):
        b = dataclasses.replace(batch, why={"batch_size": why})
        lines = plan_mod._memory_warning(141.5, 139.8, b, on_cpu=False)
        assert any("exceeds this GPU" in w for w in lines) == warned, (why, lines)
