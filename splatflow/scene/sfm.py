"""Structure from motion with COLMAP (through pycolmap): images -> cameras, sparse points, undistorted images.

The pipeline is COLMAP's (Schönberger & Frahm, "Structure-from-Motion Revisited", CVPR 2016): SIFT features
(Lowe, IJCV 2004) at full resolution, matching with geometric verification, incremental mapping (or global mapping,
GLOMAP: Pan et al., ECCV 2024), and undistortion to an ideal pinhole camera, which is what 3D Gaussian Splatting
(Kerbl et al., SIGGRAPH 2023) trains on.

Choices and why:

* Cameras (``sfm.camera_mode``): images taken with one camera and lens share intrinsics, which makes
  self-calibration far better conditioned than one camera per image (COLMAP's own AUTO makes one per image).
  ``auto`` (default) groups the images by size and, when present, EXIF make/model/focal length: one COLMAP camera
  per group, so a single-camera capture gets one camera and a mixed photo collection one per camera and size.
  ``per_folder`` gives each sub-folder of the source its own camera (a multi-camera rig stored as ``cam_a/``,
  ``cam_b/``: identical bodies with the same EXIF are still separate lenses); ingest flattens the names and
  records each image's folder (``folders``), and ``auto`` splits by folder too when ingest read sub-folders.
  Each group is extracted with ``CameraMode.SINGLE`` in its own call (SINGLE silently drops images of another size,
  so a group never mixes sizes), which also gives each group its own EXIF prior; COLMAP's ``PER_FOLDER`` would
  need the folders in the image names and takes one ``camera_params`` for all of them. ``single`` forces one
  camera and ``per_folder`` one per folder (a size mix in it is then an error); ``per_image`` gives every image
  its own intrinsics.
* EXIF focal length as a prior: the 35 mm-equivalent focal length (``FocalLengthIn35mmFilm``, scaled by the
  longer image side over the 36 mm frame width) or the focal length in mm with the sensor's pixel density
  (``FocalPlaneXResolution``) gives the initial focal length in pixels, marked as a prior
  (``has_prior_focal_length``), which helps COLMAP choose and reconstruct its initial pair. Without EXIF, COLMAP's
  default (1.2 x the longer side, no prior) is used.
* Full resolution: SIFT on down-scaled images loses the fine texture that pins the poses; the default cap of
  COLMAP (3200 px) is lifted to the images' size.
* Matcher: exhaustive matching is the most robust for unordered photos but costs O(n^2) pairs; sequential matching
  (each image with its ``overlap`` successors) fits video frames and large sets. ``auto`` picks exhaustive up to
  ``sfm.exhaustive_max_images`` images and sequential beyond, or for video.
* Nothing that can abort the process is reachable: vocabulary-tree matching and sequential loop detection try to
  download a vocabulary tree, and ALIKED features need ONNX models (docs/design.md §3); none of them is configurable
  here and loop detection is switched off explicitly.
* The largest reconstruction is kept when the mapper splits the images into several models.
* ``undistort_images`` crops 1-2 px at the border: downstream code must use the undistorted model's image sizes.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from splatflow.pipeline.config import BaseConfig, SfmConfig
from splatflow.pipeline.errors import UserError
from splatflow.scene.fitness import fitness_warning, model_fitness
from splatflow.scene.groundtruth import camera_error, read_ground_truth

__all__ = ["IMAGE_SUFFIXES", "check_reconstruction", "replace_dir", "list_images", "choose_matcher",
           "first_sift_octave", "SfmResult", "run_sfm", "reconstruction_poses", "model_metrics", "exif_camera", "camera_groups", "camera_summary", "undistort_model"]

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".tif", ".tiff", ".bmp"}
_PINHOLE = {"PINHOLE", "SIMPLE_PINHOLE"}


def check_reconstruction(rec, where: str) -> None:
    """:func:`splatflow.scene.schemas.validate_reconstruction`, imported when a reconstruction is checked (pandera
    and pandas cost ~1 CPU-s to import): the ingest stage imports this module (through splatflow.scene.colmap) and
    never checks one."""
    from splatflow.scene.schemas import validate_reconstruction  # lazy: pandera and pandas, ~1 CPU-s at import

    validate_reconstruction(rec, where)


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


def _check_one_size(images_dir: Path, infos: list[tuple], mode: str, folder: str | None = None) -> tuple[int, int]:
    """All images of one camera must share one size (``sfm.camera_mode: single`` or ``per_folder``); ``infos`` are
    ``(name, width, height, exif)``; returns (width, height)."""
    sizes: dict[tuple[int, int], list[str]] = {}
    for n, w, h, _ in infos:
        sizes.setdefault((w, h), []).append(n)
    if len(sizes) > 1:
        common = max(sizes, key=lambda s: len(sizes[s]))
        odd = [n for s, ns in sizes.items() if s != common for n in ns]
        which = "images" if folder is None else f"the images of source sub-folder '{folder or '.'}'"
        raise UserError(f"{images_dir}: {which} have {len(sizes)} different sizes (most are {common[0]}x{common[1]}; "
                        f"e.g. {odd[0]} is not), but sfm.camera_mode = {mode} shares one camera"
                        f"{'' if folder is None else ' per folder'}, which needs one size. Set sfm.camera_mode: auto "
                        f"(one camera per size and EXIF camera{'' if folder is None else ' within each folder'}) or "
                        f"remove those images")
    return next(iter(sizes))


# EXIF tags (Exif 2.3): IFD0 Make/Model, Exif sub-IFD focal length fields.
_EXIF_IFD = 0x8769
_MAKE, _MODEL = 0x010F, 0x0110
_FOCAL_MM, _FOCAL_35MM = 0x920A, 0xA405
_FOCAL_PLANE_XRES, _FOCAL_PLANE_UNIT = 0xA20E, 0xA210
_PIXEL_X_DIMENSION = 0xA002
_UNIT_MM = {2: 25.4, 3: 10.0, 4: 1.0, 5: 0.001}  # FocalPlaneResolutionUnit: inch, cm, mm, micrometre


@dataclass(frozen=True)
class ExifCamera:
    """What an image's EXIF says about its camera; ``focal_px`` is the prior in pixels (None when unknown)."""

    make: str | None
    model: str | None
    focal_mm: float | None
    focal_35mm: float | None
    focal_px: float | None
    focal_from: str | None  # "exif_35mm" or "exif_focal_plane"


