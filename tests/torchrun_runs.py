"""Several `gptoughts` commands in ONE torchrun launch: each worker runs them in turn, in the process group it
joined once. A launch (start-up, ``import torch``, the gloo rendezvous) costs ~5-8 s on 2 CPU cores, several times
what a debug run trains; the tests that compare settings on several ranks pay it once.

From a test: ``outputs = launch([argv, argv, ...], nproc=2, tmp=...)`` gives each command's rank-0 stdout (every
command must exit 0). The launch itself is ``python -m torch.distributed.run ... tests/torchrun_runs.py RUNS.json``.
What stays one launch per command: the tests of the launch itself (README's torchrun lines, ``-m gptoughts``, a
refusal's exit code). The one-process references these runs are compared with train in the test's own process
(:func:`here`): the same ``gptoughts`` command without a process start.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

MARK = "=== torchrun_runs: command "


def launch(
    runs: list[list[str]],
    *,
    nproc: int = 2,
    tmp: Path,
    env: dict[str, str] | None = None,
    plots: bool = False,
    timeout: int = 600,
) -> list[str]:
    """Run each ``gptoughts ARGV`` of ``runs`` in turn in one ``torchrun --nproc_per_node=nproc`` launch; the
    rank-0 stdout of each (the launch fails the test on any non-zero exit, with its stderr). ``plots``: draw
    each run's plots/ (skipped otherwise, as tests/conftest.py does in the test process)."""
    spec = tmp / "torchrun_runs.json"
    spec.write_text(json.dumps({"runs": runs, "plots": plots}), encoding="utf-8")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           __file__, str(spec)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    parts = r.stdout.split(MARK)[1:]
    assert [int(p.split("\n", 1)[0]) for p in parts] == list(range(len(runs))), r.stdout[-3000:]
    return [p.split("\n", 1)[1] for p in parts]


def process(argv: list[str], *, procs: int = 1, timeout: int = 300) -> subprocess.CompletedProcess:
    """``gptoughts ARGV`` as a process of its own (under torchrun with ``procs`` > 1): for the tests of the
    process itself (an exit code, a refusal's one line). The test's environment, read now (its GPTOUGHTS_CACHE
    included), one thread."""
    launcher = (
        ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}"] if procs > 1 else []
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, *launcher, "-m", "gptoughts", *argv]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def by_rank(argvs: list[list[str]], *, tmp: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    """``gptoughts ARGV`` under torchrun, each rank with its own (``argvs[rank]``, one process each): a launch in
    which a rank alone sees an error. The process itself, as :func:`process` gives it."""
    spec = tmp / "torchrun_by_rank.json"
    spec.write_text(json.dumps({"by_rank": argvs}), encoding="utf-8")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={len(argvs)}",
           __file__, str(spec)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def ok(r: subprocess.CompletedProcess) -> None:
    assert r.returncode == 0, r.stderr[-3000:]


def here(argv: list[str], env: dict[str, str] | None = None, *, plots: bool = False) -> str:
    """``gptoughts ARGV`` in this process, which must exit 0: its stdout. Usable from a module-scoped fixture: it
    runs in an empty folder of its own, with ``env`` set for the call, and leaves the logger, the environment and
    the working directory as it found them. ``plots``: draw the run's plots/ (skipped otherwise, as in a launch)."""
    from gptoughts import cli
    from gptoughts.training import plots as plotting

    log = logging.getLogger("gptoughts")
    saved_log = (list(log.handlers), log.level, log.propagate)
    saved_env = dict(os.environ)
    cwd = os.getcwd()
    out, err = io.StringIO(), io.StringIO()
    draw = plotting.write_run_plots
    if not plots:
        plotting.write_run_plots = lambda run_dir, *args, **kwargs: []
    try:
        with tempfile.TemporaryDirectory() as empty:
            os.chdir(empty)
            os.environ.update(env or {})
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = cli.main(list(argv))
    finally:
        plotting.write_run_plots = draw
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        log.handlers[:], log.level, log.propagate = saved_log
    assert code == 0, (
        f"gptoughts {' '.join(argv)} exited {code}: {out.getvalue()[-1500:]}{err.getvalue()[-3000:]}"
    )
    return out.getvalue()


def _worker(path: str) -> int:
    from gptoughts import cli
    from gptoughts.parallel import dist as pdist

    spec = json.loads(Path(path).read_text(encoding="utf-8"))
    if "by_rank" in spec:
        return cli.main(spec["by_rank"][int(os.environ["RANK"])])
    runs = spec["runs"]
    if not spec["plots"]:
        from gptoughts.training import plots

        plots.write_run_plots = lambda run_dir, *args, **kwargs: []
    rank0 = os.environ.get("RANK", "0") == "0"
    shutdown = pdist.shutdown
    pdist.shutdown = lambda: None  # the group stays joined for the next command; left once, at the end
    try:
        for i, argv in enumerate(runs):
            if rank0:
                print(f"{MARK}{i}", flush=True)
            code = cli.main(argv)
            sys.stdout.flush()
            if code:
                print(f"command {i} exited {code}: gptoughts {' '.join(argv)}", file=sys.stderr, flush=True)
                return code
    finally:
        pdist.shutdown = shutdown
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1]))
