from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from gptoughts.errors import ConfigError
from gptoughts.models import build_model, model_args
from gptoughts.models.inl import DEFAULT_K, INL, INLArgs, Integrator
from gptoughts.sampling import generate


def _args(**overrides) -> INLArgs:
    return model_args("inl", "debug", overrides)


def _perturb_integrators(model: INL, seed: int = 3) -> None:
    # At init the controller's output layer is zero, so α, β, gate, v_cand do not depend on the token: perturb
    # every integrator parameter so that the tests exercise the full, input-dependent dynamics.
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".integrator." in name:
                p.add_(0.3 * torch.randn(p.shape, generator=g))


def _model(seed: int = 0, perturb: bool = True, **overrides) -> INL:
    torch.manual_seed(seed)
    model = build_model("inl", _args(**overrides), device="cpu").eval()
    if perturb:
        _perturb_integrators(model)
    return model


def _ids(b: int = 2, t: int = 12, vocab: int = 512, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


def test_shapes_hidden_times_head_is_logits_and_tied():
    model = _model()
    ids = _ids()
    logits = model(ids)
    assert logits.shape == (2, 12, 512) and logits.dtype == torch.float32
    hidden = model(ids, return_hidden=True)
    assert hidden.shape == (2, 12, 64)
    torch.testing.assert_close(hidden @ model.output_weight.T, logits, rtol=0, atol=1e-5)
    # Tied: the head is the embedding matrix, stored once.
    assert model.output_weight is model.tok_embeddings.weight
    assert [
        k for k in model.state_dict() if k.endswith(".weight") and k.startswith(("output", "lm_head"))
    ] == []
    assert model.num_params() - model.num_params(non_embedding=True) == 512 * 64


def test_causality():
    # The central point versus the user's first version, which averaged h over the whole sequence.
    model = _model()
    ids = _ids(t=16)
    changed = ids.clone()
    changed[:, 9] = (changed[:, 9] + 1) % 512
    a, b = model(ids), model(changed)
    assert (a[:, :9] - b[:, :9]).abs().max() <= 1e-6
    assert (a[:, 9:] - b[:, 9:]).abs().max() > 1e-4  # the change does propagate forward


def test_integrator_changes_the_output():
    # Not a no-op: the same weights without the integrator (gate closed) give other logits.
    model = _model()
    ids = _ids()
    with_integrator = model(ids)
    with torch.no_grad():
        for layer in model.layers:
            layer.integrator.b_out[2 * 64 : 3 * 64] = -1e4  # sigmoid(gate) = 0: x_K = x_0 = attention output
            layer.integrator.w_out[2 * 64 : 3 * 64] = 0.0
    closed = model(ids)
    assert (with_integrator - closed).abs().max() > 1e-3
    baseline = build_model("inl", _args(n_iterations=0), device="meta")
    baseline.to_empty(device="cpu")
    baseline.init_weights()
    sd = {k: v for k, v in model.state_dict().items() if ".integrator." not in k}
    baseline.load_state_dict(sd, strict=True)
    torch.testing.assert_close(baseline.eval()(ids), closed, rtol=0, atol=1e-5)


def _reference_step(integ: Integrator, h, x, v):
    """The update equations written out from the module docstring, with the controller as one MLP."""
    d = integ.dim
    out = F.linear(F.gelu(torch.cat([h, x, v], -1) @ integ.w_in.T + integ.b_in), integ.w_out, integ.b_out)
    a_logit, b_pre, g_logit, v_cand = (
        out[..., :d],
        out[..., d : 2 * d],
        out[..., 2 * d : 3 * d],
        out[..., 3 * d :],
    )
    kappa = torch.log1p(torch.exp(integ.kappa_raw))
    alpha = torch.sigmoid(a_logit) * torch.exp(-kappa * (x - integ.mu).abs())
    beta = torch.log1p(torch.exp(b_pre))
    gate = torch.sigmoid(g_logit)
    v_next = alpha * v + (1 - alpha) * v_cand - beta * (x - integ.mu)
    x_next = x + integ.dt * gate * v_next
    return x_next, v_next


def test_one_integrator_iteration_matches_reference():
    torch.manual_seed(0)
    d = 16
    integ = Integrator(d, n_iterations=3, dt=0.1, hidden=8)
    integ.reset_parameters(0.02)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in integ.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=g))
    h, x, v = (torch.randn(2, 5, d, generator=g) for _ in range(3))
    x_ref, v_ref = _reference_step(integ, h, x, v)
    x_got, v_got = integ.step(h, x, v)
    torch.testing.assert_close(x_got, x_ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(v_got, v_ref, rtol=0, atol=1e-6)
    # The optimised loop (h's share of the controller precomputed, v_0 = 0 shortcut) is K reference steps.
    xs, vs = h, torch.zeros_like(h)
    for _ in range(3):
        xs, vs = _reference_step(integ, h, xs, vs)
    torch.testing.assert_close(integ(h), xs, rtol=0, atol=1e-5)


def test_initial_controller_is_the_users_dynamics():
    integ = Integrator(8, n_iterations=1, dt=0.1, hidden=4)
    integ.reset_parameters(0.02)
    h = torch.randn(3, 8)
    x, v = integ.step(h, h, torch.zeros_like(h))
    # Output layer zero: α = 0.8·exp(-|x|), β = 0.5, gate = 0.5, v_cand = 0 (μ = 0, κ = 1).
    torch.testing.assert_close(v, -0.5 * h, rtol=0, atol=1e-6)
    torch.testing.assert_close(x, h + 0.1 * 0.5 * v, rtol=0, atol=1e-6)
    torch.testing.assert_close(F.softplus(integ.kappa_raw), torch.ones(8))


def test_meta_build_then_init_matches_direct_build_and_is_finite():
    args = _args()
    direct = INL(args)
    torch.manual_seed(123)
    direct.init_weights()
    with torch.device("meta"):
        lazy = INL(args)
    lazy.to_empty(device="cpu")
    with torch.no_grad():
        for t in [*lazy.parameters(), *lazy.buffers()]:
            t.fill_(float("nan"))  # whatever to_empty left must not survive init_weights
    torch.manual_seed(123)
    lazy.init_weights()
    ref = {**dict(direct.named_parameters()), **dict(direct.named_buffers())}
    got = {**dict(lazy.named_parameters()), **dict(lazy.named_buffers())}
    assert got.keys() == ref.keys()
    for name, t in got.items():
        assert torch.isfinite(t).all(), name
        assert torch.equal(t, ref[name]), name
    assert torch.isfinite(lazy.eval()(_ids())).all()


def test_kv_cache_matches_full_forward():
    model = _model()
    ids = _ids(t=20)
    full = model(ids)
    cache = model.new_cache(batch_size=2, max_len=20)
    parts = [
        model(ids[:, :8], cache=cache),
        model(ids[:, 8:13], cache=cache),  # prefill after a prefix (explicit mask path)
        *(model(ids[:, t : t + 1], cache=cache) for t in range(13, 20)),
    ]
    assert cache.length == 20
    # The cache holds attention K/V only: the integrator state is per token, nothing else to carry.
    assert len(cache.k) == 2 and cache.k[0].shape == (2, 4, 20, 16)
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=0, atol=1e-5)


