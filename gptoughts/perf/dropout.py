"""Dropout whose mask is a pure function of a seed tensor: one Philox call per eight elements, the mask kept as bits.

torch.compile's dropout draws one Philox4x32-10 call per element, again wherever the mask is needed later;
here one call's four words are eight 16-bit uniforms, the decisions of eight elements, stored as the bits of
one byte (:func:`dropout_bits`: n/8 bytes, cheap to keep for the backward). :func:`apply_bits` is plain
element-wise PyTorch that torch.compile fuses into the neighbouring kernels. Why, and what was measured:
``docs/performance.md``.

An element is dropped when its 16-bit draw is below ``t = round(p * 65536)``, so the rate is ``p`` to within
1/131072, and kept values are scaled by the exact ``65536 / (65536 - t)``: the output's expectation is the input.
Element ``8 j + k`` uses the 16-bit half ``k % 2`` of Philox word ``k // 2`` at counter ``j`` (key ``(seed_lo,
seed_hi)``, counter ``(j, 0, 0, 0)``, as Triton's ``randint4x``) and is bit ``k`` of byte ``j``. On CUDA a Triton
kernel draws the bits (a ``torch.library.triton_op``, which torch.compile traces); elsewhere, and as the tests'
reference, the same function in PyTorch integer ops.
"""

from __future__ import annotations

import functools

import torch

_M32 = 0xFFFFFFFF
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57


def threshold_and_scale(p: float) -> tuple[int, float]:
    """The 16-bit drop threshold of rate ``p`` and the scale of kept values."""
    t = min(65535, max(0, round(p * 65536)))
    return t, 65536.0 / (65536 - t)


