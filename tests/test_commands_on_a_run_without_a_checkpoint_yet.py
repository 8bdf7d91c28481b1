"""``sample`` and ``eval`` of a run that has no checkpoint: one still training before its first save said "no valid
checkpoint under RUN; train first", though it is training; the message says when it saves (or that it never will)."""

from __future__ import annotations

import json

import pytest
from cli_helpers import FASTRUN, run_cli

from gptoughts import cli
from gptoughts.errors import UserError
from gptoughts.training.trainer import Trainer

FLAGS = [*FASTRUN, "--tokenizer", "bytes", "--size", "debug"]


@pytest.mark.slow  # a whole training run
def test_sample_and_eval_during_a_run_before_its_first_checkpoint_say_when_it_saves(
    tmp_path, text_corpus, cache_dir, monkeypatch, capsys
):
    out = tmp_path / "run"
    seen: dict[str, tuple[int, str]] = {}
    original = Trainer.train_step

    def train_step(self):
        result = original(self)
        if self.state.step + 1 == 2:  # during step 2; the first save is at step 4
            for argv in (["sample", str(out)], ["eval", str(out), "--data", str(text_corpus)]):
                capsys.readouterr()  # (the run's own lines so far)
                seen[argv[0]] = (cli.main(argv), capsys.readouterr().err)
        return result

    monkeypatch.setattr(Trainer, "train_step", train_step)
    argv = ["train", "--data", str(text_corpus), "--out", str(out), "--max_steps", "8"]
    code, text = run_cli([*argv, "--checkpoint.save_interval", "4", *FLAGS], capsys)
    assert code == 0, text[-2000:]
    for command, (rc, err) in seen.items():
        assert rc == 2, (command, rc, err)
        assert "no checkpoint yet" in err and "at step 4" in err and "step 8" in err, (command, err)
        assert "train first" not in err and "Traceback" not in err, (command, err)


@pytest.mark.slow  # a whole training run
def test_sample_of_a_run_trained_without_checkpoints_says_so(tmp_path, text_corpus, cache_dir, capsys):
    out = tmp_path / "run"
    argv = ["train", "--data", str(text_corpus), "--out", str(out), "--max_steps", "2", *FLAGS]
    code, text = run_cli([*argv, "--checkpoint.checkpoints", "false"], capsys)
    assert code == 0, text[-2000:]
    code, text = run_cli(["sample", str(out)], capsys)
    assert code == 2 and "checkpoint.checkpoints false" in text and "train first" not in text, text[-2000:]


def _run_without_checkpoint(tmp_path, **record):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    plan = {"batch": {"save_interval": 4, "total_steps": 8, "checkpoints": True}}
    (run / "run.json").write_text(json.dumps({"family": "llama", "args": {}, "plan": plan, **record}))
    (run / ".lock").write_text("{}")  # left behind by a killed run: nobody holds it
    return run


def test_a_killed_run_is_not_said_to_be_training(tmp_path):
    from gptoughts.api import _refuse_a_run_before_its_first_checkpoint

    with pytest.raises(UserError, match="stopped before its first checkpoint and has nothing to load"):
        _refuse_a_run_before_its_first_checkpoint(_run_without_checkpoint(tmp_path))


def test_a_branch_stopped_before_its_first_checkpoint_names_its_origin(tmp_path):
    from gptoughts.api import _refuse_a_run_before_its_first_checkpoint

    origin = tmp_path / "base" / "checkpoints" / "step_000004"
    with pytest.raises(UserError, match=f"branched from {origin}.*--resume auto"):
        _refuse_a_run_before_its_first_checkpoint(
            _run_without_checkpoint(tmp_path, branched_from=str(origin))
        )
