"""The plan's steps line names the stopping rule and where it came from. A TOML file's ``max_steps = 5`` and a
resumed run's saved rule were both printed "(--max_steps 5)", crediting a flag the user never typed; now only a
flag of this command is written as one, and a rule from a file names the file (the resumed run's config.toml)."""

from __future__ import annotations

import json

import pytest
from cli_helpers import FASTRUN, ok, run_cli


def _steps_line(text: str) -> str:
    return next(line for line in text.splitlines() if line.startswith("  steps: "))


def _toml(tmp_path, corpus, rule: str):
    path = tmp_path / "good.toml"
    path.write_text(
        f'[model]\nsize = "debug"\n[data]\nsources = ["{corpus}"]\ntokenizer = "bytes"\n[train]\n{rule}\n'
    )
    return path


@pytest.mark.parametrize(
    "rule, typed, needle",
    [
        ("max_steps = 5", [], "(max_steps 5 in good.toml)"),
        ("epochs = 0.5", [], "(epochs 0.5 in good.toml)"),
        ("max_tokens = 4096", [], "(max_tokens 4,096 in good.toml)"),
        ("max_steps = 5", ["--max_steps", "3"], "(--max_steps 3)"),  # the flag replaces the file's
    ],
)
def test_a_rule_from_a_toml_file_names_the_file_and_only_a_typed_one_is_a_flag(
    tmp_path, text_corpus, cache_dir, capsys, monkeypatch, rule, typed, needle
):
    monkeypatch.chdir(tmp_path)
    _toml(tmp_path, text_corpus, rule)
    line = _steps_line(
        ok(["train", "good.toml", "--out", str(tmp_path / "run"), "--dry_run", *typed, *FASTRUN], capsys)
    )
    assert needle in line, line
    assert ("--" in line) == bool(typed), line


def test_a_resume_names_the_rule_its_run_saved_and_a_run_from_a_file_ends_on_max_steps(
    tmp_path, text_corpus, cache_dir, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    _toml(tmp_path, text_corpus, "max_steps = 2")
    out = tmp_path / "run"
    text = ok(["train", "good.toml", "--out", str(out), *FASTRUN], capsys)
    # a file's max_steps ends the run as a typed one does (the summary's reason is the same either way)
    assert json.loads((out / "summary.json").read_text())["stop_reason"] == "max steps"
    assert "done (max steps)" in text, text[-800:]
    # resumed without a rule typed (nothing left to train: the dry run prints its plan, then refuses)
    code, text = run_cli(["train", "--resume", "auto", "--out", str(out), "--dry_run", *FASTRUN], capsys)
    saved = f"max_steps 2 in {out / 'config.toml'}"
    line = _steps_line(text)
    assert f"({saved})" in line and "--max_steps" not in line, line
    assert code == 2 and f"complete at step 2 ({saved})" in text, text[-800:]
