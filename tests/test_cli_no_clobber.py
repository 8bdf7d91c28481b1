"""`gptoughts tune` and `gptoughts plot RUN_A RUN_B` write one file each (tuned.toml, compare.png by default): an
existing file there, named or not, is kept unless --overwrite, and tune refuses before its search starts."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from cli_helpers import run_cli

from gptoughts.config import load_config


def _fake_search(monkeypatch: pytest.MonkeyPatch, during=None) -> list[dict]:
    """Replace tune's search (minutes of real steps) by one winning trial; ``during`` runs inside it."""
    from gptoughts.tools import tune

    calls: list[dict] = []

    def run_tune(cfg, **kwargs):
        calls.append(kwargs)
        if during is not None:
            during()
        settings = {**tune.search_space(cfg, ac=["full"], compile_modes=None, fp8=None, batches=[4])[0]}
        return [tune.Trial(settings, 1234.0, 0.1, 1.0)]

    monkeypatch.setattr(tune, "run_tune", run_tune)
    return calls


TUNE = ["tune", "--size", "debug", "--device", "cpu"]


def test_tune_refuses_an_existing_default_file_before_searching(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    mine = tmp_path / "tuned.toml"
    mine.write_text("# my earlier tuning\n")
    calls = _fake_search(monkeypatch)
    code, text = run_cli(TUNE, capsys)
    assert code == 2 and calls == [], text  # refused before any trial ran
    assert text.strip().count("\n") == 0 and "Traceback" not in text, text
    assert "tuned.toml already exists" in text and "--out" in text and "--overwrite" in text, text
    assert "tuned-2.toml" in text  # a free name to pass
    assert mine.read_text() == "# my earlier tuning\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tuned.toml"]


def test_tune_refuses_an_existing_named_file_and_overwrite_replaces_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    named = tmp_path / "mine.toml"
    named.write_text("# keep\n")
    calls = _fake_search(monkeypatch)
    code, text = run_cli([*TUNE, "--out", str(named)], capsys)
    assert code == 2 and calls == [] and "mine.toml already exists" in text, text
    assert named.read_text() == "# keep\n"

    code, text = run_cli([*TUNE, "--out", str(named), "--overwrite"], capsys)
    assert code == 0, text
    tuned = load_config(str(named))
    assert tuned.perf.activation_checkpointing == "full"
    assert tuned.run.overwrite is False  # tune's --overwrite is not written into the config
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.toml"]  # no temporary file left


def test_tune_writes_a_new_default_file_and_never_replaces_one_made_during_the_search(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    _fake_search(monkeypatch)
    code, text = run_cli(TUNE, capsys)
    assert code == 0 and "written to tuned.toml" in text, text
    assert load_config(str(tmp_path / "tuned.toml")).perf.activation_checkpointing == "full"

    # --out a folder: tuned.toml in it; a tuned.toml made there while the search ran is kept
    folder = tmp_path / "configs"
    folder.mkdir()
    _fake_search(monkeypatch, during=lambda: (folder / "tuned.toml").write_text("# made meanwhile\n"))
    code, text = run_cli([*TUNE, "--out", str(folder)], capsys)
    assert code == 0, text
    assert (folder / "tuned.toml").read_text() == "# made meanwhile\n"
    assert "appeared during the search" in text and "tuned-2.toml" in text, text
    assert load_config(str(folder / "tuned-2.toml")).perf.activation_checkpointing == "full"
    assert sorted(p.name for p in folder.iterdir()) == ["tuned-2.toml", "tuned.toml"]


@pytest.mark.parametrize("steps", ["ten", "-1"])
def test_tune_bad_steps_is_a_one_line_error(steps, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    calls = _fake_search(monkeypatch)
    code, text = run_cli([*TUNE, "--steps", steps], capsys)
    assert code == 2 and calls == [] and "--steps must be a whole number" in text, text
    assert "Traceback" not in text and text.strip().count("\n") == 0


def _run(folder: Path) -> Path:
    folder.mkdir(parents=True)
    rows = [
        {"step": s, "time": 1.0 + s, "loss": 4.0 * math.exp(-s / 10) + 1, "lr": 1e-3, "tokens_per_s": 1000.0}
        for s in range(1, 21)
    ]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_plot_keeps_an_existing_compare_png(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    a, b = _run(tmp_path / "a"), _run(tmp_path / "b")
    code, text = run_cli(["plot", str(a), str(b)], capsys)
    assert code == 0 and (tmp_path / "compare.png").is_file(), text
    first = (tmp_path / "compare.png").read_bytes()

    (tmp_path / "compare.png").write_bytes(b"mine")  # the default path, and a named one
    (tmp_path / "named.png").write_bytes(b"named")
    for extra in ([], ["--out", "named.png"]):
        code, text = run_cli(["plot", str(a), str(b), *extra], capsys)
        assert code == 2 and "already exists" in text and "--overwrite" in text and "--out" in text, text
        assert "Traceback" not in text and text.strip().count("\n") == 0
    assert (tmp_path / "compare.png").read_bytes() == b"mine"
    assert (tmp_path / "named.png").read_bytes() == b"named"

    code, text = run_cli(["plot", str(a), str(b), "--overwrite"], capsys)
    assert code == 0 and (tmp_path / "compare.png").read_bytes() == first, text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "compare.png", "named.png"]
