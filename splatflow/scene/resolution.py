"""The image size training, pruning and evaluation work at, and where those images come from.

Published novel-view-synthesis numbers are computed at a stated resolution: Mip-NeRF 360 outdoor scenes on the
dataset's ``images_4`` level, indoor ones on ``images_2``, and the reference 3DGS code brings any image wider
than 1600 px down to 1600 px unless told otherwise. A real capture (3072x2048 photos, 4K video) would also be
far too slow to train at full size on a CPU. :func:`apply_resolution` turns the full-size undistorted views of
the sfm stage into views at the configured size (:class:`splatflow.pipeline.config.ResolutionConfig`):

* ``downscale: N`` uses the dataset's own ``data/S/images_N/`` (copied by ingest from a dataset that ships it,
  same file names as ``images/``) when every view has one there AND the sfm stage did not have to undistort the
  images (the SfM camera is an undistorted pinhole whose undistorted copy has the same size and intrinsics):
  those files are what published numbers are computed on. Otherwise the undistorted images are area-downscaled
  by N, because an ``images_N`` file of a distorted camera does not match the undistorted model.
* ``max_side_px: M`` area-downscales so that the longest side is M (never upscales).
* neither: images longer than ``default_max_side_px`` (1600) are brought to it, as the 3DGS code does.

Area downscaling is ``cv2.INTER_AREA`` on the 8-bit image (each output pixel the mean of the input pixels it
covers, rounded to 8 bits, as a stored ``images_N`` file would be) and the intrinsics are scaled by the same
per-axis ratios (:func:`splatflow.scene.cameras.scale_intrinsics`), so the smaller camera sees exactly the smaller
image. The full-size file is decoded only when a view is needed and dropped after resizing
(:func:`read_view_rgb`), so memory holds only images at the working size.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import cv2
import numpy as np

from splatflow.pipeline.config import ResolutionConfig
from splatflow.pipeline.errors import UserError
from splatflow.scene.cameras import scale_intrinsics
from splatflow.scene.dataset import find_model_dir, load_scene
from splatflow.scene.masks import attach_masks
from splatflow.scene.notes import folder_files
from splatflow.scene.pixels import read_rgb

__all__ = ["target_size", "apply_resolution", "read_view_rgb", "LEVELS"]

log = logging.getLogger("splatflow.resolution")

LEVELS = (2, 4, 8)  # the images_N levels of the Inria / Mip-NeRF 360 layout
_LEVEL_TOLERANCE_PX = 1  # an images_N file may round its size either way (Mip-NeRF 360's do)


def target_size(width: int, height: int, cfg: ResolutionConfig) -> tuple[tuple[int, int], str]:
    """``((w, h), rule)``: the working size of a ``width x height`` image and the rule that chose it."""
    def longest(m: int) -> tuple[int, int]:
        s = m / max(width, height)
        return (m, max(1, round(height * s))) if width >= height else (max(1, round(width * s)), m)

    if cfg.downscale is not None:
        n = cfg.downscale
        return (max(1, round(width / n)), max(1, round(height / n))), f"downscale {n}"
    if cfg.max_side_px is not None:
        if max(width, height) > cfg.max_side_px:
            return longest(cfg.max_side_px), f"max_side_px {cfg.max_side_px}"
        return (width, height), f"max_side_px {cfg.max_side_px} (images are smaller: full resolution)"
    m = cfg.default_max_side_px
    if m and max(width, height) > m:
        return longest(m), f"default: longest side > {m} px brought to {m} px (as the reference 3DGS code)"
    return (width, height), ("default: full resolution (longest side <= "
                             f"{m} px)" if m else "default_max_side_px 0: full resolution")


def _image_size(path: Path) -> tuple[int, int] | None:
    from PIL import Image

    try:
        with Image.open(path) as im:
            return im.size
    except (OSError, ValueError):
        return None


def _needed_no_undistortion(sparse_dir: Path | None, undistorted_model: Path) -> tuple[bool, str]:
    """Whether the sfm stage's undistortion left every camera unchanged (so ``images_N`` files match it)."""
    import pycolmap

    if sparse_dir is None or not Path(sparse_dir).exists():
        return False, "no distorted SfM model to compare with"
    try:
        dist = pycolmap.Reconstruction(str(find_model_dir(Path(sparse_dir))))
        und = pycolmap.Reconstruction(str(find_model_dir(Path(undistorted_model))))
    except Exception as e:  # noqa: BLE001 - pycolmap raises plain RuntimeError/ValueError
        return False, f"cannot read the SfM models ({e})"
    by_name = {im.name: dist.cameras[im.camera_id] for im in dist.images.values()}
    for im in und.images.values():
        cu, cd = und.cameras[im.camera_id], by_name.get(im.name)
        if cd is None:
            return False, f"{im.name} is not in {sparse_dir}"
        pinhole = cd.model_name in ("PINHOLE", "SIMPLE_PINHOLE") or bool(cd.is_undistorted())
        same = (cd.width, cd.height) == (cu.width, cu.height) and np.allclose(
            cd.calibration_matrix(), cu.calibration_matrix(), rtol=1e-6, atol=1e-6)
        if not (pinhole and same):
            return False, f"camera of {im.name} is {cd.model_name} and was undistorted by the sfm stage"
    return True, "the SfM cameras needed no undistortion"


