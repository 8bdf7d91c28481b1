"""Commands that read a trained run (a run or checkpoint directory, or a Hugging Face folder): ``sample``,
``eval``, ``export`` and ``plot``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from gptoughts.errors import ConfigError, UserError, closest


class Parser(argparse.ArgumentParser):
    """argparse, with errors said as the rest of the command says them: one line (a ``UserError``: exit 2, no usage
    block), and an unknown option with the closest one of the command, as ``train`` names them."""

    def error(self, message: str) -> NoReturn:
        raise UserError(f"{self.prog}: {message}; `{self.prog} --help` lists its options")

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            self._unknown(extra)
        return parsed

    def parse_intermixed_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        parsed, extra = self.parse_known_intermixed_args(args, namespace)
        if extra:
            self._unknown(extra)
        return parsed

    def _unknown(self, extra: list[str]) -> NoReturn:
        first = next((a for a in extra if a.startswith("-")), extra[0])
        if not first.startswith("-"):
            raise UserError(
                f"{self.prog}: unexpected argument {first!r}; `{self.prog} --help` lists what it takes"
            )
        typed = first.split("=", 1)[0]  # as typed: -p stays -p
        options = [o for action in self._actions for o in action.option_strings if o.startswith("--")]
        near = closest(typed, options) if typed.startswith("--") else None  # (one letter matches anything)
        raise UserError(
            f"unknown option {typed} for {self.prog}"
            + (f" (did you mean {near}?)" if near else f"; `{self.prog} --help` lists its options")
        )


def refuse_torchrun(command: str) -> None:
    """The commands on a trained run use no process group: under torchrun every rank would do the whole command and
    print its own result (two eval lines, two different samples; export writing OUT twice at once). Refused on every
    rank alike, so the line is printed once (``cli._print_error``); a torchrun of one process is one process."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UserError(
            f"gptoughts {command} runs in one process: drop torchrun and run `gptoughts {command} ...` by itself"
        )


def cmd_sample(argv: Sequence[str]) -> int:
    p = Parser(prog="gptoughts sample", description="Generate text from a trained model.")
    p.add_argument("path", help="run directory, checkpoint directory or Hugging Face model folder")
    p.add_argument(
        "--prompt",
        default="",
        help="text to continue (with --chat: the user's message); empty: the model starts a document",
    )
    p.add_argument(
        "--chat",
        default="auto",
        choices=["auto", "on", "off"],
        help="render the prompt with the chat template and print only the answer; auto: on for SFT runs "
        "and for HF folders whose tokenizer has a chat template",
    )
    p.add_argument(
        "--system",
        default=None,
        help="a system message before the prompt, as a model fine-tuned on conversations that open with one was "
        "trained (chat prompts only)",
    )
    p.add_argument("--max_new_tokens", type=int, default=128, help="tokens to generate (>= 1)")
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    p.add_argument("--top_k", type=int, default=50, help="0: no top-k filtering")
    p.add_argument("--top_p", type=float, default=None, help="in (0, 1]; default: no nucleus filtering")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--device", default="auto")
    p.add_argument(
        "--trust_remote_code", action="store_true", help="let transformers run an HF folder's own code"
    )
    a = p.parse_args(argv)
    refuse_torchrun("sample")
    from gptoughts.api import check_sampling, check_system, generate_text, load, sampler

    chat = None if a.chat == "auto" else a.chat == "on"
    # checked before the model is loaded (which can take minutes); load checks the path first
    check_sampling(a.max_new_tokens, a.temperature, a.top_k, a.top_p, a.seed, flag="--")
    check_system(None, a.system, chat, flag="--")
    loaded = load(a.path, device=a.device, trust_remote_code=a.trust_remote_code)
    check_system(loaded, a.system, chat, flag="--")
    # a prompt and answer past the model's positions: the flags' largest value that fits, not the Python API's hint
    sampler(loaded).check_room(
        [a.prompt],
        ("--max_new_tokens", "--prompt"),
        max_new_tokens=a.max_new_tokens,
        chat=chat,
        system=a.system,
    )
    if a.system is None and (loaded.chat if chat is None else chat):
        _system_note(loaded.trained_system)
    print(
        generate_text(
            loaded,
            a.prompt,
            max_new_tokens=a.max_new_tokens,
            temperature=a.temperature,
            top_k=a.top_k or None,
            top_p=a.top_p,
            seed=a.seed,
            chat=chat,
            system=a.system,
        )
    )
    return 0


