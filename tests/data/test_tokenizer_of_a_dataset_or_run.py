"""--tokenizer naming a prepared dataset or a run, whose tokenizer is in its tokenizer/ folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from gptoughts.data.tokenizer import bytes_tokenizer, parse_spec
from gptoughts.errors import ConfigError


def test_a_folder_holding_a_tokenizer_folder_names_it(tmp_path: Path) -> None:
    # reusing the vocabulary of a prepared dataset or a run, one passes the folder at hand: the error said only
    # "a folder with tokenizer.json"
    bytes_tokenizer().save(tmp_path / "prepared" / "tokenizer")
    with pytest.raises(ConfigError, match=r"pass .*prepared/tokenizer$"):
        parse_spec(str(tmp_path / "prepared"))
    assert parse_spec(str(tmp_path / "prepared" / "tokenizer")) == ("folder", None)
