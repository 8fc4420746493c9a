"""numba kernels: fused EWA projection + SH colour (forward) and their analytic backward, for the CPU backend.

Same math as :mod:`.projection` (which the torch oracle differentiates with autograd; the tests compare the two).
Forward runs in parallel over Gaussians and loops over cameras; backward recomputes the forward quantities of one
Gaussian and accumulates its gradient over cameras in registers, so it is race free without any reduction.
All arithmetic is float64: the per-Gaussian arrays come in the caller's dtype (float32 in training, float64 in
``gradcheck``; one compiled specialisation each) and every value is read into float64; outputs are in the
inputs' dtype, gradients float64.

Every step of the chain is a small inlined helper with its VJP twin next to it (``_load_gaussian`` /
``_load_gaussian_vjp``, ``_world_to_cam`` / ``_world_to_cam_vjp``, ...), and both kernels call the same forward
helpers, so the backward recomputes exactly what the forward computed.

Backward chain for one (camera, Gaussian) pair, with G = dL/d(conic) as a symmetric matrix:
conic = inverse(S2)            -> dL/dS2 = -Q G Q (Q = conic matrix)
comp = sqrt(det(S) / det(S2))  -> d/dS (antialiased mode only)
S = J Sc J^T                   -> dL/dSc = J^T V J, dL/dJ = 2 V J Sc
Sc = W Sigma W^T, p = W x + t  -> dL/dSigma = W^T (dL/dSc) W, dL/dx = W^T dL/dp
Sigma = M M^T, M = R(q) diag(s) -> dL/dM = 2 (dL/dSigma) M, then s and R(q/|q|)
SH(dir / |dir|)                -> basis derivatives, then the normalisation
"""

from __future__ import annotations

import math

import numba as nb
import numpy as np

from .constants import ALPHA_MIN, EXTEND_MAX, SH_C0, SH_C1, SH_C2, SH_C3

C20, C21, C22, C23, C24 = SH_C2
C30, C31, C32, C33, C34, C35, C36 = SH_C3


@nb.njit(cache=True, inline="always")
def _rotmat(w, x, y, z):
    return (
        1.0 - 2.0 * (y * y + z * z), 2.0 * (x * y - w * z), 2.0 * (x * z + w * y),
        2.0 * (x * y + w * z), 1.0 - 2.0 * (x * x + z * z), 2.0 * (y * z - w * x),
        2.0 * (x * z - w * y), 2.0 * (y * z + w * x), 1.0 - 2.0 * (x * x + y * y),
    )


@nb.njit(cache=True)
def _sh_bases(degree, x, y, z, out):
    out[0] = SH_C0
    if degree > 0:
        out[1] = -SH_C1 * y
        out[2] = SH_C1 * z
        out[3] = -SH_C1 * x
        if degree > 1:
            xx = x * x
            yy = y * y
            zz = z * z
            out[4] = C20 * x * y
            out[5] = C21 * y * z
            out[6] = C22 * (2.0 * zz - xx - yy)
            out[7] = C23 * x * z
            out[8] = C24 * (xx - yy)
            if degree > 2:
                out[9] = C30 * y * (3.0 * xx - yy)
                out[10] = C31 * x * y * z
                out[11] = C32 * y * (4.0 * zz - xx - yy)
                out[12] = C33 * z * (2.0 * zz - 3.0 * xx - 3.0 * yy)
                out[13] = C34 * x * (4.0 * zz - xx - yy)
                out[14] = C35 * z * (xx - yy)
                out[15] = C36 * x * (xx - 3.0 * yy)


