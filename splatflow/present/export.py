"""Export a trained model to the files other tools read, and prove each file says what the model says.

Every file is written, then read back by a reader that is not the writer's inverse: ``plyfile`` for the Inria
PLY, the ``gsply`` package's SPZ decoder for SPZ (our own decoder only if gsply is missing, and then the report
says so), and an explicit byte-offset decoding for the 32-byte ``.splat`` records. The decoded Gaussians are
compared with the model within each format's quantisation step; any excess raises
:class:`ExportVerificationError`, so a broken writer can never leave a silently wrong file behind.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from splatflow.pipeline.config import ExportConfig
from splatflow.formats import write_ply, write_splat, write_spz
from splatflow.formats.common import as_numpy_splats, sigmoid
from splatflow.formats.ply import vertices_to_splats
from splatflow.formats.spz import COLOR_SCALE, POS_FLIP_YZ, SH_FLIP_YZ, read_spz
from splatflow.formats.splat import importance_order
from splatflow.gaussians.sh import SH_C0


class ExportVerificationError(RuntimeError):
    """An exported file, read back independently, does not match the model within its quantisation."""


@dataclass(frozen=True)
class Tolerance:
    means: float
    scales: float
    alpha: float  # on sigmoid(opacity)
    color: float  # on 0.5 + SH_C0 * dc
    quat: float  # on 1 - |<q_ref, q_file>| of unit quaternions
    sh: float  # on higher SH coefficients


EXACT = Tolerance(0.0, 0.0, 0.0, 0.0, 1e-9, 0.0)  # quat: float64 rounding of 1 - |<q, q>|


def spz_tolerance(version: int, fractional_bits: int) -> Tolerance:
    return Tolerance(means=0.5 / (1 << fractional_bits) + 1e-6, scales=0.5 / 16 + 1e-6, alpha=0.5 / 255 + 1e-6,
                     color=SH_C0 * 0.5 / (COLOR_SCALE * 255) + 1e-6, quat=2e-5 if version >= 3 else 5e-3,
                     sh=8.5 / 128 + 1e-6)


SPLAT_TOLERANCE = Tolerance(means=0.0, scales=1e-5, alpha=0.5 / 255 + 1e-6, color=0.5 / 255 + 1e-6, quat=2e-4,
                            sh=0.0)


def _unit(q: np.ndarray) -> np.ndarray:
    n = np.linalg.norm(q, axis=1, keepdims=True)
    return q / np.where(n > 0, n, 1.0)


def compare(ref: dict[str, np.ndarray], got: dict[str, np.ndarray], tol: Tolerance, *, what: str,
            scale_range=(-math.inf, math.inf), color_range=(-math.inf, math.inf), sh_range=(-math.inf, math.inf),
            alpha_range=(0.0, 1.0)) -> dict[str, float]:
    """Max errors of ``got`` vs ``ref`` (numpy splats dicts, same order), raising if any exceeds ``tol``.

    Values a format cannot represent are compared after clipping the reference to the format's range.
    """
    n_ref, n_got = len(ref["means"]), len(got["means"])
    if n_ref != n_got:
        raise ExportVerificationError(f"{what}: {n_got} Gaussians read back, the model has {n_ref}")
    if n_ref == 0:
        return {}
    k1 = got["shN"].shape[1]
    errs = {
        "means": float(np.abs(got["means"] - ref["means"]).max()),
        "scales": float(np.abs(got["scales"] - np.clip(ref["scales"], *scale_range)).max()),
        "alpha": float(np.abs(sigmoid(got["opacities"].astype(np.float64))
                              - np.clip(sigmoid(ref["opacities"].astype(np.float64)), *alpha_range)).max()),
        "color": float(np.abs(SH_C0 * (got["sh0"] - np.clip(ref["sh0"], *color_range))).max()),
        "quat": float((1.0 - np.abs((_unit(got["quats"].astype(np.float64))
                                     * _unit(ref["quats"].astype(np.float64))).sum(1))).max()),
        "sh": float(np.abs(got["shN"] - np.clip(ref["shN"][:, :k1], *sh_range)).max()) if k1 else 0.0,
    }
    bad = {k: v for k, v in errs.items() if not v <= getattr(tol, k)}
    if bad:
        detail = ", ".join(f"{k} error {v:.3g} > {getattr(tol, k):.3g}" for k, v in bad.items())
        raise ExportVerificationError(f"{what}: read back does not match the model ({detail})")
    return errs


def _torch_to_np(splats) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in splats.items()}


def verify_ply(path: Path, ref: dict[str, np.ndarray]) -> dict:
    import plyfile

    data = plyfile.PlyData.read(str(path))["vertex"].data
    got = _torch_to_np(vertices_to_splats(data, str(path)))
    errs = compare(ref, got, EXACT, what=str(path))
    return {"verified_with": f"plyfile {plyfile.__version__ if hasattr(plyfile, '__version__') else ''}".strip(),
            "max_errors": errs}


def decode_splat_bytes(raw: bytes) -> dict[str, np.ndarray]:
    """Decode ``.splat`` records by explicit byte offsets (independent of the writer's numpy dtype)."""
    if len(raw) % 32:
        raise ExportVerificationError(f".splat size {len(raw)} is not a multiple of 32 bytes")
    rows = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 32)
    f = rows[:, :24].copy().view("<f4")  # [N, 6]
    rgba = rows[:, 24:28].astype(np.float64) / 255.0
    q = (rows[:, 28:32].astype(np.float64) - 128.0) / 128.0
    a = np.clip(rgba[:, 3], 1e-12, 1 - 1e-12)
    n = len(rows)
    return {"means": f[:, :3], "scales": np.log(f[:, 3:6]), "opacities": np.log(a / (1 - a)), "quats": q,
            "sh0": ((rgba[:, :3] - 0.5) / SH_C0).reshape(n, 1, 3), "shN": np.zeros((n, 0, 3))}


