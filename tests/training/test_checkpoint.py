from __future__ import annotations

import pytest
import torch
from torch import nn

from gptoughts.errors import UserError
from gptoughts.training.checkpoint import restore, savers, sharded, staging
from gptoughts.training.checkpoint import store as ckpt


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))


def test_save_load_roundtrip_weights_only(tmp_path):
    m = _model(0)
    state = {"trainer": {"step": 3}, "rng": {"torch": torch.get_rng_state()}, "loader": {"rows": 12}}
    path = ckpt.save(tmp_path, 3, m, state)
    assert ckpt.verify(path) is None
    m2 = _model(1)
    restore.load_weights(m2, path)
    for a, b in zip(m.parameters(), m2.parameters()):
        assert torch.equal(a, b)
    back = restore.load_state(path)  # torch.load(weights_only=True)
    assert back["trainer"]["step"] == 3 and back["loader"]["rows"] == 12


def test_rotation_keeps_last_and_best(tmp_path):
    m = _model(0)
    for step in (1, 2, 3, 4, 5):
        ckpt.save(tmp_path, step, m, {"s": step}, keep_last=2, is_best=(step == 2), val_loss=1.0)
    assert ckpt.list_steps(tmp_path) == [2, 4, 5]
    assert ckpt.best_step(tmp_path) == 2


def test_a_resume_past_unusable_checkpoints_never_rotates_its_own_away(tmp_path):
    """A run whose newest checkpoints are unusable resumes from an older one (the warning "falling back to the
    previous one"). Its next saves are of lower steps than those: with --keep_last 1 the rotation kept the unusable
    step 6 and deleted the step 5 just written (and the step 4 resumed from), so a crash before step 6 was reached
    again left no checkpoint that loads."""
    m = _model(0)
    for step in (4, 6):
        ckpt.save(tmp_path, step, m, {"s": step}, keep_last=3)
    (ckpt.step_dir(tmp_path, 6) / ckpt.MODEL_FILE).write_bytes(b"cut")
    with pytest.warns(UserWarning, match="unusable"):
        assert ckpt.latest_valid(tmp_path) == ckpt.step_dir(tmp_path, 4)
    ckpt.save(tmp_path, 5, m, {"s": 5}, keep_last=1)  # the resumed run's first save
    assert 5 in ckpt.list_steps(tmp_path)
    with pytest.warns(UserWarning, match="unusable"):
        assert ckpt.latest_valid(tmp_path) == ckpt.step_dir(tmp_path, 5)
    # the run reaches the step again: one checkpoint, its own
    ckpt.save(tmp_path, 6, m, {"s": 6}, keep_last=1)
    assert ckpt.list_steps(tmp_path) == [6] and ckpt.verify(ckpt.step_dir(tmp_path, 6)) is None


@pytest.mark.parametrize("damage", ["truncate", "flip", "no_meta"])
def test_corrupt_newest_falls_back_with_warning(tmp_path, damage):
    m = _model(0)
    ckpt.save(tmp_path, 1, m, {"s": 1})
    newest = ckpt.save(tmp_path, 2, m, {"s": 2})
    f = newest / ckpt.MODEL_FILE
    data = f.read_bytes()
    if damage == "truncate":
        f.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        f.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    else:
        (newest / ckpt.META_FILE).unlink()
    with pytest.warns(UserWarning, match="unusable"):
        found = ckpt.latest_valid(tmp_path)
    assert found == ckpt.step_dir(tmp_path, 1)


def test_failed_write_leaves_previous_intact(tmp_path, monkeypatch):
    m = _model(0)
    good = ckpt.save(tmp_path, 1, m, {"s": 1})

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt.torch, "save", boom)
    with pytest.raises(OSError):
        ckpt.save(tmp_path, 2, m, {"s": 2})
    assert ckpt.list_steps(tmp_path) == [1]
    assert ckpt.verify(good) is None
    assert not list(tmp_path.glob(".tmp-*"))


def test_resolve_errors_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        ckpt.resolve(tmp_path / "nope")
    with pytest.raises(UserError, match="no valid checkpoint"):
        ckpt.resolve(tmp_path)


