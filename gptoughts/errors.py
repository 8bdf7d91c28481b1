"""User-facing errors.

Anything a user can cause (bad path, bad config, bad data, missing hardware) raises a ``UserError`` whose
message is one line naming the problem and the fix. ``gptoughts.cli.main`` prints it without a traceback and
exits with status 2. Any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class UserError(Exception):
    """A mistake in what the user asked for; the message says what and how to fix it."""


class ConfigError(UserError):
    """An invalid configuration: unknown key, wrong type, impossible value."""


class DataError(UserError):
    """A corpus that cannot be used: missing, empty, binary, too small."""


class HardwareError(UserError):
    """A feature the current machine cannot run (fp8 without Hopper/Ada, CUDA without a GPU)."""


def closest(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate closest to ``name`` (for "did you mean" hints), or None when nothing is close."""
    matches = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.5)
    return matches[0] if matches else None


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """' (did you mean `x`?)' when a close candidate exists, else a list of the valid names."""
    candidates = sorted(candidates)
    best = closest(name, candidates)
    if best is not None:
        return f" (did you mean `{best}`?)"
    shown = ", ".join(candidates[:12]) + (", ..." if len(candidates) > 12 else "")
    return f" (valid: {shown})"
