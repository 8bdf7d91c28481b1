"""A run still training rotates its checkpoints (``--keep_last 1 --save_interval 1``) while another command reads
it: ``gptoughts sample RUN`` picked the newest checkpoint, the trainer deleted it before it was loaded, and the
command exited 2 (about one call in six; every call on a fast debug run). A checkpoint deleted or half-deleted
under a reader is replaced by the run's newest complete one, a bounded number of times, then refused in one line.
The rotation is simulated where the reader would meet it, so the tests are deterministic."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
import torch
from cli_helpers import FASTRUN, ok, refused
from torch import nn

from gptoughts.errors import UserError
from gptoughts.training.checkpoint import restore
from gptoughts.training.checkpoint import store as ckpt


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))


def _trainer_saves_next(root: Path, *, keep_last: int = 1, half: bool = False) -> Path:
    """What the trainer does between a reader's resolve and its read: saves the next step (the best so far, as
    in a run whose loss still falls) and rotates the older ones away (``half``: the rotation is caught midway,
    the old dir still there without its weights)."""
    newest = ckpt.step_dir(root, ckpt.list_steps(root)[-1])
    nxt = ckpt.step_of(newest) + 1
    tmp = root / f".tmp-step-{nxt}"
    shutil.copytree(newest, tmp)
    tmp.rename(ckpt.step_dir(root, nxt))
    ckpt.mark_best(root, nxt, None)
    if half:
        (newest / ckpt.MODEL_FILE).unlink()
    else:
        ckpt.rotate(root, keep_last, nxt)
    return ckpt.step_dir(root, nxt)


# ---------------------------------------------------------------------------------------------- the store


@pytest.mark.parametrize("half", [False, True])
def test_a_checkpoint_rotated_away_before_its_read_falls_back_to_the_newest(tmp_path, half):
    ckpt.save(tmp_path, 1, _model(0), {"s": 1}, keep_last=1)
    calls: list[Path] = []

    def read(ck: Path) -> None:
        calls.append(ck)
        if len(calls) == 1:
            _trainer_saves_next(tmp_path, half=half)
        restore.load_weights(_model(1), ck)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # rotated away is not corrupt: no "unusable" warning
        got = ckpt.read_newest(tmp_path, read)
    assert calls == [ckpt.step_dir(tmp_path, 1), ckpt.step_dir(tmp_path, 2)] and got == calls[-1]


def test_a_run_that_rotates_under_every_read_is_refused_in_one_line(tmp_path):
    ckpt.save(tmp_path, 1, _model(0), {"s": 1}, keep_last=1)
    calls: list[Path] = []

    def read(ck: Path) -> None:
        calls.append(ck)
        _trainer_saves_next(tmp_path)
        restore.load_weights(_model(1), ck)

    with pytest.raises(UserError) as e:
        ckpt.read_newest(tmp_path, read, attempts=3)
    assert len(calls) == 3
    msg = str(e.value)
    assert "\n" not in msg and "deleted while it was read, 3 times" in msg and "--keep_last" in msg, msg


def test_an_error_of_an_intact_checkpoint_is_not_retried(tmp_path):
    ckpt.save(tmp_path, 1, _model(0), {"s": 1}, keep_last=1)
    calls: list[Path] = []

    def read(ck: Path) -> None:
        calls.append(ck)
        restore.load_weights(nn.Linear(3, 3), ck)  # another model: the checkpoint's own error

    with pytest.raises(UserError, match="does not match the model"):
        ckpt.read_newest(tmp_path, read)
    assert len(calls) == 1


def test_a_named_checkpoint_rotated_away_names_the_run_to_read_instead(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    named = ckpt.save(root, 1, _model(0), {"s": 1}, keep_last=1)

    def read(ck: Path) -> None:
        _trainer_saves_next(root)
        restore.load_weights(_model(1), ck)

    with pytest.raises(UserError) as e:
        ckpt.read_newest(named, read)
    assert "deleted while it was read" in str(e.value) and f"the run folder {tmp_path / 'run'}" in str(
        e.value
    )


def test_the_newest_found_is_the_one_saved_while_the_listing_was_verified(tmp_path, monkeypatch):
    # the only checkpoint is rotated away while its checksums are read: there was no valid checkpoint (or, with
    # an older one kept, the older one with a warning that called the rotated one corrupt)
    ckpt.save(tmp_path, 1, _model(0), {"s": 1}, keep_last=1)
    real, rotated = ckpt.verify, []

    def verify(path: Path) -> str | None:
        if not rotated:
            rotated.append(_trainer_saves_next(tmp_path))
        return real(path)

    monkeypatch.setattr(ckpt, "verify", verify)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ckpt.latest_valid(tmp_path) == rotated[0] == ckpt.step_dir(tmp_path, 2)


def test_a_file_deleted_between_its_listing_and_its_checksum_is_missing_not_a_traceback(
    tmp_path, monkeypatch
):
    path = ckpt.save(tmp_path, 1, _model(0), {"s": 1})
    real = ckpt._sha256

    def sha256(f: Path, chunk: int = 1 << 22) -> str:
        f.unlink()
        return real(f, chunk)

    monkeypatch.setattr(ckpt, "_sha256", sha256)
    assert ckpt.verify(path) == f"{ckpt.MODEL_FILE} missing"


# ------------------------------------------------------------------------------------ the commands' load


@pytest.fixture
def live_run(tmp_path, text_corpus, cache_dir, capsys) -> Path:
    """A debug run with one checkpoint (step 2), as a run training with --keep_last 1 leaves it."""
    out = tmp_path / "run"
    ok(["train", "--data", str(text_corpus), "--size", "debug", "--tokenizer", "bytes", "--out", str(out),
        "--max_steps", "2", "--save_interval", "1", "--keep_last", "1", *FASTRUN], capsys)  # fmt: skip
    assert ckpt.list_steps(out / "checkpoints") == [2]
    return out


def _rotating_load(monkeypatch, root: Path, times: int) -> list[Path]:
    """Each of the first ``times`` weight loads finds its checkpoint rotated away by the trainer."""
    real, calls = restore.load_weights, []

    def load_weights(model, path, **kw):
        calls.append(path)
        if len(calls) <= times:
            _trainer_saves_next(root)
        return real(model, path, **kw)

    monkeypatch.setattr(restore, "load_weights", load_weights)
    return calls


def test_sample_of_a_run_that_rotates_its_checkpoint_away_reads_the_newest(live_run, capsys, monkeypatch):
    calls = _rotating_load(monkeypatch, live_run / "checkpoints", times=1)
    ok(["sample", str(live_run), "--prompt", "def ", "--max_new_tokens", "2"], capsys)
    assert [ckpt.step_of(p) for p in calls] == [2, 3]


def test_sample_of_a_run_rotating_under_every_read_is_one_line(live_run, capsys, monkeypatch):
    _rotating_load(monkeypatch, live_run / "checkpoints", times=100)
    refused(["sample", str(live_run), "--prompt", "x"], capsys, "deleted while it was read", "--keep_last")