@nb.njit(cache=True)
def _sh_bases_vjp(degree, x, y, z, vb):
    """Gradient w.r.t. the unit direction (x, y, z) given dL/d(basis) ``vb``."""
    gx = 0.0
    gy = 0.0
    gz = 0.0
    if degree > 0:
        gy += -SH_C1 * vb[1]
        gz += SH_C1 * vb[2]
        gx += -SH_C1 * vb[3]
        if degree > 1:
            xx = x * x
            yy = y * y
            zz = z * z
            gx += C20 * y * vb[4]
            gy += C20 * x * vb[4]
            gy += C21 * z * vb[5]
            gz += C21 * y * vb[5]
            gx += -2.0 * C22 * x * vb[6]
            gy += -2.0 * C22 * y * vb[6]
            gz += 4.0 * C22 * z * vb[6]
            gx += C23 * z * vb[7]
            gz += C23 * x * vb[7]
            gx += 2.0 * C24 * x * vb[8]
            gy += -2.0 * C24 * y * vb[8]
            if degree > 2:
                gx += 6.0 * C30 * x * y * vb[9]
                gy += C30 * (3.0 * xx - 3.0 * yy) * vb[9]
                gx += C31 * y * z * vb[10]
                gy += C31 * x * z * vb[10]
                gz += C31 * x * y * vb[10]
                gx += -2.0 * C32 * x * y * vb[11]
                gy += C32 * (4.0 * zz - xx - 3.0 * yy) * vb[11]
                gz += 8.0 * C32 * y * z * vb[11]
                gx += -6.0 * C33 * x * z * vb[12]
                gy += -6.0 * C33 * y * z * vb[12]
                gz += C33 * (6.0 * zz - 3.0 * xx - 3.0 * yy) * vb[12]
                gx += C34 * (4.0 * zz - 3.0 * xx - yy) * vb[13]
                gy += -2.0 * C34 * x * y * vb[13]
                gz += 8.0 * C34 * x * z * vb[13]
                gx += 2.0 * C35 * x * z * vb[14]
                gy += -2.0 * C35 * y * z * vb[14]
                gz += C35 * (xx - yy) * vb[14]
                gx += C36 * (3.0 * xx - 3.0 * yy) * vb[15]
                gy += -6.0 * C36 * x * y * vb[15]
    return gx, gy, gz


@nb.njit(cache=True, inline="always")
def _mmt(A, B, out):
    """out = A @ B^T for 3x3 (small loops: no BLAS call, no temporaries inside parallel loops)."""
    for i in range(3):
        for k in range(3):
            out[i, k] = A[i, 0] * B[k, 0] + A[i, 1] * B[k, 1] + A[i, 2] * B[k, 2]


@nb.njit(cache=True, inline="always")
def _sandwich(V, c, S, tmp, out):
    """out = W S W^T with W = V[c, :3, :3] (tmp: 3x3 scratch)."""
    for i in range(3):
        for l in range(3):
            tmp[i, l] = V[c, i, 0] * S[0, l] + V[c, i, 1] * S[1, l] + V[c, i, 2] * S[2, l]
    for i in range(3):
        for k in range(3):
            out[i, k] = tmp[i, 0] * V[c, k, 0] + tmp[i, 1] * V[c, k, 1] + tmp[i, 2] * V[c, k, 2]


@nb.njit(cache=True, inline="always")
def _sandwich_t_add(V, c, S, tmp, out):
    """out += W^T S W with W = V[c, :3, :3]."""
    for i in range(3):
        for l in range(3):
            tmp[i, l] = V[c, 0, i] * S[0, l] + V[c, 1, i] * S[1, l] + V[c, 2, i] * S[2, l]
    for i in range(3):
        for k in range(3):
            out[i, k] += tmp[i, 0] * V[c, 0, k] + tmp[i, 1] * V[c, 1, k] + tmp[i, 2] * V[c, 2, k]


@nb.njit(cache=True, inline="always")
def _load_gaussian(means, quats, scales, opacities, n, R, M, Sig):
    """Gaussian n: unit quaternion (w, x, y, z) and |q|, mean and opacity; its rotation (row major, 9 entries),
    M = R diag(s) and Sigma = M M^T are written into R, M and Sig (scratch arrays: numba's array analysis
    rejects a tuple returned through two inlined levels)."""
    qw = np.float64(quats[n, 0])
    qx = np.float64(quats[n, 1])
    qy = np.float64(quats[n, 2])
    qz = np.float64(quats[n, 3])
    qnorm = math.sqrt(qw * qw + qx * qx + qy * qy + qz * qz)
    qnorm = max(qnorm, 1e-12)  # F.normalize's eps
    w = qw / qnorm
    x = qx / qnorm
    y = qy / qnorm
    z = qz / qnorm
    r = _rotmat(w, x, y, z)
    for i in range(9):
        R[i] = r[i]
    for i in range(3):
        for j in range(3):
            M[i, j] = R[3 * i + j] * np.float64(scales[n, j])
    _mmt(M, M, Sig)
    mx = np.float64(means[n, 0])
    my = np.float64(means[n, 1])
    mz = np.float64(means[n, 2])
    return w, x, y, z, qnorm, mx, my, mz, np.float64(opacities[n])


