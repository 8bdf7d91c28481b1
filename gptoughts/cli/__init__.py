"""The ``gptoughts`` command. Thin: parse argv, build a config, call :mod:`gptoughts.api`.

One module per group of commands: :mod:`.train` (train, finetune, config), :mod:`.trained` (sample, eval,
export, plot), :mod:`.tools` (prepare, env, estimate, tune, bench); :mod:`.options` parses the config options
they share (``--section.key VALUE`` and the aliases of the user's own scripts). Heavy modules (torch, the API)
are imported by the command that needs them, so ``--help`` and ``--version`` start at once.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

from gptoughts.cli.tools import cmd_bench, cmd_env, cmd_estimate, cmd_prepare, cmd_tune
from gptoughts.cli.train import cmd_config, cmd_finetune, cmd_train
from gptoughts.cli.trained import cmd_eval, cmd_export, cmd_plot, cmd_sample
from gptoughts.errors import UserError, closest

COMMANDS: dict[str, tuple[Callable[[Sequence[str]], int], str]] = {
    "train": (cmd_train, "train a model (default: the quickstart preset)"),
    "finetune": (cmd_finetune, "fine-tune a Hugging Face model (full or --lora) on SFT JSONL or text"),
    "export": (cmd_export, "write a run as a Hugging Face transformers folder (--format hf OUT)"),
    "prepare": (cmd_prepare, "tokenize a corpus into token shards"),
    "sample": (cmd_sample, "generate text from a run or checkpoint"),
    "eval": (cmd_eval, "loss and perplexity of a run on a corpus; accuracy on multiple-choice tasks"),
    "plot": (cmd_plot, "PNG plots of a run, or several runs overlaid"),
    "config": (cmd_config, "print the fully resolved config of a train command"),
    "env": (cmd_env, "hardware, supported precisions, recommended settings"),
    "estimate": (cmd_estimate, "memory, time and cost of a run before it starts"),
    "tune": (cmd_tune, "search batch x checkpointing x compile x fp8 for the fastest settings"),
    "bench": (cmd_bench, "time training steps: tokens/s, MFU, memory, breakdown (--compare hf)"),
}


def usage() -> str:
    lines = ["usage: gptoughts COMMAND [ARGS]", "", "commands:"]
    lines += [f"  {name:<9} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += [
        "",
        "`gptoughts COMMAND --help` for details; `gptoughts train` alone trains the quickstart (a ~10M Llama "
        "on the Python standard library, a few minutes on a CPU). `gptoughts --version` prints the version.",
    ]
    return "\n".join(lines)


def _setup_logging() -> None:
    import logging

    from rich.console import Console
    from rich.logging import RichHandler

    class ToStderr(logging.StreamHandler):
        """One plain line per record, to whatever sys.stderr is when it is written (as rich's console does)."""

        stream = property(lambda self: sys.stderr, lambda self, value: None)

    log = logging.getLogger("gptoughts")
    if not log.handlers:  # to stderr: stdout stays clean for --json output and generated text
        if sys.stderr is not None and sys.stderr.isatty():
            handler: logging.Handler = RichHandler(
                console=Console(stderr=True), show_path=False, show_time=False, markup=False
            )
        else:  # a log file or a pipe: rich would wrap each record at 80 columns and pad it with spaces
            handler = ToStderr()
            handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def main(argv: Sequence[str] | None = None) -> int:
    from gptoughts.perf.startup import end_command, mark_command

    mark_command()  # `train` reports the time from here (from the process's start) to its first step
    try:
        return _command(argv)
    finally:
        end_command()


def _command(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if argv[0] in ("-V", "--version", "version"):
        from gptoughts import __version__

        print(f"gptoughts {__version__}")
        return 0
    if argv[0].startswith("-"):  # `gptoughts --data X` is `gptoughts train --data X`
        argv = ["train", *argv]
    name, rest = argv[0], argv[1:]
    _setup_logging()
    import warnings

    # Python warnings (a corrupt checkpoint skipped, a library's notice) as one line each, without the source line
    warnings.formatwarning = lambda message, category, *args, **kwargs: f"warning: {message}\n"
    if name not in COMMANDS:
        hint = closest(name, COMMANDS)
        print(
            f"error: unknown command {name!r}"
            + (f" (did you mean {hint!r}?)" if hint else "")
            + "\n\n"
            + usage(),
            file=sys.stderr,
        )
        return 2
    try:
        return COMMANDS[name][0](rest)
    except UserError as e:
        _print_error(str(e))
        return 2
    except KeyboardInterrupt:
        # Ctrl-C before training started (or a second one): nothing half-written remains
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `gptoughts ... | head`: the reader left; nothing to say, and no one to say it to
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at interpreter exit
        return 0
    except Exception as e:
        from gptoughts.errors import as_disk_full

        full = as_disk_full(e)
        if full is None:
            raise
        print(
            f"error: disk full{' while writing ' + str(full.filename) if full.filename else ''} ({full.strerror}); "
            "what was saved before is intact: free some space and run again",
            file=sys.stderr,
        )
        return 2


def _print_error(message: str) -> None:
    """A user error, one line, once per launch: under torchrun an error every rank raises alike (a config checked on
    each) is printed by rank 0 alone; one that another rank alone sees is printed by it, with its rank."""
    import os

    ranks, rank = int(os.environ.get("WORLD_SIZE", "1")), os.environ.get("RANK", "0")
    if ranks == 1 or rank == "0":
        print(f"error: {message}", file=sys.stderr, flush=True)
        if ranks == 1:
            return
    from gptoughts.parallel import dist as pdist

    if rank == "0":  # posted once printed: a rank that finds it exits, and torchrun then ends rank 0
        pdist.post_error(message)
    elif not pdist.is_rank0_error(message):
        print(f"error: rank {rank}: {message}", file=sys.stderr, flush=True)