def test_shared_weights_save(tmp_path):
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    m = nn.ModuleDict({"emb": emb, "head": head})
    path = ckpt.save(tmp_path, 1, m, {})
    m2 = nn.ModuleDict({"emb": nn.Embedding(10, 4), "head": nn.Linear(4, 10, bias=False)})
    m2["head"].weight = m2["emb"].weight
    restore.load_weights(m2, path)
    assert torch.equal(m2["head"].weight, emb.weight)


# ------------------------------------------------------------------------------------- sharded (DCP) format
def _trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model and its AdamW state (one step)."""
    m = _model(seed)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    m(torch.randn(4, 8)).square().sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return m, opt


def _dcp_save(root, step: int, m: nn.Module, opt, *, async_save: bool = False, **kw):
    saver = savers.ShardedSaver(root, async_save=async_save)
    state = {"trainer": {"step": step}, "rng": {"torch": torch.get_rng_state()}, "loader": {"rows": 12}}
    saver.save(step, sharded.sharded_state(m, opt), state, **kw)
    return saver


def test_dcp_one_process_roundtrip(tmp_path):
    m, opt = _trained(0)
    _dcp_save(tmp_path, 3, m, opt, val_loss=1.5, is_best=True).wait()
    path = ckpt.step_dir(tmp_path, 3)
    assert ckpt.verify(path) is None and ckpt.is_dcp(path)
    meta = ckpt.read_meta(path)
    assert meta["format"] == "dcp" and meta["world_size"] == 1 and "__0_0.distcp" in meta["files"]
    assert ckpt.best_step(tmp_path) == 3 and not list(tmp_path.glob(".tmp-*"))
    m2, opt2 = _model(1), None
    restore.load_weights(m2, path)  # what sampling and export do: no optimizer, no process group
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), m2.parameters()))
    state = restore.load_state(path)
    assert state["trainer"]["step"] == 3 and state["loader"]["rows"] == 12 and state["optimizer"] is None
    opt2 = torch.optim.AdamW(m2.parameters(), lr=1e-2)
    sharded.load_dcp(path, m2, opt2, weights=False)
    for p, q in zip(m.parameters(), m2.parameters()):
        assert torch.equal(opt.state[p]["exp_avg_sq"], opt2.state[q]["exp_avg_sq"])
    full = sharded.consolidated_weights(path)
    assert full.keys() == m.state_dict().keys()
    with pytest.raises(UserError, match="does not match the model"):
        restore.load_weights(nn.Sequential(nn.Linear(8, 8)), path)


def test_async_save_writes_what_a_sync_save_writes(tmp_path):
    """The async save stages a copy: the weights changing right after save() returns do not reach the files."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    m, opt = _trained(0)
    _dcp_save(tmp_path / "sync", 1, m, opt).wait()
    saver = _dcp_save(tmp_path / "async", 1, m, opt, async_save=True)
    with torch.no_grad():
        for p in m.parameters():
            p.zero_()
    saver.wait()
    a, b = ckpt.step_dir(tmp_path / "sync", 1), ckpt.step_dir(tmp_path / "async", 1)
    assert ckpt.verify(b) is None
    shards = sorted(f.name for f in a.glob("*.distcp"))
    assert shards == sorted(f.name for f in b.glob("*.distcp")) and shards
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in shards)
    ma, mb = FileSystemReader(str(a)).read_metadata(), FileSystemReader(str(b)).read_metadata()
    assert ma.state_dict_metadata == mb.state_dict_metadata and ma.storage_data == mb.storage_data


@pytest.mark.parametrize("damage", ["truncate", "flip", "no_meta", "no_index"])
def test_dcp_corrupt_newest_falls_back_with_warning(tmp_path, damage):
    m, opt = _trained(0)
    _dcp_save(tmp_path, 1, m, opt)
    _dcp_save(tmp_path, 2, m, opt)
    newest = ckpt.step_dir(tmp_path, 2)
    f = newest / "__0_0.distcp"
    data = f.read_bytes()
    if damage == "truncate":
        f.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        f.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    elif damage == "no_meta":
        (newest / ckpt.META_FILE).unlink()
    else:
        (newest / ckpt.DCP_METADATA).unlink()
    with pytest.warns(UserWarning, match="unusable"):
        found = ckpt.latest_valid(tmp_path)
    assert found == ckpt.step_dir(tmp_path, 1)


