"""The seams of run folders (issue 29): resume with nothing to resume, --overwrite and symlinks, a full disk, the
messages of a bad resume or a bad sampling option, and the end summary and TensorBoard of a resumed run."""

from __future__ import annotations

import errno
import json
import statistics
from pathlib import Path

import pytest
import tokenizers
import torch
from cli_helpers import FASTRUN as CPU_FASTRUN
from cli_helpers import disk_full_at_state_file, refused, refused_leaving, run_cli, snapshot

from gptoughts.training.checkpoint import savers
from gptoughts.training.checkpoint import store as ckpt

FASTRUN = [*CPU_FASTRUN, "--tokenizer", "bytes"]


def _train(out: Path, corpus: Path, capsys, *flags: str) -> str:
    fast = (
        FASTRUN
        if "--run.tensorboard" not in flags
        else [a for a in FASTRUN if a not in ("--run.tensorboard", "false")]
    )
    code, text = run_cli(["train", "--data", str(corpus), "--out", str(out), *flags, *fast], capsys)
    assert code == 0 and "Traceback" not in text, text[-2000:]
    return text


@pytest.fixture
def run(tmp_path, text_corpus, cache_dir, capsys) -> Path:
    """A finished run with checkpoints at steps 2 and 4."""
    out = tmp_path / "run"
    _train(out, text_corpus, capsys, "--max_steps", "4", "--save_interval", "2", "--eval_interval", "2")
    assert ckpt.list_steps(out / "checkpoints") == [2, 4]
    return out


# ---------------------------------------------------------------------------- 1. resume with nothing to resume


@pytest.mark.parametrize("state", ["missing", "empty", "killed while preparing its data"])
def test_resume_auto_where_no_run_is_refuses_and_writes_nothing(
    state, tmp_path, text_corpus, cache_dir, capsys
):
    out = tmp_path / "runs" / "llama-125m"
    if state != "missing":
        out.mkdir(parents=True)
    if state == "killed while preparing its data":  # the lock file is all such a run leaves
        (out / ".lock").write_text('{"pid": 1}')
    refused_leaving(
        tmp_path,
        [
            "train",
            "--resume",
            "auto",
            "--out",
            str(out),
            "--data",
            str(text_corpus),
            "--max_steps",
            "1",
            *FASTRUN,
        ],
        capsys,
        str(out),
        "nothing to resume",
    )
    assert out.exists() == (state != "missing") and (tmp_path / "runs").exists() == (state != "missing")
    assert not cache_dir.exists()  # refused before the corpus was read


def test_a_run_without_checkpoints_says_so_before_and_after(tmp_path, text_corpus, cache_dir, capsys):
    """--train.checkpoints false: the plan said "checkpoint at the end" and the summary pointed at a checkpoints
    folder and at sample/export/resume commands, none of which a run without a checkpoint can serve."""
    out = tmp_path / "run"
    text = _train(out, text_corpus, capsys, "--max_steps", "2", "--train.checkpoints", "false")
    assert not (out / "checkpoints").exists()
    steps = next(ln for ln in text.splitlines() if ln.startswith("  steps:"))
    assert "checkpoint at the end" not in steps and "no checkpoints (checkpoint.checkpoints false)" in steps
    after = [ln for ln in text.splitlines() if ln.startswith(("  run:", "  next:"))]
    assert len(after) == 2 and "checkpoints: none" in after[0] and str(out / "checkpoints") not in after[0]
    assert "--resume" not in after[1] and "sample" not in after[1] and f"gptoughts plot {out}" in after[1]
    run = json.loads((out / "run.json").read_text())  # one process: one data-parallel rank, said once
    assert run["dp_size"] == run["plan"]["batch"]["dp_size"] == 1


def test_resume_auto_of_a_run_that_ended_without_checkpoints_is_refused(
    tmp_path, text_corpus, cache_dir, capsys
):
    """A finished run trained with checkpoints off has nothing to resume: restarting it from step 0 replaced its
    metrics and summary, with a message saying it had stopped before its first save."""
    out = tmp_path / "run"
    _train(out, text_corpus, capsys, "--max_steps", "2", "--train.checkpoints", "false")
    refused_leaving(
        out,
        ["train", "--resume", "auto", "--out", str(out), "--max_steps", "4"],
        capsys,
        "ended without writing a checkpoint (checkpoint.checkpoints false)",
        "--overwrite",
    )


