"""lm-evaluation-harness on our models: ``gptoughts eval RUN --tasks hellaswag,arc_easy``.

:class:`NativeLM` is the harness's ``LM`` over a model from :func:`gptoughts.api.load` (a run, a checkpoint or an
HF folder): ``loglikelihood`` and ``loglikelihood_rolling`` score token windows with
:func:`gptoughts.tools.tasks.score_tokens` (batched, one forward per batch), ``generate_until`` decodes greedily
with the KV cache (:func:`gptoughts.tools.tasks.generate_until`). Masked-diffusion families (LLaDA) score through
the Monte-Carlo likelihood and generate with the diffusion sampler, both behind the same two functions.

Task data. The harness loads each task's dataset with ``datasets``: from the local cache (``HF_HOME``,
``HF_DATASETS_CACHE``), a task folder of YAML files (``--task_dir``: the harness's own format, whose
``dataset_path: json`` + ``data_files`` read local files), or the network. ``gptoughts eval`` stays offline unless
``--download`` is given, so a machine without network gets one line naming the tasks whose data is missing and
how to bring it, never a hang on a download. Tasks and their data are loaded before the model.

The harness is an optional dependency (``pip install 'gptoughts[eval]'``); custom JSONL tasks
(``--tasks FILE.jsonl``) do not need it. Note that a harness task folder may hold Python (``!function`` in its
YAML), which the harness imports: point ``--task_dir`` only at folders you trust, as with any harness task.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from gptoughts import models
from gptoughts.config import is_task_file
from gptoughts.errors import DataError, UserError
from gptoughts.tools import tasks

INSTALL = "pip install 'gptoughts[eval]'"

try:  # optional: without it, harness task names are refused in one line (Harness) and files still work
    from lm_eval.api.model import LM as _LM
except ImportError:  # pragma: no cover - the test suite installs gptoughts[eval]
    _LM = object


def split_specs(specs: list[str]) -> tuple[list[str], list[str]]:
    """``--tasks`` / ``eval_tasks`` entries as (task files, harness task names); every entry may list several,
    comma-separated (``hellaswag,mine.jsonl``), spaces around them ignored."""
    files, names = [], []
    for spec in specs:
        for part in (p.strip() for p in spec.split(",")):
            if part:
                (files if is_task_file(part) else names).append(part)
    return list(dict.fromkeys(files)), list(dict.fromkeys(names))


def check_names(file_names: list[str], harness_names: list[str]) -> None:
    """A task file and a harness task of one name would log under one key: refused in one line."""
    both = sorted(set(file_names) & set(harness_names))
    if both:
        raise UserError(
            f"task name {', '.join(both)} is both a task file's and a harness task's: rename the file (its name "
            "without .jsonl is the task's)"
        )


def _require() -> None:
    if _LM is object:
        raise UserError(
            f"harness tasks need lm-evaluation-harness, which is not installed: {INSTALL} (custom task files, "
            "--tasks FILE.jsonl, do not)"
        ) from None


@contextlib.contextmanager
def _offline(allow_download: bool) -> Iterator[None]:
    """No network access by ``datasets`` and ``huggingface_hub`` unless asked: a missing dataset fails at once
    instead of hanging on a download without network."""
    if allow_download:
        yield
        return
    import datasets
    import huggingface_hub.constants as hub

    # datasets reads its own copy of the flag (config.HF_HUB_OFFLINE), the hub client its constant.
    flags = [
        (datasets.config, "HF_HUB_OFFLINE"),
        (datasets.config, "HF_DATASETS_OFFLINE"),
        (hub, "HF_HUB_OFFLINE"),
    ]
    saved = [getattr(obj, name) for obj, name in flags]
    env = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    for obj, name in flags:
        setattr(obj, name, True)
    os.environ.update(dict.fromkeys(env, "1"))
    try:
        yield
    finally:
        for (obj, name), value in zip(flags, saved, strict=True):
            setattr(obj, name, value)
        for k, v in env.items():
            _restore_env(k, v)


def _quiet() -> None:
    """The harness and datasets log at INFO and WARNING for every task; the table says what matters."""
    for name in ("lm_eval", "datasets", "huggingface_hub", "fsspec"):
        logging.getLogger(name).setLevel(logging.ERROR)
    with contextlib.suppress(Exception):
        import datasets

        datasets.disable_progress_bars()


class Harness:
    """Harness tasks by name, indexed and their data loaded (offline unless ``allow_download``) before any model
    loads: an unknown name or missing data is one line, naming what is missing and how to provide it."""

    def __init__(
        self,
        names: list[str],
        *,
        task_dir: str | None = None,
        allow_download: bool = False,
        num_fewshot: int | None = None,
        limit: int | None = None,
        during_training: bool = False,
    ) -> None:
        """``during_training``: the messages name the training options (``--eval.eval_task_dir``; no download
        while training) instead of ``gptoughts eval``'s."""
        self.during_training = during_training
        self.dir_flag = "--eval.eval_task_dir" if during_training else "--task_dir"
        _require()
        _quiet()
        from lm_eval.tasks import TaskManager

        if task_dir is not None and not Path(task_dir).is_dir():
            raise DataError(
                f"{self.dir_flag} {task_dir} is not a folder; pass a folder of harness task YAML files"
            )
        self.names, self.allow_download = names, allow_download
        self.num_fewshot, self.limit = num_fewshot, limit
        # The harness's own index scans ~15,000 YAML files (~5 s of CPU): skipped when the folder has them all.
        manager = TaskManager(include_path=task_dir, include_defaults=False) if task_dir else None
        if manager is None or any(n not in manager.all_tasks for n in names):
            manager = TaskManager(include_path=task_dir)
        unknown = [n for n in names if n not in manager.all_tasks]
        if unknown:
            import difflib

            close = {n: difflib.get_close_matches(n, manager.all_tasks, n=3) for n in unknown}
            hint = "; ".join(f"{n}: did you mean {', '.join(c)}?" for n, c in close.items() if c)
            raise UserError(
                f"unknown harness task(s) {', '.join(unknown)}"
                + (f" ({hint})" if hint else "")
                + f"; `lm-eval ls tasks` lists them, {self.dir_flag} adds a folder of task YAML files, and a "
                "custom task file must end in .jsonl"
            )
        self.manager = manager
        self.task_dict = self._load()
        self.tasks = self.task_dict["tasks"]
        """The leaf tasks by name (a group such as ``mmlu`` expands to its subtasks; its score is reported too)."""

    def _load(self) -> dict[str, Any]:
        """Each task with its data (one at a time, so the error names every task whose data is missing), as the
        harness's task dict (``tasks``, ``groups``, ``group_map``), loaded once and scored at every call."""
        loaded: dict[str, Any] = {"tasks": {}, "groups": {}, "group_map": {}}
        missing: dict[str, str] = {}
        broken: dict[str, str] = {}
        with _offline(self.allow_download):
            for name in self.names:
                try:
                    part = self.manager.load([name])
                    for key in loaded:
                        loaded[key].update(part.get(key) or {})
                except Exception as e:  # noqa: BLE001 - which task and why: said in one line below
                    why = _first_line(e)
                    # No data where it was looked for (offline hub, missing local file) vs a task that is wrong.
                    offline = isinstance(e, (ConnectionError, FileNotFoundError)) or type(e).__name__ in (
                        "DatasetNotFoundError",
                        "OfflineModeIsEnabled",
                        "LocalEntryNotFoundError",
                    )
                    (missing if offline else broken)[name] = why
        if broken:
            what = "; ".join(f"{n}: {why}" for n, why in broken.items())
            raise DataError(
                f"harness task(s) {', '.join(broken)} could not be built ({what}); check the task's YAML (its "
                "fields, doc_to_* templates, !function modules) or the folder given to " + self.dir_flag
            )
        if not missing:
            # As simple_evaluate sets them: the asked few-shot count unless a task fixes 0, else the task's own
            # (0 when it has none), and the few-shot draws seeded.
            for task in loaded["tasks"].values():
                if self.num_fewshot is not None and task.get_config("num_fewshot") != 0:
                    task.set_config(key="num_fewshot", value=self.num_fewshot)
                elif task.get_config("num_fewshot") is None:
                    task.set_config(key="num_fewshot", value=0)
                task.set_fewshot_seed(seed=0)
            return loaded
        what = "; ".join(f"{n}: {why}" for n, why in missing.items())
        where = os.environ.get("HF_DATASETS_CACHE") or os.environ.get("HF_HOME") or "~/.cache/huggingface"
        if self.allow_download:
            raise DataError(
                f"the data of harness task(s) could not be loaded ({what}); check the network, or the "
                "task's dataset_path and data_files"
            )
        fetch = (
            f"run `gptoughts eval RUN --tasks {','.join(missing)} --download` once where there is network (training "
            "never downloads)"
            if self.during_training
            else "pass --download to fetch it, or run that on a machine with network"
        )
        raise DataError(
            f"the data of harness task(s) {', '.join(missing)} is not on this machine (offline; {what}): {fetch} "
            f"and copy its Hugging Face cache to {where} here, or give {self.dir_flag} a folder of task YAML files "
            "reading local data (dataset_path: json, data_files)"
        )

    def examples(self, name: str) -> int:
        """How many examples of task or group ``name`` are scored (``limit`` applied to each task)."""
        task = self.tasks.get(name)
        if task is None:  # a group: its tasks' (and subgroups') examples
            children = self.task_dict["group_map"].get(name, [])
            return sum(self.examples(getattr(c, "group_name", None) or str(c)) for c in children)
        n = len(task.eval_docs)
        return n if self.limit is None else min(n, self.limit)

    def evaluate(
        self, loaded: Any, *, batch_size: int = 8, mc_samples: int | None = None, asked_only: bool = False
    ) -> dict[str, dict[str, Any]]:
        """Every task (and group) on the model: ``{name: {"examples", metric: value, metric_stderr: value}}``;
        ``asked_only``: the names asked for, not a group's subtasks (training logs these).

        The harness's ``evaluate`` on the tasks loaded at construction (not ``simple_evaluate``, which loads
        them again, reseeds the global generators, runs ``git``, ``nvidia-smi`` and ``pip list`` for its report,
        and returns results only where ``LOCAL_RANK`` is 0: every rank of a sharded model runs this whole)."""
        from lm_eval.evaluator import evaluate as run_tasks

        was_training = loaded.model.training
        lm = NativeLM(loaded, batch_size=batch_size, mc_samples=mc_samples)
        with _offline(self.allow_download), _saved_rng(), contextlib.ExitStack() as undo:
            # Bootstrapped metrics (perplexity, f1, bleu, ...) would fork a pool of every core from a CUDA process.
            undo.callback(_restore_env, "DISABLE_MULTIPROC", os.environ.get("DISABLE_MULTIPROC"))
            os.environ["DISABLE_MULTIPROC"] = "1"
            undo.callback(lm.model.train, was_training)
            try:
                out = run_tasks(
                    lm=lm, task_dict=self.task_dict, limit=self.limit, bootstrap_iters=1000, log_samples=False
                )
            except (UserError, tasks.Interrupted):
                raise
            except Exception as e:  # noqa: BLE001 - a task that fails while scoring: one line, not a traceback
                raise DataError(
                    f"harness task(s) {', '.join(self.names)} failed while scoring ({_first_line(e)}); check the "
                    "task's YAML (metric_list options, filters, generation_kwargs)"
                ) from e
        rows = _results(out)
        return {n: rows[n] for n in self.names if n in rows} if asked_only else rows


