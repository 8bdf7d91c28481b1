"""INL's integrator as Triton kernels, one launch per iteration forward and backward (``integrator_impl =
"triton"``).

A launch covers a grid of token tiles by feature blocks. The controller's pre-activation ``c_{i+1}`` is a
reduction over all d features while the update is per feature, so each program applies iteration i's update to
its block with ``g_i = gelu(c_i)`` and leaves its block's share of ``c_{i+1}`` as a ``[BM, H]`` partial, which the
next launch sums. Per iteration the state is read and written once; no ``[N, 4d]`` controller output is ever
stored in the forward. The backward writes ``du_i`` (which its weight gradient needs anyway) and takes
``dc_i = gelu'(c_i) du_i W_out`` from a cuBLAS matmul between launches: reduced in the kernel as partials, its
accumulator and second weight tile halved the kernel's occupancy. Weight gradients are
reductions over all tokens: one cuBLAS matmul each over ``du_i``, ``dc_i`` and the bf16 ``[x_i, v_i]``; μ's and
κ's come as per-tile sums, deterministic.

The function is :func:`models.inl_fused.integrate`'s, with the same saved state (x_i, v_i in fp32, c_i); it keeps
``c_i`` and the controller's outputs in fp32 where the matmul path rounds them to bf16. It needs Triton (CUDA
wheels), a bf16/fp16 matmul dtype and a power-of-two controller width of 16-256; elsewhere the fused autograd
Function runs (:func:`supported`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:  # Triton ships with PyTorch's CUDA wheels; the CPU wheels have none
    import triton
    import triton.language as tl
except ImportError:
    triton = None

__all__ = ["TILES", "available", "integrate", "supported"]

TILES = {
    "forward": {"BM": 32, "BD": 16, "BDB": 512, "num_warps": 4, "num_stages": 3},
    "backward": {"BM": 32, "BD": 16, "BDB": 512, "num_warps": 4, "num_stages": 3},
}
"""Per pass: tokens per program, features per chunk and per program, warps and software-pipelining stages; the
fastest of a sweep on an H200 for each pass (bench/inl_step.py --tiles, which may change them); they coincide."""


def available() -> bool:
    return triton is not None


def supported(h: torch.Tensor, hidden: int, mm_dtype: torch.dtype) -> bool:
    """Whether the kernels run these operands (``interpret``: Triton's CPU interpreter, for the tests)."""
    if not _hidden_fits(hidden):
        return False
    if h.is_cuda:
        return mm_dtype in (torch.bfloat16, torch.float16)
    return _interpreting()


def will_run(hidden: int, device: torch.device, precision: str) -> bool:
    """Whether a run on ``device`` at ``precision`` gets the kernels (else the fused Function): what the assembly
    records and the memory estimate counts."""
    return _hidden_fits(hidden) and device.type == "cuda" and precision in ("bf16", "fp16")


def _hidden_fits(hidden: int) -> bool:
    return triton is not None and 16 <= hidden <= 256 and not hidden & (hidden - 1)


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:

    @triton.jit
    def _gelu(c):
        return 0.5 * c * (1.0 + tl.erf(c * 0.7071067811865476))

    @triton.jit
    def _softplus(x):
        return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))

    @triton.jit
    def _dot(a, b, IEEE: tl.constexpr):
        if IEEE:
            return tl.dot(a, b, input_precision="ieee")
        else:
            return tl.dot(a, b)

    @triton.jit
    def _controller(g, w4_ptr, b4_ptr, j0, D, H: tl.constexpr, BD: tl.constexpr, IEEE: tl.constexpr):
        """The chunk's four controller outputs ``W_out gelu(c) + b_out`` in fp32 ([BM, BD] each), from one
        dot: W_out's rows are interleaved per feature (row ``4j + p``: part p of feature j)."""
        hh = tl.arange(0, H)
        rows4 = 4 * j0 + tl.arange(0, 4 * BD)
        m4 = rows4 < 4 * D
        w = tl.load(w4_ptr + rows4[None, :] * H + hh[:, None], mask=m4[None, :], other=0.0)  # [H, 4 BD]
        u = _dot(g, w, IEEE) + tl.load(b4_ptr + rows4, mask=m4, other=0.0).to(tl.float32)[None, :]
        lo0, lo1 = tl.split(tl.reshape(u, [u.shape[0], BD, 2, 2]))  # p = 2 p_hi + p_lo
        a, gl = tl.split(lo0)
        b, vc = tl.split(lo1)
        return a, b, gl, vc

    @triton.jit
    def _token_tile(pm, N, BM: tl.constexpr, H: tl.constexpr):
        """Program row ``pm``'s tokens: ``(rmask, r, hh, cmat)``, ``r`` the int64 rows and ``cmat`` their
        ``[BM, H]`` offsets in an ``[N, H]`` tensor."""
        rows = pm * BM + tl.arange(0, BM)
        r = rows.to(tl.int64)
        hh = tl.arange(0, H)
        return rows < N, r, hh, r[:, None] * H + hh[None, :]

    @triton.jit
    def _chunk(j0, r, rmask, D, BD: tl.constexpr):
        """Features ``j0 .. j0 + BD`` of the tile: ``(cols, cmask, m2, off)``, ``m2`` the rows' and columns' mask
        and ``off`` the ``[BM, BD]`` offsets in an ``[N, D]`` tensor."""
        cols = j0 + tl.arange(0, BD)
        cmask = cols < D
        return cols, cmask, rmask[:, None] & cmask[None, :], r[:, None] * D + cols[None, :]

    @triton.jit
    def _per_feature(mu_ptr, ka_ptr, cols, cmask):
        """μ and κ of the chunk's features, ``[1, BD]`` fp32."""
        mu = tl.load(mu_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        return mu, tl.load(ka_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]

    @triton.jit
    def _partial_sum(base_ptr, r, rmask, N, FB, H: tl.constexpr, BM: tl.constexpr):
        """The sum over feature blocks of ``[FB, N, H]`` partials, ``[BM, H]`` fp32 (``r``: int64 rows)."""
        acc = tl.zeros([BM, H], dtype=tl.float32)
        hh = tl.arange(0, H)
        for f in range(FB):
            acc += tl.load(base_ptr + (r + f * N)[:, None] * H + hh[None, :], mask=rmask[:, None], other=0.0)
        return acc

    @triton.jit
    def _fwd_step(
        h_ptr, x_ptr, v_ptr, c0_ptr, ch_ptr, pin_ptr, pout_ptr, cs_ptr, xo_ptr, vo_ptr,
        wxv_ptr, w4_ptr, b4_ptr, mu_ptr, ka_ptr,
        N, D, FB, dt,
        H: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr, BDB: tl.constexpr,
        FIRST: tl.constexpr, LAST: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        """One iteration on a tile of tokens and a block of features: the update from ``c``, and this block's
        share of the next ``c`` (``pout``, summed over blocks by the next launch)."""
        mm = w4_ptr.dtype.element_ty
        pm, pf = tl.program_id(0), tl.program_id(1)
        rmask, r, hh, cmat = _token_tile(pm, N, BM, H)
        if FIRST:
            c = tl.load(c0_ptr + cmat, mask=rmask[:, None], other=0.0).to(tl.float32)
        else:
            c = tl.load(ch_ptr + cmat, mask=rmask[:, None], other=0.0).to(tl.float32)
            c += _partial_sum(pin_ptr, r, rmask, N, FB, H, BM)
        if pf == 0:
            tl.store(cs_ptr + cmat, c, mask=rmask[:, None])
        g = _gelu(c).to(mm)
        acc = tl.zeros([BM, H], dtype=tl.float32)
        for j0 in range(pf * BDB, tl.minimum(pf * BDB + BDB, D), BD):
            cols, cmask, m2, off = _chunk(j0, r, rmask, D, BD)
            a, b, gl, vc = _controller(g, w4_ptr, b4_ptr, j0, D, H, BD, IEEE)
            mu, ka = _per_feature(mu_ptr, ka_ptr, cols, cmask)
            if FIRST:
                x = tl.load(h_ptr + off, mask=m2, other=0.0).to(tl.float32)
            else:
                x = tl.load(x_ptr + off, mask=m2, other=0.0)
                v = tl.load(v_ptr + off, mask=m2, other=0.0)
            err = x - mu
            alpha = tl.sigmoid(a) * tl.exp(-ka * tl.abs(err))
            vn = (1.0 - alpha) * vc - _softplus(b) * err
            if not FIRST:
                vn += alpha * v
            xn = x + dt * tl.sigmoid(gl) * vn
            tl.store(xo_ptr + off, xn, mask=m2)
            if not LAST:
                tl.store(vo_ptr + off, vn, mask=m2)
                c2 = 2 * j0 + tl.arange(0, 2 * BD)  # W_in's x and v columns, interleaved per feature
                w = tl.load(
                    wxv_ptr + hh[:, None] * (2 * D) + c2[None, :], mask=(c2 < 2 * D)[None, :], other=0.0
                )
                xv = tl.reshape(tl.join(xn, vn), [BM, 2 * BD]).to(mm)
                acc += _dot(xv, tl.trans(w), IEEE)
        if not LAST:
            tl.store(pout_ptr + (r + pf * N)[:, None] * H + hh[None, :], acc, mask=rmask[:, None])

    @triton.jit
    def _update_backward(
        g, x, v, gx, gv, w4_ptr, b4_ptr, mu_ptr, ka_ptr, du_ptr, j0, cols, cmask, r, rmask, D, dt,
        H: tl.constexpr, BD: tl.constexpr, HAS_V: tl.constexpr, HAS_GV: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        """One chunk of an iteration's update backward (models.inl_fused.update_backward): stores ``du``
        (interleaved as W_out's rows), returns ``(gx + d_err, dv, dμ, dκ)`` with dμ, dκ summed over the tile."""
        mm = w4_ptr.dtype.element_ty
        a, b, gl, vc = _controller(g, w4_ptr, b4_ptr, j0, D, H, BD, IEEE)
        mu, ka = _per_feature(mu_ptr, ka_ptr, cols, cmask)
        err = x - mu
        s_a = tl.sigmoid(a)
        alpha = s_a * tl.exp(-ka * tl.abs(err))
        beta = _softplus(b)
        vn = (1.0 - alpha) * vc - beta * err
        if HAS_V:
            vn += alpha * v
        s_g = tl.sigmoid(gl)
        g_vnew = gx * (dt * s_g)
        if HAS_GV:
            g_vnew += gv
        d_gate = gx * dt * vn * s_g * (1.0 - s_g)
        d_vc = g_vnew * (1.0 - alpha)
        if HAS_V:
            d_damp = g_vnew * (v - vc) * alpha  # dα times ∂α/∂(-κ|err|) = α
        else:
            d_damp = -g_vnew * vc * alpha
        d_a = d_damp * (1.0 - s_a)
        d_b = -g_vnew * err * tl.sigmoid(b)
        du = tl.reshape(tl.join(tl.join(d_a, d_gate), tl.join(d_b, d_vc)), [x.shape[0], 4 * BD]).to(mm)
        rows4 = 4 * j0 + tl.arange(0, 4 * BD)
        m4 = rows4 < 4 * D
        tl.store(du_ptr + r[:, None] * (4 * D) + rows4[None, :], du, mask=rmask[:, None] & m4[None, :])
        sign = tl.where(err > 0, 1.0, tl.where(err < 0, -1.0, 0.0))
        d_err = -g_vnew * beta - d_damp * ka * sign
        dka = -tl.sum(d_damp * tl.abs(err), axis=0)
        return gx + d_err, g_vnew * alpha, -tl.sum(d_err, axis=0), dka

    @triton.jit
    def _bwd_step(
        gout_ptr, gx_ptr, gv_ptr, dcnext_ptr, c_ptr,
        h_ptr, x_ptr, v_ptr, xv_ptr, du_ptr, pmu_ptr, pka_ptr,
        wxv_ptr, w4_ptr, b4_ptr, mu_ptr, ka_ptr,
        N, D, dt,
        H: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr, BDB: tl.constexpr,
        TOP: tl.constexpr, FIRST: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        """Iteration i's backward on a tile of tokens and a block of features. Below the top iteration it first
        finishes the gradients of x_{i+1} and v_{i+1} with ``dc_{i+1}`` (``dcnext``); it leaves the gradients of
        x_i and v_i without dc_i's share in gx/gv, ``du_i``, the bf16 ``[x_i, v_i]`` and dμ/dκ sums."""
        mm = w4_ptr.dtype.element_ty
        pm, pf = tl.program_id(0), tl.program_id(1)
        rmask, r, hh, cmat = _token_tile(pm, N, BM, H)
        dcm = tl.zeros([BM, H], dtype=mm)
        if not TOP:
            dcm = tl.load(dcnext_ptr + cmat, mask=rmask[:, None], other=0.0).to(mm)
        g = _gelu(tl.load(c_ptr + cmat, mask=rmask[:, None], other=0.0)).to(mm)
        for j0 in range(pf * BDB, tl.minimum(pf * BDB + BDB, D), BD):
            cols, cmask, m2, off = _chunk(j0, r, rmask, D, BD)
            c2 = 2 * j0 + tl.arange(0, 2 * BD)  # W_in's x and v columns, interleaved per feature
            m2x = rmask[:, None] & (c2 < 2 * D)[None, :]
            if TOP:
                gx = tl.load(gout_ptr + off, mask=m2, other=0.0).to(tl.float32)
                gv = gx  # unused: nothing reads v_K
            else:
                w = tl.load(
                    wxv_ptr + hh[:, None] * (2 * D) + c2[None, :], mask=(c2 < 2 * D)[None, :], other=0.0
                )
                add_x, add_v = tl.split(tl.reshape(_dot(dcm, w, IEEE), [BM, BD, 2]))
                gx = tl.load(gx_ptr + off, mask=m2, other=0.0) + add_x
                gv = tl.load(gv_ptr + off, mask=m2, other=0.0) + add_v
            if FIRST:
                x = tl.load(h_ptr + off, mask=m2, other=0.0).to(tl.float32)
                v = x  # unused: iteration 0 starts from v = 0
            else:
                x = tl.load(x_ptr + off, mask=m2, other=0.0)
                v = tl.load(v_ptr + off, mask=m2, other=0.0)
            gx, gv, dmu, dka = _update_backward(
                g, x, v, gx, gv, w4_ptr, b4_ptr, mu_ptr, ka_ptr, du_ptr,
                j0, cols, cmask, r, rmask, D, dt, H, BD, not FIRST, not TOP, IEEE,
            )  # fmt: skip
            tl.store(gx_ptr + off, gx, mask=m2)
            if not FIRST:
                tl.store(gv_ptr + off, gv, mask=m2)
                xv = tl.reshape(tl.join(x, v), [BM, 2 * BD]).to(mm)
                tl.store(xv_ptr + r[:, None] * (2 * D) + c2[None, :], xv, mask=m2x)
            pmo = pm * D + cols  # the tile's row of the partial sums
            tl.store(pmu_ptr + pmo, tl.load(pmu_ptr + pmo, mask=cmask, other=0.0) + dmu, mask=cmask)
            tl.store(pka_ptr + pmo, tl.load(pka_ptr + pmo, mask=cmask, other=0.0) + dka, mask=cmask)

    def _launch(n: int, d: int, mm_dtype: torch.dtype, which: str) -> tuple[tuple[int, int], dict]:
        t = TILES[which]
        sizes = (t["BM"], t["BD"], t["BDB"])
        if any(v < 16 or v & (v - 1) for v in sizes) or t["BDB"] % t["BD"]:
            raise ValueError(
                f"TILES[{which!r}]: BM, BD and BDB must be powers of two >= 16, BD dividing BDB; got {sizes}"
            )
        kw = dict(BM=t["BM"], BD=t["BD"], BDB=t["BDB"], num_warps=t["num_warps"], num_stages=t["num_stages"])
        return (triton.cdiv(n, t["BM"]), triton.cdiv(d, t["BDB"])), dict(IEEE=mm_dtype == torch.float32, **kw)

    def _forward_outputs(h: torch.Tensor, hid: int, k: int) -> tuple[torch.Tensor, ...]:
        """``(x_K, xs, vs, cs)`` unfilled: the real op's and its fake's, one definition of their shapes."""
        n, d = h.shape
        f32 = torch.float32
        return tuple(
            h.new_empty(shape, dtype=f32) for shape in ((n, d), (k - 1, n, d), (k - 1, n, d), (k, n, hid))
        )

    def _backward_outputs(h: torch.Tensor, cs: torch.Tensor, mm: torch.dtype) -> tuple[torch.Tensor, ...]:
        """``(dh, dc, du, xv)`` unfilled, as :func:`_forward_outputs` (the other two outputs are per-feature sums
        the op reduces)."""
        (k, n, hid), d = cs.shape, h.size(-1)
        f32 = torch.float32
        return (
            h.new_empty(n, d, dtype=f32),
            h.new_empty(k, n, hid, dtype=f32),
            h.new_empty(k, n, 4 * d, dtype=mm),
            h.new_empty(k - 1, n, 2 * d, dtype=mm),
        )

    # Opaque custom ops, not torch.library.triton_op: traced through, the per-iteration views of the saved state
    # that the launches write became functional copies, and the compiled block read out of bounds.
    @torch.library.custom_op("gptoughts::inl_integrate", mutates_args=())
    def _integrate_op(
        h: torch.Tensor,
        c_h: torch.Tensor,
        c0: torch.Tensor,
        w_xv: torch.Tensor,
        w_out: torch.Tensor,
        b_out: torch.Tensor,
        mu: torch.Tensor,
        kappa: torch.Tensor,
        dt: float,
        k: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        n, d = h.shape
        hid = c_h.size(-1)
        grid, kw = _launch(n, d, w_out.dtype, "forward")
        fb = grid[1]
        out, xs, vs, cs = _forward_outputs(h, hid, k)
        parts = [h.new_empty(fb, n, hid, dtype=torch.float32) for _ in range(min(k - 1, 2))] or [cs]
        weights = (w_xv, w_out, b_out, mu, kappa)
        for it in range(k):
            x, v = (h, h) if it == 0 else (xs[it - 1], vs[it - 1])
            xo, vo = (out, out) if it == k - 1 else (xs[it], vs[it])
            pin, pout = parts[(it + 1) % len(parts)], parts[it % len(parts)]
            _fwd_step[grid](
                h, x, v, c0, c_h, pin, pout, cs[it], xo, vo, *weights, n, d, fb, dt,
                H=hid, FIRST=it == 0, LAST=it == k - 1, **kw,
            )  # fmt: skip
        return out, xs, vs, cs

    @torch.library.custom_op("gptoughts::inl_integrate_backward", mutates_args=())
    def _backward_op(
        gout: torch.Tensor,
        h: torch.Tensor,
        xs: torch.Tensor,
        vs: torch.Tensor,
        cs: torch.Tensor,
        w_xv: torch.Tensor,
        w_out: torch.Tensor,
        b_out: torch.Tensor,
        mu: torch.Tensor,
        kappa: torch.Tensor,
        dt: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        k, n, hid = cs.shape
        d = h.size(-1)
        f32 = torch.float32
        grid, kw = _launch(n, d, w_out.dtype, "backward")
        # gx becomes h's gradient through the update
        gx, dc, du, xv = _backward_outputs(h, cs, w_out.dtype)
        gv = h.new_empty(n, d, dtype=f32)
        pmu = h.new_zeros(grid[0], d, dtype=f32)
        pka = h.new_zeros(grid[0], d, dtype=f32)
        weights = (w_xv, w_out, b_out, mu, kappa)
        for it in reversed(range(k)):
            x, v = (h, h) if it == 0 else (xs[it - 1], vs[it - 1])
            nxt = min(it + 1, k - 1)
            if it < k - 1:
                dc[nxt] = _dc(du[nxt], w_out, cs[nxt])
            _bwd_step[grid](
                gout, gx, gv, dc[nxt], cs[it], h, x, v, xv[max(it - 1, 0)] if k > 1 else du,
                du[it], pmu, pka, *weights, n, d, dt,
                H=hid, TOP=it == k - 1, FIRST=it == 0, **kw,
            )  # fmt: skip
        dc[0] = _dc(du[0], w_out, cs[0])
        # μ's and κ's sums reduced here, so that no output's shape depends on the tiles (the fake's are traced once)
        return gx, dc, du, xv, pmu.sum(0), pka.sum(0)

    def _dc(du: torch.Tensor, w4: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """``dc = gelu'(c) du W_out`` by cuBLAS, accumulated in fp32 (CPU has no mm with an output dtype: the
        interpreter's, there)."""
        dg = torch.mm(du, w4, out_dtype=torch.float32) if du.is_cuda else du.float() @ w4.float()
        return torch.ops.aten.gelu_backward(dg, c)


if triton is not None:

    @_integrate_op.register_fake
    def _(h, c_h, c0, w_xv, w_out, b_out, mu, kappa, dt, k):
        return _forward_outputs(h, c_h.size(-1), k)

    @_backward_op.register_fake
    def _(gout, h, xs, vs, cs, w_xv, w_out, b_out, mu, kappa, dt):
        dh, dc, du, xv = _backward_outputs(h, cs, w_out.dtype)
        d = h.size(-1)
        return dh, dc, du, xv, h.new_empty(d, dtype=torch.float32), h.new_empty(d, dtype=torch.float32)


def _setup_context(ctx, inputs, output) -> None:
    h, c_h, c0, w_xv, w_out, b_out, mu, kappa, dt, _k = inputs
    _out, xs, vs, cs = output
    ctx.save_for_backward(h, w_xv, w_out, b_out, mu, kappa, xs, vs, cs)
    ctx.dt, ctx.ch_dtype, ctx.c0_dtype = dt, c_h.dtype, c0.dtype
    ctx.mark_non_differentiable(xs, vs, cs)


def _backward(ctx, gout, _gxs, _gvs, _gcs):
    h, w_xv, w_out, b_out, mu, kappa, xs, vs, cs = ctx.saved_tensors
    dh, dc, du, xv, dmu, dkappa = torch.ops.gptoughts.inl_integrate_backward(
        gout.contiguous(), h, xs, vs, cs, w_xv, w_out, b_out, mu, kappa, ctx.dt
    )
    k, n, hid = cs.shape
    dc0 = dc[0]
    g = F.gelu(cs).to(w_out.dtype).view(k * n, hid)
    dw_out = du.view(k * n, -1).t() @ g  # one reduction over all tokens and iterations
    db_out = du.view(k * n, -1).sum(0, dtype=torch.float32)
    if k > 1:
        dw_xv = dc[1:].to(w_xv.dtype).view(-1, hid).t() @ xv.view((k - 1) * n, -1)
        dc_h = dc[1:].sum(0)
    else:
        dw_xv, dc_h = torch.zeros_like(w_xv), torch.zeros_like(dc0)
    return (
        dh.to(h.dtype),
        dc_h.to(ctx.ch_dtype),
        dc0.to(ctx.c0_dtype),
        dw_xv.to(w_xv.dtype),
        dw_out.to(w_out.dtype),
        db_out.to(b_out.dtype),
        dmu.to(mu.dtype),
        dkappa.to(kappa.dtype),
        None,
        None,
    )


if triton is not None:
    _integrate_op.register_autograd(_backward, setup_context=_setup_context)


def integrate(
    h: torch.Tensor,
    c_h: torch.Tensor,
    w_xv: torch.Tensor,
    w_out: torch.Tensor,
    b_out: torch.Tensor,
    mu: torch.Tensor,
    kappa: torch.Tensor,
    dt: float,
    n_iterations: int,
) -> torch.Tensor:
    """``x_K`` of the integrator through the kernels (the caller checks :func:`supported`), given ``c_h`` and
    ``W_in``'s x and v columns as :func:`models.inl_fused.integrate`. The first iteration's ``c_0 = c_h + W_x h``
    stays an ordinary autograd op, as in the reference; the weights are cast to ``c_h``'s dtype, so their
    gradients reach the fp32 parameters through the casts."""
    d = h.size(-1)
    c0 = c_h + F.linear(h, w_xv[:, :d])
    mm, hid = c_h.dtype, c_h.size(-1)
    shape = h.shape
    # Interleaved per feature (plain views and copies: autograd maps the gradients back): W_out's four parts of
    # feature j at rows 4j..4j+3, W_in's x and v columns of feature j at 2j, 2j+1. A chunk's four controller
    # outputs then come from one dot, and its x and v share of the next c from another.
    w4 = w_out.to(mm).view(4, d, hid).transpose(0, 1).reshape(4 * d, hid)
    b4 = b_out.to(mm).view(4, d).t().reshape(4 * d)
    wxv = w_xv.to(mm).view(hid, 2, d).transpose(1, 2).reshape(hid, 2 * d)
    out, *_ = torch.ops.gptoughts.inl_integrate(
        h.reshape(-1, d).contiguous(),
        c_h.reshape(-1, hid).contiguous(),
        c0.reshape(-1, hid).contiguous(),
        wxv.contiguous(),
        w4.contiguous(),
        b4.contiguous(),
        mu.contiguous(),
        kappa.contiguous(),
        dt,
        n_iterations,
    )
    return out.view(shape).to(torch.promote_types(h.dtype, mu.dtype))
