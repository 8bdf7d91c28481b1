"""The LM head's weight gradient accumulated by the matmul (``perf.ce.accumulate_weight_grad``) instead of a
product, a cast and an add per chunk: the chunked loss's path that uses it gives the plain loss's gradients."""

import pytest
import torch

from gptoughts.perf import ce


def _reference_grads(h, w, t):
    out = ce.plain_linear_ce(h, w, t)
    gh, gw = torch.autograd.grad(out, (h, w))
    return out.detach(), gh, gw


def test_chunked_ce_with_the_weight_gradient_accumulated_outside_the_chunk(monkeypatch):
    """CPU: the op is CUDA's, so it is stood in for by its definition; what is checked is the chunk function's
    ``logit_grad`` path (d loss / d logits handed back) and the loop that accumulates from it."""
    calls = []

    def accumulate(grad_w, g, h):
        calls.append(g.shape)
        grad_w += g.float().t() @ h.float()

    monkeypatch.setattr(ce, "wgrad_in_gemm", lambda grad_w, h: True)
    monkeypatch.setattr(ce, "accumulate_weight_grad", accumulate)
    torch.manual_seed(0)
    h = torch.randn(100, 16, requires_grad=True)
    w = torch.randn(97, 16, requires_grad=True)
    t = torch.randint(0, 97, (100,))
    t[:7] = -100
    ref, gh, gw = _reference_grads(h, w, t)
    out = ce.chunked_linear_ce(h, w, t, chunk_size=32)
    h_grad, w_grad = torch.autograd.grad(out * 3, (h, w))
    assert calls == [(32, 97), (32, 97), (32, 97), (4, 97)]  # one accumulation per chunk, from its logit grad
    assert out.item() == pytest.approx(ref.item(), rel=1e-5)
    assert torch.allclose(h_grad / 3, gh, atol=1e-5)
    assert torch.allclose(w_grad / 3, gw, atol=1e-5)


def test_the_weight_gradient_stays_in_the_chunk_on_cpu():
    assert not ce.wgrad_in_gemm(torch.zeros(3, 2), torch.zeros(4, 2, dtype=torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("compiled", [False, True])
def test_in_gemm_accumulation_on_the_gpu_matches_the_fp32_reference(compiled, monkeypatch):
    torch.manual_seed(0)
    dev = torch.device("cuda")
    h = torch.randn(3000, 256, device=dev, requires_grad=True)
    w = (torch.randn(4099, 256, device=dev) * 0.05).requires_grad_()
    t = torch.randint(0, 4099, (3000,), device=dev)
    ref, gh, gw = _reference_grads(h.double(), w.double(), t)
    assert ce.wgrad_in_gemm(
        torch.zeros(2, 2, device=dev), torch.zeros(2, 2, device=dev, dtype=torch.bfloat16)
    )
    calls, real = [], ce.accumulate_weight_grad

    def counted(grad_w, g, h_c):
        calls.append(tuple(g.shape))
        real(grad_w, g, h_c)

    monkeypatch.setattr(ce, "accumulate_weight_grad", counted)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = ce.chunked_linear_ce(h, w, t, chunk_size=1024, compiled=compiled)
    assert calls == [(1024, 4099), (1024, 4099), (952, 4099)]  # the path ran, once per chunk
    h_grad, w_grad = torch.autograd.grad(out, (h, w))

    def rel(a, b):
        return ((a.double() - b).norm() / b.norm()).item()

    assert rel(out, ref) < 1e-2 and rel(h_grad, gh) < 2e-2
    # bf16 operands, fp32 accumulation across the chunks: within bf16's rounding of the inputs
    assert rel(w_grad, gw) < 2e-2
