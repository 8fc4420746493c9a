"""Plain-PyTorch tile rasterizer: the reference ("oracle") the numba CPU backend is tested against.

It applies gsplat's compositing rules literally and densely: every Gaussian listed for a 16x16 tile is evaluated
at every pixel of that tile, in depth order, with

* ``alpha = min(ALPHA_MAX, opacity * exp(-sigma))``, ``sigma = 0.5 (a dx^2 + c dy^2) + b dx dy``,
  ``(dx, dy) = mean2d - pixel centre``;
* a contribution skipped when ``sigma < 0`` or ``alpha < 1/255``;
* a pixel stopped (exclusively) at the first Gaussian that would bring its transmittance to ``<= 1e-4``.

Transmittances are computed with ``cumprod``, gradients come from autograd, so nothing here shares code with the
hand-written backward of the CPU backend. Tiles are processed in chunks padded to the chunk's longest list; with
gradients enabled each chunk is wrapped in activation checkpointing so memory stays bounded on large scenes.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from .constants import ALPHA_MAX, ALPHA_MIN, T_MIN, TILE
from .projection import tile_grid


def tile_lists(means2d: Tensor, radii: Tensor, depths: Tensor, width: int, height: int) -> tuple[Tensor, Tensor]:
    """Gaussian lists per tile, depth sorted (gsplat's ``isect_tiles`` + ``isect_offset_encode``), on the inputs'
    device (the torch removal score, :mod:`splatflow.render.score_torch`, uses them on a GPU).

    Inputs are one camera's [N, 2], [N, 2] int, [N]. A Gaussian is listed in every tile its radius rectangle
    ``[mean - r, mean + r]`` touches (a superset of where its alpha reaches 1/255). Returns ``offsets``
    [n_tiles + 1] and ``ids`` [M] (Gaussian indices, sorted by (tile, depth, index)).
    """
    dev = means2d.device
    tw, th = tile_grid(width, height, TILE)
    N = means2d.shape[0]
    m = means2d.detach()
    r = radii.to(m.dtype)
    vis = (radii > 0).all(dim=-1)
    x0 = torch.clamp(torch.floor((m[:, 0] - r[:, 0]) / TILE), 0, tw).long()
    x1 = torch.clamp(torch.ceil((m[:, 0] + r[:, 0]) / TILE), 0, tw).long()
    y0 = torch.clamp(torch.floor((m[:, 1] - r[:, 1]) / TILE), 0, th).long()
    y1 = torch.clamp(torch.ceil((m[:, 1] + r[:, 1]) / TILE), 0, th).long()
    nx = torch.where(vis, x1 - x0, 0)
    ny = torch.where(vis, y1 - y0, 0)
    count = nx * ny  # [N]
    gid = torch.repeat_interleave(torch.arange(N, device=dev), count)  # [M]
    start = torch.cumsum(count, 0) - count
    local = torch.arange(gid.numel(), device=dev) - start[gid]  # index within the Gaussian's rectangle
    nxg = nx[gid].clamp(min=1)
    tile = (y0[gid] + local // nxg) * tw + x0[gid] + local % nxg  # [M]
    rank = torch.empty(N, dtype=torch.long, device=dev)
    rank[torch.sort(depths.detach(), stable=True).indices] = torch.arange(N, device=dev)
    ids = gid[torch.argsort(tile * N + rank[gid])]
    offsets = torch.zeros(tw * th + 1, dtype=torch.long, device=dev)
    offsets[1:] = torch.cumsum(torch.bincount(tile, minlength=tw * th), 0)
    return offsets, ids


def _composite_chunk(
    m2: Tensor, con: Tensor, col: Tensor, op: Tensor, valid: Tensor, pix: Tensor, bg: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Composite padded lists. m2 [T, L, 2], con [T, L, 3], col [T, L, D], op/valid [T, L], pix [T, P, 2].

    Returns colour [T, P, D], transmittance [T, P] and per-(pixel, Gaussian) weights alpha*T [T, P, L].
    """
    dx = m2[:, None, :, 0] - pix[:, :, None, 0]  # [T, P, L]
    dy = m2[:, None, :, 1] - pix[:, :, None, 1]
    a, b, c = con[:, None, :, 0], con[:, None, :, 1], con[:, None, :, 2]
    sigma = 0.5 * (a * dx * dx + c * dy * dy) + b * dx * dy
    alpha = torch.clamp(op[:, None, :] * torch.exp(-sigma), max=ALPHA_MAX)
    keep = valid[:, None, :] & (sigma >= 0) & (alpha >= ALPHA_MIN)
    alpha = torch.where(keep, alpha, torch.zeros((), dtype=alpha.dtype))
    with torch.no_grad():
        alive = torch.cumprod(1.0 - alpha, dim=-1) > T_MIN  # exclusive stop rule
    alpha = torch.where(alive, alpha, torch.zeros((), dtype=alpha.dtype))
    one_minus = 1.0 - alpha
    T_excl = torch.cumprod(torch.cat([torch.ones_like(one_minus[..., :1]), one_minus[..., :-1]], dim=-1), dim=-1)
    w = alpha * T_excl  # [T, P, L]
    T_final = T_excl[..., -1] * one_minus[..., -1]  # [T, P]
    rgb = torch.einsum("tpl,tld->tpd", w, col) + T_final[..., None] * bg
    return rgb, T_final, w


def rasterize_oracle(
    means2d: Tensor,  # [C, N, 2]
    conics: Tensor,  # [C, N, 3]
    colors: Tensor,  # [C, N, D]
    opacities: Tensor,  # [C, N]
    radii: Tensor,  # [C, N, 2]
    depths: Tensor,  # [C, N]
    width: int,
    height: int,
    backgrounds: Tensor | None = None,  # [C, D]
    return_stats: bool = False,
    chunk_elems: int = 1 << 21,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """Rasterize projected Gaussians. Returns colours [C, H, W, D], alphas [C, H, W, 1] and, with
    ``return_stats``, ``hit_count`` [C, N] (int32) and ``weight_sum`` [C, N]."""
    C, N, D = colors.shape
    dtype = colors.dtype
    tw, th = tile_grid(width, height, TILE)
    ly, lx = torch.meshgrid(torch.arange(TILE), torch.arange(TILE), indexing="ij")
    ly, lx = ly.reshape(-1), lx.reshape(-1)  # [P]
    images, alphas = [], []
    hits = torch.zeros(C, N, dtype=torch.int32)
    wsum = torch.zeros(C, N, dtype=dtype)
    use_ckpt = torch.is_grad_enabled() and any(
        t.requires_grad for t in (means2d, conics, colors, opacities)
    )
    for cam in range(C):
        offsets, ids = tile_lists(means2d[cam], radii[cam], depths[cam], width, height)
        counts = offsets[1:] - offsets[:-1]  # [n_tiles]
        bg = backgrounds[cam] if backgrounds is not None else torch.zeros(D, dtype=dtype)
        img = torch.zeros(th * TILE, tw * TILE, D, dtype=dtype)
        Tmap = torch.ones(th * TILE, tw * TILE, dtype=dtype)
        tiles_nonempty = torch.nonzero(counts > 0).flatten()
        tiles_sorted = tiles_nonempty[torch.argsort(counts[tiles_nonempty], descending=True)]
        pieces_rgb, pieces_T, pieces_tiles = [], [], []
        i = 0
        while i < tiles_sorted.numel():
            L = int(counts[tiles_sorted[i]])
            n_t = max(1, chunk_elems // (TILE * TILE * L))
            chunk = tiles_sorted[i : i + n_t]
            i += n_t
            pos = torch.arange(L)
            idx = offsets[chunk][:, None] + pos[None, :]  # [T, L]
            valid = pos[None, :] < counts[chunk][:, None]
            g = ids[torch.where(valid, idx, offsets[chunk][:, None])]  # [T, L]
            px = (chunk % tw)[:, None] * TILE + lx[None, :]  # [T, P]
            py = (chunk // tw)[:, None] * TILE + ly[None, :]
            pix = torch.stack([px, py], dim=-1).to(dtype) + 0.5  # [T, P, 2] pixel centres
            args = (means2d[cam][g], conics[cam][g], colors[cam][g], opacities[cam][g], valid, pix, bg)
            if use_ckpt:
                rgb, T_final, w = checkpoint(_composite_chunk, *args, use_reentrant=False)
            else:
                rgb, T_final, w = _composite_chunk(*args)
            if return_stats:
                with torch.no_grad():
                    inside = ((px < width) & (py < height))[:, :, None]  # [T, P, 1]
                    wd = torch.where(inside, w.detach(), torch.zeros((), dtype=dtype))
                    wsum[cam].index_add_(0, g.reshape(-1), wd.sum(1).reshape(-1))
                    hits[cam].index_add_(0, g.reshape(-1), (wd > 0).sum(1).reshape(-1).to(torch.int32))
            pieces_rgb.append(rgb)
            pieces_T.append(T_final)
            pieces_tiles.append(chunk)
        if pieces_tiles:
            chunks = torch.cat(pieces_tiles)
            rgb_all = torch.cat(pieces_rgb)  # [T, P, D]
            T_all = torch.cat(pieces_T)  # [T, P]
            py = ((chunks // tw)[:, None] * TILE + ly[None, :]).reshape(-1)
            px = ((chunks % tw)[:, None] * TILE + lx[None, :]).reshape(-1)
            flat = py * (tw * TILE) + px
            img = img.reshape(-1, D).index_put((flat,), rgb_all.reshape(-1, D)).reshape(th * TILE, tw * TILE, D)
            Tmap = Tmap.reshape(-1).index_put((flat,), T_all.reshape(-1)).reshape(th * TILE, tw * TILE)
        # empty tiles show the background
        empty = torch.ones(th, tw, dtype=torch.bool)
        empty.view(-1)[tiles_nonempty] = False
        empty_px = empty.repeat_interleave(TILE, 0).repeat_interleave(TILE, 1)[..., None]
        img = torch.where(empty_px, bg.expand_as(img), img)
        images.append(img[:height, :width])
        alphas.append(1.0 - Tmap[:height, :width, None])
    out = torch.stack(images)  # [C, H, W, D]
    alpha = torch.stack(alphas)  # [C, H, W, 1]
    if return_stats:
        return out, alpha, hits, wsum
    return out, alpha, None, None
