"""numba kernels for separable image filters on CPU: the SSIM window (with SSIM's point-wise terms fused in) and
the training blur.

Why here and not ``torch.conv2d``: the speed of torch's CPU convolution depends on the build and the processor
(a depthwise 1-D convolution took 4x the rasterizer's time on one machine and a fraction on another). These loops
are plain multiply-adds over contiguous rows, which LLVM vectorises the same way everywhere.

Representation of a 1-D filter along an axis of length ``n``: a banded matrix ``M [n, n]`` (``out = M @ in``)
stored as ``band [n, L]`` and ``start [n]`` with ``out[j] = sum_k band[j, k] * in[start[j] + k]``. Zero padding
and reflect padding both fit (built in :mod:`.filters`), and so do their transposes (the backward passes), with
the same ``start``. Rows ``lo <= j < hi`` are the plain stencil (``start[j] = j - (L - 1) // 2``, taps equal to
``band[lo]``); they take the vectorised path, the few rows near the borders the general one.

Images are ``[P, H, W]`` planes (batch x channels flattened), float32 or float64 (one compiled specialisation
each). Both passes run in parallel over the ``P * H`` rows; every row writes only its own output row, so the
loops are race free. The point-wise SSIM terms are evaluated in float64 whatever the storage type.
"""

from __future__ import annotations

import numba as nb
import numpy as np


@nb.njit(cache=True, fastmath=True)
def _row_filter(src, dst, band, start, lo, hi):
    """``dst = M @ src`` for one row (1-D arrays of length n) with the banded ``M`` described above.

    The stencil rows index slices with loop counters from ``range`` only: an index with a possibly negative
    offset makes numba check for wrap-around on every access, which stops LLVM vectorising the loop (measured
    13x slower)."""
    n = dst.shape[0]
    L = band.shape[1]
    if hi <= lo:
        lo = hi = n
    for j in range(lo):
        _band_row(src, dst, band, start, j, L)
    for j in range(hi, n):
        _band_row(src, dst, band, start, j, L)
    m = hi - lo
    if m > 0:
        out = dst[lo:hi]
        for j in range(m):
            out[j] = 0.0
        s0 = start[lo]
        for k in range(L):
            w = band[lo, k]
            inp = src[s0 + k:s0 + k + m]
            for j in range(m):
                out[j] += w * inp[j]


@nb.njit(cache=True, inline="always")
def _band_row(src, dst, band, start, j, L):
    acc = 0.0
    inp = src[start[j]:start[j] + L]
    for k in range(L):
        acc += band[j, k] * inp[k]
    dst[j] = acc


@nb.njit(parallel=True, cache=True, fastmath=True)
def ssim_forward(x, y, bw, sw, lw, hw, bh, sh, need_grad):
    """SSIM of two ``[P, H, W]`` stacks with the separable window ``(bh, sh)`` (rows) x ``(bw, sw)`` (columns).

    Returns ``(row_sums [P * H] float64, dmaps)``: the per-row sums of the SSIM map, and with ``need_grad`` the
    derivatives of ``sum(S)`` w.r.t. the four moment maps that the inputs enter, ``dmaps [4, P, H, W]`` =
    (dS/dmu_x, dS/dmu_y, dS/dE[x^2] (= dS/dE[y^2]), dS/dE[xy]), to be blurred again in :func:`ssim_backward`.
    """
    P, H, W = x.shape
    C1 = 0.01 ** 2
    C2 = 0.03 ** 2
    tmp = np.empty((5, P, H, W), dtype=x.dtype)  # horizontally filtered x, y, x^2, y^2, xy
    for t in nb.prange(P * H):
        p = t // H
        i = t - p * H
        xr = x[p, i]
        yr = y[p, i]
        prod = np.empty((3, W), dtype=x.dtype)
        for j in range(W):
            prod[0, j] = xr[j] * xr[j]
            prod[1, j] = yr[j] * yr[j]
            prod[2, j] = xr[j] * yr[j]
        _row_filter(xr, tmp[0, p, i], bw, sw, lw, hw)
        _row_filter(yr, tmp[1, p, i], bw, sw, lw, hw)
        _row_filter(prod[0], tmp[2, p, i], bw, sw, lw, hw)
        _row_filter(prod[1], tmp[3, p, i], bw, sw, lw, hw)
        _row_filter(prod[2], tmp[4, p, i], bw, sw, lw, hw)
    row_sums = np.zeros(P * H, dtype=np.float64)
    dmaps = np.empty((4, P, H, W) if need_grad else (4, 0, 0, 0), dtype=x.dtype)
    L = bh.shape[1]
    for t in nb.prange(P * H):
        p = t // H
        i = t - p * H
        acc = np.zeros((5, W), dtype=x.dtype)
        s = sh[i]
        for k in range(L):
            w = bh[i, k]
            for c in range(5):
                src = tmp[c, p, s + k]
                dst = acc[c]
                for j in range(W):
                    dst[j] += w * src[j]
        total = 0.0
        for j in range(W):
            mx = np.float64(acc[0, j])
            my = np.float64(acc[1, j])
            mxy = mx * my
            a1 = 2.0 * mxy + C1
            a2 = 2.0 * (np.float64(acc[4, j]) - mxy) + C2
            b1 = mx * mx + my * my + C1
            b2 = (np.float64(acc[2, j]) - mx * mx) + (np.float64(acc[3, j]) - my * my) + C2
            inv_d = 1.0 / (b1 * b2)
            sv = a1 * a2 * inv_d
            total += sv
            if need_grad:
                s_b2 = sv / b2
                diff = s_b2 - sv / b1
                q = 2.0 * (a2 - a1) * inv_d
                dmaps[0, p, i, j] = q * my + 2.0 * mx * diff
                dmaps[1, p, i, j] = q * mx + 2.0 * my * diff
                dmaps[2, p, i, j] = -s_b2
                dmaps[3, p, i, j] = 2.0 * a1 * inv_d
        row_sums[t] = total
    return row_sums, dmaps


