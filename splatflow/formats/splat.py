"""antimatter15 ``.splat``: the 32-byte-per-Gaussian layout of the WebGL viewer (github.com/antimatter15/splat).

Per Gaussian, little endian, no header::

    float32 x, y, z | float32 sx, sy, sz (linear scales) | uint8 r, g, b, a | uint8 qw, qx, qy, qz

* colour = ``0.5 + SH_C0 * dc`` (degree-0 SH only: the format has no view dependence), alpha = sigmoid(logit);
  both scaled by 255 and clipped;
* quaternion = ``(q / |q|) * 128 + 128`` clipped to [0, 255] (wxyz order, as the viewer's converter writes);
* rows sorted by importance, largest first, as that converter does: ``exp(sum log scales) * alpha``
  (volume times opacity), so a viewer streaming the file shows the big opaque Gaussians first.

We round to the nearest byte where the original converter truncates (``astype(uint8)``): same format, half the
quantisation error. The reader inverts everything except the sort (the order is not recoverable) and the
clipping; alpha 0/255 read back as logit of 0.5/255 and 1 - 0.5/255.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from splatflow.formats.common import as_numpy_splats, logit, normalize_quats, sigmoid, splats_to_torch
from splatflow.gaussians.sh import SH_C0

SPLAT_DTYPE = np.dtype([("pos", "<f4", 3), ("scale", "<f4", 3), ("rgba", "u1", 4), ("rot", "u1", 4)])
assert SPLAT_DTYPE.itemsize == 32


def importance_order(splats: dict) -> np.ndarray:
    """Indices sorting Gaussians by ``volume * opacity``, descending (stable, so ties keep their order)."""
    a = as_numpy_splats(splats)
    score = np.exp(a["scales"].astype(np.float64).sum(axis=1)) * sigmoid(a["opacities"].astype(np.float64))
    return np.argsort(-score, kind="stable")


def splats_to_records(splats: dict) -> np.ndarray:
    """The ``.splat`` records (structured array, sorted by importance)."""
    a = as_numpy_splats(splats)
    order = importance_order(splats)
    n = len(order)
    rec = np.empty(n, dtype=SPLAT_DTYPE)
    rec["pos"] = a["means"][order]
    rec["scale"] = np.exp(a["scales"][order])
    rgb = 0.5 + SH_C0 * a["sh0"][order, 0, :]  # [N, 3]
    alpha = sigmoid(a["opacities"][order])[:, None]  # [N, 1]
    rgba = np.concatenate([rgb, alpha], axis=1)  # [N, 4]
    rec["rgba"] = np.clip(np.rint(rgba * 255.0), 0, 255).astype(np.uint8)
    q = normalize_quats(a["quats"][order].astype(np.float64))
    rec["rot"] = np.clip(np.rint(q * 128.0 + 128.0), 0, 255).astype(np.uint8)
    return rec


def write_splat(path: str | Path, splats: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    splats_to_records(splats).tofile(tmp)
    os.replace(tmp, path)
    return path


def records_to_splats(rec: np.ndarray) -> dict:
    n = len(rec)
    rgba = rec["rgba"].astype(np.float32) / 255.0  # [N, 4]
    arrays = {
        "means": rec["pos"].astype(np.float32),
        "scales": np.log(np.maximum(rec["scale"].astype(np.float32), 1e-30)),
        "quats": (rec["rot"].astype(np.float32) - 128.0) / 128.0,
        "opacities": logit(rgba[:, 3], 0.5 / 255.0).astype(np.float32),
        "sh0": ((rgba[:, :3] - 0.5) / SH_C0).reshape(n, 1, 3),
        "shN": np.zeros((n, 0, 3), np.float32),
    }
    return splats_to_torch(arrays)


def read_splat(path: str | Path) -> tuple[dict, int]:
    """``(splats, 0)`` from a ``.splat`` file (SH degree 0: the format stores only base colours)."""
    path = Path(path)
    size = path.stat().st_size
    if size % SPLAT_DTYPE.itemsize:
        raise ValueError(f"{path}: size {size} bytes is not a multiple of 32; not a .splat file")
    return records_to_splats(np.fromfile(path, dtype=SPLAT_DTYPE)), 0