def _system_note(trained: str | bool | None) -> None:
    """One line on stderr where the model was fine-tuned only on conversations that open with a system message and
    none is given: it never saw a prompt without one."""
    if not trained:
        return
    if isinstance(trained, str):
        shown = trained if len(trained) <= 80 else trained[:77] + "..."
        said = f"the system message {shown!r}; pass it with --system"
    else:
        said = "a system message; pass one with --system"
    print(
        f"note: every conversation this model was fine-tuned on opens with {said} to prompt it as it was trained",
        file=sys.stderr,
    )


def cmd_eval(argv: Sequence[str]) -> int:
    a = _eval_parser().parse_args(argv)
    refuse_torchrun("eval")
    _check_eval_args(a)
    # Everything a user can get wrong is checked before the first (possibly long) model load and scoring.
    tasks, bench = _eval_tasks(a)
    from gptoughts.api import check_model_path

    for run in a.path:
        check_model_path(run)
    if len(a.path) > 1 and (a.data or a.prefs):
        _common_windows(a)
    results: dict[str, dict[str, Any]] = {}
    for run in a.path:
        results[run] = _evaluate_run(run, a, tasks, bench)
    _print_eval(results, a, bool(tasks or bench))
    return 0


def _common_windows(a: argparse.Namespace) -> None:
    """Models compared side by side are scored in the same windows (``a.block_size`` set to it; one typed past a
    model's positions refused before any loads); their defaults differing, which one is said in a line on stderr
    (--json keeps stdout one object)."""
    from gptoughts.api import common_eval_block

    typed = a.block_size
    a.block_size, defaults = common_eval_block(a.path, a.block_size)
    if typed is None and len(set(defaults.values())) > 1:
        each = ", ".join(f"{run}: {n:,}" for run, n in defaults.items())
        print(
            f"note: every model is scored in windows of {a.block_size:,} tokens, the smallest of their defaults "
            f"({each}); --block_size N sets another",
            file=sys.stderr,
        )


def _eval_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="gptoughts eval",
        description="Loss and perplexity of a run (or HF folder) on all of a corpus; multiple-choice accuracy and "
        "generation exact match on task files and lm-evaluation-harness tasks (--tasks). Several runs: one table "
        "comparing them.",
    )
    p.add_argument(
        "path",
        nargs="+",
        metavar="RUN",
        help="run directory, checkpoint directory or Hugging Face model folder (several: compared side by side)",
    )
    p.add_argument(
        "--data", action="append", default=None, help="file, folder, .jsonl, .parquet (repeatable)"
    )
    _add_task_options(p)
    p.add_argument(
        "--prefs",
        action="append",
        default=None,
        help="preference pairs (.jsonl of prompt/chosen/rejected, repeatable): preference accuracy and reward margin",
    )
    p.add_argument(
        "--ref",
        default=None,
        help="--prefs: the reference model (run or HF folder); default: a LoRA run's base, a full run's starting "
        "model, none for a model folder",
    )
    p.add_argument(
        "--beta", type=float, default=None, help="--prefs: DPO's beta (default: the run's dpo.beta)"
    )
    p.add_argument(
        "--batch_size",
        type=int,
        default=8,
        help="sequences per forward pass (LLaDA choices: Monte-Carlo copies of one choice per pass)",
    )
    p.add_argument(
        "--block_size",
        type=int,
        default=None,
        help="default: the run's train.block_size (a model folder: 256, or its positions if fewer); several "
        "models: the smallest of theirs, for all",
    )
    p.add_argument(
        "--max_batches",
        type=int,
        default=None,
        help="score only this many batches, spread evenly over the corpus (default: all of it)",
    )
    p.add_argument(
        "--max_new_tokens",
        type=int,
        default=64,
        help="generation task files: most tokens generated per prompt (harness tasks: their max_gen_toks)",
    )
    p.add_argument(
        "--mc_samples",
        type=int,
        default=None,
        help="masked-diffusion models (LLaDA): Monte-Carlo draws per choice of a multiple-choice task "
        "(default 32; more is less noisy and proportionally slower)",
    )
    p.add_argument("--device", default="auto")
    p.add_argument("--json", action="store_true", help="print one JSON object (several runs: {run: results})")
    p.add_argument(
        "--trust_remote_code", action="store_true", help="let transformers run an HF folder's own code"
    )
    return p


