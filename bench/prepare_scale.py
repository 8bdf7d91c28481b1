"""prepare at scale on this machine: generate a corpus of ~N GB, prepare it, report wall time and peak memory.

    python bench/prepare_scale.py make /tmp/corpus --gb 2        # three sources: a folder of text files,
                                                                 # one big JSONL, a folder of Parquet files
    /usr/bin/time -v python bench/prepare_scale.py run /tmp/corpus /tmp/out --workers 2

The corpus is the standard library's source, copied with a per-copy renaming (so no two documents are equal)
until each of the three sources holds a third of the size. ``run`` prints one JSON line: seconds, bytes read,
tokens, MB/s, the parent's peak RSS and the largest worker's (``/usr/bin/time -v`` reports the parent's).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import sysconfig
import time
from pathlib import Path


def _stdlib_texts() -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for p in sorted(root.rglob("*.py")):
        if "site-packages" in p.parts or "test" in p.parts:
            continue
        try:
            out.append(p.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError):
            continue
    return out


def _copies(texts: list[str], budget: int):
    """Documents (one per stdlib file, renamed per copy) until ``budget`` characters are given."""
    given, k = 0, 0
    while True:
        for t in texts:
            doc = f"# copy {k}\n" + t.replace("self", f"self{k % 1009}").replace("def ", f"def v{k % 97}_")
            yield doc
            given += len(doc)
            if given >= budget:
                return
        k += 1


def make(root: Path, gb: float) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = _stdlib_texts()
    third = int(gb * 1e9 / 3)
    folder = root / "files"
    folder.mkdir(parents=True)
    for n, doc in enumerate(_copies(texts, third)):
        sub = folder / f"{n // 1000:04d}"
        if n % 1000 == 0:
            sub.mkdir()
        (sub / f"{n:07d}.py").write_text(doc, encoding="utf-8")
    with open(root / "big.jsonl", "w", encoding="utf-8") as f:
        for doc in _copies(texts[::-1], third):
            f.write(json.dumps({"text": doc}) + "\n")
    pqdir = root / "parquet"
    pqdir.mkdir()
    batch: list[str] = []
    size, n = 0, 0
    for doc in _copies(texts[1::2] + texts[::2], third):
        batch.append(doc)
        size += len(doc)
        if size >= 200_000_000:
            pq.write_table(pa.table({"text": batch}), pqdir / f"part-{n:03d}.parquet", row_group_size=20_000)
            batch, size, n = [], 0, n + 1
    if batch:
        pq.write_table(pa.table({"text": batch}), pqdir / f"part-{n:03d}.parquet", row_group_size=20_000)


def run(root: Path, out: Path, workers: int, tokenizer: str) -> None:
    from gptoughts.data import prepare

    sources = [root / "files", root / "big.jsonl", root / "parquet"]
    t0 = time.perf_counter()
    m = prepare(
        sources, out, tokenizer, extensions=["py", "parquet"], progress=False, workers=workers, cache=False
    )
    dt = time.perf_counter() - t0
    read = m.totals["bytes"]
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    print(
        json.dumps(
            {
                "workers": workers,
                "tokenizer": tokenizer,
                "seconds": round(dt, 1),
                "bytes": read,
                "tokens": m.train_tokens + m.val_tokens,
                "MB_per_s": round(read / dt / 1e6, 2),
                "parent_cpu_s": round(me.ru_utime + me.ru_stime, 1),
                "workers_cpu_s": round(kids.ru_utime + kids.ru_stime, 1),
                "parent_peak_rss_mib": me.ru_maxrss // 1024,
                "largest_worker_peak_rss_mib": kids.ru_maxrss // 1024,
                "load_average_1min_at_end": round(os.getloadavg()[0], 2),
            }
        ),
        flush=True,
    )


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make")
    mk.add_argument("root", type=Path)
    mk.add_argument("--gb", type=float, default=2.0)
    rn = sub.add_parser("run")
    rn.add_argument("root", type=Path)
    rn.add_argument("out", type=Path)
    rn.add_argument("--workers", type=int, default=None)
    rn.add_argument("--tokenizer", default="bpe:8192")
    a = p.parse_args(argv)
    if a.cmd == "make":
        make(a.root, a.gb)
    else:
        run(a.root, a.out, a.workers, a.tokenizer)


if __name__ == "__main__":
    main(sys.argv[1:])
