"""perf.fp8_recipe = fused_rowwise: row quantization, the fp8 linear's autograd function, the fused producers and
the module swap, against bf16/fp32 references on CPU (fp8 rounding tolerances: outputs within ~5%, gradients at
cosine > 0.99)."""

from __future__ import annotations

import copy
import json
import runpy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from cli_helpers import FASTRUN, run_cli

from gptoughts.config import load_config
from gptoughts.errors import ConfigError, UserError
from gptoughts.models import build_model, model_args
from gptoughts.models.layers import SwiGLU
from gptoughts.perf import fp8_fused
from gptoughts.perf.fp8_fused import (
    E4M3,
    FusedFp8Linear,
    FusedFp8SwiGLU,
    convert_to_fused_fp8,
    dequantize,
    fp8_linear,
    quantize_rowwise,
    rms_norm_fp8,
    swiglu_fp8,
)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.flatten().float(), b.flatten().float(), dim=0).item()


def _scaled_mm_runs_on_cpu() -> bool:
    try:
        a = torch.zeros(16, 16, dtype=E4M3)
        torch._scaled_mm(
            a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16
        )
    except (RuntimeError, NotImplementedError):
        return False
    return True


def test_rowwise_quantization_scales_each_row_alone():
    torch.manual_seed(0)
    x = torch.randn(32, 256)
    x[3] *= 1e5  # an outlier row
    x[5] = 0.0
    q, s = quantize_rowwise(x)
    assert q.dtype == E4M3 and s.shape == (32, 1) and s.dtype == torch.float32
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)  # powers of two: dividing by them is exact
    assert (q.float().abs().amax(-1) <= torch.finfo(E4M3).max).all()
    back = dequantize(q, s)
    assert torch.equal(back[5], torch.zeros(256)) and torch.isfinite(back).all()
    for row in (
        0,
        3,
        7,
    ):  # e4m3's 3 mantissa bits: ~2.5% rms error, the outlier's row no worse than the others
        assert rel(back[row], x[row]) < 0.04
    # One scale for the whole tensor would push the ordinary rows into fp8's subnormals, or flush them to 0.
    q_t = (x / (x.abs().max() / 448)).to(E4M3).float() * (x.abs().max() / 448)
    assert rel(q_t[0], x[0]) > 5 * rel(back[0], x[0])


@pytest.mark.skipif(not _scaled_mm_runs_on_cpu(), reason="this torch has no CPU torch._scaled_mm")
def test_scaled_mm_operands_match_the_fp32_reference():
    """The exact torch._scaled_mm call the GPU makes (layouts, scale shapes) against the dequantized fp32 matmul."""
    torch.manual_seed(0)
    x = torch.randn(48, 64, dtype=torch.bfloat16)
    w = (torch.randn(32, 64) * 0.1).requires_grad_()
    dy = torch.randn(48, 32, dtype=torch.bfloat16)
    outs = []
    for use in (True, False):
        xx = x.clone().requires_grad_()
        w.grad = None
        y = fp8_linear(*quantize_rowwise(xx), xx, w, scaled_mm=use)
        y.backward(dy)
        outs.append((y, xx.grad, w.grad.clone()))
    for got, want in zip(outs[0], outs[1]):
        assert torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2)


def test_scaled_mm_gets_the_layouts_the_cuda_kernel_demands(monkeypatch):
    """cuBLAS/CUTLASS refuse a row-major second operand or misshapen scales; the CPU kernel accepts anything, so the
    calls (forward, and the backward's transposed weight and strided dy) are checked here."""
    calls = []

    def checked(a, b, *, scale_a, scale_b, out_dtype, use_fast_accum):
        calls.append(use_fast_accum)
        assert a.is_contiguous() and b.t().is_contiguous(), (a.stride(), b.stride())
        assert scale_a.shape == (a.shape[0], 1) and scale_b.shape == (1, b.shape[1])
        assert scale_a.dtype == scale_b.dtype == torch.float32 and out_dtype == torch.bfloat16
        return (a.float() * scale_a) @ (b.float() * scale_b)

    monkeypatch.setattr(torch, "_scaled_mm", checked)
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(48, 64, requires_grad=True)
    y = fp8_linear(*quantize_rowwise(x), x, w, scaled_mm=True, fast_accum_bwd=False)
    y.backward(torch.randn(48, 32, dtype=torch.bfloat16).t())  # a strided output gradient
    assert calls == [True, False]  # fast accumulation in the forward only, unless asked