@nb.njit(parallel=True, cache=True, fastmath=True)
def ssim_backward(x, y, dmaps, scale, bw, sw, lw, hw, bh, sh, want_x, want_y):
    """Gradients of ``scale * sum(S)`` w.r.t. ``x`` and ``y`` ``[P, H, W]`` (empty arrays for the ones not
    wanted), from :func:`ssim_forward`'s ``dmaps``.

    The moments are ``G * x``, ``G * y``, ``G * x^2``, ``G * y^2``, ``G * (x y)`` with ``G`` the window filter, so
    ``dL/dx = G^T dmu_x + 2 x G^T dE[x^2] + y G^T dE[xy]`` (and symmetrically for y); the zero-padded symmetric
    window is its own transpose, so ``G^T = G`` and the same bands serve.
    """
    P, H, W = x.shape
    # maps to filter: 0 = dmu_x, 1 = dmu_y, 2 = dE[x^2] (= dE[y^2]), 3 = dE[xy]
    use = np.array([want_x, want_y, True, True])
    tmp = np.empty((4, P, H, W), dtype=x.dtype)
    for t in nb.prange(P * H):
        p = t // H
        i = t - p * H
        for c in range(4):
            if use[c]:
                _row_filter(dmaps[c, p, i], tmp[c, p, i], bw, sw, lw, hw)
    gx = np.empty((P, H, W) if want_x else (0, 0, 0), dtype=x.dtype)
    gy = np.empty((P, H, W) if want_y else (0, 0, 0), dtype=x.dtype)
    L = bh.shape[1]
    for t in nb.prange(P * H):
        p = t // H
        i = t - p * H
        acc = np.zeros((4, W), dtype=x.dtype)
        s = sh[i]
        for k in range(L):
            w = bh[i, k]
            for c in range(4):
                if use[c]:
                    src = tmp[c, p, s + k]
                    dst = acc[c]
                    for j in range(W):
                        dst[j] += w * src[j]
        if want_x:
            for j in range(W):
                gx[p, i, j] = scale * (acc[0, j] + 2.0 * x[p, i, j] * acc[2, j] + y[p, i, j] * acc[3, j])
        if want_y:
            for j in range(W):
                gy[p, i, j] = scale * (acc[1, j] + 2.0 * y[p, i, j] * acc[2, j] + x[p, i, j] * acc[3, j])
    return gx, gy


@nb.njit(parallel=True, cache=True, fastmath=True)
def separable_filter(src, bw, sw, lw, hw, bh, sh):
    """``out[p] = Mh @ src[p] @ Mw^T`` for every plane of ``src [P, H, W]``: the columns filter ``(bw, sw)``
    along each row, then the rows filter ``(bh, sh)`` down each column. With the transposed bands this is the
    backward of the same filter (the two axes commute)."""
    P, H, W = src.shape
    tmp = np.empty((P, H, W), dtype=src.dtype)
    for t in nb.prange(P * H):
        p = t // H
        i = t - p * H
        _row_filter(src[p, i], tmp[p, i], bw, sw, lw, hw)
    out = np.empty((P, H, W), dtype=src.dtype)
    L = bh.shape[1]
    for t in nb.prange(P * H):
        p = t // H
        i = t - p * H
        dst = out[p, i]
        dst[:] = 0.0
        s = sh[i]
        for k in range(L):
            w = bh[i, k]
            row = tmp[p, s + k]
            for j in range(W):
                dst[j] += w * row[j]
    return out
