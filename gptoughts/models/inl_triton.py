"""INL's integrator as Triton kernels, one launch per iteration forward and backward (``integrator_impl =
"triton"``).

A launch covers a grid of token tiles by feature blocks. The controller's pre-activation ``c_{i+1}`` is a
reduction over all d features while the update is per feature, so each program applies iteration i's update to
its block with ``g_i = gelu(c_i)`` and leaves its block's share of ``c_{i+1}`` as a ``[BM, H]`` partial, which the
next launch sums (the backward does the same with ``du_i W_out``). Per iteration the state is read and written
once; no ``[N, 4d]`` controller output is ever stored in the forward. Weight gradients are reductions over all
tokens: the backward writes their operands (``du_i``, ``dc_i`` and the bf16 ``[x_i, v_i]``) and one cuBLAS
matmul each reduces them; μ's and κ's come as per-tile sums, deterministic.

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
    from torch.library import triton_op, wrap_triton
except ImportError:
    triton = None

__all__ = ["TILES", "available", "integrate", "supported"]

TILES = {"BM": 32, "BD": 32, "BDB": 256, "num_warps": 4, "num_stages": 1}
"""Tokens per program, features per chunk and per program, warps and software-pipelining stages; a benchmark
may change them (bench/inl_step.py --tiles)."""


def available() -> bool:
    return triton is not None


def supported(h: torch.Tensor, hidden: int, mm_dtype: torch.dtype) -> bool:
    """Whether the kernels run these operands (``interpret``: Triton's CPU interpreter, for the tests)."""
    if triton is None or hidden < 16 or hidden > 256 or hidden & (hidden - 1):
        return False
    if h.is_cuda:
        return mm_dtype in (torch.bfloat16, torch.float16)
    return _interpreting()


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:

    @triton.jit
    def _gelu(c):
        return 0.5 * c * (1.0 + tl.erf(c * 0.7071067811865476))

    @triton.jit
    def _gelu_grad(c):
        return 0.5 * (1.0 + tl.erf(c * 0.7071067811865476)) + c * 0.3989422804014327 * tl.exp(-0.5 * c * c)

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
    def _controller(g, wout_ptr, bout_ptr, cols, cmask, D, H: tl.constexpr, IEEE: tl.constexpr):
        """The chunk's four controller outputs ``W_out gelu(c) + b_out`` in fp32: ([BM, BD] each)."""
        hh = tl.arange(0, H)
        wmask = cmask[:, None]
        wt = wout_ptr + cols[:, None] * H + hh[None, :]  # rows of W_out [4D, H], read as [BD, H]
        a = _dot(g, tl.trans(tl.load(wt, mask=wmask, other=0.0)), IEEE)
        b = _dot(g, tl.trans(tl.load(wt + D * H, mask=wmask, other=0.0)), IEEE)
        gl = _dot(g, tl.trans(tl.load(wt + 2 * D * H, mask=wmask, other=0.0)), IEEE)
        vc = _dot(g, tl.trans(tl.load(wt + 3 * D * H, mask=wmask, other=0.0)), IEEE)
        a += tl.load(bout_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        b += tl.load(bout_ptr + D + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        gl += tl.load(bout_ptr + 2 * D + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        vc += tl.load(bout_ptr + 3 * D + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        return a, b, gl, vc

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
        wxv_ptr, sw, wout_ptr, bout_ptr, mu_ptr, ka_ptr,
        N, D, FB, dt,
        H: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr, BDB: tl.constexpr,
        FIRST: tl.constexpr, LAST: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        """One iteration on a tile of tokens and a block of features: the update from ``c``, and this block's
        share of the next ``c`` (``pout``, summed over blocks by the next launch)."""
        mm = wout_ptr.dtype.element_ty
        pm, pf = tl.program_id(0), tl.program_id(1)
        rows = pm * BM + tl.arange(0, BM)
        rmask = rows < N
        r = rows.to(tl.int64)
        hh = tl.arange(0, H)
        cmat = r[:, None] * H + hh[None, :]
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
            cols = j0 + tl.arange(0, BD)
            cmask = cols < D
            m2 = rmask[:, None] & cmask[None, :]
            off = r[:, None] * D + cols[None, :]
            a, b, gl, vc = _controller(g, wout_ptr, bout_ptr, cols, cmask, D, H, IEEE)
            mu = tl.load(mu_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
            ka = tl.load(ka_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
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
                wp = wxv_ptr + hh[:, None] * sw + cols[None, :]
                acc += _dot(xn.to(mm), tl.trans(tl.load(wp, mask=cmask[None, :], other=0.0)), IEEE)
                acc += _dot(vn.to(mm), tl.trans(tl.load(wp + D, mask=cmask[None, :], other=0.0)), IEEE)
        if not LAST:
            tl.store(pout_ptr + (r + pf * N)[:, None] * H + hh[None, :], acc, mask=rmask[:, None])

    @triton.jit
    def _update_backward(
        g, x, v, gx, gv, wout_ptr, bout_ptr, mu_ptr, ka_ptr, du_ptr, cols, cmask, r, m2, N, D, dt,
        H: tl.constexpr, HAS_V: tl.constexpr, HAS_GV: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        """One chunk of an iteration's update backward (models.inl_fused.update_backward): stores ``du``,
        returns ``(gx + d_err, dv, dg, dμ, dκ)`` with ``dg = du W_out`` and dμ, dκ summed over the tile."""
        # Each du part is stored and multiplied into dg as soon as it is known: short live ranges, fewer spills.
        mm = wout_ptr.dtype.element_ty
        hh = tl.arange(0, H)
        wt = wout_ptr + cols[:, None] * H + hh[None, :]
        wmask = cmask[:, None]
        off = r[:, None] * (4 * D) + cols[None, :]
        a, b, gl, vc = _controller(g, wout_ptr, bout_ptr, cols, cmask, D, H, IEEE)
        mu = tl.load(mu_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        ka = tl.load(ka_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
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
        d_part = (gx * dt * vn * s_g * (1.0 - s_g)).to(mm)  # the gate's
        tl.store(du_ptr + off + 2 * D, d_part, mask=m2)
        dg = _dot(d_part, tl.load(wt + 2 * D * H, mask=wmask, other=0.0), IEEE)
        d_part = (g_vnew * (1.0 - alpha)).to(mm)  # v_cand's
        tl.store(du_ptr + off + 3 * D, d_part, mask=m2)
        dg += _dot(d_part, tl.load(wt + 3 * D * H, mask=wmask, other=0.0), IEEE)
        if HAS_V:
            d_damp = g_vnew * (v - vc) * alpha  # dα times ∂α/∂(-κ|err|) = α
        else:
            d_damp = -g_vnew * vc * alpha
        d_part = (d_damp * (1.0 - s_a)).to(mm)  # α̃'s
        tl.store(du_ptr + off, d_part, mask=m2)
        dg += _dot(d_part, tl.load(wt, mask=wmask, other=0.0), IEEE)
        d_part = (-g_vnew * err * tl.sigmoid(b)).to(mm)  # β̃'s
        tl.store(du_ptr + off + D, d_part, mask=m2)
        dg += _dot(d_part, tl.load(wt + D * H, mask=wmask, other=0.0), IEEE)
        sign = tl.where(err > 0, 1.0, tl.where(err < 0, -1.0, 0.0))
        d_err = -g_vnew * beta - d_damp * ka * sign
        dka = -tl.sum(d_damp * tl.abs(err), axis=0)
        return gx + d_err, g_vnew * alpha, dg, -tl.sum(d_err, axis=0), dka

    @triton.jit
    def _bwd_step(
        gout_ptr, gx_ptr, gv_ptr, qin_ptr, qout_ptr, cnext_ptr, dcnext_ptr, c_ptr,
        h_ptr, x_ptr, v_ptr, xv_ptr, du_ptr, pmu_ptr, pka_ptr,
        wxv_ptr, sw, wout_ptr, bout_ptr, mu_ptr, ka_ptr,
        N, D, FB, dt,
        H: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr, BDB: tl.constexpr,
        TOP: tl.constexpr, FIRST: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        """Iteration i's backward on a tile of tokens and a block of features. Below the top iteration it first
        finishes the gradients of x_{i+1} and v_{i+1} with ``dc_{i+1} = gelu'(c_{i+1}) Σ qin`` (the block
        partials of ``du_{i+1} W_out``); it leaves the gradients of x_i and v_i without dc_i's share in gx/gv,
        its block's partial of ``du_i W_out`` in ``qout``, ``du_i``, the bf16 ``[x_i, v_i]`` and dμ/dκ sums."""
        mm = wout_ptr.dtype.element_ty
        pm, pf = tl.program_id(0), tl.program_id(1)
        rows = pm * BM + tl.arange(0, BM)
        rmask = rows < N
        r = rows.to(tl.int64)
        hh = tl.arange(0, H)
        cmat = r[:, None] * H + hh[None, :]
        dc = tl.zeros([BM, H], dtype=tl.float32)
        if not TOP:
            cn = tl.load(cnext_ptr + cmat, mask=rmask[:, None], other=0.0)
            dc = _gelu_grad(cn) * _partial_sum(qin_ptr, r, rmask, N, FB, H, BM)
            if pf == 0:
                tl.store(dcnext_ptr + cmat, dc, mask=rmask[:, None])
        dcm = dc.to(mm)
        g = _gelu(tl.load(c_ptr + cmat, mask=rmask[:, None], other=0.0)).to(mm)
        q = tl.zeros([BM, H], dtype=tl.float32)
        for j0 in range(pf * BDB, tl.minimum(pf * BDB + BDB, D), BD):
            cols = j0 + tl.arange(0, BD)
            cmask = cols < D
            m2 = rmask[:, None] & cmask[None, :]
            off = r[:, None] * D + cols[None, :]
            if TOP:
                gx = tl.load(gout_ptr + off, mask=m2, other=0.0).to(tl.float32)
                gv = gx  # unused: nothing reads v_K
            else:
                wp = wxv_ptr + hh[:, None] * sw + cols[None, :]
                gx = tl.load(gx_ptr + off, mask=m2, other=0.0)
                gx += _dot(dcm, tl.load(wp, mask=cmask[None, :], other=0.0), IEEE)
                gv = tl.load(gv_ptr + off, mask=m2, other=0.0)
                gv += _dot(dcm, tl.load(wp + D, mask=cmask[None, :], other=0.0), IEEE)
            if FIRST:
                x = tl.load(h_ptr + off, mask=m2, other=0.0).to(tl.float32)
                v = x  # unused: iteration 0 starts from v = 0
            else:
                x = tl.load(x_ptr + off, mask=m2, other=0.0)
                v = tl.load(v_ptr + off, mask=m2, other=0.0)
            gx, gv, q_j, dmu, dka = _update_backward(
                g, x, v, gx, gv, wout_ptr, bout_ptr, mu_ptr, ka_ptr, du_ptr,
                cols, cmask, r, m2, N, D, dt, H, not FIRST, not TOP, IEEE,
            )  # fmt: skip
            q += q_j
            tl.store(gx_ptr + off, gx, mask=m2)
            if not FIRST:
                tl.store(gv_ptr + off, gv, mask=m2)
                xo = r[:, None] * 2 * D + cols[None, :]
                tl.store(xv_ptr + xo, x.to(mm), mask=m2)
                tl.store(xv_ptr + xo + D, v.to(mm), mask=m2)
            pmo = pm * D + cols  # the tile's row of the partial sums
            tl.store(pmu_ptr + pmo, tl.load(pmu_ptr + pmo, mask=cmask, other=0.0) + dmu, mask=cmask)
            tl.store(pka_ptr + pmo, tl.load(pka_ptr + pmo, mask=cmask, other=0.0) + dka, mask=cmask)
        tl.store(qout_ptr + (r + pf * N)[:, None] * H + hh[None, :], q, mask=rmask[:, None])

    def _launch(n: int, d: int, mm_dtype: torch.dtype) -> tuple[tuple[int, int], int, dict]:
        t = TILES
        fb = triton.cdiv(d, t["BDB"])
        kw = dict(BM=t["BM"], BD=t["BD"], BDB=t["BDB"], num_warps=t["num_warps"], num_stages=t["num_stages"])
        return (triton.cdiv(n, t["BM"]), fb), fb, dict(IEEE=mm_dtype == torch.float32, **kw)

    @triton_op("gptoughts::inl_integrate", mutates_args=())
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
        hid, f32, dev = c_h.size(-1), torch.float32, h.device
        grid, fb, kw = _launch(n, d, w_out.dtype)
        out = torch.empty(n, d, device=dev, dtype=f32)
        xs = torch.empty(k - 1, n, d, device=dev, dtype=f32)
        vs = torch.empty(k - 1, n, d, device=dev, dtype=f32)
        cs = torch.empty(k, n, hid, device=dev, dtype=f32)
        parts = [torch.empty(fb, n, hid, device=dev, dtype=f32) for _ in range(min(k - 1, 2))] or [cs]
        weights = (w_xv, w_xv.stride(0), w_out, b_out, mu, kappa)
        for it in range(k):
            x, v = (h, h) if it == 0 else (xs[it - 1], vs[it - 1])
            xo, vo = (out, out) if it == k - 1 else (xs[it], vs[it])
            pin, pout = parts[(it + 1) % len(parts)], parts[it % len(parts)]
            wrap_triton(_fwd_step)[grid](
                h, x, v, c0, c_h, pin, pout, cs[it], xo, vo, *weights, n, d, fb, dt,
                H=hid, FIRST=it == 0, LAST=it == k - 1, **kw,
            )  # fmt: skip
        return out, xs, vs, cs

    @triton_op("gptoughts::inl_integrate_backward", mutates_args=())
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
    ) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor
    ]:
        k, n, hid = cs.shape
        d = h.size(-1)
        f32, mm, dev = torch.float32, w_out.dtype, h.device
        grid, fb, kw = _launch(n, d, mm)
        gx = torch.empty(n, d, device=dev, dtype=f32)  # becomes h's gradient through the update
        gv = torch.empty(n, d, device=dev, dtype=f32)
        dc = torch.empty(k, n, hid, device=dev, dtype=f32)  # dc_0 is left to the caller: q holds its partials
        du = torch.empty(k, n, 4 * d, device=dev, dtype=mm)
        xv = torch.empty(k - 1, n, 2 * d, device=dev, dtype=mm)
        pmu = torch.zeros(grid[0], d, device=dev, dtype=f32)
        pka = torch.zeros(grid[0], d, device=dev, dtype=f32)
        qs = [torch.empty(fb, n, hid, device=dev, dtype=f32) for _ in range(2)]
        weights = (w_xv, w_xv.stride(0), w_out, b_out, mu, kappa)
        for it in reversed(range(k)):
            x, v = (h, h) if it == 0 else (xs[it - 1], vs[it - 1])
            qin, qout = qs[(it + 1) % 2], qs[it % 2]
            nxt = min(it + 1, k - 1)
            wrap_triton(_bwd_step)[grid](
                gout, gx, gv, qin, qout, cs[nxt], dc[nxt], cs[it], h, x, v, xv[max(it - 1, 0)] if k > 1 else du,
                du[it], pmu, pka, *weights, n, d, fb, dt,
                H=hid, TOP=it == k - 1, FIRST=it == 0, **kw,
            )  # fmt: skip
        return gx, dc, qs[0], du, xv, pmu, pka


def _setup_context(ctx, inputs, output) -> None:
    h, c_h, c0, w_xv, w_out, b_out, mu, kappa, dt, _k = inputs
    _out, xs, vs, cs = output
    ctx.save_for_backward(h, w_xv, w_out, b_out, mu, kappa, xs, vs, cs)
    ctx.dt, ctx.ch_dtype, ctx.c0_dtype = dt, c_h.dtype, c0.dtype
    ctx.mark_non_differentiable(xs, vs, cs)


def _backward(ctx, gout, _gxs, _gvs, _gcs):
    h, w_xv, w_out, b_out, mu, kappa, xs, vs, cs = ctx.saved_tensors
    dh, dc, q0, du, xv, pmu, pka = torch.ops.gptoughts.inl_integrate_backward(
        gout.contiguous(), h, xs, vs, cs, w_xv, w_out, b_out, mu, kappa, ctx.dt
    )
    k, n, hid = cs.shape
    dc0 = torch.ops.aten.gelu_backward(q0.sum(0), cs[0])
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
        pmu.sum(0).to(mu.dtype),
        pka.sum(0).to(kappa.dtype),
        None,
        None,
    )


if triton is not None:
    _integrate_op.register_autograd(_backward, setup_context=_setup_context)


def integrate(
    h: torch.Tensor,
    w_in: torch.Tensor,
    b_in: torch.Tensor,
    w_out: torch.Tensor,
    b_out: torch.Tensor,
    mu: torch.Tensor,
    kappa: torch.Tensor,
    dt: float,
    n_iterations: int,
) -> torch.Tensor:
    """``x_K`` of the integrator through the kernels (the caller checks :func:`supported`).

    ``c_h = W_h h + b_in`` and the first iteration's ``c_0 = c_h + W_x h`` stay ordinary autograd ops, as in the
    reference; the weights are cast to their dtype (the autocast dtype under autocast), so their gradients reach
    the fp32 parameters through the casts."""
    d = h.size(-1)
    c_h = F.linear(h, w_in[:, :d], b_in)
    c0 = c_h + F.linear(h, w_in[:, d : 2 * d])
    mm = c_h.dtype
    shape = h.shape
    out, *_ = torch.ops.gptoughts.inl_integrate(
        h.reshape(-1, d).contiguous(),
        c_h.reshape(-1, c_h.size(-1)).contiguous(),
        c0.reshape(-1, c0.size(-1)).contiguous(),
        w_in[:, d:].to(mm).contiguous(),
        w_out.to(mm).contiguous(),
        b_out.to(mm),
        mu.contiguous(),
        kappa.contiguous(),
        dt,
        n_iterations,
    )
    return out.view(shape).to(torch.promote_types(h.dtype, mu.dtype))