def test_fp8_linear_is_close_to_the_fp32_linear():
    torch.manual_seed(0)
    x = (torch.randn(4, 16, 128) * 2).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(96, 128) * 0.05).requires_grad_()
    b = torch.randn(96).requires_grad_()
    y = fp8_linear(*quantize_rowwise(x), x, w, b)
    assert y.shape == (4, 16, 96) and y.dtype == torch.bfloat16
    dy = torch.randn_like(y)
    y.backward(dy)
    xr, wr, br = (t.detach().float().requires_grad_() for t in (x, w, b))
    yr = F.linear(xr, wr, br)
    yr.backward(dy.float())
    assert rel(y, yr) < 0.05
    assert cos(x.grad, xr.grad) > 0.99 and x.grad.dtype == torch.bfloat16
    assert (
        cos(w.grad, wr.grad) > 0.999 and w.grad.dtype == torch.float32
    )  # the weight gradient is bf16, not fp8
    assert cos(b.grad, br.grad) > 0.999


def test_producers_return_their_exact_output_and_its_fp8_rows():
    torch.manual_seed(0)
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    w = torch.rand(64) + 0.5
    y, q, s = rms_norm_fp8(x, w, 1e-5)
    assert torch.equal(y, F.rms_norm(x, (64,), w, 1e-5))
    assert rel(dequantize(q, s), y) < 0.04
    a, b = torch.randn(8, 64), torch.randn(8, 64)
    h, q, s = swiglu_fp8(a, b)
    assert torch.equal(h, F.silu(a) * b) and rel(dequantize(q, s), h) < 0.04


def test_fused_swiglu_matches_the_bf16_mlp_forward_and_gradients():
    torch.manual_seed(0)
    ref = SwiGLU(64, 128)
    fused = copy.deepcopy(ref)
    assert fp8_fused.swap_linears(fused) == 3 and type(fused) is FusedFp8SwiGLU
    x = torch.randn(2, 16, 64)
    grads = []
    for mlp in (ref, fused):
        xx = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = mlp(xx)
        y.float().square().mean().backward()
        grads.append((y, xx.grad, *(p.grad for p in mlp.parameters())))
    # Two fp8 matmuls in a row (~3.7% each, both operands rounded): ~6.5% here, an SQNR of ~24 dB.
    assert 0 < rel(grads[1][0], grads[0][0]) < 0.08
    for got, want in zip(grads[1][1:], grads[0][1:]):
        assert cos(got, want) > 0.99


