"""``gptoughts plot`` given a folder that does not exist, or a run that has not logged a step yet."""

from __future__ import annotations

from pathlib import Path

from cli_helpers import refused


def test_plot_of_a_missing_folder_says_it_does_not_exist(tmp_path: Path, capsys):
    # was "has no metrics.jsonl; pass a run directory"
    refused(["plot", str(tmp_path / "nope")], capsys, "does not exist")


def test_plot_of_a_run_before_its_first_step_says_so(tmp_path: Path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text("{}")
    refused(["plot", str(run)], capsys, "no metrics.jsonl yet")
