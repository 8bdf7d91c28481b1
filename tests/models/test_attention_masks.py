"""Document masks (packed rows) and sliding windows in the shared attention, against explicit references."""

from __future__ import annotations

import math

import torch

from gptoughts.models import build_model, model_args
from gptoughts.models.layers import attention_mask, sdpa


def _reference(q, k, v, allowed):
    n_rep = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))
    return scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v


def test_doc_ids_and_window_masks_match_reference():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 10, 8), torch.randn(2, 2, 10, 8), torch.randn(2, 2, 10, 8)
    doc = torch.tensor([[0] * 4 + [1] * 3 + [2] * 3, [0] * 10])
    i = torch.arange(10)
    causal = i[:, None] >= i[None, :]
    same = doc[:, :, None] == doc[:, None, :]
    got = sdpa(q, k, v, doc_ids=doc)
    torch.testing.assert_close(got, _reference(q, k, v, (causal & same)[:, None]), rtol=0, atol=1e-5)
    window = causal & (i[:, None] - i[None, :] < 3)
    torch.testing.assert_close(sdpa(q, k, v, window=3), _reference(q, k, v, window), rtol=0, atol=1e-5)
    both = sdpa(q, k, v, window=3, doc_ids=doc)
    torch.testing.assert_close(both, _reference(q, k, v, (window & same)[:, None]), rtol=0, atol=1e-5)
    # a window covering the whole sequence changes nothing and keeps the mask-free path
    assert torch.equal(sdpa(q, k, v, window=10), sdpa(q, k, v))
    # decode-time alignment: the last query of 10 keys sees keys 7, 8, 9 with a window of 3
    assert attention_mask(1, 10, causal=True, window=3).flatten().tolist() == [False] * 7 + [True] * 3


def test_sliding_window_kv_cache_matches_full_forward():
    torch.manual_seed(0)
    model = build_model("llama", model_args("llama", "debug", {"sliding_window": 5}), device="cpu").eval()
    ids = torch.randint(0, 512, (2, 16))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(2, 16)
        parts = [model(ids[:, :7], cache=cache)] + [
            model(ids[:, t : t + 1], cache=cache) for t in range(7, 16)
        ]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=0, atol=1e-5)


def test_full_attention_layers_keep_full_attention():
    args = model_args("llama", "debug", {"sliding_window": 4, "full_attention_layers": 1})
    model = build_model("llama", args, device="meta")
    assert [layer.attention.sliding_window for layer in model.layers] == [None, 4]
