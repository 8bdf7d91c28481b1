"""``gptoughts export RUN OUT`` never writes into a folder gptoughts wrote: the run itself, anything inside a run
(a checkpoint, its tokenizer), a checkpoint moved out of its run, or a prepared dataset. With or without
--overwrite it is refused in one line naming another OUT, and the folder is left byte for byte as it was (an
export clears old *.safetensors: into a checkpoint it deleted the checkpoint's weights)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from cli_helpers import FASTRUN, ok, refused_leaving, snapshot

from gptoughts.errors import UserError


@pytest.fixture
def run(tmp_path: Path, text_corpus: Path, cache_dir: Path, capsys) -> Path:
    """A finished run with checkpoints at steps 2 and 4."""
    out = tmp_path / "runs" / "a"
    ok(
        ["train", "--data", str(text_corpus), "--size", "debug", "--tokenizer", "bytes", "--out", str(out),
         "--max_steps", "4", "--save_interval", "2", *FASTRUN],
        capsys,
    )  # fmt: skip
    return out


@pytest.mark.parametrize("overwrite", [False, True])
def test_export_into_a_run_or_what_is_inside_it_is_refused(run: Path, tmp_path: Path, capsys, overwrite):
    flag = ["--overwrite"] if overwrite else []
    for out in (run, run / "checkpoints" / "step_000004", run / "tokenizer", run / "hf"):
        line = refused_leaving(
            tmp_path, ["export", str(run), str(out), *flag], capsys, str(out), "another OUT", "a-hf"
        )
        assert "training run" in line, line
    assert not (run / "hf").exists()


def test_export_into_a_moved_checkpoint_or_a_prepared_dataset_is_refused(
    run: Path, tmp_path: Path, text_corpus: Path, capsys
):
    moved = tmp_path / "kept" / "step_000002"
    shutil.copytree(run / "checkpoints" / "step_000002", moved)
    shards = tmp_path / "shards"
    ok(["prepare", "--data", str(text_corpus), "--out", str(shards), "--tokenizer", "bytes"], capsys)
    for out, what in ((moved, "a checkpoint"), (shards, "a prepared dataset")):
        for flag in ([], ["--overwrite"]):
            line = refused_leaving(
                tmp_path, ["export", str(run), str(out), *flag], capsys, what, "another OUT"
            )
            assert f"{out.name}-hf" in line, line


def test_the_python_api_refuses_it_too_and_a_new_folder_still_exports(
    run: Path, tmp_path: Path, capsys, monkeypatch
):
    from gptoughts import api

    before = snapshot(tmp_path)
    loads = []
    real_load = api.load
    monkeypatch.setattr(api, "load", lambda *a, **k: loads.append(a) or real_load(*a, **k))
    with pytest.raises(UserError, match="another OUT"):
        api.export(run, run, overwrite=True)
    assert snapshot(tmp_path) == before
    assert loads == []  # refused before the model is loaded (which can take minutes)
    ok(["export", str(run), str(tmp_path / "runs" / "a-hf")], capsys)  # the name the refusal suggests
    assert (tmp_path / "runs" / "a-hf" / "config.json").is_file()
    with pytest.raises(UserError, match=r"e\.g\. \S*runs/a-hf-2$"):  # a-hf is taken now: the next free name
        api.export(run, run / "checkpoints", overwrite=True)
    # a second export into it needs --overwrite, as before; with it, it replaces that export
    refused_leaving(tmp_path, ["export", str(run), str(tmp_path / "runs" / "a-hf")], capsys, "--overwrite")
    ok(["export", str(run), str(tmp_path / "runs" / "a-hf"), "--overwrite"], capsys)
