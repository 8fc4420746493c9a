"""numba kernels: fused EWA projection + SH colour (forward) and their analytic backward, for the CPU backend.

Same math as :mod:`.projection` (which the torch oracle differentiates with autograd; the tests compare the two).
Forward runs in parallel over Gaussians and loops over cameras; backward recomputes the forward quantities of one
Gaussian and accumulates its gradient over cameras in registers, so it is race free without any reduction.
All arithmetic is float64 (the caller passes float64 arrays, so one specialisation is compiled).

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

from .projection import ALPHA_THRESHOLD, SH_C0, SH_C1, SH_C2, SH_C3

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
def _camera_space(means, quats, scales, viewmats, n, c):
    """Camera-space mean p, world covariance terms (R, s, |q|, qn) and camera covariance Sc (symmetric 3x3)."""
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
    return w, x, y, z, qnorm


@nb.njit(parallel=True, cache=True)
def project_fwd(means, quats, scales, opacities, sh, sh_degree, viewmats, Ks, campos, width, height,
                near, far, eps2d, antialiased, radius_clip):
    """Forward projection + colour for all (camera, Gaussian) pairs.

    ``sh`` is [N, K, 3] (ignored when ``sh_degree < 0``). Returns means2d [C, N, 2], conics [C, N, 3],
    depths [C, N], opacities [C, N], colors [C, N, 3], radii [C, N, 2] int32; culled pairs hold zeros.
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
        M = np.empty((3, 3), np.float64)
        Sig = np.empty((3, 3), np.float64)
        Sc = np.empty((3, 3), np.float64)
        tmp = np.empty((3, 3), np.float64)
        for n in range(blk * 128, min(N, blk * 128 + 128)):
            w, x, y, z, _qn = _camera_space(means, quats, scales, viewmats, n, 0)
            R = _rotmat(w, x, y, z)
            s0 = np.float64(scales[n, 0])
            s1 = np.float64(scales[n, 1])
            s2 = np.float64(scales[n, 2])
            # M = R diag(s); Sigma = M M^T
            for i in range(3):
                M[i, 0] = R[3 * i] * s0
                M[i, 1] = R[3 * i + 1] * s1
                M[i, 2] = R[3 * i + 2] * s2
            _mmt(M, M, Sig)
            mx = np.float64(means[n, 0])
            my = np.float64(means[n, 1])
            mz = np.float64(means[n, 2])
            op = np.float64(opacities[n])
            for c in range(C):
                W = viewmats[c]
                px = W[0, 0] * mx + W[0, 1] * my + W[0, 2] * mz + viewmats[c, 0, 3]
                py = W[1, 0] * mx + W[1, 1] * my + W[1, 2] * mz + viewmats[c, 1, 3]
                pz = W[2, 0] * mx + W[2, 1] * my + W[2, 2] * mz + viewmats[c, 2, 3]
                if not (pz >= near and pz <= far):
                    continue
                _sandwich(viewmats, c, Sig, tmp, Sc)
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
                ux = min(lim_xp, max(-lim_xn, px * rz))
                uy = min(lim_yp, max(-lim_yn, py * rz))
                J00 = fx * rz
                J02 = -fx * ux * rz
                J11 = fy * rz
                J12 = -fy * uy * rz
                # cov2d = J Sc J^T with J = [[J00, 0, J02], [0, J11, J12]]
                a0 = J00 * J00 * Sc[0, 0] + 2.0 * J00 * J02 * Sc[0, 2] + J02 * J02 * Sc[2, 2]
                b0 = J00 * J11 * Sc[0, 1] + J00 * J12 * Sc[0, 2] + J02 * J11 * Sc[2, 1] + J02 * J12 * Sc[2, 2]
                c0 = J11 * J11 * Sc[1, 1] + 2.0 * J11 * J12 * Sc[1, 2] + J12 * J12 * Sc[2, 2]
                det_orig = a0 * c0 - b0 * b0
                a = a0 + eps2d
                cc = c0 + eps2d
                det = a * cc - b0 * b0
                if not det > 0.0:
                    continue
                opc = op
                if antialiased:
                    r = det_orig / det
                    opc = op * math.sqrt(r) if r > 0.0 else 0.0
                if opc < ALPHA_THRESHOLD:
                    continue
                extend = min(3.33, math.sqrt(2.0 * math.log(opc / ALPHA_THRESHOLD)))
                rad_x = math.ceil(extend * math.sqrt(max(a, 0.0)))
                rad_y = math.ceil(extend * math.sqrt(max(cc, 0.0)))
                if rad_x <= radius_clip and rad_y <= radius_clip:
                    continue
                m2x = fx * px * rz + cx
                m2y = fy * py * rz + cy
                if m2x + rad_x <= 0 or m2x - rad_x >= width or m2y + rad_y <= 0 or m2y - rad_y >= height:
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
                    if sh_degree > 0:
                        dx = mx - campos[c, 0]
                        dy = my - campos[c, 1]
                        dz = mz - campos[c, 2]
                        inv = 1.0 / max(math.sqrt(dx * dx + dy * dy + dz * dz), 1e-12)
                        _sh_bases(sh_degree, dx * inv, dy * inv, dz * inv, bases)
                    else:
                        bases[0] = SH_C0
                    nb_ = (sh_degree + 1) * (sh_degree + 1)
                    for ch in range(3):
                        v = 0.0
                        for k in range(nb_):
                            v += bases[k] * sh[n, k, ch]
                        colors[c, n, ch] = max(v + 0.5, 0.0)
    return means2d, conics, depths, opac_out, colors, radii


