"""Where a resume meets a folder or a config it does not fit: an explicit checkpoint resumed into a folder that holds
another run is refused (its own folder, an empty or a new one take it), and a resume that asks for another optimizer
than the checkpoint's is refused before anything is written, in one line each."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from cli_helpers import FASTRUN, ok, refused_leaving

from gptoughts.training.checkpoint import store as ckpt

BASE = ["--size", "debug", "--tokenizer", "bytes", *FASTRUN, "--save_interval", "2"]


def _argv(corpus: Path, out: Path, *flags: str) -> list[str]:
    steps = [] if "--max_steps" in flags else ["--max_steps", "4"]
    return ["train", "--data", str(corpus), *BASE, *steps, "--out", str(out), *flags]


@pytest.fixture
def two_runs(tmp_path, text_corpus, cache_dir, capsys) -> tuple[Path, Path]:
    """Runs ``a`` and ``b`` (another learning rate), each with checkpoints at steps 2 and 4."""
    a, b = tmp_path / "a", tmp_path / "b"
    ok(_argv(text_corpus, a), capsys)
    ok(_argv(text_corpus, b, "--learning_rate", "1e-3"), capsys)
    assert ckpt.list_steps(a / "checkpoints") == ckpt.list_steps(b / "checkpoints") == [2, 4]
    return a, b


# ------------------------------------------------------------------------- an explicit checkpoint, and its folder


def test_a_checkpoint_of_another_run_is_not_resumed_into_a_run(two_runs, text_corpus, capsys):
    a, b = two_runs
    step2 = a / "checkpoints" / "step_000002"
    line = refused_leaving(b, _argv(text_corpus, b, "--resume", str(step2)), capsys, str(b), "another run")
    assert "--resume auto" in line and "--out" in line, line
    # the run's folder given instead of its checkpoint, and --overwrite beside it: refused alike
    refused_leaving(b, _argv(text_corpus, b, "--resume", str(a)), capsys, str(b))
    refused_leaving(b, _argv(text_corpus, b, "--resume", str(step2), "--overwrite"), capsys, str(b))


def test_a_checkpoint_resumes_into_its_own_run_an_empty_or_a_new_folder(
    two_runs, tmp_path, text_corpus, capsys
):
    a, _ = two_runs
    step2 = a / "checkpoints" / "step_000002"
    ok(_argv(text_corpus, a, "--resume", str(a / "checkpoints" / "step_000004"), "--max_steps", "5"), capsys)
    assert ckpt.list_steps(a / "checkpoints")[-1] == 5
    empty = tmp_path / "empty"
    empty.mkdir()
    for out in (empty, tmp_path / "new"):
        text = ok(_argv(text_corpus, out, "--resume", str(step2)), capsys)
        assert f"resumed from {step2} at step 2" in text, text[-1500:]
        assert ckpt.list_steps(out / "checkpoints") == [4]


def test_an_earlier_checkpoint_is_not_rewound_into_its_own_run(two_runs, text_corpus, capsys):
    """Step 2 resumed into its own run, which holds step 4: a later --resume auto took step 4 again, going on from
    the other history (metrics rows of both, steps missing between them). Refused, changing nothing, with the
    branch that keeps both."""
    a, _ = two_runs
    step2 = a / "checkpoints" / "step_000002"
    line = refused_leaving(
        a, _argv(text_corpus, a, "--resume", str(step2)), capsys, "step_000004", "--resume auto"
    )
    assert f"--out {a}-from-step_000002" in line, line


def test_a_checkpoint_is_not_resumed_into_a_folder_of_other_files(two_runs, tmp_path, text_corpus, capsys):
    a, _ = two_runs
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    refused_leaving(
        other,
        _argv(text_corpus, other, "--resume", str(a / "checkpoints" / "step_000002")),
        capsys,
        str(other),
    )


# -------------------------------------------------------------------------------------- another optimizer


@pytest.mark.parametrize(("was", "asked"), [("adamw", "muon"), ("muon", "adamw")])
def test_a_resume_with_another_optimizer_is_refused_before_anything_is_written(
    was, asked, tmp_path, text_corpus, cache_dir, capsys
):
    run = tmp_path / "r"
    ok(_argv(text_corpus, run, "--optimizer", was), capsys)
    line = refused_leaving(
        tmp_path,
        _argv(text_corpus, run, "--resume", "auto", "--max_steps", "6", "--optimizer", asked),
        capsys,
        str(run),
        f"--optimizer {was}",
    )
    assert asked in line, line
    # an explicit checkpoint, into a new folder (a branch of the run): refused alike, no folder made
    step2 = str(run / "checkpoints" / "step_000002")
    refused_leaving(
        tmp_path,
        _argv(text_corpus, tmp_path / "branch", "--resume", step2, "--optimizer", asked),
        capsys,
        was,
    )
    # a checkpoint moved out of its run (no config.toml beside it): its state says which optimizer wrote it
    moved = tmp_path / "moved" / "step_000002"
    shutil.copytree(step2, moved)
    refused_leaving(
        tmp_path, _argv(text_corpus, tmp_path / "branch", "--resume", str(moved), "--optimizer", asked), capsys,
        f"--optimizer {was}",
    )  # fmt: skip


def test_a_checkpoint_of_another_model_is_refused_as_such(two_runs, tmp_path, text_corpus, capsys):
    """With its run's config.toml the model is compared before anything is built; a checkpoint moved out of its run
    is compared by its weights' shapes, said as another model, not as a corrupt file to restore."""
    a, _ = two_runs
    step2 = a / "checkpoints" / "step_000002"
    refused_leaving(
        tmp_path, _argv(text_corpus, tmp_path / "c", "--resume", str(step2), "--model.d_model", "96"), capsys,
        "d_model 64 -> 96", f"{a}/config.toml",
    )  # fmt: skip
    moved = tmp_path / "moved" / "step_000002"
    shutil.copytree(step2, moved)
    line = refused_leaving(
        tmp_path, _argv(text_corpus, tmp_path / "c", "--resume", str(moved), "--model.d_model", "96"), capsys,
        "does not match the model",
    )  # fmt: skip
    assert "restore" not in line, line


