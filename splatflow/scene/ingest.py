"""Ingest: turn a raw capture (a folder of photos or one video) into a clean folder of images for COLMAP.

Why each step exists
--------------------
* **Orientation.** Phones store portrait photos as landscape pixels plus an EXIF ``Orientation`` tag. COLMAP
  ignores the tag, so one capture would mix rotated and upright images; we apply it to the pixels and drop it.
* **Formats.** pycolmap and OpenCV cannot read HEIC (pillow-heif can); 16-bit, palette, CMYK and grey images
  become 8-bit RGB. Already-clean RGB JPEGs are copied byte for byte (no second lossy generation).
* **Bad files.** pycolmap reads *every* file in its image folder, and OpenCV decodes a truncated JPEG with only a
  warning (grey bottom half, false features), while Pillow's ``load()`` raises: every image is fully decoded with
  Pillow here, and empty, non-image, unreadable and truncated files are rejected by name.
* **Sizes.** Images of several sizes are kept: a photo collection from several cameras (or portrait and
  landscape shots) is normal, and the sfm stage gives each size and EXIF camera its own intrinsics
  (``sfm.camera_mode``). The sizes found are listed in the metrics. Images smaller than ``min_side_px`` are
  rejected.
* **Blur.** Motion-blurred frames register badly and teach the splats blur. Sharpness (variance of the
  Laplacian, measured at a fixed width) is compared with the *median of the neighbouring images* in name order,
  because absolute sharpness depends on content and resolution (:mod:`splatflow.scene.imagehash`).
* **Featureless frames.** A black, white or lens-cap frame has nothing for SfM to match and only teaches the splats
  a flat colour; its relative sharpness may even pass the blur check next to other dark frames. An image whose
  grey thumbnail (area-averaged, so sensor noise cancels) has a standard deviation below
  ``FEATURELESS_MAX_STD`` grey levels is rejected as ``featureless``.
* **Duplicates.** Repeated shots or a camera standing still add no geometry but bias training toward one view;
  an image whose perceptual hash lies within ``dedupe_max_distance`` bits of an earlier kept image *and* whose
  thumbnail correlates with it at ``dedupe_min_correlation`` or more is dropped.
* **Video.** The sharpest frame of each of ``video_frames`` equal windows (:mod:`splatflow.scene.video`), then
  the same blur/duplicate checks.
* **Sub-folders.** A multi-camera rig is usually stored as one sub-folder per camera (``cam_a/0001.jpg``,
  ``cam_b/0001.jpg``). With ``sfm.camera_mode: per_folder``, or ``auto`` on a source that holds sub-folders but
  no image files of its own, the images of every sub-folder (any depth; hidden ones skipped) are read too
  (:func:`reads_subfolders`). Their output names keep the folder, flattened: ``cam_a/0001.jpg`` ->
  ``cam_a__0001.jpg`` (one flat folder is what COLMAP, the split, masks and renders work on), and
  ``image_folders`` (in ingest.json, and in ``data/<scene>/image_folders.json`` for the sfm stage) maps each output
  name to its folder, so the sfm stage gives each folder its own camera.
  Otherwise sub-folders are skipped and listed (a ``backup/`` next to the photos is not part of the capture).

Guarantees: the source is only read, never written (its folder may be read-only); the output is written to a
staging folder and swapped in at the end; output names keep the input stems (so ground-truth cameras still
match), are processed in the order the split will sort them in, and the bytes written are a pure function of
the input and the config (deterministic JPEG/PNG encoders, no timestamps), so a re-run gives identical files.
"""

from __future__ import annotations

import os
import shutil
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image, ImageFile, ImageOps, UnidentifiedImageError
from tqdm import tqdm

from splatflow.pipeline.config import IngestConfig
from splatflow.pipeline.errors import UserError
from splatflow.scene.imagehash import (correlation, hamming_to_many, phash, resize_to_width, sharpness, thumbnail,
                                      to_gray_f32)
from splatflow.scene.pixels import IMAGE_FILE_SUFFIXES  # noqa: F401 - also part of this module's interface
from splatflow.scene.video import check_video_source, iter_sharpest_frames, probe

