"""A reader of a run (``gptoughts sample/eval/export RUN``, ``gptoughts.load``, a dry run) never renames or removes
anything in it: only the process that holds the run's lock (the trainer) finishes or undoes an interrupted
replace (``store.recover``). A reader used to recover too, and one that landed between the two renames of the
trainer's re-save of a step (end of run, rollback) put the old folder back, and the trainer's save failed. A
reader reads a ``.old-step_N-*`` folder in place instead, as step N where ``step_N`` is missing or unusable."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from cli_helpers import FASTRUN, ok, snapshot
from safetensors.torch import load_file
from torch import nn

import gptoughts
from gptoughts.errors import UserError
from gptoughts.training.checkpoint import restore
from gptoughts.training.checkpoint import store as ckpt
from gptoughts.training.rundir import RunLock

REPO = Path(gptoughts.__file__).resolve().parents[1]


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in load_file(str(path / ckpt.MODEL_FILE)).items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _moved_aside(root: Path, step: int) -> Path:
    """What the trainer's re-save of ``step`` leaves between its two renames (or a crash there): ``step_N``
    renamed to ``.old-step_N-<time>``, the new one not in place yet."""
    old = root / f".old-step_{step:06d}-{time.monotonic_ns()}"
    ckpt.step_dir(root, step).rename(old)
    return old


def _listing(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


# ---------------------------------------------------------------------------------------------- the store


def test_a_reader_between_the_two_renames_of_a_resave_leaves_the_save_alone(tmp_path, monkeypatch):
    root = tmp_path / "run" / "checkpoints"
    ckpt.save(root, 1, _model(0), {"s": 1})
    first = _weights(ckpt.save(root, 2, _model(1), {"s": 2}))
    real, read = ckpt._fsync_dir, []

    def fsync_dir(path: Path) -> None:  # the trainer's _replace fsyncs the dir between its two renames
        real(path)
        if not read and not ckpt.step_dir(root, 2).exists() and list(root.glob(".old-step_000002-*")):
            before = _listing(root)
            read.append(ckpt.latest_valid(root))  # another process reads the run right here
            read.append(before == _listing(root))

    monkeypatch.setattr(ckpt, "_fsync_dir", fsync_dir)
    # the re-save of step 2 (end of run, rollback) must not fail: it did, OSError (step_000002 not empty), when
    # the reader renamed the old folder back
    new = ckpt.save(root, 2, _model(2), {"s": 3})
    assert read[1], "a reader renamed or removed a folder of a run it does not own"
    assert read and read[0].name.startswith(".old-step_000002-")  # the reader read the complete old step 2
    assert new == ckpt.step_dir(root, 2) and _same(_weights(new), dict(_model(2).state_dict()))
    assert not _same(_weights(new), first)
    assert _listing(root) == ["step_000001", "step_000002"]


def test_a_run_cut_between_the_two_renames_is_read_in_place(tmp_path):
    root = tmp_path / "checkpoints"
    ckpt.save(root, 1, _model(0), {"s": 1})
    want = _weights(ckpt.save(root, 2, _model(1), {"s": 2}))
    old = _moved_aside(root, 2)
    before = _listing(root)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a step moved aside is not corrupt: no warning
        found = ckpt.latest_valid(root)
    assert found == old and ckpt.step_of(found) == 2 and _same(_weights(found), want)
    assert ckpt.resolve(root) == old
    assert ckpt.latest_valid(root, before=2) == ckpt.step_dir(root, 1)
    assert _listing(root) == before  # nothing renamed back: that is the trainer's, under its lock


def test_a_folder_moved_aside_and_removed_while_it_is_verified_finds_the_new_step(tmp_path, monkeypatch):
    # the reader checks the checksums of .old-step_N while the trainer puts the new step_N in place and removes
    # the old folder: the newest is the new step_N, not step N-1
    root = tmp_path / "checkpoints"
    ckpt.save(root, 1, _model(0), {"s": 1})
    ckpt.save(root, 2, _model(1), {"s": 2})
    old = _moved_aside(root, 2)
    real = ckpt.verify

    def verify(path: Path) -> str | None:
        if path == old and old.exists():  # the trainer's second rename, then its removal of the old folder
            ckpt.save(tmp_path / "elsewhere", 2, _model(2), {"s": 3}).rename(ckpt.step_dir(root, 2))
            shutil.rmtree(old)
        return real(path)

    monkeypatch.setattr(ckpt, "verify", verify)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        found = ckpt.latest_valid(root)
    assert found == ckpt.step_dir(root, 2) and _same(_weights(found), dict(_model(2).state_dict()))


def test_a_step_resaved_while_it_is_verified_is_read_again_not_called_corrupt(tmp_path, monkeypatch):
    # the reader's checksums read half the old step_N and half the new one: a mismatch, from a re-save, not
    # from corruption (the old reader warned "unusable" and fell back to step N-1)
    root = tmp_path / "checkpoints"
    ckpt.save(root, 1, _model(0), {"s": 1})
    ckpt.save(root, 2, _model(1), {"s": 2})
    real, resaved = ckpt.verify, []

    def verify(path: Path) -> str | None:
        if path == ckpt.step_dir(root, 2) and not resaved:
            old = _moved_aside(root, 2)
            resaved.append(ckpt.save(tmp_path / "elsewhere", 2, _model(2), {"s": 3}).rename(path))
            shutil.rmtree(old)
            return f"{ckpt.STATE_FILE} checksum mismatch (corrupted)"
        return real(path)

    monkeypatch.setattr(ckpt, "verify", verify)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        found = ckpt.latest_valid(root)
    assert resaved and found == ckpt.step_dir(root, 2)
    assert _same(_weights(found), dict(_model(2).state_dict()))


def test_a_listing_that_missed_a_dir_being_renamed_is_read_again(tmp_path, monkeypatch):
    # a directory listing read while an entry is renamed may show it under neither name (measured: about one
    # listing in a thousand, against a trainer re-saving in a loop): the listing is read again
    root = tmp_path / "checkpoints"
    ckpt.save(root, 1, _model(0), {"s": 1})
    ckpt.save(root, 2, _model(1), {"s": 2})
    real, missed = Path.iterdir, []

    def iterdir(self: Path) -> Iterator[Path]:
        children = list(real(self))
        if self == root and not missed:
            missed.append(self)
            children = [c for c in children if c.name != "step_000002"]
        return iter(children)

    monkeypatch.setattr(Path, "iterdir", iterdir)
    assert ckpt.latest_valid(root) == ckpt.step_dir(root, 2) and missed


def test_a_leftover_beside_its_new_step_is_left_alone(tmp_path):
    # after the second rename, before the old folder is removed (or a crash there): step_N is the new one
    root = tmp_path / "checkpoints"
    old = _moved_aside(root, ckpt.step_of(ckpt.save(root, 3, _model(0), {"s": 1})))
    new = ckpt.save(tmp_path / "elsewhere", 3, _model(1), {"s": 2}).rename(ckpt.step_dir(root, 3))
    (old / ckpt.MODEL_FILE).unlink()  # being removed
    before = _listing(root)
    assert before == [old.name, "step_000003"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        found = ckpt.latest_valid(root)
    assert found == new and _same(_weights(found), dict(_model(1).state_dict()))
    assert _listing(root) == before


def test_a_corrupt_step_falls_back_to_its_folder_moved_aside_with_a_warning(tmp_path):
    root = tmp_path / "checkpoints"
    ckpt.save(root, 1, _model(0), {"s": 1})
    want = _weights(ckpt.save(root, 2, _model(1), {"s": 2}))
    old = root / f".old-step_000002-{time.monotonic_ns()}"
    shutil.copytree(ckpt.step_dir(root, 2), old)
    (ckpt.step_dir(root, 2) / ckpt.MODEL_FILE).write_bytes(b"garbage")
    with pytest.warns(UserWarning, match="step_000002 is unusable"):
        found = ckpt.latest_valid(root)
    assert found == old and _same(_weights(found), want)


def test_a_reader_of_the_folder_moved_aside_then_removed_reads_the_new_step(tmp_path):
    # the reader picked .old-step_N, then the trainer put the new step_N in place and removed the old one
    root = tmp_path / "checkpoints"
    ckpt.save(root, 1, _model(0), {"s": 1})
    ckpt.save(root, 2, _model(1), {"s": 2})
    calls: list[Path] = []

    def read(ck: Path) -> None:
        calls.append(ck)
        if len(calls) == 1:  # the trainer's second rename, then the removal of the old folder
            ckpt.save(tmp_path / "elsewhere", 2, _model(2), {"s": 3}).rename(ckpt.step_dir(root, 2))
            shutil.rmtree(ck)
        restore.load_weights(_model(5), ck)

    _moved_aside(root, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = ckpt.read_newest(root, read)
    assert calls[0].name.startswith(".old-step_000002-") and got == calls[1] == ckpt.step_dir(root, 2)


# ----------------------------------------------------------------------------- readers of a run in training


@pytest.fixture
def run(tmp_path, text_corpus, cache_dir, capsys) -> Path:
    """A debug run with checkpoints at steps 1 and 2."""
    out = tmp_path / "run"
    ok(["train", "--data", str(text_corpus), "--size", "debug", "--tokenizer", "bytes", "--out", str(out),
        "--max_steps", "2", "--save_interval", "1", "--keep_last", "2", *FASTRUN], capsys)  # fmt: skip
    assert ckpt.list_steps(out / "checkpoints") == [1, 2]
    return out


@pytest.fixture
def held(run) -> Iterator[Path]:
    """``run``, its lock held by another process (a trainer's), for as long as the test runs."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    code = (
        "import sys; from pathlib import Path; from gptoughts.training.rundir import RunLock; "
        "lock = RunLock.acquire(Path(sys.argv[1])); print('locked', flush=True); sys.stdin.read(); lock.release()"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code, str(run)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(UserError, match="in use by"):
            RunLock.acquire(run)  # held indeed
        yield run
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)


