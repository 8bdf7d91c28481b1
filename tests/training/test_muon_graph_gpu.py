"""Muon's step replayed as one CUDA graph (``perf.muon_graph``): the same parameters and state, bit for bit, as
the step launched kernel by kernel, through a changing learning rate, clipping and a skipped step; recorded again
after a state load; off when the gradients move every step. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from gptoughts.models import build_model, model_args
from gptoughts.training.optim import build_muon, set_lr

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

HYPER = dict(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, fused=True)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model("llama", model_args("llama", "debug")).cuda()


def _steps(model, opt, first: int, n: int, *, keep: bool = True, held: list | None = None) -> None:
    for step in range(first, first + n):
        set_lr(opt, 1e-2 / (1 + step))
        g = torch.Generator(device="cuda").manual_seed(step)
        for p in model.parameters():
            grad = torch.randn(p.shape, generator=g, device="cuda")
            if keep and p.grad is not None:
                p.grad.copy_(grad)
            else:
                if held is not None:
                    held.append(p.grad)  # the old gradient stays alive: the new one is at a new address
                p.grad = grad
        opt.grad_scale = torch.tensor(1.0 + step / 10, device="cuda")
        opt.found_inf = torch.tensor(1.0 if step == 4 else 0.0, device="cuda")
        opt.step()


def _same(a: torch.nn.Module, b: torch.nn.Module, oa, ob) -> None:
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
        for k, v in oa.state[pa].items():
            assert torch.equal(v, ob.state[pb][k]), k


@pytest.mark.parametrize("compiled", [False, True])
def test_the_replayed_step_is_the_launched_one(fresh_dynamo, compiled):
    m_a, m_b = _model(), _model()
    a = build_muon(m_a, **HYPER, compile=compiled)
    b = build_muon(m_b, **HYPER, compile=compiled, graph=True)
    start = [p.detach().clone() for p in m_b.parameters()]
    _steps(m_a, a, 0, 7)
    _steps(m_b, b, 0, 7)
    assert b.graph and b._graph is not None and b._graph.graph is not None  # recorded at the third step
    assert any(not torch.equal(p, s) for p, s in zip(m_b.parameters(), start))
    _same(m_a, m_b, a, b)


def test_a_state_load_records_the_step_again(fresh_dynamo):
    m_a, m_b = _model(), _model()
    a, b = build_muon(m_a, **HYPER), build_muon(m_b, **HYPER, graph=True)
    _steps(m_a, a, 0, 4)
    _steps(m_b, b, 0, 4)
    saved = a.state_dict()
    a.load_state_dict(saved)
    b.load_state_dict(b.state_dict())
    assert b._graph is None
    _steps(m_a, a, 4, 4)
    _steps(m_b, b, 4, 4)
    assert b._graph is not None and b._graph.graph is not None
    _same(m_a, m_b, a, b)


def test_gradients_at_new_addresses_every_step_turn_the_graph_off(fresh_dynamo):
    m_a, m_b = _model(), _model()
    a, b = build_muon(m_a, **HYPER), build_muon(m_b, **HYPER, graph=True)
    held: list = []
    _steps(m_a, a, 0, 7, keep=False)
    _steps(m_b, b, 0, 7, keep=False, held=held)
    assert not b.graph and b._graph is None
    _same(m_a, m_b, a, b)
