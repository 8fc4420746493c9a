"""The training blur: a separable Gaussian blur of render and target, reflect-padded, identity below 0.05 px.

CPU tensors take the numba filter of :mod:`splatflow.render.filters` (same operator, exact backward); other
devices the torch convolutions of :func:`gaussian_blur_torch`. The sigma of a step comes from the training
schedule (:class:`splatflow.train.schedules.BlurSchedule`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# the module, not its functions: the CPU kernels are looked up at the call (tests replace them to prove a path)
from splatflow.render import filters


def gaussian_blur(img: torch.Tensor, sigma_px: float) -> torch.Tensor:
    """Separable Gaussian blur of ``img [B, C, H, W]`` (reflect padding; identity for sigma < 0.05 px).

    CPU tensors take the numba filter of :mod:`splatflow.render.filters` (same operator, exact backward); other
    devices the torch convolutions below."""
    if sigma_px < 0.05:
        return img
    if img.device.type == "cpu":
        return filters.gaussian_blur_cpu(img, sigma_px)
    return gaussian_blur_torch(img, sigma_px)


def gaussian_blur_pair(a: torch.Tensor, b: torch.Tensor, sigma_px: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`gaussian_blur` of two images of one size (render and target), in one kernel call on CPU."""
    if sigma_px < 0.05:
        return a, b
    if a.device.type == "cpu" and b.device.type == "cpu":
        return filters.gaussian_blur_cpu(a, sigma_px, b)
    return gaussian_blur_torch(a, sigma_px), gaussian_blur_torch(b, sigma_px)


def gaussian_blur_torch(img: torch.Tensor, sigma_px: float) -> torch.Tensor:
    """:func:`gaussian_blur` with torch convolutions on ``img``'s device (any device)."""
    if sigma_px < 0.05:
        return img
    radius = max(1, int(math.ceil(3.0 * sigma_px)))
    radius = min(radius, img.shape[-1] - 1, img.shape[-2] - 1)
    x = torch.arange(-radius, radius + 1, dtype=img.dtype, device=img.device)
    k = torch.exp(-0.5 * (x / sigma_px) ** 2)
    k = k / k.sum()  # [2r+1]
    c = img.shape[1]
    kh = k.view(1, 1, 1, -1).repeat(c, 1, 1, 1)  # [C, 1, 1, 2r+1]
    kv = k.view(1, 1, -1, 1).repeat(c, 1, 1, 1)  # [C, 1, 2r+1, 1]
    out = F.pad(img, (radius, radius, 0, 0), mode="reflect")
    out = F.conv2d(out, kh, groups=c)
    out = F.pad(out, (0, 0, radius, radius), mode="reflect")
    return F.conv2d(out, kv, groups=c)
