"""numba kernels of the sparse training step (:mod:`splatflow.train.sparse`): which Gaussians a training window can
reach, and Adam on those rows only, with the updates the other rows missed applied when they are next touched.

Why: a training window of 60K pixels reaches a few thousand of the 120K Gaussians of a late step, yet the
activations, the projection's gradient buffers and Adam ran over all of them (about a third of the step).

:func:`window_candidates` works on the raw parameters (log scales, opacity logits), before any activation, with
the projection kernel's own cheap bound (:func:`._proj_kernels.project_fwd`: no 2D radius exceeds
``ext_max * sqrt(s_max^2 |J|_F^2 + eps2d) + 1``) plus a margin for float32 rounding, so it never drops a
Gaussian the projection would keep; the projection then culls the candidates exactly.

:func:`adam_rows` is torch's Adam (``amsgrad=False``, no weight decay; the same formula as its fused kernel) on the
rows a step touched. A row untouched since Adam count ``t0`` had zero gradients at counts ``t0+1 .. t-1``; dense
Adam decays its moments, ``m <- b1 m``, ``v <- b2 v``, and still moves it on them:
``p -= lr_c / (1 - b1^c) * b1^s m / (sqrt(b2^s v) / sqrt(1 - b2^c) + eps)`` at count ``c = t0 + s``.
While ``eps`` is negligible against ``sqrt(v)`` (``sqrt(v) > EPS_FREE * eps``) that sum is ``m / sqrt(v)`` times a
factor that depends only on the gap and its end, ``sum_s lr_c sqrt(1 - b2^c) / (1 - b1^c) rho^s`` with
``rho = b1 / sqrt(b2)``, tabulated once per call for every gap (:func:`gap_table`), so catching a row up costs a
few operations per value whatever its gap; otherwise (tiny ``v``) each term is summed, up to ``HORIZON`` skipped
counts (later terms are below ``rho^HORIZON`` < 3e-12 of the first). So the result equals dense Adam's up to float
rounding (the tests compare the two).
"""

from __future__ import annotations

import math

import numba as nb
import numpy as np

from ._proj_kernels import _persp_jacobian, _world_to_cam
from .constants import ALPHA_MIN, EXTEND_MAX

HORIZON = 256  # skipped Adam counts summed per row; rho^256 < 3e-12 for Adam's (0.9, 0.999)
EPS_FREE = 1e6  # sqrt(v) above this many eps: eps's share of the denominator is below 1e-6, the factored sum applies


@nb.njit(parallel=True, cache=True)
def window_candidates(means, log_scales, opacity_logits, viewmats, Ks, width, height, near, far, eps2d,
                      win_x0, win_y0, win_x1, win_y1):
    """``[N]`` uint8: 1 for each Gaussian that may reach the pixel rectangle ``[win_x0, win_x1) x [win_y0, win_y1)``
    of camera 0, by the projection kernel's cheap bound computed from the raw parameters, widened for rounding:
    the opacity test compares logits, and the extent is the largest one (``EXTEND_MAX`` sigmas) rather than the
    opacity's own, which spares an exp and a log per Gaussian for a few more candidates."""
    N = means.shape[0]
    out = np.zeros(N, np.uint8)
    logit_cut = math.log(ALPHA_MIN / (1.0 - ALPHA_MIN)) - 1e-4  # the projection compares float32 sigmoids
    for n in nb.prange(N):
        if not np.float64(opacity_logits[n]) >= logit_cut:
            continue
        px, py, pz = _world_to_cam(viewmats, 0, np.float64(means[n, 0]), np.float64(means[n, 1]),
                                   np.float64(means[n, 2]))
        if not (pz >= near and pz <= far):
            continue
        ls = max(np.float64(log_scales[n, 0]), np.float64(log_scales[n, 1]), np.float64(log_scales[n, 2]))
        s_max = math.exp(ls) * (1.0 + 1e-5)
        fx, fy, cx, cy, rz, _ux, _uy, _xf, _yf, J00, J02, J11, J12 = _persp_jacobian(Ks, 0, width, height, px, py, pz)
        r_max = (EXTEND_MAX * math.sqrt(s_max * s_max * (J00 * J00 + J02 * J02 + J11 * J11 + J12 * J12) + eps2d)
                 + 1.0) * (1.0 + 1e-5) + 1.0
        m2x = fx * px * rz + cx
        m2y = fy * py * rz + cy
        out[n] = not (m2x + r_max <= win_x0 or m2x - r_max >= win_x1 or m2y + r_max <= win_y0
                      or m2y - r_max >= win_y1)
    return out


