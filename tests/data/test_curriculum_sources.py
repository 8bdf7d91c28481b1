"""A curriculum (data.phases) naming a source that is not in data.sources is refused before the corpus is
tokenized, and by a dry run: it was refused only once the whole corpus had been prepared."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
from cli_helpers import FASTRUN, refused

prepare_module = importlib.import_module("gptoughts.data.prepare")


@pytest.mark.parametrize("dry_run", [True, False])
def test_a_phase_outside_data_sources_is_refused_before_tokenizing(
    text_corpus: Path, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch, dry_run: bool
) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "a.txt").write_text("some other text\n")
    toml = tmp_path / "cur.toml"
    toml.write_text(
        f'[data]\nsources = ["{text_corpus}"]\ntokenizer = "bytes"\n\n'
        f'[[data.phases]]\nname = "first"\nsources = ["{other}"]\ntokens = 1000\n\n'
        f'[[data.phases]]\nname = "rest"\nsources = ["{text_corpus}"]\n'
    )

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("the corpus was tokenized before the phases were checked")

    monkeypatch.setattr(prepare_module, "_build_and_install", no_tokenizing)
    refused(
        [
            "train",
            str(toml),
            "--size",
            "debug",
            "--max_steps",
            "1",
            *FASTRUN,
            *(["--dry_run"] if dry_run else []),
        ],
        capsys,
        f"data.phases `first` uses {other}, which is not in data.sources",
    )
