"""INL's integrator as two Triton kernels, forward and backward (``integrator_impl = "triton"``).

Each program owns a tile of tokens and walks its K iterations alone, so a tile's state never leaves the
chip's caches between iterations and nothing but the saved state and the weight gradients' operands reaches
memory. The controller's pre-activation is a reduction over all d features while the update is per feature, so
each iteration is one sweep over feature chunks that applies the update with ``g_i = gelu(c_i)`` and at the same
time accumulates the next iteration's ``c_{i+1}`` from the new state (the backward: finishes the state gradients
of iteration ``i`` with ``dc_i`` and runs iteration ``i - 1``'s update backward). Weight gradients are reductions
over all tokens: the backward writes their operands (``du_i``, ``dc_i`` and the bf16 ``[x_i, v_i]``) and one
cuBLAS matmul each reduces them, as inductor does; μ's and κ's come as per-tile sums, deterministic.

The function is :func:`models.inl_fused.integrate`'s, same inputs and saved state (x_i, v_i in fp32, c_i); it
keeps ``c_i`` and the controller's outputs in fp32 where the matmul path rounds them to bf16. It needs Triton
(CUDA wheels), a bf16/fp16 matmul dtype and a power-of-two controller width of 16-256; elsewhere the fused
autograd Function runs (:func:`supported`).
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

TILES = {"BM": 16, "BD": 32, "num_warps": 8, "num_stages": 1}
"""Tokens per program, features per chunk, warps and software-pipelining stages; a benchmark may change them
(bench/inl_step.py --tiles). Compiled for sm_90 these spill least (ptxas -v: none forward, 80 bytes backward)."""


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
    def _fwd_kernel(
        h_ptr, ch_ptr, wxv_ptr, sw, wout_ptr, bout_ptr, mu_ptr, ka_ptr,
        out_ptr, xs_ptr, vs_ptr, cs_ptr,
        N, D, dt,
        H: tl.constexpr, K: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        mm = wout_ptr.dtype.element_ty
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        rmask = rows < N
        r = rows.to(tl.int64)
        hh = tl.arange(0, H)
        nd, nh = N.to(tl.int64) * D, N.to(tl.int64) * H  # one iteration's slice of xs/vs and cs
        ch = tl.load(ch_ptr + r[:, None] * H + hh[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
        c = ch
        for j0 in range(0, D, BD):  # c_0 = c_h + W_x h
            cols = j0 + tl.arange(0, BD)
            cmask = cols < D
            x = tl.load(
                h_ptr + r[:, None] * D + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0
            )
            wx = tl.load(wxv_ptr + hh[:, None] * sw + cols[None, :], mask=cmask[None, :], other=0.0)
            c += _dot(x.to(mm), tl.trans(wx), IEEE)
        for it in tl.static_range(K):
            tl.store(cs_ptr + it * nh + r[:, None] * H + hh[None, :], c, mask=rmask[:, None])
            g = _gelu(c).to(mm)
            c_next = ch
            for j0 in range(0, D, BD):
                cols = j0 + tl.arange(0, BD)
                cmask = cols < D
                m2 = rmask[:, None] & cmask[None, :]
                off = r[:, None] * D + cols[None, :]
                a, b, gl, vc = _controller(g, wout_ptr, bout_ptr, cols, cmask, D, H, IEEE)
                mu = tl.load(mu_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
                ka = tl.load(ka_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
                if it == 0:
                    x = tl.load(h_ptr + off, mask=m2, other=0.0).to(tl.float32)
                else:
                    x = tl.load(xs_ptr + (it - 1) * nd + off, mask=m2, other=0.0)
                    v = tl.load(vs_ptr + (it - 1) * nd + off, mask=m2, other=0.0)
                err = x - mu
                alpha = tl.sigmoid(a) * tl.exp(-ka * tl.abs(err))
                vn = (1.0 - alpha) * vc - _softplus(b) * err
                if it > 0:
                    vn += alpha * v
                xn = x + dt * tl.sigmoid(gl) * vn
                if it < K - 1:
                    tl.store(xs_ptr + it * nd + off, xn, mask=m2)
                    tl.store(vs_ptr + it * nd + off, vn, mask=m2)
                    wx = tl.load(wxv_ptr + hh[:, None] * sw + cols[None, :], mask=cmask[None, :], other=0.0)
                    wv = tl.load(
                        wxv_ptr + hh[:, None] * sw + D + cols[None, :], mask=cmask[None, :], other=0.0
                    )
                    c_next += _dot(xn.to(mm), tl.trans(wx), IEEE) + _dot(vn.to(mm), tl.trans(wv), IEEE)
                else:
                    tl.store(out_ptr + off, xn, mask=m2)
            c = c_next
            tl.debug_barrier()  # the next sweep reads what this one stored

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
    def _bwd_kernel(
        gout_ptr, h_ptr, xs_ptr, vs_ptr, cs_ptr, wxv_ptr, sw, wout_ptr, bout_ptr, mu_ptr, ka_ptr,
        dh_ptr, gx_ptr, gv_ptr, dch_ptr, du_ptr, dc_ptr, xv_ptr, pmu_ptr, pka_ptr,
        N, D, dt,
        H: tl.constexpr, K: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        mm = wout_ptr.dtype.element_ty
        pid = tl.program_id(0)
        rows = pid * BM + tl.arange(0, BM)
        rmask = rows < N
        r = rows.to(tl.int64)
        hh = tl.arange(0, H)
        nd, nh = N.to(tl.int64) * D, N.to(tl.int64) * H  # one iteration's slice of xs/vs, cs and dc
        cmat = r[:, None] * H + hh[None, :]
        dch = tl.zeros([BM, H], dtype=tl.float32)
        dc = tl.zeros([BM, H], dtype=tl.float32)
        # Sweep s (s = K .. 1) finishes the gradients of x_s, v_s with dc_s (none at s = K: x_K's comes in) and
        # runs the update backward of iteration s - 1; a last sweep finishes h's gradient. (What a loop over
        # chunks reads is defined before it, outside any compile-time branch: Triton's scoping asks for it.)
        for t in tl.static_range(K):
            s = K - t
            it = s - 1
            c = tl.load(cs_ptr + it * nh + cmat, mask=rmask[:, None], other=0.0)
            g = _gelu(c).to(mm)
            dcm = dc.to(mm)
            dg = tl.zeros([BM, H], dtype=tl.float32)
            for j0 in range(0, D, BD):
                cols = j0 + tl.arange(0, BD)
                cmask = cols < D
                m2 = rmask[:, None] & cmask[None, :]
                off = r[:, None] * D + cols[None, :]
                if s == K:
                    gx = tl.load(gout_ptr + off, mask=m2, other=0.0).to(tl.float32)
                    gv = gx  # unused: nothing reads v_K
                else:
                    wp = wxv_ptr + hh[:, None] * sw + cols[None, :]
                    gx = tl.load(gx_ptr + off, mask=m2, other=0.0)
                    gx += _dot(dcm, tl.load(wp, mask=cmask[None, :], other=0.0), IEEE)
                    gv = tl.load(gv_ptr + off, mask=m2, other=0.0)
                    gv += _dot(dcm, tl.load(wp + D, mask=cmask[None, :], other=0.0), IEEE)
                if it == 0:
                    x = tl.load(h_ptr + off, mask=m2, other=0.0).to(tl.float32)
                    v = x  # unused: iteration 0 starts from v = 0
                else:
                    x = tl.load(xs_ptr + (it - 1) * nd + off, mask=m2, other=0.0)
                    v = tl.load(vs_ptr + (it - 1) * nd + off, mask=m2, other=0.0)
                gx, gv, dg_j, dmu, dka = _update_backward(
                    g, x, v, gx, gv, wout_ptr, bout_ptr, mu_ptr, ka_ptr, du_ptr + it * 4 * nd,
                    cols, cmask, r, m2, N, D, dt, H, it > 0, s < K, IEEE,
                )  # fmt: skip
                dg += dg_j
                tl.store(gx_ptr + off, gx, mask=m2)
                if it > 0:
                    tl.store(gv_ptr + off, gv, mask=m2)
                    tl.store(xv_ptr + it * 2 * nd + r[:, None] * 2 * D + D + cols[None, :], v.to(mm), mask=m2)
                tl.store(xv_ptr + it * 2 * nd + r[:, None] * 2 * D + cols[None, :], x.to(mm), mask=m2)
                pm = pmu_ptr + pid * D + cols
                pk = pka_ptr + pid * D + cols
                tl.store(pm, tl.load(pm, mask=cmask, other=0.0) + dmu, mask=cmask)
                tl.store(pk, tl.load(pk, mask=cmask, other=0.0) + dka, mask=cmask)
            dc = _gelu_grad(c) * dg
            dch += dc
            tl.store(dc_ptr + it * nh + cmat, dc.to(mm), mask=rmask[:, None])
            tl.debug_barrier()  # the next sweep reads what this one stored
        dcm = dc.to(mm)
        for j0 in range(0, D, BD):  # h's gradient: x_0 = h
            cols = j0 + tl.arange(0, BD)
            cmask = cols < D
            m2 = rmask[:, None] & cmask[None, :]
            off = r[:, None] * D + cols[None, :]
            gx = tl.load(gx_ptr + off, mask=m2, other=0.0)
            gx += _dot(
                dcm, tl.load(wxv_ptr + hh[:, None] * sw + cols[None, :], mask=cmask[None, :], other=0.0), IEEE
            )
            tl.store(dh_ptr + off, gx, mask=m2)
        tl.store(dch_ptr + cmat, dch, mask=rmask[:, None])

    def _launch_args(n: int, mm_dtype: torch.dtype) -> tuple[tuple[int], dict]:
        t = TILES
        kw = dict(BM=t["BM"], BD=t["BD"], num_warps=t["num_warps"], num_stages=t["num_stages"])
        return (triton.cdiv(n, t["BM"]),), dict(IEEE=mm_dtype == torch.float32, **kw)

    @triton_op("gptoughts::inl_integrate", mutates_args=())
    def _integrate_op(
        h: torch.Tensor,
        c_h: torch.Tensor,
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
        f32 = torch.float32
        out = torch.empty(n, d, device=h.device, dtype=f32)
        xs = torch.empty(k - 1, n, d, device=h.device, dtype=f32)
        vs = torch.empty(k - 1, n, d, device=h.device, dtype=f32)
        cs = torch.empty(k, n, hid, device=h.device, dtype=f32)
        grid, kw = _launch_args(n, w_out.dtype)
        wrap_triton(_fwd_kernel)[grid](
            h, c_h, w_xv, w_xv.stride(0), w_out, b_out, mu, kappa, out, xs, vs, cs, n, d, dt, H=hid, K=k, **kw
        )
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
        grid, kw = _launch_args(n, mm)
        dh = torch.empty(n, d, device=dev, dtype=f32)
        gx = torch.empty(n, d, device=dev, dtype=f32)
        gv = torch.empty(n, d, device=dev, dtype=f32)
        dch = torch.empty(n, hid, device=dev, dtype=f32)
        du = torch.empty(k, n, 4 * d, device=dev, dtype=mm)
        dc = torch.empty(k, n, hid, device=dev, dtype=mm)
        xv = torch.zeros(k, n, 2 * d, device=dev, dtype=mm)  # iteration 0's v half stays 0
        pmu = torch.zeros(grid[0], d, device=dev, dtype=f32)
        pka = torch.zeros(grid[0], d, device=dev, dtype=f32)
        wrap_triton(_bwd_kernel)[grid](
            gout, h, xs, vs, cs, w_xv, w_xv.stride(0), w_out, b_out, mu, kappa,
            dh, gx, gv, dch, du, dc, xv, pmu, pka, n, d, dt, H=hid, K=k, **kw,
        )  # fmt: skip
        return dh, dch, du, dc, xv, pmu, pka


def _setup_context(ctx, inputs, output) -> None:
    h, c_h, w_xv, w_out, b_out, mu, kappa, dt, _k = inputs
    _out, xs, vs, cs = output
    ctx.save_for_backward(h, w_xv, w_out, b_out, mu, kappa, xs, vs, cs)
    ctx.dt, ctx.ch_dtype = dt, c_h.dtype
    ctx.mark_non_differentiable(xs, vs, cs)


def _backward(ctx, gout, _gxs, _gvs, _gcs):
    h, w_xv, w_out, b_out, mu, kappa, xs, vs, cs = ctx.saved_tensors
    dh, dch, du, dc, xv, pmu, pka = torch.ops.gptoughts.inl_integrate_backward(
        gout.contiguous(), h, xs, vs, cs, w_xv, w_out, b_out, mu, kappa, ctx.dt
    )
    k, n, hid = cs.shape
    g = F.gelu(cs).to(w_out.dtype).view(k * n, hid)
    dw_out = du.view(k * n, -1).t() @ g  # one reduction over all tokens and iterations
    db_out = du.view(k * n, -1).sum(0, dtype=torch.float32)
    dw_xv = dc.view(k * n, hid).t() @ xv.view(k * n, -1)
    return (
        dh.to(h.dtype),
        dch.to(ctx.ch_dtype),
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
    """``x_K`` of the integrator through the kernels (the caller checks :func:`supported`)."""
    d = h.size(-1)
    c_h = F.linear(h, w_in[:, :d], b_in)
    mm = c_h.dtype
    shape = h.shape
    h2 = h.reshape(-1, d).contiguous()
    out, *_ = torch.ops.gptoughts.inl_integrate(
        h2,
        c_h.reshape(-1, c_h.size(-1)).contiguous(),
        w_in[:, d:].to(mm).contiguous(),
        w_out.to(mm).contiguous(),
        b_out.to(mm),
        mu.contiguous(),
        kappa.contiguous(),
        dt,
        n_iterations,
    )
    return out.view(shape).to(torch.promote_types(h.dtype, mu.dtype))