@pytest.mark.slow
def test_resume_auto_of_a_run_without_checkpoint_starts_its_own_config_from_step_0(
    tmp_path, text_corpus, cache_dir, capsys
):
    out = tmp_path / "run"
    _train(out, text_corpus, capsys, "--max_steps", "2", "--lr", "0.0007", "--train.checkpoints", "false")
    assert not ckpt.list_steps(out / "checkpoints")
    (out / "summary.json").unlink()  # as a run killed before its first save leaves it: no summary
    code, text = run_cli(
        ["train", "--resume", "auto", "--out", str(out), "--train.checkpoints", "true"], capsys
    )
    assert code == 0, text[-2000:]
    notes = [ln for ln in text.splitlines() if "no checkpoint" in ln]
    assert len(notes) == 1 and "step 0" in notes[0] and str(out) in notes[0], text[-2000:]
    assert "peak lr 7.0e-04" in text  # the run's own config, not the quickstart's
    assert ckpt.list_steps(out / "checkpoints") == [2]


def test_resume_auto_of_a_run_whose_config_toml_is_missing_is_refused(run, capsys):
    (run / "config.toml").unlink()
    refused_leaving(run, ["train", "--resume", "auto", "--out", str(run)], capsys, "config.toml", "missing")


def test_resume_auto_of_a_run_whose_run_json_is_corrupt_names_it(run, capsys):
    (run / "run.json").write_text('{"family": "llama", "ar')
    refused_leaving(
        run, ["train", "--resume", "auto", "--out", str(run)], capsys, str(run / "run.json"), "corrupt"
    )


def test_the_python_api_refuses_a_non_positive_max_new_tokens(run):
    from gptoughts import api
    from gptoughts.errors import UserError

    with pytest.raises(UserError, match="max_new_tokens"):
        api.generate_text(api.load(run, device="cpu"), "def ", max_new_tokens=-5)


# ---------------------------------------------------------------------------- 2. overwrite and symlinks


def test_overwrite_refuses_a_folder_with_run_like_files_that_gptoughts_did_not_make(
    tmp_path, text_corpus, cache_dir, capsys
):
    foreign = tmp_path / "project"
    (foreign / "tokenizer").mkdir(parents=True)
    (foreign / "config.toml").write_text("[server]\nport = 8080\n")
    (foreign / "tokenizer" / "vocab.txt").write_text("hello\nworld\n")
    argv = ["train", "--data", str(text_corpus), "--out", str(foreign), "--overwrite", *FASTRUN]
    refused_leaving(foreign, argv, capsys, "not a gptoughts run")
    (foreign / "run.json").write_text(json.dumps({"name": "someone else's run.json"}))
    refused_leaving(foreign, argv, capsys, "not a gptoughts run")


@pytest.mark.slow
def test_overwrite_never_follows_a_symlink_out_of_the_run(run, tmp_path, text_corpus, capsys):
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "ckpts" / "step_000007").mkdir(parents=True)
    (elsewhere / "ckpts" / "step_000007" / "precious.bin").write_bytes(b"not the run's")
    (elsewhere / "ckpts" / "best.json").write_text('{"step": 7}')
    (elsewhere / "vocab").mkdir()
    (elsewhere / "vocab" / "vocab.txt").write_text("hello\n")
    before = snapshot(elsewhere)
    for name, target in (("checkpoints", "ckpts"), ("tokenizer", "vocab")):
        ckpt.shutil.rmtree(run / name)
        (run / name).symlink_to(elsewhere / target, target_is_directory=True)
    _train(run, text_corpus, capsys, "--overwrite", "--max_steps", "1")
    assert snapshot(elsewhere) == before
    assert not (run / "checkpoints").is_symlink() and ckpt.list_steps(run / "checkpoints") == [1]
    assert not (run / "tokenizer").is_symlink() and (run / "tokenizer" / "tokenizer.json").is_file()


# ---------------------------------------------------------------------------- 3. disk full


class _FullDisk:
    """A file that takes ``room`` bytes and then fails as a full disk does (what torch's writer meets)."""

    def __init__(self, f, room: int):
        self.f, self.room = f, room

    def write(self, data) -> int:
        n = memoryview(data).nbytes
        if n > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= n
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)


@pytest.mark.slow
def test_disk_full_while_torch_writes_a_checkpoint_is_one_line_naming_the_last_good_one(
    run, capsys, monkeypatch
):
    real = torch.save

    def save_on_a_full_disk(obj, f, *args, **kwargs):
        if isinstance(f, (str, Path)):
            with open(f, "wb") as fh:
                return real(obj, _FullDisk(fh, 1000), *args, **kwargs)
        return real(obj, _FullDisk(f, 1000), *args, **kwargs)

    monkeypatch.setattr(torch, "save", save_on_a_full_disk)
    line = refused_leaving(
        run / "checkpoints",
        ["train", "--resume", "auto", "--out", str(run), "--max_steps", "6", "--save_interval", "1"],
        capsys,
        "disk full",
        str(ckpt.step_dir(run / "checkpoints", 4)),
    )
    assert "--resume auto" in line
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]


