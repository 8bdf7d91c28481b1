"""Muon (``train.optimizer = muon``): the update equals torch.optim.Muon's, parameter groups, device-side skip."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gptoughts.models import build_model, hidden_matrices, model_args
from gptoughts.training.optim import Muon, build_muon, set_lr


def _pair(shape: tuple[int, ...], seed: int = 0) -> tuple[nn.Parameter, nn.Parameter]:
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    return nn.Parameter(w.clone()), nn.Parameter(w.clone())


@pytest.mark.parametrize("adjust", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("shape", [(32, 16), (16, 48)])
def test_muon_step_equals_torch_muon(adjust, shape):
    ref_p, our_p = _pair(shape)
    ref = torch.optim.Muon([ref_p], lr=0.02, weight_decay=0.1, adjust_lr_fn=adjust)
    ours = Muon([{"params": [our_p], "muon": True, "weight_decay": 0.1}], lr=0.02, adjust_lr=adjust)
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        grad = torch.randn(*shape, generator=g)
        ref_p.grad, our_p.grad = grad.clone(), grad.clone()
        ref.step()
        ours.step()
    assert not torch.equal(ref_p, _pair(shape)[0])  # it moved
    torch.testing.assert_close(our_p, ref_p, rtol=0, atol=0)
    torch.testing.assert_close(
        ours.state[our_p]["momentum_buffer"], ref.state[ref_p]["momentum_buffer"], rtol=0, atol=0
    )


def test_stacked_experts_are_orthogonalized_one_by_one():
    """A 3-D parameter (MoE experts [E, out, in]) takes the step torch.optim.Muon gives each expert alone."""
    stacked, _ = _pair((4, 8, 12))
    alone = [nn.Parameter(stacked[i].detach().clone()) for i in range(4)]
    ours = Muon([{"params": [stacked], "muon": True, "weight_decay": 0.1}], lr=0.02)
    ref = torch.optim.Muon(alone, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        grad = torch.randn(4, 8, 12, generator=g)
        stacked.grad = grad.clone()
        for i, p in enumerate(alone):
            p.grad = grad[i].clone()
        ours.step()
        ref.step()
    for i, p in enumerate(alone):
        torch.testing.assert_close(stacked[i], p, rtol=0, atol=0)


def test_adamw_groups_equal_torch_adamw():
    ref_p, our_p = _pair((6, 5))
    ref_b, our_b = _pair((5,), seed=3)
    ref = torch.optim.AdamW(
        [{"params": [ref_p], "weight_decay": 0.1}, {"params": [ref_b], "weight_decay": 0.0}],
        lr=1e-2,
        betas=(0.9, 0.95),
        foreach=True,
    )
    ours = Muon(
        [
            {"params": [our_p], "muon": False, "weight_decay": 0.1},
            {"params": [our_b], "muon": False, "weight_decay": 0.0},
        ],
        lr=1e-2,
        betas=(0.9, 0.95),
    )
    g = torch.Generator().manual_seed(4)
    for _ in range(4):
        for a, b in ((ref_p, our_p), (ref_b, our_b)):
            grad = torch.randn(a.shape, generator=g)
            a.grad, b.grad = grad.clone(), grad.clone()
        ref.step()
        ours.step()
    torch.testing.assert_close(our_p, ref_p, rtol=0, atol=0)
    torch.testing.assert_close(our_b, ref_b, rtol=0, atol=0)


@pytest.mark.parametrize("family", ["llama", "deepseek", "inl", "gpt2", "llada"])
def test_every_parameter_in_exactly_one_group(family):
    model = build_model(family, model_args(family, "debug"))
    opt = build_muon(model, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, fused=False)
    seen = [id(p) for g in opt.param_groups for p in g["params"]]
    assert len(seen) == len(set(seen)) == len({id(p) for p in model.parameters()})
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)] for g in opt.param_groups if g["muon"] for p in g["params"]}
    adamw = {names[id(p)] for g in opt.param_groups if not g["muon"] for p in g["params"]}
    assert muon and all(names[i] in muon for i in hidden_matrices(model))
    embeddings = {n for n, m in model.named_modules() if isinstance(m, nn.Embedding)}
    assert all(f"{e}.weight" in adamw for e in embeddings)  # embeddings (and a tied head) take AdamW
    assert all(n in adamw for n, p in model.named_parameters() if p.ndim < 2)  # norms, biases
    if "output.weight" in names.values():  # an untied head onto the vocabulary
        assert "output.weight" in adamw
    if family == "gpt2":  # its MLP is as wide as the position table: still a hidden matrix
        assert "layers.0.mlp.c_fc.weight" in muon
    if family == "deepseek":
        assert any("experts.w1" in n for n in muon) and any("wkv_a" in n for n in muon)  # MoE and MLA


def test_non_finite_step_leaves_everything_untouched_on_the_device():
    """found_inf = 1 (set by clip_and_step, read on the device): no parameter or state changes."""
    model = build_model("llama", model_args("llama", "debug"))
    opt = build_muon(model, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, fused=True)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.grad_scale, opt.found_inf = torch.tensor(2.0), torch.tensor(0.0)
    opt.step()  # a real step first, so there is state to keep
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    for p in model.parameters():
        p.grad = torch.full_like(p, float("nan"))
    opt.grad_scale, opt.found_inf = torch.tensor(float("nan")), torch.tensor(1.0)
    opt.step()
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    for p, s in opt.state.items():
        for k, v in s.items():
            assert torch.equal(v, state[id(p)][k]), k


def test_grad_scale_is_clipping():
    """Dividing by grad_scale inside the step equals clipping the gradients first."""
    m1 = build_model("llama", model_args("llama", "debug"))
    m2 = build_model("llama", model_args("llama", "debug"))
    m2.load_state_dict(m1.state_dict())
    o1 = build_muon(m1, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, fused=False)
    o2 = build_muon(m2, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, fused=False)
    for p1, p2 in zip(m1.parameters(), m2.parameters()):
        p1.grad = torch.randn_like(p1)
        p2.grad = p1.grad / 3.0
    o1.grad_scale = torch.tensor(3.0)
    o1.step()
    o2.step()
    for p1, p2 in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(p1, p2, rtol=1e-5, atol=1e-6)


def test_own_learning_rate_keeps_its_ratio_under_the_schedule():
    model = build_model("llama", model_args("llama", "debug"))
    opt = build_muon(model, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, fused=False, muon_lr=2e-2)
    set_lr(opt, 5e-4)  # the schedule halves the peak
    lrs = {g["muon"]: g["lr"] for g in opt.param_groups}
    assert lrs[True] == pytest.approx(1e-2) and lrs[False] == pytest.approx(5e-4)


def _sharded_step(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        g = torch.Generator().manual_seed(5)
        weights = [
            torch.randn(9, 6, generator=g),
            torch.randn(3, 5, 7, generator=g),
        ]  # uneven shards, experts
        params = [nn.Parameter(distribute_tensor(w, mesh, [Shard(0)])) for w in weights]
        opt = Muon([{"params": params, "muon": True, "weight_decay": 0.1}], lr=0.02)
        for _ in range(3):
            for p, w in zip(params, weights):
                p.grad = distribute_tensor(torch.randn(w.shape, generator=g), mesh, [Shard(0)])
            opt.step()
        full = [p.full_tensor() for p in params]
        if rank == 0:
            torch.save(full, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_sharded_parameters_step_like_whole_ones(tmp_path):
    """Under FSDP a parameter is a DTensor sharded on dim 0: each rank's step equals the whole matrix's step
    (the update is orthogonalized on the gathered matrix, then cut to the shard), bit for bit."""
    import torch.multiprocessing as mp

    out = tmp_path / "sharded.pt"
    mp.spawn(_sharded_step, args=(2, f"file://{tmp_path / 'rdzv'}", str(out)), nprocs=2, join=True)
    g = torch.Generator().manual_seed(5)
    weights = [torch.randn(9, 6, generator=g), torch.randn(3, 5, 7, generator=g)]
    params = [nn.Parameter(w.clone()) for w in weights]
    opt = Muon([{"params": params, "muon": True, "weight_decay": 0.1}], lr=0.02)
    for _ in range(3):
        for p, w in zip(params, weights):
            p.grad = torch.randn(w.shape, generator=g)
        opt.step()
    for a, b in zip(torch.load(out, weights_only=True), params):
        torch.testing.assert_close(a, b.detach(), rtol=0, atol=0)


def _step_beside_torch_muon(shapes: list[tuple[int, int]]) -> None:
    """Three steps of our Muon and torch.optim.Muon on the same gradients: each matrix moves as torch's, to bf16
    rounding of the iteration (batched matmuls may round differently; a bug, wrong matrix or scale, moves it by
    about its whole step)."""
    ours = [
        nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(i))) for i, s in enumerate(shapes)
    ]
    ref = [nn.Parameter(p.detach().clone()) for p in ours]
    start = [p.detach().clone() for p in ours]
    o = Muon([{"params": ours, "muon": True, "weight_decay": 0.1}], lr=0.02)
    r = torch.optim.Muon(ref, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    g = torch.Generator().manual_seed(9)
    for _ in range(3):
        for a, b in zip(ours, ref):
            a.grad = torch.randn(a.shape, generator=g)
            b.grad = a.grad.clone()
        o.step()
        r.step()
    for a, b, s in zip(ours, ref, start):
        step = (b - s).abs().max().item()
        assert step > 1e-3
        assert (a - b).abs().max().item() < 0.02 * step


def test_matrices_of_one_shape_are_orthogonalized_together_like_alone():
    """Same-shape matrices go through Newton-Schulz as one batch (speed); each gets torch.optim.Muon's step
    for it alone."""
    _step_beside_torch_muon([(12, 20)] * 3)


def test_tall_and_wide_matrices_of_one_shape_share_a_batch(monkeypatch):
    """An MLP's w1/w3 [f, d] and w2 [d, f] go through Newton-Schulz as one batch (the tall ones transposed, as
    each would be alone): one batch per shape as iterated, and each matrix gets torch.optim.Muon's step for it
    alone."""
    from gptoughts.training import newton_schulz

    batches: list[tuple[int, ...]] = []
    plain = newton_schulz.orthogonalize
    monkeypatch.setattr(
        newton_schulz, "orthogonalize", lambda x, *a: batches.append(tuple(x.shape)) or plain(x, *a)
    )
    _step_beside_torch_muon([(20, 12), (12, 20), (20, 12)])
    assert batches == [(3, 12, 20)] * 3


def test_a_shape_whose_learning_rate_depends_on_orientation_keeps_two_batches(monkeypatch):
    """adjust_lr = original scales a tall matrix by sqrt(rows / cols) and a wide one by 1: they stay apart."""
    from gptoughts.training import newton_schulz

    ours = [nn.Parameter(torch.randn(s)) for s in [(20, 12), (12, 20)]]
    ref = [nn.Parameter(p.detach().clone()) for p in ours]
    batches: list[tuple[int, ...]] = []
    plain = newton_schulz.orthogonalize
    monkeypatch.setattr(
        newton_schulz, "orthogonalize", lambda x, *a: batches.append(tuple(x.shape)) or plain(x, *a)
    )
    o = Muon([{"params": ours, "muon": True, "weight_decay": 0.1}], lr=0.02, adjust_lr="original")
    r = torch.optim.Muon(ref, lr=0.02, weight_decay=0.1, adjust_lr_fn="original")
    for a, b in zip(ours, ref):
        a.grad = torch.randn(a.shape)
        b.grad = a.grad.clone()
    o.step()
    r.step()
    assert sorted(batches) == [(12, 20), (20, 12)]
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