@nb.njit(cache=True, inline="always")
def _load_gaussian_vjp(vSig, M, R, w, x, y, z, qnorm, scales, n, vR, g_scales, g_quats):
    """Adjoint of :func:`_load_gaussian` for Sigma: dL/dM = 2 vSig M (vSig symmetric), then the scales and,
    through R(q / |q|), the raw quaternion (written into row n of g_scales and g_quats)."""
    for i in range(3):
        for j in range(3):
            vMij = 2.0 * (vSig[i, 0] * M[0, j] + vSig[i, 1] * M[1, j] + vSig[i, 2] * M[2, j])
            g_scales[n, j] += vMij * R[3 * i + j]
            vR[3 * i + j] = vMij * np.float64(scales[n, j])
    V00, V01, V02, V10, V11, V12, V20, V21, V22 = vR[0], vR[1], vR[2], vR[3], vR[4], vR[5], vR[6], vR[7], vR[8]
    dw = 2.0 * (-z * V01 + y * V02 + z * V10 - x * V12 - y * V20 + x * V21)
    dx_ = 2.0 * (y * V01 + z * V02 + y * V10 - 2.0 * x * V11 - w * V12 + z * V20 + w * V21 - 2.0 * x * V22)
    dy_ = 2.0 * (-2.0 * y * V00 + x * V01 + w * V02 + x * V10 + z * V12 - w * V20 + z * V21 - 2.0 * y * V22)
    dz_ = 2.0 * (-2.0 * z * V00 - w * V01 + x * V02 + w * V10 - 2.0 * z * V11 + y * V12 + x * V20 + y * V21)
    dot = dw * w + dx_ * x + dy_ * y + dz_ * z
    g_quats[n, 0] = (dw - w * dot) / qnorm
    g_quats[n, 1] = (dx_ - x * dot) / qnorm
    g_quats[n, 2] = (dy_ - y * dot) / qnorm
    g_quats[n, 3] = (dz_ - z * dot) / qnorm


@nb.njit(cache=True, inline="always")
def _world_to_cam(viewmats, c, mx, my, mz):
    """Camera-space mean p = W m + t of camera c."""
    V = viewmats
    return (V[c, 0, 0] * mx + V[c, 0, 1] * my + V[c, 0, 2] * mz + V[c, 0, 3],
            V[c, 1, 0] * mx + V[c, 1, 1] * my + V[c, 1, 2] * mz + V[c, 1, 3],
            V[c, 2, 0] * mx + V[c, 2, 1] * my + V[c, 2, 2] * mz + V[c, 2, 3])


@nb.njit(cache=True, inline="always")
def _world_to_cam_vjp(viewmats, c, vpx, vpy, vpz):
    """dL/dm = W^T dL/dp (the covariance part, Sc = W Sigma W^T, is :func:`_sandwich_t_add`)."""
    V = viewmats
    return (V[c, 0, 0] * vpx + V[c, 1, 0] * vpy + V[c, 2, 0] * vpz,
            V[c, 0, 1] * vpx + V[c, 1, 1] * vpy + V[c, 2, 1] * vpz,
            V[c, 0, 2] * vpx + V[c, 1, 2] * vpy + V[c, 2, 2] * vpz)


