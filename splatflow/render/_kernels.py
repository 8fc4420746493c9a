"""numba kernels of the CPU rasterizer: tile binning, forward compositing, analytic backward.

Layout: C cameras x N Gaussians are flattened to G = C*N rows (row ``g`` belongs to camera ``g // N``); the
image of every camera is cut into 16x16 tiles, and tiles of all cameras are numbered ``cam * n_tiles + ty *
tiles_x + tx``. ``ids[offsets[t]:offsets[t+1]]`` lists the Gaussians of tile ``t`` front to back.

Race freedom: tiles run in parallel (``prange``), and everything a tile writes lives in its own pixels or in the
slots ``offsets[t]..offsets[t+1]`` of per-intersection arrays; per-Gaussian sums (gradients, statistics) are
reduced from those slots afterwards in one serial pass. No atomics, no shared accumulators.

Work saving that does not change results: a Gaussian is only evaluated on the pixels whose centres lie inside its
radius rectangle. The radius is opacity aware (see :mod:`.projection`), so every pixel outside it has
``alpha < 1/255`` and gsplat would skip it too; the tests check this against the dense oracle, which evaluates
every pixel of every listed tile.

The per-Gaussian and per-pixel input arrays come in the caller's dtype (float32 in training, float64 in
``gradcheck``; numba compiles one specialisation per dtype). Every value is read into float64 and all per-pixel
state (transmittance, colour sums) and gradient sums are float64, so a float32 array gives exactly the result its
float64 copy would, without the copy. The two compositing kernels use ``fastmath``
(fused multiply-add, reassociation; no NaN/inf reach them): 10% less CPU time at 10K Gaussians, outputs equal to
1e-15. The one exception is ``exp(-sigma)``, evaluated in float32
(as gsplat does with ``__expf``) when the caller's tensors are float32: it is the most frequent operation and float32 ``expf`` is about twice as fast.
"""

from __future__ import annotations

import math

import numba as nb
import numpy as np

from .constants import ALPHA_MAX, ALPHA_MIN, T_MIN, TILE


@nb.njit(parallel=True, cache=True)
def touch_pool(x):
    """Trivial parallel loop: starts numba's thread pool (see :func:`splatflow.render.configure_threads`)."""
    for i in nb.prange(x.shape[0]):
        x[i] = x[i] * 1.0


@nb.njit(cache=True, inline="always")
def _tile_rect(mx, my, rx, ry, tiles_x, tiles_y):
    """Tiles [x0, x1) x [y0, y1) touched by the rectangle mean +- radius (gsplat's ``isect_tiles``)."""
    fx = mx / TILE
    fy = my / TILE
    frx = rx / TILE
    fry = ry / TILE
    x0 = min(max(0, int(math.floor(fx - frx))), tiles_x)
    x1 = min(max(0, int(math.ceil(fx + frx))), tiles_x)
    y0 = min(max(0, int(math.floor(fy - fry))), tiles_y)
    y1 = min(max(0, int(math.ceil(fy + fry))), tiles_y)
    return x0, x1, y0, y1


