"""prepare clears its own stale build folders, never those of another output folder beside it."""

from __future__ import annotations

from pathlib import Path

from gptoughts.data import prepare


def test_an_output_name_with_brackets_spares_the_builds_of_other_folders(
    tmp_path: Path, corpus: Path
) -> None:
    # `--out data[12]` matched the stale-build pattern of data1 and data2 as a glob: their interrupted (or running)
    # builds were deleted
    other = tmp_path / ".data1.partial-0123456789abcdef"
    other.mkdir()
    (other / "plan.json").write_text("{}", encoding="utf-8")
    prepare([corpus], tmp_path / "data[12]", "bytes", progress=False)
    assert (other / "plan.json").is_file()
    assert (tmp_path / "data[12]" / "manifest.json").is_file()