def _positive(v) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError, ZeroDivisionError):
        return None
    return f if math.isfinite(f) and f > 0 else None


def exif_camera(path: Path, width: int, height: int) -> ExifCamera:
    """Camera make/model and the focal-length prior in pixels from ``path``'s EXIF (see the module docstring).

    ``width``/``height`` are the image's pixel size as stored (ingest has already applied the EXIF rotation).
    """
    from PIL import Image

    try:
        with Image.open(path) as im:
            exif = im.getexif()
            sub = exif.get_ifd(_EXIF_IFD)
    except Exception:
        return ExifCamera(None, None, None, None, None, None)

    def text(v) -> str | None:
        v = v.decode(errors="replace") if isinstance(v, bytes) else v
        return str(v).strip("\x00 ").strip() or None if v is not None else None

    make, model = text(exif.get(_MAKE)), text(exif.get(_MODEL))
    f_mm, f35 = _positive(sub.get(_FOCAL_MM)), _positive(sub.get(_FOCAL_35MM))
    longer = max(width, height)
    if f35 is not None:
        return ExifCamera(make, model, f_mm, f35, f35 / 36.0 * longer, "exif_35mm")
    xres, unit = _positive(sub.get(_FOCAL_PLANE_XRES)), sub.get(_FOCAL_PLANE_UNIT, 2)
    if f_mm is not None and xres is not None and unit in _UNIT_MM:
        px_per_mm = xres / _UNIT_MM[unit]  # of the sensor's full-resolution image
        full_w = _positive(sub.get(_PIXEL_X_DIMENSION))
        # An image resized after capture keeps the sensor's density in EXIF: rescale by its width now vs then
        # (the larger side: ingest may have rotated the pixels).
        scale = longer / full_w if full_w else 1.0
        return ExifCamera(make, model, f_mm, None, f_mm * px_per_mm * scale, "exif_focal_plane")
    return ExifCamera(make, model, f_mm, None, None, None)


@dataclass
class CameraGroup:
    """Images that share one COLMAP camera."""

    names: list[str]
    width: int
    height: int
    exif: ExifCamera
    folder: str | None = None  # the source sub-folder of its images (per_folder, or auto on sub-folders)

    @property
    def label(self) -> str:
        who = " ".join(x for x in (self.exif.make, self.exif.model) if x) or "no EXIF camera"
        focal = f", {self.exif.focal_mm:g} mm" if self.exif.focal_mm else ""
        where = "" if self.folder is None else f"folder {self.folder or '.'}: "
        return f"{where}{self.width}x{self.height} ({who}{focal})"


