"""The spatial (Morton) order the CPU step keeps a training run's Gaussians in (the rows move with everything that
has a row per Gaussian: :meth:`splatflow.train.state.GaussianState.reorder_spatially`).

Why a spatial order (``train.spatial_order``): a late CPU step renders a window that reaches a few thousand of the
model's Gaussians. In the order densification leaves them (clones and split children appended at the end) those
rows are scattered over the whole model, so the step's gathers, its Adam rows and the compositing's reads of the
projected splats jump through memory. Sorted along a Z-order (Morton) curve of their positions, Gaussians that
are close in space are close in memory, and a window's rows are a few contiguous runs (docs/experiments.md,
Training, 2026-11-26 04:58: Adam 3.5 -> 2.2 ms of a 41.5 ms late step). The order changes no result beyond float
rounding: every per-Gaussian quantity moves with its row.
"""

from __future__ import annotations

import torch

MORTON_BITS = 10  # per axis: a 1024^3 grid over the model's bounding box (30-bit codes)


def _spread(x: torch.Tensor) -> torch.Tensor:
    """The low 10 bits of each entry moved to every third bit (bit i -> bit 3i)."""
    x = x & 0x3FF
    x = (x | (x << 16)) & 0x030000FF
    x = (x | (x << 8)) & 0x0300F00F
    x = (x | (x << 4)) & 0x030C30C3
    return (x | (x << 2)) & 0x09249249


def morton_codes(means: torch.Tensor) -> torch.Tensor:
    """30-bit Z-order codes ``[N]`` (int64) of positions ``[N, 3]`` on a 1024^3 grid over their bounding box."""
    m = means.detach().to(torch.float64)
    lo, hi = m.min(dim=0).values, m.max(dim=0).values
    cells = (1 << MORTON_BITS) - 1
    q = ((m - lo) / (hi - lo).clamp_min(1e-12) * cells).round().to(torch.int64).clamp_(0, cells)
    return _spread(q[:, 0]) | (_spread(q[:, 1]) << 1) | (_spread(q[:, 2]) << 2)


def spatial_order(means: torch.Tensor) -> torch.Tensor:
    """The permutation ``[N]`` (int64) that sorts Gaussians along the Morton curve of their positions (ties keep
    their current order, so sorted rows stay where they are)."""
    if means.shape[0] == 0:
        return torch.zeros(0, dtype=torch.int64, device=means.device)
    return torch.sort(morton_codes(means), stable=True).indices
