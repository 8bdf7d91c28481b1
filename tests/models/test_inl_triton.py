"""INL's integrator as Triton kernels (``model.integrator_impl = "triton"``, models/inl_triton.py) against the
reference module: outputs and every gradient, on a GPU under bf16 autocast and compiled, and in fp32 through
Triton's CPU interpreter where Triton is installed; without Triton the switch runs the fused Function."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from test_inl_fused import _integrators

from gptoughts import models
from gptoughts.models import inl_triton
from gptoughts.models.inl import Integrator

NAMES = ["output", "h", "w_in", "b_in", "w_out", "b_out", "mu", "kappa_raw"]


def _pair(
    k: int, d: int, hidden: int, impl: str = "triton", device: str = "cpu"
) -> tuple[Integrator, Integrator]:
    """(reference, ``impl``) with the same perturbed weights (test_inl_fused's), on ``device``."""
    ref, other = _integrators(k, d, hidden, impl)
    return ref.to(device), other.to(device)


def _run(module: torch.nn.Module, h: torch.Tensor, bf16: bool) -> list[torch.Tensor]:
    """[output, dL/dh, dL/dparam...] for a loss weighting every output element differently."""
    h = h.detach().clone().requires_grad_()
    module.zero_grad()
    with torch.autocast(h.device.type, dtype=torch.bfloat16, enabled=bf16):
        y = module(h)
    weights = torch.linspace(-1, 1, y.numel(), device=h.device).view_as(y)
    (y * weights).sum().backward()
    return [y.detach(), h.grad, *(p.grad for p in module.parameters())]


def test_without_the_kernels_the_switch_runs_the_fused_function(monkeypatch):
    import gptoughts.models.inl as inl

    calls = []
    fused = inl.integrate
    monkeypatch.setattr(inl, "integrate", lambda *a: calls.append(1) or fused(*a))
    monkeypatch.setattr(inl_triton, "supported", lambda *a: False)
    ref, other = _pair(3, 24, 16)
    h = torch.randn(2, 5, 24, generator=torch.Generator().manual_seed(1))
    for name, a, b in zip(NAMES, _run(ref, h, False), _run(other, h, False), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5 * a.abs().max().item(), msg=name)
    assert calls == [1]


def test_the_kernels_run_only_where_they_can():
    h = torch.zeros(2, 8)
    assert not inl_triton.supported(h, 12, torch.bfloat16)  # the controller's width is not a power of two
    assert not inl_triton.supported(h, 8, torch.bfloat16)  # narrower than a tensor-core tile
    if not torch.cuda.is_available():
        assert inl_triton.supported(h, 64, torch.bfloat16) == (
            inl_triton.available() and os.environ.get("TRITON_INTERPRET") == "1"
        )


def test_a_run_records_the_fused_function_where_the_kernels_cannot_run(text_corpus, cache_dir):
    # The 3b size asks for the kernels; on this CPU the assembly records what runs, so the plan's memory estimate
    # counts the fused Function's saved tensors, not the kernels'.
    import gptoughts

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert not inl_triton.will_run(64, cpu, "bf16") and not inl_triton.will_run(64, gpu, "fp32")
    assert inl_triton.will_run(64, gpu, "bf16") == inl_triton.available()
    assert not inl_triton.will_run(48, gpu, "bf16")
    assert models.model_args("inl", "3b").integrator_impl == "triton"
    model, _, hist = gptoughts.train(
        data_path=str(text_corpus), model="inl", size="3b", dry_run=True, **{"perf.device": "cpu"}
    )
    assert model.args.integrator_impl == "fused"
    line = hist.plan["resolved"]["integrator"]  # the plan says so, and why
    assert line.startswith("fused") and "instead of triton, the 3b size's default" in line and "CUDA" in line


_INTERPRETED = textwrap.dedent(
    """
    import json, sys, torch
    sys.path.insert(0, {tests!r})
    from test_inl_triton import NAMES, _pair, _run
    from gptoughts.models import inl_triton
    for t in inl_triton.TILES.values():  # 2 token tiles, 2 feature blocks (one part-filled)
        t.update(BM=16, BD=16, BDB=32)
    out = {{}}
    for k in (1, 2, 4):
        ref, tri = _pair(k, 40, 16)  # 40 features: a part chunk; 21 tokens: a part tile
        h = torch.randn(3, 7, 40, generator=torch.Generator().manual_seed(k))
        assert inl_triton.supported(h, 16, torch.float32)
        errs = [((b - a).abs().max() / a.abs().max()).item()
                for a, b in zip(_run(ref, h, False), _run(tri, h, False), strict=True)]
        out[k] = dict(zip(NAMES, errs, strict=True))
        torch._dynamo.reset()
        compiled = torch.compile(tri, backend="aot_eager", fullgraph=True)
        errs = [((b - a).abs().max() / a.abs().max()).item()
                for a, b in zip(_run(ref, h, False), _run(compiled, h, False), strict=True)]
        out[f"{{k}} compiled"] = dict(zip(NAMES, errs, strict=True))
    print(json.dumps(out))
    """
)


@pytest.mark.skipif(not inl_triton.available(), reason="needs Triton (its CPU interpreter runs the kernels)")
def test_interpreted_kernels_equal_the_reference_in_fp32():
    # TRITON_INTERPRET must be set before the kernels are defined: a fresh process.
    tests = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    script = _INTERPRETED.format(tests=tests)
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    errors = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(errors) == {"1", "2", "4", "1 compiled", "2 compiled", "4 compiled"}
    for k, per_name in errors.items():
        assert set(per_name) == set(NAMES)
        for name, err in per_name.items():
            assert err < 1e-5, (k, name, err)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("tiles", [None, {"BM": 16, "BD": 16, "BDB": 64, "num_warps": 4, "num_stages": 2}])
@pytest.mark.gpu
@needs_cuda
def test_gpu_kernels_under_bf16_are_as_close_to_fp32_as_the_reference(k, tiles, monkeypatch):
    # The reference rounds c, gelu(c) and the controller's outputs to bf16, the kernels keep them in fp32: each is
    # compared with the fp32 function, and the kernels must be as close as the reference (within 1.5x, plus a
    # floor of bf16's resolution). Errors are relative RMS: with K = 4 and these perturbed weights the largest
    # element's error swings several-fold with rounding order alone.
    if tiles:  # 4 feature blocks of 64, the last part-filled
        monkeypatch.setattr(inl_triton, "TILES", {"forward": tiles, "backward": tiles})
    ref, tri = _pair(k, 200, 64, device="cuda")  # 200 features: a part chunk; 111 tokens: a part tile
    h = torch.randn(3, 37, 200, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    assert inl_triton.supported(h, 64, torch.bfloat16)
    truth = _run(ref, h, False)
    for name, t, a, b in zip(NAMES, truth, _run(ref, h, True), _run(tri, h, True), strict=True):
        assert b.dtype == a.dtype, name
        err_ref, err_tri = ((x.float() - t).norm().item() / t.norm().item() for x in (a, b))
        assert err_tri <= 1.5 * err_ref + 2e-3, (name, err_tri, err_ref)


@pytest.mark.gpu
@needs_cuda
def test_gpu_compiled_block_with_checkpointing_equals_the_compiled_reference():
    from gptoughts.perf.checkpointing import apply_activation_checkpointing

    ids = torch.randint(0, 512, (2, 100), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    results = []
    for impl in ("reference", "triton"):
        torch.manual_seed(0)
        args = models.model_args("inl", "debug", {"integrator_impl": impl, "n_layers": 2})
        model = models.build_model("inl", args, device="cuda")
        model.init_weights()
        with torch.no_grad():
            g = torch.Generator("cuda").manual_seed(3)
            for name, p in model.named_parameters():
                if ".integrator." in name:
                    p.add_(0.1 * torch.randn(p.shape, device="cuda", generator=g))
        apply_activation_checkpointing(model, "selective")
        for block in model.layers:
            block.compile(fullgraph=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(ids)
        out.float().square().mean().backward()
        results.append([out.detach().float(), *(p.grad.float() for p in model.parameters())])
    for a, b in zip(*results, strict=True):
        assert (a - b).abs().max() <= 2e-2 * a.abs().max()


def test_a_config_built_in_code_plans_the_integrator_line(tmp_path, text_corpus, cache_dir):
    # the plan asked Config.is_given about a family field, which a Config built in code cannot answer
    import gptoughts
    from gptoughts.config import Config

    cfg = Config()
    cfg.model.family, cfg.model.size, cfg.perf.device = "inl", "3b", "cpu"
    cfg.data.sources, cfg.run.out = [str(text_corpus)], str(tmp_path / "r")
    _, _, hist = gptoughts.train(cfg, dry_run=True)
    assert "the 3b size's default" in hist.plan["resolved"]["integrator"]
