"""prepare at scale: bounded memory, parallel tokenising identical to serial, resuming an interrupted build."""

from __future__ import annotations

import importlib
import json
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest

from gptoughts.data import Manifest, prepare

prepare_module = importlib.import_module("gptoughts.data.prepare")  # gptoughts.data.prepare is the function
shards_module = importlib.import_module("gptoughts.data.shards")

MB = 1 << 20


def _text_block(seed: int, size: int) -> str:
    """``size`` characters of random lowercase words and newlines (incompressible enough for parquet)."""
    rng = np.random.default_rng(seed)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz     \n", dtype=np.uint8)
    return rng.choice(letters, size).tobytes().decode()


def _big_corpus(root: Path, per_source: int) -> list[Path]:
    """Four sources of ~``per_source`` characters each, in the layouts that could load whole: one big text
    file, one JSONL, one Parquet file of a single row group, one saved HF dataset (arrow stream)."""
    root.mkdir()
    block = _text_block(0, 4 * MB)
    docs = [
        f"<doc-{k}> " + block[(k * 7919) % (3 * MB) :][: 2000 + k % 1000] for k in range(per_source // 2500)
    ]
    (root / "big.txt").write_text("".join(docs))
    with open(root / "big.jsonl", "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    table = pa.table({"text": docs})
    pq.write_table(table, root / "big.parquet", row_group_size=len(docs))  # one row group of everything
    hf = root / "hf"
    hf.mkdir()
    with (
        pa.OSFile(str(hf / "data-00000-of-00001.arrow"), "wb") as sink,
        ipc.new_stream(sink, table.schema) as w,
    ):
        for batch in table.to_batches(max_chunksize=1000):
            w.write_batch(batch)
    (hf / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    (hf / "dataset_info.json").write_text("{}")
    return [root / "big.txt", root / "big.jsonl", root / "big.parquet", hf]


_PEAK_RSS = """
import json, re, sys
from pathlib import Path
import importlib
from gptoughts.data import prepare
shards_module = importlib.import_module("gptoughts.data.shards")
sources_module = importlib.import_module("gptoughts.data.sources")

def kib(field):
    return int(re.search(field + r":\\s+(\\d+) kB", Path("/proc/self/status").read_text()).group(1))

args = json.loads(sys.argv[1])
# Smaller batches than the defaults (memory is O(batch): ~50 MB at the defaults, whatever the corpus size),
# so that a corpus a few times larger than the bound is quick to read.
shards_module._ENCODE_BATCH_BYTES = 128 << 10
sources_module.CHUNK_BYTES = 64 << 10
sources_module._COLUMN_SLICE_BYTES = 32 << 10
# The same kinds of source, small: imports, allocator arenas and pyarrow's pool are in the baseline.
prepare(args["warmup"], args["out"] + "-warmup", "bytes", progress=False, workers=1)
Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to the current resident set
before = kib("VmHWM")
m = prepare(args["sources"], args["out"], "bytes", progress=False, workers=1)
print(json.dumps({"growth_kib": kib("VmHWM") - before, "bytes": m.totals["bytes"]}))
"""


@pytest.mark.slow
@pytest.mark.skipif(
    not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc to reset the RSS peak"
)
def test_peak_memory_is_bounded_on_a_corpus_several_times_larger(tmp_path: Path) -> None:
    # ~16 MB whatever the corpus size at these batch sizes (measured: 14-17 MB for 32 to 72 MB): the
    # batches, the checksums' 4 MB read blocks, the tokenizer's save.
    bound = 24 * MB
    sources = _big_corpus(tmp_path / "corpus", per_source=3 * bound // 4)  # 4 sources: 3x the bound
    warmup = _big_corpus(tmp_path / "small", per_source=MB // 4)
    args = {
        "sources": [str(s) for s in sources],
        "warmup": [str(s) for s in warmup],
        "out": str(tmp_path / "out"),
    }
    # pyarrow's default pool (mimalloc) keeps freed memory cached in amounts that grow with what it has seen
    # (measured: +52 MB after reading a 64 MB parquet file, +16 MB with jemalloc, +26 with the system's):
    # its own caching, not our reading; the system allocator makes the test measure ours.
    env = {**os.environ, "ARROW_DEFAULT_MEMORY_POOL": "system"}
    # The peak's growth scatters between runs of the same code (seen: 12.6 to 25.1 MB, allocator arenas and
    # timing): a second run is made when the first is over the bound. Memory that grew with the corpus (3x the
    # bound) would be over it in both.
    results = []
    for attempt in range(2):
        run = subprocess.run(
            [sys.executable, "-c", _PEAK_RSS, json.dumps({**args, "out": f"{args['out']}-{attempt}"})],
            capture_output=True,
            text=True,
            check=True,
            env=env,
        )
        results.append(json.loads(run.stdout.strip().splitlines()[-1]))
        if results[-1]["growth_kib"] * 1024 < bound:
            break
    assert all(r["bytes"] > 2.9 * bound for r in results)
    assert min(r["growth_kib"] for r in results) * 1024 < bound, results


# --------------------------------------------------------------------------------------------- workers


def _shards(m: Manifest) -> dict[str, bytes]:
    names = [n for s in m.sources for n in s.train_shards + s.val_shards]
    return {n: (m.dir / n).read_bytes() for n in names}


def _same_output(a: Manifest, b: Manifest) -> None:
    da, db = a.to_dict(), b.to_dict()
    da.pop("created")
    db.pop("created")
    assert da == db
    assert _shards(a) == _shards(b)


@pytest.fixture
def small_shards(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shards of 2000 tokens and batches of ~3 documents: many of each on a tiny corpus."""
    monkeypatch.setattr(prepare_module, "SHARD_TOKENS", 2000)
    monkeypatch.setattr(shards_module, "_ENCODE_BATCH_BYTES", 600)


def test_workers_give_byte_identical_shards(
    tmp_path: Path, write_folder: Callable[..., Path], make_docs: Callable[..., list[str]], small_shards: None
) -> None:
    corpus = write_folder(tmp_path / "corpus", make_docs(120))
    one = prepare([corpus], tmp_path / "w1", "bpe:300", progress=False, workers=1)
    two = prepare([corpus], tmp_path / "w2", "bpe:300", progress=False, workers=2)
    assert len(one.sources[0].train_shards) >= 3 and one.sources[0].val_docs >= 1
    _same_output(one, two)  # the cache key too: workers is not part of it
    with pytest.raises(prepare_module.ConfigError, match="workers must be a number of processes >= 1"):
        prepare([corpus], tmp_path / "w0", "bytes", progress=False, workers=0)


# --------------------------------------------------------------------------------------------- resuming


class _Kill(Exception):
    pass


def _encoded_texts(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the texts tokenised in this process (workers=1), in a one-element list."""
    count = [0]
    encode = shards_module._encode

    def counting(tok, texts, splits, dtype):  # type: ignore[no-untyped-def]
        count[0] += len(texts)
        return encode(tok, texts, splits, dtype)

    monkeypatch.setattr(shards_module, "_encode", counting)
    return count


def _interrupt_after(monkeypatch: pytest.MonkeyPatch, shards: int) -> None:
    """Raise in the middle of a write once ``shards`` shards were filled: the open shard then holds bytes
    past the last checkpoint, as after a kill."""
    write = shards_module.ShardWriter.write
    filled = [0]

    def failing(self, arr):  # type: ignore[no-untyped-def]
        n = write(self, arr)
        filled[0] += n
        if filled[0] >= shards and not n:
            raise _Kill
        return n

    monkeypatch.setattr(shards_module.ShardWriter, "write", failing)


def test_an_interrupted_prepare_resumes(
    tmp_path: Path,
    write_folder: Callable[..., Path],
    make_docs: Callable[..., list[str]],
    small_shards: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    a = write_folder(tmp_path / "a", make_docs(60, seed=1))
    b = write_folder(tmp_path / "b", make_docs(60, seed=2))
    whole = prepare([a, b], tmp_path / "whole", "bpe:300", progress=False, workers=1)
    assert len(whole.sources[1].train_shards) >= 4

    with monkeypatch.context() as mp:
        _interrupt_after(mp, shards=len(whole.sources[0].train_shards) + 2)  # inside the second source
        with pytest.raises(_Kill):
            prepare([a, b], tmp_path / "out", "bpe:300", progress=False, workers=1)
    assert not (tmp_path / "out").exists()
    (partial,) = tmp_path.glob(".out.partial-*")
    assert (partial / "progress.json").is_file()

    count = _encoded_texts(monkeypatch)
    resumed = prepare([a, b], tmp_path / "out", "bpe:300", progress=False, workers=1)
    _same_output(whole, resumed)
    assert 0 < count[0] < 60  # the first source and part of the second were not tokenised again
    assert not list(tmp_path.glob(".out.partial-*"))
    assert sorted(p.name for p in resumed.dir.iterdir()) == sorted(
        ["manifest.json", "tokenizer", *_shards(resumed)]
    )


def test_a_damaged_or_foreign_partial_build_is_not_resumed(
    tmp_path: Path,
    write_folder: Callable[..., Path],
    make_docs: Callable[..., list[str]],
    small_shards: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    corpus = write_folder(tmp_path / "corpus", make_docs(80))
    whole = prepare([corpus], tmp_path / "whole", "bytes", progress=False, workers=1)

    def interrupted(**kw: object) -> Path:
        with monkeypatch.context() as mp:
            _interrupt_after(mp, shards=3)
            with pytest.raises(_Kill):
                prepare([corpus], tmp_path / "out", "bytes", progress=False, workers=1, **kw)
        (partial,) = tmp_path.glob(".out.partial-*")
        return partial

    partial = interrupted()
    shard = partial / "train_0_1.bin"
    data = bytearray(shard.read_bytes())
    data[10] ^= 1
    shard.write_bytes(bytes(data))
    count = _encoded_texts(monkeypatch)
    _same_output(whole, prepare([corpus], tmp_path / "out", "bytes", progress=False, workers=1))
    assert count[0] == 80  # the damaged build was started over

    # A partial build of other settings is removed, not resumed.
    shutil.rmtree(tmp_path / "out")
    other = interrupted(seed=5)
    prepare([corpus], tmp_path / "out2", "bytes", progress=False, workers=1)
    assert other.exists()  # another output folder's partial build is left alone
    count[0] = 0
    _same_output(whole, prepare([corpus], tmp_path / "out", "bytes", progress=False, workers=1))
    assert not other.exists() and count[0] == 80


def test_a_partial_build_planned_under_older_rules_is_started_over(
    tmp_path: Path,
    write_folder: Callable[..., Path],
    make_docs: Callable[..., list[str]],
    small_shards: None,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The reading rules changed (data.max_bytes now cuts the document crossing it) under the same cache key: a
    build interrupted under the older rules, whose plan.json records none, must not be finished under the new ones."""
    corpus = write_folder(tmp_path / "corpus", make_docs(80))
    whole = prepare([corpus], tmp_path / "whole", "bytes", progress=False, workers=1, max_bytes=9000)
    with monkeypatch.context() as mp:
        _interrupt_after(mp, shards=2)
        with pytest.raises(_Kill):
            prepare([corpus], tmp_path / "out", "bytes", progress=False, workers=1, max_bytes=9000)
    (partial,) = tmp_path.glob(".out.partial-*")
    plan = json.loads((partial / "plan.json").read_text())
    plan.pop("rules", None)  # as an older version wrote it
    (partial / "plan.json").write_text(json.dumps(plan))

    count = _encoded_texts(monkeypatch)
    with caplog.at_level(logging.INFO, logger="gptoughts.data"):
        resumed = prepare([corpus], tmp_path / "out", "bytes", progress=False, workers=1, max_bytes=9000)
    assert count[0] == whole.totals["docs"]  # every document tokenised again: started over
    assert "planned by another version of gptoughts" in caplog.text and "resuming" not in caplog.text
    _same_output(whole, resumed)


_KILLED = """
import importlib, json, os, signal, sys
from gptoughts.data import prepare
P = importlib.import_module("gptoughts.data.prepare")
S = importlib.import_module("gptoughts.data.shards")
args = json.loads(sys.argv[1])
P.SHARD_TOKENS, S._ENCODE_BATCH_BYTES = 2000, 600
write, filled = S.ShardWriter.write, [0]

def killing(self, arr):
    n = write(self, arr)
    filled[0] += n
    if filled[0] >= args["shards"] and not n:  # buffered bytes past the last checkpoint: lost or partial
        os.kill(os.getpid(), signal.SIGKILL)
    return n

S.ShardWriter.write = killing
prepare(args["sources"], args["out"], "bpe:300", progress=False, workers=2)
"""


@pytest.mark.slow
def test_a_killed_prepare_resumes(
    tmp_path: Path,
    write_folder: Callable[..., Path],
    make_docs: Callable[..., list[str]],
    small_shards: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """SIGKILL with two workers: no cleanup runs, buffered bytes are lost, the orphaned workers exit."""
    corpus = write_folder(tmp_path / "corpus", make_docs(120))
    whole = prepare([corpus], tmp_path / "whole", "bpe:300", progress=False, workers=2)
    args = {"sources": [str(corpus)], "out": str(tmp_path / "out"), "shards": 4}
    run = subprocess.run([sys.executable, "-c", _KILLED, json.dumps(args)], capture_output=True, text=True)
    assert run.returncode == -9, run.stderr[-2000:]
    assert not (tmp_path / "out").exists() and list(tmp_path.glob(".out.partial-*"))
    with caplog.at_level(logging.INFO, logger="gptoughts.data"):
        _same_output(whole, prepare([corpus], tmp_path / "out", "bpe:300", progress=False, workers=2))
    assert "resuming the interrupted preparation" in caplog.text and "from document" in caplog.text


def _die(*args: object) -> None:
    os._exit(3)  # a worker killed (the OOM killer, say)


def test_a_dead_worker_is_a_one_line_error(
    tmp_path: Path, corpus: Path, small_shards: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shards_module, "_worker_encode", _die)
    with pytest.raises(prepare_module.DataError, match=r"a tokenizing worker process died .*\(it resumes\)"):
        prepare([corpus], tmp_path / "out", "bpe:300", progress=False, workers=2)
    assert list(tmp_path.glob(".out.partial-*"))  # kept for the next run
