"""`finetune --model RUN` writes the run's export into OUT/base before the run itself takes OUT's lock: the export
holds that lock (a second launch on the same --out is refused, not writing over the first's base), and a failed
export leaves nothing behind, a full disk as one line (api._start_from_run)."""

from __future__ import annotations

import errno
from pathlib import Path
from types import SimpleNamespace

import pytest

from gptoughts import api
from gptoughts.config import load_config
from gptoughts.errors import UserError
from gptoughts.training import rundir


def _setup(tmp_path: Path, monkeypatch, export) -> tuple[object, SimpleNamespace, Path]:
    source = tmp_path / "sft"
    base = api.RunBase(run=source, checkpoint=source / "checkpoints" / "step_000003", step=3)
    monkeypatch.setattr(api, "run_base", lambda spec: base if spec == str(source) else None)
    monkeypatch.setattr(api, "export", export)
    out = tmp_path / "dpo"
    cfg = load_config("finetune", {"run.out": str(out)})
    cfg.model.init_from = str(source)  # (a run's folder: load_config would look for a model folder there)
    env = SimpleNamespace(dist=SimpleNamespace(enabled=False, is_main=True))
    return cfg, env, out


def test_a_second_launch_on_the_same_out_is_refused_while_the_first_exports(tmp_path, monkeypatch):
    calls = []
    cfg, env, out = _setup(tmp_path, monkeypatch, lambda *a, **k: calls.append(a))
    first = rundir.RunLock.acquire(out)  # the first launch, exporting
    try:
        with pytest.raises(UserError, match="in use"):
            api._start_from_run(cfg, env, dry_run=False)
    finally:
        first.release()
    assert calls == [] and not (out / rundir.BASE_DIR).exists()


def test_a_full_disk_during_the_export_is_one_line_and_leaves_no_folder(tmp_path, monkeypatch):
    def export(path, target, **kw):
        Path(target).mkdir(parents=True)
        (Path(target) / "model.safetensors").write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    cfg, env, out = _setup(tmp_path, monkeypatch, export)
    with pytest.raises(UserError, match="disk"):
        api._start_from_run(cfg, env, dry_run=False)
    assert not out.exists()  # the folder this command made, its lock and half an export: all gone


def test_the_export_runs_under_the_lock_and_leaves_the_folder_free(tmp_path, monkeypatch):
    held = []

    def export(path, target, **kw):
        held.append(rundir.in_use(Path(target).parent))
        Path(target).mkdir(parents=True)

    cfg, env, out = _setup(tmp_path, monkeypatch, export)
    undo = api._start_from_run(cfg, env, dry_run=False)
    assert held == [True] and not rundir.in_use(out)  # held while exporting; the run takes it next
    assert cfg.model.init_from == str((out / rundir.BASE_DIR).resolve())
    undo()  # no run.json came of it: the export is removed
    assert not (out / rundir.BASE_DIR).exists()
