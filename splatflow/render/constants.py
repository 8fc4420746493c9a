"""Constants of the rendering model, shared by the torch projection, the oracle and the numba kernels.

They follow gsplat 1.5.3's CUDA kernels, so the CPU and CUDA backends draw the same pixels; one definition
keeps the oracle, the projection and the kernels from drifting apart.
"""

from __future__ import annotations

# the SH basis constants, defined in splatflow.gaussians.sh (outside this package, so the file formats and the viewer
# read them without loading the rasterizer) and part of the rendering model's constants here
from splatflow.gaussians.sh import SH_C0, SH_C1, SH_C2, SH_C3  # noqa: F401

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