@nb.njit(cache=True, inline="always")
def _persp_jacobian(Ks, c, width, height, px, py, pz):
    """Pinhole intrinsics of camera c and the Jacobian of the projection at p, taken with x/z and y/z clamped to
    1.3x the field of view. Returns fx, fy, cx, cy, rz = 1/z, the clamped ux, uy, whether each was left
    unclamped (x_free, y_free), and J's non-zero entries J00, J02, J11, J12."""
    fx = np.float64(Ks[c, 0, 0])
    fy = np.float64(Ks[c, 1, 1])
    cx = np.float64(Ks[c, 0, 2])
    cy = np.float64(Ks[c, 1, 2])
    tan_fovx = 0.5 * width / fx
    tan_fovy = 0.5 * height / fy
    lim_xp = (width - cx) / fx + 0.3 * tan_fovx
    lim_xn = cx / fx + 0.3 * tan_fovx
    lim_yp = (height - cy) / fy + 0.3 * tan_fovy
    lim_yn = cy / fy + 0.3 * tan_fovy
    rz = 1.0 / pz
    ux_raw = px * rz
    uy_raw = py * rz
    ux = min(lim_xp, max(-lim_xn, ux_raw))
    uy = min(lim_yp, max(-lim_yn, uy_raw))
    x_free = ux_raw <= lim_xp and ux_raw >= -lim_xn
    y_free = uy_raw <= lim_yp and uy_raw >= -lim_yn
    return fx, fy, cx, cy, rz, ux, uy, x_free, y_free, fx * rz, -fx * ux * rz, fy * rz, -fy * uy * rz


@nb.njit(cache=True, inline="always")
def _persp_jacobian_vjp(fx, fy, rz, px, py, ux, uy, x_free, y_free, vJ00, vJ02, vJ11, vJ12, v_m2x, v_m2y, v_depth):
    """dL/dp from the gradients of J's entries, of the 2D mean (fx px / pz + cx, fy py / pz + cy) and of the
    depth pz (the clamped ux, uy pass no gradient to p)."""
    rz2 = rz * rz
    vpx = fx * rz * v_m2x
    vpy = fy * rz * v_m2y
    vpz = -fx * px * rz2 * v_m2x - fy * py * rz2 * v_m2y + v_depth
    vpz += -fx * rz2 * vJ00 - fy * rz2 * vJ11
    # J02 = -fx * ux / pz
    vpz += fx * ux * rz2 * vJ02
    if x_free:  # ux = px / pz
        vpx += -fx * rz * rz * vJ02
        vpz += -fx * rz * (-px * rz2) * vJ02
    vpz += fy * uy * rz2 * vJ12
    if y_free:
        vpy += -fy * rz * rz * vJ12
        vpz += -fy * rz * (-py * rz2) * vJ12
    return vpx, vpy, vpz


@nb.njit(cache=True, inline="always")
def _cov2d(J00, J02, J11, J12, Sc):
    """cov2d = J Sc J^T with J = [[J00, 0, J02], [0, J11, J12]]: its entries a, b, c (before the eps2d filter)."""
    a0 = J00 * J00 * Sc[0, 0] + 2.0 * J00 * J02 * Sc[0, 2] + J02 * J02 * Sc[2, 2]
    b0 = J00 * J11 * Sc[0, 1] + J00 * J12 * Sc[0, 2] + J02 * J11 * Sc[2, 1] + J02 * J12 * Sc[2, 2]
    c0 = J11 * J11 * Sc[1, 1] + 2.0 * J11 * J12 * Sc[1, 2] + J12 * J12 * Sc[2, 2]
    return a0, b0, c0


