"""The removal cost of :func:`splatflow.render.removal_loss` in one Triton kernel launch per view.

The score is :mod:`.score_torch`'s (its docstring has the formula): the growth of the squared error when one
Gaussian ALONE is removed, ``sum_p |R_ip|^2 - 2 R_ip . (C_p - Y_p)`` with
``R_ip = a_ip (c_i T_ip - S_ip / (1 - a_ip))`` on the black background. The torch version evaluates every (pixel,
list entry) pair of padded tile lists with scans, tens of launches and ``[T, 256, L, 3]`` temporaries per chunk;
here one program per 16x16 tile walks its depth-sorted list as the CPU kernels and gsplat's rasterizer do, with its
256 pixels as one block:

* front to back: per pixel the transmittance ``T``, the colour and the list position of the last contributor;
  an entry with ``sigma < 0`` or alpha below ``ALPHA_MIN`` is skipped (alpha clamped at ``ALPHA_MAX``), and the
  entry that would bring ``T`` to ``T_MIN`` or below stops the pixel (it and everything behind it do not count).
  The walk ends early once every pixel of the tile inside the image has stopped (checked every ``BATCH`` entries);
* back to front from the last contributor of any pixel: the transmittance in front of each entry from the one
  behind it (``T / (1 - a)``, as the CPU kernels' backward), the colour behind it ``S``, ``R`` and the entry's
  cost summed over the tile's pixels inside the image (float32), added to ``increase[g]`` by a float64 atomic;
* the render is written for the pixels inside the image.

The inputs are :func:`.projection.project_gaussians`, :func:`.projection.gaussian_colors` and
:func:`.oracle.tile_lists` (torch, on the device), with each view's list entries gathered into one ``[M, 9]``
float32 array in list order, so the walk reads memory in order. The launch grid is the tile count (known from the
image size): no host read per view beyond the one inside ``tile_lists``. Checked against the CPU kernels under
Triton's interpreter (``TRITON_INTERPRET=1``, ``tests/test_score_triton.py``) and on CUDA by its ``cuda`` test.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .constants import ALPHA_MAX, ALPHA_MIN, T_MIN, TILE
from .oracle import tile_lists
from .projection import gaussian_colors, project_gaussians, tile_grid
from .triton_gate import enabled as available  # noqa: F401 (this module's gate)
from .triton_gate import tl, triton

BATCH = 32  # list entries between two checks of whether every pixel of the tile has stopped
SCAN_BLOCK = 16  # list entries per block of the scan kernel ([16, 256] per tensor: 16 registers a thread at 8 warps)
KERNELS = ("walk", "scan")


if triton is not None:
    @triton.jit
    def _tile(offsets_ptr, W, H, tiles_x, TILE: tl.constexpr):
        """This program's tile: its list's range in the entry array, its pixels' coordinates and which of them lie
        inside the image."""
        t = tl.program_id(0)
        lane = tl.arange(0, TILE * TILE)
        px = (t % tiles_x) * TILE + lane % TILE
        py = (t // tiles_x) * TILE + lane // TILE
        return tl.load(offsets_ptr + t), tl.load(offsets_ptr + t + 1), px, py, (px < W) & (py < H)

    @triton.jit
    def _store_render(img_ptr, tgt_ptr, pixel, inside, acc0, acc1, acc2, HAS_TARGET: tl.constexpr,
                      TILE: tl.constexpr):
        """Write a tile's render (its pixels inside the image) and return its error against the target, ``C - Y``
        per channel (zero without a target: the render itself)."""
        pix = pixel.to(tl.int64) * 3
        tl.store(img_ptr + pix, acc0, mask=inside)
        tl.store(img_ptr + pix + 1, acc1, mask=inside)
        tl.store(img_ptr + pix + 2, acc2, mask=inside)
        if HAS_TARGET:
            e0 = acc0 - tl.load(tgt_ptr + pix, mask=inside, other=0.0)
            e1 = acc1 - tl.load(tgt_ptr + pix + 1, mask=inside, other=0.0)
            e2 = acc2 - tl.load(tgt_ptr + pix + 2, mask=inside, other=0.0)
        else:
            e0 = tl.zeros([TILE * TILE], dtype=tl.float32)
            e1 = tl.zeros([TILE * TILE], dtype=tl.float32)
            e2 = tl.zeros([TILE * TILE], dtype=tl.float32)
        return e0, e1, e2

    @triton.jit
    def _block_alphas(e, km, live, T, fx, fy, ALPHA_MIN: tl.constexpr, ALPHA_MAX: tl.constexpr,
                      T_MIN: tl.constexpr):
        """The alphas of a block of list entries (``e``: their rows of the entry array, ``km``: which exist) at the
        tile's pixels ``[B, P]``, zero where an entry is skipped or lies at or behind a pixel's stop, the
        transmittance behind each entry ``[B, P]`` and which pixels are still live after the block."""
        dx = tl.load(e, mask=km, other=0.0)[:, None] - fx  # [B, P]
        dy = tl.load(e + 1, mask=km, other=0.0)[:, None] - fy
        sigma = 0.5 * (tl.load(e + 2, mask=km, other=0.0)[:, None] * dx * dx
                       + tl.load(e + 4, mask=km, other=0.0)[:, None] * dy * dy) \
            + tl.load(e + 3, mask=km, other=0.0)[:, None] * dx * dy
        alpha = tl.minimum(tl.load(e + 5, mask=km, other=0.0)[:, None] * tl.exp(-sigma), ALPHA_MAX)
        a = tl.where(km[:, None] & live[None, :] & (sigma >= 0.0) & (alpha >= ALPHA_MIN), alpha, 0.0)
        incl = T[None, :] * tl.cumprod(1.0 - a, axis=0)  # transmittance behind each entry, before the stop
        a = tl.where(incl > T_MIN, a, 0.0)  # the entry that would bring T to T_MIN and all behind it: out
        live = live & (tl.min(incl, axis=0) > T_MIN)
        incl = T[None, :] * tl.cumprod(1.0 - a, axis=0)
        return a, incl, live

    @triton.jit
    def _tile_scores(offsets_ptr, ids_ptr, ent_ptr, tgt_ptr, img_ptr, inc_ptr, W, H, tiles_x,
                     HAS_TARGET: tl.constexpr, TILE: tl.constexpr, BATCH: tl.constexpr,
                     ALPHA_MIN: tl.constexpr, ALPHA_MAX: tl.constexpr, T_MIN: tl.constexpr):
        """One tile: render its pixels into ``img`` [H, W, 3] and add each list entry's cost to ``inc[ids[k]]``."""
        start, end, px, py, inside = _tile(offsets_ptr, W, H, tiles_x, TILE)
        fx = px.to(tl.float32) + 0.5  # pixel centres
        fy = py.to(tl.float32) + 0.5
        T = tl.full([TILE * TILE], 1.0, tl.float32)
        acc0 = tl.zeros([TILE * TILE], dtype=tl.float32)
        acc1 = tl.zeros([TILE * TILE], dtype=tl.float32)
        acc2 = tl.zeros([TILE * TILE], dtype=tl.float32)
        last = tl.full([TILE * TILE], -1, tl.int64) + start  # list position of the last contributor (start - 1: none)
        live = inside  # not stopped yet (pixels beyond the image never take part)
        n_live = tl.sum(live.to(tl.int32), axis=0)
        k0 = start
        while (k0 < end) & (n_live > 0):
            k1 = tl.minimum(k0 + BATCH, end)
            for k in range(k0, k1):
                e = ent_ptr + k * 9
                dx = tl.load(e) - fx
                dy = tl.load(e + 1) - fy
                sigma = 0.5 * (tl.load(e + 2) * dx * dx + tl.load(e + 4) * dy * dy) + tl.load(e + 3) * dx * dy
                alpha = tl.minimum(tl.load(e + 5) * tl.exp(-sigma), ALPHA_MAX)
                ok = live & (sigma >= 0.0) & (alpha >= ALPHA_MIN)
                nT = T * (1.0 - alpha)
                upd = ok & (nT > T_MIN)
                live = live & (upd | ~ok)  # the entry that would bring T to T_MIN stops the pixel
                w = tl.where(upd, alpha * T, 0.0)
                acc0 += w * tl.load(e + 6)
                acc1 += w * tl.load(e + 7)
                acc2 += w * tl.load(e + 8)
                T = tl.where(upd, nT, T)
                last = tl.where(upd, k, last)
            n_live = tl.sum(live.to(tl.int32), axis=0)
            k0 = k1
        e0, e1, e2 = _store_render(img_ptr, tgt_ptr, py * W + px, inside, acc0, acc1, acc2, HAS_TARGET, TILE)
        # T is now each pixel's final transmittance: times the black background it adds nothing to the render or R
        s0 = tl.zeros([TILE * TILE], dtype=tl.float32)  # colour composited behind the entry
        s1 = tl.zeros([TILE * TILE], dtype=tl.float32)
        s2 = tl.zeros([TILE * TILE], dtype=tl.float32)
        top = tl.max(tl.where(inside, last, start - 1), axis=0)
        for j in range(start, top + 1):
            k = top + start - j
            e = ent_ptr + k * 9
            dx = tl.load(e) - fx
            dy = tl.load(e + 1) - fy
            sigma = 0.5 * (tl.load(e + 2) * dx * dx + tl.load(e + 4) * dy * dy) + tl.load(e + 3) * dx * dy
            alpha = tl.minimum(tl.load(e + 5) * tl.exp(-sigma), ALPHA_MAX)
            ok = inside & (sigma >= 0.0) & (alpha >= ALPHA_MIN) & (k <= last)
            am = tl.where(ok, alpha, 0.0)
            ra = 1.0 / (1.0 - am)
            T = T * ra  # in front of the entry
            c0 = tl.load(e + 6)
            c1 = tl.load(e + 7)
            c2 = tl.load(e + 8)
            r0 = am * (c0 * T - s0 * ra)
            r1 = am * (c1 * T - s1 * ra)
            r2 = am * (c2 * T - s2 * ra)
            cost = tl.sum(r0 * (r0 - 2.0 * e0) + r1 * (r1 - 2.0 * e1) + r2 * (r2 - 2.0 * e2), axis=0)
            g = tl.load(ids_ptr + k)
            tl.atomic_add(inc_ptr + g, cost.to(tl.float64))
            fac = am * T
            s0 += c0 * fac
            s1 += c1 * fac
            s2 += c2 * fac


    @triton.jit
    def _tile_scores_scan(offsets_ptr, ids_ptr, ent_ptr, tgt_ptr, img_ptr, inc_ptr, W, H, tiles_x,
                          HAS_TARGET: tl.constexpr, TILE: tl.constexpr, B: tl.constexpr,
                          ALPHA_MIN: tl.constexpr, ALPHA_MAX: tl.constexpr, T_MIN: tl.constexpr):
        """The same tile as :func:`_tile_scores`, its list taken ``B`` entries at a time as a ``[B, 256]`` block:
        products and sums along the list are scans within the block (as :mod:`.score_torch` does per chunk), and
        the ``B`` costs go out in one vector atomic, where the walk reduces over the pixels and adds once per
        entry. Both passes run front to back: the colour behind an entry is the pixel's final colour minus what
        the entries up to it composited."""
        start, end, px, py, inside = _tile(offsets_ptr, W, H, tiles_x, TILE)
        fx = (px.to(tl.float32) + 0.5)[None, :]  # pixel centres [1, P]
        fy = (py.to(tl.float32) + 0.5)[None, :]
        rows = tl.arange(0, B)
        # pass 1: the render, and where the walk may end (every pixel inside the image stopped)
        T = tl.full([TILE * TILE], 1.0, tl.float32)
        acc0 = tl.zeros([TILE * TILE], dtype=tl.float32)
        acc1 = tl.zeros([TILE * TILE], dtype=tl.float32)
        acc2 = tl.zeros([TILE * TILE], dtype=tl.float32)
        live = inside
        n_live = tl.sum(live.to(tl.int32), axis=0)
        k0 = start
        while (k0 < end) & (n_live > 0):
            ks = k0 + rows
            km = ks < end
            e = ent_ptr + ks * 9
            a, incl, live = _block_alphas(e, km, live, T, fx, fy, ALPHA_MIN, ALPHA_MAX, T_MIN)
            wgt = a * (incl / (1.0 - a))  # alpha times the transmittance in front
            acc0 += tl.sum(wgt * tl.load(e + 6, mask=km, other=0.0)[:, None], axis=0)
            acc1 += tl.sum(wgt * tl.load(e + 7, mask=km, other=0.0)[:, None], axis=0)
            acc2 += tl.sum(wgt * tl.load(e + 8, mask=km, other=0.0)[:, None], axis=0)
            T = tl.min(incl, axis=0)
            n_live = tl.sum(live.to(tl.int32), axis=0)
            k0 += B
        stop = k0
        e0, e1, e2 = _store_render(img_ptr, tgt_ptr, py * W + px, inside, acc0, acc1, acc2, HAS_TARGET, TILE)
        # pass 2: the same blocks again (the same alphas and stops, to the bit), now with each entry's cost
        T = tl.full([TILE * TILE], 1.0, tl.float32)
        f0 = tl.zeros([TILE * TILE], dtype=tl.float32)  # colour composited in front of the block
        f1 = tl.zeros([TILE * TILE], dtype=tl.float32)
        f2 = tl.zeros([TILE * TILE], dtype=tl.float32)
        live = inside
        k0 = start
        while k0 < stop:
            ks = k0 + rows
            km = ks < end
            e = ent_ptr + ks * 9
            a, incl, live = _block_alphas(e, km, live, T, fx, fy, ALPHA_MIN, ALPHA_MAX, T_MIN)
            ra = 1.0 / (1.0 - a)
            front = incl * ra  # transmittance in front of each entry
            wgt = a * front
            c0 = tl.load(e + 6, mask=km, other=0.0)[:, None]
            c1 = tl.load(e + 7, mask=km, other=0.0)[:, None]
            c2 = tl.load(e + 8, mask=km, other=0.0)[:, None]
            q0 = f0[None, :] + tl.cumsum(wgt * c0, axis=0)  # composited up to and with each entry
            q1 = f1[None, :] + tl.cumsum(wgt * c1, axis=0)
            q2 = f2[None, :] + tl.cumsum(wgt * c2, axis=0)
            r0 = a * (c0 * front - (acc0[None, :] - q0) * ra)  # R: what removing the entry alone changes
            r1 = a * (c1 * front - (acc1[None, :] - q1) * ra)
            r2 = a * (c2 * front - (acc2[None, :] - q2) * ra)
            cost = r0 * (r0 - 2.0 * e0[None, :]) + r1 * (r1 - 2.0 * e1[None, :]) + r2 * (r2 - 2.0 * e2[None, :])
            cost = tl.sum(tl.where(inside[None, :], cost, 0.0), axis=1)  # [B]
            g = tl.load(ids_ptr + ks, mask=km, other=0)
            tl.atomic_add(inc_ptr + g, cost.to(tl.float64), mask=km)
            f0 += tl.sum(wgt * c0, axis=0)
            f1 += tl.sum(wgt * c1, axis=0)
            f2 += tl.sum(wgt * c2, axis=0)
            T = tl.min(incl, axis=0)
            k0 += B


