from __future__ import annotations

import pytest
import torch
from torch import nn

from gptoughts.errors import UserError
from gptoughts.train import checkpoint as ckpt


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))


def test_save_load_roundtrip_weights_only(tmp_path):
    m = _model(0)
    state = {"trainer": {"step": 3}, "rng": {"torch": torch.get_rng_state()}, "loader": {"rows": 12}}
    path = ckpt.save(tmp_path, 3, m, state)
    assert ckpt.verify(path) is None
    m2 = _model(1)
    ckpt.load_weights(m2, path)
    for a, b in zip(m.parameters(), m2.parameters()):
        assert torch.equal(a, b)
    back = ckpt.load_state(path)  # torch.load(weights_only=True)
    assert back["trainer"]["step"] == 3 and back["loader"]["rows"] == 12


def test_rotation_keeps_last_and_best(tmp_path):
    m = _model(0)
    for step in (1, 2, 3, 4, 5):
        ckpt.save(tmp_path, step, m, {"s": step}, keep_last=2, is_best=(step == 2), val_loss=1.0)
    assert ckpt.list_steps(tmp_path) == [2, 4, 5]
    assert ckpt.best_step(tmp_path) == 2


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
    ckpt.load_weights(m2, path)
    assert torch.equal(m2["head"].weight, emb.weight)
