"""The model protocol of docs/internals.md ("Models"), checked for every registered family at its debug size."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gptoughts.errors import UserError
from gptoughts.models import FAMILIES, build_model, model_args

NAMES = list(FAMILIES)
CAUSAL = [n for n in NAMES if FAMILIES[n].objective == "causal"]
DIFFUSION = [n for n in NAMES if FAMILIES[n].objective != "causal"]


def _model(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return build_model(name, model_args(name, "debug"), device="cpu").eval()


def _ids(name: str, b: int = 2, t: int = 12, seed: int = 1) -> torch.Tensor:
    vocab = model_args(name, "debug").vocab_size
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


def _all_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters, buffers (non-persistent ones included) and plain tensor attributes of every module."""
    out = {f"param {k}": p for k, p in model.named_parameters()}
    out.update({f"buffer {k}": b for k, b in model.named_buffers()})
    for mod_name, mod in model.named_modules():
        for attr, value in vars(mod).items():
            if isinstance(value, torch.Tensor):
                out[f"attribute {mod_name}.{attr}"] = value
    return out


def test_every_family_is_checked():
    assert len(NAMES) >= 5 and "debug" in FAMILIES["llama"].sizes
    assert set(CAUSAL) | set(DIFFUSION) == set(NAMES) and CAUSAL


@pytest.mark.parametrize("name", NAMES)
def test_construction_on_meta_allocates_nothing(name):
    """``__init__`` only builds modules: on ``meta`` even the largest preset holds no storage anywhere."""
    fam = FAMILIES[name]
    largest = list(fam.sizes)[-1]
    args = model_args(name, largest)
    with torch.device("meta"):
        model = fam.model_cls(args)
    tensors = _all_tensors(model)
    assert tensors
    on_device = [k for k, t in tensors.items() if t.device.type != "meta"]
    assert not on_device, f"{name}/{largest} allocates on construction: {on_device[:3]}"
    assert model.args is args
    built = build_model(name, model_args(name, "debug"), device="meta")
    assert all(t.is_meta for t in _all_tensors(built).values())


@pytest.mark.parametrize("name", NAMES)
def test_forward_shapes_and_hidden_times_head_is_logits(name):
    model = _model(name)
    args = model.args
    assert isinstance(args, FAMILIES[name].args_cls)
    ids = _ids(name)
    logits = model(ids)
    assert logits.shape == (2, 12, args.vocab_size) and logits.dtype == torch.float32
    hidden = model(ids, return_hidden=True)
    assert hidden.shape == (2, 12, args.d_model)
    weight = model.output_weight
    assert weight.shape == (args.vocab_size, args.d_model)
    assert any(weight is p for p in model.parameters())
    torch.testing.assert_close(F.linear(hidden, weight), logits, rtol=1e-6, atol=1e-6)
    # Explicit positions 0..T-1 are the default positions.
    positions = torch.arange(12).expand(2, 12)
    torch.testing.assert_close(model(ids, position_ids=positions), logits, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_layers_are_a_module_list_of_blocks(name):
    model = _model(name)
    layers = model.layers
    assert isinstance(layers, nn.ModuleList) and len(layers) == model.args.n_layers
    assert len({type(b) for b in layers}) == 1  # one block class, repeated
    per_block = [sum(p.numel() for p in b.parameters()) for b in layers]
    assert min(per_block) > 0
    # The blocks hold most of the non-embedding weights (what checkpointing and FSDP wrap).
    assert sum(per_block) > 0.5 * model.num_params(non_embedding=True)


@pytest.mark.parametrize("name", NAMES)
def test_init_weights_after_to_empty_is_finite_and_reproducible(name):
    args = model_args(name, "debug")

    def materialise(seed: int) -> dict[str, torch.Tensor]:
        model = build_model(name, args, device="meta")
        model.to_empty(device="cpu")
        with torch.no_grad():  # to_empty leaves garbage: make anything init_weights forgets visible
            for t in itertools.chain(model.parameters(), model.buffers()):
                if t.is_floating_point():
                    t.fill_(float("nan"))
        torch.manual_seed(seed)
        model.init_weights()
        return {k: t.detach().clone() for k, t in _all_tensors(model).items()}

    a, b, c = materialise(0), materialise(0), materialise(1)
    not_finite = [k for k, t in a.items() if t.is_floating_point() and not torch.isfinite(t).all()]
    assert not not_finite, f"init_weights leaves non-finite values in {not_finite[:3]}"
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), "same seed, different weights"
    assert not all(torch.equal(a[k], c[k]) for k in a), "the weights do not depend on the seed"
    # build_model on a real device goes through the same path.
    torch.manual_seed(0)
    direct = build_model(name, args, device="cpu")
    assert all(torch.equal(t, a[f"param {k}"]) for k, t in direct.named_parameters())


@pytest.mark.parametrize("name", NAMES)
def test_num_params_and_flops_per_token(name):
    model = _model(name)
    unique = {id(p): p.numel() for p in model.parameters()}
    total = model.num_params()
    assert total == sum(unique.values())
    assert 0 < model.num_params(non_embedding=True) < total
    f64, f128, f256 = (model.flops_per_token(t) for t in (64, 128, 256))
    assert isinstance(f64, int) and 0 < f64 < f128 < f256
    assert f256 - f128 == 2 * (f128 - f64)  # affine in T: 6 N + (attention term) * T


@pytest.mark.parametrize("name", CAUSAL)
def test_cached_decoding_matches_the_full_forward(name):
    model = _model(name)
    ids = _ids(name, t=12)
    full = model(ids)
    cache = model.new_cache(2, 16)
    parts = [model(ids[:, :5], cache=cache)]  # prefill
    parts += [model(ids[:, t : t + 1], cache=cache) for t in range(5, 9)]  # one token at a time
    parts.append(model(ids[:, 9:], cache=cache))  # several tokens after a non-empty cache
    assert cache.length == 12
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", CAUSAL)
def test_causal_families_do_not_see_the_future(name):
    model = _model(name)
    ids = _ids(name, t=16)
    changed = ids.clone()
    changed[:, 9] = (changed[:, 9] + 1) % model.args.vocab_size
    a, b = model(ids), model(changed)
    assert (a[:, :9] - b[:, :9]).abs().max() <= 1e-6
    assert (a[:, 9:] - b[:, 9:]).abs().max() > 1e-4


@pytest.mark.parametrize("name", DIFFUSION)
def test_diffusion_families_attend_both_ways_and_have_no_cache(name):
    model = _model(name)
    ids = _ids(name, t=16)
    changed = ids.clone()
    changed[:, 9] = (changed[:, 9] + 1) % model.args.vocab_size
    assert (model(ids)[:, :9] - model(changed)[:, :9]).abs().max() > 1e-4
    with pytest.raises(UserError):
        model.new_cache(2, 16)