def _add_task_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tasks",
        action="append",
        default=None,
        help='task file (repeatable), JSONL of one kind: multiple choice, {"context": str, "choices": [str, ...], '
        '"answer": int} per line, scored by log-likelihood (acc, acc_norm); or generation, {"prompt": str, '
        '"expected": str, "until": [str, ...]} per line, scored by greedy decoding (exact_match); or '
        "lm-evaluation-harness task names, comma-separated (hellaswag,arc_easy; needs gptoughts[eval])",
    )
    p.add_argument(
        "--task_dir",
        default=None,
        help="a folder of lm-evaluation-harness task YAML files (e.g. reading local data: dataset_path: json)",
    )
    p.add_argument(
        "--download",
        action="store_true",
        help="harness tasks: let datasets download missing task data (default: offline, missing data is an error)",
    )
    p.add_argument(
        "--limit",
        type=int,
        default=None,
        help="score the first N examples of each task (files and harness tasks)",
    )
    p.add_argument(
        "--num_fewshot", type=int, default=None, help="harness tasks: few-shot examples per prompt"
    )


def _check_eval_args(a: argparse.Namespace) -> None:
    if not a.data and not a.tasks and not a.prefs:
        raise UserError(
            "gptoughts eval needs --data PATH (loss, perplexity), --tasks FILE.jsonl (accuracy, exact match) or "
            "--prefs PAIRS.jsonl (preference accuracy)"
        )
    if a.data:
        _refuse_chat_data(a.data)
        from gptoughts.data.sources import refuse_prepared

        refuse_prepared(a.data, with_model_tokenizer=True)  # before a model loads, in eval's words
    if a.prefs:
        from gptoughts.data.prefs import read_pairs

        read_pairs(a.prefs)  # every line checked before a model loads
    if a.beta is not None and not a.beta > 0:
        raise UserError(f"--beta must be > 0, got {a.beta}")
    for flag, value in (
        ("--batch_size", a.batch_size),
        ("--max_new_tokens", a.max_new_tokens),
        ("--mc_samples", a.mc_samples),
        ("--limit", a.limit),
        ("--max_batches", a.max_batches),
        ("--block_size", a.block_size),
    ):
        if value is not None and value < 1:
            raise UserError(f"{flag} must be >= 1, got {value}")
    named: dict[Path, str] = {}
    for run in a.path:  # however it is spelt (runs/a and runs/a/), a run is loaded and scored once
        first = named.setdefault(Path(run).expanduser().resolve(), run)
        if first != run or a.path.count(run) > 1:
            same = "" if first == run else f" (as {first})"
            raise UserError(f"{run} is given more than once{same}; name each run once")
    if a.num_fewshot is not None and a.num_fewshot < 0:
        raise UserError(f"--num_fewshot must be >= 0, got {a.num_fewshot}")


def _refuse_chat_data(data: list[str]) -> None:
    """``--data`` scores plain text: chat examples or preference pairs there are named, before a model loads
    (read as text, they would fail on a missing "text" field with a hint to a flag eval does not take)."""
    from gptoughts.data.prefs import examples_kind

    what = examples_kind(data)
    if what == "preference pairs":
        raise UserError(
            f"--data {', '.join(data)} holds preference pairs (chosen/rejected); score them with --prefs instead"
        )
    if what == "chat examples":
        raise UserError(
            f"--data {', '.join(data)} holds chat examples (messages, or prompt/response), and eval --data scores "
            'plain text (text files, or JSONL with a "text" field); a fine-tuning\'s loss on held-out examples is '
            "its val_loss (metrics.jsonl), and answers are scored with --tasks (generation: prompt/expected)"
        )


def _eval_tasks(a: argparse.Namespace) -> tuple[list[Any], Any]:
    """The task files read (cut to ``--limit``), and the lm-evaluation-harness tasks named (None: none)."""
    from gptoughts.tools.harness import check_names, split_specs
    from gptoughts.tools.tasks import read_tasks

    files, names = split_specs(a.tasks) if a.tasks else ([], [])
    if a.task_dir and not names:
        raise UserError("--task_dir holds harness tasks: name them with --tasks NAME[,NAME...]")
    tasks = read_tasks(files)
    if a.limit is not None:  # the first N examples of every task, files as harness tasks (as in training)
        from dataclasses import replace

        tasks = [replace(t, examples=t.examples[: a.limit]) for t in tasks]
    check_names([t.name for t in tasks], names)
    if not names:
        return tasks, None
    from gptoughts.tools.harness import Harness

    bench = Harness(
        names,
        task_dir=a.task_dir,
        allow_download=a.download,
        num_fewshot=a.num_fewshot,
        limit=a.limit,
    )
    return tasks, bench


