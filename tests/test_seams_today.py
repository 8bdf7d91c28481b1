"""Where two features meet: fp8 fused_rowwise under LoRA, the FSDP2 gradient-sync rule under the memory layout
search's CPU offload, FSDP-only settings asked of runs that are not FSDP."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from gptoughts.config import LoraConfig, load_config
from gptoughts.models import build_model, model_args
from gptoughts.parallel.dist import DistInfo
from gptoughts.perf.fp8_fused import FusedFp8Linear, convert_to_fused_fp8
from gptoughts.perf.hardware import HardwareProfile
from gptoughts.training.environment import Environment
from gptoughts.training.setup import apply_lora

GIB = 2**30


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model("llama", model_args("llama", "debug", {"n_layers": 2}), device="cpu")


@pytest.mark.parametrize("merged", [True, False])
def test_lora_adapters_of_the_mlp_train_under_fused_fp8(merged):
    """fp8 converts before LoRA wraps: the fused SwiGLU read its linears' weights directly, so the adapters PEFT put
    on gate, up and down were skipped (no gradient, no effect). Every adapter now trains, over fp8 base linears."""
    model = _llama()
    convert_to_fused_fp8(model)
    lora = LoraConfig(enabled=True, r=4, alpha=8, merged_forward=merged)
    peft_model = apply_lora(model, lora, device=torch.device("cpu"))
    ff = peft_model.base_model.model.layers[0].feed_forward
    assert all(isinstance(getattr(ff, n).base_layer, FusedFp8Linear) for n in ("w1", "w2", "w3"))
    x = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = peft_model(x).clone()
        for name, p in peft_model.named_parameters():  # adapters that are not zero: they change the output
            if "lora_B" in name:
                p.normal_(std=0.5)
    out = peft_model(x)
    assert (out - before).abs().max() > 1e-3
    out.float().square().mean().backward()
    trained = {n: p.grad for n, p in peft_model.named_parameters() if p.requires_grad}
    mlp = [n for n in trained if "feed_forward" in n]
    assert len(mlp) == 2 * 2 * 3  # lora_A, lora_B of w1, w2, w3 in 2 blocks
    missing = [n for n, g in trained.items() if g is None or not g.abs().sum() > 0]
    assert not missing, missing


def test_fused_fp8_and_lora_give_the_unconverted_lora_models_output():
    """The same adapters over fp8 base linears: the bf16 LoRA model's output, within fp8 rounding."""
    ref, fused = _llama(), _llama()
    convert_to_fused_fp8(fused)
    lora = LoraConfig(enabled=True, r=4, alpha=8)
    ref, fused = (apply_lora(m, lora, device=torch.device("cpu")) for m in (ref, fused))
    with torch.no_grad():
        for (name, a), b in zip(ref.named_parameters(), fused.parameters()):
            if "lora_" in name:
                if "lora_B" in name:
                    a.normal_(std=0.5)
                b.copy_(a)
    x = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    want, got = ref(x), fused(x)
    assert ((got - want).norm() / want.norm()).item() < 0.05


def _hw(gib: float) -> HardwareProfile:
    return HardwareProfile(
        device="cuda:0", name="NVIDIA H100 80GB HBM3", arch="hopper", compute_capability=(9, 0),
        memory_bytes=int(gib * GIB), gpu_count=1, cpu_count=16, peak_bf16_flops=989e12, bf16=True, fp16=True,
        fp8=True, compile=True,
    )  # fmt: skip


def test_cpu_offload_chosen_by_the_layout_search_reduces_gradients_every_micro_batch(monkeypatch):
    """The layout search moves a run that fits nowhere else to CPU offload; the DistInfo it makes for it kept the
    default 'sync after the last micro-batch', so FSDP2 held the whole unsharded fp32 gradient on the GPU between
    micro-batches (what offload exists to avoid, and what the estimate that chose it did not count)."""
    from gptoughts.training import build, estimates

    monkeypatch.setattr(estimates, "host_memory_gib", lambda env: 1024.0)
    cfg = load_config(
        None,
        {"model.size": "1b", "train.batch_size": 1, "train.grad_accum": 4, "train.block_size": 1024},
    )
    env = Environment(device=torch.device("cuda"), dist=DistInfo(), hw=_hw(8), precision="bf16")
    model = SimpleNamespace(
        args=model_args("llama", "1b", {}), family=SimpleNamespace(name="llama"), pretrained=None
    )
    cfg2, env2 = build.choose_memory_layout(cfg, env, model, dry_run=True)
    assert env2.dist.cpu_offload and env2.dist.strategy == "fsdp"
    assert env2.dist.sync_every_microbatch
    assert "every micro-batch" in cfg2.resolved["grad_sync"]
    # asked: kept as asked
    asked = replace(cfg, parallel=replace(cfg.parallel, grad_sync_every_microbatch=False))
    _, env3 = build.choose_memory_layout(asked, env, model, dry_run=True)
    assert env3.dist.cpu_offload and not env3.dist.sync_every_microbatch


