"""``gptoughts eval A B --data TEXT``: the models compared are scored in the same windows. A run and its own export
(the same weights) were scored in windows of the run's block and of a model folder's default (256): two losses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_helpers import FAST, run_cli

import gptoughts
from gptoughts.errors import UserError


def _run(folder: Path, block: int, positions: int) -> str:
    """A run's folder as common_eval_block reads it: its config's block, its model's positions."""
    folder.mkdir()
    (folder / "config.toml").write_text(f"[train]\nblock_size = {block}\n")
    (folder / "run.json").write_text(json.dumps({"family": "llama", "args": {"max_seq_len": positions}}))
    return str(folder)


def _model_folder(folder: Path, positions: int) -> str:
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps({"model_type": "llama", "max_position_embeddings": positions})
    )
    return str(folder)


def test_the_common_window_is_the_smallest_default_and_a_typed_one_fits_every_model(tmp_path, monkeypatch):
    from gptoughts.api import common_eval_block
    from gptoughts.models import hf

    monkeypatch.setattr(
        hf, "resolved_config", hf.read_config
    )  # (the configs are complete: no transformers import)
    a, b = _run(tmp_path / "a", 96, 512), _model_folder(tmp_path / "b", 1024)  # defaults: 96, and 256
    c = _model_folder(tmp_path / "c", 64)  # fewer positions than the default window: its positions
    assert common_eval_block([a, b], None) == (96, {a: 96, b: 256})
    assert common_eval_block([b, c], None) == (64, {b: 256, c: 64})
    assert common_eval_block([a, b], 512)[0] == 512
    with pytest.raises(UserError, match=f"--block_size 513 is longer than {a}'s 512 positions"):
        common_eval_block([b, a], 513)


@pytest.fixture(scope="module")
def run_and_export(tmp_path_factory: pytest.TempPathFactory, shared_corpus: Path) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("side-by-side")
    run = root / "run"  # trained in windows of 32 tokens; its export's default window is 256
    gptoughts.train(
        data_path=str(shared_corpus), save_dir=str(run), max_steps=1, **{**FAST, "train.sample_prompts": []}
    )
    gptoughts.export(run, root / "export")
    return str(run), str(root / "export")


@pytest.mark.slow  # (a run trained and exported: ~10 s)
def test_a_run_and_its_export_score_the_same_loss(run_and_export, shared_corpus, capsys):
    run, export = run_and_export
    code = gptoughts.cli.main(
        ["eval", run, export, "--data", str(shared_corpus), "--device", "cpu", "--json"]
    )
    out = capsys.readouterr()
    assert code == 0, out.err[-2000:]
    scores = json.loads(out.out)
    assert scores[run]["tokens"] == scores[export]["tokens"]
    assert scores[run]["loss"] == pytest.approx(scores[export]["loss"], rel=1e-5)
    assert "in windows of 32 tokens" in scores[export]["scored"]
    # the window chosen, and why, in one line beside the JSON
    note = [line for line in out.err.splitlines() if line.startswith("note:")]
    assert note == [
        f"note: every model is scored in windows of 32 tokens, the smallest of their defaults ({run}: 32, "
        f"{export}: 256); --block_size N sets another"
    ]


@pytest.mark.slow
def test_a_typed_window_past_one_models_positions_is_refused_before_any_is_scored(
    run_and_export, shared_corpus, capsys, monkeypatch
):
    from gptoughts import api

    monkeypatch.setattr(api, "load", lambda *a, **k: pytest.fail("loaded a model"))
    run, export = run_and_export
    positions = json.loads((Path(run) / "run.json").read_text())["args"]["max_seq_len"]
    argv = ["eval", run, export, "--data", str(shared_corpus), "--block_size", str(positions + 1)]
    code, text = run_cli(argv, capsys)
    assert (
        code == 2 and f"--block_size {positions + 1} is longer than {run}'s {positions} positions" in text
    ), text


def test_side_by_side_preferences_name_each_models_reference(capsys):
    """A LoRA run's default reference is its base, a model folder has none: the table put their margins side by side
    without saying so (its export's margin differed from the run's, the same weights)."""
    from argparse import Namespace

    from gptoughts.cli.trained import _print_eval

    def prefs(margin: float, reference: str) -> dict:
        p = {
            "preference_accuracy": 0.5,
            "reward_margin": margin,
            "pairs": 8,
            "beta": 0.1,
            "reference": reference,
        }
        return {"prefs": p}

    results = {"runs/ft": prefs(0.25, "the base model (adapters disabled)"), "export": prefs(-1.5, "none")}
    _print_eval(results, Namespace(json=False, data=None, prefs=["pairs.jsonl"]), False)
    lines = capsys.readouterr().out.splitlines()
    assert "runs/ft: 8 pairs of pairs.jsonl; beta 0.1; reference: the base model (adapters disabled)" in lines
    assert "export: 8 pairs of pairs.jsonl; beta 0.1; reference: none" in lines
