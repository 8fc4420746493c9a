"""Existing COLMAP datasets as a scene source: the dataset's cameras and points instead of a new SfM run.

Published scenes (Mip-NeRF 360, Tanks and Temples and Deep Blending in the layout of the 3D Gaussian Splatting
reference code) come as ``images/`` (full resolution), optional ``images_2/ images_4/ images_8/`` (the same
names, downscaled by 2/4/8: what published metrics are computed on) and a COLMAP model in ``sparse/0/`` or
``sparse/`` (binary or text). A scene with ``base.scenes.S.colmap`` set is such a dataset:

* ingest validates and copies ``images/`` like any capture (so a broken or duplicate file is still caught), and
  copies each ``images_N`` level to ``data/S/images_N/`` under the names ingest gave the full-resolution images
  (:func:`copy_levels`). For every scene those three folders exist after ingest (DVC outputs cannot be optional);
  an empty one means the dataset has no such level.
* the sfm stage imports the model (:func:`import_model`): no features, no matching, no mapping. It keeps the
  registered images that ingest kept, drops the others from the model and names each with the reason (ingest's
  rejection or "not in the images folder"), refuses a model whose cameras do not match its images' sizes, and
  writes the same outputs as an SfM run (``data/S/sparse/``, ``data/S/undistorted/{images,sparse}``, the metrics
  of sfm.json with ``"source": "imported"``). Pinhole models are copied unchanged (images byte for byte, so the
  pixels a published table was measured on stay the same); every other model that COLMAP's undistorter handles
  (all perspective models: the radial, OpenCV, division and fisheye families) is undistorted to PINHOLE.
"""

from __future__ import annotations

import math
import mmap
import shutil
import struct
import tempfile
import time
from pathlib import Path

from splatflow.pipeline.config import BaseConfig, IngestConfig, SfmConfig
from splatflow.pipeline.errors import UserError
from splatflow.scene.groundtruth import read_ground_truth
from splatflow.scene.ingest import _Reject, _save, open_image, output_names
from splatflow.scene.notes import write_empty_note
from splatflow.scene.sfm import (SfmResult, camera_summary, check_reconstruction, list_images, model_metrics,
                                replace_dir, undistort_model)

__all__ = ["LEVELS", "find_model", "is_colmap_dataset", "level_dir", "output_name_map", "copy_levels",
           "empty_levels", "import_model", "check_model_files", "partial_model", "incomplete_model_message"]

LEVELS = (2, 4, 8)  # the downscale levels of the Inria / Mip-NeRF 360 layout
MODEL_CANDIDATES = ("sparse/0", "sparse")


def _has_model(d: Path) -> bool:
    return d.is_dir() and all((d / f"{n}.bin").exists() or (d / f"{n}.txt").exists()
                              for n in ("cameras", "images", "points3D"))


def _missing_files(d: Path) -> list[str]:
    """The model files (``cameras``, ``images``, ``points3D``) that ``d`` has neither as .bin nor as .txt."""
    return [n for n in MODEL_FILES if not ((d / f"{n}.bin").exists() or (d / f"{n}.txt").exists())]


def partial_model(root: str | Path) -> tuple[Path, list[str]] | None:
    """A model folder of the dataset at ``root`` that holds some model files but not all: (folder, missing)."""
    for rel in MODEL_CANDIDATES:
        d = Path(root) / rel
        if d.is_dir():
            missing = _missing_files(d)
            if missing and len(missing) < len(MODEL_FILES):
                return d, missing
    return None


def incomplete_model_message(d: Path, missing: list[str], images: Path | None = None) -> str:
    """What a model folder lacks, and the fix: a model exported without its points (the usual case) cannot start
    training, which begins from the model's 3D points."""
    present = [n for n in MODEL_FILES if n not in missing]
    sfm = (f"give {images} to `splatflow add-scene` to run SfM on the images" if images is not None
           else "drop base.scenes.<scene>.colmap so the sfm stage runs SfM on the images")
    if missing == ["points3D"]:
        fix = ("training starts from the model's 3D points: re-export the model with its points (COLMAP: File > "
               "Export model; for a poses-only model, `colmap point_triangulator` makes them), or " + sfm)
    else:
        fix = f"copy the missing file{'s' * (len(missing) > 1)} from the COLMAP project, or {sfm}"
    return (f"{d}: the COLMAP model has {' and '.join(present)} but no {' or '.join(missing)} (.bin or .txt); "
            f"{fix}")


