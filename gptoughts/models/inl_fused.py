"""INL's integrator loop as one autograd Function with a hand-written backward (``integrator_impl = "fused"``).

Autograd on the reference loop saves about ten ``[N, d]`` tensors per iteration (every element-wise operand).
This Function saves per iteration only the state entering it, ``x_i`` and ``v_i`` (in the state dtype, fp32
under bf16 autocast; ``x_0 = h`` and ``v_0 = 0`` are not stored again), and the controller's pre-activation
``c_i`` (``[N, H]``, H = 64). The backward recomputes ``u_i = W_out gelu(c_i) + b_out`` (one narrow matmul) and
the update's element-wise values from them, then walks the K iterations in reverse, accumulating the weight
gradients in fp32.

The element-wise parts are plain torch functions (:func:`update` and :func:`update_backward`): inside a compiled
block, dynamo traces the Function's forward and backward and inductor fuses each of them into a few kernels.
Matmuls run in the dtype of ``c_h`` (the autocast dtype under autocast, else the weights'), as the reference's;
the update in the promotion of ``h`` and ``μ`` (fp32 under autocast, where the reference rounds sigmoid and
softplus of its bf16 logits to bf16): equal in fp32, within bf16's error under autocast (tests/models/
test_inl_fused.py). The backward's copies of the saved state (see below) cost one read and write of them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["integrate", "update", "update_backward"]


# Inside a compiled block, dynamo traces the Function's backward into one graph with the forward, and the
# partitioner then computes in the forward whatever of the backward does not depend on the incoming gradient, and
# saves it: the recomputed u_i = W_out gelu(c_i) + b_out (4d wide; matmuls are never recomputed), the bf16 copy of
# [x_i, v_i], x_i - μ and exp(-κ|x_i - μ|) (measured with the aot_eager_decomp_partition backend). Passing the
# saved values through an op that the compiler cannot see through and that takes the gradient as an input keeps
# the backward's work in the backward and the saved set to this Function's.


@torch.library.custom_op("gptoughts::inl_fresh_copies", mutates_args=())
def _fresh_copies(ts: list[torch.Tensor], after: torch.Tensor) -> list[torch.Tensor]:
    """Copies of ``ts``, ordered after ``after`` (clones the compiler would remove as no-ops)."""
    return [t.clone() for t in ts]


@_fresh_copies.register_fake
def _(ts: list[torch.Tensor], after: torch.Tensor) -> list[torch.Tensor]:
    return [torch.empty_like(t) for t in ts]


def update(
    u: torch.Tensor, x: torch.Tensor, v: torch.Tensor | None, mu: torch.Tensor, kappa: torch.Tensor, dt: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One iteration's state update from the controller's output ``u = [α̃, β̃, g̃, v_cand]``; ``v = None`` is 0."""
    a_logit, b_pre, g_logit, v_cand = u.to(torch.promote_types(x.dtype, mu.dtype)).chunk(4, dim=-1)
    err = x - mu
    alpha = torch.sigmoid(a_logit) * torch.exp(-kappa * err.abs())
    v_new = (1 - alpha) * v_cand - F.softplus(b_pre) * err
    if v is not None:
        v_new = v_new + alpha * v
    return x + dt * torch.sigmoid(g_logit) * v_new, v_new


