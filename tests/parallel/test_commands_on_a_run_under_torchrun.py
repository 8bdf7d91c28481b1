"""`torchrun --nproc_per_node 2 -m gptoughts eval RUN --data X` (or `sample RUN`) ran the whole command on every
rank: two eval lines, two different samples, each rank loading the model. These commands use no process group:
under torchrun of several processes they are refused, one line printed once, before any model loads."""

from __future__ import annotations

import re

import pytest
from cli_helpers import FASTRUN
from torchrun_runs import here, process

from gptoughts import cli
from gptoughts.errors import UserError


@pytest.mark.parametrize("command", ["eval", "sample", "export", "plot"])
def test_several_processes_are_refused_and_one_is_not(command, monkeypatch):
    from gptoughts.cli.trained import refuse_torchrun

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")  # `torchrun --nproc_per_node 1`: one process, as without torchrun
    refuse_torchrun(command)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UserError, match=rf"gptoughts {command} runs in one process: drop torchrun"):
        refuse_torchrun(command)


@pytest.mark.parametrize(
    "argv",
    [["eval", "RUN", "--data", "X"], ["sample", "RUN", "--prompt", "def "]],
    ids=["eval", "sample"],
)
def test_the_command_says_so_before_reading_the_run(argv, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)  # no launch store to post the error to
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: gptoughts {argv[0]} runs in one process: drop torchrun and run `gptoughts {argv[0]} "
                   "...` by itself"], err  # fmt: skip


@pytest.mark.slow
@pytest.mark.distributed
def test_eval_and_sample_under_torchrun_say_it_once_and_print_no_result(shared_corpus, tmp_path):
    run = tmp_path / "run"
    here(["train", "--data", str(shared_corpus), "--out", str(run), "--size", "debug", "--tokenizer", "bytes",
          "--max_steps", "1", *FASTRUN], env={"GPTOUGHTS_CACHE": str(tmp_path / "cache")})  # fmt: skip
    for argv in (["eval", str(run), "--data", str(shared_corpus), "--max_batches", "1"],
                 ["sample", str(run), "--prompt", "def ", "--max_new_tokens", "4", "--device", "cpu"]):  # fmt: skip
        r = process(argv, procs=2)
        text = r.stdout + r.stderr
        assert r.returncode != 0 and not r.stdout.strip(), text[-3000:]  # no result printed, by any rank
        errors = [line for line in text.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "drop torchrun" in errors[0], text[-3000:]
        assert set(re.findall(r"exitcode\s*:\s*(-?\d+)", text)) <= {"2", "-15"}, text[-3000:]
