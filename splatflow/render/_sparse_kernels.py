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
factor shared by the whole row, ``sum_s lr_c sqrt(1 - b2^c) / (1 - b1^c) rho^s`` with ``rho = b1 / sqrt(b2)``;
otherwise each term is summed. Terms beyond ``HORIZON`` skipped counts are below ``rho^HORIZON`` (< 3e-12) of the
first and left out. So the result equals dense Adam's up to float rounding (the tests compare the two).
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
    of camera 0, by the projection kernel's cheap bound computed from the raw parameters, widened for rounding."""
    N = means.shape[0]
    out = np.zeros(N, np.uint8)
    alpha_cut = ALPHA_MIN * (1.0 - 1e-4)  # the projection compares float32 sigmoids: keep borderline ones
    for n in nb.prange(N):
        op = 1.0 / (1.0 + math.exp(-np.float64(opacity_logits[n])))
        if not op >= alpha_cut:
            continue
        mx = np.float64(means[n, 0])
        my = np.float64(means[n, 1])
        mz = np.float64(means[n, 2])
        px, py, pz = _world_to_cam(viewmats, 0, mx, my, mz)
        if not (pz >= near and pz <= far):
            continue
        ls = max(np.float64(log_scales[n, 0]), np.float64(log_scales[n, 1]), np.float64(log_scales[n, 2]))
        s_max = math.exp(ls) * (1.0 + 1e-5)
        ext_max = min(EXTEND_MAX, math.sqrt(2.0 * math.log(max(op * (1.0 + 1e-4), ALPHA_MIN) / ALPHA_MIN)))
        fx, fy, cx, cy, rz, _ux, _uy, _xf, _yf, J00, J02, J11, J12 = _persp_jacobian(Ks, 0, width, height, px, py, pz)
        r_max = (ext_max * math.sqrt(s_max * s_max * (J00 * J00 + J02 * J02 + J11 * J11 + J12 * J12) + eps2d)
                 + 1.0) * (1.0 + 1e-5) + 1.0
        m2x = fx * px * rz + cx
        m2y = fy * py * rz + cy
        if m2x + r_max <= win_x0 or m2x - r_max >= win_x1 or m2y + r_max <= win_y0 or m2y - r_max >= win_y1:
            continue
        out[n] = 1
    return out


@nb.njit(cache=True, inline="always")
def _catch_up(p, m, v, r, t0, t_end, lr, bc1, bc2s, beta1, beta2, eps, rho_pows):
    """Bring row ``r`` from Adam count ``t0`` to ``t_end`` with zero gradients (see the module docstring)."""
    k = t_end - t0
    if k <= 0:
        return
    kk = min(k, HORIZON)
    factor = 0.0
    for s in range(1, kk + 1):
        c = t0 + s
        factor += lr[c] * bc2s[c] / bc1[c] * rho_pows[s]  # lr_c sqrt(1 - b2^c) / (1 - b1^c) rho^s
    b1k = beta1 ** k
    b2k = beta2 ** k
    for d in range(p.shape[1]):
        m0 = np.float64(m[r, d])
        v0 = np.float64(v[r, d])
        if m0 != 0.0:
            sv = math.sqrt(v0)
            if sv > EPS_FREE * eps:
                p[r, d] = np.float64(p[r, d]) - factor * m0 / sv
            else:  # eps matters: each skipped update on its own
                acc = 0.0
                b1s = 1.0
                b2s = 1.0
                for s in range(1, kk + 1):
                    c = t0 + s
                    b1s *= beta1
                    b2s *= beta2
                    acc += lr[c] / bc1[c] * b1s * m0 / (math.sqrt(b2s * v0) / bc2s[c] + eps)
                p[r, d] = np.float64(p[r, d]) - acc
        m[r, d] = m0 * b1k
        v[r, d] = v0 * b2k


@nb.njit(cache=True)
def _rho_powers(beta1, beta2):
    """``rho^s`` for s = 0..HORIZON, ``rho = b1 / sqrt(b2)``."""
    rho = beta1 / math.sqrt(beta2)
    out = np.empty(HORIZON + 1, np.float64)
    out[0] = 1.0
    for s in range(1, HORIZON + 1):
        out[s] = out[s - 1] * rho
    return out


@nb.njit(parallel=True, cache=True)
def adam_rows(p, m, v, last, rows, g, t, lr, bc1, bc2s, beta1, beta2, eps):
    """Adam count ``t`` on rows ``rows`` of ``p`` [N, D] with gradients ``g`` [len(rows), D], after catching each
    row up from its count ``last[row]``; moments ``m``, ``v`` [N, D] in place; ``last[rows] = t``.

    ``lr[c]``, ``bc1[c] = 1 - b1^c`` and ``bc2s[c] = sqrt(1 - b2^c)`` are per Adam count (index 0 unused)."""
    rho_pows = _rho_powers(beta1, beta2)
    n = rows.shape[0]
    D = p.shape[1]
    step_size = lr[t] / bc1[t]
    for j in nb.prange(n):
        r = rows[j]
        _catch_up(p, m, v, r, last[r], t - 1, lr, bc1, bc2s, beta1, beta2, eps, rho_pows)
        for d in range(D):
            gd = np.float64(g[j, d])
            md = beta1 * np.float64(m[r, d]) + (1.0 - beta1) * gd
            vd = beta2 * np.float64(v[r, d]) + (1.0 - beta2) * gd * gd
            m[r, d] = md
            v[r, d] = vd
            p[r, d] = np.float64(p[r, d]) - step_size * md / (math.sqrt(vd) / bc2s[t] + eps)
        last[r] = t


@nb.njit(parallel=True, cache=True)
def adam_catch_up(p, m, v, last, t, lr, bc1, bc2s, beta1, beta2, eps):
    """Bring every row of ``p`` [N, D] (and its moments) to Adam count ``t``, as if it had received zero gradients
    since its count ``last[row]``; ``last[:] = t``."""
    rho_pows = _rho_powers(beta1, beta2)
    N = p.shape[0]
    n_blocks = (N + 255) // 256
    for blk in nb.prange(n_blocks):
        for r in range(blk * 256, min(N, blk * 256 + 256)):
            if last[r] < t:
                _catch_up(p, m, v, r, last[r], t, lr, bc1, bc2s, beta1, beta2, eps, rho_pows)
                last[r] = t
