"""Seams around a trained run, typed as a newcomer types them: bench and tune counts that are not counts, GPU
names for estimate (case, dashes, "L40" that is not an "L4"), and the Python API's generate/evaluate/train given
a path, a Path, a model instead of what load returns, or arguments of the wrong type."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
from cli_helpers import FAST, run_cli

import gptoughts
from gptoughts.errors import UserError


def _error_line(code: int, text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.startswith("error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in text, text[-2000:]
    return lines[0]


DEBUG = [
    "--size",
    "debug",
    "--block_size",
    "32",
    "--batch_size",
    "2",
    "--device",
    "cpu",
    "--compile",
    "false",
]


# ------------------------------------------------------------------------------------------- bench and tune


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--steps", "0"], "--steps must be a whole number >= 1, got '0'"),  # was a ZeroDivisionError
        (["--steps", "x"], "--steps must be a whole number >= 1, got 'x'"),  # was a ValueError traceback
        (["--steps", "-1"], "--steps must be a whole number >= 1"),  # was "tokens/s -148,664,267", exit 0
        (["--warmup", "-1"], "--warmup must be a whole number >= 0"),
        (["--kernels", "x"], "--kernels must be a whole number >= 0"),
    ],
)
def test_bench_counts_are_checked_in_one_line(flags, needle, capsys):
    line = _error_line(*run_cli(["bench", *DEBUG, *flags], capsys))
    assert needle in line, line


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--steps", "0"], "--steps must be a whole number >= 1"),  # was a ZeroDivisionError
        (["--batches", "0"], "--batches takes micro-batch sizes >= 1 or auto"),  # was a ZeroDivisionError
        (["--batches", "x"], "got 'x'"),  # was timed as batch 8 and written to tuned.toml
    ],
)
def test_tune_counts_are_checked_before_any_trial(flags, needle, tmp_path: Path, capsys):
    out = tmp_path / "tuned.toml"
    line = _error_line(*run_cli(["tune", *DEBUG, *flags, "--out", str(out)], capsys))
    assert needle in line and not out.exists(), line


def test_run_bench_refuses_zero_steps_from_python():
    from gptoughts.config import load_config
    from gptoughts.tools.bench import run_bench

    with pytest.raises(UserError, match="steps >= 1"):
        run_bench(load_config("default", {"model.size": "debug"}), steps=0)


def test_bench_kernels_off_a_gpu_is_refused_before_anything_is_built(capsys, monkeypatch):
    # on a CPU it announced "+ 2 profiled", ran them, and printed no kernel table
    from gptoughts.training import modeling

    monkeypatch.setattr(modeling, "build_model", lambda *a, **k: pytest.fail("built a model"))
    argv = [
        "bench",
        "--size",
        "debug",
        "--block_size",
        "32",
        "--batch_size",
        "1",
        "--device",
        "cpu",
        "--kernels",
        "2",
    ]
    assert "--kernels profiles CUDA kernels; this bench runs on cpu" in _error_line(*run_cli(argv, capsys))


def test_bench_says_the_compile_it_ran_not_auto():
    from gptoughts.tools.bench import format_result

    r = {"family": "llama", "size": "debug", "device": "cpu", "precision": "fp32", "compile": "auto",
         "batch_size": 2, "block_size": 32, "grad_accum": 1, "params": 1e6, "tokens_per_s": 1.0, "step_ms": 1.0,
         "mfu": None, "peak_memory_gib": None, "data": "synthetic", "resolved": {"compile": False}}  # fmt: skip
    assert "compile=off" in format_result(r) and "compile=auto" not in format_result(r)


# --------------------------------------------------------------------------------------------- GPU names


@pytest.mark.parametrize(
    "name, peak_tflops",
    [
        ("NVIDIA L40", 181),  # was L4's figures (121): the MFU of a run on an L40 1.5x too high
        ("L40", 181),
        ("NVIDIA L40S", 362),
        ("NVIDIA L4", 121),
        ("h100-pcie", 756),  # was a full H100 SXM's 989
        ("rtx4090", 165),  # was "unknown GPU"
        ("NVIDIA GeForce RTX 4090", 165),
        ("NVIDIA H100 80GB HBM3", 989),
        ("NVIDIA H100 NVL", 835),
        ("NVIDIA A100-SXM4-40GB", 312),
        ("NVIDIA A10", 125),
        ("GH200", 989),
        ("h200", 989),
    ],
)
def test_gpu_names_match_by_whole_words(name, peak_tflops):
    from gptoughts.perf.hardware import peak_flops

    assert peak_flops(name) == peak_tflops * 1e12


def test_estimate_on_an_l40_is_not_an_l4(capsys):
    import json

    speed = {}
    for gpu in ("L40", "L4"):
        code, text = run_cli(
            ["estimate", "--size", "debug", "--batch_size", "1", "--gpu", gpu, "--json"], capsys
        )
        assert code == 0, text
        speed[gpu] = json.loads(text)["flops_tokens_per_s"]
    assert speed["L40"] / speed["L4"] == pytest.approx(181 / 121)


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--num_gpus", "0"], "--num_gpus must be a whole number >= 1"),  # was taken as 1 GPU
        (["--num_gpus", "-2"], "--num_gpus must be a whole number >= 1"),  # was "speed: -154,381 tokens/s"
        (["--num_gpus", "1.5"], "--num_gpus must be a whole number >= 1"),  # was cut to 1
        (["--tokens", "inf"], "--tokens must be a number of tokens >= 1"),  # was an OverflowError traceback
        (["--tokens", "-5"], "--tokens must be a number of tokens >= 1"),  # was "time for -5 tokens: -0.0 h"
        (["--mfu", "nan"], "--mfu must be a fraction"),  # was "speed: nan tokens/s"
        (["--mfu", "2"], "--mfu must be a fraction"),
        (["--price", "-1"], "--price must be a price per GPU-hour >= 0"),
    ],
)
def test_estimate_numbers_are_checked(flags, needle, capsys):
    line = _error_line(*run_cli(["estimate", "--size", "debug", "--batch_size", "1", *flags], capsys))
    assert needle in line, line


@pytest.mark.parametrize(
    "flags, needle",
    [
        # each printed a memory, a speed and a cost for a run that train refuses
        (["--parallel.tp", "2"], "--parallel.tp 2 splits the run over groups of 2 GPUs"),  # on one GPU
        (
            ["--parallel.pp", "4", "--num_gpus", "2", "--model.tie_embeddings", "false"],
            "--num_gpus 2 does not divide",
        ),
        (["--parallel.tp", "2", "--num_gpus", "2", "--model", "deepseek"], "no tensor-parallel plan"),
        (["--parallel.ep", "3", "--num_gpus", "3", "--model", "deepseek"], "do not split over 3 ranks"),
        (["--parallel.ep", "2", "--num_gpus", "2"], "no routed experts"),
        (["--parallel.pp", "2", "--num_gpus", "2", "--model", "gpt2"], "parallel.pp covers the llama family"),
        (
            ["--parallel.tp", "2", "--num_gpus", "4", "--strategy", "ddp"],
            "ddp does not combine with --parallel.tp",
        ),
        (["--cpu_offload", "true", "--strategy", "ddp"], "use --parallel.strategy fsdp"),
    ],
)
def test_estimate_refuses_a_layout_train_refuses(flags, needle, capsys):
    line = _error_line(*run_cli(["estimate", "--size", "debug", "--batch_size", "1", *flags], capsys))
    assert needle in line, line


def test_estimate_of_a_layout_train_takes_still_prints_its_figures(capsys):
    for flags in (
        ["--parallel.tp", "2", "--num_gpus", "4"],
        ["--model", "deepseek", "--parallel.ep", "2", "--num_gpus", "2"],
    ):
        code, text = run_cli(["estimate", "--size", "debug", "--batch_size", "1", *flags], capsys)
        assert code == 0 and "tokens/s" in text, text[-2000:]


# ---------------------------------------------------------------------------------------------- Python API


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory, shared_corpus: Path):
    out = tmp_path_factory.mktemp("h4") / "run"
    gptoughts.train(
        data_path=str(shared_corpus), save_dir=str(out), max_steps=1, **{**FAST, "train.sample_prompts": []}
    )
    return gptoughts.load(out)


def test_train_takes_pathlib_paths(shared_corpus: Path, tmp_path: Path):
    # was "'PosixPath' object is not iterable" (data_path) and "run.out must be a string" (save_dir)
    _, _, history = gptoughts.train(
        data_path=shared_corpus, save_dir=tmp_path / "run", max_steps=1, dry_run=True, **FAST
    )
    assert history.run_dir == str(tmp_path / "run")
    with pytest.raises(UserError, match="data_path must be a path or a list of paths"):
        gptoughts.train(data_path=5, max_steps=1, dry_run=True, **FAST)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(max_new_tokens="5"), "max_new_tokens must be a whole number"),
        (dict(temperature="0.5"), "temperature must be a number >= 0"),
        (dict(temperature=float("nan")), "temperature must be a number >= 0"),  # was sampled: noise
        (dict(temperature=float("inf")), "temperature must be a number >= 0"),
        (dict(top_k=2.5), "top_k must be a whole number"),
        (dict(top_k=-3), "top_k must be a whole number >= 0"),  # the CLI refuses it; the API ignored it
        (dict(seed="1"), "seed must be a whole number or None"),
    ],
)
def test_generate_names_the_argument_of_the_wrong_type(loaded, kwargs, needle):
    with pytest.raises(UserError, match=needle):
        gptoughts.generate(loaded, "def ", **{"max_new_tokens": 2, **kwargs})


def test_generate_given_a_run_path_or_the_trained_model_says_to_load_it(loaded):
    for wrong in (str(loaded.checkpoint), loaded.model):  # was "'str' object has no attribute 'family'"
        with pytest.raises(UserError, match=r"gptoughts\.load"):
            gptoughts.generate(wrong, "def ", max_new_tokens=2)
    with pytest.raises(UserError, match="prompt must be a string"):
        gptoughts.generate(loaded, None, max_new_tokens=2)
    # a batch of prompts: said with the call that generates each (was "got list ['def ', 'import os']")
    with pytest.raises(
        UserError, match=r"a list of 2; generate each: \[gptoughts\.generate\(loaded, p\) for p"
    ):
        gptoughts.generate(loaded, ["def ", "import os"], max_new_tokens=2)


def test_generate_past_the_model_length_names_a_function_that_takes_use_cache(loaded):
    from gptoughts.sampling import generate

    n = loaded.model.args.max_seq_len
    with pytest.raises(UserError) as e:
        gptoughts.generate(loaded, "def ", max_new_tokens=n + 1)
    assert "gptoughts.sampling.generate(" in str(e.value) and "use_cache=False" in str(e.value)
    assert "use_cache" in inspect.signature(generate).parameters  # the function named takes it


def test_evaluate_takes_one_path_as_a_string(loaded, shared_corpus: Path):
    # a str was read as a list of one-letter paths: "t does not exist"
    res = gptoughts.evaluate(loaded, str(shared_corpus), block_size=16, max_batches=1)
    assert res["loss"] > 0 and res["tokens"] > 0


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(max_batches=0), "max_batches must be a whole number >= 1"),  # was loss 0.0, perplexity 1.0
        (dict(batch_size=-1), "batch_size must be a whole number >= 1"),  # the same
        (dict(batch_size=0), "batch_size must be a whole number >= 1"),  # was a ZeroDivisionError
        (dict(block_size=0), "block_size must be a whole number >= 1"),  # was the run's block, silently
        (dict(batch_size="8"), "batch_size must be a whole number >= 1"),  # was a TypeError
    ],
)
def test_evaluate_names_the_argument_out_of_range(loaded, shared_corpus: Path, kwargs, needle):
    with pytest.raises(UserError, match=needle):
        gptoughts.evaluate(loaded, str(shared_corpus), **kwargs)


def test_evaluate_given_a_run_path_says_to_load_it(loaded, shared_corpus: Path):
    # was "'str' object has no attribute 'config'"
    with pytest.raises(UserError, match=r"loaded = gptoughts\.load\(RUN_DIR\); gptoughts\.evaluate\(loaded"):
        gptoughts.evaluate(str(loaded.checkpoint), str(shared_corpus))


def test_eval_of_a_prepared_dataset_names_evals_own_flags(
    loaded, shared_corpus: Path, tmp_path: Path, capsys
):
    """The refusal spoke of train and suggested `--tokenizer bytes`, which eval does not take (it reads a corpus with
    the model's own tokenizer), and came after the model was loaded."""
    from gptoughts.data.prepare import prepare

    shards = tmp_path / "shards"
    prepare([str(shared_corpus)], str(shards), "bytes", progress=False)
    run = str(loaded.checkpoint.parent.parent)
    line = _error_line(*run_cli(["eval", run, "--data", str(shards)], capsys))
    assert "prepared dataset" in line and "eval" in line and f"--data {shared_corpus}" in line, line
    assert "--tokenizer" not in line and "train" not in line, line


# ------------------------------------------------------------------------------------------------------ plot


def test_plot_of_a_runs_file_or_checkpoint_names_the_run(tmp_path: Path, capsys):
    run = tmp_path / "run"
    (run / "checkpoints" / "step_000001").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0, "lr": 0.001}\n')
    # was "run/metrics.jsonl has no metrics.jsonl; pass a run directory"
    line = _error_line(*run_cli(["plot", str(run / "metrics.jsonl")], capsys))
    assert "is a file" in line and f"gptoughts plot {run}" in line, line
    line = _error_line(*run_cli(["plot", str(run / "checkpoints" / "step_000001")], capsys))
    assert f"gptoughts plot {run}" in line, line