@nb.njit(parallel=True, cache=True)
def project_bwd(means, quats, scales, opacities, sh, sh_degree, viewmats, Ks, campos, width, height,
                eps2d, antialiased, radii, v_means2d, v_conics, v_depths, v_opac, v_colors):
    """Gradients w.r.t. means [N, 3], quats [N, 4], scales [N, 3], opacities [N], sh [N, K, 3] (float64)."""
    N = means.shape[0]
    C = viewmats.shape[0]
    K = sh.shape[1]
    g_means = np.zeros((N, 3), np.float64)
    g_quats = np.zeros((N, 4), np.float64)
    g_scales = np.zeros((N, 3), np.float64)
    g_opac = np.zeros(N, np.float64)
    g_sh = np.zeros((N, K, 3), np.float64)
    n_blocks = (N + 127) // 128  # per-block scratch arrays: no allocation per Gaussian
    for blk in nb.prange(n_blocks):
        bases = np.zeros(16, np.float64)
        vb = np.zeros(16, np.float64)
        s = np.empty(3, np.float64)
        M = np.empty((3, 3), np.float64)
        Sig = np.empty((3, 3), np.float64)
        Sc = np.empty((3, 3), np.float64)
        tmp = np.empty((3, 3), np.float64)
        vSc = np.empty((3, 3), np.float64)
        JS0 = np.empty(3, np.float64)
        JS1 = np.empty(3, np.float64)
        vR = np.empty(9, np.float64)
        vSig = np.zeros((3, 3), np.float64)
        for n in range(blk * 128, min(N, blk * 128 + 128)):
            w, x, y, z, qnorm = _camera_space(means, quats, scales, viewmats, n, 0)
            R = _rotmat(w, x, y, z)
            for j in range(3):
                s[j] = scales[n, j]
            for i in range(3):
                for j in range(3):
                    M[i, j] = R[3 * i + j] * s[j]
            _mmt(M, M, Sig)
            mx = np.float64(means[n, 0])
            my = np.float64(means[n, 1])
            mz = np.float64(means[n, 2])
            op = np.float64(opacities[n])
            vSig[:, :] = 0.0  # dL/dSigma summed over cameras
            gmx = 0.0
            gmy = 0.0
            gmz = 0.0
            gop = 0.0
            for c in range(C):
                if radii[c, n, 0] <= 0 or radii[c, n, 1] <= 0:
                    continue
                W = viewmats[c]
                px = W[0, 0] * mx + W[0, 1] * my + W[0, 2] * mz + viewmats[c, 0, 3]
                py = W[1, 0] * mx + W[1, 1] * my + W[1, 2] * mz + viewmats[c, 1, 3]
                pz = W[2, 0] * mx + W[2, 1] * my + W[2, 2] * mz + viewmats[c, 2, 3]
                _sandwich(viewmats, c, Sig, tmp, Sc)
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
                J00 = fx * rz
                J02 = -fx * ux * rz
                J11 = fy * rz
                J12 = -fy * uy * rz
                a0 = J00 * J00 * Sc[0, 0] + 2.0 * J00 * J02 * Sc[0, 2] + J02 * J02 * Sc[2, 2]
                b0 = J00 * J11 * Sc[0, 1] + J00 * J12 * Sc[0, 2] + J02 * J11 * Sc[2, 1] + J02 * J12 * Sc[2, 2]
                c0 = J11 * J11 * Sc[1, 1] + 2.0 * J11 * J12 * Sc[1, 2] + J12 * J12 * Sc[2, 2]
                a = a0 + eps2d
                cc = c0 + eps2d
                det = a * cc - b0 * b0
                QA = cc / det
                QB = -b0 / det
                QC = a / det
                # ---- opacity / compensation
                v_op_eff = np.float64(v_opac[c, n])
                v_a = 0.0
                v_b = 0.0
                v_c = 0.0
                if antialiased:
                    det_orig = a0 * c0 - b0 * b0
                    r = det_orig / det
                    if r > 0.0:
                        comp = math.sqrt(r)
                        gop += v_op_eff * comp
                        v_r = v_op_eff * op * 0.5 / comp
                        v_a += v_r * (c0 - r * cc) / det
                        v_c += v_r * (a0 - r * a) / det
                        v_b += v_r * (-2.0 * b0 * (1.0 - r)) / det
                else:
                    gop += v_op_eff
                # ---- conic = inverse(S2): dL/dS2 = -Q G Q, G = [[vA, vB/2], [vB/2, vC]]
                gA = np.float64(v_conics[c, n, 0])
                gB = 0.5 * np.float64(v_conics[c, n, 1])
                gC = np.float64(v_conics[c, n, 2])
                # T = G Q
                T00 = gA * QA + gB * QB
                T01 = gA * QB + gB * QC
                T10 = gB * QA + gC * QB
                T11 = gB * QB + gC * QC
                # -Q T
                v_a += -(QA * T00 + QB * T10)
                v_c += -(QB * T01 + QC * T11)
                v_b += -((QA * T01 + QB * T11) + (QB * T00 + QC * T10))  # both off-diagonal entries
                # V: symmetric dL/dcov2d
                V00 = v_a
                V11 = v_c
                V01 = 0.5 * v_b
                # ---- cov2d = J Sc J^T
                # dL/dSc = J^T V J ; J rows: j0 = (J00, 0, J02), j1 = (0, J11, J12)
                j0 = (J00, 0.0, J02)
                j1 = (0.0, J11, J12)
                for i in range(3):
                    for k in range(3):
                        vSc[i, k] = (V00 * j0[i] * j0[k] + V01 * (j0[i] * j1[k] + j1[i] * j0[k])
                                     + V11 * j1[i] * j1[k])
                # dL/dJ = 2 V J Sc
                for k in range(3):
                    JS0[k] = J00 * Sc[0, k] + J02 * Sc[2, k]
                    JS1[k] = J11 * Sc[1, k] + J12 * Sc[2, k]
                vJ00 = 2.0 * (V00 * JS0[0] + V01 * JS1[0])
                vJ02 = 2.0 * (V00 * JS0[2] + V01 * JS1[2])
                vJ11 = 2.0 * (V01 * JS0[1] + V11 * JS1[1])
                vJ12 = 2.0 * (V01 * JS0[2] + V11 * JS1[2])
                # ---- J and mean2d as functions of p
                rz2 = rz * rz
                v_m2x = np.float64(v_means2d[c, n, 0])
                v_m2y = np.float64(v_means2d[c, n, 1])
                vpx = fx * rz * v_m2x
                vpy = fy * rz * v_m2y
                vpz = -fx * px * rz2 * v_m2x - fy * py * rz2 * v_m2y + np.float64(v_depths[c, n])
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
                # ---- p = W m + t ; Sc = W Sig W^T
                gmx += W[0, 0] * vpx + W[1, 0] * vpy + W[2, 0] * vpz
                gmy += W[0, 1] * vpx + W[1, 1] * vpy + W[2, 1] * vpz
                gmz += W[0, 2] * vpx + W[1, 2] * vpy + W[2, 2] * vpz
                _sandwich_t_add(viewmats, c, vSc, tmp, vSig)
                # ---- colour
                if sh_degree >= 0:
                    nb_ = (sh_degree + 1) * (sh_degree + 1)
                    dx = 0.0
                    dy = 0.0
                    dz = 0.0
                    inv = 0.0
                    if sh_degree > 0:
                        dx = mx - campos[c, 0]
                        dy = my - campos[c, 1]
                        dz = mz - campos[c, 2]
                        inv = 1.0 / max(math.sqrt(dx * dx + dy * dy + dz * dz), 1e-12)
                        _sh_bases(sh_degree, dx * inv, dy * inv, dz * inv, bases)
                    else:
                        bases[0] = SH_C0
                    for k in range(nb_):
                        vb[k] = 0.0
                    for ch in range(3):
                        v = 0.0
                        for k in range(nb_):
                            v += bases[k] * sh[n, k, ch]
                        if v + 0.5 > 0.0:
                            gcol = np.float64(v_colors[c, n, ch])
                            for k in range(nb_):
                                g_sh[n, k, ch] += bases[k] * gcol
                                vb[k] += sh[n, k, ch] * gcol
                    if sh_degree > 0:
                        ex = dx * inv
                        ey = dy * inv
                        ez = dz * inv
                        gx, gy, gz = _sh_bases_vjp(sh_degree, ex, ey, ez, vb)
                        dot = gx * ex + gy * ey + gz * ez
                        gmx += (gx - ex * dot) * inv
                        gmy += (gy - ey * dot) * inv
                        gmz += (gz - ez * dot) * inv
            g_means[n, 0] = gmx
            g_means[n, 1] = gmy
            g_means[n, 2] = gmz
            g_opac[n] = gop
            # ---- Sigma = M M^T -> dL/dM = 2 vSig M (vSig symmetric)
            for i in range(3):
                for j in range(3):
                    vMij = 2.0 * (vSig[i, 0] * M[0, j] + vSig[i, 1] * M[1, j] + vSig[i, 2] * M[2, j])
                    g_scales[n, j] += vMij * R[3 * i + j]
                    vR[3 * i + j] = vMij * s[j]
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
    return g_means, g_quats, g_scales, g_opac, g_sh