#: Joins the folder and the file stem in a flat output name (``cam_a/0001.jpg`` -> ``cam_a__0001.jpg``).
FOLDER_SEP = "__"
#: File suffixes that count as a source's own images when ``auto`` decides whether to read its sub-folders.
MIN_USABLE_IMAGES = 3  # fewer cannot make a two-view model plus one image to register against it
#: What a capture that reconstructs well usually looks like, for the messages about captures that are too small.
TYPICAL_CAPTURE = ("20 to 200 photos taken a step apart while walking around the subject, each overlapping its "
                   "neighbours by more than half, work best")
#: Std of the 128-px grey thumbnail (0-255) below which an image is featureless. Measured: uniform black, grey or
#: white 800x600 frames with sensor noise of std 4 and JPEG q90 give 0.34-0.44; the views of the synthetic room and
#: of fountain-P11/entry-P10 give 19.8 or more, and scikit-image's photos darkened to 15 % of their brightness 4.3
#: or more. 1.5 sits well clear of both.
FEATURELESS_MAX_STD = 1.5
FEATURELESS_THUMB_WIDTH = 128

# reason codes in the metrics, with the fix each one suggests when too few images survive
REASON_HINTS = {
    "empty": "re-copy the files: they are 0 bytes",
    "not_image": "remove non-image files or convert RAW/other formats to JPEG/PNG/HEIC",
    "unreadable": "re-copy or re-export the damaged/truncated files",
    "too_small": "use larger images or lower ingest.min_side_px",
    "featureless": "remove the black, white or lens-cap frames: they hold nothing to match",
    "blurry": "retake the blurry shots, or lower ingest.blur_rel_threshold (0 disables the check)",
    "duplicate": "take photos from more distinct positions, or raise ingest.dedupe_min_correlation",
}

_ORIENTATION_TAG = 0x0112
_ICC_KEY = "icc_profile"
_heif_registered = False


@dataclass
class Candidate:
    """An image that decoded and was written to the staging folder; later checks may still reject it."""

    source: str  # input file name (relative to the source folder) or "<video>#frame=<index>"
    out_name: str
    width_px: int
    height_px: int
    sharpness: float
    hash: np.ndarray  # [64] bool perceptual hash
    thumb: np.ndarray  # [h, 128] float32 normalised grey thumbnail (confirms duplicates)
    written: str  # "copied" (bytes unchanged), "converted" (re-encoded) or "frame" (from a video)
    order: int  # position in processing (= output name) order
    folder: str | None = None  # sub-folder of the source it came from ("" = the source itself) when they are read


@dataclass
class Rejection:
    file: str
    reason: str  # one of REASON_HINTS
    detail: str
    order: int = 0