class _Evil:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').close()",))


def test_dcp_forged_index_is_refused_unrun(tmp_path):
    """DCP unpickles .metadata with plain pickle: ours is read first with an allow-list, so a forged index (even
    with its checksum updated in meta.json) is an unusable checkpoint and its code never runs."""
    import json
    import pickle

    m, opt = _trained(0)
    _dcp_save(tmp_path, 1, m, opt)
    _dcp_save(tmp_path, 2, m, opt)
    newest = ckpt.step_dir(tmp_path, 2)
    marker = tmp_path / "pwned"
    index = newest / ckpt.DCP_METADATA
    index.write_bytes(pickle.dumps(_Evil(marker)))
    meta = json.loads((newest / ckpt.META_FILE).read_text())
    meta["files"][ckpt.DCP_METADATA] = {"sha256": ckpt._sha256(index), "bytes": index.stat().st_size}
    (newest / ckpt.META_FILE).write_text(json.dumps(meta))
    assert "cannot be read safely" in ckpt.verify(newest)
    with pytest.warns(UserWarning, match="unusable"):
        assert ckpt.latest_valid(tmp_path) == ckpt.step_dir(tmp_path, 1)
    with pytest.raises(ckpt.UnreadableCheckpoint, match="not allowed"):
        restore.load_weights(_model(1), newest)
    assert not marker.exists()


_KILL_CHILD = """
import sys, time, torch
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from gptoughts.training.checkpoint import savers, sharded
from gptoughts.training.checkpoint import store as ckpt

root, where = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
m = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 2))
opt = torch.optim.AdamW(m.parameters())
state = {"trainer": {"step": 1}, "rng": {"torch": torch.get_rng_state()}, "loader": {"rows": 0}}
savers.ShardedSaver(root, async_save=False).save(1, sharded.sharded_state(m, opt), state)

def hang(*a, **k):
    print("IN FLIGHT", flush=True)
    time.sleep(120)

if where == "writing":  # the shards are being written
    FileSystemWriter.write_data = hang
else:  # every shard written and hashed, meta.json and the rename not yet done
    ckpt.commit = hang
saver = savers.ShardedSaver(root, async_save=True)
saver.save(2, sharded.sharded_state(m, opt), {**state, "trainer": {"step": 2}})
print("SAVE RETURNED", flush=True)
saver.wait()
"""


