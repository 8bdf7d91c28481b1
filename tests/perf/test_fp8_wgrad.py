"""perf.fp8_wgrad = fp8 (with perf.fp8_recipe = fused_rowwise): the weight gradient's matmul in fp8 too, its
operands quantized per channel over the tokens; close to the fp32 gradient, in the layouts the CUDA kernel takes,
and a model still trains like bf16."""

from __future__ import annotations

import pytest
import torch
from test_fp8_fused import _llama, _losses, cos

from gptoughts.config import load_config
from gptoughts.errors import ConfigError
from gptoughts.perf.fp8_fused import convert_to_fused_fp8, fp8_linear, quantize_rowwise


def _grads(wgrad_fp8: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    x = (torch.randn(64, 128) * 2).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(96, 128) * 0.05).requires_grad_()
    y = fp8_linear(*quantize_rowwise(x), x, w, scaled_mm=False, wgrad_fp8=wgrad_fp8)
    dy = torch.randn(64, 96, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    y.backward(dy)
    ref = dy.float().t() @ x.detach().float()
    return w.grad, x.grad, ref


def test_the_fp8_weight_gradient_is_close_to_fp32_and_differs_from_bf16():
    w8, x8, ref = _grads(True)
    w16, x16, _ = _grads(False)
    assert w8.dtype == torch.float32 and w8.shape == ref.shape
    assert cos(w8, ref) > 0.99 and cos(w16, ref) > 0.999
    assert not torch.equal(w8, w16)  # the fp8 path ran (bf16 operands give another rounding)
    assert torch.equal(x8, x16)  # the input gradient is the same either way


def test_the_weight_gradient_gets_the_layouts_the_cuda_kernel_demands(monkeypatch):
    calls = []

    def checked(a, b, *, scale_a, scale_b, out_dtype, use_fast_accum):
        calls.append((tuple(a.shape), tuple(b.shape)))
        assert a.is_contiguous() and b.t().is_contiguous(), (a.stride(), b.stride())
        assert scale_a.shape == (a.shape[0], 1) and scale_b.shape == (1, b.shape[1])
        return (a.float() * scale_a) @ (b.float() * scale_b)

    monkeypatch.setattr(torch, "_scaled_mm", checked)
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(48, 64, requires_grad=True)
    y = fp8_linear(*quantize_rowwise(x), x, w, scaled_mm=True, wgrad_fp8=True)
    y.backward(torch.randn(48, 32, dtype=torch.bfloat16).t())  # a strided output gradient
    # forward [32, 64] x [64, 48]; input gradient [32, 48] x [48, 64]; weight gradient [48, 32] x [32, 64]
    assert calls == [((32, 64), (64, 48)), ((32, 48), (48, 64)), ((48, 32), (32, 64))]


def test_a_model_with_fp8_weight_gradients_trains_like_bf16():
    ref = _losses(_llama(), 12)
    bf16_wgrad, fp8_wgrad = _llama(), _llama()
    convert_to_fused_fp8(bf16_wgrad)
    convert_to_fused_fp8(fp8_wgrad, wgrad_fp8=True)
    bf16_wgrad, fp8_wgrad = _losses(bf16_wgrad, 12), _losses(fp8_wgrad, 12)
    assert fp8_wgrad != bf16_wgrad  # the weight gradients did run in fp8
    assert fp8_wgrad[-1] < fp8_wgrad[0] - 2.0
    for a, b in zip(fp8_wgrad, ref):
        assert abs(a - b) / b < 0.01, (fp8_wgrad, ref)


def test_fp8_wgrad_belongs_to_the_fused_recipe():
    base = {"perf.fp8": "true", "perf.fp8_recipe": "fused_rowwise", "perf.fp8_wgrad": "fp8"}
    assert load_config("quickstart", base).perf.fp8_wgrad == "fp8"
    with pytest.raises(ConfigError, match="fp8_wgrad = fp8 is a setting of perf.fp8_recipe = fused_rowwise"):
        load_config("quickstart", {**base, "perf.fp8_recipe": "tensorwise"})
    with pytest.raises(ConfigError, match="fp8_wgrad must be one of bf16, fp8"):
        load_config("quickstart", {**base, "perf.fp8_wgrad": "fp4"})


def test_the_plan_says_so_and_warns_when_fp8_is_off():
    from gptoughts.training.plan import RunPlan, _unused_fp8_switches

    corpus = {"files": 3, "bytes": 123_456, "bytes_read": 123_456, "tokens": 120_000}
    batch = {"micro_batch": 2, "grad_accum": 1, "world_size": 1, "block_size": 64, "tokens_per_step": 128,
             "total_steps": 100, "epochs": 0.5, "stop_rule": "max_steps", "warmup_steps": 10, "eval_interval": 0,
             "save_interval": 0}  # fmt: skip
    plan = RunPlan(model="llama/debug", params=1, params_non_embedding=1, trainable_params=1, vocab_size=256,
                   block_size=64, corpus=corpus, batch=batch, memory_gib=None, device_memory_gib=None,
                   tokens_per_s=None, speed_basis="", hours=None, out="/tmp/x", resume=None, warnings=[],
                   resolved={"fp8": "fused_rowwise (asked)", "fp8_linears": 12, "fp8_wgrad": "fp8"})  # fmt: skip
    assert "  fp8: fused_rowwise (asked), 12 linear layers; weight gradients in fp8 too" in plan.format()
    cfg = load_config("quickstart", {"perf.fp8_recipe": "fused_rowwise", "perf.fp8_wgrad": "fp8"})
    (warning,) = _unused_fp8_switches(cfg, {"fp8": "False (asked)"})
    assert "perf.fp8_wgrad" in warning