@dataclass
class IngestResult:
    source: Path
    source_kind: str  # "folder" or "video"
    images_in: int
    kept: list[Candidate]
    rejected: list[Rejection]
    ignored: list[str] = field(default_factory=list)  # hidden files and sub-folders, never looked at
    seconds: float = 0.0
    video: dict | None = None

    def metrics(self) -> dict:
        by_reason = Counter(r.reason for r in self.rejected)
        sizes = {(c.width_px, c.height_px) for c in self.kept}
        (w, h), = sizes if len(sizes) == 1 else {(None, None)}
        out = {
            "source": str(self.source),
            "source_kind": self.source_kind,
            "images_in": self.images_in,
            "images_kept": len(self.kept),
            "images_rejected": len(self.rejected),
            "rejected_by_reason": {k: by_reason[k] for k in REASON_HINTS if by_reason[k]},
            "rejected": [{"file": r.file, "reason": r.reason, "detail": r.detail} for r in self.rejected],
            "image_width_px": w,
            "image_height_px": h,
            "image_sizes": dict(Counter(f"{c.width_px}x{c.height_px}" for c in self.kept).most_common()),
            "copied": sum(c.written == "copied" for c in self.kept),
            "converted": sum(c.written != "copied" for c in self.kept),
            "ignored": list(self.ignored),
            "seconds": round(self.seconds, 3),
        }
        # the sfm stage's per-folder cameras read this; empty when the sub-folders were not read
        out["image_folders"] = {c.out_name: c.folder for c in self.kept if c.folder is not None}
        if self.video is not None:
            out["video"] = self.video
        return out

    def folder_counts(self) -> dict[str, int]:
        """Kept images per source sub-folder (``""`` = the source itself); empty when sub-folders were not read."""
        return dict(sorted(Counter(c.folder for c in self.kept if c.folder is not None).items()))

    def summary_lines(self, max_names: int = 6) -> list[str]:
        """One console line per reason anything was left out (sub-folders, hidden files, each rejection
        reason), with the count, the first names and what to do; nothing is left out in silence."""
        def names(items: list[str]) -> str:
            more = f", ... ({len(items) - max_names} more)" if len(items) > max_names else ""
            return ", ".join(items[:max_names]) + more

        lines = []
        folders = [n for n in self.ignored if n.endswith("/")]
        hidden = [n for n in self.ignored if not n.endswith("/")]
        if folders:
            lines.append(f"skipped {len(folders)} sub-folder{'s' * (len(folders) != 1)} (ingest reads only the "
                         f"files directly in {self.source} unless sfm.camera_mode is per_folder): {names(folders)}")
        if hidden:
            lines.append(f"skipped {len(hidden)} hidden file{'s' * (len(hidden) != 1)}: {names(hidden)}")
        by_reason: dict[str, list[str]] = {}
        for r in self.rejected:
            by_reason.setdefault(r.reason, []).append(r.file)
        for reason in [k for k in REASON_HINTS if k in by_reason] + [k for k in by_reason if k not in REASON_HINTS]:
            files = by_reason[reason]
            hint = REASON_HINTS.get(reason)
            lines.append(f"rejected {len(files)} {reason.replace('_', ' ')}: {names(files)}"
                         + (f" (fix: {hint})" if hint else ""))
        return lines


# --------------------------------------------------------------------------------------------- entry point


IMAGE_FOLDERS_FILE = "image_folders.json"  # in data/<scene>/, next to images/


def write_image_folders(data_dir: str | Path, folders: dict[str, str]) -> Path:
    """Write ``{output name: source sub-folder}`` to ``data_dir/image_folders.json`` (``{}`` when ingest read no
    sub-folders); the bytes depend on the mapping only, so an unchanged capture gives an unchanged file."""
    import json

    path = Path(data_dir) / IMAGE_FOLDERS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(sorted(folders.items())), indent=1) + "\n")
    return path


def read_image_folders(data_dir: str | Path) -> dict[str, str] | None:
    """What :func:`write_image_folders` wrote, or None when absent or empty (no sub-folders were read)."""
    import json

    path = Path(data_dir) / IMAGE_FOLDERS_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text()) or None
    except ValueError:
        raise UserError(f"{path}: not valid JSON; rerun the ingest stage (it writes this file)") from None


def reads_subfolders(source: str | Path, camera_mode: str) -> bool:
    """Whether ingest reads the images of ``source``'s sub-folders (see the module docstring): always for
    ``sfm.camera_mode: per_folder``; for ``auto`` when ``source`` is a folder with no image files of its own and a
    sub-folder that is not hidden (the layout of a multi-camera rig); never for ``single`` and ``per_image``."""
    source = Path(source).expanduser()
    if camera_mode == "per_folder":
        return True
    if camera_mode != "auto" or not source.is_dir():
        return False
    entries = [p for p in source.iterdir() if not p.name.startswith(".")]
    own_images = any(p.is_file() and p.suffix.lower() in IMAGE_FILE_SUFFIXES for p in entries)
    return not own_images and any(p.is_dir() for p in entries)


