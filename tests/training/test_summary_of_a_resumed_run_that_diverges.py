"""A resumed run that diverged (its divergence error, exit 2) left the previous session's summary.json, which said
the run ended on "max steps" at that session's step: this session's end is what the summary tells, or none."""

from __future__ import annotations

import json

import pytest
from test_recovery import _argv, _main, _one_line_error, install_fault, nan_on_calls


@pytest.mark.slow
def test_a_resume_that_diverges_leaves_no_summary_of_the_session_before(
    tmp_path, text_corpus, cache_dir, fast, capsys
):
    out = tmp_path / "run"
    code, _, err = _main(_argv(text_corpus, out, fast, "--train.max_steps", "3"), capsys)
    assert code == 0, err
    assert json.loads((out / "summary.json").read_text())["steps"] == 3
    with pytest.MonkeyPatch.context() as mp:
        install_fault(mp.setattr, nan_on_calls(1, None))  # every step of the resume is non-finite
        flags = ("--train.max_steps", "8", "--train.nan_policy", "stop")
        code, _, err = _main(_argv(text_corpus, out, fast, *flags, "--resume", "auto"), capsys)
    assert "non-finite loss or gradient" in _one_line_error(code, err)
    summary = out / "summary.json"
    said = json.loads(summary.read_text()) if summary.is_file() else {}
    assert said.get("stop_reason") != "max steps" and said.get("steps") != 3, said
    # the run resumes from its checkpoint as before
    code, _, err = _main(_argv(text_corpus, out, fast, "--train.max_steps", "4", "--resume", "auto"), capsys)
    assert code == 0, err
    assert json.loads(summary.read_text())["steps"] == 4
