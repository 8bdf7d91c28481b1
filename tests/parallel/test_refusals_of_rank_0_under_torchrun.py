"""What rank 0 alone checks or writes under torchrun (the run folder: its lock, whether it holds another run, the
run's files): a refusal there was one line from rank 0, but the other ranks, waiting for its answer in a collective,
died there with gloo's "Connection closed by peer" traceback and exit status 1. Every rank now stops on the same
one-line error, printed once."""

from __future__ import annotations

import json
import re
import sys

import pytest
from cli_helpers import QUIET_CPU
from torchrun_runs import process

from gptoughts.training import rundir


def _argv(out, corpus, *extra: str) -> list[str]:
    return ["train", "--data", str(corpus), "--out", str(out), "--size", "debug", "--tokenizer", "bytes",
            "--block_size", "32", "--batch_size", "2", "--max_steps", "2", *QUIET_CPU, *extra]  # fmt: skip


def _one_error(r, needle: str) -> None:
    """Exit non-zero, the refusal once, no traceback through our code, every rank stopped by it (status 2) or by
    torchrun ending the launch (SIGTERM)."""
    text = r.stdout + r.stderr
    assert r.returncode != 0, text[-3000:]
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0] and not errors[0].startswith("error: rank"), text[-3000:]
    ours = [line for line in text.splitlines() if 'File "' in line and "/gptoughts/" in line]
    assert not ours, text[-3000:]
    codes = set(re.findall(r"exitcode\s*:\s*(-?\d+)", text))
    assert codes <= {"2", "-15"}, text[-3000:]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("folder", ["in use", "not empty"])
def test_a_folder_rank_0_refuses_is_refused_on_every_rank(folder, tmp_path, text_corpus, cache_dir):
    out = tmp_path / "run"
    if folder == "not empty":
        out.mkdir()
        (out / "notes.txt").write_text("mine", encoding="utf-8")
        r = process(_argv(out, text_corpus), procs=2)
        _one_error(r, "exists and is not empty")
        return
    lock = rundir.RunLock.acquire(out)  # another run training there
    try:
        r = process(_argv(out, text_corpus), procs=2)
    finally:
        lock.release()
    _one_error(r, "is in use by")


@pytest.mark.slow
@pytest.mark.distributed
def test_a_bad_record_rank_0_finds_as_it_prepares_the_corpus_stops_every_rank(tmp_path, cache_dir):
    # past what the plan's estimate samples: found only as rank 0 tokenizes, the other ranks waiting meanwhile
    corpus = tmp_path / "c.jsonl"
    good = "".join(json.dumps({"text": f"def f(x):\n    return x + {i}\n" * 4}) + "\n" for i in range(3000))
    corpus.write_text(good + "{broken\n", encoding="utf-8")
    r = process(_argv(tmp_path / "run", corpus), procs=2)
    _one_error(r, "is not valid JSON")


# Rank 0 fails as it writes the run's files (a full disk, an unwritable tokenizer folder): a UserError there.
DRIVER = """
import os, sys
from gptoughts import cli
from gptoughts.errors import UserError
from gptoughts.training import components
def write_run_files(asm):
    raise UserError("cannot write the run files; free some space")
if os.environ["RANK"] == "0":
    components.write_run_files = write_run_files
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.slow
@pytest.mark.distributed
def test_a_failure_writing_the_run_files_on_rank_0_stops_every_rank(tmp_path, text_corpus, cache_dir):
    import os
    import subprocess

    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER, encoding="utf-8")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(driver),
           *_argv(tmp_path / "run", text_corpus)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    _one_error(r, "cannot write the run files")