@nb.njit(cache=True)
def gap_table(lr, bc1, bc2s, beta1, beta2, t_end, j_max):
    """Per gap j = 0..j_max ending at count ``t_end``: ``F[j]``, the factor of ``m / sqrt(v)`` that the zero-gradient
    counts ``t_end - j + 1 .. t_end`` move a parameter by (``sum_s lr_c sqrt(1 - b2^c) / (1 - b1^c) rho^s`` over
    ``c = t_end - j + s``, s = 1..j, by the recurrence ``F[j+1] = rho (a[t_end - j] + F[j])``), and the moments'
    decay ``b1^j``, ``b2^j``. One pass for every row that shares ``t_end``."""
    rho = beta1 / math.sqrt(beta2)
    F = np.zeros(j_max + 1, np.float64)
    B1 = np.ones(j_max + 1, np.float64)
    B2 = np.ones(j_max + 1, np.float64)
    for j in range(j_max):
        c = t_end - j
        F[j + 1] = rho * (lr[c] * bc2s[c] / bc1[c] + F[j])
        B1[j + 1] = B1[j] * beta1
        B2[j + 1] = B2[j] * beta2
    return F, B1, B2


@nb.njit(cache=True, inline="always")
def _needs_terms(m, v, r, v_free):
    """Whether row ``r`` has a value whose ``v`` is too small for the factored catch-up (eps matters)."""
    need = False
    for d in range(m.shape[1]):
        need |= (np.float64(v[r, d]) <= v_free) & (np.float64(m[r, d]) != 0.0)
    return need


@nb.njit(cache=True)
def _catch_up_terms(p, m, v, r, t0, t_end, lr, bc1, bc2s, beta1, beta2, eps):
    """Row ``r`` from count ``t0`` to ``t_end`` term by term (values whose tiny ``v`` makes eps matter)."""
    k = t_end - t0
    for d in range(p.shape[1]):
        m0 = np.float64(m[r, d])
        v0 = np.float64(v[r, d])
        acc = 0.0
        b1s = 1.0
        b2s = 1.0
        for s in range(1, min(k, HORIZON) + 1):
            c = t0 + s
            b1s *= beta1
            b2s *= beta2
            acc += lr[c] / bc1[c] * b1s * m0 / (math.sqrt(b2s * v0) / bc2s[c] + eps)
        p[r, d] = np.float64(p[r, d]) - acc
        m[r, d] = m0 * beta1 ** k
        v[r, d] = v0 * beta2 ** k


@nb.njit(cache=True, inline="always")
def _catch_up(p, m, v, r, k, F, B1, B2, v_free):
    """Row ``r`` over a gap of ``k`` zero-gradient counts, factored (every value's ``v`` above ``v_free``): branch
    free, so the loop over the row's values vectorises."""
    factor = np.float32(F[k])
    b1k = np.float32(B1[k])
    b2k = np.float32(B2[k])
    sq_free = np.float32(math.sqrt(v_free))
    for d in range(p.shape[1]):
        m0 = m[r, d]
        v0 = v[r, d]
        p[r, d] = p[r, d] - factor * m0 / max(np.sqrt(v0), sq_free)
        m[r, d] = m0 * b1k
        v[r, d] = v0 * b2k


