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
``gradcheck``; numba compiles one specialisation per dtype). The training kernels (:func:`rasterize_fwd`,
:func:`rasterize_bwd_rgb`) take the float type ``F`` of their per-pixel state (transmittance, colour sums) and
per-intersection sums as an argument: the caller passes the inputs' type (``cpu._work_type``), so a float32 model
composites in float32 as gsplat's CUDA kernels do (twice the pixels per SIMD instruction), and float64 inputs
composite in float64 for the exactness tests. With the forward's RGB sums inside the row loop and the backward's
per-lane gradient sums, the forward is 1.7x and the backward 1.5x faster than float64 lanes on real checkpoints
(docs/experiments.md, Training, 2026-11-26 08:02). Per-splat set-up (the radius
rectangle, the row reach test) stays float64, and per-Gaussian gradient sums are float64. The general kernels
compute in float64. The compositing kernels use ``fastmath`` (fused multiply-add, reassociation; no NaN/inf reach
them). ``exp(-sigma)``, the most frequent operation, is a branch-free polynomial (:func:`_exp`, accurate to 5e-9
in float64 and to a few float32 roundings in float32), used by every kernel, so forward and backward agree
exactly.

Vectorisation: the training kernels (:func:`rasterize_fwd`, :func:`rasterize_bwd_rgb`) composite a splat over
all 16 pixels of a tile row at once, branch free, with unsigned pixel indices; the compiler turns those loops into
SIMD code (1.5x faster forward and backward than the per-pixel loops at 120K Gaussians, docs/experiments.md). Two
things kept such loops scalar and must not come back: signed indices (numba's negative-index wrap-around) and a
branch inside the row loop (even a loop-invariant one, e.g. a choice of exp function), or too many arrays written
in one loop (the general backward's per-channel loop). The RGB backward also gives pruning's removal columns
(1.4x faster than the general kernel on a whole 800x600 view); the general :func:`rasterize_bwd` (other channel
counts) keeps the per-pixel loop over each row's exact span.
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


@nb.njit(cache=True, inline="always")
def _edge_min(d_fixed, lo, hi, c_fixed, c_cross, c_free):
    """Smallest ``0.5 c_fixed f^2 + c_cross f u + 0.5 c_free u^2`` over ``u`` in [lo, hi] at ``f = d_fixed``."""
    u = min(hi, max(lo, -c_cross * d_fixed / c_free))
    return 0.5 * c_fixed * d_fixed * d_fixed + c_cross * d_fixed * u + 0.5 * c_free * u * u


@nb.njit(cache=True, inline="always")
def _tile_reached(mx, my, ca, cb, cc, sig_max, tx, ty):
    """Whether the splat can reach alpha >= 1/255 at any pixel centre of tile (tx, ty): the smallest sigma
    ``0.5 ca dx^2 + cb dx dy + 0.5 cc dy^2`` over the rectangle of the tile's pixel centres (at the mean when it
    lies inside, else on an edge) is at most ``sig_max = ln(255 op)`` (plus a margin for the kernels' exp). A
    diagonal or elongated splat misses many tiles of its radius rectangle, which then need no list entry: the
    compositing would only have masked every pixel of them out (the same image and gradients, less work)."""
    if not (ca > 0.0 and cc > 0.0):
        return True
    x_lo = tx * TILE + 0.5
    x_hi = x_lo + TILE - 1.0
    y_lo = ty * TILE + 0.5
    y_hi = y_lo + TILE - 1.0
    if x_lo <= mx <= x_hi and y_lo <= my <= y_hi:
        return True
    # offsets d = mean - pixel over the rectangle: dx in [mx - x_hi, mx - x_lo], dy in [my - y_hi, my - y_lo]
    dx_lo, dx_hi, dy_lo, dy_hi = mx - x_hi, mx - x_lo, my - y_hi, my - y_lo
    s = min(min(_edge_min(dx_lo, dy_lo, dy_hi, ca, cb, cc), _edge_min(dx_hi, dy_lo, dy_hi, ca, cb, cc)),
            min(_edge_min(dy_lo, dx_lo, dx_hi, cc, cb, ca), _edge_min(dy_hi, dx_lo, dx_hi, cc, cb, ca)))
    return s <= sig_max + 1e-6 * (1.0 + abs(sig_max))


@nb.njit(parallel=True, cache=True)
def _reached_tiles(means2d, radii, conics, opacities, tiles_x, tiles_y):
    """For every visible splat, one flag per tile of its radius rectangle (row by row): whether it can reach that
    tile (:func:`_tile_reached`). ``start[g]`` is splat g's first flag. The tests run in parallel; the binning's
    two sequential passes then only read the flags."""
    G = means2d.shape[0]
    start = np.zeros(G + 1, np.int64)
    for g in range(G):
        if radii[g, 0] > 0 and radii[g, 1] > 0:
            x0, x1, y0, y1 = _tile_rect(means2d[g, 0], means2d[g, 1], radii[g, 0], radii[g, 1], tiles_x, tiles_y)
            start[g + 1] = (x1 - x0) * (y1 - y0)
    start = np.cumsum(start)
    flags = np.zeros(start[G], np.uint8)
    for g in nb.prange(G):
        if radii[g, 0] <= 0 or radii[g, 1] <= 0:
            continue
        mx, my = np.float64(means2d[g, 0]), np.float64(means2d[g, 1])
        ca, cb, cc = np.float64(conics[g, 0]), np.float64(conics[g, 1]), np.float64(conics[g, 2])
        sig_max = math.log(max(np.float64(opacities[g]), ALPHA_MIN) / ALPHA_MIN)
        x0, x1, y0, y1 = _tile_rect(means2d[g, 0], means2d[g, 1], radii[g, 0], radii[g, 1], tiles_x, tiles_y)
        j = start[g]
        for ty in range(y0, y1):
            for tx in range(x0, x1):
                flags[j] = 1 if _tile_reached(mx, my, ca, cb, cc, sig_max, tx, ty) else 0
                j += 1
    return start, flags


@nb.njit(cache=True)
def bin_tiles(means2d, radii, conics, opacities, order, n_per_cam, n_cams, tiles_x, tiles_y):
    """Depth-sorted Gaussian lists per tile.

    ``order`` lists the visible Gaussians (radii > 0; others are skipped) by depth, stably; scattering them into
    their tiles in that order makes every tile's list depth sorted without a per-tile sort. A Gaussian is listed in
    the tiles of its radius rectangle that it can reach at alpha >= 1/255 (:func:`_tile_reached`, evaluated once
    per tile in parallel by :func:`_reached_tiles`). Returns ``offsets`` [n_cams * n_tiles + 1] and ``ids`` [M].
    """
    G = means2d.shape[0]
    n_tiles = tiles_x * tiles_y
    start, flags = _reached_tiles(means2d, radii, conics, opacities, tiles_x, tiles_y)
    counts = np.zeros(n_cams * n_tiles + 1, np.int64)
    for g in range(G):
        if radii[g, 0] <= 0 or radii[g, 1] <= 0:
            continue
        x0, x1, y0, y1 = _tile_rect(means2d[g, 0], means2d[g, 1], radii[g, 0], radii[g, 1], tiles_x, tiles_y)
        base = (g // n_per_cam) * n_tiles + 1
        j = start[g]
        for ty in range(y0, y1):
            for tx in range(x0, x1):
                counts[base + ty * tiles_x + tx] += flags[j]
                j += 1
    offsets = np.cumsum(counts)
    cursor = offsets[:-1].copy()
    ids = np.empty(offsets[-1], np.int32)
    for i in range(order.shape[0]):
        g = order[i]
        if radii[g, 0] <= 0 or radii[g, 1] <= 0:
            continue
        x0, x1, y0, y1 = _tile_rect(means2d[g, 0], means2d[g, 1], radii[g, 0], radii[g, 1], tiles_x, tiles_y)
        base = (g // n_per_cam) * n_tiles
        j = start[g]
        for ty in range(y0, y1):
            for tx in range(x0, x1):
                if flags[j]:
                    t = base + ty * tiles_x + tx
                    ids[cursor[t]] = g
                    cursor[t] += 1
                j += 1
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


SIGMA_CLAMP = 8.0
"""Beyond this sigma ``op * exp(-sigma) < exp(-8) < 1/255`` for every opacity <= 1: no pixel is drawn, so the
kernels evaluate exp on ``min(sigma, SIGMA_CLAMP)``."""


@nb.njit(cache=True, inline="always")
def _exp_neg_poly(s, F):
    """exp(-s) for 0 <= s <= SIGMA_CLAMP in the float type F, without a libm call and without a branch or table
    (so a loop over pixels vectorises): exp(-s) = exp(-s/16)^16, exp(-x) on [0, 0.5] by its degree-9 Taylor
    polynomial (relative error < 3e-10, times 16 after the four squarings: < 5e-9, below float32's 6e-8; in
    float32 the rounding of the polynomial dominates, a few 1e-7)."""
    x = s * F(0.0625)
    p = F(1.0) + x * (F(-1.0) + x * (F(0.5) + x * (F(-1.0 / 6.0) + x * (F(1.0 / 24.0) + x * (F(-1.0 / 120.0) + x * (
        F(1.0 / 720.0) + x * (F(-1.0 / 5040.0) + x * (F(1.0 / 40320.0) - x * F(1.0 / 362880.0)))))))))
    p = p * p
    p = p * p
    p = p * p
    return p * p


@nb.njit(cache=True, inline="always")
def _exp(sigma, F):
    """exp(-sigma) in the float type F (np.float64 or np.float32) as every compositing kernel evaluates it (sigma
    clamped to [0, SIGMA_CLAMP]); one definition, so the forward and the backward draw and differentiate exactly
    the same alphas."""
    return _exp_neg_poly(min(max(sigma, F(0.0)), F(SIGMA_CLAMP)), F)


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
def _alpha_at(dx, dy, ca, cb, cc, op):
    """alpha = min(ALPHA_MAX, op exp(-sigma)) at offset (dx, dy) from the mean; also the unclamped op exp(-sigma)
    and exp(-sigma). A negative sigma (not a valid conic there) gives alpha 0, which every caller skips."""
    sigma = 0.5 * (ca * dx * dx + cc * dy * dy) + cb * dx * dy
    if sigma < 0.0:
        return 0.0, 0.0, 0.0
    vis = _exp(sigma, np.float64)
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


@nb.njit(cache=True, inline="always")
def _lane(i):
    """A pixel-array index as unsigned: numba then emits no negative-index wrap-around, and the fixed 16-wide loops
    over a tile row vectorise (with signed indices they stayed scalar: measured 2.5x slower, not faster)."""
    return np.uint64(i)


@nb.njit(cache=True, inline="always")
def _step(ok, F):
    """1 or 0 in the float type F (the branch-free masks)."""
    return F(1.0) if ok else F(0.0)


@nb.njit(cache=True, inline="always")
def _row_mask(lx, la, lb, sigma, alpha, F):
    """1 where lane lx of a tile row is inside the splat's pixel rectangle [la, lb] and reaches alpha >= 1/255,
    else 0, in the float type F (a branch-free mask: the vectorised loops multiply by it)."""
    return (_step(lx >= la, F) * _step(lx <= lb, F) * _step(sigma >= F(0.0), F)
            * _step(alpha >= F(ALPHA_MIN), F))


@nb.njit(cache=True, inline="always")
def _load_lanes(means2d, conics, opacities, radii, g, k, px0, py0, pw, ph):
    """Row g for the 16-lane row loops: mean, its pixel rectangle in the tile as lanes [la, lb] x rows [ya, yb]
    (empty when la > lb or ya > yb), half the first conic entry, the other two, the opacity, list position k, and
    the largest sigma that still reaches alpha >= 1/255 (for :func:`_row_reached`). All float64 (the per-splat
    set-up); :func:`_lane_consts` brings what the lanes use to their float type."""
    mx, my, xa, xb, ya, yb, ca, cb, cc, op, s_max = _load_splat(means2d, conics, opacities, radii, g, px0, py0, pw,
                                                                ph)
    return mx, my, xa - px0, xb - px0, ya, yb, 0.5 * ca, cb, cc, op, k, s_max


@nb.njit(cache=True, inline="always")
def _lane_consts(mx, px0, hca, cb, op, k, start, F):
    """What a splat's lane loops read, in their float type F: the mean's x from the first pixel centre of the tile
    row (dx = that - lane), half the first conic entry, the second, the opacity, and list position k from the
    start of the tile's list (small, so exact in float32 too: the lanes' "last contributor" arrays are of type F,
    so every lane operation stays one width)."""
    return F(mx - px0 - 0.5), F(hca), F(cb), F(op), F(k - start)


@nb.njit(cache=True, inline="always")
def _row_reached(mx, dy, hca, cb, cc, s_max, la, lb, px0):
    """Whether some pixel of the row (lanes [la, lb]) can reach alpha >= 1/255 (:func:`_row_span`): the row loops
    skip the rows of a splat's rectangle that it cannot reach, where every lane would get mask 0."""
    lo, hi = _row_span(mx, dy, 2.0 * hca, cb, cc, s_max, la + px0, lb + px0)
    return lo <= hi


@nb.njit(cache=True, inline="always")
def _lane_row(py, py0, my, cb, cc, F):
    """Pixel row py: dy from the mean (float64), and in the lanes' float type F: dy, the row's constant terms of
    sigma (0.5 cc dy^2 and cb dy); and the row's offset into the tile's pixel arrays."""
    dy = my - (py + 0.5)
    return dy, F(dy), F(0.5 * cc * dy * dy), F(cb * dy), (py - py0) * TILE


@nb.njit(parallel=True, cache=True, fastmath=True)
def rasterize_fwd(offsets, ids, means2d, conics, colors, opacities, radii, backgrounds,
                  n_cams, width, height, tiles_x, tiles_y, want_stats, n_par, F):
    """Front-to-back compositing per tile, with per-pixel state and sums in the float type ``F`` (np.float32 in
    training, as gsplat; np.float64 for exact checks).

    Returns colour [C, H, W, D] (colors' dtype), final transmittance [C, H, W] (F), the list position of the last
    Gaussian that contributed to each pixel [C, H, W] (-1: none), and per-intersection weight sums and hit counts
    (empty unless ``want_stats``).

    Each splat is composited one tile row at a time over all 16 pixels of the row, branch free (a pixel outside
    the splat's rectangle, below 1/255 or already saturated gets weight 0 and keeps its state), so the compiler
    vectorises the row (AVX2/AVX-512: 8/16 float32 pixels per instruction). The results are those of a per-pixel
    loop that skips those pixels. With three channels (every RGB render) the colour sums are accumulated in the
    row loop itself (``rgb``: loop invariant, so the compiler emits one loop per case): 1.5-1.7x faster than a
    second pass over the row's weights per channel, which other channel counts keep.
    """
    D = colors.shape[1]
    n_tiles = tiles_x * tiles_y
    M = ids.shape[0]
    out = np.empty((n_cams, height, width, D), colors.dtype)
    T_out = np.empty((n_cams, height, width), F)
    last_out = np.empty((n_cams, height, width), np.int64)
    n_stats = M if want_stats else 0
    isect_w = np.zeros(n_stats, np.float64)
    isect_hits = np.zeros(n_stats, np.int32)
    n_tot, per = _tile_split(n_cams * n_tiles, n_par)
    one = F(1.0)
    a_max = F(ALPHA_MAX)
    t_min = F(T_MIN)
    rgb = D == 3
    for i in nb.prange(per * n_par):
        t = _strided(i, per, n_par)
        if t >= n_tot:
            continue
        cam, px0, py0, pw, ph = _tile_origin(t, n_tiles, tiles_x, width, height)
        n_px = pw * ph
        start = offsets[t]
        lanes = np.arange(TILE).astype(F)
        Tl = np.ones(TILE * TILE, F)
        live = np.ones(TILE * TILE, F)  # 1 until the pixel saturates
        acc = np.zeros((D, TILE * TILE), F)  # colour sums, other channel counts
        acc0 = np.zeros(TILE * TILE, F)  # colour sums for RGB, summed in the row loop itself
        acc1 = np.zeros(TILE * TILE, F)
        acc2 = np.zeros(TILE * TILE, F)
        lastf = np.full(TILE * TILE, -1.0, F)  # list position (from start) of the last contributor
        wrow = np.zeros(TILE, F)
        n_done = 0
        for k in range(start, offsets[t + 1]):
            if n_done >= n_px:
                break
            g = ids[k]
            mx, my, la, lb, ya, yb, hca, cb, cc, op, _, s_max = _load_lanes(
                means2d, conics, opacities, radii, g, k, px0, py0, pw, ph)
            if la > lb or ya > yb:
                continue
            mxl, hcaf, cbf, opf, kf = _lane_consts(mx, px0, hca, cb, op, k, start, F)
            c0 = F(colors[g, 0])  # (read for every D, in range: only the rgb loop uses them)
            c1 = F(colors[g, 1 % D])
            c2 = F(colors[g, 2 % D])
            wsum = 0.0
            nh = 0.0
            for py in range(ya, yb + 1):
                dy, _, hy, bdy, base = _lane_row(py, py0, my, cb, cc, F)
                if not _row_reached(mx, dy, hca, cb, cc, s_max, la, lb, px0):
                    continue
                nd = F(0.0)
                ws = F(0.0)
                nhr = F(0.0)
                for lx in range(TILE):
                    li = _lane(base + lx)
                    dx = mxl - lanes[_lane(lx)]
                    sigma = hcaf * dx * dx + bdy * dx + hy
                    alpha = min(a_max, opf * _exp(sigma, F))
                    T = Tl[li]
                    ok = _row_mask(lx, la, lb, sigma, alpha, F) * live[li]
                    nT = T * (one - alpha)
                    upd = ok * _step(nT > t_min, F)
                    w = alpha * T * upd
                    Tl[li] = T + (nT - T) * upd
                    live[li] = live[li] - (ok - upd)  # saturates here: this splat and all behind it are skipped
                    lastf[li] = lastf[li] + (kf - lastf[li]) * upd
                    nd += ok - upd
                    if rgb:  # loop invariant: the compiler makes one loop per case
                        acc0[li] += c0 * w
                        acc1[li] += c1 * w
                        acc2[li] += c2 * w
                    else:
                        wrow[_lane(lx)] = w
                    if want_stats:
                        ws += w
                        nhr += upd
                n_done += int(nd)
                wsum += ws
                nh += nhr
                if not rgb:
                    for d in range(D):
                        c = F(colors[g, d])
                        for lx in range(TILE):
                            acc[d, _lane(base + lx)] += c * wrow[_lane(lx)]
            if want_stats:
                isect_w[k] = wsum
                isect_hits[k] = int(nh)
        if rgb:
            acc[0] = acc0
            acc[1] = acc1
            acc[2] = acc2
        for ly in range(ph):
            for lx in range(pw):
                li = ly * TILE + lx
                T_out[cam, py0 + ly, px0 + lx] = Tl[li]
                lk = np.int64(lastf[li])
                last_out[cam, py0 + ly, px0 + lx] = lk + start if lk >= 0 else -1
                for d in range(D):
                    out[cam, py0 + ly, px0 + lx, d] = acc[d, li] + Tl[li] * backgrounds[cam, d]
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


@nb.njit(cache=True, inline="always")
def _bwd_tile(i, per, n_par, n_tot, offsets):
    """Tile of parallel-loop index i for a backward pass, or -1 when there is none or its list is empty."""
    t = _strided(i, per, n_par)
    if t >= n_tot or offsets[t + 1] == offsets[t]:
        return -1
    return t


@nb.njit(cache=True, inline="always")
def _store_geometry(per_isect, k, v_mx, v_my, v_ca, v_cb, v_cc, v_op, abs_x, abs_y):
    """The first eight columns of intersection k's row: d mean2d, d conic, d opacity, |d mean2d|."""
    per_isect[k, 0] = v_mx
    per_isect[k, 1] = v_my
    per_isect[k, 2] = v_ca
    per_isect[k, 3] = v_cb
    per_isect[k, 4] = v_cc
    per_isect[k, 5] = v_op
    per_isect[k, 6] = abs_x
    per_isect[k, 7] = abs_y


@nb.njit(cache=True)
def _sum_rows(ids, per_isect, G):
    """Per-Gaussian sums [G, NG] of the per-intersection rows (serial: no two threads write one Gaussian)."""
    NG = per_isect.shape[1]
    grads = np.zeros((G, NG), np.float64)
    for k in range(ids.shape[0]):
        g = ids[k]
        for j in range(NG):
            grads[g, j] += per_isect[k, j]
    return grads


@nb.njit(parallel=True, cache=True, fastmath=True)
def rasterize_bwd(offsets, ids, means2d, conics, colors, opacities, radii, backgrounds, T_final, last_ids,
                  v_out, v_alpha_out, n_cams, width, height, tiles_x, tiles_y, n_par, want_removal=False):
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
        t = _bwd_tile(i, per, n_par, n_tot, offsets)
        if t < 0:
            continue
        start = offsets[t]
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
                    alpha, a0, vis = _alpha_at(dx, dy, ca, cb, cc, op)
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
            _store_geometry(per_isect, k, v_mx, v_my, v_ca, v_cb, v_cc, v_op, abs_x, abs_y)
            for d in range(D):
                per_isect[k, 8 + d] = vcol[d]
            if want_removal:
                per_isect[k, 8 + D] = rem_lin
                per_isect[k, 9 + D] = rem_sq
    return _sum_rows(ids, per_isect, G)


@nb.njit(parallel=True, cache=True, fastmath=True)
def rasterize_bwd_rgb(offsets, ids, means2d, conics, colors, opacities, radii, backgrounds, T_final, last_ids,
                      v_out, v_alpha_out, n_cams, width, height, tiles_x, tiles_y, n_par, F, removal=None):
    """:func:`rasterize_bwd` for three colour channels (every training step, and pruning's removal cost), vectorised,
    with per-pixel state and the per-intersection sums in the float type ``F`` (as :func:`rasterize_fwd`).

    The same adjoint, walked over all 16 pixels of a tile row at once and branch free (a pixel the splat did not
    reach gets mask 0, so its transmittance, colour sums and the splat's gradient sums do not change). With the
    channels unrolled, one loop per row writes only four arrays, which is what lets the compiler vectorise it
    (the general kernel's per-channel inner loop, or more written arrays, kept it scalar). Returns [G, 11]
    (float64 sums): the columns of :func:`rasterize_bwd` with D = 3; with ``removal`` (any non-None value, e.g.
    True) [G, 13] with its two removal columns. ``removal`` is a compile-time switch: numba compiles the None and
    the bool case separately and drops the untaken branch, so the training kernel carries no removal arithmetic
    and no branch.
    """
    G = means2d.shape[0]
    n_tiles = tiles_x * tiles_y
    M = ids.shape[0]
    NG = 11 if removal is None else 13
    P = TILE * TILE
    per_isect = np.zeros((M, NG), F)
    n_tot, per = _tile_split(n_cams * n_tiles, n_par)
    zero = F(0.0)
    one = F(1.0)
    half = F(0.5)
    two = F(2.0)
    a_max = F(ALPHA_MAX)
    for i in nb.prange(per * n_par):
        t = _bwd_tile(i, per, n_par, n_tot, offsets)
        if t < 0:
            continue
        start = offsets[t]
        cam, px0, py0, pw, ph = _tile_origin(t, n_tiles, tiles_x, width, height)
        lanes = np.arange(TILE).astype(F)
        Tl = np.ones(P, F)
        Tf = np.ones(P, F)
        va = np.zeros(P, F)  # dL/dA - bg . dL/dC
        lastf = np.full(P, -1.0, F)  # list position (from start) of the last contributor
        b0 = np.zeros(P, F)  # colour of everything behind, per channel
        b1 = np.zeros(P, F)
        b2 = np.zeros(P, F)
        o0 = np.zeros(P, F)  # dL/dC per channel
        o1 = np.zeros(P, F)
        o2 = np.zeros(P, F)
        # the splat's gradient sums per lane (columns of rasterize_bwd's row x 16 lanes), summed over its rows and
        # reduced across lanes once per splat: a scalar sum per column would be reduced across lanes every row
        A = np.zeros((11, TILE), F)
        bg0 = F(backgrounds[cam, 0])
        bg1 = F(backgrounds[cam, 1])
        bg2 = F(backgrounds[cam, 2])
        max_last = -1
        for ly in range(ph):
            for lx in range(pw):
                li = ly * TILE + lx
                py = py0 + ly
                px = px0 + lx
                Tl[li] = F(T_final[cam, py, px])
                Tf[li] = Tl[li]
                lk = last_ids[cam, py, px]
                lastf[li] = F(lk - start) if lk >= 0 else F(-1.0)
                if lk > max_last:
                    max_last = lk
                o0[li] = F(v_out[cam, py, px, 0])
                o1[li] = F(v_out[cam, py, px, 1])
                o2[li] = F(v_out[cam, py, px, 2])
                va[li] = F(v_alpha_out[cam, py, px]) - (bg0 * o0[li] + bg1 * o1[li] + bg2 * o2[li])
        for k in range(max_last, start - 1, -1):
            g = ids[k]
            mx, my, la, lb, ya, yb, hca, cb, cc, op, _, s_max = _load_lanes(
                means2d, conics, opacities, radii, g, k, px0, py0, pw, ph)
            if la > lb or ya > yb:
                continue
            mxl, hcaf, cbf, opf, kf = _lane_consts(mx, px0, hca, cb, op, k, start, F)
            ccf = F(cc)
            c0 = F(colors[g, 0])
            c1 = F(colors[g, 1])
            c2 = F(colors[g, 2])
            A[:, :] = zero
            rem_lin = zero
            rem_sq = zero
            for py in range(ya, yb + 1):
                dy64, dy, hy, bdy, base = _lane_row(py, py0, my, cb, cc, F)
                if not _row_reached(mx, dy64, hca, cb, cc, s_max, la, lb, px0):
                    continue
                for lx in range(TILE):
                    li = _lane(base + lx)
                    lq = _lane(lx)
                    dx = mxl - lanes[lq]
                    sigma = hcaf * dx * dx + bdy * dx + hy
                    vis = _exp(sigma, F)
                    a0 = opf * vis
                    alpha = min(a_max, a0)
                    ok = _row_mask(lx, la, lb, sigma, alpha, F) * _step(kf <= lastf[li], F)
                    am = alpha * ok
                    ra = one / (one - am)
                    T = Tl[li] * ra
                    Tl[li] = T
                    fac = am * T
                    e0 = o0[li]
                    e1 = o1[li]
                    e2 = o2[li]
                    q0 = b0[li]
                    q1 = b1[li]
                    q2 = b2[li]
                    A[8, lq] += fac * e0
                    A[9, lq] += fac * e1
                    A[10, lq] += fac * e2
                    v_alpha = ((c0 * T - q0 * ra) * e0 + (c1 * T - q1 * ra) * e1 + (c2 * T - q2 * ra) * e2
                               + Tf[li] * ra * va[li]) * ok
                    if removal is not None:  # the image change R = a (c T - (S + T_final bg) / (1 - a))
                        tf = Tf[li]
                        r0 = c0 * T - (q0 + tf * bg0) * ra
                        r1 = c1 * T - (q1 + tf * bg1) * ra
                        r2 = c2 * T - (q2 + tf * bg2) * ra
                        rem_sq += am * am * (r0 * r0 + r1 * r1 + r2 * r2)
                        rem_lin += am * v_alpha
                    b0[li] = q0 + c0 * fac
                    b1[li] = q1 + c1 * fac
                    b2[li] = q2 + c2 * fac
                    v_sigma = -a0 * v_alpha * _step(a0 <= a_max, F)  # no gradient where clamped
                    gx = v_sigma * (two * hcaf * dx + cbf * dy)  # 2 hca = ca exactly
                    gy = v_sigma * (cbf * dx + ccf * dy)
                    A[2, lq] += half * v_sigma * dx * dx
                    A[3, lq] += v_sigma * dx * dy
                    A[4, lq] += half * v_sigma * dy * dy
                    A[0, lq] += gx
                    A[1, lq] += gy
                    A[6, lq] += abs(gx)
                    A[7, lq] += abs(gy)
                    A[5, lq] += vis * v_alpha * _step(a0 <= a_max, F)
            for j in range(11):
                sj = zero
                for lx in range(TILE):
                    sj += A[j, lx]
                per_isect[k, j] = sj
            if removal is not None:
                per_isect[k, 11] = rem_lin
                per_isect[k, 12] = rem_sq
    return _sum_rows(ids, per_isect, G)
