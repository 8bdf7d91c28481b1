"""Never lose a run (issue 11): refusals instead of silent restarts, one process per run directory, every failure
one line with a non-zero exit, and nothing that was saved is damaged. Through the CLI as a user types it.
(Non-finite and spike recovery: tests/training/test_recovery.py.)"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cli_helpers import FASTRUN as CPU_FASTRUN
from cli_helpers import disk_full_at_state_file, ok, refused, refused_leaving, run_cli

from gptoughts.training.checkpoint import store as ckpt
from gptoughts.training.rundir import RunLock

FASTRUN = [*CPU_FASTRUN, "--tokenizer", "bytes"]


_run = run_cli


@pytest.fixture
def run(tmp_path, text_corpus, cache_dir, capsys) -> Path:
    """A finished run with checkpoints at steps 2 and 4."""
    out = tmp_path / "run"
    code, text = _run(
        [
            "train",
            "--data",
            str(text_corpus),
            "--out",
            str(out),
            "--max_steps",
            "4",
            "--save_interval",
            "2",
            "--eval_interval",
            "2",
            *FASTRUN,
        ],
        capsys,
    )
    assert code == 0, text[-2000:]
    assert ckpt.list_steps(out / "checkpoints") == [2, 4]
    return out


# ------------------------------------------------------------------------------------ never destroy


def test_resume_with_every_checkpoint_corrupt_refuses_and_changes_nothing(run, capsys):
    for step in (2, 4):
        f = ckpt.step_dir(run / "checkpoints", step) / ckpt.MODEL_FILE
        f.write_bytes(f.read_bytes()[:-10] + b"0123456789")
    refused_leaving(
        run,
        ["train", "--resume", "auto", "--out", str(run), "--max_steps", "6"],
        capsys,
        "every checkpoint",
        "nothing was changed",
    )


def test_a_rejected_resume_leaves_config_and_run_json_as_they_were(run, capsys, text_corpus):
    refused_leaving(
        run, ["train", "--resume", "auto", "--out", str(run), "--size", "125m"], capsys, "size debug -> 125m"
    )
    refused_leaving(
        run,
        ["train", "--resume", "auto", "--out", str(run), "--seed", "7", "--max_steps", "6"],
        capsys,
        "seed",
    )


def test_forged_state_falls_back_to_the_previous_checkpoint(run, capsys):
    """A state.pt that holds code, with meta.json rewritten to match it: weights_only refuses it, the resume
    falls back to step 2 like for any corruption (and the code never runs)."""

    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(run / "PWNED"),))

    newest = ckpt.step_dir(run / "checkpoints", 4)
    torch.save({"trainer": {"step": 4}, "x": Evil()}, newest / ckpt.STATE_FILE)
    meta = json.loads((newest / ckpt.META_FILE).read_text())
    meta["files"][ckpt.STATE_FILE] = {
        "sha256": ckpt._sha256(newest / ckpt.STATE_FILE),
        "bytes": (newest / ckpt.STATE_FILE).stat().st_size,
    }
    (newest / ckpt.META_FILE).write_text(json.dumps(meta))
    code, text = _run(
        ["train", "--resume", "auto", "--out", str(run), "--max_steps", "5", "--no_progress"], capsys
    )
    assert code == 0 and "falling back to step_000002" in text and "resumed from" in text, text[-2000:]
    assert not (run / "PWNED").exists()


def test_meta_json_listing_no_files_does_not_verify(run):
    path = ckpt.step_dir(run / "checkpoints", 4)
    (path / ckpt.META_FILE).write_text(json.dumps({"step": 4, "files": {}}))
    assert ckpt.verify(path) is not None
    assert ckpt.latest_valid(run / "checkpoints") == ckpt.step_dir(run / "checkpoints", 2)


def test_overwrite_removes_only_a_runs_files_and_refuses_other_folders(run, tmp_path, capsys, text_corpus):
    (run / "my_notes.txt").write_text("keep me")
    code, text = _run(
        ["train", "--data", str(text_corpus), "--out", str(run), "--overwrite", "--max_steps", "1", *FASTRUN],
        capsys,
    )
    assert code == 0, text[-1500:]
    assert (run / "my_notes.txt").read_text() == "keep me" and ckpt.list_steps(run / "checkpoints") == [1]
    foreign = tmp_path / "photos"
    (foreign / "checkpoints").mkdir(parents=True)  # a checkpoints/ folder alone does not make a run
    (foreign / "cat.jpg").write_bytes(b"\xff\xd8 not a run")
    refused_leaving(
        foreign,
        ["train", "--data", str(text_corpus), "--out", str(foreign), "--overwrite", *FASTRUN],
        capsys,
        "not a gptoughts run",
    )


@pytest.mark.slow
def test_a_run_killed_before_its_first_checkpoint_restarts_without_duplicate_rows(
    tmp_path, text_corpus, cache_dir, capsys
):
    out = tmp_path / "run"
    code, _ = _run(
        [
            "train",
            "--data",
            str(text_corpus),
            "--out",
            str(out),
            "--max_steps",
            "3",
            "--log_interval",
            "1",
            "--train.checkpoints",
            "false",
            *FASTRUN,
        ],
        capsys,
    )  # a run that never checkpointed
    assert code == 0 and not ckpt.list_steps(out / "checkpoints")
    # killed, it would not have written its summary (a run that ended without checkpoints is refused)
    (out / "summary.json").unlink()
    code, text = _run(["train", "--resume", "auto", "--out", str(out), "--train.checkpoints", "true"], capsys)
    assert code == 0, text[-1500:]
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert steps == [1, 2, 3]


# ------------------------------------------------------------------------------------ one process per run


@pytest.mark.slow
def test_a_second_train_on_the_same_out_is_refused_while_the_first_holds_it(run, capsys):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys, time; from pathlib import Path; from gptoughts.training.rundir import RunLock; "
                f"held = RunLock.acquire(Path({str(run)!r})); print('locked', flush=True); time.sleep(60)"
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        # .lock included: the refused process only reads the holder's line in it
        refused_leaving(
            run,
            ["train", "--resume", "auto", "--out", str(run), "--max_steps", "6"],
            capsys,
            f"process {holder.pid}",
            "in use",
        )
    finally:
        holder.kill()
        holder.wait()
    # the kernel released the dead holder's lock: the run continues
    code, text = _run(
        ["train", "--resume", "auto", "--out", str(run), "--max_steps", "5", "--no_progress"], capsys
    )
    assert code == 0, text[-1500:]
    lock = RunLock.acquire(run)  # released after the run
    lock.release()


# ------------------------------------------------------------------------------------ one line, non-zero


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--block_size", "1000000000"], "block_size"),
        (["--learning_rate", "nan"], "learning_rate"),
        (["--learning_rate", "inf"], "learning_rate"),
        (["--log_interval", "0"], "log_interval"),
        (["--max_steps", "0"], "max_steps"),
        (["--max_steps", "-5"], "max_steps"),
        (["--epochs", "0"], "epochs"),
        (["--eval_interval", "-1"], "eval_interval"),
        (["--save_interval", "-3"], "save_interval"),
        (["--max_bad_steps", "0"], "max_bad_steps"),
    ],
)
def test_bad_numbers_are_refused_before_anything_is_built(
    flags, needle, tmp_path, text_corpus, capsys, cache_dir
):
    out = tmp_path / "r"
    refused(["train", "--data", str(text_corpus), "--out", str(out), *flags], capsys, needle)
    assert not out.exists() and not cache_dir.exists()


def test_toml_base_loops_and_relative_bases(tmp_path, capsys):
    a, b = tmp_path / "a.toml", tmp_path / "sub" / "b.toml"
    b.parent.mkdir()
    a.write_text('base = "sub/b.toml"\n[train]\nmax_steps = 3\n')
    b.write_text('base = "../a.toml"\n')
    refused(["train", str(a), "--dry_run"], capsys, "loops back")
    b.write_text('base = "default"\n[train]\nlearning_rate = 0.005\n')  # relative to a.toml's folder
    code, text = _run(["config", str(a)], capsys)
    assert code == 0 and "learning_rate = 0.005" in text and "max_steps = 3" in text
    (tmp_path / "self.toml").write_text('base = "self.toml"\n')
    refused(["train", str(tmp_path / "self.toml")], capsys, "loops back")


def test_corrupt_run_files_are_one_line(run, capsys, text_corpus):
    (run / "config.toml").write_text("[train\nmax_steps = ")
    refused(["train", "--resume", "auto", "--out", str(run)], capsys, "config.toml", "corrupt")
    refused(["sample", str(run), "--prompt", "x"], capsys, "config.toml", "corrupt")
    (run / "config.toml").unlink()
    (run / "run.json").write_text('{"args": 3}')
    refused(["sample", str(run), "--prompt", "x"], capsys, "run.json", "corrupt")


def test_corrupt_run_tokenizer_on_resume_is_one_line(run, capsys):
    (run / "tokenizer" / "tokenizer.json").write_text('{"model": ')
    refused_leaving(
        run, ["train", "--resume", "auto", "--out", str(run), "--max_steps", "6"], capsys, "tokenizer"
    )


def test_corrupt_cache_manifest_is_rebuilt(run, capsys, cache_dir, text_corpus, tmp_path):
    manifests = list(cache_dir.rglob("manifest.json"))
    assert manifests
    for m in manifests:
        m.write_text(json.dumps({"format_version": 2, "sources": []}))
    code, text = _run(
        ["train", "--data", str(text_corpus), "--out", str(tmp_path / "again"), "--max_steps", "1", *FASTRUN],
        capsys,
    )
    assert code == 0, text[-1500:]


def test_hf_weight_index_pointing_outside_its_folder_is_refused(tmp_path, capsys, text_corpus):
    sys.path.insert(0, str(Path(__file__).parent / "finetune"))
    from hf_helpers import save_hf_model

    folder = save_hf_model(tmp_path / "m", "llama")
    (folder / "model.safetensors").rename(tmp_path / "elsewhere.safetensors")
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.embed_tokens.weight": "../elsewhere.safetensors"}})
    )
    refused(["sample", str(folder), "--prompt", "x"], capsys, "outside the model folder")


def test_disk_full_during_a_checkpoint_is_one_line_and_earlier_checkpoints_are_intact(
    run, capsys, monkeypatch
):
    disk_full_at_state_file(monkeypatch)
    # the whole folder, not only steps 2 and 4: the failed save of step 5 leaves no file behind either
    refused_leaving(
        run / "checkpoints",
        ["train", "--resume", "auto", "--out", str(run), "--max_steps", "6", "--save_interval", "1"],
        capsys,
        "disk full",
    )
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".tmp")]


def test_ctrl_c_before_training_is_quiet(monkeypatch, capsys):
    import gptoughts.config as config

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(config, "load_config", interrupted)
    code, text = _run(["train", "--dry_run"], capsys)
    assert code == 130 and text.strip() == "interrupted"


@pytest.mark.slow
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_an_interrupted_run_saves_and_exits_with_128_plus_the_signal(
    sig, code, tmp_path, text_corpus, cache_dir
):
    out = tmp_path / "run"
    env = {**os.environ, "GPTOUGHTS_CACHE": str(cache_dir), "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gptoughts",
            "train",
            "--data",
            str(text_corpus),
            "--out",
            str(out),
            "--max_steps",
            "100000",
            "--log_interval",
            "1",
            *[a for a in FASTRUN if a != "--no_progress"],
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    lines = []
    for line in p.stdout:  # wait until training runs
        lines.append(line)
        if line.startswith("step 2/"):
            break
    time.sleep(0.2)
    p.send_signal(sig)
    rest = p.communicate(timeout=120)[0]
    assert p.returncode == code, "".join(lines)[-1000:] + rest[-2000:]
    assert "Traceback" not in rest and ckpt.latest_valid(out / "checkpoints") is not None


def test_a_resumes_plan_times_the_steps_left_not_the_whole_run(run, capsys):
    """Resumed at step 4 of 6, the plan's time is for the 2 steps left (it timed all 6: a newcomer's 20-step resume
    was announced at ~4 min and took 23 s)."""
    from cli_helpers import run_cli

    code, text = run_cli(
        ["train", "--resume", "auto", "--out", str(run), "--max_steps", "6", "--dry_run"], capsys
    )
    assert code == 0, text[-2000:]
    line = next(ln for ln in text.splitlines() if "time: ~" in ln)
    assert "for the 2 steps left" in line, line


# ------------------------------------------------------------------------------- a run used from another folder


def _debug_run(out: Path, corpus: Path, capsys, *flags: str) -> str:
    """A debug model trained on ``corpus`` into ``out`` (bytes tokenizer unless ``flags`` name another)."""
    tok = [] if "--tokenizer" in flags else ["--tokenizer", "bytes"]
    return ok(["train", "--data", str(corpus), "--size", "debug", *tok, *flags, "--out", str(out), *CPU_FASTRUN],
              capsys)  # fmt: skip


def test_a_run_on_a_relative_tokenizer_folder_resumes_from_another_directory(
    tmp_path, text_corpus, capsys, monkeypatch
):
    # config.toml kept `--tokenizer tok` as typed: a resume from elsewhere looked for ./tok and refused
    first, out = tmp_path / "first", tmp_path / "r"
    _debug_run(first, text_corpus, capsys, "--max_steps", "1")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tok").symlink_to(first / "tokenizer")
    _debug_run(out, text_corpus, capsys, "--tokenizer", "tok", "--max_steps", "2", "--save_interval", "1")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    ok(["train", "--resume", "auto", "--out", str(out), "--max_steps", "3", *CPU_FASTRUN], capsys)
    assert json.loads((out / "summary.json").read_text())["steps"] == 3


def test_a_lora_run_on_a_relative_model_folder_samples_from_another_directory(
    tmp_path, text_corpus, capsys, monkeypatch
):
    base = tmp_path / "base"
    _debug_run(base, text_corpus, capsys, "--max_steps", "1")
    monkeypatch.chdir(tmp_path)
    ok(["export", str(base), "--format", "hf", "exported"], capsys)
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"prompt": f"q{i}?", "response": f"a{i}"}) + "\n" for i in range(40)))
    ft = tmp_path / "ft"
    ok(["finetune", "--model", "exported", "--data", str(chat), "--lora", "--max_steps", "1",
        "--out", str(ft), *CPU_FASTRUN], capsys)  # fmt: skip
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    ok(["sample", str(ft), "--prompt", "q1?", "--max_new_tokens", "2"], capsys)


@pytest.mark.slow  # whole runs: seconds on 2 cores
def test_a_token_budget_counts_the_tokens_seen_when_a_resume_changes_the_batch(tmp_path, text_corpus, capsys):
    # 2,048 tokens at 2 rows x 32 = 32 steps; resumed at step 8 with 1 row a step, the steps were counted again
    # from zero at the new batch (64 of them): the run ended at 2,304 tokens, over the budget its summary quoted
    out = tmp_path / "r"
    _debug_run(out, text_corpus, capsys, "--max_tokens", "2048", "--save_interval", "8", "--keep_last", "10")
    for d in (out / "checkpoints").glob("step_*"):
        if int(d.name.split("_")[1]) > 8:
            shutil.rmtree(d)
    resume = ["train", "--resume", "auto", "--out", str(out), *CPU_FASTRUN]
    resume[resume.index("--batch_size") + 1] = "1"
    text = ok(resume, capsys)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tokens"] == 2048 and summary["steps"] == 8 + 48, summary
    assert "1,536 tokens of it left at step 8" in text
    # resumed again at the same new batch (its run.json now says that batch): still the tokens seen that count
    for d in (out / "checkpoints").glob("step_*"):
        if int(d.name.split("_")[1]) > 24:
            shutil.rmtree(d)
    ok(resume, capsys)
    assert json.loads((out / "summary.json").read_text())["tokens"] == 2048


def test_a_resume_below_the_runs_step_is_refused_and_keeps_its_config(tmp_path, text_corpus, capsys):
    # --max_steps 2 on a run at step 4 trained nothing, exited 0, and rewrote config.toml's max_steps to 2
    out = tmp_path / "r"
    _debug_run(out, text_corpus, capsys, "--max_steps", "4", "--save_interval", "2")
    line = refused_leaving(out, ["train", "--resume", "auto", "--out", str(out), "--max_steps", "2", *CPU_FASTRUN],
                           capsys, "at step 4", "--max_steps above 4")  # fmt: skip
    assert "Traceback" not in line


def test_resuming_a_complete_run_is_refused_and_keeps_its_summary(tmp_path, text_corpus, capsys):
    # it trained nothing and rewrote summary.json with the empty session's figures (wall 0 s, 0 tokens/s); a
    # branch of its last checkpoint wrote a folder with no checkpoint
    out = tmp_path / "r"
    _debug_run(out, text_corpus, capsys, "--max_steps", "2", "--save_interval", "2")
    line = refused_leaving(out, ["train", "--resume", "auto", "--out", str(out), *CPU_FASTRUN], capsys,
                           "complete at step 2", "--max_steps above 2")  # fmt: skip
    assert "Traceback" not in line
    branch = ["train", "--resume", str(out / "checkpoints" / "step_000002"), "--out", str(tmp_path / "b"),
              *CPU_FASTRUN]  # fmt: skip
    refused_leaving(tmp_path, branch, capsys, "complete at step 2")


def test_a_resume_on_a_changed_corpus_says_so(tmp_path, text_corpus, capsys):
    # a file appended to: the run re-tokenized and resumed without a word, its held-out set changed
    out = tmp_path / "r"
    _debug_run(out, text_corpus, capsys, "--max_steps", "2", "--save_interval", "1")
    resume = ["train", "--resume", "auto", "--out", str(out), "--max_steps", "3", *CPU_FASTRUN]
    assert "corpus differs" not in ok(resume, capsys)
    with open(sorted(text_corpus.iterdir())[0], "a") as f:
        f.write("\n# one more line\n")
    resume[resume.index("--max_steps") + 1] = "4"
    assert "the corpus differs from the one this run trained on" in ok(resume, capsys)