def update_backward(
    u: torch.Tensor,
    x: torch.Tensor,
    v: torch.Tensor | None,
    mu: torch.Tensor,
    kappa: torch.Tensor,
    dt: float,
    gx: torch.Tensor,
    gv: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Gradients through :func:`update` given those of its outputs (``gv = None`` is 0): ``(du, dx, dv, dμ, dκ)``,
    ``du`` in ``u``'s dtype, ``dx``/``dv`` in the state dtype, ``dμ``/``dκ`` summed over tokens in fp32 (or wider)."""
    a_logit, b_pre, g_logit, v_cand = u.to(gx.dtype).chunk(4, dim=-1)
    err = x - mu
    s_a = torch.sigmoid(a_logit)
    alpha = s_a * torch.exp(-kappa * err.abs())
    beta = F.softplus(b_pre)
    v_new = (1 - alpha) * v_cand - beta * err
    if v is not None:
        v_new = v_new + alpha * v
    s_g = torch.sigmoid(g_logit)
    # x_next = x + dt·s_g·v_new: v_new reaches the loss directly and through x_next.
    g_vnew = gx * (dt * s_g) if gv is None else gv + gx * (dt * s_g)
    d_gate = gx * dt * v_new * s_g * (1 - s_g)
    d_alpha = g_vnew * (-v_cand if v is None else v - v_cand)
    d_alpha_damp = d_alpha * alpha  # ∂α/∂(-κ|err|) = α
    d_a = d_alpha_damp * (1 - s_a)  # ∂α/∂α̃ = α (1 - s_a)
    d_b = -g_vnew * err * torch.sigmoid(b_pre)
    d_vcand = g_vnew * (1 - alpha)
    d_err = -g_vnew * beta - d_alpha_damp * kappa * torch.sign(err)
    du = torch.cat([d_a, d_b, d_gate, d_vcand], dim=-1).to(u.dtype)
    dv = None if v is None else g_vnew * alpha
    flat, acc = (-1, x.size(-1)), torch.promote_types(gx.dtype, torch.float32)
    d_mu = -d_err.reshape(flat).sum(0, dtype=acc)
    d_kappa = -(d_alpha_damp * err.abs()).reshape(flat).sum(0, dtype=acc)
    return du, gx + d_err, dv, d_mu, d_kappa


def _xv(x: torch.Tensor, v: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The controller's ``[x, v]`` input in the matmul dtype (``x`` alone while ``v = 0``)."""
    return (x if v is None else torch.cat([x, v], dim=-1)).to(dtype)


def _controller_out(c: torch.Tensor, w_out: torch.Tensor, b_out: torch.Tensor) -> torch.Tensor:
    return F.linear(F.gelu(c), w_out, b_out)


class _IntegratorLoop(torch.autograd.Function):
    """``x_K`` from ``c_h = W_h h + b_in``, ``h`` and the controller's weights (already in the matmul dtype)."""

    @staticmethod
    def forward(ctx, c_h, h, w_xv, w_out, b_out, mu, kappa, dt: float, n_iterations: int):
        d = h.size(-1)
        x, v = h, None  # the first update promotes x to the state dtype
        xs, vs, cs = [], [], []
        for _ in range(n_iterations):
            w = w_xv if v is not None else w_xv[:, :d]
            c = c_h + F.linear(_xv(x, v, c_h.dtype), w)
            if v is not None:  # x_0 = h and v_0 = 0 are known: not stored again
                xs.append(x)
                vs.append(v)
            cs.append(c)
            x, v = update(_controller_out(c, w_out, b_out), x, v, mu, kappa, dt)
        ctx.save_for_backward(h, w_xv, w_out, b_out, mu, kappa, *xs, *vs, *cs)
        ctx.dt, ctx.n_iterations = dt, n_iterations
        return x

    @staticmethod
    def backward(ctx, gx):
        k = ctx.n_iterations
        h, w_xv, w_out, b_out, mu, kappa, *rest = ctx.saved_tensors
        xs = [h, *rest[: k - 1]]
        vs = [None, *rest[k - 1 : 2 * (k - 1)]]
        cs = rest[2 * (k - 1) :]
        d, f32 = h.size(-1), torch.float32
        dw_xv = torch.zeros(w_xv.shape, dtype=f32, device=h.device)
        dw_out = torch.zeros(w_out.shape, dtype=f32, device=h.device)
        db_out = torch.zeros(b_out.shape, dtype=f32, device=h.device)
        d_mu = torch.zeros(mu.shape, dtype=f32, device=h.device)
        d_kappa = torch.zeros(kappa.shape, dtype=f32, device=h.device)
        dc_h = torch.zeros(cs[0].shape, dtype=f32, device=h.device)
        gv = None
        for i in reversed(range(k)):
            if i:
                x, v, c = _fresh_copies([xs[i], vs[i], cs[i]], gx)
            else:
                (x, c), v = _fresh_copies([xs[i], cs[i]], gx), None
            g = F.gelu(c)  # recomputed: c is [N, H], g and u are not kept
            u = F.linear(g, w_out, b_out)
            du, gx, gv, dmu_i, dk_i = update_backward(u, x, v, mu, kappa, ctx.dt, gx, gv)
            d_mu += dmu_i
            d_kappa += dk_i
            du2, g2 = du.reshape(-1, du.size(-1)), g.reshape(-1, g.size(-1))
            dw_out += (du2.t() @ g2).to(f32)
            db_out += du2.sum(0, dtype=f32)
            dc = torch.ops.aten.gelu_backward(du @ w_out, c)
            dc_h += dc
            xv = _xv(x, v, c.dtype)
            cols = xv.size(-1)
            dw_xv[:, :cols] += (dc.reshape(-1, dc.size(-1)).t() @ xv.reshape(-1, cols)).to(f32)
            dxv = (dc @ w_xv[:, :cols]).to(gx.dtype)
            gx = gx + dxv[..., :d]
            if gv is not None:
                gv = gv + dxv[..., d:]
        return (
            dc_h.to(cs[0].dtype),
            gx.to(h.dtype),
            dw_xv.to(w_xv.dtype),
            dw_out.to(w_out.dtype),
            db_out.to(b_out.dtype),
            d_mu.to(mu.dtype),
            d_kappa.to(kappa.dtype),
            None,
            None,
        )


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
    """``x_K`` of the integrator (``Integrator.forward``'s function) through :class:`_IntegratorLoop`, given
    ``c_h = W_h h + b_in`` (an ordinary autograd op, in the controller's matmul dtype) and ``W_in``'s x and v
    columns. The weights are cast to that dtype here, so their gradients reach the fp32 parameters through the
    casts, as under autocast."""
    mm = c_h.dtype
    return _IntegratorLoop.apply(c_h, h, w_xv.to(mm), w_out.to(mm), b_out.to(mm), mu, kappa, dt, n_iterations)