@pytest.mark.slow
def test_disk_full_in_a_background_checkpoint_write_is_one_line(run, capsys, monkeypatch):
    """The thread's write fails, then the synchronous retry too (the disk is still full): one line."""
    monkeypatch.setattr(savers.FileSaver, "_worth_it", lambda self, weights, state: True)
    disk_full_at_state_file(monkeypatch)
    refused(
        ["train", "--resume", "auto", "--out", str(run), "--max_steps", "6", "--save_interval", "3"],
        capsys,
        "disk full",
        str(ckpt.step_dir(run / "checkpoints", 4)),
    )
    assert ckpt.list_steps(run / "checkpoints") == [2, 4]


def test_a_background_write_that_found_the_disk_full_reports_it_as_disk_full(tmp_path, monkeypatch):
    saver = savers.FileSaver(tmp_path / "checkpoints")
    monkeypatch.setattr(savers.FileSaver, "_worth_it", lambda self, weights, state: True)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", "state.pt")

    monkeypatch.setattr(ckpt, "save", full)
    saver.save(1, {"w": torch.ones(3)}, {"trainer": {"step": 1}})
    with pytest.raises(OSError) as e:
        saver.wait()
    assert e.value.errno == errno.ENOSPC


def test_disk_full_while_saving_the_tokenizer_on_resume_is_one_line(run, capsys, cache_dir, monkeypatch):
    ckpt.shutil.rmtree(
        cache_dir
    )  # the resume prepares the corpus again, and saves its tokenizer in the cache

    def save(self, path, pretty=True):  # what the tokenizers library raises: a bare Exception
        raise Exception("No space left on device (os error 28)")

    monkeypatch.setattr(tokenizers.Tokenizer, "save", save)
    refused_leaving(
        run,
        ["train", "--resume", "auto", "--out", str(run), "--max_steps", "6"],
        capsys,
        "disk full",
        str(ckpt.step_dir(run / "checkpoints", 4)),
    )


# ---------------------------------------------------------------------------- 6. messages


def test_an_empty_config_toml_on_resume_names_the_file(run, capsys):
    (run / "config.toml").write_text("")
    line = refused_leaving(
        run, ["train", "--resume", "auto", "--out", str(run)], capsys, str(run / "config.toml"), "empty"
    )
    assert "no training data" not in line


@pytest.mark.slow
def test_a_resume_with_changed_architecture_names_each_field_old_and_new(run, capsys):
    line = refused_leaving(
        run,
        ["train", "--resume", "auto", "--out", str(run), "--model.n_layers", "3", "--model.d_model", "96"],
        capsys,
        "n_layers 2 -> 3",
        "d_model 64 -> 96",
    )
    assert "ffn_dim" not in line
    refused_leaving(
        run, ["train", "--resume", "auto", "--out", str(run), "--size", "125m"], capsys, "size debug -> 125m"
    )
    # the architecture it already has is no change: it resumes
    code, text = run_cli(
        ["train", "--resume", "auto", "--out", str(run), "--model.n_layers", "2", "--max_steps", "5"], capsys
    )
    assert code == 0 and "resumed from" in text, text[-2000:]


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["sample", "RUN", "--max_new_tokens", "-5"], "--max_new_tokens"),
        (["sample", "RUN", "--max_new_tokens", "0"], "--max_new_tokens"),
        (["sample", "RUN", "--temperature", "-1"], "--temperature"),
        (["sample", "RUN", "--top_p", "0"], "--top_p"),
        (["sample", "RUN", "--top_p", "1.5"], "--top_p"),
        (["sample", "RUN", "--top_k", "-3"], "--top_k"),
        (["export", "RUN", "OUT", "--max_shard_size", "0"], "--max_shard_size"),
        (["export", "RUN", "OUT", "--max_shard_size=-5GB"], "--max_shard_size"),
    ],
)
def test_bad_numbers_of_sample_and_export_are_refused_in_one_line(
    argv, needle, tmp_path, capsys, monkeypatch
):
    import gptoughts.api as api

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before its options were checked")

    monkeypatch.setattr(api, "load", no_load)
    out = tmp_path / "out"
    argv = [str(tmp_path) if a == "RUN" else str(out) if a == "OUT" else a for a in argv]
    refused(argv, capsys, needle)
    assert not out.exists()


