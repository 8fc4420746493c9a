"""Image-quality metrics of the standard novel-view-synthesis protocol (docs/design.md §6).

PSNR and SSIM are computed on RGB in [0, 1], as in the 3DGS reference evaluation (Kerbl et al. 2023) and
Mip-NeRF 360 tables. SSIM (Wang et al. 2004) uses an 11x11 Gaussian window with sigma 1.5 and zero "same"
padding, exactly as the 3DGS code; it is the render engineer's fast implementation in
:mod:`splatflow.render.ssim`, shared with the training loss so the two never drift apart.
LPIPS lives in :mod:`splatflow.evaluation.lpips` (plain torch, offline weights).
"""

from __future__ import annotations

import math

import torch

from splatflow.evaluation.lpips import LPIPS, LpipsSet, VARIANT_INPUTS, VARIANTS, load_lpips  # noqa: F401 (re-exported)
from splatflow.render.ssim import ssim as _ssim, ssim_map_reference


def _as_bchw(x: torch.Tensor) -> torch.Tensor:
    """Accept ``[H, W, 3]``, ``[B, H, W, 3]`` or ``[B, 3, H, W]``; return ``[B, 3, H, W]`` float."""
    if x.ndim == 3 and x.shape[-1] in (3, 4):
        x = x[..., :3].permute(2, 0, 1).unsqueeze(0)  # [1, 3, H, W]
    elif x.ndim == 4 and x.shape[-1] in (3, 4) and x.shape[1] not in (3, 4):
        x = x[..., :3].permute(0, 3, 1, 2)  # [B, 3, H, W]
    if x.ndim != 4 or x.shape[1] != 3:
        raise ValueError(f"expected an RGB image [H,W,3], [B,H,W,3] or [B,3,H,W], got shape {tuple(x.shape)}")
    return x.float()


@torch.no_grad()
def psnr(x: torch.Tensor, y: torch.Tensor) -> float:
    """Peak signal-to-noise ratio in dB of images in [0, 1] (peak 1): ``-10 log10(MSE)``.

    The MSE is taken over all pixels and channels of the pair (in float64, so near-identical images do not
    underflow); identical images give ``inf``.
    """
    a, b = _as_bchw(x), _as_bchw(y)
    if a.shape != b.shape:
        raise ValueError(f"psnr: shapes differ {tuple(a.shape)} vs {tuple(b.shape)}")
    mse = float(((a.double() - b.double()) ** 2).mean())
    return math.inf if mse == 0.0 else -10.0 * math.log10(mse)


@torch.no_grad()
def ssim(x: torch.Tensor, y: torch.Tensor) -> float:
    """Mean SSIM of images in [0, 1] (11x11 Gaussian window, sigma 1.5, C1 = 0.01^2, C2 = 0.03^2)."""
    a, b = _as_bchw(x), _as_bchw(y)
    if a.shape != b.shape:
        raise ValueError(f"ssim: shapes differ {tuple(a.shape)} vs {tuple(b.shape)}")
    return float(_ssim(a, b))


def quantize_8bit(x: torch.Tensor) -> torch.Tensor:
    """Round to the 256 levels an 8-bit PNG would store (for metrics "as saved")."""
    return torch.round(x.clamp(0.0, 1.0) * 255.0) / 255.0


def masked_pair(render: torch.Tensor, gt: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``render`` with the ground truth put in its masked pixels (``mask`` ``[H, W]`` bool, True = keep), so a
    masked pixel differs nowhere: windowed metrics (SSIM, LPIPS) near the mask see no error from it."""
    a, b = _as_bchw(render), _as_bchw(gt)
    return torch.where(mask.to(a.device)[None, None], a, b)


@torch.no_grad()
def masked_psnr(x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> float:
    """PSNR over the kept pixels (``mask`` ``[H, W]`` bool) only: the MSE's mean runs over kept pixels."""
    a, b = _as_bchw(x), _as_bchw(y)
    keep = mask.to(a.device)[None, None].expand_as(a)  # [B, 3, H, W]
    if not bool(keep.any()):
        raise ValueError("masked_psnr: the mask keeps no pixel")
    mse = float(((a.double() - b.double()) ** 2)[keep].mean())
    return math.inf if mse == 0.0 else -10.0 * math.log10(mse)


@torch.no_grad()
def masked_ssim(x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean of the SSIM map (same window and constants as :func:`ssim`) over the kept pixels; the masked
    pixels of ``x`` are replaced by ``y``'s first (:func:`masked_pair`), so they add no error to nearby windows."""
    a, b = _as_bchw(x), _as_bchw(y)
    a = masked_pair(a, b, mask)
    smap = ssim_map_reference(a.double(), b.double()).mean(1)  # [B, H, W]
    keep = mask.to(a.device)[None].expand_as(smap)
    return float(smap[keep].mean())