def _llama(n_layers: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model("llama", model_args("llama", "debug", {"n_layers": n_layers}), device="cpu")


def test_conversion_swaps_the_block_linears_and_keeps_the_state_dict():
    model = _llama(4)
    keys = {k: v.clone() for k, v in model.state_dict().items()}
    assert convert_to_fused_fp8(model) == 4 * 7  # q, k, v, o, gate, up, down per block
    assert isinstance(model.layers[0].feed_forward, FusedFp8SwiGLU)
    assert isinstance(model.layers[0].attention.wq, FusedFp8Linear)
    assert type(model.output) is torch.nn.Linear  # the LM head stays bf16
    after = model.state_dict()
    assert after.keys() == keys.keys() and all(torch.equal(after[k], keys[k]) for k in keys)
    assert convert_to_fused_fp8(_llama(4), bf16_end_layers=1) == 2 * 7


def test_conversion_refuses_other_families():
    torch.manual_seed(0)
    gpt2 = build_model("gpt2", model_args("gpt2", "debug", {}), device="cpu")
    with pytest.raises(UserError, match="fused_rowwise supports the llama family"):
        convert_to_fused_fp8(gpt2)


def _losses(model: torch.nn.Module, steps: int) -> list[float]:
    """Losses of ``steps`` AdamW steps on one fixed batch (memorised fast: a clear downward trajectory)."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batch = torch.randint(0, 512, (4, 33), generator=torch.Generator().manual_seed(1))
    out = []
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def test_a_converted_model_trains_like_bf16():
    ref = _losses(_llama(), 12)
    fused_model = _llama()
    convert_to_fused_fp8(fused_model)
    fused = _losses(fused_model, 12)
    assert fused != ref  # the matmuls did run in fp8
    assert fused[-1] < fused[0] - 2.0 and ref[-1] < ref[0] - 2.0
    for a, b in zip(fused, ref):  # measured: within 0.2% at each step
        assert abs(a - b) / b < 0.01, (fused, ref)


@pytest.mark.slow
def test_compiled_block_traces_whole_and_matches_eager():
    """One graph per block (no break at the autograd function), so inductor can fuse the norm with the cast."""
    model = _llama()
    convert_to_fused_fp8(model)
    block = model.layers[0]
    x = torch.randn(2, 16, 64)
    cos_, sin_ = model.rope(16)
    compiled = torch.compile(block, fullgraph=True)
    outs = []
    for fn in (block, compiled):
        xx = x.clone().requires_grad_()
        block.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = fn(xx, cos_, sin_)
        y.float().square().mean().backward()
        outs.append((y, xx.grad, block.feed_forward.w1.weight.grad))
    for got, want in zip(outs[1], outs[0]):
        assert cos(got, want) > 0.999


def test_rms_norm_fp8_compiles_to_one_kernel():
    """The norm's reduction, the row amax and the fp8 cast in one generated kernel (CPU inductor here; Triton on
    GPU makes the same fusion decision from the same graph)."""
    from torch._inductor.utils import run_and_get_code

    x = torch.randn(64, 256, dtype=torch.bfloat16)
    w = torch.ones(256, dtype=torch.bfloat16)
    out, codes = run_and_get_code(torch.compile(lambda x, w: rms_norm_fp8(x, w, 1e-5)), x, w)
    kernels = [line for line in codes[0].splitlines() if "async_compile.cpp_pybinding" in line]
    assert len(kernels) == 1 and "amax" in kernels[0] and "rsqrt" in kernels[0], kernels
    want = rms_norm_fp8(x, w, 1e-5)
    assert torch.equal(out[1].float(), want[1].float()) and torch.equal(out[2], want[2])


def test_config_refuses_what_fused_rowwise_does_not_cover():
    base = {"perf.fp8": "true", "perf.fp8_recipe": "fused_rowwise"}
    assert load_config("quickstart", base).perf.fp8_recipe == "fused_rowwise"
    with pytest.raises(ConfigError, match="llama family only, not gpt2"):
        load_config("quickstart", {**base, "model.family": "gpt2"})
    with pytest.raises(ConfigError, match="parallel.tp"):
        load_config("quickstart", {**base, "parallel.tp": 2})
    with pytest.raises(ConfigError, match="fp8_all_gather needs perf.fp8_recipe = tensorwise"):
        load_config("quickstart", {**base, "perf.fp8_all_gather": "true"})


def test_cli_refuses_fused_rowwise_for_another_family_in_one_line(tmp_path, cache_dir, capsys):
    out = tmp_path / "run"
    argv = ["train", "--model", "gpt2", "--size", "debug", "--fp8", "true", "--perf.fp8_recipe", "fused_rowwise",
            "--max_steps", "1", "--out", str(out), *FASTRUN]  # fmt: skip
    code, text = run_cli(argv, capsys)
    assert code != 0 and "Traceback" not in text
    assert "fused_rowwise supports the llama family only" in text
    assert not out.exists()  # refused before anything is written


def test_odd_row_counts_take_the_reference_path():
    # The fp8 tensor cores need M % 16 == 0: sampling's few rows run the fp32 reference instead, even on CUDA.
    assert not fp8_fused._use_scaled_mm(torch.zeros(3, 16), None)
    assert fp8_fused._use_scaled_mm(torch.zeros(3, 16), True)


def test_the_gpu_microbenchmark_runs_its_cpu_smoke(tmp_path, monkeypatch):
    out = tmp_path / "r.jsonl"
    script = Path(__file__).resolve().parents[2] / "bench" / "fp8_fused.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--device", "cpu", "--dry", "--out", str(out)])
    runpy.run_path(str(script), run_name="__main__")
    rows = {r["variant"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert rows["bf16"]["speedup_vs_bf16"] == 1.0
    # fp8 did run; 4-5 fp8 matmuls in a chain (wq -> wo -> gate/up -> down), ~3.7% each: ~9% measured
    assert 0 < rows["fused_rowwise"]["rel_err_vs_bf16"] < 0.15
