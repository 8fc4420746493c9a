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
each). Each kernel is one parallel loop over chunks of rows of one plane; a chunk reads its rows plus the filter's
reach, keeps the intermediate rows in its own local buffers and writes only its own output rows, so the loops are
race free.
"""

from __future__ import annotations

import numba as nb
import numpy as np


@nb.njit(cache=True)
def build_band(n, taps, reflect, transpose):
    """The band ``(band [n, L] float64, start [n], lo, hi)`` of the filter ``taps`` (odd length ``2r + 1``) along
    an axis of length ``n`` with zero (``reflect`` False) or reflect padding, or of its transpose (see
    :func:`splatflow.render.filters.band_matrix`). Built here rather than with numpy because the training blur's
    sigma changes every step (numpy took ~0.25 ms per band, mostly call overhead)."""
    L0 = taps.shape[0]
    r = (L0 - 1) // 2
    L = min(L0, n)
    start = np.empty(n, dtype=np.int64)
    for j in range(n):
        start[j] = min(max(j - r, 0), n - L)
    band = np.zeros((n, L), dtype=np.float64)
    for j in range(n):
        for k in range(L0):
            c = j + k - r
            if reflect:
                if c < 0:
                    c = -c
                if c > n - 1:
                    c = 2 * (n - 1) - c
            elif c < 0 or c >= n:
                continue
            row, col = (c, j) if transpose else (j, c)
            pos = col - start[row]
            if pos < 0 or pos >= L:
                raise ValueError("filter band too narrow (radius larger than the image side?)")
            band[row, pos] += taps[k]
    lo = hi = 0
    if L == L0:
        first = -1
        last = -1
        for j in range(n):
            plain = start[j] == j - r
            if plain:
                for k in range(L):
                    if band[j, k] != taps[k]:
                        plain = False
                        break
            if plain:
                if first < 0:
                    first = j
                last = j
            elif first >= 0 and last == j - 1:
                break  # the plain rows are one run; a non-plain row after it ends the run
        if first >= 0:
            lo, hi = first, last + 1
    return band, start, lo, hi


@nb.njit(cache=True, fastmath=True)
def _hconv(inp, out, w, m, L):
    """``out[j] = sum_k w[k] inp[j + k]`` for ``j < m``. Called with a literal ``L`` (see :func:`_hconv_n`), the
    tap loop is unrolled and the outer loop vectorised; indices are plain ``range`` counters, since an index with
    a possibly negative offset makes numba test for wrap-around on every access and stops vectorisation."""
    for j in range(m):
        acc = w[0] * inp[j]
        for k in range(1, L):
            acc += w[k] * inp[j + k]
        out[j] = acc


@nb.njit(cache=True, fastmath=True)
def _vconv(blk, out, w, m, L):
    """``out[j] = sum_k w[k] blk[k, j]`` for ``j < m`` (rows ``blk[k]`` of one column block)."""
    for j in range(m):
        acc = w[0] * blk[0, j]
        for k in range(1, L):
            acc += w[k] * blk[k, j]
        out[j] = acc


@nb.njit(cache=True, fastmath=True)
def _hconv_n(inp, out, w, m, L):
    # one unrolled copy per common filter length (SSIM: 11; training blur up to sigma 2.67 px: 3..17), measured
    # 5x faster than a loop over a run-time length
    if L == 11:
        _hconv(inp, out, w, m, 11)
    elif L == 3:
        _hconv(inp, out, w, m, 3)
    elif L == 5:
        _hconv(inp, out, w, m, 5)
    elif L == 7:
        _hconv(inp, out, w, m, 7)
    elif L == 9:
        _hconv(inp, out, w, m, 9)
    elif L == 13:
        _hconv(inp, out, w, m, 13)
    elif L == 15:
        _hconv(inp, out, w, m, 15)
    elif L == 17:
        _hconv(inp, out, w, m, 17)
    else:
        _hconv(inp, out, w, m, L)


@nb.njit(cache=True, fastmath=True)
def _vconv_n(blk, out, w, m, L):
    if L == 11:
        _vconv(blk, out, w, m, 11)
    elif L == 3:
        _vconv(blk, out, w, m, 3)
    elif L == 5:
        _vconv(blk, out, w, m, 5)
    elif L == 7:
        _vconv(blk, out, w, m, 7)
    elif L == 9:
        _vconv(blk, out, w, m, 9)
    elif L == 13:
        _vconv(blk, out, w, m, 13)
    elif L == 15:
        _vconv(blk, out, w, m, 15)
    elif L == 17:
        _vconv(blk, out, w, m, 17)
    else:
        _vconv(blk, out, w, m, L)


@nb.njit(cache=True, fastmath=True)
def _row_filter(src, dst, band, start, lo, hi):
    """``dst = M @ src`` for one row (1-D arrays of length n) with the banded ``M`` described above."""
    n = dst.shape[0]
    L = band.shape[1]
    if hi <= lo:
        lo = hi = n
    for j in range(lo):
        _band_row(src, dst, band, start, j, L)
    for j in range(hi, n):
        _band_row(src, dst, band, start, j, L)
    if hi > lo:
        _hconv_n(src[start[lo]:], dst[lo:hi], band[lo], hi - lo, L)


@nb.njit(cache=True)
def _band_row(src, dst, band, start, j, L):
    acc = 0.0
    inp = src[start[j]:start[j] + L]
    for k in range(L):
        acc += band[j, k] * inp[k]
    dst[j] = acc


@nb.njit(cache=True, fastmath=True)
def _col_filter(buf, row0, dst, band, start, i):
    """Row ``i`` of ``M @ rows`` where ``buf[r - row0]`` holds row ``r`` (only the rows that row ``i`` reads)."""
    L = band.shape[1]
    s = start[i] - row0
    _vconv_n(buf[s:s + L], dst, band[i], dst.shape[0], L)


@nb.njit(parallel=True, cache=True, fastmath=True)
def ssim_fused(x, y, bw, sw, lw, hw, bh, sh, want_x, want_y, chunk):
    """SSIM of two ``[P, H, W]`` stacks, and the gradients of the SUM of its map w.r.t. ``x`` / ``y`` (those
    wanted), with the separable window ``(bh, sh)`` (rows) x ``(bw, sw)`` (columns).

    Returns ``(row_sums [P * H] float64, l1_rows [P * H] float64, gx, gy)``: per-row sums of the SSIM map and of
