"""``gptoughts train --resume auto --out RUN`` where RUN's recorded base is another gptoughts run and RUN kept no export
of it in ``base/`` (a new fine-tune of a run keeps one, which its resume reads): the resume cannot start from the run
as it is now (it may have trained on since), so it is refused in one line that names what works, a new fine-tune
from the run with ``--model`` (it said "export it first ... and fine-tune OUT", while ``--model RUN`` now does that)."""

from __future__ import annotations

import json

import pytest
from cli_helpers import FASTRUN, ok, refused_leaving


@pytest.mark.slow
def test_the_refusal_names_a_new_fine_tune_from_the_run(tmp_path, text_corpus, cache_dir, capsys):
    pre, ft = tmp_path / "pre", tmp_path / "ft"
    ok(["train", "--data", str(text_corpus), "--tokenizer", "bytes", "--size", "debug", "--out", str(pre),
        "--max_steps", "1", *FASTRUN], capsys)  # fmt: skip
    ok(["finetune", "--model", str(pre), "--data", str(text_corpus), "--out", str(ft), "--max_steps", "1",
        *FASTRUN], capsys)  # fmt: skip
    # the run as it would be had it recorded the run itself as its base and kept no export of it
    (ft / "base" / "gptoughts_source.json").unlink()
    toml = (ft / "config.toml").read_text()
    (ft / "config.toml").write_text(toml.replace(json.dumps(str(ft / "base")), json.dumps(str(pre))))
    record = json.loads((ft / "run.json").read_text())
    (ft / "run.json").write_text(json.dumps({**record, "init_from": str(pre)}))
    line = refused_leaving(
        ft, ["train", "--resume", "auto", "--out", str(ft), "--max_steps", "2", *FASTRUN], capsys, str(pre)
    )
    assert f"start a new fine-tune from it instead: gptoughts finetune --model {pre} --out NEW" in line, line
    assert "export it first" not in line