@nb.njit(cache=True)
def bin_tiles(means2d, radii, order, n_per_cam, n_cams, tiles_x, tiles_y):
    """Depth-sorted Gaussian lists per tile.

    ``order`` lists the visible Gaussians (radii > 0; others are skipped) by depth, stably; scattering them into
    their tiles in that order makes every tile's list depth sorted without a per-tile sort. Returns ``offsets``
    [n_cams * n_tiles + 1] and ``ids`` [M].
    """
    G = means2d.shape[0]
    n_tiles = tiles_x * tiles_y
    counts = np.zeros(n_cams * n_tiles + 1, np.int64)
    for g in range(G):
        rx = radii[g, 0]
        ry = radii[g, 1]
        if rx <= 0 or ry <= 0:
            continue
        x0, x1, y0, y1 = _tile_rect(means2d[g, 0], means2d[g, 1], rx, ry, tiles_x, tiles_y)
        base = (g // n_per_cam) * n_tiles + 1
        for ty in range(y0, y1):
            for tx in range(x0, x1):
                counts[base + ty * tiles_x + tx] += 1
    offsets = np.cumsum(counts)
    cursor = offsets[:-1].copy()
    ids = np.empty(offsets[-1], np.int32)
    for i in range(order.shape[0]):
        g = order[i]
        rx = radii[g, 0]
        ry = radii[g, 1]
        if rx <= 0 or ry <= 0:
            continue
        x0, x1, y0, y1 = _tile_rect(means2d[g, 0], means2d[g, 1], rx, ry, tiles_x, tiles_y)
        base = (g // n_per_cam) * n_tiles
        for ty in range(y0, y1):
            for tx in range(x0, x1):
                t = base + ty * tiles_x + tx
                ids[cursor[t]] = g
                cursor[t] += 1
    return offsets, ids


@nb.njit(cache=True, inline="always")
def _pixel_rect(mx, my, rx, ry, px0, py0, pw, ph):
    """Pixels of the tile whose centres (p + 0.5) lie within mean +- radius: [xa, xb] x [ya, yb] inclusive."""
    xa = max(px0, int(math.ceil(mx - rx - 0.5)))
    xb = min(px0 + pw - 1, int(math.floor(mx + rx - 0.5)))
    ya = max(py0, int(math.ceil(my - ry - 0.5)))
    yb = min(py0 + ph - 1, int(math.floor(my + ry - 0.5)))
    return xa, xb, ya, yb


@nb.njit(cache=True, inline="always")
def _strided(i, per, n_par):
    """Tile for parallel-loop index i: numba splits ``range(per * n_par)`` into n_par contiguous blocks, one per
    thread; this maps block b to tiles b, b + n_par, b + 2 n_par, ... so every thread gets tiles from all over the
    image (a static split into image halves would leave one thread idle when the work sits in one half, and
    numba's dynamic chunking measured 30-50% more CPU time here)."""
    return (i % per) * n_par + i // per


@nb.njit(cache=True, inline="always")
def _tile_split(n_tot, n_par):
    """The n_tot tiles as n_par blocks of ``per`` loop indices (see :func:`_strided`); returns n_tot, per."""
    return n_tot, (n_tot + n_par - 1) // n_par


_POW2_NEG = 2.0 ** -np.arange(128, dtype=np.float64)  # 2^-n, n = 0..127 (a compile-time constant in numba)


@nb.njit(cache=True, inline="always")
def _exp_neg_poly(s):
    """exp(-s) for s >= 0 without a libm call: exp(-s) = 2^-n exp(-r) with n = round(s / ln 2), |r| <= ln(2) / 2,
    exp(-r) by its degree-7 Taylor polynomial (relative error < 2e-8, below float32's 6e-8) and 2^-n from a table.
    Beyond s = 80 the result is 0 (far below any alpha threshold)."""
    if s > 80.0:
        return 0.0
    n = int(s * 1.4426950408889634 + 0.5)
    r = s - n * 0.6931471805599453
    p = 1.0 + r * (-1.0 + r * (0.5 + r * (-1.0 / 6.0 + r * (1.0 / 24.0 + r * (-1.0 / 120.0 + r * (
        1.0 / 720.0 - r * (1.0 / 5040.0)))))))
    return p * _POW2_NEG[n]


@nb.njit(cache=True, inline="always")
def _exp(sigma, fast_exp):
    """exp(-sigma) for sigma >= 0: polynomial (float32-accurate) for float32 inputs (``fast_exp``), else libm
    float64 (gradcheck needs it)."""
    if fast_exp:
        return _exp_neg_poly(sigma)
    return math.exp(-sigma)


@nb.njit(cache=True, inline="always")
def _tile_origin(t, n_tiles, tiles_x, width, height):
    """Camera of tile t, its top-left pixel and its size (tiles at the right and bottom edges may be partial)."""
    cam = t // n_tiles
    tl = t - cam * n_tiles
    ty = tl // tiles_x
    tx = tl - ty * tiles_x
    px0 = tx * TILE
    py0 = ty * TILE
    return cam, px0, py0, min(TILE, width - px0), min(TILE, height - py0)


@nb.njit(cache=True, inline="always")
def _load_splat(means2d, conics, opacities, radii, g, px0, py0, pw, ph):
    """Row g, as the pixel loops need it: mean, the pixels of the tile inside its radius rectangle [xa, xb] x
    [ya, yb] (empty when xa > xb or ya > yb, and then the rest is not read), conic (ca, cb, cc), opacity and the
    largest sigma that can still reach alpha >= 1/255."""
    mx = np.float64(means2d[g, 0])
    my = np.float64(means2d[g, 1])
    xa, xb, ya, yb = _pixel_rect(mx, my, radii[g, 0], radii[g, 1], px0, py0, pw, ph)
    if xa > xb or ya > yb:
        return mx, my, xa, xb, ya, yb, 0.0, 0.0, 0.0, 0.0, 0.0
    op = np.float64(opacities[g])
    return (mx, my, xa, xb, ya, yb, np.float64(conics[g, 0]), np.float64(conics[g, 1]), np.float64(conics[g, 2]),
            op, math.log(op / ALPHA_MIN))


@nb.njit(cache=True, inline="always")
def _alpha_at(dx, dy, ca, cb, cc, op, fast_exp):
    """alpha = min(ALPHA_MAX, op exp(-sigma)) at offset (dx, dy) from the mean; also the unclamped op exp(-sigma)
    and exp(-sigma). A negative sigma (not a valid conic there) gives alpha 0, which every caller skips."""
    sigma = 0.5 * (ca * dx * dx + cc * dy * dy) + cb * dx * dy
    if sigma < 0.0:
        return 0.0, 0.0, 0.0
    vis = _exp(sigma, fast_exp)
    a0 = op * vis
    return min(ALPHA_MAX, a0), a0, vis


@nb.njit(cache=True, inline="always")
def _alpha_at_vjp(v_alpha, a0, vis, dx, dy, ca, cb, cc):
    """Adjoint of :func:`_alpha_at` for dL/dalpha: dL/d(ca, cb, cc), dL/d(mean x, mean y), dL/dopacity (all zero
    where alpha is clamped at ALPHA_MAX)."""
    if a0 > ALPHA_MAX:
        return 0.0, 0.0, 0.0, 0.0, 0.0, 0.0
    v_sigma = -a0 * v_alpha
    return (0.5 * v_sigma * dx * dx, v_sigma * dx * dy, 0.5 * v_sigma * dy * dy,
            v_sigma * (ca * dx + cb * dy), v_sigma * (cb * dx + cc * dy), vis * v_alpha)


@nb.njit(cache=True, inline="always")
def _row_span(mx, dy, ca, cb, cc, s_max, xa, xb):
    """Pixels of one row that can reach ``sigma <= s_max`` (i.e. ``alpha >= 1/255``), clipped to [xa, xb].

    sigma(dx) = 0.5 ca dx^2 + cb dy dx + 0.5 cc dy^2 is a parabola in dx = mx - (px + 0.5); outside its roots
    sigma > s_max and the pixel would be skipped anyway, so visiting only the span changes no result. A 1e-3 px
    margin keeps rounding from dropping a pixel on the boundary.
    """
    disc = (cb * cb - ca * cc) * dy * dy + 2.0 * ca * s_max
    if disc < 0.0:
        return 1, 0
    r = math.sqrt(disc)
    dx_lo = (-cb * dy - r) / ca
    dx_hi = (-cb * dy + r) / ca
    lo = max(xa, int(math.ceil(mx - dx_hi - 0.5 - 1e-3)))
    hi = min(xb, int(math.floor(mx - dx_lo - 0.5 + 1e-3)))
    return lo, hi


@nb.njit(cache=True, inline="always")
def _pixel_row(py, px0, py0, mx, my, ca, cb, cc, s_max, xa, xb):
    """Pixel row py of a tile: dy from the mean, the row's offset into the tile's pixel arrays (add px), and the
    span [lo, hi] of pixels that can reach alpha >= 1/255."""
    dy = my - (py + 0.5)
    lo, hi = _row_span(mx, dy, ca, cb, cc, s_max, xa, xb)
    return dy, (py - py0) * TILE - px0, lo, hi


@nb.njit(parallel=True, cache=True, fastmath=True)
def rasterize_fwd(offsets, ids, means2d, conics, colors, opacities, radii, backgrounds,
                  n_cams, width, height, tiles_x, tiles_y, want_stats, fast_exp, n_par):
    """Front-to-back compositing per tile.

    Returns colour [C, H, W, D], final transmittance [C, H, W] (float64), the list position of the last
    Gaussian that contributed to each pixel [C, H, W] (-1: none), and per-intersection weight sums and hit counts
    (empty unless ``want_stats``).
    """
    D = colors.shape[1]
    n_tiles = tiles_x * tiles_y
    M = ids.shape[0]
    out = np.empty((n_cams, height, width, D), colors.dtype)
    T_out = np.empty((n_cams, height, width), np.float64)
    last_out = np.empty((n_cams, height, width), np.int64)
    n_stats = M if want_stats else 0
    isect_w = np.zeros(n_stats, np.float64)
    isect_hits = np.zeros(n_stats, np.int32)
    n_tot, per = _tile_split(n_cams * n_tiles, n_par)
    for i in nb.prange(per * n_par):
        t = _strided(i, per, n_par)
        if t >= n_tot:
            continue
        cam, px0, py0, pw, ph = _tile_origin(t, n_tiles, tiles_x, width, height)
        n_px = pw * ph
        Tl = np.ones(TILE * TILE, np.float64)
        acc = np.zeros((TILE * TILE, D), np.float64)
        last = np.full(TILE * TILE, -1, np.int64)
        done = np.zeros(TILE * TILE, np.bool_)
        n_done = 0
        for k in range(offsets[t], offsets[t + 1]):
            if n_done >= n_px:
                break
            wsum = 0.0
            nh = 0
            g = ids[k]
            mx, my, xa, xb, ya, yb, ca, cb, cc, op, s_max = _load_splat(
                means2d, conics, opacities, radii, g, px0, py0, pw, ph)
            if xa > xb or ya > yb:
                continue
            for py in range(ya, yb + 1):
                dy, row, lo, hi = _pixel_row(py, px0, py0, mx, my, ca, cb, cc, s_max, xa, xb)
                for px in range(lo, hi + 1):
                    li = row + px
                    if done[li]:
                        continue
                    dx = mx - (px + 0.5)
                    alpha, _a0, _vis = _alpha_at(dx, dy, ca, cb, cc, op, fast_exp)
                    if alpha < ALPHA_MIN:
                        continue
                    T = Tl[li]
                    nT = T * (1.0 - alpha)
                    if nT <= T_MIN:
                        done[li] = True
                        n_done += 1
                        continue
                    w = alpha * T
                    for d in range(D):
                        acc[li, d] += colors[g, d] * w
                    Tl[li] = nT
                    last[li] = k
                    wsum += w
                    nh += 1
            if want_stats:
                isect_w[k] = wsum
                isect_hits[k] = nh
        for ly in range(ph):
            for lx in range(pw):
                li = ly * TILE + lx
                T_out[cam, py0 + ly, px0 + lx] = Tl[li]
                last_out[cam, py0 + ly, px0 + lx] = last[li]
                for d in range(D):
                    out[cam, py0 + ly, px0 + lx, d] = acc[li, d] + Tl[li] * backgrounds[cam, d]
    return out, T_out, last_out, isect_w, isect_hits


@nb.njit(cache=True)
def reduce_stats(ids, isect_w, isect_hits, G):
    """Per-Gaussian sums of the per-intersection statistics."""
    wsum = np.zeros(G, np.float64)
    hits = np.zeros(G, np.int32)
    for k in range(ids.shape[0]):
        g = ids[k]
        wsum[g] += isect_w[k]
        hits[g] += isect_hits[k]
    return wsum, hits


@nb.njit(parallel=True, cache=True, fastmath=True)
def rasterize_bwd(offsets, ids, means2d, conics, colors, opacities, radii, backgrounds, T_final, last_ids,
                  v_out, v_alpha_out, n_cams, width, height, tiles_x, tiles_y, fast_exp, n_par, want_removal=False):
    """Analytic backward, per tile, back to front (the adjoint of :func:`rasterize_fwd`).

    For pixel transmittance ``T_i`` before Gaussian i, ``C = sum_i c_i a_i T_i + T_final bg`` and
    ``A = 1 - T_final``; walking back from the last contributor, ``T_i = T_{i+1} / (1 - a_i)`` and the colour of
    everything behind i, ``S_i``, is accumulated, giving
    ``dL/da_i = sum_d (c_id T_i - S_id / (1 - a_i)) dL/dC_d + T_final / (1 - a_i) (dL/dA - bg . dL/dC)``.
    Then ``a = o exp(-sigma)`` (unless clamped) gives the opacity, conic and 2D mean gradients.

    Returns per-Gaussian rows [G, 8 + D]: d mean2d (2), d conic (3), d opacity, |d mean2d| summed per pixel (2,
    gsplat's ``absgrad``), d colour (D).

    ``want_removal`` appends two columns, what removing each Gaussian would do to the image: the change of
    pixel ``p`` is exactly ``R_p = a_i (c_i T_i - (S_i + T_final bg) / (1 - a_i))`` (the pixel is affine in
    ``a_i``, and ``R_p = a_i dC/da_i``); the columns are ``sum_p R_p . dL/dC_p`` and ``sum_p |R_p|^2``.
    """
    D = colors.shape[1]
    G = means2d.shape[0]
    n_tiles = tiles_x * tiles_y
    M = ids.shape[0]
    NG = 8 + D + (2 if want_removal else 0)
    per_isect = np.zeros((M, NG), np.float64)
    n_tot, per = _tile_split(n_cams * n_tiles, n_par)
    for i in nb.prange(per * n_par):
        t = _strided(i, per, n_par)
        if t >= n_tot:
            continue
        start = offsets[t]
        if offsets[t + 1] == start:
            continue
        cam, px0, py0, pw, ph = _tile_origin(t, n_tiles, tiles_x, width, height)
        Tl = np.ones(TILE * TILE, np.float64)
        Tf = np.ones(TILE * TILE, np.float64)
        buf = np.zeros((TILE * TILE, D), np.float64)
        vo = np.zeros((TILE * TILE, D), np.float64)
        va = np.zeros(TILE * TILE, np.float64)  # dL/dA - bg . dL/dC
        last = np.full(TILE * TILE, -1, np.int64)
        max_last = -1
        for ly in range(ph):
            for lx in range(pw):
                li = ly * TILE + lx
                py = py0 + ly
                px = px0 + lx
                Tl[li] = T_final[cam, py, px]
                Tf[li] = Tl[li]
                last[li] = last_ids[cam, py, px]
                if last[li] > max_last:
                    max_last = last[li]
                s = 0.0
                for d in range(D):
                    vo[li, d] = v_out[cam, py, px, d]
                    s += backgrounds[cam, d] * vo[li, d]
                va[li] = v_alpha_out[cam, py, px] - s
        vcol = np.zeros(D, np.float64)
        for k in range(max_last, start - 1, -1):
            g = ids[k]
            mx, my, xa, xb, ya, yb, ca, cb, cc, op, s_max = _load_splat(
                means2d, conics, opacities, radii, g, px0, py0, pw, ph)
            if xa > xb or ya > yb:
                continue
            v_mx = 0.0
            v_my = 0.0
            v_ca = 0.0
            v_cb = 0.0
            v_cc = 0.0
            v_op = 0.0
            abs_x = 0.0
            abs_y = 0.0
            rem_lin = 0.0
            rem_sq = 0.0
            for d in range(D):
                vcol[d] = 0.0
            for py in range(ya, yb + 1):
                dy, row, lo, hi = _pixel_row(py, px0, py0, mx, my, ca, cb, cc, s_max, xa, xb)
                for px in range(lo, hi + 1):
                    li = row + px
                    if k > last[li]:
                        continue
                    dx = mx - (px + 0.5)
                    alpha, a0, vis = _alpha_at(dx, dy, ca, cb, cc, op, fast_exp)
                    if alpha < ALPHA_MIN:
                        continue
                    ra = 1.0 / (1.0 - alpha)
                    T = Tl[li] * ra
                    Tl[li] = T
                    fac = alpha * T
                    v_alpha = 0.0
                    for d in range(D):
                        c = colors[g, d]
                        vcol[d] += fac * vo[li, d]
                        v_alpha += (c * T - buf[li, d] * ra) * vo[li, d]
                        if want_removal:
                            r = alpha * (c * T - (buf[li, d] + Tf[li] * backgrounds[cam, d]) * ra)
                            rem_sq += r * r
                        buf[li, d] += c * fac
                    v_alpha += Tf[li] * ra * va[li]
                    if want_removal:
                        rem_lin += alpha * v_alpha
                    g_ca, g_cb, g_cc, gx, gy, g_op = _alpha_at_vjp(v_alpha, a0, vis, dx, dy, ca, cb, cc)
                    v_ca += g_ca
                    v_cb += g_cb
                    v_cc += g_cc
                    v_mx += gx
                    v_my += gy
                    abs_x += abs(gx)
                    abs_y += abs(gy)
                    v_op += g_op
            per_isect[k, 0] = v_mx
            per_isect[k, 1] = v_my
            per_isect[k, 2] = v_ca
            per_isect[k, 3] = v_cb
            per_isect[k, 4] = v_cc
            per_isect[k, 5] = v_op
            per_isect[k, 6] = abs_x
            per_isect[k, 7] = abs_y
            for d in range(D):
                per_isect[k, 8 + d] = vcol[d]
            if want_removal:
                per_isect[k, 8 + D] = rem_lin
                per_isect[k, 9 + D] = rem_sq
    grads = np.zeros((G, NG), np.float64)
    for k in range(M):
        g = ids[k]
        for j in range(NG):
            grads[g, j] += per_isect[k, j]
    return grads
