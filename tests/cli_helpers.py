"""Helpers of the tests that run the CLI as a user types it (test_readme, test_user_path, test_never_lose_a_run).

Imported by name (``from cli_helpers import ...``): pytest puts this folder on sys.path for the tests beside it.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from gptoughts import cli

GIB = 2**30
HOST_GIB = 100.0  # a workstation's RAM, as MemAvailable reports it

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
    m = re.search(
        r"plan: (\w+)/(\w+)(?: resized \([^)]*\))?, ([\d,]+) parameters", text
    )  # (what it changed of the size)
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
    """Every file under ``folder`` by its SHA-256, and every folder (an empty one made or removed counts too):
    what a refusal must leave as it was."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "folder"
        for p in sorted(folder.rglob("*"))
        if p.is_file() or p.is_dir()
    }


def refused_leaving(folder: Path, argv: list[str], capsys, *needles: str) -> str:
    """``refused(argv, capsys, *needles)``, which must also leave every file under ``folder`` as it was: none
    changed, added or removed. The error line."""
    before = snapshot(folder)
    line = refused(argv, capsys, *needles)
    after = snapshot(folder)
    # named, not a bare dict: pytest does not rewrite the asserts of this module into a diff
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert not changed, f"refused, but gptoughts {argv[0]} changed under {folder}: {changed}"
    return line


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


def h100(cap_gib: float):
    """An H100's profile whose memory is ``cap_gib`` (what ``--gpu_memory_gib`` makes of it)."""
    from gptoughts.perf import hardware

    p = hardware.HardwareProfile(device="cuda:0", name="NVIDIA H100 80GB HBM3", arch="hopper",
                                 compute_capability=(9, 0), memory_bytes=int(cap_gib * GIB), gpu_count=1, cpu_count=2,
                                 peak_bf16_flops=989e12, bf16=True, fp16=True, fp8=True, compile=True)  # fmt: skip
    p.recommended = hardware.recommend(p)
    return p


def pretend_gpu(monkeypatch, gpu_gib: float = 80) -> None:
    """Runs on this CPU machine see one H100 of ``gpu_gib`` (the run's --gpu_memory_gib caps it further), and a
    host with HOST_GIB available. Only what a dry run touches is pretended: nothing is allocated on it."""
    import torch

    from gptoughts.perf import hardware
    from gptoughts.training.checkpoint import staging

    monkeypatch.setattr(hardware, "resolve_device", lambda requested="auto": torch.device("cuda", 0))
    monkeypatch.setattr(hardware, "apply_runtime_settings", lambda *a, **k: None)
    monkeypatch.setattr(hardware, "detect", lambda device="auto": h100(gpu_gib))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(staging, "host_memory_available", lambda: int(HOST_GIB * GIB))
    # PyTorch's CUDA wheels ship Triton: INL's kernels would run there (the CPU wheels have none)
    from gptoughts.models import inl_triton

    monkeypatch.setattr(
        inl_triton, "_hidden_fits", lambda hidden: 16 <= hidden <= 256 and not hidden & (hidden - 1)
    )


def signal_during_step(monkeypatch, step: int) -> None:
    """SIGTERM as the trainer's handler receives it, during training step ``step`` (1-based)."""
    import signal

    from gptoughts.training.trainer import Trainer

    original = Trainer.train_step

    def train_step(self):
        out = original(self)
        if self.state.step + 1 == step:
            self._on_signal(signal.SIGTERM, None)
        return out

    monkeypatch.setattr(Trainer, "train_step", train_step)