def verify_splat(path: Path, ref: dict[str, np.ndarray], order: np.ndarray) -> dict:
    got = decode_splat_bytes(path.read_bytes())
    ref_sorted = {k: v[order] for k, v in ref.items()}
    c_lo, c_hi = (0.0 - 0.5) / SH_C0, (1.0 - 0.5) / SH_C0
    errs = compare(ref_sorted, got, SPLAT_TOLERANCE, what=str(path), color_range=(c_lo, c_hi))
    return {"verified_with": "byte-offset decoder (splatflow.present.export.decode_splat_bytes)", "max_errors": errs}


def verify_spz(path: Path, ref: dict[str, np.ndarray], version: int, from_coordinates: str) -> dict:
    import gzip

    fb = gzip.decompress(path.read_bytes())[13]
    try:
        import gsply

        g = gsply.read_spz(str(path))
        k1 = 0 if g.shN is None else g.shN.shape[1]
        got = {"means": np.asarray(g.means, np.float64), "scales": np.asarray(g.scales),
               "opacities": np.asarray(g.opacities), "quats": np.asarray(g.quats, np.float64),
               "sh0": np.asarray(g.sh0).reshape(-1, 1, 3),
               "shN": np.asarray(g.shN) if k1 else np.zeros((len(g.means), 0, 3))}
        if len(got["shN"]) and got["shN"].shape[1] and from_coordinates == "RDF":
            got["shN"] = got["shN"] * SH_FLIP_YZ[: got["shN"].shape[1], None]
        if from_coordinates == "RDF":  # gsply returns the file's RUB frame: mirror y, z back
            got["means"] = got["means"] * POS_FLIP_YZ
            got["quats"] = got["quats"] * np.array([1.0, 1.0, -1.0, -1.0])
        reader = f"gsply {getattr(gsply, '__version__', '')}".strip()
    except ImportError:
        got = _torch_to_np(read_spz(path, to_coordinates=from_coordinates)[0])
        reader = "splatflow.formats.spz (gsply not installed: not an independent check)"
    c_lim = 127.5 / (COLOR_SCALE * 255)
    errs = compare(ref, got, spz_tolerance(version, fb), what=str(path), scale_range=(-10.0, 5.9375),
                   color_range=(-c_lim, c_lim), sh_range=(-1.0, 127.0 / 128.0),
                   alpha_range=(0.5 / 255, 1 - 0.5 / 255))
    return {"verified_with": reader, "max_errors": errs, "fractional_bits": int(fb)}


def export_model(splats: dict, sh_degree: int, out_dir: str | Path, *, formats=ExportConfig.formats,
                 spz_version: int = ExportConfig.spz_version,
                 spz_from_coordinates: str = ExportConfig.spz_from_coordinates, progress: bool = True) -> dict:
    """Write ``scene.<fmt>`` for each format into ``out_dir``, verify each, return the export metrics."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ref = as_numpy_splats(splats, sh_degree)  # bands above the active degree zeroed, as written
    n = len(ref["means"])
    files = {}
    from tqdm import tqdm

    for fmt in tqdm(formats, desc="export (write + verify)", unit="file", disable=not progress):
        path = out_dir / f"scene.{fmt}"
        if fmt == "ply":
            write_ply(path, splats, sh_degree)
            info = verify_ply(path, ref)
        elif fmt == "splat":
            write_splat(path, splats)
            info = verify_splat(path, ref, importance_order(splats))
        elif fmt == "spz":
            write_spz(path, splats, sh_degree, version=spz_version, from_coordinates=spz_from_coordinates)
            k1 = min((sh_degree + 1) ** 2 - 1, ref["shN"].shape[1])
            info = verify_spz(path, {**ref, "shN": ref["shN"][:, :k1]}, spz_version, spz_from_coordinates)
        else:
            raise ValueError(f"unknown export format {fmt!r}")
        size = path.stat().st_size
        files[fmt] = {"path": str(path), "bytes": size, "size_mb": round(size / 2**20, 4), "gaussians": n, **info}
    return {"gaussians": n, "sh_degree": sh_degree, "files": files}
