"""Camera geometry shared by the scene readers, training, pruning, the report and the viewer: where a camera is,
and the size and intrinsics of a downscaled image level.

Plain numpy and no project imports, so that a module needing only this geometry (the model's scene scale, the
ground-truth alignment, the report's cameras) does not pull in the image readers. Intrinsics scale by per-axis
ratios (COLMAP's continuous pixel convention: the image spans ``[0, W]``, so ``fx, cx`` scale by ``W'/W``).
"""

from __future__ import annotations

import numpy as np


def camera_centers(world_to_cams: np.ndarray) -> np.ndarray:
    """Camera centres in world coordinates, ``-R^T t``: ``[C, 4, 4]`` world-to-camera matrices -> ``[C, 3]``
    (one ``[4, 4]`` -> ``[3]``). The torch twin for rendering is :func:`splatflow.render.projection.camera_centers`.
    """
    w2c = np.asarray(world_to_cams, dtype=np.float64)
    return -np.einsum("...ji,...j->...i", w2c[..., :3, :3], w2c[..., :3, 3])


def level_size(width: int, height: int, factor: float) -> tuple[int, int]:
    """Image size at resolution ``factor`` (at least 1 px)."""
    return max(1, int(round(width * factor))), max(1, int(round(height * factor)))


def scale_intrinsics(K: np.ndarray, width: int, height: int, new_width: int, new_height: int) -> np.ndarray:
    """``K [3, 3]`` of a ``width x height`` camera rescaled to ``new_width x new_height``."""
    sx, sy = new_width / width, new_height / height
    K2 = np.array(K, dtype=np.float64, copy=True)
    K2[0, :] *= sx  # fx, skew, cx
    K2[1, :] *= sy  # fy, cy
    return K2