# ---------------------------------------------------------------------------------------------------- export


def test_export_never_writes_over_the_base_a_run_reads(tmp_path: Path):
    """`gptoughts export runs/ft BASE --overwrite` (BASE: the folder the LoRA run was fine-tuned from) replaced BASE's
    weights by the merged ones, which the run rebuilds itself over at every load, then failed with shutil's
    SameFileError traceback. Refused before the load now, BASE untouched."""
    import json

    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (base / "model.safetensors").write_bytes(b"base weights")
    run = tmp_path / "ft"
    (run / "checkpoints").mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"family": "llama", "args": {}, "init_from": str(base)}))
    for source in (run, run / "checkpoints", base):
        with pytest.raises(UserError, match="is the model folder .* is read from"):
            gptoughts.export(source, base, overwrite=True)
    assert (base / "model.safetensors").read_bytes() == b"base weights"


def test_an_export_cut_short_leaves_no_half_model(loaded, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Ctrl-C while the weights were written left OUT with a config.json and half a safetensors file: it looked like
    a model, and the same command again was refused ("exists and is not empty"). The export is renamed into place
    when complete now: nothing at OUT, and the same command then writes it."""
    from gptoughts.models import hf_export

    real = hf_export.save_state_dict

    def cut(sd, out, max_shard_bytes):
        (Path(out) / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    out = tmp_path / "exported"
    monkeypatch.setattr(hf_export, "save_state_dict", cut)
    with pytest.raises(KeyboardInterrupt):
        gptoughts.export(loaded.checkpoint, out)
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == []
    monkeypatch.setattr(hf_export, "save_state_dict", real)
    assert gptoughts.export(loaded.checkpoint, out) == out and (out / "config.json").is_file()
    assert (out / "model.safetensors").stat().st_size > 100


def test_load_of_a_file_or_of_nothing_says_what_it_takes(tmp_path: Path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(UserError, match="is a file; pass a run directory"):  # was "no valid checkpoint under"
        gptoughts.load(tmp_path / "notes.txt")
    with pytest.raises(UserError, match="load takes the path of a run"):  # was a TypeError from pathlib
        gptoughts.load(None)


def test_a_tiny_temperature_samples_as_greedy_from_python_and_the_command_line(loaded, capsys):
    # 1e-40 sampled token 0 (end-of-text) at once: logits / t overflowed to inf and the softmax to NaN
    kw = dict(max_new_tokens=6, seed=0)
    greedy = gptoughts.generate(loaded, "def ", temperature=0.0, **kw)
    assert gptoughts.generate(loaded, "def ", temperature=1e-40, **kw) == greedy
    run = str(loaded.checkpoint.parent.parent)
    texts = []
    for t in ("0", "1e-40"):
        code, text = run_cli(
            ["sample", run, "--prompt", "def ", "--max_new_tokens", "6", "--temperature", t], capsys
        )
        assert code == 0, text[-2000:]
        texts.append(text)
    assert texts[1] == texts[0] and greedy in texts[0]


@pytest.mark.parametrize("left", ["empty folder", "no folder"])
def test_a_run_whose_tokenizer_is_gone_is_refused_in_one_line(loaded, left, tmp_path: Path, capsys):
    # an emptied tokenizer/ was a six-line error about train's --tokenizer flag, after the weights were read
    import shutil

    run = tmp_path / "run"
    shutil.copytree(loaded.checkpoint.parent.parent, run)
    shutil.rmtree(run / "tokenizer")
    if left == "empty folder":
        (run / "tokenizer").mkdir()
    with pytest.raises(
        UserError, match=r"tokenizer\.json is missing .* put back the run's tokenizer/ folder"
    ):
        gptoughts.load(run)
    for argv in (
        ["sample", str(run), "--prompt", "x"],
        ["eval", str(run), "--data", str(run / "config.toml")],
    ):
        assert "tokenizer.json is missing" in _error_line(*run_cli(argv, capsys))


def test_eval_of_two_runs_refuses_the_second_ones_missing_tokenizer_before_loading_the_first(
    loaded, tmp_path: Path, capsys, monkeypatch
):
    import shutil

    good = loaded.checkpoint.parent.parent
    run = tmp_path / "run"
    shutil.copytree(good, run)
    shutil.rmtree(run / "tokenizer")
    monkeypatch.setattr(gptoughts.api, "load", lambda *a, **k: pytest.fail("a model loaded first"))
    argv = ["eval", str(good), str(run), "--data", str(run / "config.toml")]
    assert "tokenizer.json is missing" in _error_line(*run_cli(argv, capsys))


def test_sample_past_the_model_length_names_the_flags_value_that_fits(loaded, capsys):
    # was the Python API's hint (gptoughts.sampling.generate(..., use_cache=False)) to a user of the command line
    run, n = str(loaded.checkpoint), loaded.model.args.max_seq_len
    argv = ["sample", run, "--prompt", "ab", "--device", "cpu", "--max_new_tokens"]
    line = _error_line(*run_cli([*argv, str(n)], capsys))
    assert line.endswith(f"pass --max_new_tokens {n - 1} or less") and "use_cache" not in line, line
    line = _error_line(*run_cli([*argv[:3], "x" * (n + 1), *argv[4:], "1"], capsys))
    assert line.endswith("shorten the prompt (--prompt)"), line
    code, text = run_cli([*argv, str(n - 1), "--temperature", "0"], capsys)
    assert code == 0 and text.startswith("ab"), text[-500:]


def test_eval_of_one_run_named_twice_is_refused_however_it_is_spelt(loaded, shared_corpus: Path, capsys):
    # `eval runs/a runs/a/` loaded and scored the same run twice, side by side
    run = loaded.checkpoint.parent.parent
    for again in (f"{run}/", str(run / ".." / run.name)):
        line = _error_line(*run_cli(["eval", str(run), again, "--data", str(shared_corpus)], capsys))
        assert "more than once" in line and again in line, line