def _usable_level(views, data_dir: Path, n: int, sparse_dir: Path | None,
                  undistorted_model: Path | None) -> tuple[dict | None, str]:
    """``({name: (path, (w, h))}, why)`` when ``data_dir/images_N`` serves every view, else ``(None, why not)``."""
    level = Path(data_dir) / f"images_{n}"
    if not folder_files(level):  # for a dataset without it ingest leaves the folder with only a note
        return None, f"no {level.name}/ level in this dataset"
    if undistorted_model is not None:
        ok, why = _needed_no_undistortion(sparse_dir, undistorted_model)
        if not ok:
            return None, f"{level} exists but {why}: area-downscaling the undistorted images instead"
    files = {}
    for v in views:
        p = level / v.name
        size = _image_size(p) if p.exists() else None
        if size is None:
            return None, f"{level} lacks a readable {v.name}: area-downscaling the undistorted images instead"
        if abs(size[0] - v.width / n) > _LEVEL_TOLERANCE_PX or abs(size[1] - v.height / n) > _LEVEL_TOLERANCE_PX:
            return None, (f"{p} is {size[0]}x{size[1]}, not 1/{n} of {v.width}x{v.height}: "
                          "area-downscaling the undistorted images instead")
        files[v.name] = (p, size)
    return files, f"the dataset's own {level.name}/ ({why if undistorted_model is not None else 'given'})"