# ---------------------------------------------------------------------------- 16. a resumed run's summary


def _event_steps(run: Path, tag: str) -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    return [e.step for e in acc.Scalars(tag)]


@pytest.mark.slow
def test_a_resumed_runs_summary_labels_run_and_session_and_tensorboard_keeps_every_step(
    tmp_path, text_corpus, cache_dir, capsys
):
    out = tmp_path / "run"
    tb = ["--run.tensorboard", "true", "--log_interval", "1", "--save_interval", "4", "--eval_interval", "4"]
    _train(out, text_corpus, capsys, "--max_steps", "4", *tb)
    assert _event_steps(out, "train/loss") == [1, 2, 3, 4]
    code, text = run_cli(
        ["train", "--resume", "auto", "--out", str(out), "--max_steps", "7", *tb[:2]], capsys
    )
    assert code == 0, text[-2000:]
    assert _event_steps(out, "train/loss") == [1, 2, 3, 4, 5, 6, 7]
    assert _event_steps(out, "train/val_loss") == [4, 7]
    summary = json.loads((out / "summary.json").read_text())
    per_step = summary["tokens"] // 7
    assert (summary["steps"], summary["session_steps"]) == (7, 3)
    assert summary["session_tokens"] == 3 * per_step
    done = next(ln for ln in text.splitlines() if ln.startswith("done"))
    assert f"run: 7 steps, {7 * per_step:,} tokens" in done, done
    assert f"this session: 3 steps, {3 * per_step:,} tokens in" in done, done


def test_the_summary_names_the_stopping_rule_the_run_had(tmp_path, text_corpus, cache_dir, capsys):
    """--epochs 2 and a run without a rule (one epoch) ended "done (max steps)", in the summary and summary.json."""
    out = tmp_path / "run"
    text = _train(out, text_corpus, capsys, "--epochs", "2", "--data.max_bytes", "3000")
    assert "done (--epochs 2)" in text, text[-800:]
    assert json.loads((out / "summary.json").read_text())["stop_reason"] == "--epochs 2"
    text = _train(tmp_path / "bare", text_corpus, capsys, "--data.max_bytes", "3000")  # no rule: one epoch
    assert "done (one epoch)" in text, text[-800:]


def test_overwrite_says_it_replaces_a_run_and_a_plot_of_runs_says_where_it_went(
    tmp_path, text_corpus, cache_dir, capsys, monkeypatch
):
    """--overwrite deleted a run with nothing said; `gptoughts plot A B` printed a bare 'compare.png'."""
    out = tmp_path / "run"
    first = _train(out, text_corpus, capsys, "--max_steps", "2")
    assert "replacing" not in first
    second = _train(out, text_corpus, capsys, "--max_steps", "2", "--overwrite")
    outs = [ln for ln in second.splitlines() if ln.startswith("  out:")]
    assert outs == [f"  out: {out} (replacing the run there: --overwrite)"], outs
    monkeypatch.chdir(tmp_path)
    code, text = run_cli(["plot", str(out), str(out)], capsys)
    assert code == 0 and f"wrote {tmp_path / 'compare.png'}" in text and (tmp_path / "compare.png").is_file()


def test_a_resume_is_timed_at_the_runs_own_speed(tmp_path, text_corpus, cache_dir, capsys):
    """A resumed run's plan timed the steps left from the matmul estimate (a quarter of the CPU's matmul speed), not
    from the speed the run had measured: 1,278 tokens/s planned where it had trained at ~2,000. Where the resume
    runs otherwise (another micro-batch here), the run's speed says nothing of it, and the estimate stays."""
    out = tmp_path / "run"
    _train(out, text_corpus, capsys, "--max_steps", "8", "--log_interval", "1")
    logged = [r["tokens_per_s"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
              if "tokens_per_s" in r]  # fmt: skip
    code, text = run_cli(["train", "--resume", "auto", "--out", str(out), "--max_steps", "10"], capsys)
    assert code == 0, text[-2000:]
    line = next(ln for ln in text.splitlines() if "time: ~" in ln)
    assert "(this run's own speed before the resume)" in line, line
    planned = float(line.split(" at ~")[1].split(" tokens/s")[0].replace(",", ""))
    assert planned == pytest.approx(statistics.median(logged[-10:]), abs=0.51)  # (printed to the token)
    code, text = run_cli(
        ["train", "--resume", "auto", "--out", str(out), "--max_steps", "12", "--batch_size", "1"], capsys
    )
    assert code == 0, text[-2000:]
    line = next(ln for ln in text.splitlines() if "time: ~" in ln)
    assert "own speed" not in line, line