@contextlib.contextmanager
def _saved_rng() -> Iterator[None]:
    """The global generators (Python's, numpy's, torch's CPU and CUDA ones) as they were: a training run's draws
    continue as if the harness had not run."""
    import random

    import numpy as np

    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    states = (
        random.getstate(),
        np.random.get_state(),
        torch.get_rng_state(),
        torch.cuda.get_rng_state_all() if cuda else None,
    )
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if states[3] is not None:
            torch.cuda.set_rng_state_all(states[3])


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:160]}" if text else type(e).__name__


def _restore_env(key: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = value


def _results(out: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The harness's ``results`` (keys such as ``"acc,none"``, ``"acc_stderr,none"``) as flat rows."""
    rows: dict[str, dict[str, Any]] = {}
    samples = out.get("n-samples", {})
    subtasks = out.get("group_subtasks", {})

    def count(name: str) -> int:  # a task's scored examples; a group's: its subtasks'
        n = samples.get(name)
        if n:
            return int(n.get("effective", n.get("original", 0)))
        return sum(count(c) for c in subtasks.get(name, []))

    for task, metrics in out["results"].items():
        row: dict[str, Any] = {"examples": count(task)}
        for key, value in metrics.items():
            if key in ("alias", "sample_len") or not isinstance(value, (int, float)):
                continue
            metric, _, filt = key.partition(",")
            row[metric if filt in ("", "none") else f"{metric}[{filt}]"] = float(value)
        rows[task] = row
    return rows


class NativeLM(_LM):  # type: ignore[misc, valid-type]
    """The harness's ``LM`` over a model from :func:`gptoughts.api.load` (see the module docstring)."""

    def __init__(self, loaded: Any, *, batch_size: int = 8, mc_samples: int | None = None) -> None:
        super().__init__()
        self.loaded, self.batch_size = loaded, batch_size
        self.model = loaded.model.eval()
        self.tokenizer = loaded.tokenizer
        self.max_len = getattr(loaded.args, "max_seq_len", None) or 2048
        self.diffusion = models.family_of(loaded.family).objective == "diffusion"
        # Masked diffusion (LLaDA): the Monte-Carlo likelihood and the denoising sampler, with its mask token.
        self.kw: dict[str, Any] = {}
        if self.diffusion:
            self.kw = dict(
                diffusion=True, mask_id=tasks.mask_id_of(self.tokenizer, self.model, loaded.family)
            )
        self.mc = {"mc_samples": mc_samples} if self.diffusion and mc_samples else {}

    def loglikelihood(self, requests: list[Any]) -> list[tuple[float, bool]]:
        pairs = [tuple(r.args) for r in requests]
        return tasks.loglikelihoods(
            self.model,
            self.tokenizer,
            pairs,
            batch_size=self.batch_size,
            max_len=self.max_len,
            with_greedy=True,
            **self.kw,
            **self.mc,
        )

    def loglikelihood_rolling(self, requests: list[Any]) -> list[float]:
        """The text's log-likelihood in disjoint windows of the model's length, each after as much of the
        text before it as fits (the harness's rolling windows), the first after the eos token."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        windows, owner = [], []
        for i, r in enumerate(requests):
            ids = self.tokenizer.encode(r.args[0])
            for w in get_rolling_token_windows(ids, self.tokenizer.eos_id, self.max_len, 1):
                windows.append(make_disjoint_window(w))
                owner.append(i)
        scores = tasks.score_tokens(
            self.model,
            windows,
            eos_id=self.tokenizer.eos_id,
            batch_size=self.batch_size,
            max_len=self.max_len,
            **self.kw,
            **self.mc,
        )
        out = [0.0] * len(requests)
        for i, s in zip(owner, scores, strict=True):
            out[i] += s
        return out

    def generate_until(self, requests: list[Any]) -> list[str]:
        """Greedy continuations, batched per distinct generation settings (a task has one)."""
        out: list[str] = [""] * len(requests)
        groups: dict[tuple, list[int]] = {}
        for i, r in enumerate(requests):
            kw = dict(r.args[1] or {})
            until = kw.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            # At most half the model's window: the harness's default (256) on a 256-position model would leave
            # the prompt no room (a one-line refusal, or a prompt cut to its last token).
            key = (tuple(until), min(int(kw.get("max_gen_toks", 256)), max(1, self.max_len // 2)))
            groups.setdefault(key, []).append(i)
        for (until, max_new), idx in groups.items():
            texts = tasks.generate_until(
                self.model,
                self.tokenizer,
                [requests[i].args[0] for i in idx],
                until=list(until),
                max_new_tokens=max_new,
                batch_size=self.batch_size,
                max_len=self.max_len,
                **self.kw,
            )
            for i, t in zip(idx, texts, strict=True):
                out[i] = t
        return out
