"""The README's two commands in order, as a newcomer runs them: train first, then the tests, in one checkout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _fresh_copy(dest: Path) -> Path:
    """The checkout's tracked files (what a clone holds), or the source tree where this is not a git checkout."""
    try:
        files = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout.split(b"\0")
    except (OSError, subprocess.CalledProcessError):
        shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns("runs", ".git", "__pycache__"))
        return dest
    for name in filter(None, files):
        src = ROOT / name.decode()
        if src.is_file():
            (dest / name.decode()).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name.decode())
    return dest


@pytest.mark.slow
def test_tests_pass_after_the_quickstart_wrote_its_run_in_the_checkout(tmp_path):
    """`gptoughts train` leaves runs/quickstart in the checkout; the test command that follows must not see it."""
    repo = _fresh_copy(tmp_path / "clone")
    env = {**os.environ, "PYTHONPATH": str(repo), "GPTOUGHTS_CACHE": str(tmp_path / "cache")}
    first = subprocess.run(
        [sys.executable, "-m", "gptoughts", "train", "--max_steps", "2", "--threads", "1", "--no_progress"],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
    )
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    assert (repo / "runs" / "quickstart" / "run.json").is_file()
    tests = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "tests/test_user_path.py::test_bare_train_is_the_quickstart_and_says_so",
            "tests/test_config.py",
        ],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
    )
    assert tests.returncode == 0, tests.stdout[-3000:]
    assert " passed" in tests.stdout and "failed" not in tests.stdout