``|x - y|`` (the L1 term of the training loss, for free while the rows are in cache), and the gradients
(empty when not wanted). With ``S`` the map,
    the moments are ``G x``, ``G y``, ``G x^2``, ``G y^2``, ``G (x y)`` (``G`` the window filter), and
    ``d sum(S) / dx = G^T dmu_x + 2 x G^T dE[x^2] + y G^T dE[xy]`` (symmetrically for y; ``dS/dE[x^2] =
    dS/dE[y^2]``); the zero-padded symmetric window is its own transpose, so the same bands filter the
    point-wise derivatives.

    Work is split into chunks of ``chunk`` rows of one plane, in parallel. A chunk keeps everything it needs in
    small local buffers that stay in cache: the column-filtered moments of its rows plus a margin of twice the
    window radius, the derivative maps of its rows plus one radius, then its gradient rows. Nothing else is
    written to memory (the margins are recomputed by the neighbouring chunk: ~30% more filtering at 48 rows,
    much less than a round trip of the intermediate images through main memory).
    """
    P, H, W = x.shape
    L = bh.shape[1]
    C1 = 0.01 ** 2
    C2 = 0.03 ** 2
    two = np.array([2.0], dtype=x.dtype)[0]  # typed: the gradient rows stay in the storage type
    need = want_x or want_y
    nc = (H + chunk - 1) // chunk
    row_sums = np.zeros(P * H, dtype=np.float64)
    l1_rows = np.zeros(P * H, dtype=np.float64)
    gx = np.empty((P, H, W) if want_x else (0, 0, 0), dtype=x.dtype)
    gy = np.empty((P, H, W) if want_y else (0, 0, 0), dtype=x.dtype)
    for t in nb.prange(P * nc):
        p = t // nc
        r0 = (t - p * nc) * chunk
        r1 = min(H, r0 + chunk)
        d0, d1 = r0, r1  # rows whose point-wise terms are needed
        if need:
            d0, d1 = sh[r0], sh[r1 - 1] + L
        m0, m1 = sh[d0], sh[d1 - 1] + L  # rows whose moments are needed
        hm = np.empty((5, m1 - m0, W), dtype=x.dtype)  # column-filtered x, y, x^2, y^2, xy
        prod = np.empty((3, W), dtype=x.dtype)
        for m in range(m0, m1):
            xr = x[p, m]
            yr = y[p, m]
            if r0 <= m < r1:
                a = 0.0
                for j in range(W):
                    a += abs(xr[j] - yr[j])
                l1_rows[p * H + m] = a
            for j in range(W):
                prod[0, j] = xr[j] * xr[j]
                prod[1, j] = yr[j] * yr[j]
                prod[2, j] = xr[j] * yr[j]
            q = m - m0
            _row_filter(xr, hm[0, q], bw, sw, lw, hw)
            _row_filter(yr, hm[1, q], bw, sw, lw, hw)
            _row_filter(prod[0], hm[2, q], bw, sw, lw, hw)
            _row_filter(prod[1], hm[3, q], bw, sw, lw, hw)
            _row_filter(prod[2], hm[4, q], bw, sw, lw, hw)
        mom = np.empty((5, W), dtype=x.dtype)
        dm = np.empty((4, W), dtype=x.dtype)  # dS/dmu_x, dS/dmu_y, dS/dE[x^2] (= dS/dE[y^2]), dS/dE[xy]
        dh = np.empty((4, d1 - d0 if need else 0, W), dtype=x.dtype)  # the same, column-filtered
        for d in range(d0, d1):
            for c in range(5):
                _col_filter(hm[c], m0, mom[c], bh, sh, d)
            total = 0.0
            for j in range(W):
                # in float64: the variances are small differences of large moments, and in float32 (with FMA
                # contraction) SSIM(x, x) came out 1 + 3e-6
                mx = np.float64(mom[0, j])
                my = np.float64(mom[1, j])
                mxy = mx * my
                a1 = 2.0 * mxy + C1
                a2 = 2.0 * (np.float64(mom[4, j]) - mxy) + C2
                b1 = mx * mx + my * my + C1
                b2 = (np.float64(mom[2, j]) - mx * mx) + (np.float64(mom[3, j]) - my * my) + C2
                inv_b1 = 1.0 / b1
                inv_b2 = 1.0 / b2
                inv_d = inv_b1 * inv_b2
                sv = a1 * a2 * inv_d
                total += sv
                if need:
                    s_b2 = sv * inv_b2
                    diff = s_b2 - sv * inv_b1
                    qq = 2.0 * (a2 - a1) * inv_d
                    dm[0, j] = qq * my + 2.0 * mx * diff
                    dm[1, j] = qq * mx + 2.0 * my * diff
                    dm[2, j] = -s_b2
                    dm[3, j] = 2.0 * a1 * inv_d
            if r0 <= d < r1:
                row_sums[p * H + d] = total
            if need:
                e = d - d0
                if want_x:
                    _row_filter(dm[0], dh[0, e], bw, sw, lw, hw)
                if want_y:
                    _row_filter(dm[1], dh[1, e], bw, sw, lw, hw)
                _row_filter(dm[2], dh[2, e], bw, sw, lw, hw)
                _row_filter(dm[3], dh[3, e], bw, sw, lw, hw)
        if need:
            acc = np.empty((4, W), dtype=x.dtype)
            for i in range(r0, r1):
                if want_x:
                    _col_filter(dh[0], d0, acc[0], bh, sh, i)
                if want_y:
                    _col_filter(dh[1], d0, acc[1], bh, sh, i)
                _col_filter(dh[2], d0, acc[2], bh, sh, i)
                _col_filter(dh[3], d0, acc[3], bh, sh, i)
                xr = x[p, i]
                yr = y[p, i]
                if want_x:
                    o = gx[p, i]
                    for j in range(W):
                        o[j] = acc[0, j] + two * xr[j] * acc[2, j] + yr[j] * acc[3, j]
                if want_y:
                    o = gy[p, i]
                    for j in range(W):
                        o[j] = acc[1, j] + two * yr[j] * acc[2, j] + xr[j] * acc[3, j]
    return row_sums, l1_rows, gx, gy


@nb.njit(parallel=True, cache=True, fastmath=True)
def add_sign_grad(g, x, y, a, b):
    """``a * g + b * sign(x - y)`` (flat arrays; ``g`` empty means 0): the SSIM gradient scaled by its
    incoming gradient plus the L1 term's, in one pass."""
    n = x.shape[0]
    out = np.empty(n, dtype=x.dtype)
    has_g = g.shape[0] == n
    for i in nb.prange(n):
        d = x[i] - y[i]
        sg = 1.0 if d > 0 else (-1.0 if d < 0 else 0.0)
        v = b * sg
        if has_g:
            v += a * g[i]
        out[i] = v
    return out


