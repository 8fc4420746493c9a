"""Frames from a video: one sharp frame per window of the timeline.

Structure from motion wants frames spread evenly over the capture and as sharp as possible. Hand-held video
blurs many frames (motion blur, rolling focus), so instead of taking every k-th frame we split the timeline into
``n_frames`` equal windows and keep, in each, the frame with the highest variance of the Laplacian (measured at a
fixed width, see :mod:`splatflow.scene.imagehash`). This is the usual "sharp frame selection" of capture tools
(e.g. nerfstudio's and COLMAP users' ffmpeg recipes); the window scheme keeps the spacing even.

Decoding is sequential: ``VideoCapture.grab()`` in order is ~13x faster than seeking with ``CAP_PROP_POS_FRAMES``
(measured, docs/design.md §5), because every seek decodes again from the previous key frame. OpenCV's FFmpeg build
cannot decode AV1 and then reports an opened capture that yields 0 frames without any error, so an empty
decode is turned into a :class:`UserError` naming the codec and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import cv2
import numpy as np
from tqdm import tqdm

from splatflow.pipeline.errors import UserError
from splatflow.scene.imagehash import sharpness
from splatflow.scene.pixels import IMAGE_FILE_SUFFIXES

#: Video containers known by suffix: named in messages and used to word them; whether a file is a usable video is
#: decided by opening it (:func:`check_video_source`).
VIDEO_SUFFIXES = frozenset(
    {".mp4", ".m4v", ".mov", ".avi", ".mkv", ".webm", ".mpg", ".mpeg", ".wmv", ".flv", ".mts", ".m2ts", ".ts",
     ".3gp", ".ogv"}
)

_REENCODE_HINT = "re-encode it to H.264, e.g. `ffmpeg -i INPUT -c:v libx264 -crf 18 -pix_fmt yuv420p OUTPUT.mp4`"


@dataclass
class VideoFrame:
    """One chosen frame: its index in the source, its pixels and the sharpness it won its window with."""

    index: int
    bgr: np.ndarray  # [H, W, 3] uint8, OpenCV channel order
    sharpness: float
    window: tuple[int, int]  # [start, stop) frame indices of the window it was chosen from

    @property
    def rgb(self) -> np.ndarray:
        return cv2.cvtColor(self.bgr, cv2.COLOR_BGR2RGB)  # [H, W, 3]


def check_video_source(path: Path) -> dict:
    """Decide whether the file ``path`` is a video a scene can use, by opening it and decoding its first frame, as
    ingest will; return :func:`probe`'s record. The one test behind ``add-scene`` and ingest, so neither refuses a
    file the other reads: the suffix only picks the message (a camera's ``.MTS``, an unusual container that OpenCV's
    FFmpeg opens, is taken; a ``.mp4`` OpenCV cannot decode is refused with the re-encode fix).

    Raises UserError naming the file and the fix: a single photo (put photos in a folder), a file OpenCV cannot
    open (listing the video formats known by suffix), or a video of 0 decodable frames (AV1, a damaged file)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix in IMAGE_FILE_SUFFIXES:
        raise UserError(f"{path}: a scene source must be a folder of images or a video file; this is a single image: "
                        f"put the photos in a folder and give the folder")
    cap = cv2.VideoCapture(str(path))
    try:
        if not cap.isOpened():
            if suffix in VIDEO_SUFFIXES:
                _open(path)  # raises the message for a video OpenCV cannot open
            raise UserError(f"{path}: not a video OpenCV can open (video formats: "
                            f"{', '.join(sorted(VIDEO_SUFFIXES))}), nor a folder; give a folder of images or a video "
                            f"file")
        codec = fourcc_string(cap)
        if not cap.grab():
            raise UserError(_no_frames_message(path, codec))
    finally:
        cap.release()
    return probe(path)


def fourcc_string(cap: cv2.VideoCapture) -> str:
    code = int(cap.get(cv2.CAP_PROP_FOURCC))
    chars = "".join(chr((code >> (8 * i)) & 0xFF) for i in range(4))
    return chars if chars.isprintable() and chars.strip("\x00") else f"0x{code:08x}"


def _open(path: Path) -> cv2.VideoCapture:
    cap = cv2.VideoCapture(str(path))
    if not cap.isOpened():
        raise UserError(
            f"{path}: OpenCV cannot open this video (unknown container, damaged file or not a video). "
            f"If it plays elsewhere, {_REENCODE_HINT}; or extract the frames to a folder of images and use that "
            f"folder as the scene source."
        )
    return cap