@nb.njit(cache=True, inline="always")
def _cov2d_vjp(J00, J02, J11, J12, Sc, V00, V01, V11, vSc):
    """For V = dL/dcov2d (symmetric): dL/dSc = J^T V J (written into vSc); returns dL/dJ = 2 V J Sc's entries
    at J00, J02, J11, J12."""
    j0 = (J00, 0.0, J02)
    j1 = (0.0, J11, J12)
    for i in range(3):
        for k in range(3):
            vSc[i, k] = V00 * j0[i] * j0[k] + V01 * (j0[i] * j1[k] + j1[i] * j0[k]) + V11 * j1[i] * j1[k]
    js00 = J00 * Sc[0, 0] + J02 * Sc[2, 0]
    js01 = J00 * Sc[0, 1] + J02 * Sc[2, 1]
    js02 = J00 * Sc[0, 2] + J02 * Sc[2, 2]
    js10 = J11 * Sc[1, 0] + J12 * Sc[2, 0]
    js11 = J11 * Sc[1, 1] + J12 * Sc[2, 1]
    js12 = J11 * Sc[1, 2] + J12 * Sc[2, 2]
    return (2.0 * (V00 * js00 + V01 * js10), 2.0 * (V00 * js02 + V01 * js12),
            2.0 * (V01 * js01 + V11 * js11), 2.0 * (V01 * js02 + V11 * js12))


@nb.njit(cache=True, inline="always")
def _conic(a0, b0, c0, eps2d):
    """The eps2d-filtered covariance (a, b0, cc), its determinant, and det(S) / det(S + eps I) (the square of the
    antialiasing compensation; 0 when the filtered covariance is not positive definite)."""
    a = a0 + eps2d
    cc = c0 + eps2d
    det = a * cc - b0 * b0
    r = (a0 * c0 - b0 * b0) / det if det > 0.0 else 0.0
    return a, cc, det, r


@nb.njit(cache=True, inline="always")
def _conic_vjp(a0, b0, c0, a, cc, det, r, op, antialiased, v_op_eff, gA, gB, gC):
    """Adjoint of :func:`_conic` and the compensation: returns dL/d(a0, b0, c0) as (v_a, v_b, v_c) for a symmetric
    b (both off-diagonal entries) and dL/d(opacity), from dL/d(conic) (gA, 2 gB, gC) and dL/d(compensated
    opacity). conic = inverse(S2) -> dL/dS2 = -Q G Q with G = [[gA, gB], [gB, gC]]."""
    v_a = 0.0
    v_b = 0.0
    v_c = 0.0
    gop = 0.0
    if antialiased:
        if r > 0.0:
            comp = math.sqrt(r)
            gop = v_op_eff * comp
            v_r = v_op_eff * op * 0.5 / comp
            v_a += v_r * (c0 - r * cc) / det
            v_c += v_r * (a0 - r * a) / det
            v_b += v_r * (-2.0 * b0 * (1.0 - r)) / det
    else:
        gop = v_op_eff
    QA = cc / det
    QB = -b0 / det
    QC = a / det
    # T = G Q
    T00 = gA * QA + gB * QB
    T01 = gA * QB + gB * QC
    T10 = gB * QA + gC * QB
    T11 = gB * QB + gC * QC
    # -Q T
    v_a += -(QA * T00 + QB * T10)
    v_c += -(QB * T01 + QC * T11)
    v_b += -((QA * T01 + QB * T11) + (QB * T00 + QC * T10))
    return v_a, v_b, v_c, gop


@nb.njit(cache=True, inline="always")
def _view_bases(sh_degree, mx, my, mz, campos, c, bases):
    """SH bases at the unit direction from camera c to the mean (into ``bases``); returns that direction and
    1 / distance (zeros for degree 0, whose only basis is constant)."""
    if sh_degree > 0:
        dx = mx - campos[c, 0]
        dy = my - campos[c, 1]
        dz = mz - campos[c, 2]
        inv = 1.0 / max(math.sqrt(dx * dx + dy * dy + dz * dz), 1e-12)
        ex = dx * inv
        ey = dy * inv
        ez = dz * inv
        _sh_bases(sh_degree, ex, ey, ez, bases)
        return ex, ey, ez, inv
    bases[0] = SH_C0
    return 0.0, 0.0, 0.0, 0.0


@nb.njit(cache=True, inline="always")
def _sh_coef(sh0, shN, n, k, ch):
    """SH coefficient k of channel ch, from the two tensors the model stores (band 0 in ``sh0 [N, 1, 3]``, the
    others in ``shN [N, K-1, 3]``), so training never joins them into one array."""
    if k == 0:
        return np.float64(sh0[n, 0, ch])
    return np.float64(shN[n, k - 1, ch])


