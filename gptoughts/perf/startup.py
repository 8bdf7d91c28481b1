"""Time from the command to the first finished training step, and its parts (no torch import: the CLI
starts this clock before anything heavy is imported)."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field

_IMPORTED_AT = time.time()


def process_age_s() -> float:
    """Seconds since this process started: Linux's ``/proc/self/stat`` start time (so Python's own start and
    the imports count), elsewhere since this module was imported."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])  # field 22 of stat(5); the two before the split are pid and comm
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time() - _IMPORTED_AT


_command_origin: float | None = None
_commands = 0


def mark_command() -> None:
    """The CLI calls this on entry: the first command of a process counts from the process's start (Python and
    the imports included); a later one (tests call the CLI in-process) from this call."""
    global _command_origin, _commands
    _command_origin = 0.0 if _commands == 0 else process_age_s()
    _commands += 1


def end_command() -> None:
    """The CLI calls this when a command returns: a command that trained nothing (``estimate``, a refused run)
    leaves no origin behind for a later API call in the same process to read as its own."""
    global _command_origin
    _command_origin = None


def startup_clock() -> float:
    """Process age at which this run's start-up clock starts: the command's (consumed once), else now (a
    Python API call: its imports are the caller's business)."""
    global _command_origin
    origin, _command_origin = _command_origin, None
    return process_age_s() if origin is None else origin


@dataclass
class Startup:
    """Time from the command to the first finished step, in parts: ``imports`` (Python, torch, gptoughts, up
    to the assembly), ``assembly`` (device, data cache check or preparation, tokenizer, model build, batch
    plan), ``first_step`` (compile and the first optimizer step, synchronized)."""

    imports_s: float
    assembly_s: float = 0.0
    first_step_s: float = 0.0
    origin: float = 0.0
    """Process age (:func:`process_age_s`) where the clock starts."""
    _made: tuple[float, float] = field(default_factory=lambda: (process_age_s(), time.monotonic()))
    """Process age and monotonic time when this was made: later readings use the monotonic clock (the process
    age has /proc's 10 ms resolution, which rounded a tiny model's first step to 0)."""

    def age(self) -> float:
        """Seconds on this run's start-up clock."""
        return self._made[0] + time.monotonic() - self._made[1] - self.origin

    @property
    def total_s(self) -> float:
        return self.imports_s + self.assembly_s + self.first_step_s

    def to_dict(self) -> dict[str, float]:
        return {
            "to_first_step_s": round(self.total_s, 3),
            "imports_s": round(self.imports_s, 3),
            "assembly_s": round(self.assembly_s, 3),
            "first_step_s": round(self.first_step_s, 3),
        }

    def line(self) -> str:
        return (
            f"first step done {self.total_s:.1f} s after the command (imports {self.imports_s:.1f} s, "
            f"data + model {self.assembly_s:.1f} s, compile + first step {self.first_step_s:.1f} s)"
        )

    def bytecode_hint(self, slow_s: float = 5.0) -> str:
        """One short line, once per cache folder (``$GPTOUGHTS_CACHE``), when a start-up slower than ``slow_s`` ran
        in a Python that writes no bytecode caches (``PYTHONDONTWRITEBYTECODE``, ``python -B``): every process then
        compiles the sources of torch, sympy and dynamo it imports again (seconds of every start-up:
        ``docs/performance.md``). "" otherwise."""
        if not sys.flags.dont_write_bytecode or self.total_s < slow_s:
            return ""
        from pathlib import Path

        # data.cache.default_cache_dir's rule (that module imports numpy; this one is read before anything heavy)
        cache = os.environ.get("GPTOUGHTS_CACHE")
        shown = (
            Path(cache).expanduser() if cache else Path.home() / ".cache" / "gptoughts"
        ) / "hint-bytecode"
        if shown.exists():
            return ""
        try:
            shown.parent.mkdir(parents=True, exist_ok=True)
            shown.touch()
        except OSError:  # a read-only cache: the hint again next time, rather than none
            pass
        return (
            "hint: PYTHONDONTWRITEBYTECODE is set, so each start recompiles torch: unset it to start faster"
        )
