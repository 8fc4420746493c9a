"""The CPU backend: numba tile rasterization wrapped in a ``torch.autograd.Function``.

Projection and SH colours stay in PyTorch (:mod:`.projection`, differentiated by autograd, a small share of the
time); the per-pixel work, where nearly all the time goes, runs in the numba kernels of :mod:`._kernels`: tile
binning with depth-sorted lists, front-to-back compositing with gsplat's rules, tiles in parallel, and an
analytic backward over the same lists, back to front, race free (per-intersection slots reduced afterwards).
This is the tile-based differentiable rasterizer of Kerbl et al. (SIGGRAPH 2023), written for CPU threads.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from torch import Tensor

from . import _kernels as K
from . import _proj_kernels as P
from .constants import TILE
from .projection import camera_centers, tile_grid


def _np(t: Tensor, dtype: torch.dtype | None = None) -> np.ndarray:
    t = t.detach()
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    return t.contiguous().numpy()


def _binned(means2d, conics, colors, opacities, radii, depths, backgrounds, tiles_x, tiles_y):
    """The kernels' inputs: depth-sorted tile lists ``(offsets, ids)`` and flat arrays of the [C, N, ...] tensors,
    in the order the compositing kernels take them.

    The arrays keep the tensors' dtype, and the compositing works in it (:func:`_work_type`).
    """
    C, N, D = colors.shape
    G = C * N
    m2 = _np(means2d.reshape(G, 2))
    con = _np(conics.reshape(G, 3), means2d.dtype)
    col = _np(colors.reshape(G, D), means2d.dtype)
    op = _np(opacities.reshape(G), means2d.dtype)
    rad = _np(radii.reshape(G, 2), torch.int32)
    # depth order of the visible Gaussians only: with a training window most of them are culled, and sorting
    # those too cost more than the binning (an argsort of all G depths)
    vis = np.flatnonzero((rad[:, 0] > 0) & (rad[:, 1] > 0))
    order = vis[np.argsort(_np(depths.reshape(G))[vis], kind="stable")]
    bg = _np(backgrounds, torch.float64) if backgrounds is not None else np.zeros((C, D), np.float64)
    offsets, ids = K.bin_tiles(m2, rad, con, op, order, N, C, tiles_x, tiles_y)
    return offsets, ids, m2, con, col, op, rad, bg


def _work_type(dtype) -> type:
    """The float type the compositing kernels keep per-pixel state and sums in: that of the inputs. float32 (every
    training, evaluation and pruning render: the model is float32) composites in float32 as gsplat does, 16 pixels
    per AVX-512 instruction; float64 inputs (gradcheck, the exactness tests) composite in float64."""
    return np.float32 if dtype in (torch.float32, np.float32) else np.float64


def _backward(D: int, *args, F: type, removal: bool = False):
    """The compositing backward for D channels: the vectorised RGB kernel for three (every training step, and with
    ``removal`` pruning's removal columns) in the float type F, the general float64 kernel otherwise."""
    if D == 3:
        return K.rasterize_bwd_rgb(*args, F, True if removal else None)
    return K.rasterize_bwd(*args, removal)


class _RasterizeTiles(torch.autograd.Function):
    @staticmethod
    def forward(ctx, means2d, conics, colors, opacities, backgrounds, radii, depths, width, height, absgrad,
                want_stats):
        C, N, D = colors.shape
        dt = colors.dtype
        G = C * N
        tiles_x, tiles_y = tile_grid(width, height, TILE)
        offsets, ids, m2, con, col, op, rad, bg = _binned(means2d, conics, colors, opacities, radii, depths,
                                                          backgrounds, tiles_x, tiles_y)
        out, T_final, last, isect_w, isect_hits = K.rasterize_fwd(
            offsets, ids, m2, con, col, op, rad, bg, C, width, height, tiles_x, tiles_y, bool(want_stats),
            numba.get_num_threads(), _work_type(dt),
        )
        img = torch.from_numpy(out).to(dt)  # [C, H, W, D] (already dt: no copy)
        alpha = (1.0 - torch.from_numpy(T_final)).to(dt)[..., None]  # [C, H, W, 1]
        if want_stats:
            w, h = K.reduce_stats(ids, isect_w, isect_hits, G)
            wsum = torch.from_numpy(w).to(dt).reshape(C, N)
            hits = torch.from_numpy(h).reshape(C, N)
        else:
            wsum = torch.zeros(C, N, dtype=dt, device="cpu")
            hits = torch.zeros(C, N, dtype=torch.int32, device="cpu")
        ctx.mark_non_differentiable(hits, wsum)
        ctx.save_for_backward(means2d, backgrounds if backgrounds is not None else torch.empty(0, device="cpu"))
        ctx.arrays = (offsets, ids, m2, con, col, op, rad, bg, T_final, last)
        ctx.shape = (C, N, D, width, height, tiles_x, tiles_y)
        ctx.absgrad = absgrad
        ctx.dtype = dt
        ctx.has_bg = backgrounds is not None
        return img, alpha, hits, wsum

    @staticmethod
    def backward(ctx, v_img, v_alpha, _v_hits, _v_wsum):
        means2d, backgrounds = ctx.saved_tensors
        offsets, ids, m2, con, col, op, rad, bg, T_final, last = ctx.arrays
        C, N, D, width, height, tiles_x, tiles_y = ctx.shape
        dt = ctx.dtype
        if v_img is None:
            v_img = torch.zeros(C, height, width, D, dtype=dt, device="cpu")
        if v_alpha is None:
            v_alpha = torch.zeros(C, height, width, 1, dtype=dt, device="cpu")
        grads = _backward(
            D, offsets, ids, m2, con, col, op, rad, bg, T_final, last,
            _np(v_img, dt), _np(v_alpha[..., 0], dt), C, width, height, tiles_x, tiles_y,
            numba.get_num_threads(), F=_work_type(dt),
        )
        g = torch.from_numpy(grads).to(dt).reshape(C, N, 8 + D)  # [C, N, 8 + D]
        v_means2d = g[..., 0:2].contiguous()
        v_conics = g[..., 2:5].contiguous()
        v_opac = g[..., 5].contiguous()
        v_colors = g[..., 8:].contiguous()
        if ctx.absgrad:
            # gsplat's convention: DefaultStrategy(absgrad=True) reads info["means2d"].absgrad
            means2d.absgrad = g[..., 6:8].contiguous()
        v_bg = None
        if ctx.has_bg and ctx.needs_input_grad[4]:
            Tf = torch.from_numpy(T_final).to(dt)[..., None]  # [C, H, W, 1]
            v_bg = (Tf * v_img).sum(dim=(1, 2))  # [C, D]
        return v_means2d, v_conics, v_colors, v_opac, v_bg, None, None, None, None, None, None


def rasterize_cpu(
    means2d: Tensor,  # [C, N, 2]
    conics: Tensor,  # [C, N, 3]
    colors: Tensor,  # [C, N, D]
    opacities: Tensor,  # [C, N]
    radii: Tensor,  # [C, N, 2] int
    depths: Tensor,  # [C, N]
    width: int,
    height: int,
    backgrounds: Tensor | None = None,  # [C, D]
    absgrad: bool = False,
    return_stats: bool = False,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """Composite projected Gaussians on CPU. Returns colours [C, H, W, D], alphas [C, H, W, 1], and with
    ``return_stats`` ``hit_count`` [C, N] int32 and ``weight_sum`` [C, N] (else None, None)."""
    for name, t in (("means2d", means2d), ("conics", conics), ("colors", colors), ("opacities", opacities)):
        if t.device.type != "cpu":
            raise ValueError(f"the cpu backend needs CPU tensors; {name} is on {t.device}")
    img, alpha, hits, wsum = _RasterizeTiles.apply(
        means2d, conics, colors, opacities, backgrounds, radii, depths, int(width), int(height), bool(absgrad),
        bool(return_stats),
    )
    if not return_stats:
        return img, alpha, None, None
    return img, alpha, hits, wsum


class _ProjectCPU(torch.autograd.Function):
    """Fused projection + SH colour (numba, :mod:`._proj_kernels`) with its analytic backward."""

    @staticmethod
    def forward(ctx, means, quats, scales, opacities, sh0, shN, viewmats, Ks, width, height, near_plane, far_plane,
                eps2d, antialiased, radius_clip, sh_degree, window):
        dt = means.dtype
        N = means.shape[0]
        vm = _np(viewmats, torch.float64)
        ks = _np(Ks, torch.float64)
        campos = _np(camera_centers(viewmats.detach().to(torch.float64)))
        # per-Gaussian arrays stay in dt (the kernels compute in float64; see _binned); camera arrays are tiny
        has_sh = sh0 is not None
        sh0_np = _np(sh0, dt) if has_sh else np.zeros((N, 1, 3), _np(means).dtype)
        shN_np = _np(shN, dt) if has_sh else np.zeros((N, 0, 3), _np(means).dtype)
        deg = int(sh_degree) if has_sh else -1
        args = (_np(means), _np(quats, dt), _np(scales, dt), _np(opacities, dt), sh0_np, shN_np, deg, vm, ks, campos,
                int(width), int(height))
        x0, y0, ww, wh = window if window is not None else (0, 0, int(width), int(height))
        m2, con, dep, op, col, radii = P.project_fwd(*args, float(near_plane), float(far_plane), float(eps2d),
                                                     bool(antialiased), float(radius_clip),
                                                     int(x0), int(y0), int(x0 + ww), int(y0 + wh))
        radii_t = torch.from_numpy(radii)
        ctx.mark_non_differentiable(radii_t)
        ctx.args = args
        ctx.extra = (float(eps2d), bool(antialiased), radii)
        ctx.has_sh = has_sh
        ctx.dtype = dt
        return (torch.from_numpy(m2).to(dt), torch.from_numpy(con).to(dt), torch.from_numpy(dep).to(dt),
                torch.from_numpy(op).to(dt), torch.from_numpy(col).to(dt), radii_t)

    @staticmethod
    def backward(ctx, v_m2, v_con, v_dep, v_op, v_col, _v_radii):
        args = ctx.args
        eps2d, antialiased, radii = ctx.extra
        dt = ctx.dtype
        C, N = radii.shape[0], radii.shape[1]

        ft = args[0].dtype

        def g(t, shape):
            return _np(t, dt) if t is not None else np.zeros(shape, ft)

        gm, gq, gs, go, gsh0, gshN = P.project_bwd(
            *args, eps2d, antialiased, radii,
            g(v_m2, (C, N, 2)), g(v_con, (C, N, 3)), g(v_dep, (C, N)), g(v_op, (C, N)), g(v_col, (C, N, 3)),
        )
        out = [torch.from_numpy(a).to(dt) for a in (gm, gq, gs, go)]
        v_sh = (torch.from_numpy(gsh0).to(dt), torch.from_numpy(gshN).to(dt)) if ctx.has_sh else (None, None)
        return (*out, *v_sh) + (None,) * 11


def split_sh(sh) -> tuple[Tensor, Tensor] | tuple[None, None]:
    """SH coefficients as the two tensors the projection kernels take: ``(sh0 [N, 1, 3], shN [N, K-1, 3])`` from
    such a pair (as the model stores them: passed through, no copy) or from one ``[N, K, 3]`` tensor."""
    if sh is None:
        return None, None
    if isinstance(sh, (tuple, list)):
        sh0, shN = sh
        return sh0, shN
    return sh[:, :1], sh[:, 1:]


def project_cpu(means, quats, scales, opacities, sh, viewmats, Ks, width, height, *, near_plane, far_plane,
                eps2d, antialiased, radius_clip, sh_degree, window=None):
    """numba projection + SH; returns the same dict as :func:`.projection.project_gaussians` plus ``colors``
    ([C, N, 3] SH colours, or None when ``sh`` is None). ``sh`` is ``[N, K, 3]`` or the pair ``(sh0, shN)``
    (:func:`split_sh`). With ``window=(x0, y0, w, h)`` Gaussians that do not reach that part of the view are
    culled too (radius 0, zeros, no colour computed, no gradient)."""
    sh0, shN = split_sh(sh)
    m2, con, dep, op, col, radii = _ProjectCPU.apply(
        means, quats, scales, opacities, sh0, shN, viewmats, Ks, width, height, near_plane, far_plane, eps2d,
        antialiased, radius_clip, sh_degree, window,
    )
    return {"means2d": m2, "conics": con, "depths": dep, "opacities": op, "radii": radii,
            "valid": (radii > 0).all(-1), "colors": col if sh is not None else None}


@torch.no_grad()
def removal_loss_cpu(means2d: Tensor, conics: Tensor, colors: Tensor, opacities: Tensor, radii: Tensor,
                     depths: Tensor, width: int, height: int, target: Tensor | None = None,
                     backgrounds: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """What removing each Gaussian ALONE would cost: the growth of the summed squared error over the image.

    Returns ``(img [C, H, W, D], increase [C, N])``. With the render ``C``, the target ``Y`` (``target``; the
    render itself when None) and ``R_j`` the exact change of the image when Gaussian ``j`` is taken out
    (:func:`._kernels.rasterize_bwd_rgb` with ``removal``), the increase is
    ``sum_p |C_p - R_jp - Y_p|^2 - |C_p - Y_p|^2 = sum_p |R_jp|^2 - 2 R_jp . (C_p - Y_p)``: negative for a
    Gaussian whose removal makes the image better. One forward and one backward pass of the kernels.
    """
    C, N, D = colors.shape
    tiles_x, tiles_y = tile_grid(width, height, TILE)
    offsets, ids, m2, con, col, op, rad, bg = _binned(means2d, conics, colors, opacities, radii, depths,
                                                      backgrounds, tiles_x, tiles_y)
    n_par = numba.get_num_threads()
    F = _work_type(colors.dtype)
    out, T_final, last, _, _ = K.rasterize_fwd(offsets, ids, m2, con, col, op, rad, bg, C, width, height, tiles_x,
                                               tiles_y, False, n_par, F)
    resid = np.zeros_like(out) if target is None else out - _np(target, torch.float64).reshape(out.shape)
    rows = _backward(D, offsets, ids, m2, con, col, op, rad, bg, T_final, last, resid,
                     np.zeros(T_final.shape, np.float64), C, width, height, tiles_x, tiles_y, n_par,
                     F=F, removal=True)  # [C * N, 10 + D]
    increase = rows[:, 9 + D] - 2.0 * rows[:, 8 + D]
    return torch.from_numpy(out).to(colors.dtype), torch.from_numpy(increase).reshape(C, N)
