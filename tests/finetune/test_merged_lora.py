"""The merged LoRA forward (gptoughts/perf/lora.py) against PEFT's own layer: same outputs, same gradients."""

from __future__ import annotations

import copy

import peft
import pytest
import torch
from torch import nn

from gptoughts.perf.lora import MergedLoraLinear


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(24, 40, bias=True)
        self.down = nn.Linear(40, 24, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def _pair(dropout: float = 0.0) -> tuple[nn.Module, nn.Module]:
    """(PEFT's standard layers, ours) over the same base and the same non-zero adapters."""
    torch.manual_seed(0)
    base = _Net()
    cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=["up", "down"])
    ref = peft.get_peft_model(copy.deepcopy(base), cfg)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=["up", "down"])
    cfg._register_custom_module({nn.Linear: MergedLoraLinear})
    ours = peft.get_peft_model(copy.deepcopy(base), cfg)
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.3)  # B starts at zero: make the adapters do something
        ours.load_state_dict(ref.state_dict())
    assert isinstance(ours.base_model.model.up, MergedLoraLinear)
    assert type(ref.base_model.model.up) is not MergedLoraLinear
    return ref, ours


def _grads(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    x = x.clone().requires_grad_(True)
    y = model(x)
    (y.float() * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
    return y.detach(), x.grad, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def test_merged_forward_matches_peft_outputs_and_gradients_in_fp32(monkeypatch):
    from gptoughts.perf import lora

    applied = []
    real = lora._merged_lora_linear
    monkeypatch.setattr(lora, "_merged_lora_linear", lambda *a: applied.append(1) or real(*a))
    ref, ours = _pair()
    x = torch.randn(3, 5, 24)
    y_ref, dx_ref, g_ref = _grads(ref, x)
    y, dx, g = _grads(ours, x)
    assert len(applied) == 2  # both layers took the merged path
    assert (y - y_ref).abs().max().item() <= 1e-5
    assert (dx - dx_ref).abs().max().item() <= 1e-5
    assert g.keys() == g_ref.keys() and len(g) == 4  # lora_A and lora_B of both layers
    for n in g:
        assert (g[n] - g_ref[n]).abs().max().item() <= 1e-5 * max(1.0, g_ref[n].abs().max().item()), n
    # frozen base: no gradient anywhere else
    assert all(p.grad is None for n, p in ours.named_parameters() if not p.requires_grad)


def _seeded_like_ours(ref: nn.Module, seeds: list[torch.Tensor], p: float) -> None:
    """PEFT's layers with their dropout replaced by the seeded dropout of the seeds our layers drew, in order."""
    from gptoughts.perf.dropout import seeded_dropout

    for layer, seed in zip((ref.base_model.model.up, ref.base_model.model.down), seeds, strict=True):
        layer.lora_dropout["default"].forward = lambda t, seed=seed: seeded_dropout(t, seed, p)


def _spy_seeds(monkeypatch) -> list[torch.Tensor]:
    from gptoughts.perf import lora

    seeds: list[torch.Tensor] = []
    real = lora._LoraLinear.apply
    monkeypatch.setattr(lora._LoraLinear, "apply", lambda *a: seeds.append(a[1]) or real(*a))
    return seeds


@pytest.mark.parametrize("dropout", [0.0, 0.1])  # the merged forward, the fused adapter add
def test_our_forward_under_bf16_autocast_keeps_fp32_adapter_grads(dropout, monkeypatch):
    ref, ours = _pair(dropout=dropout)
    seeds = _spy_seeds(monkeypatch)
    x = torch.randn(2, 9, 24)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, _, g = _grads(ours, x)
        assert len(seeds) == (2 if dropout else 0)
        if dropout:
            _seeded_like_ours(ref, seeds, dropout)
        y_ref, _, g_ref = _grads(ref, x)
    assert y.dtype == y_ref.dtype == torch.bfloat16
    assert (y.float() - y_ref.float()).abs().max().item() <= 0.05 * y_ref.float().abs().max().item()
    for n in g:
        assert g[n].dtype == torch.float32
        assert torch.nn.functional.cosine_similarity(g[n].flatten(), g_ref[n].flatten(), dim=0) > 0.99, n


def test_dropout_in_training_takes_the_fused_adapter_path_with_the_seeded_masks_and_their_gradients(
    monkeypatch,
):
    """With adapter dropout our layer's outputs and hand-written gradients equal autograd's through PEFT's
    ``x W^T + b + s B(A(drop(x)))`` with the seeded masks our forward drew."""
    ref, ours = _pair(dropout=0.5)
    seeds = _spy_seeds(monkeypatch)
    x = torch.randn(4, 8, 24)
    ours.train(), ref.train()
    torch.manual_seed(1)
    y, dx, g = _grads(ours, x)
    assert len(seeds) == 2 and not torch.equal(seeds[0], seeds[1])  # both layers, a fresh seed each
    _seeded_like_ours(ref, seeds, 0.5)
    y_ref, dx_ref, g_ref = _grads(ref, x)
    assert (y - y_ref).abs().max().item() <= 1e-5
    assert (dx - dx_ref).abs().max().item() <= 1e-5
    assert g.keys() == g_ref.keys() and len(g) == 4
    for n in g:
        assert (g[n] - g_ref[n]).abs().max().item() <= 1e-5 * max(1.0, g_ref[n].abs().max().item()), n
    torch.manual_seed(2)  # other seeds, other masks: another output (the dropout is really applied)
    assert (ours(x) - y).abs().max().item() > 1e-3


def test_a_dropout_module_replaced_by_the_user_keeps_pefts_forward(monkeypatch):
    class Half(nn.Dropout):  # a subclass with its own forward: our layer cannot draw its masks
        def forward(self, t):
            return t * 0.5

    ref, ours = _pair(dropout=0.5)
    seeds = _spy_seeds(monkeypatch)
    for m in (ref, ours):
        for layer in (m.base_model.model.up, m.base_model.model.down):
            layer.lora_dropout["default"] = Half(0.5)
    x = torch.randn(4, 8, 24)
    ours.train(), ref.train()
    assert (ours(x) - ref(x)).abs().max().item() <= 1e-5 and not seeds  # PEFT's forward, with the module


def test_eval_takes_the_merged_path_and_tiny_calls_peft_side_path(monkeypatch):
    ref, ours = _pair(dropout=0.5)
    calls = []
    real = MergedLoraLinear._merged_path_ok

    def spy(self, x, kwargs):
        calls.append(real(self, x, kwargs))
        return calls[-1]

    monkeypatch.setattr(MergedLoraLinear, "_merged_path_ok", spy)
    x = torch.randn(4, 8, 24)
    ours.eval(), ref.eval()
    with torch.no_grad():
        assert (ours(x) - ref(x)).abs().max().item() <= 1e-5
    assert calls == ["default", "default"]
    # below in*out/(in+out) tokens (24*40/64 = 15 here: decoding, tiny batches) PEFT's side path is cheaper
    calls.clear()
    with torch.no_grad():
        assert (ours(x[:1, :7]) - ref(x[:1, :7])).abs().max().item() <= 1e-5
    assert calls == [None, None]


def test_merge_and_unload_and_disabled_adapters_behave_as_peft():
    ref, ours = _pair()
    x = torch.randn(2, 3, 24)
    with torch.no_grad(), ours.disable_adapter(), ref.disable_adapter():
        assert (ours(x) - ref(x)).abs().max().item() <= 1e-6
    with torch.no_grad():
        merged = ours.merge_and_unload()
        assert type(merged.up) is nn.Linear
        assert (merged(x) - ref(x)).abs().max().item() <= 1e-5


@pytest.mark.parametrize("merged_forward", [True, False])
def test_apply_lora_registers_the_merged_layer_only_when_asked(merged_forward):
    from gptoughts.config import LoraConfig
    from gptoughts.training.setup import apply_lora

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wq = nn.Linear(8, 8)

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([Block()])

    m = apply_lora(M(), LoraConfig(enabled=True, merged_forward=merged_forward), device=torch.device("cpu"))
    assert isinstance(m.base_model.model.layers[0].wq, MergedLoraLinear) is merged_forward


class _Block(nn.Module):
    """A SwiGLU MLP over LoRA-adapted linears, as in a transformer block."""

    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.w1, self.w3, self.w2 = (
            nn.Linear(d, h, bias=False),
            nn.Linear(d, h, bias=False),
            nn.Linear(h, d, bias=False),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))


@pytest.mark.slow
@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
            ],
        ),
    ],
)
def test_compiled_full_checkpointing_keeps_no_projection_of_the_merged_layer(device):
    """Full activation checkpointing, compiled, keeps each block's input and no projection output: under torch 2.11
    (pytorch/pytorch#177396) the merged layer as an autograd.Function had every layer's projections saved (LoRA-DPO
    at 1b: 7.7 GiB)."""
    from torch._dynamo.utils import counters
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch._dynamo.reset()  # other tests' cache entries would count toward the recompile limit (then: eager)
    compiled = counters["frames"]["ok"]
    torch.manual_seed(0)
    d, h, tokens, layers = 64, 256, 512, 3
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["w1", "w2", "w3"])
    cfg._register_custom_module({nn.Linear: MergedLoraLinear})
    model = peft.get_peft_model(nn.Sequential(*[_Block(d, h) for _ in range(layers)]), cfg).to(
        device, torch.bfloat16
    )
    inner = model.base_model.model
    for i in range(layers):
        inner[i] = checkpoint_wrapper(inner[i])
        inner[i].compile()
    shapes: list[tuple[int, ...]] = []
    x = torch.randn(tokens, d, device=device, dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
        y = inner(x)
    y.float().sum().backward()
    assert counters["frames"]["ok"] > compiled  # the blocks ran compiled, not in an eager fallback
    assert shapes.count((tokens, d)) >= layers  # the blocks' inputs
    assert (tokens, h) not in shapes, shapes  # w1 / w3 outputs: recomputed, not kept
    assert x.grad is not None and all(p.grad is not None for n, p in model.named_parameters() if "lora_" in n)