def find_model(root: str | Path) -> str | None:
    """The model folder of a dataset, relative to ``root`` (``sparse/0`` before ``sparse``), or None."""
    root = Path(root)
    for rel in MODEL_CANDIDATES:
        if _has_model(root / rel):
            return rel
    return None


def is_colmap_dataset(path: str | Path) -> bool:
    """A folder holding ``images/`` and a COLMAP model in ``sparse/0/`` or ``sparse/``."""
    path = Path(path)
    return path.is_dir() and (path / "images").is_dir() and find_model(path) is not None


def model_dir(source: Path, colmap: str) -> Path:
    """``base.scenes.S.colmap`` resolved against the dataset root ``source``; UserError when it holds no model."""
    p = Path(colmap).expanduser()
    p = p if p.is_absolute() else source / p
    if p.is_dir() and 0 < len(_missing_files(p)) < len(MODEL_FILES):
        raise UserError(incomplete_model_message(p, _missing_files(p)))
    if not _has_model(p):
        found = find_model(source) if source.is_dir() else None
        hint = f" (this dataset has one in {found})" if found else ""
        raise UserError(f"{p}: no COLMAP model here (cameras, images and points3D as .bin or .txt); set "
                        f"base.scenes.<scene>.colmap to the model folder relative to {source}{hint}")
    check_model_files(p)
    return p


MODEL_FILES = ("cameras", "images", "points3D")
_FIX = ("re-export the model from COLMAP (File > Export model, or `colmap model_converter --input_path <a readable "
        "copy> --output_path {dir} --output_type BIN`), or drop base.scenes.<scene>.colmap so the sfm stage runs "
        "splatflow's own SfM on the images alone")


def _model_files(model_path: Path) -> list[Path]:
    """The files pycolmap will read: the three .bin when all exist, else the three .txt (as COLMAP chooses)."""
    for suffix in (".bin", ".txt"):
        files = [model_path / f"{n}{suffix}" for n in MODEL_FILES]
        if all(f.is_file() for f in files):
            return files
    return [f for n in MODEL_FILES for f in (model_path / f"{n}.bin", model_path / f"{n}.txt") if f.is_file()]


def _model_file(model_path: Path, name: str) -> Path:
    """The file of ``name`` (``cameras``, ...) that pycolmap reads in ``model_path``."""
    return next((f for f in _model_files(model_path) if f.stem == name), model_path / f"{name}.bin")


def _camera_param_counts() -> dict[int, int]:
    """COLMAP camera model id -> number of parameters, from the installed pycolmap (it knows every model it reads)."""
    import pycolmap

    out = {}
    for m in pycolmap.CameraModelId.__members__.values():
        if int(m.value) >= 0:
            out[int(m.value)] = len(pycolmap.Camera.create_from_model_id(1, m, 1.0, 1, 1).params)
    return out


def _camera_param_counts_by_name() -> dict[str, int]:
    """COLMAP camera model name (``PINHOLE``, ...) -> number of parameters."""
    import pycolmap

    counts = _camera_param_counts()
    return {name: counts[int(m.value)] for name, m in pycolmap.CameraModelId.__members__.items()
            if int(m.value) in counts}