def apply_resolution(scene, cfg: ResolutionConfig, *, data_dir: str | Path | None = None,
                     sparse_dir: str | Path | None = None, undistorted_model: str | Path | None = None):
    """``(scene, info)``: ``scene`` with every view at the working size, and what was chosen and why.

    ``data_dir`` is where ``images_N`` levels may live (``data/S``); ``sparse_dir`` the distorted SfM model and
    ``undistorted_model`` the undistorted one (folders holding them), compared to decide whether ``images_N`` files match the cameras
    (without them an ``images_N`` level is not used). ``info`` is JSON-ready: ``rule``, ``image_source``,
    ``reason``, ``sizes`` and ``full_sizes``.
    """
    views = list(scene.views)
    full_sizes = sorted({f"{v.width}x{v.height}" for v in views})
    files, why_level = None, None
    if cfg.downscale is not None and cfg.downscale > 1 and data_dir is not None:
        files, why_level = _usable_level(views, Path(data_dir), cfg.downscale,
                                         Path(sparse_dir) if sparse_dir else None,
                                         Path(undistorted_model) if undistorted_model else None)
    new, rules = {}, set()
    for v in views:
        if files is not None:
            path, (w, h) = files[v.name]
            rules.add(f"downscale {cfg.downscale}")
            new[id(v)] = dataclasses.replace(v, image_path=path, width=w, height=h,
                                             K=scale_intrinsics(v.K, v.width, v.height, w, h), source_size=None)
            continue
        (w, h), rule = target_size(v.width, v.height, cfg)
        rules.add(rule)
        if (w, h) == (v.width, v.height):
            new[id(v)] = v
        else:
            new[id(v)] = dataclasses.replace(v, width=w, height=h, K=scale_intrinsics(v.K, v.width, v.height, w, h),
                                             source_size=(v.width, v.height))
    resized = any(new[id(v)].source_size is not None for v in views)
    if files is not None:
        source = f"images_{cfg.downscale}"
        reason = why_level
    elif resized:
        source = "area-downscaled (cv2.INTER_AREA) from the undistorted images"
        reason = why_level or "no images_N level applies"
    else:
        source = "undistorted images at full resolution"
        reason = why_level or "no downscaling needed"
    out = dataclasses.replace(scene, views=[new[id(v)] for v in scene.views],
                              train_views=[new[id(v)] for v in scene.train_views],
                              test_views=[new[id(v)] for v in scene.test_views])
    info = {"rule": "; ".join(sorted(rules)), "image_source": source, "reason": reason,
            "sizes": sorted({f"{x.width}x{x.height}" for x in out.views}), "full_sizes": full_sizes}
    log.info("resolution: %s -> %s from %s (%s)", info["rule"], ", ".join(info["sizes"]), source, reason)
    return out, info


def read_view_rgb(view) -> np.ndarray:
    """``[H, W, 3]`` uint8 RGB of ``view`` at its working size: decoded, and area-downscaled when the file is
    the larger ``view.source_size`` (the full-size array is dropped at once). UserError naming the file when it
    cannot be decoded or has neither size."""
    img = read_rgb(view.image_path)
    h, w = img.shape[:2]
    if (w, h) == (view.width, view.height):
        return img
    src = getattr(view, "source_size", None)
    if src is not None and (w, h) == tuple(src):
        return cv2.resize(img, (int(view.width), int(view.height)), interpolation=cv2.INTER_AREA)
    expected = f"{view.width}x{view.height}" + (f" or {src[0]}x{src[1]}" if src is not None else "")
    raise UserError(f"{view.image_path}: image is {w}x{h} but its camera says {expected}; rerun the sfm stage so "
                    "images and model agree")


def load_working_scene(params, paths, *, with_split: bool = True):
    """``(scene, info)`` as train, prune and evaluate use it: the sfm stage's undistorted model with the split,
    at the scene's working size (``base.scenes.S.resolution`` or ``base.resolution``), with its masks when
    ``base.scenes.S.masks`` is set. ``info`` (:func:`apply_resolution`) goes into the stage's metrics."""
    scene = load_scene(paths.undistorted_dir, paths.split_json if with_split else None)
    scene, info = apply_resolution(scene, params.base.scene_resolution(paths.scene), data_dir=paths.data_dir,
                                   sparse_dir=paths.sparse_dir, undistorted_model=paths.undistorted_dir)
    src = params.base.scenes.get(paths.scene)  # absent when a stage is called on a bare folder (tests, tools)
    masked = src is not None and src.masks is not None
    if masked:
        scene = attach_masks(scene, paths.masks_dir, paths.sparse_dir)
    info["masks"] = masked
    return scene, info


def describe(info: dict) -> str:
    """One line for the stage logs: the working size and where its images come from."""
    return (f"resolution {', '.join(info['sizes'])} (full {', '.join(info['full_sizes'])}; {info['rule']}) from "
            f"{info['image_source']}: {info['reason']}" + ("; masks on" if info.get("masks") else ""))
