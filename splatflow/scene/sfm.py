"""Structure from motion with COLMAP (through pycolmap): images -> cameras, sparse points, undistorted images.

The pipeline is COLMAP's (Schönberger & Frahm, "Structure-from-Motion Revisited", CVPR 2016): SIFT features
(Lowe, IJCV 2004) at full resolution, matching with geometric verification, incremental mapping (or global mapping,
GLOMAP: Pan et al., ECCV 2024), and undistortion to an ideal pinhole camera, which is what 3D Gaussian Splatting
(Kerbl et al., SIGGRAPH 2023) trains on.

Choices and why:

* One shared camera (``CameraMode.SINGLE``): a scene is shot with one camera and lens, and sharing intrinsics
  makes self-calibration far better conditioned than one camera per image (COLMAP's AUTO made one per image here).
  SINGLE silently drops images of another size, so sizes are checked first and a mix is an error.
* Full resolution: SIFT on down-scaled images loses the fine texture that pins the poses; the default cap of
  COLMAP (3200 px) is lifted to the images' size.
* Matcher: exhaustive matching is the most robust for unordered photos but costs O(n^2) pairs; sequential matching
  (each image with its ``overlap`` successors) fits video frames and large sets. ``auto`` picks exhaustive up to
  ``sfm.exhaustive_max_images`` images and sequential beyond, or for video.
* Nothing that can abort the process is reachable: vocabulary-tree matching and sequential loop detection try to
  download a vocabulary tree, and ALIKED features need ONNX models (DESIGN.md §3); none of them is configurable
  here and loop detection is switched off explicitly.
* The largest reconstruction is kept when the mapper splits the images into several models.
* ``undistort_images`` crops 1-2 px at the border: downstream code must use the undistorted model's image sizes.
"""

from __future__ import annotations

import math
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from splatflow.config import SfmConfig
from splatflow.errors import UserError
from splatflow.scene.groundtruth import camera_error, read_ground_truth
from splatflow.scene.schemas import validate_reconstruction

__all__ = ["IMAGE_SUFFIXES", "list_images", "choose_matcher", "first_sift_octave", "SfmResult", "run_sfm",
           "reconstruction_poses"]

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".tif", ".tiff", ".bmp"}


def list_images(images_dir: Path) -> list[str]:
    """Image file names in ``images_dir`` (sorted). COLMAP would try to read every file, so we pick them."""
    if not images_dir.is_dir():
        raise UserError(f"{images_dir}: image folder not found; run the ingest stage first")
    return sorted(p.name for p in images_dir.iterdir()
                  if p.is_file() and not p.name.startswith(".") and p.suffix.lower() in IMAGE_SUFFIXES)


def _image_size(path: Path) -> tuple[int, int]:
    from PIL import Image

    try:
        with Image.open(path) as im:
            return im.size
    except Exception as e:
        raise UserError(f"{path}: cannot read this image ({e}); remove it or rerun the ingest stage") from None


def _check_one_size(images_dir: Path, names: list[str]) -> tuple[int, int]:
    """All images must share one size (one shared camera); returns (width, height)."""
    sizes: dict[tuple[int, int], list[str]] = {}
    for n in names:
        sizes.setdefault(_image_size(images_dir / n), []).append(n)
    if len(sizes) > 1:
        common = max(sizes, key=lambda s: len(sizes[s]))
        odd = [n for s, ns in sizes.items() if s != common for n in ns]
        raise UserError(f"{images_dir}: images have {len(sizes)} different sizes (most are {common[0]}x{common[1]}; "
                        f"e.g. {odd[0]} is not). SfM uses one shared camera: run the ingest stage, which rejects "
                        f"odd sizes, or remove those images")
    return next(iter(sizes))


def first_sift_octave(width: int, height: int) -> int:
    """SIFT's first octave: -1 (detect on a 2x upsampled image, Lowe 2004 §3.3) for images up to 2000 px, else 0.

    Upsampling quadruples the detector's work; it pays off on small images, where it finds the many small-scale
    keypoints that a 480 px image needs to register, but on multi-megapixel photos it costs minutes of CPU (11
    Strecha images at 3072x2048: over 130 CPU-s for extraction alone) for features the full-resolution octave
    already has.
    """
    return -1 if max(width, height) <= 2000 else 0


def choose_matcher(cfg: SfmConfig, n_images: int, ordered_sequence: bool = False) -> str:
    """'exhaustive' or 'sequential' (see the module docstring)."""
    if cfg.matcher != "auto":
        return cfg.matcher
    if ordered_sequence or n_images > cfg.exhaustive_max_images:
        return "sequential"
    return "exhaustive"


def reconstruction_poses(rec) -> dict[str, np.ndarray]:
    """Image name -> world_to_cam [4, 4] of every registered image."""
    out = {}
    for im in rec.images.values():
        if im.has_pose:
            m = np.eye(4)
            m[:3, :] = np.asarray(im.cam_from_world().matrix(), dtype=np.float64)
            out[im.name] = m
    return out