def new_seed(device: torch.device) -> torch.Tensor:
    """A fresh seed from torch's generator of ``device`` (reproducible under ``torch.manual_seed``)."""
    return torch.randint(0, 2**31 - 1, (1,), device=device, dtype=torch.int64)


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a*b >> 32, a*b mod 2**32)`` for a 32-bit constant ``a`` and 32-bit values ``b`` held in int64 (16-bit limbs
    of ``a`` keep every product below 2**49)."""
    hi_part, lo_part = b * (a >> 16), b * (a & 0xFFFF)
    hi = (hi_part + (lo_part >> 16)) >> 16
    lo = (((hi_part & 0xFFFF) << 16) + lo_part) & _M32
    return hi, lo


def _philox4x32(seed: torch.Tensor, counter: torch.Tensor) -> list[torch.Tensor]:
    c0, c1, c2, c3 = counter, torch.zeros_like(counter), torch.zeros_like(counter), torch.zeros_like(counter)
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    for _ in range(10):
        hi_b, lo_b = _mulhilo(_ROUND_B, c2)
        hi_a, lo_a = _mulhilo(_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _KEY_A) & _M32, (k1 + _KEY_B) & _M32
    return [c0, c1, c2, c3]


def draws(seed: torch.Tensor, n: int) -> torch.Tensor:
    """The 16-bit uniform draw of each of ``n`` elements (int64; the reference of the kernel's)."""
    words = _philox4x32(seed.to(torch.int64), torch.arange(-(-n // 8), device=seed.device, dtype=torch.int64))
    halves = [(words[k // 2] >> (16 * (k % 2))) & 0xFFFF for k in range(8)]
    return torch.stack(halves, dim=1).flatten()[:n]


def reference_bits(seed: torch.Tensor, n: int, p: float) -> torch.Tensor:
    """The keep mask of ``n`` elements as ``ceil(n / 8)`` bytes, in PyTorch ops."""
    t, _ = threshold_and_scale(p)
    keep = (draws(seed, -(-n // 8) * 8) >= t).view(-1, 8).to(torch.int32)
    return (keep << torch.arange(8, device=seed.device, dtype=torch.int32)).sum(1).to(torch.uint8)


def apply_bits(x: torch.Tensor, bits: torch.Tensor, p: float) -> torch.Tensor:
    """``x`` with the elements whose bit is 0 zeroed and the rest scaled by ``65536 / (65536 - t)``, computed in
    fp32 (fp64 for fp64) and returned in ``x``'s dtype: element-wise ops that torch.compile fuses with their
    neighbours."""
    _, scale = threshold_and_scale(p)
    n = x.numel()
    flat = x.reshape(-1)
    pad = -n % 8
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    shifts = torch.arange(8, device=x.device, dtype=torch.int32)
    keep = ((bits.view(-1, 1).to(torch.int32) >> shifts) & 1).bool()
    wide = torch.promote_types(x.dtype, torch.float32)
    out = torch.where(keep, flat.view(-1, 8).to(wide) * scale, 0.0).to(x.dtype).view(-1)
    return (out[:n] if pad else out).view(x.shape)


try:  # Triton ships with PyTorch's CUDA wheels; the CPU wheels have none
    import triton
    import triton.language as tl
    from torch.library import triton_op, wrap_triton
except ImportError:
    triton = None

if triton is not None:

    @triton.jit
    def _bit(word, SHIFT: tl.constexpr, threshold, POS: tl.constexpr):
        return ((((word >> SHIFT) & 0xFFFF).to(tl.int32) >= threshold).to(tl.int32)) << POS

    @triton.jit
    def _dropout_bits_kernel(seed_ptr, out_ptr, n_bytes, threshold, BLOCK: tl.constexpr):
        # int32 counters: Philox4x32 (int64 counters would pick Philox4x64)
        j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        w0, w1, w2, w3 = tl.randint4x(tl.load(seed_ptr), j)
        byte = _bit(w0, 0, threshold, 0) | _bit(w0, 16, threshold, 1) | _bit(w1, 0, threshold, 2)
        byte = byte | _bit(w1, 16, threshold, 3) | _bit(w2, 0, threshold, 4) | _bit(w2, 16, threshold, 5)
        byte = byte | _bit(w3, 0, threshold, 6) | _bit(w3, 16, threshold, 7)
        tl.store(out_ptr + j, byte.to(tl.uint8), mask=j < n_bytes)

    _BLOCK = 1024

    @triton_op("gptoughts::dropout_bits", mutates_args=())
    def _dropout_bits_cuda(seed: torch.Tensor, n_bytes: int, threshold: int) -> torch.Tensor:
        out = torch.empty(n_bytes, device=seed.device, dtype=torch.uint8)
        if n_bytes:
            grid = ((n_bytes + _BLOCK - 1) // _BLOCK,)
            wrap_triton(_dropout_bits_kernel)[grid](seed, out, n_bytes, threshold, BLOCK=_BLOCK)
        return out


@functools.cache
def _triton_runs_on(index: int) -> bool:
    return triton is not None and torch.cuda.get_device_capability(index) >= (7, 0)  # Triton's oldest GPUs


def dropout_bits(seed: torch.Tensor, n: int, p: float) -> torch.Tensor:
    """The keep mask of ``n`` elements at rate ``p`` as ``ceil(n / 8)`` bytes (bit ``k`` of byte ``j``: element
    ``8 j + k``); the same seed gives the same mask."""
    # compiled, the GPU runs inductor's own Triton kernels (no check traced); eager, the GPU may be too old
    kernel = seed.is_cuda and triton is not None
    if kernel and not torch.compiler.is_compiling():
        kernel = _triton_runs_on(seed.device.index if seed.device.index is not None else 0)
    if kernel:
        return torch.ops.gptoughts.dropout_bits(seed, -(-n // 8), threshold_and_scale(p)[0])
    return reference_bits(seed, n, p)


def seeded_dropout(x: torch.Tensor, seed: torch.Tensor, p: float) -> torch.Tensor:
    """``x`` with the elements the seed drops zeroed and the rest scaled by ``1 / (1 - p)`` (to within the rate's
    16-bit step, see the module docstring). The same ``seed`` and shape give the same mask."""
    return apply_bits(x, dropout_bits(seed, x.numel(), p), p)
