"""The removal cost in plain torch: the score of :func:`splatflow.render.removal_loss` on any device.

The CPU kernels compute it in their backward pass (``_kernels.rasterize_bwd_rgb`` with ``removal``): walking each
tile's depth-sorted list back to front, the change of pixel ``p`` when Gaussian ``i`` ALONE is taken out is
``R_ip = a_ip (c_i T_ip - (S_ip + T_final,p bg) / (1 - a_ip))``, with ``T_ip`` the transmittance in front of ``i``
and ``S_ip`` the colour composited behind it (up to where the pixel stopped). The pixel is affine in ``a_ip``, so
this is exact for one removal; the score is ``sum_p |R_ip|^2 - 2 R_ip . (C_p - Y_p)``, the growth of the squared
error against the target ``Y``.

gsplat's CUDA backward sums these per-pixel terms into gradients, so a GPU run cannot get them from it. Here the
same quantities come from scans instead of a sequential walk: per tile, the listed Gaussians are evaluated at all
256 pixels (as :mod:`.oracle` does), ``T`` is an exclusive ``cumprod`` of ``1 - a`` and ``S`` the total minus an
inclusive ``cumsum`` of ``a T c``. Tiles go in chunks of about ``chunk_elems`` (pixel, Gaussian) pairs, padded to
the chunk's longest list (tiles sorted by list length, so the padding stays small): a few dozen launches per chunk
instead of the host copy and CPU kernels a GPU run needed before. Every tensor is made on the device of the
inputs (tested with torch's default device set to ``meta``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .constants import ALPHA_MAX, ALPHA_MIN, T_MIN, TILE
from .oracle import tile_lists
from .projection import gaussian_colors, project_gaussians, tile_grid

# (pixel, Gaussian) pairs per chunk: about 40 bytes of temporaries each in float32, so ~0.2 GiB on the CPU and
# ~1.3 GiB on a GPU, where fewer, larger chunks mean fewer launches
CHUNK_ELEMS_CPU = 1 << 22
CHUNK_ELEMS_CUDA = 1 << 25



def _chunk_scores(m2: Tensor, con: Tensor, col: Tensor, op: Tensor, valid: Tensor, pix: Tensor, inside: Tensor,
                  target: Tensor | None, bg: Tensor) -> tuple[Tensor, Tensor]:
    """Render and removal cost of a chunk of padded tile lists.

    ``m2 [T, L, 2], con [T, L, 3], col [T, L, 3], op/valid [T, L]``; ``pix [T, P, 2]`` pixel centres, ``inside
    [T, P]`` (pixels of partial tiles beyond the image do not count), ``target [T, P, 3]`` or None (the render
    itself). Returns the render ``[T, P, 3]`` and each list entry's cost ``[T, L]`` (summed over the tile's pixels).
    """
    zero = torch.zeros((), dtype=col.dtype, device=col.device)
    dx = m2[:, None, :, 0] - pix[:, :, None, 0]  # [T, P, L]
    dy = m2[:, None, :, 1] - pix[:, :, None, 1]
    sigma = 0.5 * (con[:, None, :, 0] * dx * dx + con[:, None, :, 2] * dy * dy) + con[:, None, :, 1] * dx * dy
    alpha = torch.clamp(op[:, None, :] * torch.exp(-sigma), max=ALPHA_MAX)
    alpha = torch.where(valid[:, None, :] & (sigma >= 0) & (alpha >= ALPHA_MIN), alpha, zero)
    # a pixel stops (exclusively) at the Gaussian that would bring its transmittance to T_MIN or below
    alpha = torch.where(torch.cumprod(1.0 - alpha, dim=-1) > T_MIN, alpha, zero)
    one_minus = 1.0 - alpha
    T_incl = torch.cumprod(one_minus, dim=-1)  # [T, P, L] transmittance behind each entry
    T_excl = T_incl / one_minus  # in front of it (alpha <= 0.999, so no division by zero)
    T_final = T_incl[..., -1]  # [T, P]
    contrib = (alpha * T_excl)[..., None] * col[:, None, :, :]  # [T, P, L, 3]
    acc = torch.cumsum(contrib, dim=2)
    img = acc[:, :, -1, :] + T_final[..., None] * bg  # [T, P, 3]
    behind = acc[:, :, -1:, :] - acc  # [T, P, L, 3] S: the colour of everything behind the entry
    R = alpha[..., None] * (col[:, None, :, :] * T_excl[..., None]
                            - (behind + (T_final[..., None] * bg)[:, :, None, :]) / one_minus[..., None])
    resid = img - (img if target is None else target)  # [T, P, 3] zero without a target
    cost = (R * (R - 2.0 * resid[:, :, None, :])).sum(-1)  # [T, P, L] |R|^2 - 2 R . (C - Y)
    cost = torch.where(inside[..., None], cost, zero).sum(1)  # [T, L]
    return img, cost


@torch.no_grad()
def removal_loss_torch(means: Tensor, quats: Tensor, scales: Tensor, opacities: Tensor,
                       colors: Tensor | tuple[Tensor, Tensor], viewmats: Tensor, Ks: Tensor, width: int, height: int,
                       *, sh_degree: int, target: Tensor | None = None, near_plane: float = 0.01,
                       far_plane: float = 1e10, eps2d: float = 0.3,
                       chunk_elems: int | None = None) -> tuple[Tensor, Tensor]:
    """:func:`splatflow.render.removal_loss` on the device of ``means``: ``(render [C, H, W, 3], increase [C, N])``.

    Same inputs (activated Gaussians; SH ``[N, K, 3]`` or the pair ``(sh0, shN)``; ``target [C, H, W, 3]``, float in
    [0, 1]), same outputs; cameras and target are moved to that device. ``increase`` is float64 (summed over pixels in the inputs' float type per tile, then in float64), as
    the CPU kernels return it.
    """
    dev = means.device
    dtype = means.dtype
    if isinstance(colors, (tuple, list)):
        colors = torch.cat([c.to(dev) for c in colors], dim=1)  # [N, K, 3]
    viewmats = viewmats.to(dev, dtype)
    Ks = Ks.to(dev, dtype)
    C, N = viewmats.shape[0], means.shape[0]
    proj = project_gaussians(means, quats, scales, opacities, viewmats, Ks, width, height, near_plane=near_plane,
                             far_plane=far_plane, eps2d=eps2d, antialiased=False, radius_clip=0.0)
    rgb = gaussian_colors(colors, sh_degree, means, viewmats, proj["valid"])  # [C, N, 3]
    if chunk_elems is None:
        chunk_elems = CHUNK_ELEMS_CUDA if dev.type == "cuda" else CHUNK_ELEMS_CPU
    tw, th = tile_grid(width, height, TILE)
    P = TILE * TILE
    ly = torch.arange(P, device=dev) // TILE  # [P]
    lx = torch.arange(P, device=dev) % TILE
    bg = torch.zeros(3, dtype=dtype, device=dev)
    images = torch.zeros(C, th * TILE * tw * TILE, 3, dtype=dtype, device=dev)
    increase = torch.zeros(C, N, dtype=torch.float64, device=dev)
    for cam in range(C):
        offsets, ids = tile_lists(proj["means2d"][cam], proj["radii"][cam], proj["depths"][cam], width, height)
        counts = offsets[1:] - offsets[:-1]  # [n_tiles]
        tiles = torch.nonzero(counts > 0).flatten()
        tiles = tiles[torch.argsort(counts[tiles], descending=True)]
        lengths = counts[tiles].tolist()  # one read per camera: the chunking is planned on the host
        tgt = None
        if target is not None:
            t = target[cam].to(dev, dtype)  # [H, W, 3]
            tgt = torch.zeros(th * TILE, tw * TILE, 3, dtype=dtype, device=dev)
            tgt[:height, :width] = t
            tgt = tgt.reshape(-1, 3)
        i = 0
        while i < len(lengths):
            L = lengths[i]
            n_t = max(1, chunk_elems // (P * L))
            chunk = tiles[i:i + n_t]
            i += n_t
            pos = torch.arange(L, device=dev)
            first = offsets[chunk][:, None]  # [T, 1]
            valid = pos[None, :] < counts[chunk][:, None]  # [T, L]
            g = ids[torch.where(valid, first + pos[None, :], first)]  # [T, L]
            px = (chunk % tw)[:, None] * TILE + lx[None, :]  # [T, P]
            py = (chunk // tw)[:, None] * TILE + ly[None, :]
            pix = torch.stack([px, py], dim=-1).to(dtype) + 0.5  # [T, P, 2] pixel centres
            flat = py * (tw * TILE) + px  # [T, P]
            img, cost = _chunk_scores(proj["means2d"][cam][g], proj["conics"][cam][g], rgb[cam][g],
                                      proj["opacities"][cam][g], valid, pix, (px < width) & (py < height),
                                      None if tgt is None else tgt[flat], bg)
            images[cam].index_copy_(0, flat.reshape(-1), img.reshape(-1, 3))
            increase[cam].index_add_(0, g[valid], cost[valid].double())
    out = images.reshape(C, th * TILE, tw * TILE, 3)[:, :height, :width]  # empty tiles keep the zero background
    return out.contiguous(), increase