def ingest(source: str | Path, out_dir: str | Path, cfg: IngestConfig, *, progress: bool = True,
           subfolders: bool = False) -> IngestResult:
    """Read ``source`` (folder of images or a video file), write the usable images to ``out_dir``.

    ``subfolders``: also read the images in ``source``'s sub-folders, with flat output names that keep the folder
    (:func:`reads_subfolders` decides it from ``sfm.camera_mode``). ``out_dir`` is replaced as a whole (it is a
    pipeline output); ``source`` is never written to. Raises UserError for a missing/unsupported source,
    overlapping source and output, or fewer than 3 usable images.
    """
    t0 = time.perf_counter()
    source = Path(source).expanduser()
    out_dir = Path(out_dir)
    _check_locations(source, out_dir)

    staging = out_dir.parent / f".{out_dir.name}.staging"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    try:
        ignored: list[str] = []
        video_info = None
        if source.is_dir():
            kind = "folder"
            candidates, rejected, images_in, ignored = _read_folder(source, staging, cfg, progress, subfolders)
        else:
            kind = "video"
            candidates, rejected, images_in, video_info = _read_video(source, staging, cfg, progress)

        candidates = _reject_blurry(candidates, rejected, cfg)
        candidates = _reject_duplicates(candidates, rejected, cfg)
        kept_names = {c.out_name for c in candidates}
        for p in staging.iterdir():
            if p.name not in kept_names:
                p.unlink()
        rejected.sort(key=lambda r: (r.order, r.file))
        result = IngestResult(source=source, source_kind=kind, images_in=images_in, kept=candidates,
                              rejected=rejected, ignored=ignored, video=video_info)
        if len(candidates) < MIN_USABLE_IMAGES:
            raise UserError(_too_few_message(result))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(staging, out_dir)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    result.seconds = time.perf_counter() - t0
    return result


def _check_locations(source: Path, out_dir: Path) -> None:
    if not source.exists():
        raise UserError(
            f"{source}: the scene source does not exist. Point base.scenes.<scene>.source in params.yaml at a "
            f"folder of images or a video file (paths are relative to the project root)."
        )
    if source.is_file():
        check_video_source(source)  # the same test as add-scene's: open it and decode a frame
    src, out = source.resolve(), out_dir.resolve()
    if src == out or src in out.parents or out in src.parents:
        raise UserError(
            f"{source}: the scene source overlaps the ingest output folder {out_dir}; ingest replaces its output "
            f"and must never touch the source. Keep raw captures outside data/<scene>/."
        )


# --------------------------------------------------------------------------------------------- reading