@dataclass
class SfmResult:
    metrics: dict
    matcher: str
    sparse_dir: Path
    undistorted_dir: Path


def _say(msg: str) -> None:
    print(f"sfm: {msg}", flush=True)


class _Phase:
    """Prints a phase's start and its duration (the visible progress of the steps pycolmap runs without callbacks)."""

    def __init__(self, what: str):
        self.what = what

    def __enter__(self):
        self.t0 = time.perf_counter()
        self.cpu0 = time.process_time()
        _say(f"{self.what} ...")
        return self

    def __exit__(self, *exc):
        if exc[0] is None:
            _say(f"{self.what}: done in {time.perf_counter() - self.t0:.1f} s "
                 f"({time.process_time() - self.cpu0:.1f} CPU-s)")


def _replace_dir(staged: Path, final: Path) -> None:
    if final.exists():
        shutil.rmtree(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(staged), str(final))


def _too_few_message(images_dir: Path, n_reg: int, n_total: int, matcher: str, cfg: SfmConfig) -> str:
    other = "sequential" if matcher == "exhaustive" else "exhaustive"
    hint = ("for video or an ordered walk-through try sfm.matcher: sequential" if other == "sequential" else
            "for unordered photos try sfm.matcher: exhaustive")
    return (
        f"{images_dir}: only {n_reg} of {n_total} images were registered by SfM (sfm.min_registered_fraction = "
        f"{cfg.min_registered_fraction:g} needs {math.ceil(cfg.min_registered_fraction * n_total)}). What usually "
        f"helps: more overlap between neighbouring photos (at most ~10 degrees of turn between shots), more texture "
        f"in view (plain walls and reflections defeat feature matching), sharper images; {hint} (used now: "
        f"{matcher}); a simpler sfm.camera_model can help small sets."
    )


