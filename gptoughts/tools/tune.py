"""``gptoughts tune``: search the speed settings for the highest tokens/s that fits in memory.

For every combination of activation checkpointing × compile mode × fp8 recipe, the largest micro-batch that
fits is found with real steps (``--batch_size auto`` logic; a fixed list of batches with ``--batches``), then
timed with ``bench``. The table is printed and the winner is written as a TOML file that ``gptoughts train``
takes as its config (the complete config tuned, with the winning ``[perf]`` and ``[train]`` values).
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gptoughts.config import Config
from gptoughts.perf import hardware
from gptoughts.perf.autobatch import is_oom


@dataclass
class Trial:
    settings: dict[str, Any]
    tokens_per_s: float | None
    mfu: float | None
    peak_memory_gib: float | None
    error: str | None = None


def search_space(
    cfg: Config,
    *,
    ac: list[str] | None,
    compile_modes: list[str] | None,
    fp8: list[str] | None,
    batches: list[int | str] | None,
) -> list[dict[str, Any]]:
    hw = hardware.detect(cfg.perf.device)
    gpu = hw.arch not in ("cpu", "mps")
    ac = ac or ["none", "selective", "full"]
    compile_modes = compile_modes or (["blocks", "model"] if gpu else ["off"])
    fp8 = fp8 or (["off", "tensorwise", "rowwise"] if hw.fp8 else ["off"])
    batches = batches or (["auto"] if gpu else [cfg.train.batch_size])
    return [
        {
            "perf.activation_checkpointing": a,
            "perf.compile_mode": c if c != "off" else "blocks",
            "perf.compile": c != "off",
            "perf.fp8": f != "off",
            "perf.fp8_recipe": f if f != "off" else "tensorwise",
            "train.batch_size": b,
        }
        for a, c, f, b in itertools.product(ac, compile_modes, fp8, batches)
    ]


def apply(cfg: Config, settings: dict[str, Any]) -> Config:
    new = copy.deepcopy(cfg)
    for key, value in settings.items():
        section, name = key.split(".")
        setattr(getattr(new, section), name, value)
    return new


def run_tune(
    cfg: Config,
    *,
    steps: int = 10,
    warmup: int = 3,
    ac: list[str] | None = None,
    compile_modes: list[str] | None = None,
    fp8: list[str] | None = None,
    batches: list[int | str] | None = None,
) -> list[Trial]:
    from gptoughts.tools.bench import run_bench

    trials = []
    for settings in search_space(cfg, ac=ac, compile_modes=compile_modes, fp8=fp8, batches=batches):
        try:
            r = run_bench(apply(cfg, settings), steps=steps, warmup=warmup)
        except Exception as e:  # noqa: BLE001 - one failing combination must not end the search
            if not (is_oom(e) or "fp8" in str(e).lower() or isinstance(e, RuntimeError)):
                raise
            trials.append(
                Trial(settings, None, None, None, f"{type(e).__name__}: {str(e).splitlines()[0][:120]}")
            )
            torch.cuda.empty_cache() if torch.cuda.is_available() else None
            continue
        settings = {**settings, "train.batch_size": r["batch_size"]}
        trials.append(Trial(settings, r["tokens_per_s"], r["mfu"], r["peak_memory_gib"]))
    return trials


def best(trials: list[Trial]) -> Trial | None:
    ok = [t for t in trials if t.tokens_per_s is not None]
    return max(ok, key=lambda t: t.tokens_per_s) if ok else None


def format_table(trials: list[Trial]) -> str:
    win = best(trials)
    head = f"{'checkpointing':<13} {'compile':<8} {'fp8':<10} {'batch':>5} {'tokens/s':>12} {'MFU':>6} {'peak GiB':>9}"
    lines = [head, "-" * len(head)]
    for t in sorted(trials, key=lambda t: -(t.tokens_per_s or 0)):
        s = t.settings
        fp8 = s["perf.fp8_recipe"] if s["perf.fp8"] else "off"
        comp = s["perf.compile_mode"] if s["perf.compile"] else "off"
        if t.error:
            lines.append(f"{s['perf.activation_checkpointing']:<13} {comp:<8} {fp8:<10} {'':>5} {t.error}")
            continue
        mfu = f"{t.mfu:.3f}" if t.mfu is not None else "-"
        peak = f"{t.peak_memory_gib:.1f}" if t.peak_memory_gib is not None else "-"
        mark = "  <- best" if t is win else ""
        lines.append(
            f"{s['perf.activation_checkpointing']:<13} {comp:<8} {fp8:<10} {s['train.batch_size']:>5} "
            f"{t.tokens_per_s:>12,.0f} {mfu:>6} {peak:>9}{mark}"
        )
    return "\n".join(lines)


def write_winner(trial: Trial, cfg: Config, out: str | Path, *, name: str | None = None) -> Path:
    """The complete config with the winning settings, as TOML: `gptoughts train OUT.toml --data ...`. ``name``:
    the file as its header tells the user to pass it (default ``out``; the CLI writes a temporary file first)."""
    from gptoughts.config import to_toml

    out = Path(out)
    speed = f"{trial.tokens_per_s:,.0f} tokens/s" + (
        f", MFU {trial.mfu:.3f}" if trial.mfu is not None else ""
    )
    header = (
        f"# Written by `gptoughts tune`: the complete config with the fastest settings it measured ({speed}).\n"
        f"# Train with it: gptoughts train {name or out} --data PATH (flags after the file override its values)."
    )
    tuned = apply(cfg, trial.settings)
    tuned.run.out = None  # a config for future runs: each writes where its own family and size say
    # (to_toml's own first line describes a run's config.toml, "written by the run": not this file's story)
    body = to_toml(tuned)
    if body.startswith("#"):
        body = body.split("\n", 1)[1]
    out.write_text(header + "\n" + body)
    return out