def probe(path: Path) -> dict:
    """Codec, frame rate, declared frame count and size of a video, for the metrics."""
    cap = _open(path)
    try:
        return {
            "codec": fourcc_string(cap),
            "fps": round(float(cap.get(cv2.CAP_PROP_FPS) or 0.0), 3),
            "frames_declared": int(cap.get(cv2.CAP_PROP_FRAME_COUNT) or 0),
            "width_px": int(cap.get(cv2.CAP_PROP_FRAME_WIDTH) or 0),
            "height_px": int(cap.get(cv2.CAP_PROP_FRAME_HEIGHT) or 0),
        }
    finally:
        cap.release()


def count_frames(path: Path) -> int:
    """Count decodable frames with sequential grabs (when the container's frame count is missing or wrong)."""
    cap = _open(path)
    n = 0
    try:
        while cap.grab():
            n += 1
    finally:
        cap.release()
    return n


def window_bounds(n_total: int, n_windows: int) -> list[tuple[int, int]]:
    """Split frames [0, n_total) into ``min(n_windows, n_total)`` contiguous, nearly equal windows."""
    n = min(n_windows, n_total)
    edges = [(k * n_total) // n for k in range(n + 1)]
    return [(edges[k], edges[k + 1]) for k in range(n)]


def _frames(cap: cv2.VideoCapture) -> Iterator[np.ndarray]:
    while cap.grab():
        ok, bgr = cap.retrieve()
        if not ok:
            return
        yield bgr


def iter_sharpest_frames(path: Path, n_frames: int, measure_width_px: int, *, progress: bool = True,
                         stats: dict | None = None) -> Iterator[VideoFrame]:
    """Decode ``path`` once, in order, and yield the sharpest frame of each of ``n_frames`` equal windows.

    Frames are yielded as soon as their window closes, so only one full-resolution frame per window is held in
    memory at a time (a 4K video with 300 windows would otherwise need ~7 GB). Ties keep the earlier frame, so
    the choice is deterministic. Raises UserError when the video cannot be opened or yields no frames (AV1 in
    OpenCV, damaged files). ``stats``, if given, receives ``frames_decoded``.
    """
    path = Path(path)
    cap = _open(path)
    codec = fourcc_string(cap)
    declared = int(cap.get(cv2.CAP_PROP_FRAME_COUNT) or 0)
    cap.release()
    # Containers may omit the frame count; then count by grabbing (cheap compared to scoring every frame).
    n_total = declared if declared > 0 else count_frames(path)
    if n_total <= 0:
        raise UserError(_no_frames_message(path, codec))

    windows = window_bounds(n_total, n_frames)
    cap = _open(path)
    n_decoded = 0
    win = 0
    best: VideoFrame | None = None
    bar = tqdm(total=n_total, desc=f"ingest: reading {path.name}", unit="frame", disable=not progress)
    try:
        for index, bgr in enumerate(_frames(cap)):
            n_decoded += 1
            bar.update(1)
            # The last window absorbs any frames past the declared count (containers can under-state it).
            while win < len(windows) - 1 and index >= windows[win][1]:
                if best is not None:
                    yield best
                best = None
                win += 1
            # Grey straight from BGR (same luma weights as from RGB); only the winner is converted to RGB.
            score = sharpness(cv2.cvtColor(bgr, cv2.COLOR_BGR2GRAY).astype(np.float32), measure_width_px)
            if best is None or score > best.sharpness:
                best = VideoFrame(index=index, bgr=bgr, sharpness=score, window=windows[win])
        if best is not None:
            yield best
    finally:
        bar.close()
        cap.release()
        if stats is not None:
            stats["frames_decoded"] = n_decoded
    if n_decoded == 0:
        raise UserError(_no_frames_message(path, codec))
    # Fewer frames than declared: the windows past the end stay empty and yield nothing.


def _no_frames_message(path: Path, codec: str) -> str:
    av1 = codec.lower() in {"av01", "av1 ", "av1"} or codec.lower().startswith("av0")
    why = ("its codec is AV1, which OpenCV's FFmpeg build does not decode"
           if av1 else f"its codec ({codec}) may not be supported by OpenCV's FFmpeg build, or the file is damaged")
    return f"{path}: OpenCV opened the video but decoded 0 frames: {why}. Fix: {_REENCODE_HINT}."
