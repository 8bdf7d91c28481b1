"""The Python API: ``train``, ``finetune``, ``load``, ``generate``, ``evaluate``, ``export``. The CLI is a thin
layer over these; the assembly of a run is ``gptoughts.training.build``."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gptoughts import models
from gptoughts.config import Config, config_from_toml_text, load_config
from gptoughts.errors import ConfigError, DataError, UserError, as_disk_full, first_line
from gptoughts.models import GENERIC_FAMILY
from gptoughts.models.hf import check_base_unchanged, is_hf_folder, load_pretrained, restore_hint
from gptoughts.models.hf_generic import HFCausalLM
from gptoughts.parallel import dist as pdist
from gptoughts.perf import hardware
from gptoughts.training.checkpoint import restore
from gptoughts.training.checkpoint import store as ckpt


@dataclass
class History:
    """What ``train`` returns besides the model and tokenizer (the INL guide's ``history``)."""

    steps: int = 0
    tokens: int = 0
    val_loss: list[float] = field(default_factory=list)
    val_ppl: list[float] = field(default_factory=list)
    eval_steps: list[int] = field(default_factory=list)
    final_val_loss: float = math.nan
    final_val_ppl: float = math.nan
    sample: str = ""
    run_dir: str = ""
    stop_reason: str = ""
    plan: dict[str, Any] = field(default_factory=dict)
    """The run plan (``RunPlan.to_dict()``): what was asked, resolved and estimated before the first step."""
    summary: dict[str, Any] = field(default_factory=dict)
    """What the run did: wall time, tokens/s, MFU, best val loss (also ``RUN/summary.json``)."""
    interrupted: int | None = None
    """The signal (SIGINT 2, SIGTERM 15) that stopped the run early, after its checkpoint; None otherwise."""


# -------------------------------------------------------------------------------------------------- train


def train(
    config: Config | str | None = None,
    *,
    data_path: str | list[str] | None = None,
    model: str | None = None,
    size: str | None = None,
    num_epochs: float | None = None,
    batch_size: int | str | None = None,
    learning_rate: float | None = None,
    save_dir: str | None = None,
    device: str | None = None,
    max_steps: int | None = None,
    dry_run: bool = False,
    **overrides: Any,
) -> tuple[nn.Module, Any, History]:
    """Train a model; returns ``(model, tokenizer, history)``.

    ``config`` is a Config, a preset name or a TOML path. With none, the rule of the command line applies: a
    call that names ``data_path``, ``model`` or ``size`` starts from the defaults of that family and size, a
    bare call trains the quickstart preset. The keyword arguments mirror the INL guide's ``train_inl_llm``;
    ``overrides`` take dotted keys as in the CLI (``**{"train.warmup_steps": 10}``). ``dry_run``: print the
    plan and return (``history.plan``) without training or writing anything.
    """
    if not isinstance(config, Config):
        named = {"model.family": model, "model.size": size}
        config = load_config(
            config,
            _overrides(
                data_path,
                num_epochs,
                batch_size,
                learning_rate,
                save_dir,
                device,
                max_steps,
                named,
                overrides,
                _keywords(train),
            ),
        )
    return run_training(config, dry_run=dry_run)


def _overrides(
    data_path: str | list[str] | None,
    num_epochs: float | None,
    batch_size: int | str | None,
    learning_rate: float | None,
    save_dir: str | None,
    device: str | None,
    max_steps: int | None,
    named: dict[str, Any],
    overrides: dict[str, Any],
    keywords: list[str],
) -> dict[str, Any]:
    """The API's keyword arguments as the dotted keys of the command line (the ones left None are not given)."""
    kw: dict[str, Any] = {}
    if data_path is not None:
        if isinstance(data_path, (str, os.PathLike)):
            data_path = [data_path]
        elif not isinstance(data_path, (list, tuple)):
            raise ConfigError(
                f"data_path must be a path or a list of paths, got {type(data_path).__name__} {data_path!r}"
            )
        kw["data.sources"] = [_path_text(d) for d in data_path]
    common = {
        "train.epochs": num_epochs,
        "train.batch_size": batch_size,
        "train.learning_rate": learning_rate,
        "run.out": _path_text(save_dir),
        "perf.device": device,
        "train.max_steps": max_steps,
    }
    kw.update({k: v for k, v in {**named, **common}.items() if v is not None})
    from gptoughts.config.schema import bare_keys

    dotted = bare_keys()
    for key, value in overrides.items():
        if "." in key:
            kw[key] = value
        elif key in dotted:  # a setting named without its section, as the command line takes it
            kw[dotted[key]] = value
        else:  # a misspelt keyword
            _refuse_bare_key(key, keywords)
    return kw


def _path_text(path: Any) -> Any:
    """A ``pathlib.Path`` (any ``os.PathLike``) as the string the config holds; anything else as given."""
    return os.fspath(path) if isinstance(path, os.PathLike) else path


def _keywords(fn: Any) -> list[str]:
    """The keyword arguments of the API function ``fn`` (its dotted-key ``overrides`` aside)."""
    import inspect

    return [p for p in inspect.signature(fn).parameters if p not in ("config", "overrides")]


def _refuse_bare_key(key: str, keywords: list[str]) -> None:
    """One line for a keyword that is neither an argument nor a setting (dotted, or by its bare name): the argument
    or the setting it is closest to (as the command line's ``did you mean``)."""
    from gptoughts.config.schema import bare_keys
    from gptoughts.errors import closest, did_you_mean

    dotted = bare_keys()
    for fn in (train, finetune):
        if key in _keywords(fn):
            raise ConfigError(f"`{key}` is an argument of gptoughts.{fn.__name__}, not of this function")
    near = closest(key, [*keywords, *dotted])
    if near in keywords:
        hint = f" (did you mean `{near}`?)"
    elif near is not None:
        hint = f" (did you mean **{{{dotted[near]!r}: ...}}?)"
    else:
        hint = did_you_mean(key, keywords)
    raise ConfigError(f"unknown argument `{key}`{hint}")


def finetune(
    config: Config | str | None = None,
    *,
    model_path: str | None = None,
    data_path: str | list[str] | None = None,
    lora: bool | None = None,
    num_epochs: float | None = None,
    batch_size: int | str | None = None,
    learning_rate: float | None = None,
    save_dir: str | None = None,
    device: str | None = None,
    max_steps: int | None = None,
    trust_remote_code: bool | None = None,
    dry_run: bool = False,
    **overrides: Any,
) -> tuple[nn.Module, Any, History]:
    """Fine-tune a Hugging Face model (``model_path``: a local folder or a hub id ``ORG/NAME``, from the Hugging Face
    cache) on ``data_path``; ``(model, tokenizer, history)``.

    The same pipeline as :func:`train` (``config`` defaults to the ``finetune`` preset): JSONL with
    prompt/response or messages trains on the responses only; plain text continues pretraining. ``lora=True``
    trains PEFT LoRA adapters (``lora.*`` overrides: ``**{"lora.r": 8}``).
    """
    if not isinstance(config, Config):
        named = {
            "model.init_from": _path_text(model_path),
            "lora.enabled": lora,
            "model.trust_remote_code": trust_remote_code,
        }
        config = load_config(
            config if config is not None else "finetune",
            _overrides(
                data_path,
                num_epochs,
                batch_size,
                learning_rate,
                save_dir,
                device,
                max_steps,
                named,
                overrides,
                _keywords(finetune),
            ),
        )
    if config.model.init_from is None and config.run.resume:
        from gptoughts.training.rundir import check_finetune_base

        check_finetune_base(config)  # no run to resume, or one trained from scratch: said by name
    if config.model.init_from is None:
        raise ConfigError("finetune needs a pretrained model: pass model_path (--model HF_DIR)")
    return run_training(config, dry_run=dry_run)


def run_training(cfg: Config, *, dry_run: bool = False) -> tuple[nn.Module, Any, History]:
    """Assemble the run (``training/build.py``), print its plan, train, print and write the summary."""
    from gptoughts.perf.startup import Startup, startup_clock
    from gptoughts.tools.task_scorer import read_scorer
    from gptoughts.training.build import build
    from gptoughts.training.environment import setup_environment
    from gptoughts.training.metrics import console

    startup = Startup(imports_s=0.0, origin=startup_clock())
    startup.imports_s = startup.age()
    # every task file, harness name and harness dataset checked before anything is built or written
    ev = cfg.eval
    tasks = read_scorer(ev.eval_tasks, task_dir=ev.eval_task_dir, limit=ev.eval_tasks_limit)
    env = setup_environment(cfg)
    undo: Any = None
    try:
        undo = _start_from_run(cfg, env, dry_run)  # --model RUN: its export, kept in OUT/base
        with _disk_full_is_a_user_error(Path(cfg.run.out)), _out_of_memory_is_a_user_error(env.device):
            asm = build(cfg, dry_run=dry_run, env=env, tasks=tasks)  # prints the plan
        startup.assembly_s = startup.age() - startup.imports_s
        main = env.dist.is_main
        history = History(run_dir=str(asm.run_dir), plan=asm.plan.to_dict())
        if dry_run:
            history.stop_reason = "dry run: nothing trained or written"
            return asm.model.raw, asm.data.tokenizer, history
        try:
            if main and cfg.lora.enabled and cfg.train.learning_rate < 1e-4:
                console.print(
                    f"[yellow]hint:[/yellow] LoRA usually wants a larger learning rate than full "
                    f"fine-tuning (~2e-4); this run uses {cfg.train.learning_rate:g} (--lr)"
                )
            if main and asm.model.pretrained is not None and asm.model.pretrained.notice:
                console.print(asm.model.pretrained.notice, highlight=False)
            if main:
                # An earlier session's summary (read above, by the build) would outlive a session that fails (a
                # divergence, a crash) and say the run ended as that one did: this session writes its own, or none.
                (asm.run_dir / "summary.json").unlink(missing_ok=True)
            # where this session starts (a resumed run's step and tokens): the summary tells its figures apart
            start, t0 = (asm.trainer.state.step, asm.trainer.state.tokens_seen), time.perf_counter()
            with _disk_full_is_a_user_error(asm.run_dir), _out_of_memory_is_a_user_error(env.device):
                st = asm.trainer.fit(startup)
            wall = time.perf_counter() - t0
            history = _history(asm, st, history)
            history.sample = _final_sample(asm)
            if main:
                history.summary = _summary(asm, history, wall, start)
                _print_summary(asm, history)
            # The ranks leave together: under torchrun a rank that exits non-zero first (an interrupt's 130 or 143)
            # gets the others killed, rank 0 in the middle of its summary.
            pdist.barrier(env.dist)
        finally:
            asm.close()
        return asm.model.raw, asm.data.tokenizer, history
    finally:
        if undo is not None:
            undo()
        pdist.shutdown()


_BASE_SOURCE = "gptoughts_source.json"
"""In the export a fine-tune keeps of the run it started from (OUT/base): that run, its checkpoint and step."""


@dataclass(frozen=True)
class RunBase:
    """A gptoughts run named as a fine-tune's model: the checkpoint it starts from."""

    run: Path
    checkpoint: Path
    step: int


def run_base(spec: str | None) -> RunBase | None:
    """What a fine-tune whose ``model.init_from`` is ``spec`` starts from when ``spec`` is a gptoughts run: its newest
    checkpoint, the one ``gptoughts export RUN`` reads (a checkpoint of a run: that one). None for a model folder
    or a hub id; a run with no checkpoint yet is refused in one line. Reads only."""
    from gptoughts.models.hf_export import run_of_model

    run = run_of_model(spec) if spec else None
    if run is None:
        return None
    try:
        ck = ckpt.resolve(Path(str(spec)).expanduser())
    except UserError:
        _refuse_a_run_before_its_first_checkpoint(run)
        raise
    return RunBase(run=run, checkpoint=ck, step=int(ckpt.read_meta(ck)["step"]))


def _start_from_run(cfg: Config, env: Any, dry_run: bool) -> Any:
    """``--model RUN``: the fine-tune starts from what ``gptoughts export RUN`` writes (the newest checkpoint, LoRA
    merged, with the run's tokenizer and chat template), kept inside the new run as OUT/base, where the run, its
    resume, sample and export read it whatever the source run does next (trains on, is replaced). ``model.init_from``
    becomes that folder and the plan names the run and step. A resume reads the base its run kept; a dry run
    exports into a temporary folder. Returns what undoes the export where no run came of it (None: nothing to)."""
    from gptoughts.data.sources import read_json_dict
    from gptoughts.training import rundir
    from gptoughts.training.metrics import console

    out = Path(cfg.run.out).expanduser()
    kept = out / rundir.BASE_DIR
    source = read_json_dict(kept / _BASE_SOURCE) or {}
    if cfg.run.resume and isinstance(source.get("step"), int) and isinstance(source.get("run"), str):
        # the base the run kept: named again (RUN, wherever it is now) or as its config.toml has it (OUT/base)
        base = run_base(cfg.model.init_from)
        given = base.run if base is not None else Path(str(cfg.model.init_from)).expanduser()
        if given.resolve() in (Path(source["run"]).resolve(), kept.resolve()):
            now = f"; {base.run} is at step {base.step:,} now" if base and base.step != source["step"] else ""
            cfg.model.init_from = str(kept.resolve())
            cfg.resolved["base"] = (
                f"{source['run']} at step {source['step']:,} (its export, kept in {kept}{now})"
            )
        return None  # (another base named is refused by the resume as such)
    base = None if cfg.run.resume else run_base(cfg.model.init_from)
    if base is None:
        return None
    # (reads only) what a new run refuses: a folder not empty, a run without --overwrite
    rundir.check(out, cfg)
    if rundir.is_run(out):
        raise UserError(
            f"{out} holds a run, whose files --overwrite replaces only once this run is checked, while the export "
            f"of {base.run} goes into {kept} before; remove {out}, or choose another --out"
        )
    created = not out.exists()

    def export_base() -> str:
        """Rank 0's export (a refusal or a full disk is one line on every rank, not a hang in the others'
        broadcast), under the run's lock: a second launch on this --out is refused, not writing over it."""
        target = Path(tempfile.mkdtemp(prefix="gptoughts-base-")) / rundir.BASE_DIR if dry_run else kept
        lock = None if dry_run else rundir.RunLock.acquire(out)
        console.print(
            f"base: exporting {base.run} at step {base.step:,} into {target} (LoRA merged)", highlight=False
        )
        try:
            with _disk_full_is_a_user_error(out):
                export(base.checkpoint, target, overwrite=True, trust_remote_code=cfg.model.trust_remote_code)
                record = {
                    "run": str(base.run.resolve()),
                    "checkpoint": str(base.checkpoint.resolve()),
                    "step": base.step,
                }
                (target / _BASE_SOURCE).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        except BaseException:
            shutil.rmtree(target.parent if dry_run else target, ignore_errors=True)
            raise
        finally:
            if lock is not None:
                lock.release()
                if created and not (out / rundir.BASE_DIR).exists():
                    with contextlib.suppress(OSError):
                        out.rmdir()  # (the folder the lock made, when the export failed)
        return str(target)

    target = Path(pdist.on_main(export_base, env.dist))  # (a dry run's temporary folder is rank 0's)
    cfg.model.init_from = str(target.resolve())
    where = f"a temporary folder for this dry run; a run keeps it in {kept}" if dry_run else str(kept)
    cfg.resolved["base"] = f"{base.run} at step {base.step:,} (its export, in {where})"

    def undo() -> None:
        if env.dist.is_main and (dry_run or not (out / "run.json").exists()):
            shutil.rmtree(target.parent if dry_run else target, ignore_errors=True)
            if created and not dry_run:
                with contextlib.suppress(OSError):
                    out.rmdir()  # (when empty)

    return undo


@contextlib.contextmanager
def _disk_full_is_a_user_error(run_dir: Path) -> Iterator[None]:
    """A full disk (data cache, tokenizer, checkpoint; whichever library wrote) is one line naming the run's last
    good checkpoint, not a traceback: every write goes to a temp file or folder renamed into place, so what was
    already saved is intact."""
    try:
        yield
    except Exception as e:
        full = as_disk_full(e)
        if full is None:
            raise
        where = f" while writing {full.filename}" if full.filename else ""
        last = ckpt.latest_valid(run_dir / "checkpoints") if run_dir.is_dir() else None
        kept = (
            f"the last good checkpoint, {last}, is intact: free some space (or point --out / GPTOUGHTS_CACHE "
            f"elsewhere) and continue from it with --resume auto --out {run_dir}"
            if last is not None
            else "no checkpoint of this run was written yet: free some space (or point --out / GPTOUGHTS_CACHE "
            "elsewhere) and run again"
        )
        raise UserError(f"disk full{where} ({full.strerror}); {kept}") from None


def _final_sample(asm: Any) -> str | None:
    """The summary's sample of the first prompt, once training and its last checkpoint are done: the trainer's from
    the final step when it sampled there (the same seeded text), else generated now. A failure is one warning line:
    a sample never turns a finished run into an error. An interrupted run has none: it stops at its checkpoint,
    within a scheduler's SIGTERM grace period, and ``gptoughts sample RUN`` generates from that checkpoint."""
    trainer, d = asm.trainer, asm.env.dist
    if trainer.stop_signal is not None:
        return None
    prompts = trainer.evaluator.cfg.sample_prompts  # resolved: None became the data's own
    ev = trainer.evaluator
    # No sampler: a pipeline's stages do not generate (run plan), or sampling failed during the run (warned then).
    if not prompts or ev.sampler is None:
        return None
    if ev.last_samples is not None and ev.last_samples[0] == trainer.state.step:
        return ev.last_samples[1][0]
    if not (d.is_main or d.sharded):  # under FSDP or TP every rank takes part in generation
        return None
    asm.model.raw.eval()
    try:
        with trainer.autocast():
            return ev.sampler(prompts[0])
    except Exception as e:  # noqa: BLE001 - said in one line; the run is complete
        trainer.log_line(
            f"warning: the end-of-run sample failed ({first_line(e)}); the run and its checkpoints are complete "
            "(generate from them with gptoughts sample RUN)"
        )
        return None


@contextlib.contextmanager
def _out_of_memory_is_a_user_error(device: torch.device) -> Iterator[None]:
    """Out of memory while building or training (on a CPU a failed allocation, when the kernel does not kill the
    process first): one line, not a traceback; checkpoints are written atomically, so those on disk are intact."""
    from gptoughts.perf.autobatch import is_oom

    try:
        yield
    except RuntimeError as e:  # torch.OutOfMemoryError is one
        if not is_oom(e):
            raise
        what = "GPU memory" if device.type == "cuda" else "memory"
        raise UserError(
            f"out of {what}; lower --batch_size (raise --grad_accum to keep the global batch) or --block_size"
            + ("" if device.type == "cuda" else ", or train a smaller --size here")
            + "; checkpoints already written are intact"
        ) from None


def _history(asm: Any, st: Any, history: History) -> History:
    history.steps, history.tokens, history.stop_reason = st.step, st.tokens_seen, asm.trainer.stop_reason
    if history.stop_reason == "max steps" and asm.cfg.train.max_steps is None:
        # the epochs or tokens asked for, as the plan named them ("--epochs 2", "epochs 2 in good.toml")
        history.stop_reason = asm.batch.stop_rule.split(" (")[0]
    history.interrupted = asm.trainer.stop_signal
    for h in st.history:
        history.eval_steps.append(h["step"])
        history.val_loss.append(h["val_loss"])
        history.val_ppl.append(h["val_ppl"])
    if history.val_loss:
        history.final_val_loss, history.final_val_ppl = history.val_loss[-1], history.val_ppl[-1]
    return history


def _summary(asm: Any, history: History, wall: float, start: tuple[int, int]) -> dict[str, Any]:
    """What the run did, for the end of the log and ``RUN/summary.json``; the plots are drawn here too. ``steps``
    and ``tokens`` are the whole run's; ``session_*``, ``wall_s``, ``tokens_per_s`` and ``mfu`` this process's,
    which resumed the run at ``start`` = (step, tokens)."""
    from gptoughts.training.checkpoint.store import write_text_atomic
    from gptoughts.training.evaluation import best_evaluation

    tokens = history.tokens - start[1]
    tps = tokens / wall if wall > 0 else None
    peak = asm.env.hw.peak_bf16_flops if asm.env.device.type == "cuda" else None
    flops = asm.model.raw.flops_per_token(asm.batch.block_size)
    best = best_evaluation(asm.trainer.state.history)  # (as best.json names it)
    plots = asm.plots.close() if asm.plots is not None else []
    asm.plots = None
    summary = {
        "steps": history.steps,
        "tokens": history.tokens,
        "resumed_at_step": start[0] or None,
        "session_steps": history.steps - start[0],
        "session_tokens": tokens,
        "wall_s": round(wall, 2),
        "tokens_per_s": tps,
        "mfu": flops * tps / (peak * asm.env.dist.world_size) if tps and peak else None,
        "best_val_loss": best[0] if best else None,
        "best_step": best[1] if best else None,
        "final_val_loss": history.final_val_loss if math.isfinite(history.final_val_loss) else None,
        "final_val_ppl": history.final_val_ppl if math.isfinite(history.final_val_ppl) else None,
        "stop_reason": history.stop_reason,
        "startup": asm.trainer.startup.to_dict() if asm.trainer.startup.first_step_s else None,
        "checkpoints": str(asm.run_dir / "checkpoints") if asm.cfg.checkpoint.checkpoints else None,
        "plots": [str(p) for p in plots],
        "sample": history.sample,
    }
    if asm.trainer.evaluator.task_scores:  # the last scores of eval.eval_tasks
        summary["tasks"] = asm.trainer.evaluator.task_scores
    if asm.trainer.evaluator.last_pair_metrics:  # DPO: the last held-out accuracy and reward margin
        summary["preference"] = asm.trainer.evaluator.last_pair_metrics
    write_text_atomic(asm.run_dir / "summary.json", json.dumps(summary, indent=2))
    return summary


def _print_summary(asm: Any, history: History) -> None:
    from gptoughts.training.metrics import console

    s, run = history.summary, asm.run_dir
    if history.sample:
        prompt = asm.trainer.evaluator.cfg.sample_prompts[0]
        console.print(f"[bold]sample[/bold] ({prompt!r}):\n{history.sample}", highlight=False)
    speed = f"{s['tokens_per_s']:,.0f} tokens/s" if s["tokens_per_s"] else "-"
    mfu = f", MFU {s['mfu']:.3f}" if s["mfu"] else ""
    best = (
        f"best val loss {s['best_val_loss']:.4f} at step {s['best_step']}"
        if s["best_val_loss"] is not None
        else "no evaluation"
    )
    pref = s.get("preference")  # (a DPO loss has no perplexity)
    final = ""
    if s["final_val_loss"] is not None:
        last = (
            f"preference accuracy {pref['val_dpo/accuracy']:.3f}"
            if pref
            else f"perplexity {s['final_val_ppl']:.2f}"
        )
        final = f" (final {s['final_val_loss']:.4f}, {last})"
    session = (
        f"{s['session_steps']:,} steps, {s['session_tokens']:,} tokens in {_clock(s['wall_s'])}, {speed}{mfu}"
    )
    if s["resumed_at_step"]:  # the run's totals apart from what this session did (and timed)
        session = f"run: {s['steps']:,} steps, {s['tokens']:,} tokens; this session: {session}"
    console.print(f"[bold]done[/bold] ({history.stop_reason}): {session}; {best}{final}", highlight=False)
    plots = f"{run / 'plots'}/ (overview.png)" if s["plots"] else "none (pip install matplotlib)"
    saved = s["checkpoints"] or "none (checkpoint.checkpoints false)"
    console.print(f"  run: {run}   checkpoints: {saved}   plots: {plots}", highlight=False)
    if not s["checkpoints"]:  # sample, eval, export and resume all read a checkpoint
        console.print(f"  next: gptoughts plot {run}", highlight=False)
        return
    # what eval scores for this run: eval --data reads plain text and refuses a fine-tuning's examples
    scored = (
        "--prefs PAIRS.jsonl"
        if asm.data.prefs is not None
        else "--tasks TASKS.jsonl"
        if asm.data.sft is not None
        else "--data PATH"
    )
    # An interrupted run continues to its own end as it is; a finished one needs a budget past where it stopped;
    # an early-stopped one keeps its used-up patience (it would stop again at its next evaluation).
    more = (
        ""
        if history.stop_reason.startswith("interrupted")
        else " --early_stopping_patience none"
        if history.stop_reason == "early stopping"
        else " --max_steps N"
    )
    console.print(
        f'  next: gptoughts sample {run} --prompt "..."  |  gptoughts eval {run} {scored}  |  '
        f"gptoughts export {run} --format hf OUT  |  {_resume_command(run)}{more}  |  gptoughts plot {run}",
        highlight=False,
    )


def _resume_command(run: Path) -> str:
    """How this run resumes: launched as it was, since a plain ``gptoughts train`` resumes it on one process."""
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    if ranks == 1:
        return f"gptoughts train --resume auto --out {run}"
    if int(os.environ.get("LOCAL_WORLD_SIZE", ranks)) < ranks:  # several nodes: their own torchrun flags
        return f"the same torchrun command with --resume auto --out {run}"
    return f"torchrun --nproc_per_node {ranks} -m gptoughts train --resume auto --out {run}"


def _clock(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{seconds:.1f}s"


# ---------------------------------------------------------------------------------------------- load etc.


@dataclass
class Loaded:
    model: nn.Module
    tokenizer: Any
    config: Config
    checkpoint: Path
    family: str
    chat: bool = False
    """Prompts go through the chat template by default (SFT and DPO runs, HF folders whose tokenizer has one)."""
    init_from: str | None = None
    """The HF folder the run started from (export keeps its config's extra keys)."""
    args: Any = None
    trained_system: str | bool | None = None
    """The system message that opened every conversation of a fine-tuning (True: each its own), None otherwise."""


def load(path: str | Path, device: str = "auto", *, trust_remote_code: bool = False) -> Loaded:
    """Load a trained model from a run directory, a checkpoint directory or a Hugging Face model folder.

    Runs fine-tuned with LoRA (or of an architecture without native code) rebuild the base model from their
    ``model.init_from`` folder, then load the checkpoint (the adapters) over it; the result is the PEFT model
    (``merge_and_unload()`` gives the plain one)."""
    from gptoughts.data.tokenizer import Tokenizer

    if not isinstance(path, (str, os.PathLike)):
        raise UserError(f"load takes the path of {MODEL_PATHS}, got {type(path).__name__}")
    check_model_path(os.fspath(path))
    dev = hardware.resolve_device(device)
    if is_hf_folder(path):
        return _load_hf_folder(path, dev, trust_remote_code)
    try:
        ck = ckpt.resolve(path)
    except UserError:
        _refuse_a_run_before_its_first_checkpoint(Path(path).expanduser())
        raise
    run_dir = ckpt.run_of(ck) or ck.parent
    cfg, run = _read_run(run_dir)
    _check_run_tokenizer(run_dir)  # before the weights, which can take minutes to read
    tokenizer = Tokenizer.load(run_dir / "tokenizer")
    init_from = run.get("init_from")
    if init_from and (cfg.lora.enabled or run.get("generic")):
        if cfg.lora.enabled:
            check_base_unchanged(run_dir, init_from, run.get("base_fingerprint"))
        model, family_name, args, weights = _build_over_base(run_dir, cfg, init_from, dev, trust_remote_code)
    else:
        model, family_name, args = _build_native(run_dir / "run.json", run, dev)
        weights = model
    # a run still training may rotate ck away before it is read: then its newest checkpoint is read instead
    ck = ckpt.read_newest(path, lambda c: restore.load_weights(weights, c), first=ck)
    model.eval()
    return Loaded(
        model=model,
        tokenizer=tokenizer,
        config=cfg,
        checkpoint=ck,
        family=family_name,
        chat=run.get("data_format") in ("sft", "prefs"),  # DPO renders pairs as SFT turns
        init_from=init_from,
        args=args,
        trained_system=run.get("sft_system"),
    )


MODEL_PATHS = (
    "a run directory, a checkpoint directory or a Hugging Face model folder (what save_pretrained writes)"
)
"""What ``load`` (``sample``, ``eval``, ``export``) reads, as their errors name it."""


def _check_run_tokenizer(run_dir: Path) -> None:
    if not (run_dir / "tokenizer" / "tokenizer.json").is_file():
        raise DataError(
            f"{run_dir}/tokenizer/tokenizer.json is missing (it encodes prompts and decodes the outputs); put back "
            "the run's tokenizer/ folder from a copy of the run"
        )


def check_model_path(spec: str) -> str:
    """``spec`` when it can name a model to read (:data:`MODEL_PATHS`); otherwise a one-line error naming what is
    accepted, checked before anything loads. A hub id (``ORG/NAME``) is not fetched here: the hint says how."""
    from gptoughts.models.hf import CONFIG_NAME, is_hub_id

    p = Path(spec).expanduser()
    if not p.exists():
        hub = (
            f"; for a model of the Hugging Face hub, `hf download {spec} --local-dir DIR`, then pass DIR"
            if is_hub_id(spec)
            else ""
        )
        raise UserError(f"{spec} does not exist; pass {MODEL_PATHS}{hub}")
    if not p.is_dir():
        raise UserError(f"{spec} is a file; pass {MODEL_PATHS}")
    marks = ("run.json", "config.toml", CONFIG_NAME, "checkpoints", ckpt.META_FILE, ckpt.MODEL_FILE)
    # what ckpt.resolve reads: a checkpoint's files, or step_N folders (.old-step_N-*: a replace a crash cut short)
    if not any((p / m).exists() for m in (*marks, ckpt.DCP_METADATA)) and not any(
        "step_" in c.name for c in p.iterdir()
    ):
        raise UserError(
            f"{spec} holds no run, checkpoint or model (no run.json, checkpoint or config.json); pass {MODEL_PATHS}"
        )
    from gptoughts.data.sources import is_run_folder

    # a run, or a checkpoint of one: its tokenizer too (`eval A B` loads A before B)
    run = next((f for f in (p, p.parent.parent) if is_run_folder(f)), None)
    if run is not None:
        _check_run_tokenizer(run)
    return spec


def _refuse_a_run_before_its_first_checkpoint(run: Path) -> None:
    """A run with no checkpoint at all, said as such: when it saves its first (its plan in run.json), or
    that it never will. Anything else (checkpoints there but none intact) is left to the checkpoint store's
    error."""
    from gptoughts.data.sources import is_run_folder, read_json_dict
    from gptoughts.training.rundir import in_use

    saved = (c for pattern in ("step_*", ".old-step_*") for c in (run / "checkpoints").glob(pattern))
    if not is_run_folder(run) or any(saved):  # (a .tmp-step_* folder is a first save still being written)
        return
    record = read_json_dict(run / "run.json") or {}
    batch = (record.get("plan") or {}).get("batch") or {}
    if batch.get("checkpoints") is False:
        raise UserError(
            f"{run} was trained with checkpoint.checkpoints false: it has no checkpoint to load; train it again "
            "without that option"
        )
    if not in_use(run):
        origin = record.get("branched_from")
        if origin:  # a branch: `--resume auto` goes on from its origin, which can be read meanwhile
            raise UserError(
                f"{run} stopped before its first checkpoint; it branched from {origin}: read that one, or go on "
                f"with `gptoughts train --resume auto --out {run}`"
            )
        raise UserError(f"{run} stopped before its first checkpoint and has nothing to load; train it again")
    every, total = batch.get("save_interval"), batch.get("total_steps")
    if not isinstance(total, int):
        return
    first = (
        f"at step {every:,} (then every {every:,}), " if isinstance(every, int) and 0 < every < total else ""
    )
    raise UserError(
        f"{run} is training and has no checkpoint yet: it saves {first}at its end (step {total:,}) and when stopped "
        "with Ctrl-C or SIGTERM; try again after that save"
    )


def _load_hf_folder(path: str | Path, dev: torch.device, trust_remote_code: bool) -> Loaded:
    pre = load_pretrained(path, device=dev, trust_remote_code=trust_remote_code)
    return Loaded(
        model=pre.model.eval(),
        tokenizer=pre.tokenizer,
        config=load_config("default"),
        checkpoint=Path(path),
        family=pre.family or GENERIC_FAMILY.name,
        chat=pre.tokenizer.chat_template is not None,
        init_from=str(path),
        args=pre.model.args,
    )


def _run_holding(path: Path) -> Path | None:
    """The run ``path`` is, or whose checkpoints folder or checkpoint it is; None for anything else."""
    from gptoughts.data.sources import is_run_folder

    return next((f for f in (path, path.parent, path.parent.parent) if is_run_folder(f)), None)


def _read_run(run_dir: Path) -> tuple[Config, dict[str, Any]]:
    """The run's config.toml and run.json, or a UserError naming the file that is missing or corrupt."""
    cfg_file, run_file = run_dir / "config.toml", run_dir / "run.json"
    if not cfg_file.exists() or not run_file.exists():
        raise UserError(
            f"{run_dir} has no config.toml/run.json next to its checkpoints; is it a gptoughts run?"
        )
    try:
        cfg = config_from_toml_text(cfg_file.read_text(encoding="utf-8"))
    except (ValueError, OSError, UserError) as e:  # tomllib's error is a ValueError; ConfigError: wrong keys
        raise UserError(
            f"{cfg_file} is corrupt ({str(e).splitlines()[0][:150]}); restore it from a copy"
        ) from None
    try:
        run = json.loads(run_file.read_text(encoding="utf-8"))
        if not isinstance(run, dict) or "family" not in run or not isinstance(run.get("args", {}), dict):
            raise ValueError("no family/args")
    except (ValueError, OSError) as e:
        raise UserError(
            f"{run_file} is corrupt ({str(e).splitlines()[0][:150]}); restore it from a copy"
        ) from None
    return cfg, run


def _build_over_base(
    run_dir: Path, cfg: Config, init_from: str, dev: torch.device, trust_remote_code: bool
) -> tuple[nn.Module, str, Any, nn.Module]:
    """A run that holds only what was trained on top of its ``init_from`` folder (LoRA adapters, or a generic
    transformers model): the base rebuilt; last, what the checkpoint is loaded into, over it."""
    from gptoughts.training.setup import TrainableWeights, apply_lora

    if not Path(init_from).is_dir():
        raise UserError(
            f"{run_dir} holds only what was trained on top of {init_from}, which is missing; {restore_hint(init_from)}"
        )
    pre = load_pretrained(
        init_from, device=dev, trust_remote_code=cfg.model.trust_remote_code or trust_remote_code
    )
    model, family_name, args = pre.model, pre.family or GENERIC_FAMILY.name, pre.model.args
    if cfg.lora.enabled:
        # QLoRA adapters are put back over the full-precision base (the usual way to merge and export them:
        # the result differs from the 4-bit training-time model by the base's quantization error only), so a
        # QLoRA run loads, samples and exports on any device.
        model = apply_lora(model, replace(cfg.lora, quantize="none"), device=dev)
    return model, family_name, args, TrainableWeights(model) if cfg.lora.enabled else model


def _build_native(run_file: Path, run: dict[str, Any], dev: torch.device) -> tuple[nn.Module, str, Any]:
    """A native family's model rebuilt from run.json's args (the checkpoint's weights are loaded into it)."""
    from gptoughts.training.setup import build_raw_model

    family = models.get_family(run["family"])
    try:
        args = family.args_cls(**run["args"])
    except (TypeError, ValueError) as e:
        raise UserError(f"{run_file} is corrupt (args: {e}); restore it from a copy") from None
    return build_raw_model(family.name, args, dev, seed=0), family.name, args


def generate_text(
    loaded: Loaded,
    prompt: str,
    *,
    max_new_tokens: int = 128,
    temperature: float = 0.8,
    top_k: int | None = 50,
    top_p: float | None = None,
    seed: int | None = None,
    chat: bool | None = None,
    system: str | None = None,
) -> str:
    """Continue ``prompt`` (``gptoughts.generate``). Masked-diffusion families (LLaDA) use the diffusion sampler
    (``temperature`` as Gumbel noise; ``top_k``/``top_p`` do not apply) and stop at the first eos.

    ``chat`` (default ``loaded.chat``): the prompt is a user message rendered with the chat template (the
    tokenizer's own, else the SFT default) and only the assistant's answer is returned. ``system``: a system message
    rendered before it, as a model fine-tuned on conversations that open with one was trained (chat only)."""
    _check_generate_args(loaded, prompt, max_new_tokens, temperature, top_k, top_p, seed)
    check_system(loaded, system, chat)
    return sampler(loaded)(
        prompt,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        chat=chat,
        system=system,
    )


def check_system(loaded: Loaded | None, system: Any, chat: bool | None, flag: str = "") -> None:
    """A system message is given as a string, to a chat prompt (``chat`` None: the model's default; ``loaded`` None:
    not loaded yet, only what the arguments say): one line otherwise, naming the setting (``flag``: "--" for the
    command line), since plain text has no turn to put it in."""
    if system is None:
        return
    if not isinstance(system, str):
        raise UserError(f"{flag}system must be a string, got {type(system).__name__} {system!r:.60}")
    if chat is False:
        off = "--chat off" if flag else "chat=False"
        raise UserError(
            f"{flag}system is a turn of a chat prompt and {off} samples plain text; drop {off}, or put the text at "
            "the start of the prompt"
        )
    if chat is None and loaded is not None and not loaded.chat:
        on = "--chat on" if flag else "chat=True"
        raise UserError(
            f"{flag}system is a turn of a chat prompt and this model samples plain text (it was not fine-tuned on "
            f"conversations and has no chat template); put the text at the start of the prompt ({on} renders "
            "both with the default chat template, which it was not trained on)"
        )


def _check_generate_args(
    loaded: Any, prompt: Any, max_new_tokens: Any, temperature: Any, top_k: Any, top_p: Any, seed: Any
) -> None:
    """``generate``'s arguments, each checked as ``gptoughts sample`` checks its flags: one line naming the argument
    (a wrong type was a library's error about something else, and a NaN temperature silently sampled noise)."""
    _check_loaded(loaded, "generate", "gptoughts.generate(loaded, PROMPT)")
    if isinstance(prompt, (list, tuple)):  # a batch of prompts: one call each
        raise UserError(
            f"prompt must be one string, got a {type(prompt).__name__} of {len(prompt)}; generate each: "
            "[gptoughts.generate(loaded, p) for p in prompts]"
        )
    if not isinstance(prompt, str):
        raise UserError(f"prompt must be a string, got {type(prompt).__name__} {prompt!r:.60}")
    check_sampling(max_new_tokens, temperature, top_k, top_p, seed)


def _check_loaded(loaded: Any, function: str, call: str) -> None:
    if not isinstance(loaded, Loaded):
        raise UserError(
            f"{function} takes the model gptoughts.load returns, got {type(loaded).__name__}: "
            f"loaded = gptoughts.load(RUN_DIR); {call}"
        )


def _whole(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_sampling(
    max_new_tokens: Any, temperature: Any, top_k: Any, top_p: Any, seed: Any, flag: str = ""
) -> None:
    """The sampling settings' types and ranges, one line naming the setting (``flag``: "--" for the command line,
    which checks them before a model loads)."""

    def real(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    if not _whole(max_new_tokens) or max_new_tokens < 1:
        raise UserError(f"{flag}max_new_tokens must be a whole number >= 1, got {max_new_tokens!r}")
    if not real(temperature) or temperature < 0:
        raise UserError(f"{flag}temperature must be a number >= 0 (0: greedy), got {temperature!r}")
    if top_k is not None and (not _whole(top_k) or top_k < 0):
        raise UserError(
            f"{flag}top_k must be a whole number >= 0 (0 or None: no top-k filtering), got {top_k!r}"
        )
    if top_p is not None and (not real(top_p) or not 0 < top_p <= 1):
        raise UserError(f"{flag}top_p must be a number in (0, 1] (None: no nucleus filtering), got {top_p!r}")
    if seed is not None and not _whole(seed):
        raise UserError(f"{flag}seed must be a whole number or None, got {seed!r}")


def sampler(loaded: Loaded) -> Any:
    """The :class:`~gptoughts.sampling.Sampler` of a loaded model (causal or diffusion from its family)."""
    from gptoughts.sampling import Sampler

    diffusion = models.family_of(loaded.family).objective == "diffusion"
    return Sampler(loaded.model, loaded.tokenizer, diffusion=diffusion, chat=loaded.chat)


def eval_block(loaded: Loaded, block_size: int | None) -> int:
    """The window an evaluation scores ``loaded`` in: ``block_size``, by default the run's block (a model folder's
    config has the default one) within the model's positions; one more than those is refused in one line (the
    forward raised a traceback)."""
    return _window(block_size, loaded.config.train.block_size, getattr(loaded.args, "max_seq_len", None))


def _window(block_size: int | None, default: int, limit: int | None, name: str = "the model") -> int:
    block = block_size or default
    if limit is not None and block > limit:
        if block_size is None:
            return limit
        raise UserError(
            f"--block_size {block} is longer than {name}'s {limit} positions; pass --block_size {limit} or less"
        )
    return block


def common_eval_block(paths: list[str], block_size: int | None) -> tuple[int | None, dict[str, int]]:
    """The one window several models are scored in side by side (the same weights in other windows score another
    loss): ``block_size`` when given, refused where it exceeds one model's positions; else the smallest of their
    default windows (:func:`eval_block`'s). Read from their files, before any model loads. Returns it (None where a
    model's files do not say: each then takes its own) and each model's default."""
    defaults: dict[str, int] = {}
    for path in paths:
        default, limit = _default_window(Path(path).expanduser())
        if default is None:
            return block_size, {}
        defaults[path] = _window(None, default, limit)
        _window(block_size, default, limit, path)  # (a typed one past a model's positions: refused)
    return block_size or min(defaults.values()), defaults


def _default_window(path: Path) -> tuple[int | None, int | None]:
    """(default window, positions) of the model at ``path`` as :func:`load` would build it, read from its config
    files; (None, None) where they do not say (loading it then says what is wrong)."""
    from gptoughts.models.hf import max_positions

    if is_hf_folder(path):
        return load_config("default").train.block_size, max_positions(path)
    run = _run_holding(path)
    if run is None:
        return None, None
    cfg, record = _read_run(run)
    limit = (record.get("args") or {}).get("max_seq_len")
    base = record.get("init_from")
    if not isinstance(limit, int) and isinstance(base, str) and Path(base).is_dir():
        limit = max_positions(base)  # a generic transformers model: its base's positions
    return cfg.train.block_size, limit if isinstance(limit, int) else None


@torch.no_grad()
def evaluate(
    loaded: Loaded,
    data: str | os.PathLike | list[str],
    *,
    batch_size: int = 8,
    block_size: int | None = None,
    max_batches: int | None = None,
) -> dict[str, Any]:
    """Loss and perplexity of a loaded model on all of ``data`` (tokenized with the model's own tokenizer, in
    non-overlapping windows of ``block_size``, the last batch holding what is left), or on ``max_batches``
    batches spread evenly over it."""
    from gptoughts.data.loader import TokenDataset, eval_batches
    from gptoughts.data.prepare import cached_prepare
    from gptoughts.data.sources import refuse_prepared
    from gptoughts.training.corpus import resolve_sources
    from gptoughts.training.objectives import build_objective

    _check_loaded(loaded, "evaluate", "gptoughts.evaluate(loaded, DATA)")
    # as `gptoughts eval` checks its flags: a count below 1 would score no batch (a loss of 0.0) or divide by zero
    for name, value in (("batch_size", batch_size), ("block_size", block_size), ("max_batches", max_batches)):
        if (value is not None or name == "batch_size") and not (_whole(value) and value >= 1):
            none = "" if name == "batch_size" else " or None"
            raise UserError(f"{name} must be a whole number >= 1{none}, got {value!r}")
    if isinstance(data, (str, os.PathLike)):  # one path (a str would be read as a list of one-letter paths)
        data = [data]
    data = [_path_text(d) for d in data]
    refuse_prepared(data, with_model_tokenizer=True)  # in eval's words, not train's
    cfg = loaded.config
    block = eval_block(loaded, block_size)
    # The model's tokenizer as loaded (its folder read again without the user's --trust_remote_code was refused
    # where only the folder's own code loads it); the cache is keyed by its fingerprint either way.
    manifest = cached_prepare(
        resolve_sources(data),
        loaded.tokenizer,
        text_field=cfg.data.text_field,
        extensions=cfg.data.extensions or None,
        val_fraction=0.0,
        min_val_docs=0,
        seed=cfg.train.seed,
        cache_root=cfg.data.cache_dir,
        progress=False,
    )
    dataset = TokenDataset(manifest.dir)
    dev = next(loaded.model.parameters()).device
    fam = models.family_of(loaded.family)
    diffusion = fam.objective == "diffusion"
    objective = None if diffusion else build_objective(fam.objective)
    mc_gen = torch.Generator(device=dev).manual_seed(0) if diffusion else None
    total, count = 0.0, 0.0
    for batch in eval_batches(
        dataset,
        split="train",
        batch_size=batch_size,
        block_size=block,
        max_batches=max_batches,
        device=dev,
        whole=True,
    ):
        if diffusion:
            # Masked diffusion has no exact likelihood: a Monte-Carlo estimate of its NLL bound per token (see
            # llada.diffusion_log_likelihood). Few draws per window suffice, the corpus average pools them all.
            from gptoughts.models.llada import diffusion_log_likelihood

            x = batch[0]
            ls = diffusion_log_likelihood(loaded.model, x, n_samples=8, generator=mc_gen).sum() * x.size(1)
            n = x.numel()
        else:
            ls, n = objective(loaded.model, batch)
        total += float(ls)
        count += float(n)
    loss = total / max(count, 1.0)
    available = manifest.train_tokens
    # Each window's first token predicts nothing, and a tail shorter than a window is not scored.
    scored = f"{int(count):,} of its {available:,} tokens" + (
        " (--max_batches)"
        if max_batches is not None
        else f" (in windows of {block:,} tokens; a tail shorter than one is left out)"
    )
    return {
        "loss": loss,
        "perplexity": math.exp(min(loss, 50.0)),
        "tokens": count,
        "corpus_tokens": available,
        "scored": scored,
        "split": "all",
    }


def _refuse_export_into_source(path: str | Path, out: str | Path) -> None:
    """An export never writes over the model folder it reads: an HF folder exported onto itself, or the base a
    fine-tuned run starts from (its ``init_from``, which a LoRA run rebuilds itself over at every load). With
    --overwrite its weights were replaced by the merged ones, then the tokenizer copy failed with a traceback."""
    from gptoughts.data.sources import free_name, read_json_dict

    src = Path(path).expanduser()
    run = _run_holding(src)
    base = (read_json_dict(run / "run.json") or {}).get("init_from") if run else None
    sources = [src] if is_hf_folder(src) else []
    if isinstance(base, str) and base:
        sources.append(Path(base).expanduser())
    target = Path(out).expanduser().resolve()
    if any(s.resolve() == target for s in sources):
        beside = free_name(target.with_name(f"{target.name}-export"))
        raise UserError(
            f"{out} is the model folder {path} is read from (its weights would be replaced by the export's, "
            f"--overwrite or not); export into another folder, e.g. {beside}"
        )


# ------------------------------------------------------------------------------------------------- export


def export(
    path: str | Path,
    out: str | Path,
    *,
    format: str = "hf",
    max_shard_size: str | int = "5GB",
    dtype: str = "auto",
    overwrite: bool = False,
    device: str = "cpu",
    trust_remote_code: bool = False,
) -> Path:
    """Write a run (or checkpoint, or HF folder) as a ``transformers`` model folder; LoRA adapters are merged.

    ``dtype``: auto (the dtype of the model the run started from, fp32 for runs trained from scratch), fp32,
    bf16 or fp16. ``max_shard_size``: weights above it are split into shards with an index (e.g. ``5GB``).
    """
    from gptoughts.models.hf_export import check_out_dir, parse_size

    if format != "hf":
        raise ConfigError(f"--format {format!r}: only hf (a transformers model folder) is supported")
    names = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    if dtype not in ("auto", *names):
        raise ConfigError(f"--dtype must be auto, fp32, bf16 or fp16; got {dtype!r}")
    shard = parse_size(max_shard_size)  # (before the load, which can take minutes)
    check_out_dir(out, overwrite)  # (the same: an output refused is refused before the load)
    _refuse_export_into_source(path, out)
    loaded = load(path, device=device, trust_remote_code=trust_remote_code)
    model = loaded.model
    if hasattr(model, "merge_and_unload"):  # PEFT: fold B @ A * alpha / r into the base weights
        model = model.merge_and_unload()
    final = Path(out).expanduser()
    if final.exists():  # (an empty folder of the user's, or --overwrite: written in place, as asked)
        return _write_export(loaded, model, final, shard, names.get(dtype), overwrite)
    # A new folder is written under a hidden name and renamed into place when complete: an export cut short (Ctrl-C,
    # a full disk) left a config.json beside half a safetensors file, which looked like a model and refused the
    # same command again as "not empty".
    partial = final.with_name(f".{final.name}.partial-{uuid.uuid4().hex[:12]}")
    try:
        _write_export(loaded, model, partial, shard, names.get(dtype), overwrite)
        os.replace(partial, final)
    finally:
        if partial.exists():
            shutil.rmtree(partial, ignore_errors=True)
    return final


def _write_export(
    loaded: Loaded, model: nn.Module, out: Path, shard: int, dtype: torch.dtype | None, overwrite: bool
) -> Path:
    """The transformers folder of ``model`` (LoRA merged) written into ``out``."""
    from gptoughts.models.hf import read_config
    from gptoughts.models.hf_export import copy_tokenizer_files, model_dtype, save_generic, save_hf

    base = read_config(loaded.init_from) if loaded.init_from else None
    target = dtype or (model_dtype(base) if base else torch.float32)
    if isinstance(model, HFCausalLM):
        written = save_generic(
            model, loaded.tokenizer, out, max_shard_bytes=shard, dtype=target, overwrite=overwrite
        )
    else:
        gen = None
        if loaded.init_from and (Path(loaded.init_from) / "generation_config.json").is_file():
            gen = json.loads((Path(loaded.init_from) / "generation_config.json").read_text())
        written = save_hf(
            model,
            loaded.family,
            loaded.args,
            loaded.tokenizer,
            out,
            base_config=base,
            base_generation_config=gen,
            max_shard_bytes=shard,
            dtype=target,
            overwrite=overwrite,
        )
    if loaded.init_from:  # fine-tuning keeps the vocabulary: ship the original tokenizer files as they were
        copy_tokenizer_files(loaded.init_from, written)
    if loaded.chat and loaded.tokenizer.chat_template is None:
        # SFT without a template of the tokenizer's own trained on the default one: the export carries it, so that
        # transformers' apply_chat_template renders prompts as training did
        from gptoughts.data.sft import DEFAULT_CHAT_TEMPLATE

        (written / "chat_template.jinja").write_text(DEFAULT_CHAT_TEMPLATE, encoding="utf-8")
    return written
