"""Ground-truth cameras and how far an SfM result is from them.

SfM recovers cameras only up to a similarity (scale, rotation, translation: the gauge freedom of structure from
motion, Hartley & Zisserman, *Multiple View Geometry*, §10.2), so the error is measured after aligning the SfM camera
centres to the true ones with the closed-form least-squares similarity of Umeyama (IEEE TPAMI 13(4), 1991), and
divided by the extent of the true camera orbit (largest distance between two true centres) so that it is a unitless
fraction comparable across scenes of any scale.

Readers for three formats, chosen by what the path holds:

* a COLMAP model folder (``cameras.txt``/``images.txt`` or the ``.bin`` files), e.g. our generator's
  ``ground_truth/`` folder;
* our generator's ``cameras.json`` (or a folder holding it);
* the Strecha benchmark's ``gt_dense_cameras/`` folder of ``<image>.camera`` files (Strecha et al., CVPR 2008): K
  (3 rows), distortion (1 row), R (3 rows, camera orientation in world coordinates), C (camera centre), width height;
  projection ``x ~ K R^T (X - C)``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from splatflow.pipeline.errors import UserError
from splatflow.scene.cameras import camera_centers

__all__ = ["GroundTruthCamera", "read_ground_truth", "umeyama", "CameraError", "camera_error"]


@dataclass(frozen=True)
class GroundTruthCamera:
    name: str
    world_to_cam: np.ndarray  # [4, 4]
    K: np.ndarray | None = None  # [3, 3], when known

    @property
    def center(self) -> np.ndarray:
        return camera_centers(self.world_to_cam)


def _w2c(rot_cam_from_world: np.ndarray, t: np.ndarray) -> np.ndarray:
    m = np.eye(4)
    m[:3, :3] = rot_cam_from_world
    m[:3, 3] = t
    return m


def _read_colmap(model_dir: Path) -> dict[str, GroundTruthCamera]:
    import pycolmap

    try:
        rec = pycolmap.Reconstruction(str(model_dir))
    except Exception as e:
        raise UserError(f"{model_dir}: cannot read this COLMAP model as ground truth ({e})") from None
    out = {}
    for im in rec.images.values():
        if not im.has_pose:
            continue
        w2c = np.eye(4)
        w2c[:3, :] = np.asarray(im.cam_from_world().matrix(), dtype=np.float64)
        out[im.name] = GroundTruthCamera(im.name, w2c, np.asarray(rec.cameras[im.camera_id].calibration_matrix()))
    return out


def _read_cameras_json(path: Path) -> dict[str, GroundTruthCamera]:
    try:
        data = json.loads(path.read_text())
        frames = data["frames"]
        return {f["name"]: GroundTruthCamera(f["name"], np.asarray(f["world_to_cam"], dtype=np.float64),
                                             np.asarray(f["K"], dtype=np.float64)) for f in frames}
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise UserError(f"{path}: not a splatflow cameras.json ({type(e).__name__}: {e}); expected "
                        f"{{'frames': [{{'name', 'K', 'world_to_cam'}}]}} as written by `splatflow demo-scene`"
                        ) from None


def read_strecha_camera(path: Path) -> GroundTruthCamera:
    """One Strecha ``.camera`` file (see the module docstring) -> camera with world_to_cam = [R^T | -R^T C]."""
    try:
        rows = [[float(x) for x in line.split()] for line in path.read_text().splitlines() if line.strip()]
        K = np.array(rows[0:3])
        R = np.array(rows[4:7])  # camera orientation in world coordinates (columns = camera axes)
        C = np.array(rows[7])
        if K.shape != (3, 3) or R.shape != (3, 3) or C.shape != (3,):
            raise ValueError("unexpected row lengths")
    except (ValueError, IndexError) as e:
        raise UserError(f"{path}: not a Strecha .camera file ({e}); expected K (3 rows), distortion, R (3 rows), "
                        f"C, width height") from None
    name = path.name[: -len(".camera")]
    return GroundTruthCamera(name, _w2c(R.T, -R.T @ C), K)


def read_ground_truth(path: str | Path) -> dict[str, GroundTruthCamera]:
    """Image name -> true camera, from any of the formats in the module docstring."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"{p}: ground-truth cameras not found; fix base.scenes.<scene>.ground_truth in params.yaml "
                        f"or remove the key")
    if p.is_file():
        if p.suffix == ".json":
            return _read_cameras_json(p)
        if p.name.endswith(".camera"):
            cam = read_strecha_camera(p)
            return {cam.name: cam}
        raise UserError(f"{p}: unknown ground-truth format; give a COLMAP model folder, a cameras.json or a "
                        f"folder of Strecha .camera files")
    if any((p / f).exists() for f in ("cameras.txt", "cameras.bin")):
        return _read_colmap(p)
    if (p / "cameras.json").exists():
        return _read_cameras_json(p / "cameras.json")
    strecha = sorted(p.glob("*.camera"))
    if strecha:
        return {c.name: c for c in map(read_strecha_camera, strecha)}
    raise UserError(f"{p}: no ground-truth cameras found (no cameras.txt/.bin, cameras.json or *.camera files)")