def _cameras_txt_problem(path: Path) -> str | None:
    """What makes a cameras.txt line fail COLMAP's camera check (``Check failed: camera.VerifyParams()``, naming
    neither the file nor the camera): an unknown model, a parameter count the model does not have, a size that is
    not a positive whole number."""
    try:
        counts = _camera_param_counts_by_name()
    except Exception:  # noqa: BLE001 - an older pycolmap: leave the check to it
        return None
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            words = line.split()
            if not words or words[0].startswith("#"):
                continue
            head = f"line {lineno} (camera {words[0]})"
            if len(words) < 4:
                return f"{head} has {len(words)} fields; a camera line is CAMERA_ID MODEL WIDTH HEIGHT PARAMS..."
            model = words[1]
            if model not in counts:
                return f"{head}: {model!r} is no COLMAP camera model (known: {', '.join(sorted(counts))})"
            if not (words[2].isdigit() and words[3].isdigit() and int(words[2]) > 0 and int(words[3]) > 0):
                return f"{head}: the size {words[2]}x{words[3]} is not two positive whole numbers of pixels"
            n = len(words) - 4
            if n != counts[model]:
                return f"{head}: {model} takes {counts[model]} parameters, the line has {n}"
    return None


def _u64(f, what: str) -> int:
    b = f.read(8)
    if len(b) < 8:
        raise _Truncated(what)
    return struct.unpack("<Q", b)[0]


class _Truncated(Exception):
    pass


def _bin_problem(path: Path, size: int) -> str | None:
    """What makes a COLMAP binary model file unreadable (layout of COLMAP's ``Read*Binary``), or None."""
    kind = path.stem
    if size < 8:
        return f"{size} bytes is too short for the 8-byte record count every COLMAP .bin file starts with"
    with open(path, "rb") as f:
        n = _u64(f, "count")
        body = size - 8
        if kind == "points3D":
            # id u64, xyz 3 f64, rgb 3 u8, error f64, track length u64 (then 8 bytes per track element)
            rec = 8 + 24 + 3 + 8 + 8
            if n * rec > body:
                return (f"its header counts {n:,} points, which need at least {n * rec:,} bytes, but only {body:,} "
                        f"follow: the file is truncated or not a points3D.bin")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as b:  # ~0.25 s per million points
                unpack, pos = struct.Struct("<Q").unpack_from, 8
                for i in range(n):
                    fixed_end = pos + rec  # the track length ends the fixed part of a record
                    pos = fixed_end + 8 * unpack(b, fixed_end - 8)[0] if fixed_end <= size else fixed_end
                    if pos > size:
                        return (f"point record {i + 1} of {n:,} runs past the end of the file: the file is "
                                f"truncated or corrupt")
            return None
        if kind == "images":
            # id u32, qvec 4 f64, tvec 3 f64, camera id u32, name + NUL, n points2D u64, 24 bytes per point
            rec = 4 + 32 + 24 + 4 + 1 + 8
            if n * rec > body:
                return (f"its header counts {n:,} images, which need at least {n * rec:,} bytes, but only {body:,} "
                        f"follow: the file is truncated or not an images.bin")
            for i in range(n):
                f.seek(4 + 32 + 24 + 4, 1)
                name = b""
                while not name.endswith(b"\0"):
                    chunk = f.read(256)
                    if not chunk:
                        return f"image record {i + 1} of {n:,} ends inside its name: the file is truncated"
                    cut = chunk.find(b"\0")
                    if cut >= 0:
                        f.seek(cut + 1 - len(chunk), 1)
                        chunk = chunk[:cut + 1]
                    name += chunk
                try:
                    k = _u64(f, "points2D")
                except _Truncated:
                    return f"image record {i + 1} of {n:,} ends before its point count: the file is truncated"
                f.seek(24 * k, 1)
                if f.tell() > size:
                    return (f"image record {i + 1} of {n:,} ({name[:-1].decode('utf-8', 'replace')!r}) counts {k:,} "
                            f"2D points, more than the file holds: the file is truncated or corrupt")
            return None
        # cameras: id u32, model id i32, width u64, height u64, then the model's parameters as f64
        if n == 0:
            return "its header counts no cameras (every image needs one)"
        try:
            counts = _camera_param_counts()
        except Exception:  # noqa: BLE001 - an older pycolmap: the size check alone
            counts = {}
        rec = 24 + 8 * min(counts.values(), default=1)
        if n * rec > body:
            return (f"its header counts {n:,} cameras, which need at least {n * rec:,} bytes, but only {body:,} "
                    f"follow: the file is truncated or not a cameras.bin")
        for i in range(n):
            head = f.read(24)
            if len(head) < 24:
                return f"camera record {i + 1} of {n:,} is cut off: the file is truncated"
            cam_id, model_id, _, _ = struct.unpack("<IiQQ", head)
            if counts and model_id not in counts:
                return (f"camera record {i + 1} of {n:,} (id {cam_id}) has model id {model_id}, which is no COLMAP "
                        f"camera model: the file is corrupt or not a cameras.bin")
            f.seek(8 * counts.get(model_id, 0), 1)
            if f.tell() > size:
                return f"camera record {i + 1} of {n:,} (id {cam_id}) is cut off: the file is truncated"
    return None