def _read_by_every_command(run: Path, capsys, monkeypatch) -> list[Path]:
    """``gptoughts sample`` and ``gptoughts.load`` of ``run``: the checkpoints whose weights they loaded."""
    real, loaded = restore.load_weights, []

    def load_weights(model, path, **kw):
        loaded.append(path)
        return real(model, path, **kw)

    monkeypatch.setattr(restore, "load_weights", load_weights)
    ok(["sample", str(run), "--prompt", "def ", "--max_new_tokens", "2"], capsys)
    got = gptoughts.load(run, device="cpu")
    assert got.checkpoint == loaded[-1]
    return loaded


def test_readers_of_a_run_whose_trainer_is_between_two_renames_change_nothing(held, capsys, monkeypatch):
    root = held / "checkpoints"
    old = _moved_aside(root, 2)
    before = snapshot(held)
    loaded = _read_by_every_command(held, capsys, monkeypatch)
    assert snapshot(held) == before, "a reader renamed or removed a folder of a run it does not own"
    assert loaded and all(p == old for p in loaded)  # the newest complete checkpoint: step 2, moved aside
    assert not ckpt.step_dir(root, 2).exists()  # the trainer's second rename still has its place


def test_readers_of_a_locked_run_read_its_newest_step_and_change_nothing(held, capsys, monkeypatch):
    root = held / "checkpoints"
    leftover = root / f".old-step_000001-{time.monotonic_ns()}"
    leftover.mkdir()  # a leftover the trainer has yet to remove
    before = snapshot(held)
    loaded = _read_by_every_command(held, capsys, monkeypatch)
    assert snapshot(held) == before
    assert loaded and all(p == ckpt.step_dir(root, 2) for p in loaded)


def test_a_reader_of_a_run_cut_between_two_renames_reads_it_and_the_resume_recovers_it(
    run, text_corpus, capsys, monkeypatch
):
    # no trainer holds the lock (it was killed between the renames): a reader still only reads; the resume,
    # which takes the lock, renames the step back and continues from it
    root = run / "checkpoints"
    old = _moved_aside(root, 2)
    before = snapshot(run)
    loaded = _read_by_every_command(run, capsys, monkeypatch)
    assert snapshot(run) == before and loaded and all(p == old for p in loaded)
    out = ok(["train", "--resume", "auto", "--out", str(run), "--max_steps", "3", *FASTRUN], capsys)
    assert f"resumed from {ckpt.step_dir(root, 2)} at step 2" in out, out[-2000:]
    assert ckpt.list_steps(root) == [2, 3] and not list(root.glob(".old-*"))