def umeyama(src: np.ndarray, dst: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
    """Least-squares similarity ``dst ~ s * R @ src + t`` between point sets ``src, dst [N, 3]`` (Umeyama 1991).

    Returns ``(s, R [3, 3], t [3])``; R is a proper rotation (det +1) even when the best orthogonal map would be a
    reflection.
    """
    src = np.asarray(src, dtype=np.float64)
    dst = np.asarray(dst, dtype=np.float64)
    if src.shape != dst.shape or src.ndim != 2 or src.shape[1] != 3 or src.shape[0] < 3:
        raise ValueError(f"umeyama needs two [N>=3, 3] arrays, got {src.shape} and {dst.shape}")
    mu_s, mu_d = src.mean(0), dst.mean(0)
    xs, xd = src - mu_s, dst - mu_d
    var_s = (xs ** 2).sum() / len(src)
    if var_s <= 0:
        raise ValueError("umeyama: all source points coincide")
    cov = xd.T @ xs / len(src)  # [3, 3]
    U, D, Vt = np.linalg.svd(cov)
    S = np.eye(3)
    if np.linalg.det(U) * np.linalg.det(Vt) < 0:
        S[2, 2] = -1.0
    R = U @ S @ Vt
    s = float(np.trace(np.diag(D) @ S) / var_s)
    t = mu_d - s * R @ mu_s
    return s, R, t


@dataclass(frozen=True)
class CameraError:
    matched: int  # images found in both
    center_error_rel: float  # mean centre error after alignment / orbit extent
    center_error_max_rel: float
    rotation_error_deg: float  # mean angle between aligned and true camera orientations
    orbit_extent: float  # in ground-truth units


def _match_names(names: list[str], truth: dict[str, GroundTruthCamera]) -> dict[str, str]:
    """SfM name -> ground-truth name: exact, else by file stem (ingest may change the extension)."""
    by_stem = {Path(n).stem: n for n in truth}
    out = {}
    for n in names:
        if n in truth:
            out[n] = n
        elif Path(n).stem in by_stem:
            out[n] = by_stem[Path(n).stem]
    return out


def camera_error(world_to_cams: dict[str, np.ndarray], truth: dict[str, GroundTruthCamera]) -> CameraError:
    """Compare estimated cameras (name -> world_to_cam [4, 4]) with the truth after a similarity alignment."""
    pairs = _match_names(sorted(world_to_cams), truth)
    if len(pairs) < 3:
        raise UserError(f"only {len(pairs)} registered images have a ground-truth camera (need 3 to align); check "
                        f"that base.scenes.<scene>.ground_truth belongs to this scene (names are matched by stem)")
    names = sorted(pairs)
    est_w2c = np.stack([world_to_cams[n] for n in names])  # [M, 4, 4]
    gt_w2c = np.stack([truth[pairs[n]].world_to_cam for n in names])  # [M, 4, 4]
    est_c = camera_centers(est_w2c)  # [M, 3]
    gt_c = camera_centers(gt_w2c)  # [M, 3]
    s, R, t = umeyama(est_c, gt_c)
    aligned = s * est_c @ R.T + t  # [M, 3]
    extent = float(np.max(np.linalg.norm(gt_c[:, None] - gt_c[None], axis=-1)))
    err = np.linalg.norm(aligned - gt_c, axis=1) / extent
    # Orientation: the estimated camera-from-world rotation maps to R_est @ R^T in the ground-truth frame.
    rel = np.einsum("mij,mkj->mik", est_w2c[:, :3, :3] @ R.T, gt_w2c[:, :3, :3])  # [M, 3, 3] R_est' R_gt^T
    cos = np.clip((np.trace(rel, axis1=1, axis2=2) - 1.0) / 2.0, -1.0, 1.0)
    return CameraError(matched=len(names), center_error_rel=float(err.mean()), center_error_max_rel=float(err.max()),
                       rotation_error_deg=float(np.degrees(np.arccos(cos)).mean()), orbit_extent=extent)