@nb.njit(cache=True, inline="always")
def _sh_channel(bases, sh0, shN, n, ch, nb_):
    """Unclamped colour of channel ch: 0.5 + sum_k basis_k sh_k[n, ch] (the colour is its positive part)."""
    v = 0.0
    for k in range(nb_):
        v += bases[k] * _sh_coef(sh0, shN, n, k, ch)
    return v + 0.5


@nb.njit(cache=True, inline="always")
def _sh_color(sh_degree, mx, my, mz, campos, c, sh0, shN, n, bases, colors):
    """colors[c, n] = max(0, 0.5 + SH(direction from camera c))."""
    _view_bases(sh_degree, mx, my, mz, campos, c, bases)
    nb_ = (sh_degree + 1) * (sh_degree + 1)
    for ch in range(3):
        colors[c, n, ch] = max(_sh_channel(bases, sh0, shN, n, ch, nb_), 0.0)


@nb.njit(cache=True, inline="always")
def _sh_color_vjp(sh_degree, mx, my, mz, campos, c, sh0, shN, n, bases, vb, v_colors, g_sh0, g_shN):
    """Adjoint of :func:`_sh_color`: adds dL/dsh into g_sh0[n] and g_shN[n] and returns dL/dmean through the view
    direction."""
    ex, ey, ez, inv = _view_bases(sh_degree, mx, my, mz, campos, c, bases)
    nb_ = (sh_degree + 1) * (sh_degree + 1)
    for k in range(nb_):
        vb[k] = 0.0
    for ch in range(3):
        if _sh_channel(bases, sh0, shN, n, ch, nb_) > 0.0:
            gcol = np.float64(v_colors[c, n, ch])
            g_sh0[n, 0, ch] += bases[0] * gcol
            vb[0] += np.float64(sh0[n, 0, ch]) * gcol
            for k in range(1, nb_):
                g_shN[n, k - 1, ch] += bases[k] * gcol
                vb[k] += np.float64(shN[n, k - 1, ch]) * gcol
    if sh_degree == 0:
        return 0.0, 0.0, 0.0
    gx, gy, gz = _sh_bases_vjp(sh_degree, ex, ey, ez, vb)
    dot = gx * ex + gy * ey + gz * ez
    return (gx - ex * dot) * inv, (gy - ey * dot) * inv, (gz - ez * dot) * inv


