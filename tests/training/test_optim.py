from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from gptoughts.training.optim import Schedule, param_groups


def test_cosine_schedule_shape():
    s = Schedule("cosine", 1.0, total_steps=110, warmup_steps=10, min_lr_ratio=0.1)
    assert s.lr_at(0) == pytest.approx(0.1)
    assert s.lr_at(9) == pytest.approx(1.0)
    assert s.lr_at(10) == pytest.approx(1.0)
    assert s.lr_at(60) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    assert s.lr_at(110) == pytest.approx(0.1)
    lrs = [s.lr_at(i) for i in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_wsd_and_constant():
    w = Schedule("wsd", 1.0, total_steps=100, warmup_steps=10, min_lr_ratio=0.0, decay_fraction=0.2)
    assert w.lr_at(50) == 1.0 and w.lr_at(79) == 1.0
    assert w.lr_at(90) == pytest.approx(0.5)
    assert w.lr_at(100) == pytest.approx(0.0)
    c = Schedule("constant", 0.5, total_steps=100, warmup_steps=0)
    assert c.lr_at(0) == c.lr_at(99) == 0.5


def test_no_weight_decay_on_norms_biases_embeddings():
    m = nn.ModuleDict({"emb": nn.Embedding(10, 4), "lin": nn.Linear(4, 4), "norm": nn.LayerNorm(4)})
    decay, no_decay = param_groups(m, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert {id(p) for p in decay["params"]} == {id(m["lin"].weight)}
    ids = {id(p) for p in no_decay["params"]}
    assert ids == {id(m["emb"].weight), id(m["lin"].bias), id(m["norm"].weight), id(m["norm"].bias)}
    assert isinstance(torch.optim.AdamW([decay, no_decay]), torch.optim.AdamW)


@pytest.mark.parametrize("max_norm", [0.05, 1e9, math.inf])
def test_clipping_folded_into_fused_adamw_equals_clip_then_step(max_norm):
    from gptoughts.training.optim import clip_and_step

    def run(fused: bool):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, fused=fused)
        params = list(m.parameters())
        norms = []
        for step in range(3):
            x = torch.randn(5, 8, generator=torch.Generator().manual_seed(step))
            loss = m(x).pow(2).sum()
            loss.backward()
            norm, found_inf = clip_and_step(opt, params, max_norm, loss.detach(), fused=fused)
            assert found_inf.item() == 0
            norms.append(norm.item())
            opt.zero_grad(set_to_none=True)
        return torch.cat([p.detach().flatten() for p in params]), norms

    (ref, ref_norms), (got, got_norms) = run(False), run(True)
    assert got_norms == pytest.approx(ref_norms, rel=1e-6)
    if max_norm == 0.05:
        assert min(ref_norms) > 0.05  # clipping was active
    assert torch.allclose(got, ref, atol=1e-6, rtol=1e-5)


def test_fused_step_is_skipped_when_not_finite():
    from gptoughts.training.optim import clip_and_step

    m = nn.Linear(4, 4)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)
    before = m.weight.detach().clone()
    m(torch.randn(2, 4)).sum().backward()
    m.weight.grad[0, 0] = float("nan")
    _, found_inf = clip_and_step(opt, list(m.parameters()), 1.0, torch.tensor(1.0), fused=True)
    assert found_inf.item() == 1 and torch.equal(m.weight.detach(), before)