def test_generation_with_and_without_cache_agree():
    model = _model()
    prompt = _ids(b=2, t=5)
    cached = generate(model, prompt, 12, temperature=0.0, use_cache=True)
    plain = generate(model, prompt, 12, temperature=0.0, use_cache=False)
    assert cached.shape == (2, 17)
    assert torch.equal(cached, plain)


def test_position_ids_and_length_limit():
    model = _model(max_seq_len=32)
    ids = _ids(t=10)
    pos = torch.arange(10).expand(2, 10)
    torch.testing.assert_close(model(ids, position_ids=pos), model(ids), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(_ids(t=33))
    with pytest.raises(ValueError, match="max_seq_len"):
        model.new_cache(1, 64)


def test_block_trains_on_repeating_data():
    torch.manual_seed(0)
    model = build_model("inl", _args(), device="cpu").train()
    pattern = torch.randint(0, 512, (8,), generator=torch.Generator().manual_seed(2))
    ids = pattern.repeat(2, 4)  # [2, 32]: a sequence that repeats every 8 tokens
    x, y = ids[:, :-1], ids[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] > math.log(512) - 0.5  # starts near uniform
    assert losses[-1] < 0.5 * losses[0]
    # The controller learns too: its output layer (zero at init) has moved.
    assert model.layers[0].integrator.w_out.abs().max() > 0


def test_param_counts_and_flops():
    a = _args()
    d, L, V, H, K = a.d_model, a.n_layers, a.vocab_size, a.controller_hidden, a.n_iterations
    attn = 4 * d * d
    ffn = 2 * d * 4 * d
    controller = 3 * d * H + H + H * 4 * d + 4 * d + 2 * d  # W_in, b_in, W_out, b_out, μ, κ
    per_layer = attn + ffn + controller + 2 * d
    expected = V * d + L * per_layer + d
    model = _model(perturb=False)
    assert model.num_params() == expected == 189_632
    assert model.num_params(non_embedding=True) == expected - V * d
    # Controller matrices counted as applied: W_in's h part once, its [x, v] part and W_out K times.
    n_eff = expected - V * d + V * d + L * (d * H + K * 6 * d * H - 7 * d * H)
    assert model.flops_per_token(256) == 6 * n_eff + 12 * L * d * 256
    assert DEFAULT_K == a.n_iterations
    assert model_args("inl", "3b", {}).d_model == 2048 and model_args("inl", "4b", {}).n_layers == 48
    big = {s: build_model("inl", model_args("inl", s, {}), device="meta").num_params() for s in ("3b", "4b")}
    assert big == {"3b": 2_117_734_912, "4b": 3_183_580_416}  # the figures of the module docstring


def test_k_zero_is_a_plain_transformer_and_args_are_checked():
    model = _model(perturb=False, n_iterations=0)
    assert not any(".integrator." in k for k in model.state_dict())
    assert torch.isfinite(model(_ids())).all()
    with pytest.raises(ConfigError, match="n_iterations"):
        _args(n_iterations=-1)
    with pytest.raises(ConfigError, match="n_kv_heads"):
        _args(n_kv_heads=3)
    with pytest.raises(ConfigError, match="dt"):
        _args(dt=0.0)


def test_packed_rows_match_separate_documents():
    model = _model()
    a, b = _ids(b=1, t=5, seed=3), _ids(b=1, t=7, seed=4)
    packed = torch.cat([a, b], dim=1)
    pos = torch.cat([torch.arange(5), torch.arange(7)])[None]
    docs = torch.tensor([[0] * 5 + [1] * 7])
    out = model(packed, position_ids=pos, doc_ids=docs)
    torch.testing.assert_close(out, torch.cat([model(a), model(b)], dim=1), rtol=0, atol=1e-5)
