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
    TimeRemainingColumn,
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

    def __init__(self, run_dir: Path, *, enabled: bool, tensorboard: bool = True, wandb: bool = False,
                 wandb_project: str = "gptoughts", config: dict | None = None, resume_step: int | None = None):
        self.enabled = enabled
        self.tb = None
        self.wandb = None
        if not enabled:
            return
        self.path = run_dir / "metrics.jsonl"
        if resume_step is not None and self.path.exists():
            # Lines written after the checkpoint we resume from describe steps that will be run again.
            kept = [ln for ln in self.path.read_text().splitlines() if ln.strip() and _step_of(ln) <= resume_step]
            self.path.write_text("".join(ln + "\n" for ln in kept))
        self.file = open(self.path, "a", buffering=1)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tensorboard"), purge_step=resume_step)
        if wandb:
            try:
                import wandb as wandb_mod
            except ImportError:
                raise UserError("--wandb needs the wandb package: pip install 'gptoughts[wandb]'") from None
            mode = os.environ.get("WANDB_MODE")
            self.wandb = wandb_mod.init(project=wandb_project, dir=str(run_dir), config=config,
                                        name=run_dir.name, resume="allow", mode=mode or None)

    def log(self, step: int, values: dict[str, Any]) -> None:
        if not self.enabled:
            return
        row = {"step": step, "time": round(time.time(), 3), **{k: _clean(v) for k, v in values.items()}}
        self.file.write(json.dumps(row) + "\n")
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


def _step_of(line: str) -> int:
    try:
        return int(json.loads(line).get("step", 0))
    except ValueError:
        return 1 << 62


class ProgressBar:
    """A rich progress bar (step/total, loss, lr, tokens/s, ETA) on a terminal; plain log lines otherwise."""

    def __init__(self, total: int, start: int, *, enabled: bool):
        self.enabled = enabled
        self.interactive = enabled and sys.stdout.isatty()
        self.progress = None
        if self.interactive:
            self.progress = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}  lr {task.fields[lr]}  {task.fields[tps]} tok/s"),
                TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), console=console, transient=False,
            )
            self.task = self.progress.add_task("train", total=total, completed=start, loss="-", lr="-", tps="-")
            self.progress.start()

    def update(self, step: int, *, loss: float | None = None, lr: float | None = None, tps: float | None = None,
               line: str | None = None) -> None:
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
            self.progress.update(self.task, completed=step, **fields)
        elif line is not None:
            console.print(line, highlight=False)

    def print(self, text: str) -> None:
        if self.enabled:
            console.print(text, highlight=False)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
