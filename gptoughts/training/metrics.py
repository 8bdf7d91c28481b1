"""Metrics sinks (JSONL, TensorBoard, wandb) and the progress bar. Everything here runs on rank 0 only."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)

from gptoughts.errors import UserError

# soft_wrap: long lines (the run plan, paths) are not cut at 80 columns when the output is a file or a pipe
console = Console(stderr=False, soft_wrap=True)


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them visible
    return value


class MetricsLogger:
    """Writes one JSON object a line to ``metrics.jsonl``, mirrors scalars to TensorBoard and wandb."""

    def __init__(
        self,
        run_dir: Path,
        *,
        enabled: bool,
        tensorboard: bool = True,
        wandb: bool = False,
        wandb_project: str = "gptoughts",
        config: dict | None = None,
        resume_step: int | None = None,
    ):
        self.enabled = enabled
        self.tb = None
        self.wandb = None
        if not enabled:
            return
        self.path = run_dir / "metrics.jsonl"
        if resume_step is not None and self.path.exists():
            # Lines written after the checkpoint we resume from describe steps that will be run again.
            kept = [
                ln for ln in self.path.read_text().splitlines() if ln.strip() and _step_of(ln) <= resume_step
            ]
            self.path.write_text("".join(ln + "\n" for ln in kept))
        if resume_step is not None:  # the samples of those steps too: they are generated again
            _drop_samples_after(run_dir / "samples.txt", resume_step)
        self.file = open(self.path, "a", buffering=1)
        if tensorboard:
            # Events of the steps after the checkpoint are dropped as above; the checkpoint's own step was logged
            # before it was saved and is not run again (purging from it lost its scalars).
            self._open_tensorboard(run_dir, resume_step)
        if wandb:
            self.wandb = _start_wandb(run_dir, wandb_project, config)

    def _open_tensorboard(self, run_dir: Path, after_step: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step writes a session start at that step: TensorBoard then drops every event of a later step it
        # read before (the steps run again after a resume or a rollback would otherwise draw a second curve).
        purge = after_step + 1 if after_step is not None else None
        self.tb = SummaryWriter(str(run_dir / "tensorboard"), purge_step=purge)

    def rewind(self, step: int) -> None:
        """A rollback to the checkpoint of ``step``: TensorBoard and samples.txt forget the steps after it, which
        are run again. metrics.jsonl keeps their rows; the rollback's own row (logged next, at ``step``) marks
        where the re-run begins, and the plots keep the last value written for each step."""
        if not self.enabled:
            return
        _drop_samples_after(self.path.parent / "samples.txt", step)
        if self.tb is not None:
            self.tb.close()
            self._open_tensorboard(self.path.parent, step)

    def log(self, step: int, values: dict[str, Any]) -> None:
        if not self.enabled:
            return
        row = {"step": step, "time": round(time.time(), 3), **{k: _clean(v) for k, v in values.items()}}
        self.file.write(json.dumps(row) + "\n")
        event = values.get("event")
        if event is not None:
            # An event (a rollback, a spike, a curriculum phase) is a line of text: its numbers are no training
            # series (a rollback's skipped_steps counts the steps it undid, not those a window skipped).
            text = ", ".join(f"{k}: {_clean(v)}" for k, v in values.items() if k != "event")
            if self.tb is not None:
                self.tb.add_text(f"events/{event}", text, step)
            if self.wandb is not None:
                self.wandb.log({f"events/{event}": text}, step=step)
            return
        for k, v in values.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                if self.tb is not None:
                    self.tb.add_scalar(k if "/" in k else f"train/{k}", v, step)
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in values.items() if isinstance(v, (int, float))}, step=step)

    def text(self, tag: str, text: str, step: int) -> None:
        if not self.enabled:
            return
        if self.tb is not None:
            self.tb.add_text(tag, "```\n" + text + "\n```", step)
        if self.wandb is not None:
            self.wandb.log({tag: text}, step=step)

    def close(self) -> None:
        if not self.enabled:
            return
        self.file.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def check_wandb() -> None:
    """Before a run writes anything: --wandb needs the package."""
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise UserError("--wandb needs the wandb package: pip install 'gptoughts[wandb]'") from None


def _has_wandb_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        import netrc

        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def _start_wandb(run_dir: Path, project: str, config: dict | None) -> Any:
    """wandb online when a key is configured, offline (with a note) when not; a wandb that fails to start costs
    one line, never the run."""
    import wandb as wandb_mod

    mode = os.environ.get("WANDB_MODE")
    if not mode and not _has_wandb_key():
        mode = "offline"
        console.print(
            f"note: no wandb API key (`wandb login` or WANDB_API_KEY): logging offline to {run_dir}/wandb; "
            f"`wandb sync {run_dir}/wandb/offline-run-*` uploads it later",
            highlight=False,
        )
    try:
        return wandb_mod.init(
            project=project,
            dir=str(run_dir),
            config=config,
            name=run_dir.name,
            resume="allow",
            mode=mode or None,
        )
    except Exception as e:  # noqa: BLE001 - network, auth, service: the run goes on without wandb
        console.print(
            f"note: wandb could not start ({type(e).__name__}: {str(e).splitlines()[0][:150]}); "
            "training without it (metrics.jsonl and TensorBoard still log)",
            highlight=False,
        )
        return None


def _drop_samples_after(path: Path, step: int) -> None:
    """Cut samples.txt (``=== step N`` sections) before its first section of a step after ``step`` (in place, the
    bytes before it untouched)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return
    offset = 0
    for line in data.split(b"\n"):
        if line.startswith(b"=== step ") and line[9:].strip().isdigit() and int(line[9:]) > step:
            os.truncate(path, offset)
            return
        offset += len(line) + 1


def _step_of(line: str) -> int:
    try:
        return int(json.loads(line).get("step", 0))
    except ValueError:
        return 1 << 62


def format_eta(seconds: float) -> str:
    s = int(max(0.0, seconds))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}"


class ProgressBar:
    """A rich progress bar (step/total, loss, lr, tokens/s, ETA) on a terminal; plain log lines otherwise."""

    def __init__(self, total: int, start: int, *, enabled: bool):
        self.enabled = enabled
        self.interactive = enabled and sys.stdout.isatty()
        self.progress = None
        if self.interactive:
            # The ETA is ours (remaining tokens / measured tokens/s at each log): rich's own column estimates speed
            # from updates of the last 30 s, and a log interval longer than that left it at -:--:-- for good.
            self.progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}  lr {task.fields[lr]}  {task.fields[tps]} tok/s"),
                TimeElapsedColumn(),
                TextColumn("eta {task.fields[eta]}"),
                console=console,
                transient=False,
            )
            self.task = self.progress.add_task(
                "train", total=total, completed=start, loss="-", lr="-", tps="-", eta="-"
            )
            self.progress.start()

    def update(
        self,
        step: int,
        *,
        loss: float | None = None,
        lr: float | None = None,
        tps: float | None = None,
        eta_s: float | None = None,
        line: str | None = None,
    ) -> None:
        if not self.enabled:
            return
        if self.progress is not None:
            fields = {}
            if loss is not None:
                fields["loss"] = f"{loss:.4f}"
            if lr is not None:
                fields["lr"] = f"{lr:.2e}"
            if tps is not None:
                fields["tps"] = f"{tps:,.0f}"
            if eta_s is not None:
                fields["eta"] = format_eta(eta_s)
            self.progress.update(self.task, completed=step, **fields)
        elif line is not None:
            console.print(line, highlight=False)

    def print(self, text: str) -> None:
        if self.enabled:
            console.print(text, highlight=False)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