def _shared_camera(images_dir: Path, infos: list[tuple], mode: str, folder: str | None = None) -> CameraGroup:
    """One camera for all of ``infos`` (``(name, width, height, exif)``, one size): the median EXIF prior."""
    w, h = _check_one_size(images_dir, infos, mode, folder)
    with_prior = [e for *_, e in infos if e.focal_px is not None]
    e = with_prior[0] if with_prior else infos[0][3]
    if with_prior:  # one camera: the median prior of its images
        e = ExifCamera(e.make, e.model, e.focal_mm, e.focal_35mm,
                       float(np.median([x.focal_px for x in with_prior])), e.focal_from)
    return CameraGroup([n for n, *_ in infos], w, h, e, folder)


def camera_groups(images_dir: Path, names: list[str], mode: str,
                  folders: dict[str, str] | None = None) -> list[CameraGroup]:
    """Split ``names`` into the cameras of ``sfm.camera_mode`` (see the module docstring), in name order.

    ``folders``: image name -> the source sub-folder ingest read it from (``""`` = the source itself); None or
    empty when ingest read no sub-folders. ``per_folder`` without it is one folder, so one camera.
    """
    infos = []
    for n in names:
        w, h = _image_size(images_dir / n)
        infos.append((n, w, h, exif_camera(images_dir / n, w, h)))
    folders = folders or {}
    if mode == "single":
        return [_shared_camera(images_dir, infos, mode)]
    if mode == "per_image":
        return [CameraGroup([n], w, h, e, folders.get(n)) for n, w, h, e in infos]
    if mode == "per_folder":
        by_folder: dict[str, list[tuple]] = {}
        for info in infos:
            by_folder.setdefault(folders.get(info[0], ""), []).append(info)
        return [_shared_camera(images_dir, fi, mode, f) for f, fi in by_folder.items()]
    groups: dict[tuple, CameraGroup] = {}
    for n, w, h, e in infos:
        # no EXIF: (folder, w, h, None, ...) = one camera per size (and sub-folder)
        key = (folders.get(n), w, h, e.make, e.model, e.focal_mm, e.focal_35mm)
        if key not in groups:
            groups[key] = CameraGroup([], w, h, e, folders.get(n))
        groups[key].names.append(n)
    return list(groups.values())


def camera_params_string(model: str, focal_px: float, width: int, height: int) -> str:
    """COLMAP ``camera_params`` for ``model`` with focal ``focal_px``, the image centre and no distortion."""
    import pycolmap

    cam = pycolmap.Camera.create_from_model_name(1, model, float(focal_px), int(width), int(height))
    return ",".join(f"{v:.10g}" for v in cam.params)


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


def choose_mapper(cfg: SfmConfig, n_images: int) -> str:
    """'incremental' or 'global': ``sfm.mapper``, with "auto" resolved from the image count. Past
    ``exhaustive_max_images`` images (matched sequentially) incremental mapping grows one model along the walk and
    keeps its drift: on a 252-photo 360-degree capture its model jumped 45x the median camera step between two
    consecutive photos and trained to 23.48 dB, where global mapping on the same matches gave a consistent path
    (1.8x), 0.36 px instead of 0.51 and 26.34 dB (2,000 steps; bench/RESULTS.md "Real captures")."""
    if cfg.mapper != "auto":
        return cfg.mapper
    return "global" if n_images > cfg.exhaustive_max_images else "incremental"


def reconstruction_poses(rec) -> dict[str, np.ndarray]:
    """Image name -> world_to_cam [4, 4] of every registered image."""
    out = {}
    for im in rec.images.values():
        if im.has_pose:
            m = np.eye(4)
            m[:3, :] = np.asarray(im.cam_from_world().matrix(), dtype=np.float64)
            out[im.name] = m
    return out