class _Reject(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason, self.detail = reason, detail


def _register_heif() -> None:
    """Teach Pillow to open HEIC/HEIF (iPhone photos); done lazily so importing this module has no side effect."""
    global _heif_registered
    if not _heif_registered:
        from pillow_heif import register_heif_opener

        register_heif_opener()
        _heif_registered = True


def output_names(files: list[str], ext: str) -> dict[str, str]:
    """Input file name (relative to the source, ``/``-separated) -> output name: the input stem with the output
    extension, unique; a file in a sub-folder keeps its folder in the name (``cam_a/0001.jpg`` ->
    ``cam_a__0001.<ext>``, see ``FOLDER_SEP``).

    Two inputs with one stem (``a.jpg``, ``a.png``) keep the first (in name order) as ``a.<ext>`` and give the
    other its old extension in the stem (``a_png.<ext>``).
    """
    names: dict[str, str] = {}
    used: set[str] = set()
    for f in sorted(files):
        p = Path(f)
        stem = FOLDER_SEP.join([*p.parent.parts, p.stem]) if p.parent != Path(".") else p.stem
        name = f"{stem}.{ext}"
        if name.lower() in used:
            name = f"{stem}_{p.suffix.lstrip('.').lower() or 'noext'}.{ext}"
            k = 2
            while name.lower() in used:
                name = f"{stem}_{k}.{ext}"
                k += 1
        used.add(name.lower())
        names[f] = name
    return names


def open_image(path: Path) -> tuple[Image.Image, bool, str]:
    """Fully decode ``path`` with Pillow, apply EXIF orientation, return (RGB image, was_clean_jpeg, format).

    ``was_clean_jpeg``: the file is an RGB JPEG without a rotation to apply, so its bytes can be kept as they are.
    Raises _Reject with the reason code for empty, non-image and unreadable/truncated files.
    """
    _register_heif()
    if path.stat().st_size == 0:
        raise _Reject("empty", "file is empty (0 bytes)")
    # Some library may have switched Pillow to tolerate truncated files globally: we need the error.
    tolerant = ImageFile.LOAD_TRUNCATED_IMAGES
    ImageFile.LOAD_TRUNCATED_IMAGES = False
    try:
        try:
            im = Image.open(path)
        except UnidentifiedImageError:
            raise _Reject("not_image", "not an image format Pillow/pillow-heif can read") from None
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
            raise _Reject("unreadable", f"cannot open: {e}") from None
        with im:
            fmt = im.format or "?"
            try:
                im.load()  # decodes every byte: a truncated JPEG raises here (OpenCV would only warn)
            except (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError) as e:
                raise _Reject("unreadable", f"corrupt or truncated {fmt}: {e}") from None
            orientation = im.getexif().get(_ORIENTATION_TAG, 1)
            clean_jpeg = fmt == "JPEG" and im.mode == "RGB" and orientation in (None, 0, 1)
            upright = ImageOps.exif_transpose(im)  # new image; the orientation tag is removed from its EXIF
            rgb = _to_rgb(upright)
            rgb.info = dict(upright.info)
            return rgb, clean_jpeg, fmt
    finally:
        ImageFile.LOAD_TRUNCATED_IMAGES = tolerant


def _to_rgb(im: Image.Image) -> Image.Image:
    """8-bit RGB. 16/32-bit grey is scaled (Pillow's own convert would clip it); alpha is dropped."""
    if im.mode == "RGB":
        return im
    if im.mode.startswith("I"):  # I;16, I;16B, I: 16-bit range
        grey16 = np.asarray(im).astype(np.float64)  # [H, W]
        grey8 = np.clip(np.rint(grey16 / 257.0), 0, 255).astype(np.uint8)
        return Image.fromarray(grey8).convert("RGB")
    if im.mode == "F":  # float images: assume [0, 1]
        grey8 = np.clip(np.rint(np.asarray(im) * 255.0), 0, 255).astype(np.uint8)
        return Image.fromarray(grey8).convert("RGB")
    return im.convert("RGB")


def _save(im: Image.Image, path: Path, cfg: IngestConfig) -> None:
    """Encode deterministically: fixed settings, no timestamps; keep EXIF (focal length helps COLMAP) and ICC."""
    exif = im.getexif()
    exif.pop(_ORIENTATION_TAG, None)  # pixels are upright now
    extra = {}
    if len(exif):
        extra["exif"] = exif.tobytes()
    if im.info.get(_ICC_KEY):
        extra[_ICC_KEY] = im.info[_ICC_KEY]
    if cfg.image_format == "jpg":
        # 4:4:4 chroma: SIFT works on luma, but training compares colours at full resolution.
        im.save(path, "JPEG", quality=cfg.jpeg_quality, subsampling=0, optimize=False, progressive=False, **extra)
    else:
        im.save(path, "PNG", compress_level=6, optimize=False, **extra)


def _measure(rgb_u8: np.ndarray, cfg: IngestConfig) -> tuple[float, np.ndarray, np.ndarray]:
    gray = to_gray_f32(rgb_u8)  # [H, W]
    flat = _featureless(gray)
    if flat:
        raise flat
    return sharpness(gray, cfg.blur_measure_width), phash(gray), thumbnail(gray)


def _featureless(gray: np.ndarray) -> _Reject | None:
    """A nearly uniform image (black, white, lens cap): see ``FEATURELESS_MAX_STD``."""
    small = resize_to_width(gray, min(FEATURELESS_THUMB_WIDTH, gray.shape[1]))  # [h, 128]
    std = float(small.std())
    if std < FEATURELESS_MAX_STD:
        return _Reject("featureless", f"nearly uniform (grey-level std {std:.2f} of 255, mean {float(small.mean()):.0f}"
                                      f"; below {FEATURELESS_MAX_STD:g}): a black, white or lens-cap frame has no "
                                      "features for structure from motion")
    return None


def _too_small(w: int, h: int, cfg: IngestConfig) -> _Reject | None:
    if min(w, h) < cfg.min_side_px:
        return _Reject("too_small", f"{w}x{h} px: shorter side below ingest.min_side_px = {cfg.min_side_px}")
    return None


def _list_folder(source: Path, subfolders: bool) -> tuple[list[str], list[str]]:
    """``(files, ignored)`` relative to ``source`` (``/``-separated): the files to read, and the hidden files and
    (unless ``subfolders``) sub-folders left out, folders with a trailing ``/``."""
    ignored, files = [], []
    todo = [source]
    while todo:
        folder = todo.pop()
        for p in sorted(folder.iterdir()):
            rel = p.relative_to(source).as_posix()
            if p.name.startswith("."):  # .DS_Store, .thumbnails/: not part of the capture
                ignored.append(rel + ("/" if p.is_dir() else ""))
            elif p.is_dir():
                if subfolders:
                    todo.append(p)
                else:  # a backup/ or rejects/ next to the photos: not part of the capture
                    ignored.append(rel + "/")
            elif p.is_file():
                files.append(rel)
    return files, sorted(ignored)


def _read_folder(source: Path, staging: Path, cfg: IngestConfig, progress: bool, subfolders: bool = False):
    files, ignored = _list_folder(source, subfolders)
    names = output_names(files, cfg.image_format)
    # Process in output-name order: the neighbours of the blur check are the split's neighbours too.
    order = sorted(files, key=lambda f: (names[f], f))
    candidates: list[Candidate] = []
    rejected: list[Rejection] = []
    for i, f in enumerate(tqdm(order, desc="ingest: reading images", unit="img", disable=not progress)):
        path = source / f
        try:
            im, clean_jpeg, _fmt = open_image(path)
            w, h = im.size
            small = _too_small(w, h, cfg)
            if small:
                raise small
            rgb = np.asarray(im)  # [H, W, 3] uint8
            score, h64, thumb = _measure(rgb, cfg)
            dst = staging / names[f]
            if clean_jpeg and cfg.image_format == "jpg":
                shutil.copyfile(path, dst)  # byte-identical: no second JPEG generation
                written = "copied"
            else:
                _save(im, dst, cfg)
                written = "converted"
        except _Reject as r:
            rejected.append(Rejection(f, r.reason, r.detail, i))
            continue
        folder = Path(f).parent.as_posix() if subfolders else None
        candidates.append(Candidate(f, names[f], w, h, score, h64, thumb, written, i,
                                    folder=None if folder is None else ("" if folder == "." else folder)))
    return candidates, rejected, len(files), ignored


def _read_video(source: Path, staging: Path, cfg: IngestConfig, progress: bool):
    candidates: list[Candidate] = []
    rejected: list[Rejection] = []
    info = probe(source)
    for i, fr in enumerate(iter_sharpest_frames(source, cfg.video_frames, cfg.blur_measure_width,
                                                progress=progress, stats=info)):
        name = f"frame_{fr.index:06d}.{cfg.image_format}"
        label = f"{source.name}#frame={fr.index}"
        h, w = fr.bgr.shape[:2]
        small = _too_small(w, h, cfg)
        if small:
            rejected.append(Rejection(label, small.reason, small.detail, i))
            continue
        rgb = fr.rgb  # [H, W, 3]
        try:
            _, h64, thumb = _measure(rgb, cfg)
        except _Reject as r:
            rejected.append(Rejection(label, r.reason, r.detail, i))
            continue
        _save(Image.fromarray(rgb), staging / name, cfg)
        candidates.append(Candidate(label, name, w, h, fr.sharpness, h64, thumb, "frame", i))
    info.update(frames_requested=cfg.video_frames, frames_chosen=len(candidates) + len(rejected),
                chosen_frame_indices=[int(c.source.rsplit("=", 1)[1]) for c in candidates])
    return candidates, rejected, len(candidates) + len(rejected), info


# --------------------------------------------------------------------------------------------- selection


def neighbour_indices(i: int, n: int, window: int) -> range | list[int]:
    """The ``window`` positions nearest to ``i`` in [0, n), excluding i (shifted inward at the ends)."""
    lo = max(0, min(i - window // 2, n - 1 - window))
    hi = min(n, lo + window + 1)
    return [j for j in range(lo, hi) if j != i]


def relative_sharpness(scores: np.ndarray, window: int) -> np.ndarray:
    """[N] sharpness -> [N] ratio of each to the median of its ``window`` neighbours in order."""
    n = len(scores)
    rel = np.ones(n)
    for i in range(n):
        med = float(np.median(scores[neighbour_indices(i, n, window)]))
        rel[i] = scores[i] / med if med > 0 else (1.0 if scores[i] == 0 else np.inf)
    return rel


def _reject_blurry(cands: list[Candidate], rejected: list[Rejection], cfg: IngestConfig) -> list[Candidate]:
    if len(cands) < 3 or cfg.blur_rel_threshold <= 0:  # need two neighbours to call anything blurry
        return cands
    rel = relative_sharpness(np.array([c.sharpness for c in cands]), cfg.blur_window)
    keep = []
    for c, r in zip(cands, rel):
        if r >= cfg.blur_rel_threshold:
            keep.append(c)
        else:
            rejected.append(Rejection(
                c.source, "blurry",
                f"sharpness {c.sharpness:.1f} is {r:.2f}x the median of its {cfg.blur_window} neighbours "
                f"(threshold ingest.blur_rel_threshold = {cfg.blur_rel_threshold})", c.order))
    return keep


def _reject_duplicates(cands: list[Candidate], rejected: list[Rejection], cfg: IngestConfig) -> list[Candidate]:
    """Keep the first of each group of near-identical images (in order), comparing with every image kept so far.

    Two stages: the 64-bit perceptual hash is a cheap prefilter (distance <= ``dedupe_max_distance``), and the
    correlation of 128-px thumbnails decides (>= ``dedupe_min_correlation``): hashes alone confuse noise on smooth
    content with small camera motion (see :func:`splatflow.scene.imagehash.correlation`).
    """
    keep: list[Candidate] = []
    hashes = np.zeros((len(cands), 64), dtype=bool)  # [K, 64] hashes of kept images in the first K rows
    for c in cands:
        dist = hamming_to_many(c.hash, hashes[:len(keep)])  # [K]
        near = np.flatnonzero(dist <= cfg.dedupe_max_distance)
        best_j, best_ncc = -1, -1.0
        for j in near:
            if keep[j].thumb.shape != c.thumb.shape:  # another aspect ratio (mixed sizes): not the same shot
                continue
            ncc = correlation(c.thumb, keep[j].thumb)
            if ncc > best_ncc:
                best_j, best_ncc = int(j), ncc
        if best_j >= 0 and best_ncc >= cfg.dedupe_min_correlation:
            rejected.append(Rejection(
                c.source, "duplicate",
                f"near-duplicate of {keep[best_j].source} (thumbnail correlation {best_ncc:.4f} >= "
                f"ingest.dedupe_min_correlation = {cfg.dedupe_min_correlation}; perceptual-hash distance "
                f"{int(dist[best_j])})", c.order))
            continue
        hashes[len(keep)] = c.hash
        keep.append(c)
    return keep


def _too_few_message(result: IngestResult) -> str:
    by_reason = Counter(r.reason for r in result.rejected)
    parts = [f"{n} {reason.replace('_', ' ')}" for reason, n in by_reason.most_common()]
    examples = "; ".join(f"{r.file}: {r.detail}" for r in result.rejected[:8])
    more = f" (and {len(result.rejected) - 8} more)" if len(result.rejected) > 8 else ""
    hints = "; ".join(f"{reason}: {REASON_HINTS[reason]}" for reason, _ in by_reason.most_common())
    what = "frames" if result.source_kind == "video" else "images"
    folders = [n for n in result.ignored if n.endswith("/")]
    if folders and result.images_in == 0:
        return (f"{result.source}: no image files here, only sub-folders ({', '.join(folders[:5])}); ingest reads "
                f"sub-folders only with sfm.camera_mode: per_folder or auto (one camera per sub-folder): set that, "
                f"or point base.scenes.<scene>.source at the folder that holds the images.")
    if not result.rejected:  # nothing to blame but the size of the capture
        more_frames = (f" (a video: raise ingest.video_frames, now {len(result.kept)} frames were kept)"
                       if result.source_kind == "video" else "")
        return (f"{result.source}: only {len(result.kept)} {what} and none was rejected; structure from motion "
                f"needs at least {MIN_USABLE_IMAGES} overlapping views. Fix: add more {what} of the scene{more_frames}"
                f"; {TYPICAL_CAPTURE}.")
    return (
        f"{result.source}: only {len(result.kept)} usable {what} of {result.images_in}; structure from motion "
        f"needs at least {MIN_USABLE_IMAGES}. Rejected {len(result.rejected)}"
        + (f" ({', '.join(parts)})" if parts else "")
        + (f": {examples}{more}." if examples else ".")
        + (f" Fix: {hints}." if hints else " Fix: add more images to the source.")
    )
