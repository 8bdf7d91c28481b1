"""The run directory: what it holds, who may write it, and what may be removed from it.

* **One process per run directory.** :class:`RunLock` takes an exclusive ``flock`` on ``RUN/.lock`` before
  anything is read or written, and keeps it until the run ends. The kernel releases it when the process dies,
  so a crashed run never leaves a stale lock; a second ``train`` on the same ``--out`` is refused with the
  process that holds it.
* **A run is recognised by its run.json** (written by every run since the first version: it has ``family``);
  a folder with a ``checkpoints/`` subfolder alone is not a run, and ``--overwrite`` refuses folders that are
  not runs. :func:`clear` removes only what a run writes (:data:`RUN_FILES`), never anything else in the folder.
* **Nothing is destroyed by a refusal.** :func:`check` decides (resume, start, refuse) by reading only; a run
  whose every checkpoint is unusable is refused rather than restarted over them.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any

from gptoughts.config import Config, config_from_toml_text
from gptoughts.errors import ConfigError, UserError
from gptoughts.train import checkpoint as ckpt

# Everything a run writes at its top level (checkpoints/ holds only step_* folders, best.json and temp dirs).
RUN_FILES = (
    "config.toml",
    "run.json",
    "metrics.jsonl",
    "samples.txt",
    "summary.json",
    "tokenizer",
    "tensorboard",
    "plots",
    "profile",
    "wandb",
    "checkpoints",
)
LOCK_FILE = ".lock"


class RunLock:
    """An exclusive lock on a run directory, held for the life of the run."""

    def __init__(self, path: Path, handle: Any, created: bool) -> None:
        self.path, self.handle, self.created = path, handle, created

    @classmethod
    def acquire(cls, run_dir: Path) -> RunLock:
        created = not run_dir.exists()
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(
                f"cannot create the run directory {run_dir}: {e.strerror}; choose another --out"
            ) from None
        path = run_dir / LOCK_FILE
        handle = open(path, "a+", encoding="utf-8")  # noqa: SIM115 - held until release()
        try:
            import fcntl

            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except ImportError:  # no flock (Windows): no protection, but no refusal either
            pass
        except OSError:
            handle.seek(0)
            holder = _holder(handle.read())
            handle.close()
            raise UserError(
                f"{run_dir} is in use by {holder}; wait for it to finish, or choose another --out"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(
            json.dumps(
                {
                    "pid": os.getpid(),
                    "host": socket.gethostname(),
                    "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                    "command": " ".join(sys.argv[:1] + sys.argv[1:])[:300],
                }
            )
        )
        handle.flush()
        return cls(path, handle, created)

    def release(self) -> None:
        if self.handle is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        finally:
            self.handle.close()  # closing drops the flock
            self.handle = None
        run_dir = self.path.parent
        if self.created and run_dir.is_dir() and not any(run_dir.iterdir()):
            run_dir.rmdir()  # a run that failed before writing anything leaves no empty folder behind


def _holder(text: str) -> str:
    try:
        info = json.loads(text)
        return f"process {info['pid']} on {info['host']} (`{info['command']}`, started {info['started']})"
    except (ValueError, KeyError, TypeError):
        return "another process"


def is_run(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a gptoughts run (its run.json names a model family)."""
    try:
        return "family" in json.loads((run_dir / "run.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError):
        return (run_dir / "config.toml").is_file() and (run_dir / "tokenizer").is_dir()


def _foreign(run_dir: Path) -> list[str]:
    return (
        sorted(p.name for p in run_dir.iterdir() if p.name not in (*RUN_FILES, LOCK_FILE))
        if run_dir.is_dir()
        else []
    )


def read_run_json(run_dir: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((run_dir / "run.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def check(run_dir: Path, cfg: Config) -> tuple[Path | None, dict[str, Any] | None]:
    """What to do with ``run_dir``, deciding by reading only: ``(checkpoint to resume or None, the resumed
    run's run.json or None)``; a :class:`UserError` when the run must not start."""
    resume = cfg.run.resume
    if resume and resume != "auto":
        path = ckpt.resolve(resume)
        return path, read_run_json(path.parent.parent if path.parent.name == "checkpoints" else path.parent)
    present = [p for p in run_dir.iterdir() if p.name != LOCK_FILE] if run_dir.is_dir() else []
    if not is_run(run_dir):
        if present and cfg.run.overwrite:
            raise UserError(
                f"--overwrite replaces runs only, and {run_dir} is not a gptoughts run (it holds "
                f"{', '.join(sorted(p.name for p in present)[:4])}); choose another --out"
            )
        if present:
            raise UserError(f"{run_dir} exists and is not empty; choose another --out")
        return None, None
    if resume == "auto":
        old = _old_config(run_dir)
        if old is not None and (old.model.family, old.model.size, old.model.overrides) != (
            cfg.model.family,
            cfg.model.size,
            cfg.model.overrides,
        ):
            raise UserError(
                f"{run_dir} holds a run of model {old.model.family}/{old.model.size}; resuming it as "
                f"{cfg.model.family}/{cfg.model.size} is impossible; use another --out"
            )
        if old is not None and (old.model.init_from, old.lora.enabled) != (
            cfg.model.init_from,
            cfg.lora.enabled,
        ):
            raise UserError(
                f"{run_dir} fine-tunes {old.model.init_from} (LoRA {'on' if old.lora.enabled else 'off'})"
                f"; resume it with the same --model and --lora, or use another --out"
            )
        steps = ckpt.list_steps(run_dir / "checkpoints")
        found = ckpt.latest_valid(run_dir / "checkpoints")
        if steps and found is None:
            problems = "; ".join(
                f"step_{s:06d}: {ckpt.verify(ckpt.step_dir(run_dir / 'checkpoints', s))}" for s in steps[-3:]
            )
            raise UserError(
                f"every checkpoint of {run_dir} is unusable ({problems}); nothing was changed: restore "
                "one, or start over with --overwrite"
            )
        return found, read_run_json(run_dir)  # None: killed before its first checkpoint, started again
    if cfg.run.overwrite:
        return None, None
    steps = ckpt.list_steps(run_dir / "checkpoints")
    where = f" (checkpoints up to step {steps[-1]})" if steps else ""
    raise UserError(
        f"{run_dir} already holds a run{where}; pass --resume auto to continue it, --overwrite to "
        f"replace it, or choose another --out"
    )


def _old_config(run_dir: Path) -> Config | None:
    f = run_dir / "config.toml"
    if not f.exists():
        return None
    try:
        return config_from_toml_text(f.read_text(encoding="utf-8"))
    except (ConfigError, ValueError, OSError) as e:
        raise UserError(
            f"{f} is corrupt ({str(e).splitlines()[0]}); restore it or start over with another --out"
        ) from None


def check_tokenizer(run_dir: Path, tokenizer: Any, cfg: Config) -> None:
    """A resumed run must tokenize as it did: say why it would not, and the fix that works."""
    from gptoughts.data.tokenizer import Tokenizer
    from gptoughts.errors import DataError

    try:
        saved = Tokenizer.load(run_dir / "tokenizer")
    except (DataError, ValueError, OSError, Exception) as e:  # noqa: BLE001 - a corrupt file, whatever raised
        raise UserError(
            f"{run_dir}/tokenizer is corrupt ({str(e).splitlines()[0][:120]}); restore it from a copy "
            "(the run's model depends on its exact vocabulary)"
        ) from None
    if saved.fingerprint() == tokenizer.fingerprint():
        return
    old = _old_config(run_dir)
    cause = (
        "the corpus differs from the one the run started on (edited, added or removed files), so the BPE "
        "trained on it differs"
    )
    if old is not None and old.data.tokenizer != cfg.data.tokenizer:
        cause = f"the run used --tokenizer {old.data.tokenizer}, this command asks for {cfg.data.tokenizer}"
    elif old is not None and old.train.seed != cfg.train.seed:
        cause = (
            f"the run's seed was {old.train.seed} and this command's is {cfg.train.seed} (the seed picks the "
            "held-out documents, which the BPE is not trained on)"
        )
    elif old is not None and (old.data.max_bytes, old.data.val_fraction) != (
        cfg.data.max_bytes,
        cfg.data.val_fraction,
    ):
        cause = "data.max_bytes or data.val_fraction changed, so the BPE was trained on other text"
    raise UserError(
        f"the tokenizer built now differs from {run_dir}/tokenizer: {cause}; resume with the run's own "
        f"settings, or keep its vocabulary with --tokenizer {run_dir}/tokenizer"
    )


def clear(run_dir: Path) -> None:
    """Remove what a run wrote (:data:`RUN_FILES`; inside checkpoints/ only checkpoints), nothing else."""
    for name in RUN_FILES:
        p = run_dir / name
        if name == "checkpoints" and p.is_dir():
            for child in p.iterdir():
                if (
                    ckpt.STEP_DIR.match(child.name)
                    or child.name == "best.json"
                    or child.name.startswith(".tmp-")
                ):
                    shutil.rmtree(child) if child.is_dir() else child.unlink()
            if not any(p.iterdir()):
                p.rmdir()
        elif p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to a temp file beside ``path``, fsync, rename: a reader sees the old or the new file."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
