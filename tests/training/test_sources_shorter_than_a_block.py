"""A curriculum phase whose sources are each shorter than a block (a block never spans two sources) has nothing to
draw: the run crashed at its first batch (ZeroDivisionError, after the run folder was written) and its dry run
planned it. Both now refuse it in one line, before writing anything; so too a corpus of several sources none of
which holds a block, which the run called "fewer than one block" by their sum."""

from __future__ import annotations

from pathlib import Path

import pytest

from gptoughts import cli
from gptoughts.data.prepare import cached_prepare
from gptoughts.errors import DataError

QUIET = ["--size", "debug", "--device", "cpu", "--threads", "1", "--no_progress", "--block_size", "32"]


def _curriculum(tmp_path: Path, text_corpus: Path) -> Path:
    conf = tmp_path / "conf"
    (conf / "big").mkdir(parents=True)
    for f in sorted(text_corpus.iterdir())[:3]:
        (conf / "big" / f.name).write_text(f.read_text())
    (conf / "tiny.txt").write_text("tiny text\n")  # 11 tokens with its end-of-text
    (conf / "run.toml").write_text(
        'base = "default"\n[data]\nsources = ["tiny.txt", "big"]\ntokenizer = "bytes"\n'
        '[[data.phases]]\nname = "first"\nsources = ["tiny.txt"]\ntokens = 200\n'
        '[[data.phases]]\nname = "rest"\nsources = ["big"]\n'
    )
    return conf / "run.toml"


@pytest.mark.parametrize("cached", [False, True])
def test_a_phase_with_no_source_of_a_block_is_refused_by_the_plan(
    cached, tmp_path, text_corpus, cache_dir, capsys
):
    toml = _curriculum(tmp_path, text_corpus)
    if cached:  # the shards prepared: the dry run and the run judge them, not an estimate
        sources = [str(tmp_path / "conf" / "tiny.txt"), str(tmp_path / "conf" / "big")]
        cached_prepare(sources, "bytes", progress=False)
    out = tmp_path / "run"
    for extra in (["--dry_run"], ["--max_steps", "12"]):
        assert cli.main(["train", str(toml), *QUIET, "--out", str(out), *extra]) == 2, extra
        err = capsys.readouterr().err
        assert "curriculum phase 'first' has no source of one block of block_size+1 = 33" in err, err
        assert "tiny.txt" in err and "Traceback" not in err, err
    assert not out.exists()


def test_sources_none_of_which_holds_a_block_are_refused_by_the_dry_run(tmp_path, cache_dir, capsys):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("short one " * 2)
    b.write_text("another short " * 2)  # 21 and 29 tokens: more than a block of 33 together, not apart
    argv = [
        "train",
        "--data",
        str(a),
        "--data",
        str(b),
        "--tokenizer",
        "bytes",
        *QUIET,
        "--out",
        str(tmp_path / "r"),
    ]
    assert cli.main([*argv, "--dry_run"]) == 2
    err = capsys.readouterr().err
    assert "the corpus has no source of one block of block_size+1 = 33" in err and "Traceback" not in err, err


def test_the_loader_names_the_phase_with_nothing_to_draw(tmp_path, cache_dir, text_corpus):
    from gptoughts.data.loader import Phase, check_drawable

    tiny = tmp_path / "tiny.txt"
    tiny.write_text("tiny text\n")
    m = cached_prepare([str(tiny), str(text_corpus)], "bytes", progress=False)
    phases = [Phase("first", [str(tiny)], tokens=200), Phase("rest", [str(text_corpus)])]
    with pytest.raises(
        DataError, match=r"curriculum phase 'first' has no source of one block .*tiny\.txt 11\)"
    ):
        check_drawable(m.dir, phases, 32)
    check_drawable(m.dir, phases[1:], 32)  # a phase of the long source alone draws
