"""User-facing errors.

Anything a user can cause (bad path, bad config, bad data, missing hardware) raises a ``UserError`` whose
message is one line naming the problem and the fix. ``gptoughts.cli.main`` prints it without a traceback and
exits with status 2. Any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import difflib
import errno
import os
import re
from collections.abc import Iterable
from pathlib import Path


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


def first_line(e: BaseException, limit: int = 300) -> str:
    """``e``'s message cut to its first line (its type's name when it has none): an error told as a warning."""
    lines = str(e).strip().splitlines()
    return lines[0][:limit] if lines else type(e).__name__


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
# How an OS error code reads in a message: Rust's io::Error, and Python's OSError turned into text (an error
# carried from another thread or rank as a string).
_OS_ERROR_TEXT = re.compile(r"\(os error (\d+)\)|\[Errno (\d+)\]")


# torch's zip writer, writing to a path (torch.save, DCP's shards), says only this when a write comes up short.
_SHORT_WRITE = "unexpected pos"
_NEARLY_FULL = 2**30
"""Free bytes under which a short write in a folder is taken for a full disk."""


def as_disk_full(e: BaseException, filename: object = None, folder: object = None) -> OSError | None:
    """``e`` as an ``OSError(ENOSPC or EDQUOT)`` when a full disk (or quota) caused it, else None.

    Libraries report a full disk in their own ways: torch's writer to a Python file raises a RuntimeError
    ("unexpected pos") whose context holds Python's OSError, to a path the same RuntimeError alone (then, with
    ``folder``, the folder's free space decides); the Rust of ``tokenizers`` and ``safetensors`` raises a plain
    Exception whose message ends in "(os error 28)"; an error passed on as text says "[Errno 28]".
    ``filename`` (default: the OSError's) names what was being written."""
    seen: set[int] = set()
    short = False
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        code = e.errno if isinstance(e, OSError) else None
        if code is None and (m := _OS_ERROR_TEXT.search(str(e))):
            code = int(m.group(1) or m.group(2))
        if code in DISK_FULL:
            name = filename if filename is not None else getattr(e, "filename", None)
            return OSError(code, os.strerror(code), *([str(name)] if name is not None else []))
        short = short or _SHORT_WRITE in str(e)
        e = e.__cause__ or e.__context__
    if short and folder is not None and _free_bytes(folder) < _NEARLY_FULL:
        name = filename if filename is not None else folder
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(name))
    return None


def _free_bytes(folder: object) -> int:
    import shutil

    path = Path(str(folder))
    while not path.exists() and path != path.parent:  # the temp folder may be gone already
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return _NEARLY_FULL
