"""``gptoughts train --resume auto --out RUN --dry_run`` on a run that has already completed was refused before
its plan, so the user could not see where the run stands before extending it. The dry run prints the plan, then
the same one-line refusal as the run itself (exit 2: a script checking with --dry_run gets the real verdict,
as for any other resume a dry run would refuse), and writes nothing."""

from __future__ import annotations

import pytest
from cli_helpers import FASTRUN, ok, plan_of, run_cli, snapshot


@pytest.fixture
def done(tmp_path, text_corpus, cache_dir, capsys):
    out = tmp_path / "r"
    ok(["train", "--data", str(text_corpus), "--size", "debug", "--tokenizer", "bytes", "--out", str(out),
        "--max_steps", "4", "--save_interval", "2", *FASTRUN], capsys)  # fmt: skip
    return out


@pytest.mark.parametrize(
    "flags, needle",
    [
        # the rule the run saved is named as its config.toml's: this command typed no --max_steps
        ([], "complete at step 4 (max_steps 4 in {run}/config.toml): nothing to train"),
        (["--max_steps", "2"], "past --max_steps 2"),
    ],
)
def test_the_dry_run_of_a_resume_with_nothing_to_train_prints_its_plan_then_refuses(
    done, capsys, tmp_path, flags, needle
):
    before = snapshot(tmp_path)
    code, text = run_cli(
        ["train", "--resume", "auto", "--out", str(done), "--dry_run", *flags, *FASTRUN], capsys
    )
    assert code == 2 and "Traceback" not in text, text[-2000:]
    assert plan_of(text)[:2] == ("llama", "debug")
    assert "resuming" in text and "step_000004" in text, text[-2000:]
    errors = [ln for ln in text.splitlines() if ln.startswith("error:")]
    needle = needle.format(run=done)
    assert len(errors) == 1 and needle in errors[0] and "--max_steps above 4" in errors[0], text[-2000:]
    assert text.index("plan: ") < text.index("error:")
    assert snapshot(tmp_path) == before  # nothing written
