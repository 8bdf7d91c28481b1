"""Symbolic links to files in a corpus folder: each document is read once."""

from __future__ import annotations

from pathlib import Path

from gptoughts.data.sources import iter_documents, source_fingerprint


def test_a_link_to_a_file_read_under_its_own_name_is_not_read_again(tmp_path: Path) -> None:
    # `latest.txt -> v3.txt`: the document was read twice, and could be held out in one copy and trained on in the
    # other
    c = tmp_path / "c"
    (c / "old").mkdir(parents=True)
    (c / "v3.txt").write_text("version three\n", encoding="utf-8")
    (c / "latest.txt").symlink_to("v3.txt")
    (c / "old" / "v2.txt").symlink_to("../v3.txt")
    outside = tmp_path / "shared.md"
    outside.write_text("kept once\n", encoding="utf-8")
    (c / "shared.md").symlink_to(outside)  # outside the folder: read through its link
    (c / ".drafts").mkdir()
    (c / ".drafts" / "d.txt").write_text("a draft\n", encoding="utf-8")
    (c / "draft.txt").symlink_to(".drafts/d.txt")  # its target is not read under its own name
    assert sorted(iter_documents(c)) == ["a draft\n", "kept once\n", "version three\n"]
    before = source_fingerprint(c)
    (c / "latest.txt").unlink()
    assert source_fingerprint(c) == before  # the same files read, the same key
