"""A full disk under the sharded (FSDP, CPU offload) checkpoint writer is reported as a full disk.

torch's zip writer, under DCP and ``torch.save`` to a path, says only "unexpected pos N vs M" when a write comes
up short: with no errno to read, the writer looks at the free space of the folder it was writing."""

from __future__ import annotations

import errno
import shutil
from collections import namedtuple

import pytest
import torch

from gptoughts.errors import as_disk_full
from gptoughts.training.checkpoint import savers, sharded

TORCH_SHORT_WRITE = "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"
Usage = namedtuple("Usage", "total used free")


def _disk(monkeypatch, free: int) -> None:
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10**12, 10**12 - free, free))


def test_a_short_write_on_a_full_disk_is_a_full_disk(tmp_path, monkeypatch):
    _disk(monkeypatch, free=4096)
    full = as_disk_full(RuntimeError(TORCH_SHORT_WRITE), folder=tmp_path)
    assert full is not None and full.errno == errno.ENOSPC
    _disk(monkeypatch, free=10**11)  # room left: some other short write, not a full disk
    assert as_disk_full(RuntimeError(TORCH_SHORT_WRITE), folder=tmp_path) is None
    assert as_disk_full(RuntimeError(TORCH_SHORT_WRITE)) is None  # no folder to look at


@pytest.mark.parametrize("where", ["shards", "state"])
def test_the_sharded_writer_says_the_disk_is_full(where, tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    m = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    _disk(monkeypatch, free=0)
    if where == "shards":
        monkeypatch.setattr(
            dcp, "save", lambda *a, **k: (_ for _ in ()).throw(RuntimeError(TORCH_SHORT_WRITE))
        )
    else:
        real = torch.save

        def short(obj, f, *a, **k):
            if str(f).endswith(".pt"):
                raise RuntimeError(TORCH_SHORT_WRITE)
            return real(obj, f, *a, **k)

        monkeypatch.setattr(torch, "save", short)
    saver = savers.ShardedSaver(tmp_path / "checkpoints", async_save=False)
    with pytest.raises(OSError) as e:
        saver.save(1, sharded.sharded_state(m, opt), {"step": 1})
    assert e.value.errno == errno.ENOSPC, e.value
    assert not list((tmp_path / "checkpoints").glob("step_*"))  # nothing half-written left as a checkpoint
