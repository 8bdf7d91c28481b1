"""DPO's LM head (``dpo.head``): the fused pair-chunked head gives plain's losses, margins and gradients (softcap,
label smoothing, tied and untied heads, LoRA and full fine-tuning), no step holds more than one chunk of logits
(the adapters-off reference pass included), a frozen head gets no weight-gradient buffer, and a run trains the
same with either head."""

from __future__ import annotations

import pytest
import torch
from hf_helpers import losses as run_losses
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from gptoughts import api
from gptoughts.training.dpo import DPO
from gptoughts.training.dpo_head import completion_logps, dpo_loss, fused_pair_loss

V, D, T = 37, 16, 7


class Toy(nn.Module):
    """Embedding -> one linear block -> norm, and the model protocol DPO reads (``return_hidden``,
    ``output_weight``, ``logit_softcap``)."""

    def __init__(self, tied: bool, softcap: float | None) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.block = nn.Linear(D, D)
        self.norm = nn.RMSNorm(D)
        self.head = None if tied else nn.Linear(D, V, bias=False)
        self.logit_softcap = softcap

    @property
    def output_weight(self) -> torch.Tensor:
        return self.emb.weight if self.head is None else self.head.weight

    def forward(self, x: torch.Tensor, return_hidden: bool = False) -> torch.Tensor:
        assert return_hidden
        h = self.emb(x)
        return self.norm(h + torch.tanh(self.block(h)))


def toy(tied: bool, lora: bool, softcap: float | None = None) -> nn.Module:
    torch.manual_seed(0)
    model = Toy(tied, softcap)
    if lora:
        from peft import LoraConfig, inject_adapter_in_model

        # Nonzero adapters: the adapters-off reference then differs from the policy.
        model = inject_adapter_in_model(
            LoraConfig(r=4, target_modules=["block"], init_lora_weights=False), model
        )
        for name, p in model.named_parameters():
            p.requires_grad_("lora_" in name)
    return model


def pairs(b: int = 5, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, V, (b, 2, T), generator=g)
    y = torch.randint(0, V, (b, 2, T), generator=g)
    y[:, :, :3] = -100  # the prompt
    y[1, 1] = -100  # a row with no target: log-prob 0
    return x, torch.randn(b, generator=g), y


