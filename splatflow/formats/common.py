"""Helpers shared by the format writers/readers: the splats dict as numpy and back."""

from __future__ import annotations

import numpy as np
import torch

KEYS = ("means", "quats", "scales", "opacities", "sh0", "shN")


def as_numpy_splats(splats: dict, sh_degree: int | None = None) -> dict[str, np.ndarray]:
    """float32 numpy copies of a splats dict; SH bands above ``sh_degree`` are zeroed.

    Zeroing matters for export: a model trained with active degree d < allocated degree still carries the
    higher coefficients, which we never render with; a viewer would use them, so they are written as 0.
    A model with a 3D smoothing filter (``Splats.filter_3d``) is baked first (``Splats.baked``): its scales and
    opacities are the filtered ones, what the model renders, since no file format or viewer knows the filter.
    """
    bake = getattr(splats, "baked", None)
    if callable(bake):
        splats = bake()
    missing = [k for k in KEYS if k not in splats]
    if missing:
        raise ValueError(f"splats dict lacks {missing}; expected keys {KEYS}")
    out = {}
    for k in KEYS:
        v = splats[k]
        v = v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else np.asarray(v)
        out[k] = np.ascontiguousarray(v, dtype=np.float32)
    n = out["means"].shape[0]
    shapes = {"means": (n, 3), "quats": (n, 4), "scales": (n, 3), "opacities": (n,), "sh0": (n, 1, 3)}
    for k, s in shapes.items():
        if out[k].shape != s:
            raise ValueError(f"splats[{k!r}] has shape {out[k].shape}, expected {s}")
    if out["shN"].ndim != 3 or out["shN"].shape[0] != n or out["shN"].shape[2] != 3:
        raise ValueError(f"splats['shN'] has shape {out['shN'].shape}, expected ({n}, K-1, 3)")
    if sh_degree is not None:
        keep = (sh_degree + 1) ** 2 - 1
        if keep < out["shN"].shape[1]:
            out["shN"] = out["shN"].copy()
            out["shN"][:, keep:, :] = 0.0
    return out


def sh_degree_of(n_rest: int) -> int:
    """SH degree from the number of non-DC coefficients per channel (0, 3, 8, 15 -> 0..3)."""
    for d in range(5):
        if (d + 1) ** 2 - 1 == n_rest:
            return d
    raise ValueError(f"{n_rest} higher SH coefficients per channel is not (d+1)^2 - 1 for any degree d")


def splats_to_torch(arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(np.ascontiguousarray(arrays[k], dtype=np.float32)) for k in KEYS}


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def logit(p: np.ndarray, eps: float) -> np.ndarray:
    p = np.clip(p, eps, 1.0 - eps)
    return np.log(p / (1.0 - p))


def normalize_quats(q: np.ndarray) -> np.ndarray:
    n = np.linalg.norm(q, axis=-1, keepdims=True)
    out = q / np.where(n > 0, n, 1.0)
    out[n[:, 0] == 0] = (1.0, 0.0, 0.0, 0.0)  # degenerate quaternion -> identity
    return out