@nb.njit(parallel=True, cache=True, fastmath=True)
def separable_filter(src, src2, bw, sw, lw, hw, bh, sh, chunk):
    """``out[p] = Mh @ src[p] @ Mw^T`` for every plane of ``src [P, H, W]`` and of ``src2 [P2, H, W]`` (may
    have no planes): the columns filter ``(bw, sw)`` along each row, then the rows filter ``(bh, sh)`` down each
    column. With the transposed bands this is the backward of the same filter (the two axes commute). Returns
    ``(out, out2)``.

    One parallel loop over chunks of ``chunk`` rows of a plane of either stack (render and target go through one
    loop); each chunk filters the rows it reads (its own plus the filter's reach) into a local buffer and reduces
    them down the columns from there, so no intermediate image goes through memory and the threads meet once
    per call (on a shared machine every parallel loop waits for its slowest thread)."""
    P, H, W = src.shape
    P2 = src2.shape[0]
    L = bh.shape[1]
    nc = (H + chunk - 1) // chunk
    out = np.empty((P, H, W), dtype=src.dtype)
    out2 = np.empty((P2, H, W), dtype=src.dtype)
    for t in nb.prange((P + P2) * nc):
        q = t // nc
        r0 = (t - q * nc) * chunk
        r1 = min(H, r0 + chunk)
        if q < P:
            img = src[q]
            dst = out[q]
        else:
            img = src2[q - P]
            dst = out2[q - P]
        m0, m1 = sh[r0], sh[r1 - 1] + L
        buf = np.empty((m1 - m0, W), dtype=src.dtype)
        for m in range(m0, m1):
            _row_filter(img[m], buf[m - m0], bw, sw, lw, hw)
        for i in range(r0, r1):
            _col_filter(buf, m0, dst[i], bh, sh, i)
    return out, out2
