"""The data step on ranks after the first: rank 0 prepared (or verified) the shards just before the barrier."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from gptoughts.config import load_config
from gptoughts.data.manifest import Manifest
from gptoughts.training import corpus


def test_ranks_after_the_first_do_not_read_every_shard_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, make_docs
) -> None:
    # each of N ranks re-reading a whole corpus's shards for their checksums, right after rank 0 did, cost N full
    # reads of the dataset at every start of a multi-GPU run
    src = tmp_path / "c.txt"
    src.write_text("\n".join(make_docs(30)), encoding="utf-8")
    cfg = load_config(None, {"data.sources": [str(src)], "data.tokenizer": "bytes", "run.progress": False})
    kwargs = dict(text_field="text", extensions=None, val_fraction=0.1, max_bytes=None, seed=0)
    kwargs["cache_root"] = tmp_path / "cache"

    def rank(main: bool) -> Manifest:
        env = SimpleNamespace(dist=SimpleNamespace(is_main=main, enabled=False))
        return corpus._prepared(cfg, env, [str(src)], "bytes", dict(kwargs))

    first = rank(True)
    read: list[Path] = []
    monkeypatch.setattr(Manifest, "verify", lambda self: read.append(self.dir))
    other = rank(False)
    assert other.dir == first.dir and other.cache_key == first.cache_key
    assert read == []
