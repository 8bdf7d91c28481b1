"""The lock that serialises prepares of one output folder: nothing of it is left beside the folder afterwards, and
removing it never lets two processes in at once."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from gptoughts.data.cache import locked
from gptoughts.data.manifest import Manifest
from gptoughts.data.prepare import prepare


def test_prepare_leaves_no_lock_file(tmp_path: Path, corpus: Path) -> None:
    out = tmp_path / "shards"
    prepare([corpus], out, "bytes", progress=False)
    prepare([corpus], out, "bytes", progress=False)  # reused
    prepare([corpus], out, "bytes", progress=False, cache=False)  # rebuilt over the old one
    assert sorted(p.name for p in tmp_path.iterdir()) == [corpus.name, "shards"]
    Manifest.load(out).verify()


def test_a_lock_file_left_by_a_killed_holder_is_taken_and_removed(tmp_path: Path) -> None:
    out = tmp_path / "o"
    (tmp_path / ".o.lock").write_text("")  # what a process killed while holding the lock leaves
    with locked(out):
        assert (tmp_path / ".o.lock").exists()
    assert list(tmp_path.iterdir()) == []


_WORKER = """
import os, sys, time
from pathlib import Path
from gptoughts.data.cache import locked

out, log, go = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
(go.parent / f"ready-{os.getpid()}").touch()
while not go.exists():  # every worker starts its rounds together, once all are imported
    time.sleep(0.002)
for i in range(40):
    with locked(out):
        with open(log, "a") as f:
            f.write(f"in {os.getpid()}\\n")
            f.flush()
            time.sleep(0.003)
            f.write(f"out {os.getpid()}\\n")
"""


@pytest.mark.slow  # three processes taking the lock 40 times each: seconds on 2 cores
def test_concurrent_holders_are_serialised_while_the_lock_file_comes_and_goes(tmp_path: Path) -> None:
    """Three processes take the lock 40 times each; each holder removes the file as it leaves, so waiters keep
    finding their file gone: never two inside at once, and no lock file at the end."""
    out, log, go = tmp_path / "o", tmp_path / "log.txt", tmp_path / "go"
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(_WORKER))
    procs = [
        subprocess.Popen([sys.executable, str(script), str(out), str(log), str(go)], stderr=subprocess.PIPE)
        for _ in range(3)
    ]
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("ready-*"))) < len(procs) and time.monotonic() < deadline:
        time.sleep(0.01)
    go.touch()
    for p in procs:
        _, err = p.communicate(timeout=240)
        assert p.returncode == 0, err.decode()[-2000:]
    lines = log.read_text().splitlines()
    assert len(lines) == 3 * 40 * 2
    for enter, leave in zip(lines[::2], lines[1::2]):  # strictly alternating: in A, out A, in B, out B, ...
        assert enter.startswith("in ") and leave == "out " + enter[3:], lines
    assert not (tmp_path / ".o.lock").exists()


_PREPARE = """
import sys
from gptoughts.data.prepare import prepare
m = prepare([sys.argv[1]], sys.argv[2], "bytes", progress=False, workers=1)
print(m.train_tokens)
"""


def test_two_prepares_of_one_folder_build_it_once(tmp_path: Path, corpus: Path) -> None:
    out = tmp_path / "shards"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _PREPARE, str(corpus), str(out)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for _ in range(2)
    ]
    results = [p.communicate(timeout=240) for p in procs]
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 0, err.decode()[-2000:]
    assert results[0][0] == results[1][0]  # the same tokens, whichever built them
    Manifest.load(out).verify()
    assert sorted(p.name for p in tmp_path.iterdir()) == [corpus.name, "shards"]
