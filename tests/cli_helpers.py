"""Helpers of the tests that run the CLI as a user types it (test_readme, test_user_path, test_never_lose_a_run).

Imported by name (``from cli_helpers import ...``): pytest puts this folder on sys.path for the tests beside it.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from gptoughts import cli

# Settings that keep a training run to a second or two on 2 CPU cores.
FAST = {
    "model.family": "llama",
    "model.size": "debug",
    "data.tokenizer": "bytes",
    "train.block_size": 32,
    "train.batch_size": 4,
    "train.grad_accum": 1,
    "train.eval_batches": 2,
    "train.sample_max_new_tokens": 8,
    "train.sample_prompts": ["def "],
    "train.warmup_steps": 2,
    "perf.device": "cpu",
    "perf.precision": "fp32",
    "perf.compile": False,
    "perf.threads": 1,
    "run.progress": False,
    "run.tensorboard": False,
}

# Added to a training command run in a test: CPU, one thread, quiet, short evaluations and samples. None of them
# changes what the command builds or reads.
QUIET_CPU = ["--device", "cpu", "--threads", "1", "--no_progress", "--run.tensorboard", "false", "--eval_batches", "2",
             "--sample_max_new_tokens", "4"]  # fmt: skip
# ...and small batches of short blocks, for the tests' own commands.
FASTRUN = [*QUIET_CPU, "--block_size", "32", "--batch_size", "2"]


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    """``gptoughts ARGV`` in this process: (exit code, stdout + stderr)."""
    code = cli.main(argv)
    out = capsys.readouterr()
    return code, out.out + out.err


def ok(argv: list[str], capsys) -> str:
    """``gptoughts ARGV``, which must succeed without a traceback; its output."""
    code, text = run_cli(argv, capsys)
    assert code == 0, f"{argv} exited {code}: {text[-2000:]}"
    assert "Traceback" not in text, text[-2000:]
    return text


def plan_of(text: str) -> tuple[str, str, int]:
    """(family, size, parameters) of the run plan a command printed."""
    m = re.search(r"plan: (\w+)/(\w+), ([\d,]+) parameters", text)
    assert m, text[-1500:]
    return m.group(1), m.group(2), int(m.group(3).replace(",", ""))


def refused(argv: list[str], capsys, *needles: str) -> str:
    """``gptoughts ARGV``, which must be refused in one line (exit 2, no traceback) holding every needle; the line."""
    code, text = run_cli(argv, capsys)
    assert code == 2, text[-2000:]
    assert "Traceback" not in text, text[-2000:]
    errors = [ln for ln in text.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, text[-2000:]
    for n in needles:
        assert n in errors[0], errors[0]
    return errors[0]


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` by its SHA-256: what a refusal must leave as it was."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def disk_full_at_state_file(monkeypatch) -> None:
    """Every checkpoint write from now on finds the disk full when it flushes the optimizer state file."""
    import errno

    from gptoughts.training.checkpoint import store as ckpt

    real = ckpt._fsync_file

    def full(path):
        if path.name == ckpt.STATE_FILE:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path)

    monkeypatch.setattr(ckpt, "_fsync_file", full)