def _evaluate_run(run: str, a: argparse.Namespace, tasks: list[Any], bench: Any) -> dict[str, Any]:
    """Loss on ``--data`` and the task scores of one run; the scores are saved beside a run's run.json."""
    from gptoughts.api import evaluate, load
    from gptoughts.tools.tasks import MC_SAMPLES, evaluate_tasks

    loaded = load(run, device=a.device, trust_remote_code=a.trust_remote_code)
    res: dict[str, Any] = {}
    if a.data:
        res = evaluate(
            loaded, a.data, batch_size=a.batch_size, block_size=a.block_size, max_batches=a.max_batches
        )
    if a.prefs:
        res["prefs"] = _preferences(loaded, a)
    if tasks or bench:
        res["tasks"] = evaluate_tasks(
            loaded,
            tasks,
            batch_size=a.batch_size,
            mc_samples=a.mc_samples or MC_SAMPLES,
            max_new_tokens=a.max_new_tokens,
        )
        if bench is not None:
            res["tasks"].update(bench.evaluate(loaded, batch_size=a.batch_size, mc_samples=a.mc_samples))
        if (Path(run) / "run.json").is_file():
            _save_task_scores(Path(run), res["tasks"])
    return res  # (the model is dropped here: one in memory at a time)


def _preferences(loaded: Any, a: argparse.Namespace) -> dict[str, Any]:
    from gptoughts.api import eval_block, load
    from gptoughts.tools.preferences import default_reference, evaluate_preferences

    block = eval_block(loaded, a.block_size)  # (before a reference model loads)
    ref_path = a.ref or default_reference(loaded)
    reference = load(ref_path, device=a.device, trust_remote_code=a.trust_remote_code) if ref_path else None
    return evaluate_preferences(
        loaded,
        a.prefs,
        batch_size=a.batch_size,
        block_size=block,
        beta=a.beta,
        reference=reference,
        reference_name=ref_path,
    )


def _print_eval(results: dict[str, dict[str, Any]], a: argparse.Namespace, scored_tasks: bool) -> None:
    from gptoughts.tools.tasks import format_comparison, format_table

    if len(results) > 1:
        if a.json:
            print(json.dumps(results))
            return
        print(format_comparison(results))
        for run, res in results.items():
            if a.data:
                print(f"{run}: scored {res['scored']} of {', '.join(a.data)}")
            if a.prefs:
                # each model's default reference and beta are its own: its margin is read against them
                p = res["prefs"]
                print(
                    f"{run}: {p['pairs']:,} pairs of {', '.join(a.prefs)}; beta {p['beta']:g}; "
                    f"reference: {p['reference']}"
                )
        return
    (res,) = results.values()
    if a.json:
        print(json.dumps(res))
        return
    if a.data:
        print(
            f"loss {res['loss']:.4f}  perplexity {res['perplexity']:.2f}  (scored {res['scored']} of "
            f"{', '.join(a.data)})"
        )
    if a.prefs:
        p = res["prefs"]
        print(
            f"preference accuracy {p['preference_accuracy']:.4f}  reward margin {p['reward_margin']:.4f}  "
            f"({p['pairs']:,} pairs of {', '.join(a.prefs)}; beta {p['beta']:g}; reference: {p['reference']})"
        )
    if scored_tasks:
        print(format_table(res["tasks"]))


def _save_task_scores(run: Path, scores: dict[str, Any]) -> None:
    """``RUN/eval_tasks.json``: this evaluation's scores over the earlier ones (tasks scored before and not now
    stay). A run folder that cannot be written is a warning after the table, not a lost evaluation."""
    path = run / "eval_tasks.json"
    try:
        old = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        old = {}
    from gptoughts.training.checkpoint.store import write_text_atomic

    try:
        write_text_atomic(
            path, json.dumps({**(old if isinstance(old, dict) else {}), **scores}, indent=2) + "\n"
        )
    except OSError as e:
        print(
            f"warning: could not write {path} ({e.strerror or e}); the scores are printed only",
            file=sys.stderr,
        )


