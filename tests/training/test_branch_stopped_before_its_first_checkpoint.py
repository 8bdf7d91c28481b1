"""A branch (``--resume RUN/checkpoints/step_N --out NEW``) stopped before it wrote a checkpoint of its own, then
continued with ``--resume auto --out NEW``: it goes on from the checkpoint it branched from, never from step 0."""

from __future__ import annotations

import json

import pytest
from cli_helpers import FASTRUN, ok, refused, run_cli

from gptoughts.training.checkpoint import store as ckpt
from gptoughts.training.trainer import Trainer

FLAGS = [*FASTRUN, "--tokenizer", "bytes", "--size", "debug"]


def _branch_interrupted_at_its_start(tmp_path, corpus, monkeypatch, capsys):
    """A run of 2 steps, and a branch of it (to step 3) whose Ctrl-C came before its first step."""
    run, branch = tmp_path / "run", tmp_path / "branch"
    ok(["train", "--data", str(corpus), "--out", str(run), "--max_steps", "2", *FLAGS], capsys)

    def interrupted(self, *a, **k):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(Trainer, "fit", interrupted)
        origin = ckpt.step_dir(run / "checkpoints", 2)
        code, text = run_cli(
            ["train", "--resume", str(origin), "--out", str(branch), "--max_steps", "3"], capsys
        )
    assert code == 130 and not ckpt.list_steps(branch / "checkpoints"), text[-2000:]
    return origin, branch


@pytest.mark.slow  # three runs
def test_a_branch_stopped_before_its_first_checkpoint_goes_on_from_where_it_branched(
    tmp_path, text_corpus, cache_dir, monkeypatch, capsys
):
    """It said "has no checkpoint yet: its own config.toml starts again from step 0" and trained a new model from
    random weights under the branch's name."""
    origin, branch = _branch_interrupted_at_its_start(tmp_path, text_corpus, monkeypatch, capsys)
    text = ok(["train", "--resume", "auto", "--out", str(branch)], capsys)
    assert f"resumed from {origin} at step 2" in text and "starts again from step 0" not in text, text[-2000:]
    summary = json.loads((branch / "summary.json").read_text())
    assert (summary["resumed_at_step"], summary["steps"]) == (2, 3), summary


def test_a_branch_whose_origin_is_gone_is_refused_not_restarted(
    tmp_path, text_corpus, cache_dir, monkeypatch, capsys
):
    origin, branch = _branch_interrupted_at_its_start(tmp_path, text_corpus, monkeypatch, capsys)
    (origin / ckpt.MODEL_FILE).write_bytes(b"cut")
    before = (branch / "run.json").read_bytes()
    refused(["train", "--resume", "auto", "--out", str(branch)], capsys, str(origin), "--overwrite")
    assert (branch / "run.json").read_bytes() == before
