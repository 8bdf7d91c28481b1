"""FlashAttention-4 and FlexAttention on a GPU against SDPA's math kernel in fp32: forward and q/k/v gradients
in bf16, eager and compiled. Skipped without CUDA (and FA4's tests without flash_attn.cute on sm90+)."""

from __future__ import annotations

import pytest
import torch

from gptoughts.models.layers import AttentionKernels, attention_mask, sdpa, use_attention_kernels
from gptoughts.perf import attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# bf16 attention against an fp32 reference: errors of a few bf16 ulps of the outputs' scale
ATOL, RTOL = 2e-2, 2e-2


def _qkv(b, h, kv, t, hd, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [
        torch.randn(b, n, t, hd, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
        for n in (h, kv, kv)
    ]


def _reference(q, k, v, mask):
    """fp32 math-kernel SDPA with an explicit boolean mask (k/v heads repeated): output and q/k/v grads."""
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    n_rep = q.size(1) // k.size(1)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]):
        out = torch.nn.functional.scaled_dot_product_attention(
            q32, k32.repeat_interleave(n_rep, 1), v32.repeat_interleave(n_rep, 1), attn_mask=mask
        )
    grads = torch.autograd.grad(out.square().sum(), (q32, k32, v32))
    return out, grads


def _check(got, q, k, v, ref):
    grads = torch.autograd.grad(got.float().square().sum(), (q, k, v))
    torch.testing.assert_close(got.float(), ref[0], atol=ATOL, rtol=RTOL)
    for g, r in zip(grads, ref[1], strict=True):
        # gradients sum over the sequence: compare relative to their own scale
        torch.testing.assert_close(g.float() / r.abs().max(), r / r.abs().max(), atol=ATOL, rtol=RTOL)


def _docs(b, t, n_docs=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    cuts = torch.stack([torch.randperm(t - 1, generator=g)[: n_docs - 1] + 1 for _ in range(b)])
    starts = torch.zeros(b, t, dtype=torch.long).scatter_(1, cuts, 1)
    return torch.cumsum(starts, 1).cuda()


fa4_missing = attention.fa4_unavailable(torch.device("cuda")) if torch.cuda.is_available() else "no GPU"
needs_fa4 = pytest.mark.skipif(fa4_missing is not None, reason=str(fa4_missing))
CASES = [
    # (B, H, KV, T, hd, causal, window)
    (2, 8, 2, 512, 64, True, None),  # 1b-like: GQA, head_dim 64
    (2, 8, 8, 384, 128, True, None),  # 3b/8b head_dim, T not a multiple of the tiles
    (2, 8, 2, 512, 64, False, None),  # bidirectional (LLaDA)
    (2, 8, 2, 512, 64, True, 100),  # sliding window
    (1, 4, 4, 256, 64, False, 64),  # bidirectional window
]


@needs_fa4
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize(("b", "h", "kv", "t", "hd", "causal", "window"), CASES)
def test_fa4_matches_math_sdpa(b, h, kv, t, hd, causal, window, compiled):
    q, k, v = _qkv(b, h, kv, t, hd)
    ref = _reference(q, k, v, attention_mask(t, t, causal=causal, window=window, device="cuda"))
    fa4 = attention.FA4()
    assert fa4.accepts(q, k, v)

    def fn(q, k, v):
        return sdpa(q, k, v, causal=causal, window=window)

    if compiled:
        fn = torch.compile(fn, fullgraph=True)
    with use_attention_kernels(AttentionKernels(fa4=fa4)):
        got = fn(q, k, v)
    _check(got, q, k, v, ref)


@pytest.mark.parametrize("compiled_block", [False, True])
@pytest.mark.parametrize(
    ("h", "kv", "hd", "causal", "window"),
    [(8, 2, 64, True, None), (8, 8, 128, True, None), (8, 2, 64, False, None), (8, 2, 64, True, 96)],
)
def test_flex_doc_mask_matches_math_sdpa(h, kv, hd, causal, window, compiled_block):
    """Packed rows through flex (compiled flex, the block mask built eagerly once; or the whole call compiled
    as inside a compiled block, the mask built in the graph) against the dense mask on the math kernel."""
    b, t = 2, 640
    q, k, v = _qkv(b, h, kv, t, hd)
    doc = _docs(b, t)
    ref = _reference(q, k, v, attention_mask(t, t, causal=causal, window=window, doc_ids=doc, device="cuda"))

    def fn(q, k, v, doc):
        return sdpa(q, k, v, causal=causal, window=window, doc_ids=doc)

    if compiled_block:
        fn = torch.compile(fn)
    with use_attention_kernels(AttentionKernels(doc=attention.FlexDocAttention())):
        got = fn(q, k, v, doc)
    _check(got, q, k, v, ref)


def test_train_setup_routes_packed_rows_to_flex_when_asked_and_auto_to_fa4_where_installed():
    from gptoughts.config import PerfConfig
    from gptoughts.training.resolve import attention_rule
    from gptoughts.training.setup import attention_kernels

    cuda = torch.device("cuda")
    chosen, _ = attention_rule(PerfConfig(doc_mask_attention="flex"), cuda)
    kernels = attention_kernels(chosen, cuda)
    assert chosen["doc_mask_attention"] == "flex" and isinstance(kernels.doc, attention.FlexDocAttention)
    chosen, why = attention_rule(PerfConfig(), cuda)
    kernels = attention_kernels(chosen, cuda)
    fa4 = attention.fa4_unavailable(cuda) is None
    assert chosen == {"sdpa_backend": "fa4" if fa4 else "auto", "doc_mask_attention": "sdpa"}, why
    assert (kernels.fa4 is not None) == fa4 and kernels.doc is None
