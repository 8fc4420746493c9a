"""Constants of the rendering model, shared by the torch projection, the oracle and the numba kernels.

They follow gsplat 1.5.3's CUDA kernels, so the CPU and CUDA backends draw the same pixels; one definition
keeps the oracle, the projection and the kernels from drifting apart.
"""

from __future__ import annotations

TILE = 16
"""Side of a screen tile in pixels (tile binning and compositing work tile by tile)."""

ALPHA_MIN = 1.0 / 255.0
"""Contributions with alpha below this are skipped (gsplat / 3DGS); also the opacity floor of the radius."""

ALPHA_MAX = 0.999
"""Per-Gaussian alpha clamp of gsplat 1.5.3 (``min(0.999f, opac * exp(-sigma))`` in its CUDA kernels).

The original 3DGS code clamps at 0.99; we follow gsplat so the CPU and CUDA backends agree."""

T_MIN = 1e-4
"""A pixel stops at the first Gaussian that would bring its transmittance to or below this (exclusive)."""

EXTEND_MAX = 3.33
"""Largest screen-space radius in standard deviations (the opacity-aware radius is capped here)."""

# Real spherical-harmonics normalisation constants, bands 0-3, in the sign convention of the 3DGS reference
# code and gsplat (basis 1 is -C1*y, basis 2 is C1*z, basis 3 is -C1*x).
SH_C0 = 0.28209479177387814
SH_C1 = 0.4886025119029199
SH_C2 = (1.0925484305920792, -1.0925484305920792, 0.31539156525252005, -1.0925484305920792, 0.5462742152960396)
SH_C3 = (
    -0.5900435899266435,
    2.890611442640554,
    -0.4570457994644658,
    0.3731763325901154,
    -0.4570457994644658,
    1.445305721320277,
    -0.5900435899266435,
)