def test_a_checkpoint_resumed_with_no_flags_starts_from_its_runs_config(two_runs, tmp_path, capsys):
    # `--resume PATH` started from the quickstart preset: a debug run's checkpoint planned the quickstart's model
    # and failed as it loaded ("cannot be read ... restore the checkpoint")
    _, b = two_runs
    out = tmp_path / "branch"
    text = ok(
        ["train", "--resume", str(b / "checkpoints" / "step_000002"), "--out", str(out), *FASTRUN], capsys
    )
    assert "resumed from" in text and ckpt.list_steps(out / "checkpoints") == [4]
    saved = (out / "config.toml").read_text()
    assert 'size = "debug"' in saved and "learning_rate = 0.001" in saved, saved


def test_a_branch_tokenizes_as_the_run_it_comes_from(tmp_path, text_corpus, cache_dir, capsys):
    # a branch into a new folder was never compared with its run's tokenizer: a BPE of the same size trained on
    # another corpus resumed the weights silently, every token id meaning something else
    a, branch = tmp_path / "a", tmp_path / "branch"
    flags = ["--size", "debug", "--tokenizer", "bpe:300", *FASTRUN, "--save_interval", "2"]
    ok(["train", "--data", str(text_corpus), *flags, "--max_steps", "2", "--out", str(a)], capsys)
    other = tmp_path / "other"
    other.mkdir()
    for f in sorted(text_corpus.iterdir())[:2]:
        shutil.copy(f, other / f.name)
    argv = ["train", "--data", str(other), *flags, "--max_steps", "4", "--out", str(branch),
            "--resume", str(a / "checkpoints" / "step_000002")]  # fmt: skip
    refused_leaving(
        a, argv, capsys, "corpus differs"
    )  # (the other corpus's shards are cached: not the run's)
    assert not branch.exists()


def test_a_lora_checkpoint_is_not_resumed_as_another_kind_of_run(tmp_path, text_corpus, cache_dir, capsys):
    # --resume PATH had no base-model check: only --resume auto refused a LoRA run resumed without LoRA
    base, ft = tmp_path / "base", tmp_path / "ft"
    ok(_argv(text_corpus, base, "--max_steps", "1"), capsys)
    ok(["export", str(base), "--format", "hf", str(tmp_path / "exp")], capsys)
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(f'{{"prompt": "q{i}?", "response": "a{i}"}}\n' for i in range(40)))
    tune = [
        "finetune",
        "--model",
        str(tmp_path / "exp"),
        "--data",
        str(chat),
        *FASTRUN,
        "--save_interval",
        "1",
    ]
    ok([*tune, "--lora", "--max_steps", "2", "--out", str(ft)], capsys)
    off = [*tune, "--max_steps", "3", "--lora.enabled", "false"]
    refused_leaving(ft, [*off, "--resume", "auto", "--out", str(ft)], capsys, "a fine-tune of", "LoRA on")
    step1 = ft / "checkpoints" / "step_000001"
    refused_leaving(tmp_path, [*off, "--resume", str(step1), "--out", str(tmp_path / "b")], capsys, "LoRA on")
