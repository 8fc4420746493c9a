"""Gaussian parameters: initialisation from SfM points, scene scale, checkpoint I/O.

Parameter layout and activations follow gsplat's ``simple_trainer`` (docs/CONTRACTS.md "Checkpoint"):
``means`` world positions, ``quats`` wxyz (unnormalised), ``scales`` log scales, ``opacities`` logit opacity,
``sh0``/``shN`` spherical-harmonic colour coefficients. Initialisation is the one of the 3DGS paper
(Kerbl et al. 2023, §5.1): one Gaussian per SfM point, isotropic, with a scale equal to the mean distance to its
three nearest neighbours, identity rotation and low opacity.
"""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path

import numpy as np
import torch

from splatflow.errors import UserError

SH_C0 = 0.28209479177387814  # Y_0^0 = 1 / (2 sqrt(pi))

SPLAT_KEYS = ("means", "quats", "scales", "opacities", "sh0", "shN")


def num_sh_bases(degree: int) -> int:
    """Number of SH coefficients per colour channel up to ``degree`` ((d+1)^2)."""
    return (degree + 1) ** 2


def rgb_to_sh0(rgb: torch.Tensor) -> torch.Tensor:
    """DC coefficient whose degree-0 SH evaluation (+0.5 offset, as gsplat/3DGS) gives ``rgb`` in [0, 1]."""
    return (rgb - 0.5) / SH_C0


def knn_mean_distance(points: np.ndarray, k: int = 3, chunk: int = 65536) -> np.ndarray:
    """Mean Euclidean distance of each point to its ``k`` nearest other points, ``[P]`` float32.

    A KD-tree (O(P log P)) queried in chunks keeps memory at O(P + chunk * k) even for millions of points,
    where a dense distance matrix would need O(P^2). Duplicated points give distance 0; the caller clamps.
    """
    from scipy.spatial import cKDTree

    points = np.asarray(points, dtype=np.float64)
    n = len(points)
    if n < 2:
        return np.ones(n, dtype=np.float32)
    k_eff = min(k, n - 1)
    tree = cKDTree(points)
    out = np.empty(n, dtype=np.float32)
    for lo in range(0, n, chunk):
        d, _ = tree.query(points[lo:lo + chunk], k=k_eff + 1)  # [B, k+1]; column 0 is the point itself
        out[lo:lo + chunk] = d[:, 1:].mean(axis=1)
    return out


def camera_centers(world_to_cams: np.ndarray) -> np.ndarray:
    """Camera centres in world coordinates from world-to-camera matrices ``[C, 4, 4]`` -> ``[C, 3]``."""
    w2c = np.asarray(world_to_cams, dtype=np.float64)
    R = w2c[:, :3, :3]  # [C, 3, 3]
    t = w2c[:, :3, 3]  # [C, 3]
    return -np.einsum("cji,cj->ci", R, t)  # -R^T t


def scene_scale(world_to_cams: np.ndarray) -> float:
    """Scene extent from the cameras: 1.1 x the largest distance of a camera centre from their mean.

    This is the ``cameras_extent`` of the 3DGS reference (``getNerfppNorm``); it scales the position learning
    rate and the densification thresholds so they do not depend on the SfM's arbitrary world units.
    """
    c = camera_centers(world_to_cams)
    radius = float(np.linalg.norm(c - c.mean(axis=0), axis=1).max()) * 1.1
    return radius if radius > 1e-8 else 1.0


def init_splats(points: np.ndarray, colors_u8: np.ndarray, *, sh_degree: int = 3, init_opacity: float = 0.1,
                init_scale: float = 1.0) -> dict[str, torch.Tensor]:
    """Gaussians from SfM points ``[P, 3]`` and colours ``[P, 3]`` uint8 (float32 CPU tensors).

    Raises UserError when there are too few points to initialise from.
    """
    points = np.asarray(points, dtype=np.float32)
    if points.ndim != 2 or points.shape[1] != 3 or len(points) < 4:
        raise UserError(
            f"training needs at least 4 SfM points to initialise Gaussians, got {len(points)}; "
            "check that the sfm stage registered the images (metrics/<scene>/sfm.json) and rerun it")
    if not np.isfinite(points).all():
        raise UserError("the SfM points contain NaN/Inf coordinates; rerun the sfm stage")
    n = len(points)
    dist = knn_mean_distance(points, k=3)
    positive = dist[dist > 0]
    floor = float(positive.min()) if len(positive) else 1e-3
    dist = np.maximum(dist, max(floor, 1e-7))
    means = torch.from_numpy(points.copy())  # [N, 3]
    scales = torch.log(torch.from_numpy(dist * init_scale)).unsqueeze(-1).repeat(1, 3)  # [N, 3]
    quats = torch.zeros(n, 4, device="cpu")
    quats[:, 0] = 1.0  # identity rotation, wxyz
    opacities = torch.full((n,), math.log(init_opacity / (1.0 - init_opacity)), device="cpu")  # logit
    rgb = torch.from_numpy(np.asarray(colors_u8, dtype=np.float32) / 255.0)  # [N, 3]
    sh0 = rgb_to_sh0(rgb).unsqueeze(1)  # [N, 1, 3]
    shN = torch.zeros(n, num_sh_bases(sh_degree) - 1, 3, device="cpu")  # [N, K-1, 3]
    return {"means": means, "quats": quats, "scales": scales, "opacities": opacities,
            "sh0": sh0.contiguous(), "shN": shN}


def save_checkpoint(path: str | Path, payload: dict) -> None:
    """``torch.save`` to a temporary file in the same folder, then atomically rename over ``path``.

    A crash or SIGKILL mid-write leaves the previous checkpoint intact (rename is atomic on POSIX).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_checkpoint(path: str | Path) -> dict:
    """The raw checkpoint dict (CPU tensors). Raises UserError for a missing or unreadable file."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: checkpoint not found; run the stage that writes it (e.g. `dvc repro train`)")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means the file is unusable
        raise UserError(f"{path}: not a readable checkpoint ({e}); delete it and rerun the stage") from e
    if not isinstance(ckpt, dict) or "splats" not in ckpt:
        raise UserError(f"{path}: not a splatflow checkpoint (no 'splats' entry); delete it and rerun the stage")
    return ckpt


def load_splats(path: str | Path) -> tuple[dict[str, torch.Tensor], int]:
    """``(splats, sh_degree)`` from a checkpoint written by train or prune (docs/CONTRACTS.md)."""
    ckpt = load_checkpoint(path)
    splats = ckpt["splats"]
    missing = [k for k in SPLAT_KEYS if k not in splats]
    if missing:
        raise UserError(f"{path}: checkpoint lacks {', '.join(missing)}; delete it and rerun the stage")
    splats = {k: splats[k].detach().float().cpu() for k in SPLAT_KEYS}
    return splats, int(ckpt.get("sh_degree", 0))


def activated_for_render(splats: dict[str, torch.Tensor], sh_degree: int,
                         device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Rasterizer inputs from stored parameters, on ``device``: real scales, opacities in [0, 1], and the SH
    bands up to ``sh_degree`` as ``colors [N, (sh_degree+1)^2, 3]``."""
    s = {k: splats[k].to(device) for k in SPLAT_KEYS}
    k = (sh_degree + 1) ** 2
    return {"means": s["means"], "quats": s["quats"], "scales": torch.exp(s["scales"]),
            "opacities": torch.sigmoid(s["opacities"]),
            "colors": torch.cat([s["sh0"], s["shN"][:, : k - 1]], dim=1)}  # [N, K, 3]
