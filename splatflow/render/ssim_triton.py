"""The training loss's L1 and SSIM terms in four GPU launches forward and two backward (Triton kernels).

Why: on a GPU the step is launch-bound (docs/backends.md), and the torch SSIM of :mod:`.ssim` is about forty
launches a step (the five moment maps, two convolutions, some twenty element-wise operations, the L1 chain, the
same again backward). The math is that module's, step for step (the 11-tap Gaussian window applied along rows
then columns with zero padding, the analytic backward through the three moment maps that involve the render);
only its grouping changes:

* forward: one pass along rows writes the five row-blurred moment maps; one pass down columns finishes the
  moments, forms SSIM, |x - y| and the three point-wise derivative maps the backward blurs, and leaves one partial
  sum of SSIM and of |x - y| per block (summed by torch: deterministic, no atomics);
* backward: a row pass over the three derivative maps, and a column pass that combines them with the images and
  adds the L1 gradient, scaled by the incoming gradients read on the device (no host sync).

The render gets a gradient, the target none (the training loss's case; :func:`splatflow.render.ssim.l1_ssim`
takes the torch path when the target needs one). Checked against the torch path to 1e-6 under Triton's CPU
interpreter (``TRITON_INTERPRET=1``, ``tests/test_ssim_triton.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .ssim_window import C1, C2, WINDOW, gaussian_window_1d
from .triton_gate import enabled as available  # noqa: F401 (this module's gate)
from .triton_gate import tl, triton

BW = 128  # columns per block
_TAPS: dict = {}  # device -> the window's taps


if triton is not None:
    @triton.jit
    def _rows5(x_ptr, y_ptr, out_ptr, taps_ptr, W, N, R: tl.constexpr, BW: tl.constexpr):
        """Row pass: the five moments' inputs (x, y, x^2, y^2, xy) blurred along rows, zero padded."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BW + tl.arange(0, BW)
        base = row * W
        ax = tl.zeros([BW], dtype=tl.float32)
        ay = tl.zeros([BW], dtype=tl.float32)
        axx = tl.zeros([BW], dtype=tl.float32)
        ayy = tl.zeros([BW], dtype=tl.float32)
        axy = tl.zeros([BW], dtype=tl.float32)
        for k in tl.static_range(2 * R + 1):
            c = cols + (k - R)
            m = (c >= 0) & (c < W)
            xv = tl.load(x_ptr + base + c, mask=m, other=0.0)
            yv = tl.load(y_ptr + base + c, mask=m, other=0.0)
            t = tl.load(taps_ptr + k)
            ax += t * xv
            ay += t * yv
            axx += t * (xv * xv)
            ayy += t * (yv * yv)
            axy += t * (xv * yv)
        om = cols < W
        tl.store(out_ptr + base + cols, ax, mask=om)
        tl.store(out_ptr + N + base + cols, ay, mask=om)
        tl.store(out_ptr + 2 * N + base + cols, axx, mask=om)
        tl.store(out_ptr + 3 * N + base + cols, ayy, mask=om)
        tl.store(out_ptr + 4 * N + base + cols, axy, mask=om)

    @triton.jit
    def _cols_ssim(h_ptr, x_ptr, y_ptr, d_ptr, part_ptr, taps_ptr, H, W, N, n_cb, C1, C2,
                   R: tl.constexpr, BW: tl.constexpr):
        """Column pass: the moments, SSIM, |x - y|, the derivative maps and this block's two partial sums."""
        row = tl.program_id(0).to(tl.int64)
        cb = tl.program_id(1)
        plane = row // H
        h = row % H
        cols = cb * BW + tl.arange(0, BW)
        om = cols < W
        hb = tl.zeros([BW], dtype=tl.int64) + h
        mx = tl.zeros([BW], dtype=tl.float32)
        my = tl.zeros([BW], dtype=tl.float32)
        exx = tl.zeros([BW], dtype=tl.float32)
        eyy = tl.zeros([BW], dtype=tl.float32)
        exy = tl.zeros([BW], dtype=tl.float32)
        for k in tl.static_range(2 * R + 1):
            hh = hb + (k - R)  # a block, not a scalar: Triton's interpreter rejects a scalar-and-block mask
            m = om & (hh >= 0) & (hh < H)
            off = (plane * H + hh) * W + cols
            t = tl.load(taps_ptr + k)
            mx += t * tl.load(h_ptr + off, mask=m, other=0.0)
            my += t * tl.load(h_ptr + N + off, mask=m, other=0.0)
            exx += t * tl.load(h_ptr + 2 * N + off, mask=m, other=0.0)
            eyy += t * tl.load(h_ptr + 3 * N + off, mask=m, other=0.0)
            exy += t * tl.load(h_ptr + 4 * N + off, mask=m, other=0.0)
        A1 = 2.0 * mx * my + C1
        A2 = 2.0 * (exy - mx * my) + C2
        B1 = mx * mx + my * my + C1
        B2 = (exx - mx * mx) + (eyy - my * my) + C2
        S = A1 * A2 / (B1 * B2)
        inv_D = 1.0 / (B1 * B2)
        s_b2 = S / B2
        s_b1 = S / B1
        here = row * W + cols
        # dS/dmu_x, dS/dE[x^2], dS/dE[xy] per pixel (the scale 1/numel and the incoming gradient come later)
        tl.store(d_ptr + here, 2.0 * my * (A2 - A1) * inv_D + 2.0 * mx * (s_b2 - s_b1), mask=om)
        tl.store(d_ptr + N + here, -s_b2, mask=om)
        tl.store(d_ptr + 2 * N + here, 2.0 * A1 * inv_D, mask=om)
        xv = tl.load(x_ptr + here, mask=om, other=0.0)
        yv = tl.load(y_ptr + here, mask=om, other=0.0)
        pid = row * n_cb + cb
        tl.store(part_ptr + 2 * pid, tl.sum(tl.where(om, S, 0.0), axis=0))
        tl.store(part_ptr + 2 * pid + 1, tl.sum(tl.where(om, tl.abs(xv - yv), 0.0), axis=0))

    @triton.jit
    def _rows3(d_ptr, out_ptr, taps_ptr, W, N, R: tl.constexpr, BW: tl.constexpr):
        """Backward row pass over the three derivative maps (the symmetric zero-padded window is its own adjoint)."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BW + tl.arange(0, BW)
        base = row * W
        a0 = tl.zeros([BW], dtype=tl.float32)
        a1 = tl.zeros([BW], dtype=tl.float32)
        a2 = tl.zeros([BW], dtype=tl.float32)
        for k in tl.static_range(2 * R + 1):
            c = cols + (k - R)
            m = (c >= 0) & (c < W)
            t = tl.load(taps_ptr + k)
            a0 += t * tl.load(d_ptr + base + c, mask=m, other=0.0)
            a1 += t * tl.load(d_ptr + N + base + c, mask=m, other=0.0)
            a2 += t * tl.load(d_ptr + 2 * N + base + c, mask=m, other=0.0)
        om = cols < W
        tl.store(out_ptr + base + cols, a0, mask=om)
        tl.store(out_ptr + N + base + cols, a1, mask=om)
        tl.store(out_ptr + 2 * N + base + cols, a2, mask=om)

    @triton.jit
    def _cols_grad(h_ptr, x_ptr, y_ptr, gx_ptr, gs_ptr, gl_ptr, inv_n, taps_ptr, H, W, N,
                   R: tl.constexpr, BW: tl.constexpr):
        """Backward column pass: ``dL/dx = gs (G*dmu_x + 2 x G*dE[x^2] + y G*dE[xy]) / n + gl sign(x - y) / n``."""
        row = tl.program_id(0).to(tl.int64)
        plane = row // H
        h = row % H
        cols = tl.program_id(1) * BW + tl.arange(0, BW)
        om = cols < W
        hb = tl.zeros([BW], dtype=tl.int64) + h
        b0 = tl.zeros([BW], dtype=tl.float32)
        b1 = tl.zeros([BW], dtype=tl.float32)
        b2 = tl.zeros([BW], dtype=tl.float32)
        for k in tl.static_range(2 * R + 1):
            hh = hb + (k - R)  # a block, not a scalar: Triton's interpreter rejects a scalar-and-block mask
            m = om & (hh >= 0) & (hh < H)
            off = (plane * H + hh) * W + cols
            t = tl.load(taps_ptr + k)
            b0 += t * tl.load(h_ptr + off, mask=m, other=0.0)
            b1 += t * tl.load(h_ptr + N + off, mask=m, other=0.0)
            b2 += t * tl.load(h_ptr + 2 * N + off, mask=m, other=0.0)
        here = row * W + cols
        xv = tl.load(x_ptr + here, mask=om, other=0.0)
        yv = tl.load(y_ptr + here, mask=om, other=0.0)
        gs = tl.load(gs_ptr) * inv_n
        gl = tl.load(gl_ptr) * inv_n
        d = xv - yv
        sgn = tl.where(d > 0, 1.0, tl.where(d < 0, -1.0, 0.0))
        tl.store(gx_ptr + here, gs * (b0 + 2.0 * xv * b1 + yv * b2) + gl * sgn, mask=om)


def _launch_grid(P: int, H: int, W: int) -> tuple[int, int]:
    return (P * H, triton.cdiv(W, BW))


class _FusedL1SSIM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, y: Tensor):
        B, C, H, W = x.shape
        P, N = B * C, x.numel()
        taps = _TAPS.get(x.device)  # [11], the torch path's own taps, made once per device (five launches)
        if taps is None:
            taps = _TAPS[x.device] = gaussian_window_1d(dtype=torch.float32, device=x.device)
        R = WINDOW // 2
        grid = _launch_grid(P, H, W)
        rows = torch.empty(5, N, dtype=torch.float32, device=x.device)
        _rows5[grid](x, y, rows, taps, W, N, R=R, BW=BW)
        dmaps = torch.empty(3, N, dtype=torch.float32, device=x.device)
        part = torch.empty(grid[0] * grid[1], 2, dtype=torch.float32, device=x.device)
        _cols_ssim[grid](rows, x, y, dmaps, part, taps, H, W, N, grid[1], C1, C2, R=R, BW=BW)
        sums = part.sum(0) / N  # [2]: mean SSIM, mean |x - y|
        ctx.save_for_backward(x, y, dmaps, taps)
        ctx.shape = (P, H, W, N, R)
        return sums[1], sums[0]

    @staticmethod
    def backward(ctx, g_l1: Tensor | None, g_s: Tensor | None):
        x, y, dmaps, taps = ctx.saved_tensors
        P, H, W, N, R = ctx.shape
        def flat(g):  # an unused output's gradient comes as None
            return torch.zeros((), dtype=torch.float32, device=x.device) if g is None \
                else g.to(torch.float32).reshape(())

        g_l1, g_s = flat(g_l1), flat(g_s)
        grid = _launch_grid(P, H, W)
        rows = torch.empty(3, N, dtype=torch.float32, device=x.device)
        _rows3[grid](dmaps, rows, taps, W, N, R=R, BW=BW)
        gx = torch.empty_like(x)
        _cols_grad[grid](rows, x, y, gx, g_s, g_l1, 1.0 / N, taps, H, W, N, R=R, BW=BW)
        return gx, None


def fused_l1_ssim(x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    """``(mean |x - y|, mean SSIM)`` of ``[B, C, H, W]`` float32 images on a device :func:`available` accepts;
    differentiable in ``x`` only (``y`` is the target)."""
    return _FusedL1SSIM.apply(x.contiguous(), y.detach().contiguous())
