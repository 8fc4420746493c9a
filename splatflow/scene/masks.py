"""Per-image masks: pixels a user wants left out of training and evaluation (people, sky, the capture rig).

A mask is a grey image named like its photo (``0005.png`` or ``0005.jpg.png`` for ``0005.jpg``, or the same file
name; a photo in a sub-folder of the source, ``cam_a/0005.jpg``, has its mask in the same sub-folder of the mask
folder, ``cam_a/0005.png``), white = keep, black = ignore, the size of the photo. Ingest checks and copies them
(:func:`ingest_masks`) to ``data/S/masks/<output stem>.png``, binarised at 50% grey. Training multiplies the
loss by the mask, so a masked pixel gives no gradient; evaluation scores kept pixels only.

The sfm stage undistorts the photos, so a mask drawn on a photo is carried into the undistorted camera the same
way (:func:`read_view_mask`: every undistorted pixel looks up where it came from in the distorted image), then
area-downscaled to the working size like the image. A working pixel is kept only when ALL of its footprint is
kept: a pixel half covered by a masked person still shows part of that person.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import cv2
import numpy as np

from splatflow.pipeline.errors import UserError
from splatflow.scene.cameras import scale_intrinsics
from splatflow.scene.dataset import find_model_dir

__all__ = ["MASK_SUFFIXES", "find_mask", "ingest_masks", "attach_masks", "read_view_mask"]

MASK_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff", ".webp")
_KEEP_EPS = 1e-3  # a working pixel is kept when its kept fraction is at least 1 - this


def find_mask(masks_dir: Path, image_name: str) -> Path | None:
    """The mask of ``image_name`` in ``masks_dir``: the same file name, ``<name>.png`` or ``<stem>.<ext>``."""
    stem = Path(image_name).stem
    for cand in [image_name, f"{image_name}.png", *(stem + s for s in MASK_SUFFIXES)]:
        p = masks_dir / cand
        if p.is_file():
            return p
    return None


def read_mask_file(path: Path) -> np.ndarray:
    """``[H, W]`` float32 in {0, 1} (white = keep, threshold 50% grey), EXIF orientation applied."""
    from PIL import Image, ImageOps

    try:
        with Image.open(path) as im:
            im.load()
            grey = np.asarray(ImageOps.exif_transpose(im).convert("L"))
    except Exception as e:  # noqa: BLE001 - Pillow raises many types for unreadable files
        raise UserError(f"{path}: cannot read this mask ({e}); masks must be grey or RGB images "
                        "(white = keep, black = ignore)") from None
    return (grey >= 128).astype(np.float32)


def ingest_masks(masks_dir: str | Path, kept: list, out_dir: str | Path) -> dict:
    """Check the masks of the images ingest ``kept`` and write them to ``out_dir`` (replaced); return metrics.

    ``kept`` are ingest candidates (``source`` = input file name, ``out_name``, ``width_px``, ``height_px``).
    Every kept image needs a mask of its size; a mask that matches no image in the source, or that keeps no
    pixel, is an error too (a typo in the names would otherwise silently train on unmasked images).
    """
    masks_dir, out_dir = Path(masks_dir), Path(out_dir)
    if not masks_dir.is_dir():
        raise UserError(f"{masks_dir}: mask folder not found; fix base.scenes.<scene>.masks in params.yaml "
                        "(a folder of masks named like the images, white = keep) or remove the key")
    staging = out_dir.parent / f".{out_dir.name}.staging"
    if staging.exists():
        import shutil

        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    missing, used, kept_fracs = [], set(), []
    for c in kept:
        src_name = c.source  # relative to the source: an image of sub-folder cam_a/ has its mask in masks/cam_a/
        p = find_mask(masks_dir / Path(src_name).parent, Path(src_name).name)
        if p is None:
            missing.append(src_name)
            continue
        used.add(p)
        m = read_mask_file(p)
        if m.shape != (c.height_px, c.width_px):
            raise UserError(f"{p}: mask is {m.shape[1]}x{m.shape[0]} but its image {src_name} is "
                            f"{c.width_px}x{c.height_px} (after EXIF rotation); masks must have their image's size")
        if not m.any():
            raise UserError(f"{p}: the mask is black everywhere, so {src_name} would contribute nothing; "
                            "white = keep, black = ignore (invert it?) or remove the image")
        kept_fracs.append(float(m.mean()))
        cv2.imwrite(str(staging / (Path(c.out_name).stem + ".png")), (m * 255).astype(np.uint8))
    if missing:
        import shutil

        shutil.rmtree(staging)
        raise UserError(f"{masks_dir}: no mask for {len(missing)} image(s) (e.g. {missing[0]}); give every image a "
                        f"mask named like it ({Path(missing[0]).with_suffix('.png').as_posix()}), or remove "
                        "base.scenes.<scene>.masks")
    orphans = []
    for folder in sorted({Path(c.source).parent for c in kept}):
        here = [Path(c.source).name for c in kept if Path(c.source).parent == folder]
        image_stems = {Path(n).stem for n in here} | set(here)
        orphans += sorted((folder / f.name).as_posix() for f in (masks_dir / folder).iterdir()
                          if f.is_file() and not f.name.startswith(".") and f not in used
                          and f.suffix.lower() in MASK_SUFFIXES and f.stem not in image_stems)
    if orphans:
        import shutil

        shutil.rmtree(staging)
        raise UserError(f"{masks_dir}: {len(orphans)} mask(s) match no image of the scene (e.g. {orphans[0]}); "
                        "mask names must follow the image names (0005.jpg -> 0005.png)")
    if out_dir.exists():
        import shutil

        shutil.rmtree(out_dir)
    staging.rename(out_dir)
    return {"masks": len(kept_fracs), "mask_kept_fraction_mean": round(float(np.mean(kept_fracs)), 4)}


def attach_masks(scene, masks_dir: str | Path, sparse_dir: str | Path | None = None):
    """``scene`` with ``mask_path`` (and the distorted camera to undistort the mask with) on every view.

    ``masks_dir`` holds ``<stem>.png`` per image (what ingest writes); ``sparse_dir`` is the distorted SfM model:
    a view whose camera there is not an undistorted pinhole gets that camera, so :func:`read_view_mask` can
    carry the mask into the undistorted image.
    """
    import pycolmap

    masks_dir = Path(masks_dir)
    cams = {}
    if sparse_dir is not None and Path(sparse_dir).exists():
        rec = pycolmap.Reconstruction(str(find_model_dir(Path(sparse_dir))))
        for im in rec.images.values():
            cam = rec.cameras[im.camera_id]
            if not (cam.model_name in ("PINHOLE", "SIMPLE_PINHOLE") or cam.is_undistorted()):
                cams[im.name] = cam
    new = {}
    for v in scene.views:
        p = masks_dir / (Path(v.name).stem + ".png")
        if not p.is_file():
            raise UserError(f"{p}: mask of {v.name} is missing; rerun the ingest stage (it writes data/<scene>/masks "
                            "from base.scenes.<scene>.masks)")
        new[id(v)] = dataclasses.replace(v, mask_path=p, mask_camera=cams.get(v.name))
    return dataclasses.replace(scene, views=[new[id(v)] for v in scene.views],
                               train_views=[new[id(v)] for v in scene.train_views],
                               test_views=[new[id(v)] for v in scene.test_views])


def _undistort_mask(mask: np.ndarray, cam, K_und: np.ndarray, width: int, height: int) -> np.ndarray:
    """The distorted-camera ``mask`` seen by the undistorted pinhole ``K_und`` of ``width x height`` (float)."""
    u, v = np.meshgrid(np.arange(width, dtype=np.float64) + 0.5, np.arange(height, dtype=np.float64) + 0.5)
    pix = np.stack([u.ravel(), v.ravel(), np.ones(u.size)], axis=1)  # [HW, 3] (COLMAP: pixel centres at +0.5)
    rays = pix @ np.linalg.inv(K_und).T  # [HW, 3] camera rays, z = 1
    xy = np.asarray(cam.img_from_cam(rays, False), dtype=np.float64) - 0.5  # [HW, 2] cv2 pixel centres
    map_x = xy[:, 0].reshape(height, width).astype(np.float32)
    map_y = xy[:, 1].reshape(height, width).astype(np.float32)
    # outside the distorted image there is no photo either: ignore those pixels
    return cv2.remap(mask, map_x, map_y, interpolation=cv2.INTER_LINEAR, borderMode=cv2.BORDER_CONSTANT,
                     borderValue=0.0)


def read_view_mask(view) -> np.ndarray | None:
    """``[H, W]`` bool keep-mask of ``view`` at its working size, or None when the view has no mask."""
    path = getattr(view, "mask_path", None)
    if path is None:
        return None
    m = read_mask_file(Path(path))  # [Hm, Wm] at the size of the ingested photo
    w, h = int(view.width), int(view.height)
    cam = getattr(view, "mask_camera", None)
    if cam is not None:  # into the undistorted full-size frame first
        src = getattr(view, "source_size", None)
        fw, fh = (int(src[0]), int(src[1])) if src is not None else (w, h)
        if m.shape != (int(cam.height), int(cam.width)):
            raise UserError(f"{path}: mask is {m.shape[1]}x{m.shape[0]} but the SfM camera of {view.name} is "
                            f"{cam.width}x{cam.height}; rerun the ingest stage")
        m = _undistort_mask(m, cam, scale_intrinsics(view.K, w, h, fw, fh), fw, fh)
    if m.shape != (h, w):
        mh, mw = m.shape
        if abs(mw / mh - w / h) > 0.01 * (w / h):
            raise UserError(f"{path}: mask is {mw}x{mh}, which is not the shape of {view.name} ({w}x{h}); "
                            "rerun the ingest stage")
        m = cv2.resize(m, (w, h), interpolation=cv2.INTER_AREA)
    return m >= 1.0 - _KEEP_EPS