@pytest.mark.parametrize(
    ("dist", "warned"),
    [
        (DistInfo(), True),
        (DistInfo(world_size=2, strategy="ddp"), True),
        (DistInfo(world_size=2, strategy="fsdp"), False),
        (DistInfo(cpu_offload=True, strategy="fsdp"), False),
    ],
)
def test_fsdp_settings_asked_of_a_run_without_fsdp_are_named_in_the_plan(dist, warned):
    """grad_sync_every_microbatch (and reshard_after_forward) set to true or false on one process or under DDP did
    nothing, silently: the plan now says so."""
    from gptoughts.training.plan import unused_fsdp_switches

    cfg = load_config(None, {"parallel.grad_sync_every_microbatch": True, "train.grad_accum": 2})
    lines = unused_fsdp_switches(cfg, dist)
    assert bool(lines) == warned
    if warned:
        assert "parallel.grad_sync_every_microbatch" in lines[0] and "drop it" in lines[0]
    assert unused_fsdp_switches(load_config(None, {}), dist) == []  # auto says nothing


def test_under_a_pipeline_the_plan_says_the_schedule_reduces_after_the_last_micro_batch():
    """torch's pipeline stages hold FSDP2's gradient sync off until their last micro-batch whatever the trainer
    asks: the rule said 'every micro-batch' for a large model under pp (it divided the gradient by pp), a plan line
    that described no run."""
    from gptoughts.training.resolve import grad_sync_rule

    pp2 = DistInfo(world_size=8, strategy="fsdp", pp=2)
    big = load_config(None, {"model.size": "8b", "parallel.strategy": "fsdp"})
    sync, why = grad_sync_rule(big, pp2, _hw(79.2))
    assert not sync and "pipeline" in why
    asked = load_config(None, {"model.size": "1b", "parallel.grad_sync_every_microbatch": True})
    sync, why = grad_sync_rule(asked, pp2, _hw(79.2))
    assert not sync and "asked true" in why
    assert grad_sync_rule(big, replace(pp2, pp=1), _hw(79.2))[0]  # without the pipeline: every micro-batch


def test_a_frozen_fp8_weight_costs_no_weight_gradient_matmul():
    """LoRA freezes the fp8 base linears: their backward computed the weight gradient anyway (a third of the
    linear's FLOPs, then discarded). The input gradient is the same either way."""
    from torch.utils.flop_counter import FlopCounterMode

    from gptoughts.perf.fp8_fused import fp8_linear, quantize_rowwise

    torch.manual_seed(0)
    x = torch.randn(32, 64)
    flops, dx = {}, {}
    for frozen in (False, True):
        torch.manual_seed(0)
        w = torch.randn(48, 64).requires_grad_(not frozen)
        xx = x.clone().requires_grad_()
        y = fp8_linear(*quantize_rowwise(xx), xx, w, scaled_mm=False)
        with FlopCounterMode(display=False) as count:
            y.float().square().sum().backward()
        flops[frozen], dx[frozen] = count.get_total_flops(), xx.grad
        assert (w.grad is None) == frozen
    assert flops[True] == flops[False] // 2  # the input gradient's matmul only
    assert torch.equal(dx[True], dx[False])


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_fused_fp8_blocks_recompute_exactly_under_activation_checkpointing(mode):
    """Selective checkpointing saves ``_scaled_mm`` and ``mm`` outputs and replays the rest of the fp8 autograd
    function's forward: loss and gradients equal the run without checkpointing, bit for bit."""
    import copy

    import torch.nn.functional as F

    from gptoughts.perf.checkpointing import apply_activation_checkpointing

    base = _llama()
    convert_to_fused_fp8(base)
    x = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(1))
    runs = []
    for ac in ("none", mode):
        model = copy.deepcopy(base)
        apply_activation_checkpointing(model, ac)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        runs.append((loss.detach(), [p.grad for p in model.parameters()]))
    (loss_a, grads_a), (loss_b, grads_b) = runs
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))