def run_sfm(images_dir: str | Path, sparse_dir: str | Path, undistorted_dir: str | Path, cfg: SfmConfig, *,
            seed: int = 0, threads: int = 2, ordered_sequence: bool = False, ground_truth: str | Path | None = None,
            progress: bool = True) -> SfmResult:
    """Run SfM on every image in ``images_dir``; write the largest model to ``sparse_dir`` (COLMAP binary) and the
    PINHOLE-undistorted images and model to ``undistorted_dir/{images,sparse}``.

    Returns the metrics of docs/CONTRACTS.md (``images_total``, ``images_registered``, ``points3d``,
    ``mean_reprojection_error_px``, ``mean_track_length``, ``camera_center_error_rel``, ``seconds``) plus
    ``camera_rotation_error_deg``; the two error fields are None without ``ground_truth``.
    Raises UserError when fewer than ``cfg.min_registered_fraction`` of the images register.
    """
    import pycolmap

    t_start = time.perf_counter()
    images_dir, sparse_dir, undistorted_dir = Path(images_dir), Path(sparse_dir), Path(undistorted_dir)
    names = list_images(images_dir)
    if len(names) < 3:
        raise UserError(f"{images_dir}: {len(names)} images found; SfM needs at least 3 overlapping photos")
    width, height = _check_one_size(images_dir, names)
    truth = read_ground_truth(ground_truth) if ground_truth is not None else None  # fail early on a bad path
    matcher = choose_matcher(cfg, len(names), ordered_sequence)
    pycolmap.logging.minloglevel = 1  # warnings and errors; our own lines report the phases

    parent = sparse_dir.parent
    parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".sfm-", dir=parent) as tmp_s:
        tmp = Path(tmp_s)
        db = tmp / "database.db"

        with _Phase(f"SIFT features of {len(names)} images at full resolution {width}x{height}, one shared "
                    f"{cfg.camera_model} camera"):
            reader = pycolmap.ImageReaderOptions()
            reader.camera_model = cfg.camera_model
            extraction = pycolmap.FeatureExtractionOptions()
            extraction.max_image_size = max(width, height)
            extraction.num_threads = threads
            extraction.use_gpu = False
            extraction.sift.max_num_features = cfg.max_num_features
            extraction.sift.first_octave = first_sift_octave(width, height)
            pycolmap.extract_features(db, images_dir, image_names=names, camera_mode=pycolmap.CameraMode.SINGLE,
                                      reader_options=reader, extraction_options=extraction,
                                      device=pycolmap.Device.cpu)

        n_pairs = len(names) * (len(names) - 1) // 2 if matcher == "exhaustive" else None
        with _Phase(f"{matcher} matching" + (f" of {n_pairs} pairs" if n_pairs else
                                             f" (overlap {cfg.sequential_overlap})")):
            matching = pycolmap.FeatureMatchingOptions()
            matching.num_threads = threads
            matching.use_gpu = False
            if matcher == "exhaustive":
                pycolmap.match_exhaustive(db, matching_options=matching, device=pycolmap.Device.cpu)
            else:
                pairing = pycolmap.SequentialPairingOptions()
                pairing.overlap = cfg.sequential_overlap
                pairing.loop_detection = False  # needs a vocabulary tree download: aborts the process offline
                pairing.num_threads = threads
                pycolmap.match_sequential(db, matching_options=matching, pairing_options=pairing,
                                          device=pycolmap.Device.cpu)

        models_dir = tmp / "models"
        models_dir.mkdir()
        with _Phase(f"{cfg.mapper} mapping"):
            if cfg.mapper == "incremental":
                opts = pycolmap.IncrementalPipelineOptions()
                opts.num_threads = threads
                opts.random_seed = seed
                opts.ba_refine_principal_point = cfg.refine_principal_point
                from tqdm.auto import tqdm

                with tqdm(total=len(names), desc="sfm: registered images", unit="img", disable=not progress) as bar:
                    def _initial():
                        bar.update(min(2, bar.total - bar.n))

                    def _next():
                        bar.update(min(1, bar.total - bar.n))

                    models = pycolmap.incremental_mapping(db, images_dir, models_dir, options=opts,
                                                          initial_image_pair_callback=_initial,
                                                          next_image_callback=_next)
            else:
                opts = pycolmap.GlobalPipelineOptions()
                opts.num_threads = threads
                opts.random_seed = seed
                # CPU-only wheel: ask for no GPU solvers instead of warning and falling back.
                opts.mapper.bundle_adjustment.ceres.use_gpu = False
                opts.mapper.global_positioning.use_gpu = False
                opts.mapper.bundle_adjustment.refine_principal_point = cfg.refine_principal_point
                models = pycolmap.global_mapping(db, images_dir, models_dir, options=opts)

        if not models:
            raise UserError(_too_few_message(images_dir, 0, len(names), matcher, cfg))
        rec = max(models.values(), key=lambda r: r.num_reg_images())
        n_reg = rec.num_reg_images()
        _say(f"kept the largest of {len(models)} model(s): {n_reg}/{len(names)} images, "
             f"{rec.num_points3D()} points")
        if n_reg < math.ceil(cfg.min_registered_fraction * len(names)):
            raise UserError(_too_few_message(images_dir, n_reg, len(names), matcher, cfg))
        validate_reconstruction(rec, f"{sparse_dir} (before writing)")

        # Metrics (and the ground-truth comparison, which can fail on a wrong path) before any output is written.
        metrics = {
            "images_total": len(names),
            "images_registered": int(n_reg),
            "points3d": int(rec.num_points3D()),
            "mean_reprojection_error_px": float(rec.compute_mean_reprojection_error()),
            "mean_track_length": float(rec.compute_mean_track_length()),
            "camera_center_error_rel": None,
            "camera_rotation_error_deg": None,
            "seconds": None,
        }
        if truth is not None:
            err = camera_error(reconstruction_poses(rec), truth)
            metrics["camera_center_error_rel"] = err.center_error_rel
            metrics["camera_rotation_error_deg"] = err.rotation_error_deg
            _say(f"camera centres vs ground truth ({err.matched} images): mean error "
                 f"{100 * err.center_error_rel:.3f}% of the orbit extent, orientation error "
                 f"{err.rotation_error_deg:.3f} deg")

        staged_sparse = tmp / "sparse"
        staged_sparse.mkdir()
        rec.write_binary(str(staged_sparse))

        staged_undist = tmp / "undistorted"
        with _Phase(f"undistorting {n_reg} images to PINHOLE"):
            pycolmap.undistort_images(str(staged_undist), str(staged_sparse), str(images_dir), output_type="COLMAP",
                                      copy_policy=pycolmap.FileCopyType.copy, jpeg_quality=95, num_threads=threads)
        # Keep only what training reads: images/ and sparse/ (drop the MVS stereo/ folder and scripts).
        for p in staged_undist.iterdir():
            if p.name not in ("images", "sparse"):
                shutil.rmtree(p) if p.is_dir() else p.unlink()
        undist = pycolmap.Reconstruction(str(staged_undist / "sparse"))
        validate_reconstruction(undist, f"{undistorted_dir / 'sparse'} (before writing)")
        models_seen = {c.model_name for c in undist.cameras.values()}
        if models_seen - {"PINHOLE", "SIMPLE_PINHOLE"}:
            raise RuntimeError(f"undistortion left non-pinhole cameras: {models_seen}")

        _replace_dir(staged_sparse, sparse_dir)
        _replace_dir(staged_undist, undistorted_dir)

    metrics["seconds"] = round(time.perf_counter() - t_start, 3)
    return SfmResult(metrics=metrics, matcher=matcher, sparse_dir=sparse_dir, undistorted_dir=undistorted_dir)
