"""The run directory: what it holds, who may write it, and what may be removed from it.

* **One process per run directory.** :class:`RunLock` takes an exclusive ``flock`` on ``RUN/.lock`` before
  anything is read or written, and keeps it until the run ends. The kernel releases it when the process dies,
  so a crashed run never leaves a stale lock; a second ``train`` on the same ``--out`` is refused with the
  process that holds it.
* **A run is recognised by its run.json** (written first by every run: it has ``family`` and ``args``); files named like a run's (``config.toml``, ``tokenizer/``, ``checkpoints/``) do not
  make one, and ``--overwrite`` refuses folders that are not runs. :func:`clear` removes only what a run writes
  (:data:`RUN_FILES`), never anything else in the folder, and never follows a symlink out of it.
* **Nothing is destroyed by a refusal.** :func:`check` decides (resume, start, refuse) by reading only; a run
  whose every checkpoint is unusable is refused rather than restarted over them, ``--resume auto`` where
  there is no run is refused rather than started as a new one, and ``--resume PATH`` into a folder that holds
  another run is refused rather than mixed into it (its own run's folder, a new or an empty one take it).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any

from gptoughts.config import Config, config_from_toml_text
from gptoughts.data.sources import is_run_folder, read_json_dict
from gptoughts.errors import ConfigError, UserError
from gptoughts.training.checkpoint import store as ckpt

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
    """Whether ``run_dir`` holds a gptoughts run: its run.json is one that gptoughts wrote (family and args; the
    corpus walk skips such folders by the same test)."""
    return is_run_folder(run_dir)


def read_run_json(run_dir: Path) -> dict[str, Any] | None:
    return read_json_dict(run_dir / "run.json")


def check(run_dir: Path, cfg: Config) -> tuple[Path | None, dict[str, Any] | None]:
    """What to do with ``run_dir``, deciding by reading only: ``(checkpoint to resume or None, the resumed
    run's run.json or None)``; a :class:`UserError` when the run must not start."""
    resume = cfg.run.resume
    if resume and resume != "auto":
        return _check_checkpoint(run_dir, cfg, ckpt.resolve(resume))
    if resume == "auto":
        return _check_resume(run_dir, cfg)
    present = _contents(run_dir)
    if not is_run(run_dir):
        if present and cfg.run.overwrite:
            raise UserError(
                f"--overwrite replaces runs only, and {run_dir} is not a gptoughts run (it holds "
                f"{', '.join(present[:4])}); choose another --out"
            )
        if present:
            raise UserError(f"{run_dir} exists and is not empty; choose another --out")
        return None, None
    if cfg.run.overwrite:
        return None, None
    raise UserError(
        f"{run_dir} already holds a run{_up_to(run_dir)}; pass --resume auto to continue it, --overwrite to "
        f"replace it, or choose another --out"
    )


def _up_to(run_dir: Path) -> str:
    """`` (checkpoints up to step N)`` of a run folder, for the refusals that name it."""
    steps = ckpt.list_steps(run_dir / "checkpoints")
    return f" (checkpoints up to step {steps[-1]})" if steps else ""


def _check_same_model(old: Config, cfg: Config, subject: str, fix: str) -> None:
    """A checkpoint resumes only into the model it was saved from (``subject``: "RUN holds" or "CHECKPOINT was
    saved from", for the message): the same architecture, and the same base model and LoRA switch."""
    changed = architecture_changes(old, cfg)
    if changed:
        raise UserError(
            f"{subject} a model of another architecture than this command's ({'; '.join(changed)}): a checkpoint "
            f"resumes only into the model it was saved from; {fix}"
        )
    if (old.model.init_from, old.lora.enabled) != (cfg.model.init_from, cfg.lora.enabled):
        base = (
            f"a fine-tune of {old.model.init_from}" if old.model.init_from else "a model trained from scratch"
        )
        raise UserError(
            f"{subject} {base} (LoRA {'on' if old.lora.enabled else 'off'}); resume it with the same --model and "
            f"--lora, or {fix}"
        )


def _check_resume(run_dir: Path, cfg: Config) -> tuple[Path | None, dict[str, Any] | None]:
    """``--resume auto``: the newest usable checkpoint of the run in ``run_dir`` (None: the run stopped before
    its first one, and starts again from step 0 on its own config.toml, which ``cfg`` was loaded from)."""
    check_resumable(run_dir)
    old = _old_config(run_dir)
    _check_same_model(old, cfg, f"{run_dir} holds", "drop those flags, or use another --out")
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
    if found is not None:  # (a run with no checkpoint yet restarts from step 0: any optimizer will do)
        _check_optimizer(found, old.train.optimizer, cfg, True)
    return found, read_run_json(run_dir)


def _check_checkpoint(run_dir: Path, cfg: Config, path: Path) -> tuple[Path | None, dict[str, Any] | None]:
    """``--resume PATH``: checkpoint ``path`` resumes into its own run's folder, or branches into a new or empty
    one; never into a folder that holds another run (its checkpoints and metrics would mix with this one's)."""
    home = ckpt.run_of(path)
    own = home is not None and home.resolve() == run_dir.resolve()
    if not own:
        if is_run(run_dir):
            raise UserError(
                f"{run_dir} already holds another run{_up_to(run_dir)}, and {path} is not one of its checkpoints; "
                f"continue that run with --resume auto, or resume {path} into a new or empty --out"
                + (" (--overwrite does not replace a run by another's resume)" if cfg.run.overwrite else "")
            )
        present = _contents(run_dir)
        if present:
            raise UserError(
                f"{run_dir} exists and is not empty (it holds {', '.join(present[:4])}); resume {path} into a "
                "new or empty --out"
            )
    source = home if home is not None else path.parent
    if (source / "config.toml").is_file():
        old = _old_config(source)
        _check_same_model(
            old, cfg, f"{path} was saved from", f"give the model flags of its run ({source}/config.toml)"
        )
        _check_optimizer(path, old.train.optimizer, cfg, True)
    else:  # a checkpoint moved out of its run: its weights' shapes are checked as they load
        from gptoughts.training.checkpoint.restore import saved_optimizer

        _check_optimizer(path, saved_optimizer(path), cfg, False)
    return path, read_run_json(source)


def _check_optimizer(path: Path, was: str | None, cfg: Config, in_run: bool) -> None:
    """A checkpoint's optimizer state loads only into the optimizer that wrote it (``was``; None: unknown), whose
    groups it has: refused here, before the model is built, rather than by torch as it loads. ``in_run``: the
    checkpoint is beside its run's files, which ``gptoughts export`` needs."""
    asked = cfg.train.optimizer
    if was is not None and was != asked:
        new_run = (
            f", or train its weights with {asked} as a new run: `gptoughts export {path} --format hf OUT`, then "
            f"`gptoughts finetune --model OUT --optimizer {asked}`"
            if in_run
            else ""
        )
        raise UserError(
            f"{path} holds the state of the {was} optimizer and this command asks for --optimizer {asked}; "
            f"resume with --optimizer {was}{new_run}"
        )


def _contents(run_dir: Path) -> list[str]:
    """The names in ``run_dir`` (sorted; the lock file of a process that held it is not content)."""
    return sorted(p.name for p in run_dir.iterdir() if p.name != LOCK_FILE) if run_dir.is_dir() else []


def check_resumable(run_dir: Path) -> None:
    """``--resume auto`` needs a run to resume: refused, by reading only, where ``run_dir`` holds none (a new run
    there is started without --resume, never silently in its place) or has lost the config.toml it resumes."""
    if not is_run(run_dir):
        present = _contents(run_dir)
        if "run.json" in present:
            raise UserError(
                f"--resume auto: {run_dir}/run.json is corrupt or not a gptoughts run's, so this is not a run to "
                "resume; restore the file from a copy, or name a run's folder with --out"
            )
        holds = f"is not a gptoughts run (it holds {', '.join(present[:4])})" if present else "holds no run"
        raise UserError(
            f"--resume auto: {run_dir} {holds}, so there is nothing to resume; name a run's folder with "
            "--out, or start a new run without --resume"
        )
    if not (run_dir / "config.toml").is_file():
        raise UserError(
            f"{run_dir}/config.toml is missing, and a resume starts from it: restore it from a copy, or "
            "start over with --overwrite"
        )
    ended = (run_dir / "summary.json").is_file() and not ckpt.list_steps(run_dir / "checkpoints")
    if ended and not _old_config(run_dir).checkpoint.checkpoints:
        # A run stopped before its first save restarts from step 0; one that ended without any would be replaced.
        raise UserError(
            f"--resume auto: {run_dir} ended without writing a checkpoint (checkpoint.checkpoints false), so "
            "there is nothing to resume; train it again with --overwrite, or into another --out"
        )


def architecture_changes(old: Config, cfg: Config) -> list[str]:
    """``field old -> new`` for each model field in which ``cfg`` builds another model than ``old`` did (the
    resolved architecture: naming a run's own value again is no change). A family's speed switches
    (``KERNEL_FIELDS`` of its args) run other kernels on the same weights: no change either."""
    from gptoughts import models

    changes = [
        f"{name} {a} -> {b}"
        for name, a, b in (
            ("family", old.model.family, cfg.model.family),
            ("size", old.model.size, cfg.model.size),
        )
        if a != b
    ]
    if changes:
        return changes
    before = models.model_args(old.model.family, old.model.size, old.model.overrides)
    after = models.model_args(cfg.model.family, cfg.model.size, cfg.model.overrides)
    kernels = getattr(before, "KERNEL_FIELDS", frozenset())
    return [
        f"{f.name} {getattr(before, f.name)} -> {getattr(after, f.name)}"
        for f in dataclasses.fields(before)
        if f.name not in kernels and getattr(before, f.name) != getattr(after, f.name)
    ]


def _old_config(run_dir: Path) -> Config:
    f = run_dir / "config.toml"
    try:
        return config_from_toml_text(f.read_text(encoding="utf-8"))
    except (ConfigError, ValueError, OSError) as e:
        raise UserError(
            f"{f} is corrupt ({str(e).splitlines()[0]}); restore it or start over with another --out"
        ) from None


def check_resumed_tokenizer(run_dir: Path, resume_from: Path, tokenizer: Any, cfg: Config) -> None:
    """:func:`check_tokenizer` against the run's own tokenizer, or for a branch into a new folder the one of the
    run the checkpoint comes from (where neither has one, nothing to compare)."""
    for source in (run_dir, ckpt.run_of(resume_from)):
        if source is not None and (source / "tokenizer").exists():
            check_tokenizer(source, tokenizer, cfg)
            return


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
    old = _old_config(run_dir) if (run_dir / "config.toml").is_file() else None
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
    """Remove what a run wrote (:data:`RUN_FILES`; inside checkpoints/ only checkpoints), nothing else. A symlink
    is removed, never followed: what it points to is not the run's to delete."""
    for name in RUN_FILES:
        p = run_dir / name
        if name == "checkpoints" and p.is_dir() and not p.is_symlink():
            for child in p.iterdir():
                if (
                    ckpt.STEP_DIR.match(child.name)
                    or child.name == "best.json"
                    or child.name.startswith(".tmp-")
                ):
                    _remove(child)
            if not any(p.iterdir()):
                p.rmdir()
        else:
            _remove(p)


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    elif p.is_symlink() or p.exists():
        p.unlink()


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to a temp file beside ``path``, fsync, rename: a reader sees the old or the new file."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def refuse_existing(path: Path, overwrite: bool) -> None:
    """One line, before a command's work, where its one output file is already there and ``overwrite`` was not
    passed (``train --out`` and ``export OUT`` treat an existing output the same way)."""
    if path.exists() and not overwrite:
        raise UserError(
            f"{path} already exists; pass --out to write elsewhere (e.g. --out {free_name(path)}), or "
            "--overwrite to replace it"
        )


def free_name(path: Path) -> Path:
    """``path`` with ``-2``, ``-3``, ... before its suffix: the first name not taken."""
    n = 2
    while (free := path.with_name(f"{path.stem}-{n}{path.suffix}")).exists():
        n += 1
    return free


def place_file(tmp: Path, path: Path, overwrite: bool) -> Path:
    """Move the finished ``tmp`` to ``path`` whole (a reader never sees half a file) and return where it went.
    Without ``overwrite`` never over a file, not even one made since :func:`refuse_existing` looked: that one is
    kept and ``tmp`` goes to the first free name (:func:`free_name`)."""
    if overwrite:
        os.replace(tmp, path)
        return path
    target = path
    while True:
        try:
            os.link(tmp, target)  # fails if target exists, atomically: no window between a check and a rename
            tmp.unlink()
            return target
        except FileExistsError:
            target = free_name(path)
        except OSError:  # no hard links on this filesystem: check, then rename
            if target.exists():
                target = free_name(path)
                continue
            os.replace(tmp, target)
            return target
