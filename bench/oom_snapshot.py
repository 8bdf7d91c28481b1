"""What filled the GPU when a run ran out of memory: a ``gptoughts`` command run in this process with CUDA's
allocation history on; at the first out-of-memory, the live allocations are grouped by the innermost frame of our
code (or torch's) that made them and the largest groups are written to OUT/oom.txt.

Without an out-of-memory, OUT/oom.txt has the live allocations at the end and at the trace's peak. Under torchrun,
each rank writes OUT/rankN/oom.txt.

Usage: python3 bench/oom_snapshot.py OUT train --size 3b --parallel.cpu_offload true --gpu_memory_gib 16 ...
       torchrun --nproc_per_node 4 bench/oom_snapshot.py OUT train ...
"""

from __future__ import annotations

import os
import sys
from collections import defaultdict
from pathlib import Path

import torch


def _where(frames: list[dict]) -> str:
    """The first frames of our package (else torch's Python), innermost first, as ``file:line fn`` joined."""
    ours = [f for f in frames if "/gptoughts/" in f["filename"]]
    picked = (ours or [f for f in frames if f["filename"].endswith(".py")])[:3]
    return " < ".join(f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in picked) or "?"


def summarize(snapshot: dict, top: int = 25) -> str:
    by_site: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    reserved = 0
    for seg in snapshot["segments"]:
        reserved += seg["total_size"]
        for block in seg["blocks"]:
            if block["state"] != "active_allocated":
                continue
            site = by_site[_where(block.get("frames", []))]
            site[0] += block["size"]
            site[1] += 1
    live = sum(v[0] for v in by_site.values())
    lines = [f"reserved {reserved / 2**30:.2f} GiB, live {live / 2**30:.2f} GiB in {len(by_site)} sites"]
    for site, (size, n) in sorted(by_site.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"{size / 2**30:8.3f} GiB {n:6d} blocks  {site}")
    return "\n".join(lines)


def at_peak(snapshot: dict, top: int = 25) -> str:
    """The live allocations at the highest point of the recorded trace (replayed event by event: allocations made
    before recording started are not in it), grouped by the site that made them, largest first."""
    live: dict[int, tuple[int, str]] = {}
    total = best = 0
    best_live: dict[int, tuple[int, str]] = {}
    for trace in snapshot.get("device_traces", []):
        for ev in trace:
            if ev["action"] == "alloc":
                live[ev["addr"]] = (ev["size"], _where(ev.get("frames", [])))
                total += ev["size"]
                if total > best:
                    best, best_live = total, dict(live)
            elif ev["action"] == "free_completed" and ev["addr"] in live:
                total -= live.pop(ev["addr"])[0]
    by_site: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, site in best_live.values():
        by_site[site][0] += size
        by_site[site][1] += 1
    lines = [f"peak of the trace {best / 2**30:.2f} GiB in {len(by_site)} sites"]
    for site, (size, n) in sorted(by_site.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"{size / 2**30:8.3f} GiB {n:6d} blocks  {site}")
    return "\n".join(lines)


def main() -> int:
    out = Path(sys.argv[1])
    if "RANK" in os.environ:  # under torchrun: one folder per rank
        out = out / f"rank{os.environ['RANK']}"
    out.mkdir(parents=True, exist_ok=True)
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    written = []

    def on_oom(device, alloc, device_alloc, device_free) -> None:
        if written:
            return
        text = f"out of memory asking {alloc / 2**30:.3f} GiB\n" + summarize(torch.cuda.memory._snapshot())
        (out / "oom.txt").write_text(text + "\n")
        written.append(True)
        print(text, flush=True)

    torch._C._cuda_attach_out_of_memory_observer(on_oom)
    from gptoughts import cli

    rc = cli.main(sys.argv[2:])
    peak = torch.cuda.max_memory_allocated() / 2**30
    print(f"exit {rc}; GPU peak allocated {peak:.2f} GiB")
    if not written:
        (out / "oom.txt").write_text(
            f"no out-of-memory; peak {peak:.2f} GiB\nlive at the end: "
            + summarize(snap := torch.cuda.memory._snapshot())
            + "\n"
            + at_peak(snap)
        )
    return rc


if __name__ == "__main__":
    sys.exit(main())