def step(
    model: nn.Module, dpo: DPO, batch: tuple
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss, _ = dpo(model, batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), dpo.pop_pair_sums(True), grads


@pytest.mark.parametrize("softcap", [None, 1.5])
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("lora", [True, False])
def test_fused_head_gives_plains_loss_metrics_and_gradients(softcap, smoothing, tied, lora):
    model = toy(tied, lora, softcap)
    reference = "adapters_off" if lora else "precomputed"
    batch = pairs()
    want = step(model, DPO(beta=0.5, label_smoothing=smoothing, reference=reference, head="plain"), batch)
    # one pair a chunk; 3 rows: a trained head walks one pair, a frozen one 3 rows (across pairs), then 1;
    # 5 tokens (rows of 7): a frozen head's chunks cross rows
    for chunk, tokens in ((0, 0), (3, 0), (0, 5)):
        dpo = DPO(
            beta=0.5,
            label_smoothing=smoothing,
            reference=reference,
            head="fused",
            logp_chunk=chunk,
            logp_chunk_tokens=tokens,
        )
        loss, sums, grads = step(model, dpo, batch)
        torch.testing.assert_close(loss, want[0])
        torch.testing.assert_close(sums, want[1])  # margin sum, pairs preferred, pairs
        assert grads.keys() == want[2].keys() and grads
        for name in grads:
            torch.testing.assert_close(grads[name], want[2][name], msg=name)
    head = model.emb.weight if tied else model.head.weight
    assert (head.grad is None) == lora  # a frozen head stays without gradient


@pytest.mark.parametrize("softcap", [None, 1.5])
@pytest.mark.parametrize("frozen, tokens", [(False, 0), (True, 0), (True, 5)])
def test_fused_pair_loss_gradients_of_the_hidden_states_and_the_head(softcap, frozen, tokens):
    """An upstream gradient other than 1 scales every gradient; a frozen head is walked 3 rows (chunks across
    pairs) or 5 tokens (across rows) at a time, a trained one a pair at a time."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(6, T, D, generator=g, requires_grad=True)
    w = torch.randn(V, D, generator=g, requires_grad=not frozen)
    inputs = (h,) if frozen else (h, w)
    _, ref, y = pairs(3)
    y = y.view(6, T)
    logps = completion_logps(h, w, y, softcap=softcap).view(3, 2)
    losses, margin = dpo_loss(logps[:, 0] - logps[:, 1], ref, 0.3, 0.1)
    want = torch.autograd.grad(losses.sum() * 2.5, inputs)
    loss, fmargin = fused_pair_loss(
        h, w, y, ref, beta=0.3, label_smoothing=0.1, softcap=softcap, chunk_rows=3, chunk_tokens=tokens
    )
    got = torch.autograd.grad(loss * 2.5, inputs)
    torch.testing.assert_close(loss, losses.sum())
    torch.testing.assert_close(fmargin, margin)
    assert not fmargin.requires_grad
    torch.testing.assert_close(got, want)


def test_fused_pair_loss_refuses_half_a_pair():
    with pytest.raises(ValueError, match="whole pairs"):
        fused_pair_loss(torch.zeros(3, T, D), torch.zeros(V, D), torch.zeros(3, T, dtype=torch.long),
                        torch.zeros(1), beta=0.1)  # fmt: skip


class OutputShapes(TorchDispatchMode):
    """Every tensor an aten op returns, as (shape, dtype), forward and backward."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[tuple[int, ...], torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.seen += [(tuple(t.shape), t.dtype) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out


def largest_logits(seen: list[tuple[tuple[int, ...], torch.dtype]]) -> int:
    """Elements of the largest ``[..., vocab]`` tensor but the head weight's transpose ``[d, vocab]``."""
    return max(torch.Size(s).numel() for s, _ in seen if s and s[-1] == V and s != (D, V))


@pytest.mark.parametrize(
    "head, rows, tokens", [("fused", 1, 0), ("fused", 2, 0), ("fused", 2, 4), ("chunked", 2, 0)]
)
def test_no_tensor_of_a_dpo_step_holds_more_than_one_chunk_of_logits(head, rows, tokens):
    """The adapters-off reference pass, the policy forward and the backward: the largest ``[..., vocab]`` tensor is
    one chunk of logits (``rows`` rows, or ``tokens`` tokens). The plain head, for contrast, holds every row's."""
    model, batch = toy(tied=True, lora=True), pairs(4)
    with OutputShapes() as rec:
        step(model, DPO(reference="adapters_off", head="plain"), batch)
    assert largest_logits(rec.seen) == 8 * T * V
    with OutputShapes() as rec:
        dpo = DPO(reference="adapters_off", head=head, logp_chunk=rows, logp_chunk_tokens=tokens)
        step(model, dpo, batch)
    assert largest_logits(rec.seen) == (tokens or rows * T) * V
    if head == "fused":  # LoRA with a tied head: the frozen head's [V, d] fp32 gradient buffer is never made
        assert not [s for s, dt in rec.seen if s == (V, D) and dt == torch.float32]


def test_eval_forwards_walk_chunks_and_give_plains_metrics():
    model, batch = toy(tied=False, lora=True), pairs(4)
    out = {}
    for head in ("plain", "fused"):
        dpo = DPO(reference="adapters_off", head=head, logp_chunk=2)
        model.eval()
        with torch.no_grad(), OutputShapes() as rec:
            loss, _ = dpo(model, batch)
        out[head] = (loss, dpo.pop_pair_sums(False), largest_logits(rec.seen))
    torch.testing.assert_close(out["fused"][:2], out["plain"][:2])
    assert out["fused"][2] == 2 * T * V < out["plain"][2]


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"dpo.head": "liger"}, "dpo.head must be one of fused, chunked, plain"),
        ({"dpo.logp_chunk_tokens": -1}, "dpo.logp_chunk_tokens must be >= 0"),
    ],
)
def test_head_settings_are_checked(overrides, message, hf_model):
    from gptoughts.config import load_config
    from gptoughts.errors import ConfigError

    base = {"model.init_from": str(hf_model("llama")), "train.objective": "dpo"}
    with pytest.raises(ConfigError, match=message):
        load_config("finetune", {**base, **overrides})


@pytest.mark.parametrize("lora", [True, False])
def test_a_dpo_run_trains_the_same_with_the_fused_and_the_plain_head(
    lora, hf_model, tmp_path, ft_fast, ft_cache
):
    from test_dpo import _opts, prefs_file

    base, data = hf_model("llama", tie_word_embeddings=True), prefs_file(tmp_path / "p.jsonl", n=24)
    o = _opts(ft_fast, **{"train.max_steps": 3, "train.learning_rate": 5e-2, "train.eval_interval": 0,
                          "train.log_interval": 1, "perf.threads": 1})  # fmt: skip
    for head in ("plain", "fused"):
        api.finetune(model_path=str(base), data_path=str(data), lora=lora, save_dir=str(tmp_path / head),
                     **o, **{"dpo.head": head, "dpo.logp_chunk": 4})  # fmt: skip
    plain, fused = run_losses(tmp_path / "plain"), run_losses(tmp_path / "fused")
    assert sorted(plain) == [1, 2, 3] and plain[3] != plain[1]
    for s in plain:
        assert fused[s] == pytest.approx(plain[s], abs=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("frozen", [False, True])
def test_compiled_chunks_give_the_eager_values(frozen):
    """perf.compile on: the fused chunks and the no-gradient chunks run under torch.compile, with the same
    results."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(6, T, D, generator=g, requires_grad=True)
    w = torch.randn(V, D, generator=g, requires_grad=not frozen)
    inputs = (h,) if frozen else (h, w)
    _, ref, y = pairs(3)
    y = y.view(6, T)
    out = {}
    for compiled in (False, True):
        loss, margin = fused_pair_loss(h, w, y, ref, beta=0.3, softcap=1.5, chunk_rows=3, compiled=compiled)
        grads = torch.autograd.grad(loss, inputs)
        with torch.no_grad():
            logps = completion_logps(h, w, y, softcap=1.5, chunk_rows=4, compiled=compiled)
        out[compiled] = (loss, margin, *grads, logps)
    torch.testing.assert_close(out[True], out[False])