def check_model_files(model_path: Path) -> None:
    """UserError naming the first model file of ``model_path`` that pycolmap would fail on, with the fix.

    pycolmap reports an empty or damaged file by a consequence ("Rig with ID 1 does not exist", "Camera model does
    not exist") and names only the folder; here each file it will read is checked first: empty (0 bytes), or a
    .bin too short for its record count or whose counted records do not fit in its size."""
    model_path = Path(model_path)
    for f in _model_files(model_path):
        size = f.stat().st_size
        if size == 0:
            problem = "the file is empty (0 bytes)"
        elif f.suffix == ".bin":
            problem = _bin_problem(f, size)
        elif f.name == "cameras.txt":
            problem = _cameras_txt_problem(f)
        else:
            problem = None
        if problem:
            raise UserError(f"{f}: cannot read this COLMAP model file: {problem}; {_FIX.format(dir=model_path)}")


def level_dir(data_dir: Path, n: int) -> Path:
    """``data/S/images_N``: the dataset's own 1/N-size images under ingest's names (when it has none, only the
    note of :func:`splatflow.scene.notes.write_empty_note`)."""
    return data_dir / f"images_{n}"


def output_name_map(source_images: Path, image_format: str) -> dict[str, str]:
    """Source file name -> the name ingest gives it in ``data/S/images`` (the same rule ingest applies)."""
    files = [p.name for p in source_images.iterdir() if p.is_file() and not p.name.startswith(".")]
    return output_names(files, image_format)


# --------------------------------------------------------------------------------------------- ingest: levels


def empty_levels(data_dir: Path) -> None:
    """Make every ``data/S/images_N`` a folder with only a note (a capture without downscaled levels)."""
    for n in LEVELS:
        d = level_dir(data_dir, n)
        if d.exists():
            shutil.rmtree(d)
        write_empty_note(d, f"this capture has no images_{n} level; training downscales images/ itself when it "
                            "needs a smaller size")


def _find_level_file(level: Path, source_name: str) -> Path | None:
    p = level / source_name
    if p.is_file():
        return p
    stem = Path(source_name).stem  # some datasets store the levels as PNG next to JPEG originals
    same_stem = sorted(q for q in level.glob(f"{stem}.*") if q.is_file())
    return same_stem[0] if len(same_stem) == 1 else None