@nb.njit(parallel=True, cache=True)
def project_fwd(means, quats, scales, opacities, sh0, shN, sh_degree, viewmats, Ks, campos, width, height,
                near, far, eps2d, antialiased, radius_clip, win_x0, win_y0, win_x1, win_y1):
    """Forward projection + colour for all (camera, Gaussian) pairs.

    ``sh0`` [N, 1, 3] and ``shN`` [N, K-1, 3] are the SH bands as the model stores them (ignored when
    ``sh_degree < 0``). Returns means2d [C, N, 2], conics [C, N, 3], depths [C, N], opacities [C, N], colors [C, N, 3], radii [C, N, 2] int32; culled pairs hold zeros.
    A Gaussian whose rectangle misses the pixel rectangle ``[win_x0, win_x1) x [win_y0, win_y1)`` (the whole view,
    or the training window) is culled before its colour is evaluated, so a window costs its own Gaussians only;
    the Jacobian's clamp still uses the whole ``width`` x ``height`` view.
    """
    N = means.shape[0]
    C = viewmats.shape[0]
    dt = means.dtype
    means2d = np.zeros((C, N, 2), dt)
    conics = np.zeros((C, N, 3), dt)
    depths = np.zeros((C, N), dt)
    opac_out = np.zeros((C, N), dt)
    colors = np.zeros((C, N, 3), dt)
    radii = np.zeros((C, N, 2), np.int32)
    n_blocks = (N + 127) // 128  # per-block scratch arrays: no allocation per Gaussian
    for blk in nb.prange(n_blocks):
        bases = np.zeros(16, np.float64)
        R = np.empty(9, np.float64)
        M = np.empty((3, 3), np.float64)
        Sig = np.empty((3, 3), np.float64)
        Sc = np.empty((3, 3), np.float64)
        tmp = np.empty((3, 3), np.float64)
        for n in range(blk * 128, min(N, blk * 128 + 128)):
            op = np.float64(opacities[n])
            if not op >= ALPHA_MIN:  # the (antialiased) opacity only gets smaller: culled in every camera
                continue
            mx = np.float64(means[n, 0])
            my = np.float64(means[n, 1])
            mz = np.float64(means[n, 2])
            s_max = max(np.float64(scales[n, 0]), np.float64(scales[n, 1]), np.float64(scales[n, 2]))
            ext_max = min(EXTEND_MAX, math.sqrt(2.0 * math.log(op / ALPHA_MIN)))
            loaded = False
            for c in range(C):
                px, py, pz = _world_to_cam(viewmats, c, mx, my, mz)
                if not (pz >= near and pz <= far):
                    continue
                fx, fy, cx, cy, rz, _ux, _uy, _xf, _yf, J00, J02, J11, J12 = _persp_jacobian(
                    Ks, c, width, height, px, py, pz)
                # cheap cull before the covariance: the 2D covariance J W Sigma W^T J^T has no eigenvalue above
                # s_max^2 |J|_F^2, so no radius can exceed r_max; a Gaussian that misses the window by more is out
                r_max = ext_max * math.sqrt(s_max * s_max * (J00 * J00 + J02 * J02 + J11 * J11 + J12 * J12)
                                            + eps2d) + 1.0
                m2x = fx * px * rz + cx
                m2y = fy * py * rz + cy
                if m2x + r_max <= win_x0 or m2x - r_max >= win_x1 or m2y + r_max <= win_y0 or m2y - r_max >= win_y1:
                    continue
                if not loaded:
                    _load_gaussian(means, quats, scales, opacities, n, R, M, Sig)
                    loaded = True
                _sandwich(viewmats, c, Sig, tmp, Sc)
                a0, b0, c0 = _cov2d(J00, J02, J11, J12, Sc)
                a, cc, det, r = _conic(a0, b0, c0, eps2d)
                if not det > 0.0:
                    continue
                opc = op
                if antialiased:
                    opc = op * math.sqrt(r) if r > 0.0 else 0.0
                if opc < ALPHA_MIN:
                    continue
                extend = min(EXTEND_MAX, math.sqrt(2.0 * math.log(opc / ALPHA_MIN)))
                rad_x = math.ceil(extend * math.sqrt(max(a, 0.0)))
                rad_y = math.ceil(extend * math.sqrt(max(cc, 0.0)))
                if rad_x <= radius_clip and rad_y <= radius_clip:
                    continue
                if m2x + rad_x <= win_x0 or m2x - rad_x >= win_x1 or m2y + rad_y <= win_y0 or m2y - rad_y >= win_y1:
                    continue
                means2d[c, n, 0] = m2x
                means2d[c, n, 1] = m2y
                conics[c, n, 0] = cc / det
                conics[c, n, 1] = -b0 / det
                conics[c, n, 2] = a / det
                depths[c, n] = pz
                opac_out[c, n] = opc
                radii[c, n, 0] = int(rad_x)
                radii[c, n, 1] = int(rad_y)
                if sh_degree >= 0:
                    _sh_color(sh_degree, mx, my, mz, campos, c, sh0, shN, n, bases, colors)
    return means2d, conics, depths, opac_out, colors, radii


