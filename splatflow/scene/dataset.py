"""Load an undistorted COLMAP scene (PINHOLE cameras) for training and evaluation (docs/CONTRACTS.md).

The sfm stage writes ``data/S/undistorted/{images,sparse}``; a synthetic scene's ``ground_truth/`` folder is the same
kind of COLMAP model, so ``load_scene`` also reads ``<scene>/`` folders laid out as ``images/`` + ``ground_truth/``.
3D Gaussian Splatting (Kerbl et al., SIGGRAPH 2023) assumes an ideal pinhole camera, which is why only
undistorted models (PINHOLE / SIMPLE_PINHOLE) are accepted here: any remaining lens distortion would be baked into
the Gaussians.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from splatflow.pipeline.errors import UserError

__all__ = ["View", "SceneData", "load_scene", "find_model_dir", "read_split"]

_PINHOLE_MODELS = ("PINHOLE", "SIMPLE_PINHOLE")


@dataclass(frozen=True, eq=False)
class View:
    """One registered image: intrinsics ``K`` in pixels (COLMAP: pixel centres at +0.5) and pose world->camera.

    Compared and hashed by identity (``eq=False``): field-wise equality is ambiguous for numpy arrays.
    """

    name: str
    image_path: Path
    width: int
    height: int
    K: np.ndarray  # [3, 3] float64
    world_to_cam: np.ndarray  # [4, 4] float64, x_cam = R X + t; camera looks along +z, y down
    # (w, h) of the file at image_path when it is larger than width x height: readers area-downscale it
    # (splatflow.scene.resolution); None: the file is exactly width x height
    source_size: tuple[int, int] | None = None
    mask_path: Path | None = None  # white = keep (splatflow.scene.masks); None: every pixel counts
    # the distorted SfM camera (pycolmap.Camera) the mask was drawn in, when the image was undistorted
    mask_camera: object | None = None


@dataclass
class SceneData:
    views: list[View]  # sorted by name
    points: np.ndarray  # [P, 3] float32
    colors: np.ndarray  # [P, 3] uint8
    train_views: list[View] = field(default_factory=list)
    test_views: list[View] = field(default_factory=list)
    root: Path | None = None

    def fingerprint(self) -> str:
        """A digest of what training reads from the scene: the views (names, sizes, intrinsics, poses, the image
        and mask files' sizes), the train/test division and the SfM points with their colours. A training
        checkpoint records it, so a run resumes only on the scene it was started on: after new photos, a new SfM
        model or another split, the stage trains afresh instead of continuing a model fitted to other data."""
        h = hashlib.sha256()

        def size(path: Path | None) -> int:
            try:
                return path.stat().st_size if path is not None else -1
            except OSError:
                return -2

        for v in self.views:
            h.update(repr((v.name, v.width, v.height, v.source_size, size(v.image_path), size(v.mask_path)))
                     .encode())
            h.update(np.ascontiguousarray(v.K, dtype=np.float64).tobytes())
            h.update(np.ascontiguousarray(v.world_to_cam, dtype=np.float64).tobytes())
        h.update(repr(([v.name for v in self.train_views], [v.name for v in self.test_views])).encode())
        h.update(np.ascontiguousarray(self.points, dtype=np.float32).tobytes())
        h.update(np.ascontiguousarray(self.colors, dtype=np.uint8).tobytes())
        return h.hexdigest()[:16]


def find_model_dir(scene_dir: Path) -> Path:
    """The COLMAP model folder inside ``scene_dir``: ``sparse/``, ``sparse/0/``, ``ground_truth/`` or itself."""
    for cand in (scene_dir / "sparse", scene_dir / "sparse" / "0", scene_dir / "ground_truth", scene_dir):
        if (cand / "cameras.bin").exists() or (cand / "cameras.txt").exists():
            return cand
    raise UserError(
        f"{scene_dir}: no COLMAP model found (looked for cameras.bin/cameras.txt in sparse/, sparse/0/, "
        f"ground_truth/ and the folder itself). Run the sfm stage first, or point to a scene's undistorted/ folder."
    )


def read_split(split_json: str | Path) -> dict:
    """Read and check ``split.json`` = ``{"train": [names], "test": [names], "rule": str}``."""
    path = Path(split_json)
    try:
        split = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path}: split file not found; run the split stage first") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not valid JSON ({e}); delete it and rerun the split stage") from None
    if not isinstance(split, dict) or not isinstance(split.get("train"), list) or not isinstance(
            split.get("test"), list):
        raise UserError(f"{path}: expected {{'train': [names], 'test': [names], 'rule': ...}}; rerun the split stage")
    overlap = set(split["train"]) & set(split["test"])
    if overlap:
        raise UserError(f"{path}: {len(overlap)} images are in both train and test (e.g. {sorted(overlap)[0]}); "
                        f"rerun the split stage")
    return split


def load_scene(undistorted_dir: str | Path, split_json: str | Path | None = None) -> SceneData:
    """Read the COLMAP model and image paths of an undistorted scene (see the module docstring).

    Views are sorted by name. With ``split_json`` the views are divided into ``train_views`` and ``test_views`` as
    listed there (every name must be a registered image); without it every view is a training view.
    """
    import pycolmap

    root = Path(undistorted_dir)
    if not root.is_dir():
        raise UserError(f"{root}: scene folder not found; run the sfm stage first (it writes data/<scene>/undistorted)")
    model_dir = find_model_dir(root)
    image_dir = root / "images"
    try:
        rec = pycolmap.Reconstruction(str(model_dir))
    except Exception as e:  # pycolmap raises plain RuntimeError/ValueError on corrupt models
        raise UserError(f"{model_dir}: cannot read the COLMAP model ({e}); rerun the sfm stage") from None

    views = []
    for image in rec.images.values():
        if not image.has_pose:
            continue
        cam = rec.cameras[image.camera_id]
        if cam.model_name not in _PINHOLE_MODELS:
            raise UserError(
                f"{model_dir}: camera {cam.camera_id} is {cam.model_name}, but training needs an undistorted "
                f"PINHOLE model; load data/<scene>/undistorted (written by the sfm stage), not the distorted sparse/"
            )
        K = np.asarray(cam.calibration_matrix(), dtype=np.float64)  # [3, 3]
        w2c = np.eye(4)
        w2c[:3, :] = np.asarray(image.cam_from_world().matrix(), dtype=np.float64)  # [3, 4]
        path = image_dir / image.name
        if not path.exists():
            raise UserError(f"{path}: image listed in {model_dir} is missing; rerun the sfm stage")
        views.append(View(name=image.name, image_path=path, width=int(cam.width), height=int(cam.height), K=K,
                          world_to_cam=w2c))
    if not views:
        raise UserError(f"{model_dir}: the model has no registered images; rerun the sfm stage")
    views.sort(key=lambda v: v.name)

    if rec.num_points3D() > 0:
        pts = rec.points3D.values()
        points = np.array([p.xyz for p in pts], dtype=np.float32).reshape(-1, 3)  # [P, 3]
        colors = np.array([p.color for p in pts], dtype=np.uint8).reshape(-1, 3)  # [P, 3]
    else:
        points = np.zeros((0, 3), dtype=np.float32)
        colors = np.zeros((0, 3), dtype=np.uint8)

    if split_json is None:
        train, test = list(views), []
    else:
        split = read_split(split_json)
        by_name = {v.name: v for v in views}
        unknown = [n for n in split["train"] + split["test"] if n not in by_name]
        if unknown:
            raise UserError(f"{split_json}: {len(unknown)} names are not registered images of {model_dir} "
                            f"(e.g. {unknown[0]}); rerun the split stage after sfm")
        train = [by_name[n] for n in sorted(split["train"])]
        test = [by_name[n] for n in sorted(split["test"])]
    return SceneData(views=views, points=points, colors=colors, train_views=train, test_views=test, root=root)