def model_metrics(rec, truth=None) -> dict:
    """The sfm.json fields of a model, computed or imported alike (docs/CONTRACTS.md): ``images_registered``,
    ``points3d``, ``mean_reprojection_error_px``, ``mean_track_length``, the camera errors against ``truth``
    (ground-truth cameras of :func:`splatflow.scene.groundtruth.read_ground_truth`; None without) and
    ``seconds`` (None: the caller fills it in at the end)."""
    out = {
        "images_registered": int(rec.num_reg_images()),
        "points3d": int(rec.num_points3D()),
        "mean_reprojection_error_px": float(rec.compute_mean_reprojection_error()),
        "mean_track_length": float(rec.compute_mean_track_length()),
        "camera_center_error_rel": None,
        "camera_rotation_error_deg": None,
        "seconds": None,
    }
    out.update(model_fitness(rec))
    if truth is not None:
        err = camera_error(reconstruction_poses(rec), truth)
        out["camera_center_error_rel"] = err.center_error_rel
        out["camera_rotation_error_deg"] = err.rotation_error_deg
        _say(f"camera centres vs ground truth ({err.matched} images): mean error "
             f"{100 * err.center_error_rel:.3f}% of the orbit extent, orientation error "
             f"{err.rotation_error_deg:.3f} deg")
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


# The pair count of _MatchProgress, read by a child process: pycolmap's own SQLite keeps its database in WAL mode
# with the -shm index memory-mapped, and a second SQLite library in the same process (Python's) cannot see that
# library's locks (POSIX locks are per process), so on closing it took itself for the last connection and
# truncated the WAL index under the matcher, which died of SIGBUS minutes into an exhaustive match. A reader in
# another process takes locks the matcher's SQLite sees: it never checkpoints, and a WAL reader blocks no writer.
_COUNT_PAIRS = """
import sqlite3, sys
uri = "file:" + sys.argv[1] + "?mode=ro"
while sys.stdin.readline():
    n = -1
    try:
        con = sqlite3.connect(uri, uri=True, timeout=0.2)
        try:
            n = max(int(con.execute("SELECT count(*) FROM " + t).fetchone()[0])
                    for t in ("matches", "two_view_geometries"))
        finally:
            con.close()
    except sqlite3.Error:
        pass
    print(n, flush=True)
"""


class _MatchProgress:
    """A progress bar for pycolmap's matching, which reports nothing while it runs (20 minutes for 250 photos
    matched exhaustively on 2 cores): a thread asks a child process (:data:`_COUNT_PAIRS`; never this process,
    see there) for the image pairs already written to the database (read-only; a locked database skips a tick)
    and sets them against the pairs the matcher will visit."""

    def __init__(self, db: Path, total_pairs: int, enabled: bool, every_s: float = 2.0):
        import threading

        self.db, self.total, self.enabled, self.every_s = db, max(int(total_pairs), 1), enabled, every_s
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.child = None
        self.last = None  # the last count read

    def _count(self) -> int | None:
        """The pairs written so far, or None (a locked or not yet created table, or no reader)."""
        try:
            if self.child is None:
                self.child = subprocess.Popen([sys.executable, "-c", _COUNT_PAIRS, str(self.db)], text=True,
                                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                              stderr=subprocess.DEVNULL)
            self.child.stdin.write("\n")
            self.child.stdin.flush()
            n = int(self.child.stdout.readline())
        except (OSError, ValueError):
            return None
        if n < 0:
            return None
        self.last = n
        return n

    def _run(self) -> None:
        from tqdm.auto import tqdm

        with tqdm(total=self.total, desc="sfm: matched pairs", unit="pair", mininterval=self.every_s) as bar:
            while not self.done.wait(self.every_s):
                n = self._count()
                if n is not None:
                    bar.update(max(0, min(n, self.total) - bar.n))
            n = self._count()
            if n is not None:
                bar.update(max(0, min(n, self.total) - bar.n))

    def __enter__(self):
        if self.enabled:
            self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        if self.enabled:
            self.thread.join()
        if self.child is not None:
            try:
                self.child.stdin.close()  # the reader's loop ends on end of input
                self.child.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.child.kill()
                self.child.wait()


def replace_dir(staged: Path, final: Path) -> None:
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


def camera_summary(rec, groups: dict[str, CameraGroup] | None = None) -> list[dict]:
    """One entry per camera of ``rec`` that has registered images: model, size, focal length, EXIF prior."""
    out = []
    for cam_id in sorted(rec.cameras):
        cam = rec.cameras[cam_id]
        ims = sorted(im.name for im in rec.images.values() if im.has_pose and im.camera_id == cam_id)
        if not ims:
            continue
        entry = {"camera_id": int(cam_id), "model": cam.model_name, "width": int(cam.width),
                 "height": int(cam.height), "images": len(ims), "focal_px": round(float(cam.mean_focal_length()), 3)}
        g = groups.get(ims[0]) if groups else None
        if g is not None:
            if g.folder is not None:
                entry["folder"] = g.folder
            entry["exif_camera"] = " ".join(x for x in (g.exif.make, g.exif.model) if x) or None
            entry["focal_prior_px"] = None if g.exif.focal_px is None else round(g.exif.focal_px, 3)
            entry["focal_prior_from"] = g.exif.focal_from
        out.append(entry)
    return out


