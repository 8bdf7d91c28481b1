"""bench/scaling.sh's EXTRA overrides the script's own flags: the CLI refuses a flag given twice, so an EXTRA
repeating one (--log_interval) failed the run at once (seen on a 2-GPU call)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "scaling.sh"


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_extra_replaces_the_scripts_flags_and_keeps_the_others():
    function = re.search(r"^with_extra\(\) \{.*?^\}$", SCRIPT.read_text(), re.S | re.M).group(0)
    shell = (
        function
        + "\nds=(--model deepseek --log_interval 5 --no_progress --train.sample_prompts= --compile true)"
        '\nwith_extra ds\nprintf "%s\\n" "${ds[@]}"'
    )
    env = {"EXTRA": "--log_interval 1 --parallel.ep 4 --train.sample_prompts=hi", "PATH": "/usr/bin:/bin"}
    out = subprocess.run(["bash", "-c", shell], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == [
        "--model", "deepseek", "--no_progress", "--compile", "true",
        "--log_interval", "1", "--parallel.ep", "4", "--train.sample_prompts=hi",
    ]  # fmt: skip
