"""Seams a newcomer found around bench, sample, eval, export and tune: bench refuses a shape that cannot fit as train
does (and says what it is doing before its first slow step), sample/eval/export name what they read and suggest
the flag meant, an empty prompt starts a document without printing its end-of-text, the hint after a Ctrl-C, and
tuned.toml's header."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from cli_helpers import run_cli

from gptoughts import cli
from gptoughts.config import load_config
from gptoughts.errors import UserError

DEBUG_BENCH = ["--size", "debug", "--block_size", "32", "--batch_size", "2", "--device", "cpu",
               "--precision", "fp32", "--compile", "false", "--steps", "1", "--warmup", "1"]  # fmt: skip


def _error_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in text and "usage:" not in text, text[-2000:]
    return lines[0]


@pytest.fixture
def host_memory(monkeypatch: pytest.MonkeyPatch):
    """Set the host memory available (what a CPU run's estimate is compared with), in GiB."""
    from gptoughts.training.checkpoint import staging

    def set_gib(gib: float) -> None:
        monkeypatch.setattr(staging, "host_memory_available", lambda: int(gib * 2**30))

    return set_gib


@pytest.fixture
def nothing_built_for_real(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model built anywhere but on the meta device fails the test (a 1b on this CPU would fill its memory)."""
    from gptoughts.training import modeling

    real = modeling.build_model

    def meta_only(cfg, env, data, *, meta=False):
        assert meta, "bench built the model for real before refusing it"
        return real(cfg, env, data, meta=True)

    monkeypatch.setattr(modeling, "build_model", meta_only)


# ---------------------------------------------------------------------------------- bench: memory, what it does


def test_bench_refuses_the_readme_1b_shape_on_a_small_cpu_as_train_does(
    host_memory, nothing_built_for_real, capsys
):
    """`gptoughts bench --size 1b --block_size 2048 --batch_size 8` on a CPU grew ~1 GB every 5 s without a word;
    train refused the same shape (39.8 GiB estimated, 22.5 available). bench now refuses it in one line, before
    building anything."""
    host_memory(22.5)
    code, text = run_cli(["bench", "--size", "1b", "--block_size", "2048", "--batch_size", "8", "--device", "cpu"],
                         capsys)  # fmt: skip
    line = _error_line(text)
    assert code == 2 and "estimated peak memory" in line and "22.5 GiB" in line, line
    assert "--ignore_memory_estimate" in line and "--batch_size" in line


def test_bench_refusal_is_the_trains_and_ignore_memory_estimate_runs_anyway(host_memory, capsys):
    host_memory(0.001)  # ~1 MiB: even the debug model exceeds it
    code, text = run_cli(["bench", *DEBUG_BENCH], capsys)
    bench_line = _error_line(text)
    assert code == 2 and "estimated peak memory" in bench_line
    code, text = run_cli(
        ["train", "--data", "@stdlib", *DEBUG_BENCH[:-4], "--max_steps", "1", "--out", "r"], capsys
    )
    train_line = _error_line(text)
    assert code == 2 and train_line.split(" at micro-batch")[0] == bench_line.split(" at micro-batch")[0]
    code, text = run_cli(["bench", *DEBUG_BENCH, "--ignore_memory_estimate"], capsys)
    assert code == 0 and "tokens/s" in text, text[-2000:]


def test_bench_says_what_it_does_before_the_first_step_on_stderr(capsys):
    code = cli.main(["bench", *DEBUG_BENCH, "--json"])
    out = capsys.readouterr()
    assert code == 0
    json.loads(out.out)  # stdout: the result alone
    (line,) = [ln for ln in out.err.splitlines() if ln.startswith("bench:")]
    for part in (
        "llama/debug",
        "parameters",
        "micro-batch 2 x 32 tokens",
        "cpu",
        "fp32",
        "1 warmup + 1 timed",
    ):
        assert part in line, line


def test_tune_records_a_refused_combination_and_goes_on(host_memory):
    """tune times each combination through bench: one refused on memory is that row's error, not the search's end."""
    from gptoughts.tools.tune import run_tune

    host_memory(0.001)
    cfg = load_config("default", {"model.size": "debug", "train.block_size": 32, "train.batch_size": 2,
                                  "perf.device": "cpu", "perf.precision": "fp32"})  # fmt: skip
    (trial,) = run_tune(cfg, steps=1, warmup=0, ac=["none"])
    assert trial.tokens_per_s is None and "estimated peak memory" in (trial.error or ""), trial


# ---------------------------------------------------------------------------------------- sample, eval, export


@pytest.mark.parametrize("command", ["sample", "eval", "export"])
def test_a_path_that_is_not_there_names_what_is_read(command, capsys):
    extra = {"sample": [], "eval": ["--data", "x.txt"], "export": ["out"]}[command]
    code, text = run_cli([command, "Qwen/Qwen2.5-0.5B", *extra], capsys)
    line = _error_line(text)
    assert code == 2 and "run directory" in line and "Hugging Face model folder" in line, line
    assert "hf download Qwen/Qwen2.5-0.5B" in line


def test_a_folder_that_holds_no_model_names_what_is_read(tmp_path, capsys):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("hi")
    code, text = run_cli(["sample", str(tmp_path / "notes")], capsys)
    line = _error_line(text)
    assert code == 2 and "holds no run, checkpoint or model" in line and "Hugging Face model folder" in line


@pytest.mark.parametrize(
    "argv, meant",
    [
        (["sample", "RUN", "--max_new_toks", "3"], "--max_new_tokens"),
        (["sample", "RUN", "--temprature=0.5"], "--temperature"),
        (["eval", "RUN", "--dta", "x"], "--data"),
        (["export", "RUN", "OUT", "--formt", "hf"], "--format"),
        (["plot", "RUN", "--overwite"], "--overwrite"),
        (["env", "--jsn"], "--json"),
    ],
)
def test_a_flag_typo_suggests_the_flag_meant(argv, meant, capsys):
    code, text = run_cli(argv, capsys)
    line = _error_line(text)
    assert code == 2 and f"did you mean {meant}?" in line, line


def test_an_unknown_short_option_is_named_as_typed(capsys):
    # the review: `sample RUN -p hi` said "unknown option --p"
    code, text = run_cli(["sample", "RUN", "-p", "hi"], capsys)
    line = _error_line(text)
    assert code == 2 and "unknown option -p " in line and "--p" not in line, line


def test_an_argparse_error_is_one_line(capsys):
    code, text = run_cli(["export", "RUN", "OUT", "--format", "gguf"], capsys)
    line = _error_line(text)
    assert code == 2 and "gguf" in line and "hf" in line


def _sampler(diffusion: bool):
    from gptoughts.data.tokenizer import bytes_tokenizer
    from gptoughts.models import build_model, model_args
    from gptoughts.sampling import Sampler

    torch.manual_seed(0)
    family = "llada" if diffusion else "llama"
    overrides = {"vocab_size": 320} | ({"mask_token_id": 2} if diffusion else {})
    model = build_model(family, model_args(family, "debug", overrides), device="cpu")
    tok = bytes_tokenizer()
    return Sampler(model, tok, diffusion=diffusion, max_new_tokens=6, temperature=0.0), model, tok


@pytest.mark.parametrize("diffusion", [False, True], ids=["causal", "diffusion"])
def test_an_empty_prompt_starts_a_document_without_printing_its_end_of_text(diffusion):
    from gptoughts.sampling import diffusion_generate, generate

    sampler, model, tok = _sampler(diffusion)
    text = sampler("")
    start = torch.tensor([[tok.eos_id]])
    if diffusion:
        ids = diffusion_generate(model, start, gen_length=6, steps=6, block_length=6, mask_id=tok.mask_id)[0]
        ids = ids.tolist()
        ids = ids[: ids.index(tok.eos_id, 1) + 1] if tok.eos_id in ids[1:] else ids
    else:
        ids = generate(model, start, 6, temperature=0.0, eos_id=tok.eos_id)[0].tolist()
    assert text == tok.decode(ids[1:])  # the model's continuation of "a document starts here", and only it
    assert sampler("def ").startswith("def ")  # a prompt is still printed with its continuation


# ---------------------------------------------------------------------------------------- after a run, tune


def _summary_printed(stop_reason: str, capsys) -> str:
    from gptoughts.api import _print_summary

    summary = {"tokens_per_s": 100.0, "mfu": None, "best_val_loss": None, "best_step": None, "final_val_loss": None,
               "session_steps": 3, "session_tokens": 96, "wall_s": 1.0, "resumed_at_step": 0, "steps": 3,
               "tokens": 96, "plots": [], "checkpoints": "RUN/checkpoints"}  # fmt: skip
    history = SimpleNamespace(sample=None, summary=summary, stop_reason=stop_reason)
    asm = SimpleNamespace(run_dir=Path("RUN"), data=SimpleNamespace(prefs=None, sft=None))
    _print_summary(asm, history)
    return next(ln for ln in capsys.readouterr().out.splitlines() if "next:" in ln)


def test_the_hint_after_ctrl_c_is_a_plain_resume(capsys):
    line = _summary_printed("interrupted (checkpoint saved; resume with --resume auto)", capsys)
    assert "gptoughts train --resume auto --out RUN  |" in line and "--max_steps" not in line, line
    # a finished run continues only past its end: there the hint names the budget
    assert "--resume auto --out RUN --max_steps N" in _summary_printed("max steps", capsys)


def test_tuned_toml_says_tune_wrote_it_and_how_to_use_it(tmp_path):
    from gptoughts.tools.tune import Trial, write_winner

    cfg = load_config("default", {"model.size": "debug", "train.block_size": 32})
    settings = {"perf.activation_checkpointing": "full", "perf.compile_mode": "blocks", "perf.compile": False,
                "perf.fp8": False, "perf.fp8_recipe": "tensorwise", "train.batch_size": 4}  # fmt: skip
    out = write_winner(Trial(settings, 1234.0, None, None), cfg, tmp_path / "x.tmp", name="tuned.toml")
    text = out.read_text()
    assert "written by the run" not in text.lower()
    head = [ln for ln in text.splitlines() if ln.startswith("#")]
    assert "gptoughts tune" in head[0] and "1,234 tokens/s" in head[0]
    assert any("gptoughts train tuned.toml --data" in ln for ln in head), head
    tuned = load_config(str(out.rename(tmp_path / "tuned.toml")))
    assert tuned.perf.activation_checkpointing == "full" and tuned.train.batch_size == 4


@pytest.mark.parametrize("diffusion", [False, True], ids=["causal", "diffusion"])
def test_a_request_past_the_context_names_max_new_tokens(diffusion):
    # `gptoughts sample LLADA_RUN --max_new_tokens 5000` said "gen_length (5000) exceeds ...": not a name it takes
    sampler, model, _ = _sampler(diffusion)
    n = model.args.max_seq_len + 1
    with pytest.raises(UserError, match=rf"max_new_tokens \({n}\)") as e:
        sampler("def ", max_new_tokens=n)
    assert "gen_length" not in str(e.value)
