"""Options spelt as other tools spell them (transformers' Trainer, torchrun, nanoGPT) are answered with ours."""

from __future__ import annotations

import re

import pytest

from gptoughts import cli
from gptoughts.cli.options import (
    FINETUNE_ALIASES,
    FINETUNE_FLAGS,
    FINETUNE_SECTIONS,
    FOREIGN,
    parse_overrides,
)
from gptoughts.errors import ConfigError

# What the closest name used to suggest for a few of them: another option altogether.
MISLEADING = {
    "gpus": "eps",
    "save_steps": "max_steps",
    "max_seq_length": "max_steps",
    "report_to": "recover_nan",
}


@pytest.mark.parametrize("name", sorted(FOREIGN))
def test_a_foreign_name_is_answered_with_an_option_that_exists(name):
    with pytest.raises(ConfigError) as e:
        parse_overrides([f"--{name}", "1"])
    message = str(e.value)
    assert message.startswith(f"unknown option --{name}: ") and "\n" not in message
    named = re.findall(r"--([a-z_]+)", message.split(": ", 1)[1])
    assert named, message
    for option in named:
        if option in ("nproc_per_node", "model"):  # torchrun's own, and finetune's --model
            continue
        # every option a hint names is one train or finetune accepts
        value = [] if option in FINETUNE_FLAGS else ["1"]
        parse_overrides(
            [f"--{option}", *value],
            FINETUNE_ALIASES,
            FINETUNE_FLAGS,
            (
                "model",
                "data",
                "train",
                "eval",
                "checkpoint",
                "recovery",
                "perf",
                "parallel",
                "run",
                *FINETUNE_SECTIONS,
            ),
        )


def test_no_foreign_name_shadows_an_option():
    for name in FOREIGN:
        with pytest.raises(ConfigError):
            parse_overrides([f"--{name}", "1"])


@pytest.mark.parametrize(("name", "wrong"), sorted(MISLEADING.items()))
def test_the_command_line_names_ours_not_the_closest(name, wrong, capsys):
    assert cli.main(["train", f"--{name}", "2", "--dry_run"]) != 0
    err = capsys.readouterr().err.strip()
    assert f"--{name}" in err and f"--{wrong}" not in err and len(err.splitlines()) == 1, err


def test_estimate_names_its_own_gpu_count_first(capsys):
    assert cli.main(["estimate", "--size", "1b", "--gpus", "2"]) != 0
    err = capsys.readouterr().err
    assert "torchrun" not in err and "--gpu" in err