def cmd_export(argv: Sequence[str]) -> int:
    p = Parser(
        prog="gptoughts export",
        description="Write a run as a Hugging Face transformers model folder (LoRA merged).",
    )
    p.add_argument("path", help="run directory, checkpoint directory (or an HF folder)")
    p.add_argument("out_pos", nargs="?", metavar="OUT", help="output folder (or --out)")
    p.add_argument("--out", default=None, help="output folder")
    p.add_argument("--format", default="hf", choices=["hf"], help="hf: config.json + safetensors + tokenizer")
    p.add_argument("--max_shard_size", default="5GB", help="split weights above this size (e.g. 5GB, 500MB)")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "fp32", "bf16", "fp16"],
        help="auto: the base model's dtype (fp32 for models trained from scratch)",
    )
    p.add_argument("--overwrite", action="store_true", help="write into a non-empty OUT")
    p.add_argument("--device", default="cpu", help="where LoRA is merged (cpu needs no GPU memory)")
    p.add_argument(
        "--trust_remote_code", action="store_true", help="let transformers run an HF folder's own code"
    )
    a = p.parse_intermixed_args(argv)
    refuse_torchrun("export")
    out = a.out or a.out_pos
    if out is None:
        raise ConfigError("export needs an output folder: gptoughts export RUN --format hf OUT")
    from gptoughts.api import check_model_path, export
    from gptoughts.models.hf_export import check_out_dir, parse_size

    parse_size(a.max_shard_size)  # every option checked, then what is read
    check_model_path(a.path)
    check_out_dir(out, a.overwrite)  # before the load, which can take minutes

    written = export(
        a.path,
        out,
        format=a.format,
        max_shard_size=a.max_shard_size,
        dtype=a.dtype,
        overwrite=a.overwrite,
        device=a.device,
        trust_remote_code=a.trust_remote_code,
    )
    print(f"wrote {written} (load it with transformers.AutoModelForCausalLM.from_pretrained)")
    return 0


def cmd_plot(argv: Sequence[str]) -> int:
    p = Parser(
        prog="gptoughts plot",
        description="PNG plots of runs (loss, lr, tokens/s, grad "
        "norm, memory): one run -> RUN/plots/; several -> one figure overlaying them.",
    )
    p.add_argument("runs", nargs="+", help="run directories (each holds metrics.jsonl)")
    p.add_argument("--out", default=None, help="with several runs: the PNG to write (default compare.png)")
    p.add_argument("--overwrite", action="store_true", help="replace the PNG --out names if it exists")
    a = p.parse_args(argv)
    refuse_torchrun("plot")
    from gptoughts.training.plots import compare_runs, write_run_plots

    # what README calls RUN elsewhere (its metrics file, a checkpoint) named as the run it is in
    for run in a.runs:
        _plotted_run(Path(run))
    if len(a.runs) == 1 and a.out is None:
        if not (Path(a.runs[0]) / "metrics.jsonl").is_file():
            raise UserError(f"{a.runs[0]} has no metrics.jsonl; pass a run directory")
        written = write_run_plots(a.runs[0])
        if not written:
            raise UserError(f"nothing to plot in {a.runs[0]} (no metrics yet, or matplotlib is missing)")
        print("\n".join(str(w) for w in written))
        return 0
    # like tune's tuned.toml: an existing compare.png (default or named) is kept unless --overwrite
    print(f"wrote {Path(compare_runs(a.runs, a.out or 'compare.png', overwrite=a.overwrite)).resolve()}")
    return 0


def _plotted_run(path: Path) -> None:
    """A path ``plot`` reads runs from, or a one-line error naming the run directory meant: a file (its
    metrics.jsonl, was "metrics.jsonl has no metrics.jsonl") or a checkpoint or other folder inside a run."""
    from gptoughts.training.checkpoint import store

    if (path / "metrics.jsonl").is_file():
        return
    if not path.exists():
        raise UserError(f"{path} does not exist; pass a run directory (the --out of gptoughts train)")
    if (path / "run.json").is_file():  # a run before its first logged step
        raise UserError(f"{path} has no metrics.jsonl yet: a run writes it at its first logged step")
    if path.is_file():
        raise UserError(
            f"{path} is a file; pass the run directory that holds it: gptoughts plot {path.parent}"
        )
    run = store.run_of(path) or (path.parent if (path.parent / "metrics.jsonl").is_file() else None)
    if run is not None and (run / "metrics.jsonl").is_file():
        raise UserError(
            f"{path} is inside the run {run}, which holds the metrics; pass it: gptoughts plot {run}"
        )
