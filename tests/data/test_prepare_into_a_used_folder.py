"""``prepare`` into a folder that already holds a prepared dataset: the same inputs reuse it (or rebuild it where its
corpus changed), other ones are refused in one line naming the difference, and replaced only with overwrite."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from gptoughts.data import prepare
from gptoughts.errors import DataError


def _files(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"tokenizer": "bpe:300"}, "tokenizer bytes (this prepare: bpe:300)"),
        ({"val_fraction": 0.3}, "val_fraction 0.1 (this prepare: 0.3)"),
        ({"max_bytes": 2000}, "max_bytes none (this prepare: 2000)"),
        ({"seed": 3}, "seed 0 (this prepare: 3)"),
    ],
)
def test_other_settings_are_refused_naming_the_difference(
    tmp_path: Path, corpus: Path, change: dict, named: str
) -> None:
    out = tmp_path / "out"
    prepare([corpus], out, "bytes", progress=False, val_fraction=0.1)
    before = _files(out)
    args = {"tokenizer": "bytes", "val_fraction": 0.1, **change}
    with pytest.raises(DataError) as e:
        prepare([corpus], out, progress=False, **args)
    line = str(e.value)
    assert "\n" not in line and named in line and "--overwrite" in line and "another --out" in line, line
    assert _files(out) == before  # nothing rewritten
    assert [p.name for p in tmp_path.iterdir()] == ["corpus", "out"]  # no build folder, no lock file left

    m = prepare([corpus], out, progress=False, overwrite=True, **args)
    assert json.loads((out / "manifest.json").read_text())["cache_key"] == m.cache_key != ""
    assert _files(out) != before


def test_other_sources_are_refused(
    tmp_path: Path, corpus: Path, write_folder: Callable[..., Path], make_docs: Callable[..., list[str]]
) -> None:
    other = write_folder(tmp_path / "other", make_docs(10, seed=4))
    out = tmp_path / "out"
    prepare([corpus], out, "bytes", progress=False)
    with pytest.raises(DataError, match=f"sources {corpus} \\(this prepare: {other}\\)"):
        prepare([other], out, "bytes", progress=False)


def test_the_same_settings_reuse_or_rebuild_without_overwrite(tmp_path: Path, corpus: Path) -> None:
    out = tmp_path / "out"
    first = prepare([corpus], out, "bytes", progress=False)
    assert prepare([corpus], out, "bytes", progress=False).created == first.created
    # the corpus edited since: the same command brings the dataset up to date
    (corpus / "doc_0000.txt").write_text("<doc-0> an edited first document\n")
    again = prepare([corpus], out, "bytes", progress=False, workers=1)  # workers does not change the output
    assert again.cache_key != first.cache_key and again.totals["bytes"] != first.totals["bytes"]


def test_a_manifest_without_settings_is_still_rebuilt(tmp_path: Path, corpus: Path) -> None:
    """A damaged manifest (its fields unreadable) cannot name a difference: the folder is rebuilt, as before."""
    out = tmp_path / "out"
    prepare([corpus], out, "bytes", progress=False)
    data = json.loads((out / "manifest.json").read_text())
    del data["settings"]
    (out / "manifest.json").write_text(json.dumps(data))
    m = prepare([corpus], out, "bytes", progress=False, seed=2)
    assert m.settings["seed"] == 2


def test_extensions_in_another_order_are_the_same_settings(tmp_path: Path, corpus: Path) -> None:
    out = tmp_path / "out"
    prepare([corpus], out, "bytes", progress=False, extensions=["txt", "md"])
    m = prepare([corpus], out, "bytes", progress=False, extensions=["md", "txt"])  # the same files read
    assert m.settings["extensions"] == ["md", "txt"]
    with pytest.raises(DataError, match=r"extensions md, txt \(this prepare: md, py, txt\)"):
        prepare([corpus], out, "bytes", progress=False, extensions=["md", "txt", "py"])


def test_overwrite_replaces_prepared_datasets_only(tmp_path: Path, corpus: Path) -> None:
    """As `train --overwrite` replaces runs only: a folder of the user's files is never replaced."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("precious")
    with pytest.raises(DataError, match="not a prepared dataset"):
        prepare([corpus], out, "bytes", progress=False, overwrite=True)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