@nb.njit(parallel=True, cache=True)
def project_bwd(means, quats, scales, opacities, sh0, shN, sh_degree, viewmats, Ks, campos, width, height,
                eps2d, antialiased, radii, v_means2d, v_conics, v_depths, v_opac, v_colors):
    """Gradients w.r.t. means [N, 3], quats [N, 4], scales [N, 3], opacities [N], sh0 [N, 1, 3] and shN
    [N, K-1, 3], in the dtype of
    ``means`` (sums over cameras are kept in float64 per Gaussian; the arrays are what autograd receives, so a
    float32 run fills and hands over float32 buffers, not float64 ones to convert)."""
    N = means.shape[0]
    C = viewmats.shape[0]
    gt = means.dtype
    g_means = np.zeros((N, 3), gt)
    g_quats = np.zeros((N, 4), gt)
    g_scales = np.zeros((N, 3), gt)
    g_opac = np.zeros(N, gt)
    g_sh0 = np.zeros(sh0.shape, gt)
    g_shN = np.zeros(shN.shape, gt)
    n_blocks = (N + 127) // 128  # per-block scratch arrays: no allocation per Gaussian
    for blk in nb.prange(n_blocks):
        bases = np.zeros(16, np.float64)
        vb = np.zeros(16, np.float64)
        R = np.empty(9, np.float64)
        M = np.empty((3, 3), np.float64)
        Sig = np.empty((3, 3), np.float64)
        Sc = np.empty((3, 3), np.float64)
        tmp = np.empty((3, 3), np.float64)
        vSc = np.empty((3, 3), np.float64)
        vR = np.empty(9, np.float64)
        vSig = np.zeros((3, 3), np.float64)
        for n in range(blk * 128, min(N, blk * 128 + 128)):
            seen = False
            for c in range(C):
                if radii[c, n, 0] > 0 and radii[c, n, 1] > 0:
                    seen = True
                    break
            if not seen:  # culled in every camera (most Gaussians, with a training window): zero gradients
                continue
            w, x, y, z, qnorm, mx, my, mz, op = _load_gaussian(means, quats, scales, opacities, n, R, M, Sig)
            vSig[:, :] = 0.0  # dL/dSigma summed over cameras
            gmx = 0.0
            gmy = 0.0
            gmz = 0.0
            gop = 0.0
            for c in range(C):
                if radii[c, n, 0] <= 0 or radii[c, n, 1] <= 0:
                    continue
                px, py, pz = _world_to_cam(viewmats, c, mx, my, mz)
                _sandwich(viewmats, c, Sig, tmp, Sc)
                fx, fy, _cx, _cy, rz, ux, uy, x_free, y_free, J00, J02, J11, J12 = _persp_jacobian(
                    Ks, c, width, height, px, py, pz)
                a0, b0, c0 = _cov2d(J00, J02, J11, J12, Sc)
                a, cc, det, r = _conic(a0, b0, c0, eps2d)
                v_a, v_b, v_c, g_op_c = _conic_vjp(
                    a0, b0, c0, a, cc, det, r, op, antialiased, np.float64(v_opac[c, n]),
                    np.float64(v_conics[c, n, 0]), 0.5 * np.float64(v_conics[c, n, 1]), np.float64(v_conics[c, n, 2]))
                gop += g_op_c
                vJ00, vJ02, vJ11, vJ12 = _cov2d_vjp(J00, J02, J11, J12, Sc, v_a, 0.5 * v_b, v_c, vSc)
                vpx, vpy, vpz = _persp_jacobian_vjp(
                    fx, fy, rz, px, py, ux, uy, x_free, y_free, vJ00, vJ02, vJ11, vJ12,
                    np.float64(v_means2d[c, n, 0]), np.float64(v_means2d[c, n, 1]), np.float64(v_depths[c, n]))
                gx, gy, gz = _world_to_cam_vjp(viewmats, c, vpx, vpy, vpz)
                gmx += gx
                gmy += gy
                gmz += gz
                _sandwich_t_add(viewmats, c, vSc, tmp, vSig)
                if sh_degree >= 0:
                    gx, gy, gz = _sh_color_vjp(sh_degree, mx, my, mz, campos, c, sh0, shN, n, bases, vb, v_colors,
                                               g_sh0, g_shN)
                    gmx += gx
                    gmy += gy
                    gmz += gz
            g_means[n, 0] = gmx
            g_means[n, 1] = gmy
            g_means[n, 2] = gmz
            g_opac[n] = gop
            _load_gaussian_vjp(vSig, M, R, w, x, y, z, qnorm, scales, n, vR, g_scales, g_quats)
    return g_means, g_quats, g_scales, g_opac, g_sh0, g_shN