@pytest.mark.slow
@pytest.mark.parametrize("where", ["writing", "renaming"])
def test_kill_9_during_async_save_leaves_previous_checkpoint(tmp_path, where):
    import os
    import signal
    import subprocess
    import sys

    root = tmp_path / "checkpoints"
    child = subprocess.Popen(
        [sys.executable, "-c", _KILL_CHILD, str(root), where],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        seen = []
        for line in child.stdout:
            seen.append(line)
            if "IN FLIGHT" in line:
                break
        assert any("IN FLIGHT" in s for s in seen), (
            seen,
            child.stderr.read()[-2000:] if child.poll() else "",
        )
        assert any("SAVE RETURNED" in s for s in seen) or where == "writing"  # training went on meanwhile
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert ckpt.list_steps(root) == [1]
    assert ckpt.latest_valid(root) == ckpt.step_dir(root, 1)  # no warning: nothing looks complete
    assert list(root.glob(".tmp-step_000002-*"))  # the interrupted write, which the next save removes
    m, opt = _trained(0)
    _dcp_save(root, 3, m, opt)
    assert ckpt.list_steps(root) == [1, 3] and not list(root.glob(".tmp-*"))


def test_dcp_shared_weights(tmp_path):
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    m = nn.ModuleDict({"emb": emb, "head": head})
    savers.ShardedSaver(tmp_path, async_save=False).save(
        1, sharded.sharded_state(m), {"trainer": {"step": 1}}
    )
    m2 = nn.ModuleDict({"emb": nn.Embedding(10, 4), "head": nn.Linear(4, 10, bias=False)})
    m2["head"].weight = m2["emb"].weight
    restore.load_weights(m2, ckpt.step_dir(tmp_path, 1))
    assert torch.equal(m2["head"].weight, emb.weight) and m2["head"].weight is m2["emb"].weight


@pytest.mark.distributed
def test_dcp_two_ranks_resume_on_one_and_four(tmp_path, text_corpus, cache_dir, fast):
    """An FSDP run on 2 gloo ranks writes sharded checkpoints (async: DTensor shards staged in reused host
    buffers, written by the checkpoint thread); step 3's resumes on 1 process and on 4
    ranks (DCP reshards; the loader's position comes along) with the next step's loss of the 2-rank run, and
    it exports to a HF folder on one process."""
    import json
    import os
    import subprocess
    import sys

    from torchrun_runs import here

    from gptoughts import api

    args = ["--data", str(text_corpus), "--log_interval", "1", "--eval_interval", "3", "--save_interval", "3"]
    args += ["--train.schedule", "constant", "--warmup_steps", "0"]
    args += [
        f"--{k}={v}"
        for k, v in fast.items()
        if k not in ("train.batch_size", "train.sample_prompts", "train.warmup_steps")
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def train(out, ranks: int, *extra: str) -> dict[int, float]:
        launch = [sys.executable, "-m", "gptoughts"]
        if ranks > 1:
            launch = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc_per_node={ranks}",
            ]
            launch += ["-m", "gptoughts"]
            extra = ("--parallel.strategy", "fsdp", *extra)
        argv = ["train", "default", "--out", str(out), "--batch_size", str(4 // ranks), *args, *extra]
        if ranks > 1:
            r = subprocess.run([*launch, *argv], env=env, capture_output=True, text=True, timeout=300)
            assert r.returncode == 0, r.stderr[-3000:]
            stdout = r.stdout
        else:  # one process: in this one
            stdout = here(argv)
        # the plan counts the host copy that async sharded saves keep (checkpoint.staging.HostStaging)
        assert ("for background checkpoints" in stdout) == (ranks > 1), stdout[-2000:]
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in rows if "loss" in r}

    ref = train(tmp_path / "two", 2, "--max_steps", "5")
    step3 = tmp_path / "two" / "checkpoints" / "step_000003"
    meta = ckpt.read_meta(step3)
    assert meta["format"] == "dcp" and meta["world_size"] == 2 and ckpt.verify(step3) is None
    assert {"__0_0.distcp", "__1_0.distcp"} <= set(meta["files"])  # each rank wrote (and hashed) its shard
    for ranks in (1, 4):
        resumed = train(tmp_path / f"on{ranks}", ranks, "--max_steps", "5", "--resume", str(step3))
        assert sorted(resumed) == [4, 5]
        assert abs(resumed[4] - ref[4]) <= 1e-6 * abs(ref[4]), (ranks, resumed[4], ref[4])

    out = api.export(step3, tmp_path / "hf")  # one process consolidates the shards
    a, b = api.load(step3).model.state_dict(), api.load(out).model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_async_saves_in_a_row_each_write_their_own_state(tmp_path):
    """The saver keeps its host staging buffers from one save to the next: each save still writes the state of
    its own step (the next staging waits for the previous write)."""
    m, opt = _trained(0)
    saver = savers.ShardedSaver(tmp_path, async_save=True)
    expected = {}
    for step in (1, 2, 3):
        with torch.no_grad():
            m[0].weight.fill_(float(step))
        saver.save(step, sharded.sharded_state(m, opt), {"trainer": {"step": step}})
        expected[step] = m[0].weight.clone()
    saver.close()
    for step in (1, 2, 3):
        full = sharded.consolidated_weights(ckpt.step_dir(tmp_path, step))
        assert torch.equal(full["0.weight"], expected[step])


def test_async_staging_buffers_are_reused_and_reallocated_on_a_new_shape(tmp_path):
    """The host buffers are allocated at the first save and refilled by the next (same storages); a state with
    another shape gets new ones; tied weights share one buffer; close() frees them."""
    m, opt = _trained(0)
    saver = savers.ShardedSaver(tmp_path, async_save=True)
    saver.save(1, sharded.sharded_state(m, opt), {"trainer": {"step": 1}})
    ptrs = [b.data_ptr() for b in saver.staging._buffers]
    assert saver.staging.allocations == 1 and saver.staging.nbytes >= 4 * sum(
        p.numel() for p in m.parameters()
    )
    with torch.no_grad():
        m[0].weight.add_(1.0)
    saver.save(2, sharded.sharded_state(m, opt), {"trainer": {"step": 2}})
    assert [b.data_ptr() for b in saver.staging._buffers] == ptrs and saver.staging.allocations == 1
    saver.wait()
    full = sharded.consolidated_weights(ckpt.step_dir(tmp_path, 2))
    assert torch.equal(full["0.weight"], m[0].weight)

    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    tied = nn.ModuleDict({"emb": emb, "head": head})
    tied.register_buffer("nothing", torch.zeros(0, 3))  # an empty tensor has a (zero-byte) buffer too
    saver.save(3, sharded.sharded_state(tied), {"trainer": {"step": 3}})
    assert saver.staging.allocations == 2 and len(saver.staging._buffers) == 2  # one copy of the tied weight
    saver.close()
    assert not saver.staging._buffers
    assert torch.equal(sharded.consolidated_weights(ckpt.step_dir(tmp_path, 3))["head.weight"], emb.weight)


def test_prepare_allocates_the_staging_before_the_first_save_which_reuses_it(tmp_path):
    """ShardedSaver.prepare (the trainer calls it after the first step) allocates the host buffers in a background
    thread; the first save waits for it and copies into those buffers (no second allocation), and the checkpoint
    holds the weights of the save, not of the prepare."""
    m, opt = _trained(0)
    saver = savers.ShardedSaver(tmp_path, async_save=True)
    saver.prepare(sharded.sharded_state(m, opt))
    assert saver.prepared
    saver.wait()
    ptrs = [b.data_ptr() for b in saver.staging._buffers]
    assert saver.staging.allocations == 1 and ptrs
    saver.prepare(sharded.sharded_state(m, opt))  # once only
    assert saver.staging.allocations == 1
    with torch.no_grad():
        m[0].weight.fill_(3.0)
    saver.save(1, sharded.sharded_state(m, opt), {"trainer": {"step": 1}})
    assert [b.data_ptr() for b in saver.staging._buffers] == ptrs and saver.staging.allocations == 1
    saver.close()
    assert torch.equal(sharded.consolidated_weights(ckpt.step_dir(tmp_path, 1))["0.weight"], m[0].weight)


def test_async_write_error_surfaces_at_the_next_wait(tmp_path, monkeypatch):
    """A failed background write leaves no checkpoint and no temp dir, and the next wait() (here: the next save's)
    raises it as a one-line UserError; the save after it writes normally."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    m, opt = _trained(0)
    saver = savers.ShardedSaver(tmp_path, async_save=True)
    real = FileSystemWriter.write_data

    def broken(*a, **k):
        raise OSError("No space left on device\nsecond line")

    monkeypatch.setattr(FileSystemWriter, "write_data", broken)
    saver.save(1, sharded.sharded_state(m, opt), {"trainer": {"step": 1}})
    with pytest.raises(UserError, match="checkpoint step 1 could not be written.*No space left") as err:
        saver.save(2, sharded.sharded_state(m, opt), {"trainer": {"step": 2}})
    assert "\n" not in str(err.value)
    assert ckpt.list_steps(tmp_path) == [] and not list(tmp_path.glob(".tmp-*"))
    monkeypatch.setattr(FileSystemWriter, "write_data", real)
    saver.save(2, sharded.sharded_state(m, opt), {"trainer": {"step": 2}})
    saver.close()
    assert ckpt.list_steps(tmp_path) == [2] and ckpt.verify(ckpt.step_dir(tmp_path, 2)) is None


def test_async_staging_error_is_a_user_error_before_any_write(tmp_path, monkeypatch):
    """Host memory that cannot be had (the copy fails) stops the save at once with a UserError on every rank;
    nothing is left on disk."""
    m, opt = _trained(0)
    saver = savers.ShardedSaver(tmp_path, async_save=True)

    def no_memory(self, layout):
        raise MemoryError("cannot allocate 56 GiB")

    monkeypatch.setattr(staging.HostStaging, "_ensure", no_memory)
    with pytest.raises(UserError, match="copy to host memory failed: MemoryError"):
        saver.save(1, sharded.sharded_state(m, opt), {"trainer": {"step": 1}})
    assert not saver.pending and not list(tmp_path.glob(".tmp-*")) and ckpt.list_steps(tmp_path) == []


def test_8bit_optimizer_states_load_in_a_process_without_torchao_imported(tmp_path):
    """A run resumed with --optimizer_states fp32 or bf16 from an 8bit run's checkpoint has not imported torchao,
    whose import is what allows its 8-bit state class in weights_only loads: the checkpoint was refused as
    unreadable ("no earlier usable checkpoint")."""
    import subprocess
    import sys

    pytest.importorskip("torchao.optim")
    from gptoughts.training.optim import build_adamw

    model = nn.Linear(128, 64)
    opt = build_adamw(
        model, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8, fused=False, states="8bit"
    )
    model(torch.randn(2, 128)).sum().backward()
    opt.step()
    torch.save({"trainer": {"step": 1}, "optimizer": opt.state_dict()}, tmp_path / ckpt.STATE_FILE)
    code = (
        "import sys; from pathlib import Path; from gptoughts.training.checkpoint.restore import load_state; "
        "assert 'torchao' not in sys.modules; s = load_state(Path(sys.argv[1])); "
        "print(type(s['optimizer']['state'][0]['exp_avg']).__name__)"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[-1] == "OptimState8bit"


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 4)
        self.proj = nn.Linear(4, 4)
        self.head = nn.Linear(4, 11, bias=False)
        self.head.weight = self.embed.weight  # tied: one tensor under two names

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.proj(self.embed(x)))


def test_weights_for_file_writes_what_save_model_writes(tmp_path):
    from safetensors.torch import save_file, save_model

    torch.manual_seed(0)
    m = _Tied()
    weights, metadata = ckpt.weights_for_file(m)
    assert len(weights) == len(m.state_dict()) - 1 and metadata  # the tied name is kept once
    save_model(m, str(tmp_path / "a.safetensors"))
    save_file(weights, str(tmp_path / "b.safetensors"), metadata=metadata)
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()


def _background(monkeypatch) -> None:
    # The background path is taken for GPU tensors; on this CPU machine it is forced for the test.
    monkeypatch.setattr(savers.FileSaver, "_worth_it", lambda self, weights, state: self.background)


def test_file_saver_in_the_background_writes_the_state_of_the_save_call(tmp_path, monkeypatch):
    """Training changes the weights and the optimizer state right after save() returns: the checkpoint holds them
    as they were at the call, loads into a fresh model (tied weights restored) and is the same file as a
    synchronous save of that state."""
    import threading

    _background(monkeypatch)
    go, real_save = threading.Event(), ckpt.save

    def save_after_training_went_on(*args, **kwargs):  # the write starts once the weights have changed
        assert go.wait(30)
        return real_save(*args, **kwargs)

    monkeypatch.setattr(ckpt, "save", save_after_training_went_on)
    torch.manual_seed(0)
    m = _Tied()
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    m(torch.tensor([1, 2])).sum().backward()
    opt.step()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    saver = savers.FileSaver(tmp_path / "bg", keep_last=2)
    weights, metadata = ckpt.weights_for_file(m)
    state = {"optimizer": opt.state_dict(), "trainer": {"step": 1, "history": [1.0]}}
    saver.save(1, weights, state, weights_metadata=metadata, val_loss=2.5, is_best=True)
    assert saver.last_in_background
    with torch.no_grad():  # the next steps, while the write may still run
        for p in m.parameters():
            p.add_(1.0)
        for s in opt.state.values():
            s["exp_avg"].add_(1.0)
    state["trainer"]["history"].append(2.0)
    go.set()
    saver.close()
    path = ckpt.step_dir(tmp_path / "bg", 1)
    assert ckpt.verify(path) is None and ckpt.best_step(tmp_path / "bg") == 1
    fresh = _Tied()
    restore.load_weights(fresh, path)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert fresh.head.weight is fresh.embed.weight
    back = restore.load_state(path)
    assert back["trainer"]["history"] == [1.0]
    moved = next(iter(opt.state.values()))["exp_avg"]
    assert not torch.equal(next(iter(back["optimizer"]["state"].values()))["exp_avg"], moved)
    sync = real_save(tmp_path / "sync", 1, ckpt.weights_for_file(fresh)[0], back, weights_metadata=metadata)
    assert (sync / ckpt.MODEL_FILE).read_bytes() == (path / ckpt.MODEL_FILE).read_bytes()


def test_file_saver_reports_a_failed_background_write_at_the_next_wait(tmp_path, monkeypatch):
    _background(monkeypatch)

    def broken(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(ckpt, "save", broken)
    saver = savers.FileSaver(tmp_path)
    weights, _ = ckpt.weights_for_file(_model(0))
    saver.save(1, weights, {"trainer": {"step": 1}})
    with pytest.raises(UserError, match="No space left on device"):
        saver.wait()
    saver.wait()  # reported once
    assert ckpt.list_steps(tmp_path) == []


def test_file_saver_writes_cpu_runs_synchronously(tmp_path):
    saver = savers.FileSaver(tmp_path)
    weights, _ = ckpt.weights_for_file(_model(0))
    saver.save(1, weights, {"trainer": {"step": 1}})
    assert not saver.last_in_background and not saver.pending
    assert ckpt.verify(ckpt.step_dir(tmp_path, 1)) is None


def test_file_saver_writes_synchronously_when_the_host_copy_fails(tmp_path, monkeypatch):
    _background(monkeypatch)

    def no_memory(self, state):
        raise MemoryError("cannot allocate")

    monkeypatch.setattr(staging.HostStaging, "stage", no_memory)
    saver = savers.FileSaver(tmp_path)
    weights, _ = ckpt.weights_for_file(_model(0))
    saver.save(1, weights, {"trainer": {"step": 1}})
    assert not saver.last_in_background and not saver.background  # and stays so for the run
    assert ckpt.verify(ckpt.step_dir(tmp_path, 1)) is None


def test_a_failed_background_write_is_made_good_by_a_synchronous_save(tmp_path, monkeypatch):
    """The next save after a failed background write writes its own state at once (and training goes on): the
    trainer calls it at its next log step when it sees the failure."""
    _background(monkeypatch)
    real_save, calls = ckpt.save, []

    def fails_once(*args, **kwargs):
        calls.append(args[1])
        if len(calls) == 1:
            raise OSError("Input/output error")
        return real_save(*args, **kwargs)

    monkeypatch.setattr(ckpt, "save", fails_once)
    saver = savers.FileSaver(tmp_path)
    weights, _ = ckpt.weights_for_file(_model(0))
    saver.save(1, weights, {"trainer": {"step": 1}})
    saver._thread.join()
    assert saver.failed()
    warned = []  # the CLI's logging setup (earlier tests) keeps this logger's records from pytest's capture
    monkeypatch.setattr(savers.log, "warning", lambda fmt, *args: warned.append(fmt % args))
    saver.save(2, weights, {"trainer": {"step": 2}})
    assert not saver.last_in_background and not saver.failed()
    assert len(warned) == 1 and "step 1 could not be written" in warned[0]
    assert "step 2 was written instead" in warned[0]
    assert ckpt.list_steps(tmp_path) == [2] and ckpt.verify(ckpt.step_dir(tmp_path, 2)) is None


def test_wrapper_tensors_are_not_staged():
    """torchao's 8-bit optimizer states are wrapper tensors without storage of their own: host staging (which
    tells tensors apart by data pointer) would give them all one buffer, so such a state is written
    synchronously. A wrapper subclass of torch's own tests stands in for them."""
    two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")
    plain = {"w": torch.ones(3), "state": {"m": torch.zeros(3)}}
    wrapped = {"w": torch.ones(3), "state": {"m": two_tensor.TwoTensor(torch.zeros(3), torch.ones(3))}}
    assert staging.stageable(plain) and not staging.stageable(wrapped)
    saver = savers.FileSaver(".")
    monkey_cuda = {"w": torch.ones(3)}
    assert not saver._worth_it(
        monkey_cuda, wrapped
    )  # CPU tensors, and a wrapper: no background path either way