def undistort_model(sparse_dir: Path, images_dir: Path, out_dir: Path, final_dir: Path, threads: int) -> None:
    """PINHOLE model and images of ``sparse_dir``'s registered images in ``out_dir/{images,sparse}``.

    Models that are already pinhole are copied (images byte for byte: resampling an undistorted image would only
    blur it and, for a published dataset, change the pixels its metrics are computed on); every other model that
    COLMAP's undistorter handles (all perspective models, the fisheye ones included) is undistorted.
    ``final_dir`` only names the destination in messages.
    """
    import pycolmap

    rec = pycolmap.Reconstruction(str(sparse_dir))
    reg = [im for im in rec.images.values() if im.has_pose]
    if all(rec.cameras[im.camera_id].model_name in _PINHOLE for im in reg):
        (out_dir / "images").mkdir(parents=True)
        for im in reg:
            dst = out_dir / "images" / im.name
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(images_dir / im.name, dst)
        (out_dir / "sparse").mkdir()
        rec.write_binary(str(out_dir / "sparse"))
    else:
        pycolmap.undistort_images(str(out_dir), str(sparse_dir), str(images_dir), output_type="COLMAP",
                                  copy_policy=pycolmap.FileCopyType.copy, jpeg_quality=95, num_threads=threads)
        # Keep only what training reads: images/ and sparse/ (drop the MVS stereo/ folder and scripts).
        for p in out_dir.iterdir():
            if p.name not in ("images", "sparse"):
                shutil.rmtree(p) if p.is_dir() else p.unlink()
    undist = pycolmap.Reconstruction(str(out_dir / "sparse"))
    check_reconstruction(undist, f"{final_dir / 'sparse'} (before writing)")
    models_seen = {c.model_name for c in undist.cameras.values()}
    if models_seen - _PINHOLE:
        raise RuntimeError(f"undistortion left non-pinhole cameras: {models_seen}")


