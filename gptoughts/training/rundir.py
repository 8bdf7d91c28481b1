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
from gptoughts.data.sources import free_name, is_run_folder, read_json_dict
from gptoughts.errors import ConfigError, UserError
from gptoughts.training.checkpoint import store as ckpt

BASE_DIR = "base"
"""A fine-tune whose ``--model`` was a gptoughts run keeps that run's export here, its base (``api._start_from_run``,
which writes it before the run's own files)."""
# Everything a run writes at its top level (checkpoints/ holds only step_* folders, best.json and temp dirs), and
# what commands write about it there (`gptoughts eval RUN --tasks`: eval_tasks.json, the scores of its model).
RUN_FILES = (
    "config.toml",
    "run.json",
    "metrics.jsonl",
    "samples.txt",
    "summary.json",
    "eval_tasks.json",
    "tokenizer",
    "tensorboard",
    "plots",
    "profile",
    "wandb",
    "checkpoints",
    BASE_DIR,
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
        lock = cls(path, handle, created)
        try:  # the lock's holder alone finishes a checkpoint replace a crash cut short (a reader only reads)
            ckpt.recover(run_dir / "checkpoints")
        except BaseException:
            lock.release()
            raise
        return lock

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


def in_use(run_dir: Path) -> bool:
    """Whether a process holds the run's lock now (its file alone outlives a killed run)."""
    try:
        import fcntl

        with open(run_dir / LOCK_FILE, encoding="utf-8") as handle:
            fcntl.flock(handle.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
    except ImportError:  # no flock (Windows): the file is all there is
        return (run_dir / LOCK_FILE).exists()
    except OSError:  # held (or no lock file: FileNotFoundError, below)
        return (run_dir / LOCK_FILE).exists()
    return False


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
        if (
            cfg.run.overwrite and "run.overwrite" in cfg.flags
        ):  # (a saved run's own value is not this command's)
            raise UserError(
                f"--resume auto continues the run in {run_dir} and --overwrite replaces it: pass one of them"
            )
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
    changed = architecture_changes(old, cfg) + adapter_changes(old, cfg)
    if changed:
        raise UserError(
            f"{subject} a model of another architecture than this command's ({'; '.join(changed)}): a checkpoint "
            f"resumes only into the model it was saved from; {fix}"
        )
    if old.lora.enabled != cfg.lora.enabled or not same_base_model(old.model.init_from, cfg.model.init_from):
        base = (
            f"a fine-tune of {old.model.init_from}" if old.model.init_from else "a model trained from scratch"
        )
        raise UserError(
            f"{subject} {base} (LoRA {'on' if old.lora.enabled else 'off'}); resume it with the same --model and "
            f"--lora, or {fix}"
        )


def same_base_model(a: str | None, b: str | None) -> bool:
    """Whether ``a`` and ``b`` (``model.init_from``) name the same base model: a folder by its resolved path
    (config.toml stores it absolute, a command names it as typed: ``exported_a``, ``./exported_a/``), a hub id
    (:func:`~gptoughts.models.hf.is_hub_id`) as it is written."""
    if a is None or b is None:
        return a is b
    return _base_model_key(a) == _base_model_key(b)


def _base_model_key(spec: str) -> str:
    from gptoughts.models.hf import is_hub_id

    return spec if is_hub_id(spec) else str(Path(spec).expanduser().resolve())


def check_finetune_base(cfg: Config) -> None:
    """``finetune`` trains a pretrained model (``model.init_from``). Without ``--model``, a resume takes it from the
    run's config.toml (as ``train --resume`` takes the whole model): refused by name where there is no run to
    resume, or the run was trained from scratch."""
    if cfg.model.init_from is not None:
        return
    resume = cfg.run.resume
    if resume == "auto":
        run_dir = Path(cfg.run.out)
        check_resumable(run_dir)  # no run there: nothing to resume, said by the refusal --resume auto gives
        raise UserError(
            f"{run_dir} holds a model trained from scratch, not a fine-tune; resume it with `gptoughts train "
            f"--resume auto --out {run_dir}`, or fine-tune a model with --model HF_DIR into another --out"
        )
    if resume:
        raise UserError(
            f"{resume} is not a checkpoint of a fine-tune (no run config.toml beside it names a base model); "
            f"resume it with `gptoughts train --resume {resume}`, or pass --model HF_DIR"
        )
    raise UserError(
        "finetune needs a pretrained model: pass --model HF_DIR (a local Hugging Face folder) or "
        "--model ORG/NAME (a Hugging Face hub id)"
    )


def _check_resume(run_dir: Path, cfg: Config) -> tuple[Path | None, dict[str, Any] | None]:
    """``--resume auto``: the newest usable checkpoint of the run in ``run_dir`` (a branch without one yet: the
    checkpoint it branched from; None: the run stopped before its first one, and starts again from step 0 on its
    own config.toml, which ``cfg`` was loaded from)."""
    check_resumable(run_dir)
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
    record = read_run_json(run_dir)
    if found is None:
        found = _branch_origin(run_dir, record)
    _check_against_run(run_dir, found, cfg, f"{run_dir} holds", "drop those flags, or use another --out")
    return found, record


def _check_against_run(source: Path, path: Path | None, cfg: Config, subject: str, fix: str) -> None:
    """What a resume of checkpoint ``path`` checks against the config.toml of its run ``source``: the same model,
    and for the checkpoint's state the same optimizer and data order (``path`` None: a run with no checkpoint yet
    restarts from step 0, with any optimizer and any batches). ``subject`` and ``fix``: as :func:`_check_same_model`."""
    old = _old_config(source)
    _check_same_model(old, cfg, subject, fix)
    if path is not None:
        _check_optimizer(path, old.train.optimizer, cfg, True)
        _check_data_order(path, old, cfg, read_run_json(source))


def _branch_origin(run_dir: Path, record: dict[str, Any] | None) -> Path | None:
    """The checkpoint a branch stopped before its first checkpoint goes on from: the one it branched from (run.json
    ``branched_from``); None for a run that started from step 0. Refused where that checkpoint is no longer usable
    (starting from step 0 instead would train another model under the branch's name)."""
    origin = (record or {}).get("branched_from")
    if not origin:
        return None
    path = Path(origin)
    problem = ckpt.verify(path) if path.is_dir() else "it no longer exists"
    if problem is not None:
        raise UserError(
            f"{run_dir} is a branch of {path} stopped before its first checkpoint, and that checkpoint is unusable "
            f"({problem}); nothing was changed: restore it, or start over with --overwrite"
        )
    return path


def _check_checkpoint(run_dir: Path, cfg: Config, path: Path) -> tuple[Path | None, dict[str, Any] | None]:
    """``--resume PATH``: checkpoint ``path`` resumes into its own run's folder (where it is the newest), or branches
    into a new or empty one; never into a folder that holds another run (its checkpoints and metrics would mix with
    this one's)."""
    home = ckpt.run_of(path)
    own = home is not None and home.resolve() == run_dir.resolve()
    later = own and any(s > ckpt.step_of(path) for s in ckpt.list_steps(path.parent))
    if (
        later
        and (newest := ckpt.latest_valid(path.parent)) is not None
        and ckpt.step_of(newest) > ckpt.step_of(path)
    ):
        # Rewound in place, the run's later checkpoints would stay: a later --resume auto would take the newest of
        # them, on the other history, and go on from it past this one's steps.
        from gptoughts.config.loading import branch_out

        raise UserError(
            f"{path} is not the newest checkpoint of {run_dir} ({newest.name} is): resumed into it, a later "
            f"--resume auto would go on from {newest.name}, mixing two histories; branch it into a new folder "
            f"(--out {branch_out(path, home)}, the default without --out), or continue the run with --resume auto"
        )
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
        _check_against_run(
            source,
            path,
            cfg,
            f"{path} was saved from",
            f"give the model flags of its run ({source}/config.toml)",
        )
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


def _check_data_order(path: Path, old: Config, cfg: Config, record: dict[str, Any] | None) -> None:
    """A checkpoint's data loader goes on only with the block and seed it cut its batches with (chat data: and its
    packing): refused here, from its run's config.toml, before the plan and in a dry run too, rather than by the
    loader as the checkpoint loads (which stays the check of a checkpoint moved out of its run). ``record``: the
    run's run.json (its data format)."""
    fields = [
        ("block_size", old.train.block_size, cfg.train.block_size),
        ("seed", old.train.seed, cfg.train.seed),
    ]
    if record is not None and record.get("data_format") == "sft" and not record.get("generic"):
        fields.append(("packing", old.data.packing, cfg.data.packing))  # (a generic model never packs)
    for name, was, now in fields:
        if was != now:
            shown = str(was).lower() if isinstance(was, bool) else was
            raise UserError(
                f"the data loader of {path} used {name}={was!r}, this command asks for {now!r}: its batches go on "
                f"only with the {name} they were cut with; resume with --{name} {shown} (or without --{name}), "
                "or train with the new value as a new run (another --out)"
            )


def _contents(run_dir: Path) -> list[str]:
    """The names in ``run_dir`` (sorted; the lock file of a process that held it is not content)."""
    return (
        sorted(p.name for p in run_dir.iterdir() if p.name not in (LOCK_FILE, BASE_DIR))
        if run_dir.is_dir()
        else []
    )


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


def adapter_changes(old: Config, cfg: Config) -> list[str]:
    """``lora.FIELD old -> new`` for each LoRA setting that shapes the adapters (their rank, the layers they wrap)
    where a LoRA run is resumed with LoRA: its checkpoint holds only adapters of the run's own shapes."""
    if not (old.lora.enabled and cfg.lora.enabled):
        return []
    return [
        f"lora.{name} {a} -> {b}"
        for name, a, b in (
            ("r", old.lora.r, cfg.lora.r),
            ("target_modules", list(old.lora.target_modules), list(cfg.lora.target_modules)),
        )
        if a != b
    ]


def adapter_scale_change(run_dir: Path, cfg: Config) -> list[str]:
    """A LoRA run resumed with another ``lora.alpha`` (allowed: a typed flag wins on a resume) in one line: the
    adapters its checkpoint holds were trained at ``alpha / r`` of the old value and act at the new one from the
    resumed step, which nothing else shows (``run_dir``: the run whose config.toml saved them)."""
    try:
        old = _old_config(run_dir)
    except UserError:  # (a resume has read it already: nothing to add here)
        return []
    if not (old.lora.enabled and cfg.lora.enabled) or old.lora.alpha == cfg.lora.alpha:
        return []
    a, b, r = old.lora.alpha, cfg.lora.alpha, cfg.lora.r
    return [
        f"lora alpha {a:g} -> {b:g}: the adapters' scale changes from this step (alpha/r {a / r:g} -> {b / r:g})"
    ]


def _old_config(run_dir: Path) -> Config:
    f = run_dir / "config.toml"
    try:
        return config_from_toml_text(f.read_text(encoding="utf-8"))
    except (ConfigError, ValueError, OSError) as e:
        raise UserError(
            f"{f} is corrupt ({str(e).splitlines()[0]}); restore it or start over with another --out"
        ) from None


def check_resumed_tokenizer(run_dir: Path, resume_from: Path, tokenizer: Any, cfg: Config) -> str | None:
    """:func:`check_tokenizer` against the run's own tokenizer, or for a branch into a new folder the one of the
    run the checkpoint comes from (where neither has one, nothing to compare).

    ``tokenizer`` None: a BPE not trained yet (the assembly's first pass, which a dry run stops after, tokenizes
    nothing). It is decided by what it would be trained on (:func:`tokenizer_inputs_changed`: the tokenizer
    asked, the sources, the seed and the reading settings, against the run's config.toml): refused where those
    differ, so that a dry run gives the real run's verdict and a real run refuses before preparing a corpus it
    cannot use. Where they are the run's own, only the trained BPE can tell an edited corpus from a touched one:
    what is left to compare is returned, for a dry run to say (else None)."""
    for source in (run_dir, ckpt.run_of(resume_from)):
        if source is None or not (source / "tokenizer").exists():
            continue
        if tokenizer is not None:
            check_tokenizer(source, tokenizer, cfg)
            return None
        old = _old_config(source) if (source / "config.toml").is_file() else None
        cause = tokenizer_inputs_changed(old, cfg) if old is not None else None
        if cause:
            raise UserError(
                f"the tokenizer this run would build differs from {source}/tokenizer: {cause}; resume with the "
                f"run's own settings, or keep its vocabulary with --tokenizer {source}/tokenizer"
            )
        # Sources at other paths may hold the same text (a copied or moved corpus): only the trained BPE tells.
        was, now = (_source_keys(old.data.sources) if old else []), _source_keys(cfg.data.sources)
        why = (
            f"the corpus is not at the run's path (--data {', '.join(now)}; the run's: {', '.join(was)})"
            if old is not None and was != now
            else "the run's corpus has no tokenized shards here (its files changed since the run read them, or "
            "the cache is another)"
        )
        return (
            f"{why}: the run trains its {cfg.data.tokenizer} on it and compares it with {source}/tokenizer before "
            f"its first step; if the text differs, it is refused then (--tokenizer {source}/tokenizer keeps the "
            "run's vocabulary)"
        )
    return None


def tokenizer_inputs_changed(old: Config, cfg: Config) -> str | None:
    """Why the tokenizer ``cfg`` builds is not the one the run of ``old`` built, when it is in what the two
    configs ask for (the tokenizer, the held-out split, the reading settings); None when they ask for the same (a
    trained BPE may still differ: its corpus's text may have changed, or be at other paths)."""
    if cfg.model.init_from is not None:  # a fine-tune's tokenizer is its base model's, whatever the data
        return None
    if _tokenizer_key(old.data.tokenizer) != _tokenizer_key(cfg.data.tokenizer):
        return f"the run used --tokenizer {old.data.tokenizer}, this command asks for {cfg.data.tokenizer}"
    if _tokenizer_kind(cfg.data.tokenizer) != "bpe":  # bytes or a folder: the same whatever the corpus
        return None
    if old.train.seed != cfg.train.seed:
        return (
            f"the run's seed was {old.train.seed} and this command's is {cfg.train.seed} (the seed picks the "
            "held-out documents, which the BPE is not trained on)"
        )
    d, n = old.data, cfg.data
    if (d.max_bytes, d.val_fraction, d.text_field, d.extensions) != (
        n.max_bytes,
        n.val_fraction,
        n.text_field,
        n.extensions,
    ):
        return (
            "data.max_bytes, data.val_fraction, data.text_field or data.extensions changed, so the BPE was "
            "trained on other text"
        )
    return None


def _tokenizer_kind(spec: str) -> str:
    from gptoughts.data.tokenizer import parse_spec

    try:
        return parse_spec(spec)[0]
    except ConfigError:  # a folder gone missing: refused by name where it is loaded
        return "folder"


def _tokenizer_key(spec: str) -> str:
    """A tokenizer spec as compared: a folder by its resolved path (config.toml stores it absolute)."""
    return str(Path(spec).expanduser().resolve()) if _tokenizer_kind(spec) == "folder" else spec.strip()


def _source_keys(sources: list[str]) -> list[str]:
    """Sources as the corpus reads them: ``@stdlib`` expanded, paths resolved (config.toml stores them absolute,
    a command names them as typed)."""
    from gptoughts.data.sources import STDLIB_ALIAS, stdlib_path

    return [str(stdlib_path()) if s == STDLIB_ALIAS else str(Path(s).expanduser().resolve()) for s in sources]


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
    if cfg.model.init_from is not None:  # a fine-tune tokenizes with its base model's tokenizer
        cause = f"the tokenizer of {cfg.model.init_from} is not the one the run started with"
    elif _tokenizer_kind(cfg.data.tokenizer) == "folder" and (
        old is None or _tokenizer_key(old.data.tokenizer) == _tokenizer_key(cfg.data.tokenizer)
    ):
        cause = f"{cfg.data.tokenizer} holds another tokenizer than the one the run started with"
    else:
        cause = (tokenizer_inputs_changed(old, cfg) if old is not None else None) or (
            "the corpus differs from the one the run started on (edited, added or removed files), so the BPE "
            "trained on it differs"
        )
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


def output_file(given: str | Path | None, default: str, overwrite: bool) -> Path:
    """Where a command writes its one output file (``tune``'s TOML, ``plot``'s PNG): ``given`` (a folder, existing
    or written with a trailing separator: ``default`` in it), else ``default`` in the current folder. Refused in
    one line, before the command does any work, where a file is already there and ``overwrite`` was not passed
    (``train --out`` and ``export OUT`` treat an existing output the same way), or where its folder cannot be
    written. The folders it needs are made when the file is placed (:func:`place_file`)."""
    as_folder = given is not None and str(given).endswith(("/", os.sep))
    path = Path(given).expanduser() if given else Path(default)
    if path.is_dir() or as_folder:
        path = path / default
    if path.is_dir():
        raise UserError(f"{path} is a folder; pass another --out")
    if path.exists() and not overwrite:
        raise UserError(
            f"{path} already exists; write elsewhere (e.g. --out {free_name(path)}), or replace it with "
            "--overwrite (overwrite=True from Python)"
        )
    above = path.parent.absolute()
    while not above.exists():
        above = above.parent
    if not above.is_dir():
        raise UserError(f"cannot write {path}: {above} is a file, not a folder; pass another --out")
    if not os.access(above, os.W_OK | os.X_OK):
        raise UserError(f"cannot write {path}: {above} is not writable; pass another --out")
    return path


def place_file(tmp: Path, path: Path, overwrite: bool) -> Path:
    """Move the finished ``tmp`` to ``path`` whole (a reader never sees half a file) and return where it went.
    Without ``overwrite`` never over a file, not even one made since :func:`output_file` looked: that one is
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