@torch.no_grad()
def removal_loss_triton(means: Tensor, quats: Tensor, scales: Tensor, opacities: Tensor,
                        colors: Tensor | tuple[Tensor, Tensor], viewmats: Tensor, Ks: Tensor, width: int,
                        height: int, *, sh_degree: int, target: Tensor | None = None, near_plane: float = 0.01,
                        far_plane: float = 1e10, eps2d: float = 0.3, kernel: str = "walk") -> tuple[Tensor, Tensor]:
    """:func:`splatflow.render.removal_loss` by the Triton kernel: ``(render [C, H, W, 3], increase [C, N])``.

    Same inputs and outputs as :func:`.score_torch.removal_loss_torch`; float32 Gaussians only (the kernel's type);
    ``increase`` is float64 (each tile's sum over its pixels in float32, the tiles added in float64). ``kernel``:
    ``"walk"`` (:func:`_tile_scores`, an entry at a time) or ``"scan"`` (:func:`_tile_scores_scan`, ``SCAN_BLOCK``
    entries at a time; the same costs up to float32 rounding).
    """
    if kernel not in KERNELS:
        raise ValueError(f"removal_loss Triton kernel must be one of {KERNELS}, got {kernel!r}")
    if triton is None:
        raise RuntimeError("removal_loss backend 'triton' needs Triton (pip install triton; torch's CUDA builds "
                           "ship it), or use backend='torch'")
    if means.dtype != torch.float32:
        raise ValueError(f"removal_loss backend 'triton' takes float32 Gaussians, got means of {means.dtype}; "
                         "convert them with .float() or use backend='torch'")
    C = viewmats.shape[0]
    if target is not None and tuple(target.shape) != (C, height, width, 3):
        raise ValueError(f"removal_loss target must have shape {(C, height, width, 3)} (views, height, width, RGB), "
                         f"got {tuple(target.shape)}")
    dev = means.device
    if isinstance(colors, (tuple, list)):
        colors = torch.cat([c.to(dev) for c in colors], dim=1)  # [N, K, 3]
    viewmats = viewmats.to(dev, torch.float32)
    Ks = Ks.to(dev, torch.float32)
    N = means.shape[0]
    proj = project_gaussians(means, quats, scales, opacities, viewmats, Ks, width, height, near_plane=near_plane,
                             far_plane=far_plane, eps2d=eps2d, antialiased=False, radius_clip=0.0)
    rgb = gaussian_colors(colors, sh_degree, means, viewmats, proj["valid"])  # [C, N, 3]
    # per list entry 9 floats, as the kernel reads them: mean x, y, conic a, b, c, opacity, colour r, g, b
    ent = torch.cat([proj["means2d"], proj["conics"], proj["opacities"][..., None], rgb], dim=-1)  # [C, N, 9]
    ent = ent.to(torch.float32)
    tw, th = tile_grid(width, height, TILE)
    images = torch.zeros(C, height, width, 3, dtype=torch.float32, device=dev)
    increase = torch.zeros(C, N, dtype=torch.float64, device=dev)
    for cam in range(C):
        offsets, ids = tile_lists(proj["means2d"][cam], proj["radii"][cam], proj["depths"][cam], width, height)
        if ids.numel() == 0:  # nothing in view: the render stays black, every cost 0 (the shape is on the host)
            continue
        packed = ent[cam][ids].contiguous()  # [M, 9] in list order
        tgt = images[cam] if target is None else target[cam].to(dev, torch.float32).contiguous()
        common = dict(HAS_TARGET=target is not None, TILE=TILE, ALPHA_MIN=ALPHA_MIN, ALPHA_MAX=ALPHA_MAX,
                      T_MIN=T_MIN, num_warps=8)
        if kernel == "walk":
            _tile_scores[(tw * th,)](offsets, ids, packed, tgt, images[cam], increase[cam], width, height, tw,
                                     BATCH=BATCH, **common)
        else:
            _tile_scores_scan[(tw * th,)](offsets, ids, packed, tgt, images[cam], increase[cam], width, height, tw,
                                          B=SCAN_BLOCK, **common)
    return images.to(means.dtype), increase