def run_sfm(images_dir: str | Path, sparse_dir: str | Path, undistorted_dir: str | Path, cfg: SfmConfig, *,
            seed: int = 0, threads: int = BaseConfig.threads, ordered_sequence: bool = False,
            ground_truth: str | Path | None = None, progress: bool = True,
            folders: dict[str, str] | None = None) -> SfmResult:
    """Run SfM on every image in ``images_dir``; write the largest model to ``sparse_dir`` (COLMAP binary) and the
    PINHOLE-undistorted images and model to ``undistorted_dir/{images,sparse}``. ``folders``: image name -> source
    sub-folder, as ingest recorded it (ingest.json ``image_folders``), for the per-folder cameras.

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
    groups = camera_groups(images_dir, names, cfg.camera_mode, folders)
    width, height = max(g.width for g in groups), max(g.height for g in groups)
    truth = read_ground_truth(ground_truth) if ground_truth is not None else None  # fail early on a bad path
    matcher = choose_matcher(cfg, len(names), ordered_sequence)
    if cfg.matcher == "auto" and matcher == "sequential" and not ordered_sequence:
        # exhaustive matching grows as n^2 (55 pairs of 3072x2048 photos: ~40 s on 2 cores) and vocabulary-tree
        # retrieval needs a download: past the limit, neighbours in name order are matched (camera file names
        # usually follow the capture order)
        _say(f"{len(names)} images exceed sfm.exhaustive_max_images ({cfg.exhaustive_max_images}): sequential "
             f"matching of the {cfg.sequential_overlap} next images in name order; raise the limit (time grows "
             "with the square of the count) or set sfm.matcher: exhaustive for an unordered collection")
    pycolmap.logging.minloglevel = 1  # warnings and errors; our own lines report the phases
    # sfm.deterministic: COLMAP on one thread (on several, its results vary slightly from run to run)
    colmap_threads = 1 if cfg.deterministic else threads

    parent = sparse_dir.parent
    parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".sfm-", dir=parent) as tmp_s:
        tmp = Path(tmp_s)
        db = tmp / "database.db"

        what = (f"one shared {cfg.camera_model} camera" if len(groups) == 1 else
                f"{len(groups)} {cfg.camera_model} cameras (sfm.camera_mode = {cfg.camera_mode})")
        with _Phase(f"SIFT features of {len(names)} images at full resolution "
                    + (f"{width}x{height}" if len(groups) == 1 else f"up to {width}x{height}") + f", {what}"):
            for g in groups:  # one extraction call per camera: SINGLE mode gives each call its own camera
                reader = pycolmap.ImageReaderOptions()
                reader.camera_model = cfg.camera_model
                if g.exif.focal_px is not None:  # given params are marked as a focal-length prior
                    reader.camera_params = camera_params_string(cfg.camera_model, g.exif.focal_px, g.width,
                                                                g.height)
                extraction = pycolmap.FeatureExtractionOptions()
                extraction.max_image_size = max(width, height)
                extraction.num_threads = colmap_threads
                extraction.use_gpu = False
                extraction.sift.max_num_features = cfg.max_num_features
                extraction.sift.first_octave = first_sift_octave(g.width, g.height)
                pycolmap.extract_features(db, images_dir, image_names=g.names,
                                          camera_mode=pycolmap.CameraMode.SINGLE, reader_options=reader,
                                          extraction_options=extraction, device=pycolmap.Device.cpu)
                if len(groups) > 1 and len(groups) <= 20:
                    _say(f"camera {g.label}: {len(g.names)} images"
                         + (f", EXIF focal prior {g.exif.focal_px:.1f} px" if g.exif.focal_px else ""))

        n_pairs = len(names) * (len(names) - 1) // 2 if matcher == "exhaustive" else None
        visits = n_pairs or sum(min(cfg.sequential_overlap, len(names) - 1 - i) for i in range(len(names)))
        with _Phase(f"{matcher} matching" + (f" of {n_pairs} pairs" if n_pairs else
                                             f" (overlap {cfg.sequential_overlap})")), \
                _MatchProgress(db, visits, progress):
            matching = pycolmap.FeatureMatchingOptions()
            matching.num_threads = colmap_threads
            matching.use_gpu = False
            if matcher == "exhaustive":
                pycolmap.match_exhaustive(db, matching_options=matching, device=pycolmap.Device.cpu)
            else:
                pairing = pycolmap.SequentialPairingOptions()
                pairing.overlap = cfg.sequential_overlap
                pairing.loop_detection = False  # needs a vocabulary tree download: aborts the process offline
                pairing.num_threads = colmap_threads
                pycolmap.match_sequential(db, matching_options=matching, pairing_options=pairing,
                                          device=pycolmap.Device.cpu)

        models_dir = tmp / "models"
        models_dir.mkdir()
        mapper = choose_mapper(cfg, len(names))
        with _Phase(f"{mapper} mapping" + (f" (sfm.mapper auto: {len(names)} images)" if cfg.mapper == "auto" else "")):
            if mapper == "incremental":
                opts = pycolmap.IncrementalPipelineOptions()
                opts.num_threads = colmap_threads
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
                opts.num_threads = colmap_threads
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
        check_reconstruction(rec, f"{sparse_dir} (before writing)")

        # Metrics (and the ground-truth comparison, which can fail on a wrong path) before any output is written.
        metrics = {
            "source": "computed",  # "imported" when an existing COLMAP model is used (splatflow.scene.colmap)
            "images_total": len(names),
            **model_metrics(rec, truth),
            "camera_mode": cfg.camera_mode,
            "mapper": mapper,
            "cameras": camera_summary(rec, {n: g for g in groups for n in g.names}),
        }

        staged_sparse = tmp / "sparse"
        staged_sparse.mkdir()
        rec.write_binary(str(staged_sparse))

        staged_undist = tmp / "undistorted"
        with _Phase(f"undistorting {n_reg} images to PINHOLE"):
            undistort_model(staged_sparse, images_dir, staged_undist, undistorted_dir, threads)

        replace_dir(staged_sparse, sparse_dir)
        replace_dir(staged_undist, undistorted_dir)

    metrics["seconds"] = round(time.perf_counter() - t_start, 3)
    warning = fitness_warning(metrics)
    if warning:
        _say("WARNING: " + warning)
    return SfmResult(metrics=metrics, matcher=matcher, sparse_dir=sparse_dir, undistorted_dir=undistorted_dir)
