"""``gptoughts.load`` and the commands that read a model (``sample``, ``eval``, ``export``) refuse a path that names
no model in the same words: load said "pass a run directory or a checkpoint directory" for a missing path, which
leaves out the Hugging Face folders it loads too (and the hint for a hub id)."""

from __future__ import annotations

import pytest
from cli_helpers import run_cli

import gptoughts
from gptoughts.errors import UserError


@pytest.mark.parametrize("kind", ["missing", "hub id", "file", "empty folder"])
def test_load_names_what_it_reads_as_the_sample_command_does(kind, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    path = {
        "missing": "runs/nope",
        "hub id": "my-org/my-model",
        "file": "notes.txt",
        "empty folder": "empty",
    }[kind]
    if kind == "file":
        (tmp_path / path).write_text("x")
    if kind == "empty folder":
        (tmp_path / path).mkdir()
    with pytest.raises(UserError) as e:
        gptoughts.load(path, device="cpu")
    code, text = run_cli(["sample", path, "--device", "cpu"], capsys)
    assert code == 2 and text.strip() == f"error: {e.value}", (text, str(e.value))
    assert "Hugging Face model folder" in str(e.value)