@nb.njit(cache=True, inline="always")
def _bring_to(p, m, v, last, r, t_end, F, B1, B2, v_free, lr, bc1, bc2s, beta1, beta2, eps):
    """Catch row ``r`` up from ``last[r]`` to count ``t_end`` (nothing if it is current)."""
    k = t_end - last[r]
    if k > 0:
        if _needs_terms(m, v, r, v_free):
            _catch_up_terms(p, m, v, r, last[r], t_end, lr, bc1, bc2s, beta1, beta2, eps)
        else:
            _catch_up(p, m, v, r, k, F, B1, B2, v_free)


@nb.njit(cache=True, inline="always")
def _adam_row(p, m, v, r, g, j, b1, b2, step_size, inv_bc2s, eps):
    """One Adam count on row ``r`` with gradient row ``g[j]`` (``j < 0``: zero gradient), in float32 as torch's
    fused CPU kernel computes it; branch free inside, so the loop vectorises."""
    one_b1 = np.float32(1.0) - b1
    one_b2 = np.float32(1.0) - b2
    if j >= 0:
        for d in range(p.shape[1]):
            gd = g[j, d]
            md = m[r, d] + one_b1 * (gd - m[r, d])
            vd = b2 * v[r, d] + one_b2 * gd * gd
            m[r, d] = md
            v[r, d] = vd
            p[r, d] = p[r, d] - step_size * md / (np.sqrt(vd) * inv_bc2s + eps)
    else:
        for d in range(p.shape[1]):
            md = b1 * m[r, d]
            vd = b2 * v[r, d]
            m[r, d] = md
            v[r, d] = vd
            p[r, d] = p[r, d] - step_size * md / (np.sqrt(vd) * inv_bc2s + eps)


@nb.njit(parallel=True, cache=True)
def adam_rows(p, m, v, last, walk, gpos, g, t, lr, bc1, bc2s, beta1, beta2, eps):
    """Adam count ``t`` on the rows ``walk`` of ``p`` [N, D] (float32), row ``walk[j]`` with gradient ``g[gpos[j]]``
    (a zero gradient where ``gpos[j] < 0``), each first caught up from its count ``last[row]``; moments ``m``, ``v``
    [N, D] in place; ``last[walk] = t``. The caller walks the rows a step reached, or every row in order when it
    reached a large share of them (streaming through memory costs less than jumping).

    ``lr[c]``, ``bc1[c] = 1 - b1^c`` and ``bc2s[c] = sqrt(1 - b2^c)`` are per Adam count (index 0 unused)."""
    n = walk.shape[0]
    t0_min = t
    for j in range(n):
        t0_min = min(t0_min, last[walk[j]])
    F, B1, B2 = gap_table(lr, bc1, bc2s, beta1, beta2, t - 1, max(0, t - 1 - t0_min))
    v_free = (EPS_FREE * eps) ** 2
    step_size = np.float32(lr[t] / bc1[t])
    inv_bc2s = np.float32(1.0 / bc2s[t])
    b1, b2, e = np.float32(beta1), np.float32(beta2), np.float32(eps)
    for j in nb.prange(n):
        r = walk[j]
        _bring_to(p, m, v, last, r, t - 1, F, B1, B2, v_free, lr, bc1, bc2s, beta1, beta2, eps)
        _adam_row(p, m, v, r, g, gpos[j], b1, b2, step_size, inv_bc2s, e)
        last[r] = t


@nb.njit(parallel=True, cache=True)
def adam_catch_up(p, m, v, last, t, lr, bc1, bc2s, beta1, beta2, eps):
    """Bring every row of ``p`` [N, D] (and its moments) to Adam count ``t``, as if it had received zero gradients
    since its count ``last[row]``; ``last[:] = t``."""
    N = p.shape[0]
    t0_min = t
    for r in range(N):
        t0_min = min(t0_min, last[r])
    F, B1, B2 = gap_table(lr, bc1, bc2s, beta1, beta2, t, t - t0_min)
    v_free = (EPS_FREE * eps) ** 2
    n_blocks = (N + 255) // 256
    for blk in nb.prange(n_blocks):
        for r in range(blk * 256, min(N, blk * 256 + 256)):
            _bring_to(p, m, v, last, r, t, F, B1, B2, v_free, lr, bc1, bc2s, beta1, beta2, eps)
            last[r] = t
