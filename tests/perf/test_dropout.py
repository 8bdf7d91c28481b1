"""The seeded dropout (gptoughts/perf/dropout.py): Philox4x32-10, the rate, the scale, the mask as a function of the
seed; on CUDA the Triton kernel against the PyTorch reference, bit for bit."""

from __future__ import annotations

import pytest
import torch

from gptoughts.perf import dropout


def test_philox_matches_the_published_known_answer():
    # Random123's kat_vectors: philox4x32_10, counter (0, 0, 0, 0), key (0, 0)
    words = dropout._philox4x32(torch.tensor([0]), torch.tensor([0]))
    assert [int(w) for w in words] == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]


@pytest.mark.parametrize("p", [0.05, 0.5])
def test_rate_scale_and_expectation(p):
    x = torch.randn(1000, 1003)  # n is not a multiple of 8
    y = dropout.seeded_dropout(x, torch.tensor([7]), p)
    t, scale = dropout.threshold_and_scale(p)
    assert abs(t / 65536 - p) <= 1 / 131072
    dropped = (y == 0) & (x != 0)
    n = x.numel()
    assert abs(dropped.float().mean().item() - t / 65536) < 5 * (p * (1 - p) / n) ** 0.5
    kept = ~dropped
    assert torch.equal(
        y[kept], (x[kept] * scale).to(x.dtype)
    )  # kept values scaled by exactly 1 / (1 - t/65536)
    ones = dropout.seeded_dropout(torch.ones(n), torch.tensor([8]), p)
    assert abs(ones.mean().item() - 1.0) < 5 * (p / (1 - p) / n) ** 0.5  # unbiased


def test_the_mask_is_a_function_of_the_seed_and_the_shape():
    x = torch.randn(64, 33).to(torch.bfloat16)
    a = dropout.seeded_dropout(x, torch.tensor([3]), 0.3)
    assert torch.equal(a, dropout.seeded_dropout(x, torch.tensor([3]), 0.3))
    assert not torch.equal(a == 0, dropout.seeded_dropout(x, torch.tensor([4]), 0.3) == 0)
    assert a.dtype == torch.bfloat16 and a.shape == x.shape
    # the same mask on another tensor of the shape: what the LoRA backward relies on
    g = torch.randn(64, 33)
    assert torch.equal(dropout.seeded_dropout(g, torch.tensor([3]), 0.3) == 0, (a == 0) | (g == 0))
    # a rate below half a 16-bit step drops nothing
    assert torch.equal(dropout.seeded_dropout(x, torch.tensor([3]), 1e-6), x)


def test_fp64_inputs_keep_fp64_precision():
    x = torch.randn(50, dtype=torch.float64)
    y = dropout.seeded_dropout(x, torch.tensor([5]), 0.3)
    kept = y != 0
    assert y.dtype == torch.float64
    assert torch.equal(y[kept], x[kept] * dropout.threshold_and_scale(0.3)[1])


def test_seeds_come_from_torchs_generator():
    torch.manual_seed(0)
    s = dropout.new_seed(torch.device("cpu"))
    torch.manual_seed(0)
    assert torch.equal(s, dropout.new_seed(torch.device("cpu")))
    assert s.dtype == torch.int64 and 0 <= int(s) < 2**31


def test_bits_pack_the_decisions_of_eight_elements_per_byte():
    seed, p = torch.tensor([11]), 0.3
    bits = dropout.dropout_bits(seed, 21, p)
    assert bits.dtype == torch.uint8 and bits.shape == (3,)
    keep = dropout.draws(seed, 21) >= dropout.threshold_and_scale(p)[0]
    unpacked = torch.tensor([(int(bits[i // 8]) >> (i % 8)) & 1 for i in range(21)], dtype=torch.bool)
    assert torch.equal(unpacked, keep)
    x = torch.randn(3, 7)
    assert torch.equal(dropout.apply_bits(x, bits, p) != 0, keep.view(3, 7) & (x != 0))


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the Triton kernel)")


@cuda
@pytest.mark.parametrize("n", [1, 7, 8, 9, 37_000, 4096 * 2048 + 3])
def test_triton_bits_equal_the_reference_and_compiled_application_equals_eager(n):
    assert dropout.triton is not None
    seed = torch.tensor([123456789], device="cuda")
    for p in (0.05, 0.5):
        assert torch.equal(dropout.dropout_bits(seed, n, p), dropout.reference_bits(seed, n, p))
    x = torch.randn(n, device="cuda").to(torch.bfloat16)
    eager = dropout.seeded_dropout(x, seed, 0.05)
    compiled = torch.compile(lambda t, s: dropout.seeded_dropout(t, s, 0.05))(x, seed)
    assert torch.equal(compiled == 0, eager == 0)
    torch.testing.assert_close(compiled, eager, rtol=2**-7, atol=0)


@cuda
def test_compiled_lora_layer_under_selective_checkpointing_applies_the_forwards_mask_in_backward():
    """y = drop(x) through identity adapters over a zero base: the backward's input gradient (ones upstream) must be
    non-zero exactly where the forward kept x, under torch.compile and selective recomputation of the block."""
    from torch.utils.checkpoint import checkpoint

    from gptoughts.perf import checkpointing, lora

    d = 256
    w = torch.zeros(d, d, device="cuda", dtype=torch.bfloat16)
    eye = torch.eye(d, device="cuda", dtype=torch.bfloat16)

    def block(x):
        return lora._LoraLinear.apply(
            torch.nn.functional.gelu(x), dropout.new_seed(x.device), w, None, eye, eye.clone(), 1.0, 0.3
        )

    def step(x):
        return checkpoint(block, x, use_reentrant=False, context_fn=checkpointing._selective_context)

    for fn in (step, torch.compile(step, fullgraph=True)):  # no eager fallback
        x = (torch.rand(8, 512, d, device="cuda") + 1).to(torch.bfloat16).requires_grad_(True)  # gelu(x) > 0
        y = fn(x)
        y.float().sum().backward()
        kept = y != 0
        assert 0.6 < kept.float().mean().item() < 0.8
        assert torch.equal(kept, x.grad != 0)