def copy_levels(dataset_root: Path, kept: list[tuple[str, str, int, int]], data_dir: Path, cfg: IngestConfig,
                *, progress: bool = True) -> dict:
    """Copy ``dataset_root/images_N`` (N in :data:`LEVELS`) to ``data_dir/images_N`` for the kept images.

    ``kept``: ``(source file name, ingest output name, width, height)`` of every image ingest kept. A level is
    copied whole or not at all: when one of its files is missing, unreadable or not 1/N of its full-size image
    (within 1 px: datasets round differently), the level folder holds only a note and the reason is returned, so a
    consumer falls back to downscaling ``images/`` itself. Files keep their bytes when ingest copied the
    full-size image's bytes (clean RGB JPEG) and are converted the same way otherwise.
    Returns ``{"images_N": {"copied": k} | {"absent": True} | {"skipped": reason}}``.
    """
    from tqdm import tqdm

    out: dict[str, dict] = {}
    for n in LEVELS:
        name = f"images_{n}"
        src, dst = dataset_root / name, level_dir(data_dir, n)
        staging = data_dir / f".{name}.staging"
        for d in (staging, dst):
            if d.exists():
                shutil.rmtree(d)
        staging.mkdir(parents=True)
        try:
            if not src.is_dir():
                out[name] = {"absent": True}
                continue
            problem = None
            for source_name, out_name, w, h in tqdm(kept, desc=f"ingest: copying {name}", unit="img",
                                                   disable=not progress):
                f = _find_level_file(src, source_name)
                if f is None:
                    problem = f"{src / source_name}: missing (a level must hold every image)"
                    break
                try:
                    im, clean_jpeg, _ = open_image(f)
                except _Reject as r:
                    problem = f"{f}: {r.detail}"
                    break
                lw, lh = im.size
                if abs(lw - w / n) > 1.0 or abs(lh - h / n) > 1.0:
                    problem = (f"{f}: {lw}x{lh} px is not 1/{n} of the full-size image ({w}x{h} px); the level "
                               f"does not belong to these images")
                    break
                if clean_jpeg and cfg.image_format == "jpg" and f.suffix.lower() in (".jpg", ".jpeg"):
                    shutil.copyfile(f, staging / out_name)
                else:
                    _save(im, staging / out_name, cfg)
            if problem:
                out[name] = {"skipped": problem}
                print(f"ingest: {name} not used: {problem}; consumers will downscale images/ instead", flush=True)
            else:
                out[name] = {"copied": len(kept)}
        finally:
            if out.get(name, {}).get("copied") is not None:
                staging.rename(dst)
            else:
                shutil.rmtree(staging)
                why = out.get(name, {}).get("skipped") or f"the dataset has no {name} folder"
                write_empty_note(dst, f"{why}; training downscales images/ itself when it needs a smaller size")
    ignored = sorted(p.name for p in dataset_root.glob("images_*") if p.is_dir() and p.name not in out)
    if ignored:
        out["ignored"] = ignored  # e.g. images_16: not a level training or the benchmark protocols use
    return out


# --------------------------------------------------------------------------------------------- sfm: import


def _say(msg: str) -> None:
    print(f"sfm: {msg}", flush=True)


