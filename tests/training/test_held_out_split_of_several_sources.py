"""A held-out split made of several sources' tails, each shorter than a block but more than a block in all, is
evaluated in windows of its longest source (a window never spans two sources). The plan said the split "(212 tokens)
is shorter than one block (128)": a figure larger than the block, called shorter."""

from __future__ import annotations

import re
from pathlib import Path

from cli_helpers import QUIET_CPU, ok

from gptoughts.data.loader import TokenDataset
from gptoughts.data.prepare import cached_prepare

BLOCK = 128


def test_the_warning_names_the_longest_source_not_a_split_shorter_than_it_is(tmp_path, cache_dir, capsys):
    folder = tmp_path / "corpus"
    folder.mkdir()
    sources: list[Path] = []
    for i, name in enumerate("abcd"):  # each over a fifth of the corpus: the split holds out a tail of each
        (folder / f"{name}.txt").write_text(
            " ".join(f"{name}{k * 7 % 13}" for k in range(200))[: 515 + 3 * i]
        )
        sources.append(folder / f"{name}.txt")
    m = cached_prepare([str(p) for p in sources], "bytes", val_fraction=0.005, seed=1337, progress=False)
    window = TokenDataset(m.dir).longest_window("val", BLOCK)
    assert 0 < window < BLOCK < m.val_tokens  # (the case: short tails, more than a block in all)
    toml = tmp_path / "run.toml"
    toml.write_text("[data]\nsources = [" + ", ".join(f'"{p}"' for p in sources) + "]\n")
    text = ok(
        ["train", str(toml), "--tokenizer", "bytes", "--block_size", str(BLOCK), "--size", "debug", "--dry_run",
         "--max_steps", "2", *QUIET_CPU],
        capsys,
    )  # fmt: skip
    line = next((ln for ln in text.splitlines() if "warning: the held-out split" in ln), None)
    assert line is not None, text[-1500:]
    said = int(re.search(r"held-out split \(([\d,]+) tokens\)", line).group(1).replace(",", ""))
    assert said == m.val_tokens, line
    assert f"evaluations use windows of {window:,} tokens" in line, line
    # what holds less than a block is named, with its size: not the split, which holds more
    assert "is shorter than one block" not in line and f"the longest holds {window + 1:,}" in line, line
