"""The SSIM window of 3DGS (11 taps, sigma 1.5) and its constants, shared by the torch SSIM
(:mod:`splatflow.render.ssim`) and the Triton kernels (:mod:`splatflow.render.ssim_triton`)."""

from __future__ import annotations

import torch
from torch import Tensor

WINDOW = 11
SIGMA = 1.5
C1 = 0.01**2
C2 = 0.03**2


def gaussian_window_1d(size: int = WINDOW, sigma: float = SIGMA, dtype: torch.dtype = torch.float32,
                       device: torch.device | str = "cpu") -> Tensor:
    """Normalised 1-D Gaussian taps [size] (the 3DGS ``gaussian(window_size, 1.5)``) on ``device``."""
    x = torch.arange(size, dtype=torch.float64, device=device) - size // 2
    g = torch.exp(-(x * x) / (2.0 * sigma * sigma))
    return (g / g.sum()).to(dtype)
