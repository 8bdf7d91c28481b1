"""``gptoughts bench --init_from MODEL`` (and ``tune``, which times through bench): bench builds its step from the
family and size on random tokens and never loads ``--init_from``; it timed another model than the one named, and
printed its figures as if it were that one. Refused in one line that names what times a fine-tune."""

from __future__ import annotations

import pytest
from cli_helpers import refused


@pytest.mark.parametrize("command", ["bench", "tune"])
def test_bench_and_tune_refuse_a_model_they_would_not_load(tmp_path, monkeypatch, capsys, command):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text('{"model_type": "llama"}')
    refused([command, "--size", "debug", "--device", "cpu", "--init_from", "m"], capsys,
            "do not load --init_from m", "gptoughts finetune --model m")  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
