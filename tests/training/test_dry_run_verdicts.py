"""A dry run gives the real run's verdict: a resume at another block size or seed than its checkpoint's batches, and
--fp8 on a machine without fp8 are refused by `--dry_run` as by the run itself (one line, exit 2, nothing written),
before the plan. A resume on another corpus, whose BPE only training it can compare, is told by the dry run and
decided by the run."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from cli_helpers import FASTRUN, ok, refused_leaving, run_cli

from gptoughts.training.checkpoint import store as ckpt

BPE = ["--size", "debug", "--tokenizer", "bpe:300", *FASTRUN, "--save_interval", "2"]


@pytest.fixture
def bpe_run(tmp_path, text_corpus, cache_dir, capsys) -> Path:
    """A debug run with a BPE of 300 trained on ``text_corpus``, checkpointed at step 2 (block 32)."""
    run = tmp_path / "a"
    ok(["train", "--data", str(text_corpus), *BPE, "--max_steps", "2", "--out", str(run)], capsys)
    assert ckpt.list_steps(run / "checkpoints") == [2]
    return run


def test_a_resume_on_another_corpus_is_told_by_its_dry_run_and_refused_by_the_run(bpe_run, tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("Meeting notes.\nThe quarterly numbers went up; the plan stays.\n" * 300)
    resume = ["train", "--resume", "auto", "--out", str(bpe_run), "--max_steps", "4", "--data", str(notes)]
    # the dry run cannot train the BPE: it says the corpus is another and that the run compares its BPE first
    text = ok([*resume, "--dry_run"], capsys)
    assert "corpus is not at the run's path" in text and str(notes) in text, text[-1500:]
    line = refused_leaving(bpe_run, resume, capsys, "tokenizer", f"{bpe_run}/tokenizer")
    assert "--tokenizer" in line, line
    # the fix it names works: the run's own vocabulary on the new corpus
    ok([*resume, "--tokenizer", str(bpe_run / "tokenizer"), *FASTRUN], capsys)
    assert ckpt.list_steps(bpe_run / "checkpoints")[-1] == 4


def test_a_resume_on_a_copy_of_its_corpus_elsewhere_resumes(bpe_run, text_corpus, tmp_path, capsys):
    # The review's regression: a corpus copied or moved to another path was refused from its path alone, though
    # the BPE trained on the same text is the run's.
    copy = tmp_path / "moved" / text_corpus.name
    shutil.copytree(text_corpus, copy)
    resume = ["train", "--resume", "auto", "--out", str(bpe_run), "--max_steps", "4", "--data", str(copy)]
    assert "corpus is not at the run's path" in ok([*resume, "--dry_run"], capsys)
    ok([*resume, *FASTRUN], capsys)
    assert ckpt.list_steps(bpe_run / "checkpoints")[-1] == 4


def test_a_resume_on_the_same_uncached_corpus_says_what_the_run_will_compare(
    bpe_run, text_corpus, cache_dir, capsys
):
    shutil.rmtree(
        cache_dir
    )  # the run's shards gone (another machine, a cleaned cache): the BPE is trained again
    text = ok(["train", "--resume", "auto", "--out", str(bpe_run), "--max_steps", "4", "--dry_run"], capsys)
    assert f"compares it with {bpe_run}/tokenizer" in text
    ok(["train", "--resume", "auto", "--out", str(bpe_run), "--max_steps", "4", *FASTRUN], capsys)  # same BPE
    assert ckpt.list_steps(bpe_run / "checkpoints")[-1] == 4


@pytest.mark.parametrize(("flag", "value"), [("block_size", "16"), ("seed", "7")])
def test_a_resume_at_another_block_or_seed_is_refused_by_its_dry_run(bpe_run, flag, value, capsys):
    from gptoughts.training.rundir import _old_config

    was = str(getattr(_old_config(bpe_run).train, flag))
    resume = ["train", "--resume", "auto", "--out", str(bpe_run), "--max_steps", "4", f"--{flag}", value]
    for argv in ([*resume, "--dry_run"], resume):
        code, text = _run(argv, capsys)
        assert code == 2 and "plan:" not in text, text[-1500:]
        line = [ln for ln in text.splitlines() if ln.startswith("error:")]
        assert len(line) == 1 and f"{flag}={was}" in line[0] and f"--{flag} {was}" in line[0], text[-1500:]
    branch = ["train", "--resume", str(bpe_run / "checkpoints" / "step_000002"), "--out", str(bpe_run.parent / "b"),
              "--max_steps", "4", f"--{flag}", value, "--dry_run"]  # fmt: skip
    refused_leaving(bpe_run.parent, branch, capsys, f"{flag}={was}")


def test_fp8_on_a_cpu_is_refused_by_the_dry_run_naming_the_recommended_precision(
    tmp_path, text_corpus, cache_dir, capsys
):
    from gptoughts.perf import hardware

    recommended = hardware.detect(hardware.resolve_device("cpu")).recommended["precision"]
    argv = ["train", "--data", str(text_corpus), "--size", "debug", "--use_fp8", "--device", "cpu",
            "--out", str(tmp_path / "r")]  # fmt: skip
    for flags in (["--dry_run"], []):
        code, text = _run([*argv, *flags], capsys)
        assert code == 2 and "plan:" not in text and "Traceback" not in text, text[-1500:]
        assert "--fp8 needs an NVIDIA GPU" in text and f"{recommended} is the recommended precision" in text
        assert "bf16 is the fastest" not in text
    assert not (tmp_path / "r").exists()


def _run(argv: list[str], capsys) -> tuple[int, str]:
    return run_cli(argv, capsys)