def import_model(model_path: Path, images_dir: Path, sparse_dir: Path, undistorted_dir: Path, cfg: SfmConfig, *,
                 name_map: dict[str, str] | None = None, rejected: dict[str, str] | None = None,
                 threads: int = BaseConfig.threads, ground_truth: Path | None = None):
    """Import the COLMAP model at ``model_path`` for the images ingest wrote to ``images_dir`` (module docstring).

    ``name_map``: model image name -> ingest output name (:func:`output_name_map`); names not in it are used as
    they are. ``rejected``: source file name -> ingest's reason, to say why a model image is missing.
    Returns an :class:`splatflow.scene.sfm.SfmResult` (``matcher`` is ``"imported"``).
    Raises UserError for an unreadable model, an unsupported camera model, sizes that do not match, no 3D points,
    or fewer than ``cfg.min_registered_fraction`` of the model's registered images left.
    """
    import pycolmap
    from PIL import Image

    t0 = time.perf_counter()
    name_map, rejected = name_map or {}, rejected or {}
    truth = read_ground_truth(ground_truth) if ground_truth is not None else None
    check_model_files(model_path)
    try:
        rec = pycolmap.Reconstruction(str(model_path))
    except Exception as e:
        raise UserError(f"{model_path}: cannot read this COLMAP model ({e}); check the dataset is complete") from None
    points_in_model = rec.num_points3D()
    bad = sorted({c.model_name for c in rec.cameras.values() if not c.is_perspective()})
    if bad:
        raise UserError(f"{model_path}: camera model {', '.join(bad)} cannot be undistorted to a pinhole camera "
                        f"(3D Gaussian Splatting needs one); use a perspective model or drop the base.scenes "
                        f"colmap entry so the sfm stage runs SfM itself")
    registered = sorted((im for im in rec.images.values() if im.has_pose), key=lambda im: im.name)
    if not registered:
        raise UserError(f"{model_path}: the model has no registered images")
    ingested = set(list_images(images_dir))

    dropped: list[dict] = []
    drop_frames: set[int] = set()
    for im in registered:
        new = name_map.get(im.name, im.name)
        if new not in ingested:
            why = rejected.get(im.name) or (f"not in {images_dir} (ingest found no such file in the dataset's "
                                            f"images folder, or it lies in a sub-folder, which ingest skips)")
            dropped.append({"image": im.name, "reason": why})
            drop_frames.add(im.frame_id)
            continue
        cam = rec.cameras[im.camera_id]
        with Image.open(images_dir / new) as pil:
            size = pil.size
        if size != (cam.width, cam.height):
            raise UserError(
                f"{images_dir / new}: image is {size[0]}x{size[1]} px but its camera {im.camera_id} in {model_path} "
                f"is {cam.width}x{cam.height}; the model does not describe these images (a downscaled images "
                f"folder, or photos rotated by their EXIF orientation). Point the dataset's images/ at the "
                f"full-size images the model was made from")
        im.name = new
    for fid in drop_frames:
        rec.deregister_frame(fid)
    n_model, n_kept = len(registered), rec.num_reg_images()
    for d in dropped:
        _say(f"dropped {d['image']} from the imported model: {d['reason']}")
    if dropped:  # a benchmark's every-8th split counts every image: a dropped one shifts the test views
        _say(f"{len(dropped)} model image(s) dropped: to compare with published numbers keep them (e.g. "
             f"ingest.blur_rel_threshold: 0 for a rejected blurry image) or name the test views in split.test_names")
    need = max(2, math.ceil(cfg.min_registered_fraction * n_model))
    if n_kept < need:
        examples = "; ".join(f"{d['image']}: {d['reason']}" for d in dropped[:5])
        raise UserError(f"{model_path}: only {n_kept} of the model's {n_model} registered images remain after "
                        f"ingest (sfm.min_registered_fraction = {cfg.min_registered_fraction:g} needs {need}). "
                        f"Dropped: {examples}. Loosen the ingest checks that rejected them (ingest.json lists why) "
                        f"or fix those files")
    if rec.num_points3D() == 0:
        if points_in_model == 0:  # a poses-only export: the file is there, with no point in it
            raise UserError(f"{_model_file(model_path, 'points3D')}: the model has camera poses but no 3D points; "
                            + incomplete_model_message(model_path, ["points3D"]).split("; ", 1)[1])
        raise UserError(f"{model_path}: the model has no 3D points left after dropping the images above; training "
                        f"starts from the SfM points: keep those images (loosen the ingest checks that rejected "
                        f"them) or drop base.scenes.<scene>.colmap so the sfm stage runs SfM on the images")
    check_reconstruction(rec, f"{model_path} (imported)")
    models = sorted({rec.cameras[im.camera_id].model_name for im in rec.images.values() if im.has_pose})

    metrics = {
        "source": "imported",
        "model": str(model_path),
        "images_total": n_model,
        **model_metrics(rec, truth),
        "images_dropped": dropped,
        "camera_models": models,
        "undistorted": any(m not in ("PINHOLE", "SIMPLE_PINHOLE") for m in models),
        "cameras": camera_summary(rec),
    }

    sparse_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".sfm-", dir=sparse_dir.parent) as tmp_s:
        tmp = Path(tmp_s)
        staged_sparse = tmp / "sparse"
        staged_sparse.mkdir()
        rec.write_binary(str(staged_sparse))
        staged_undist = tmp / "undistorted"
        what = "undistorting" if metrics["undistorted"] else "copying (pinhole: no undistortion needed)"
        _say(f"imported {model_path}: {n_kept}/{n_model} images, {metrics['points3d']} points, cameras "
             f"{', '.join(models)}; {what} {n_kept} images")
        undistort_model(staged_sparse, images_dir, staged_undist, undistorted_dir, threads)
        replace_dir(staged_sparse, sparse_dir)
        replace_dir(staged_undist, undistorted_dir)
    metrics["seconds"] = round(time.perf_counter() - t0, 3)
    return SfmResult(metrics=metrics, matcher="imported", sparse_dir=sparse_dir, undistorted_dir=undistorted_dir)
