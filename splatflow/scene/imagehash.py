"""Perceptual hashing and sharpness: the two per-image measures ingest filters on.

Perceptual hash (pHash)
    The 2-D DCT of a 32x32 grey thumbnail keeps its 8x8 lowest frequencies; each bit says whether that
    coefficient lies above their median (Zauner, "Implementation and Benchmarking of Perceptual Image Hash
    Functions", 2010). Re-encoding, resizing, mild colour changes and noise leave most bits alone, so two copies
    of one photo sit a few bits apart, while two views of a scene taken from places a few degrees apart differ in
    many low-frequency coefficients. The DC coefficient is excluded from the median (it is the mean brightness
    and would dominate it) but kept as a bit, as in the reference implementation.

Sharpness
    The variance of the Laplacian (Pech-Pacheco et al., "Diatom autofocusing in brightfield microscopy: a
    comparative study", ICPR 2000): blur removes high frequencies, which the Laplacian measures. Its value
    scales with image content *and resolution* (downscaling a photo concentrates its edges and raises it), so
    it is measured after resizing every image to one fixed width and is only ever compared *relatively*, to the
    median of neighbouring images in the same capture.
"""

from __future__ import annotations

import cv2
import numpy as np

HASH_SIDE = 8  # bits per side of the hash: 64-bit hashes
_DCT_SIDE = 32  # thumbnail side the DCT is taken on (4x the hash side, as in pHash)


def to_gray_f32(rgb_u8: np.ndarray) -> np.ndarray:
    """[H, W, 3] uint8 RGB (or [H, W] grey) -> [H, W] float32 luma in [0, 255] (Rec. 601 weights, like OpenCV)."""
    if rgb_u8.ndim == 2:
        return rgb_u8.astype(np.float32)
    return cv2.cvtColor(rgb_u8, cv2.COLOR_RGB2GRAY).astype(np.float32)


def resize_to_width(gray: np.ndarray, width_px: int) -> np.ndarray:
    """Resize [H, W] keeping the aspect ratio so that W == width_px (area filter when shrinking)."""
    h, w = gray.shape[:2]
    if w == width_px:
        return gray
    height_px = max(1, round(h * width_px / w))
    interp = cv2.INTER_AREA if width_px < w else cv2.INTER_LINEAR
    return cv2.resize(gray, (width_px, height_px), interpolation=interp)


def laplacian_variance(gray: np.ndarray) -> float:
    """Variance of the 3x3 Laplacian of a [H, W] float32 grey image (higher = sharper)."""
    lap = cv2.Laplacian(gray, cv2.CV_32F, ksize=1, borderType=cv2.BORDER_REFLECT)  # [H, W]
    _, std = cv2.meanStdDev(lap)  # 4x faster than numpy's var (no float64 copy); it runs on every video frame
    return float(std[0, 0]) ** 2


def sharpness(gray: np.ndarray, measure_width_px: int) -> float:
    """Variance of the Laplacian measured at a fixed width, so images of one capture compare fairly.

    Images narrower than ``measure_width_px`` are measured as they are: upsampling would only add interpolation
    blur. In a collection of several sizes below that width the comparison is therefore only approximate (a
    smaller image of the same content scores somewhat sharper), which the relative threshold tolerates.
    """
    width_px = min(measure_width_px, gray.shape[1])
    return laplacian_variance(resize_to_width(gray, width_px))


def phash(gray: np.ndarray) -> np.ndarray:
    """64-bit perceptual hash of a [H, W] grey image, as a [64] bool array (row-major over the 8x8 DCT block)."""
    thumb = cv2.resize(gray.astype(np.float32), (_DCT_SIDE, _DCT_SIDE), interpolation=cv2.INTER_AREA)  # [32, 32]
    coeffs = cv2.dct(thumb)[:HASH_SIDE, :HASH_SIDE].reshape(-1)  # [64], lowest frequencies
    median = np.median(coeffs[1:])  # without DC: it is the mean brightness, far from the others
    return coeffs > median


THUMB_WIDTH_PX = 128  # width of the thumbnails duplicates are confirmed on


def thumbnail(gray: np.ndarray, width_px: int = THUMB_WIDTH_PX) -> np.ndarray:
    """[h, width_px] float32 grey thumbnail, zero mean and unit norm, for :func:`correlation`."""
    t = resize_to_width(gray.astype(np.float32), width_px)  # [h, w]
    t = t - t.mean()
    return t / max(float(np.linalg.norm(t)), 1e-6)


def correlation(a: np.ndarray, b: np.ndarray) -> float:
    """Normalised cross-correlation of two :func:`thumbnail` s of one size (1 = identical up to gain/offset).

    Why both this and the hash: a pHash bit flips whenever its DCT coefficient sits near the median, so smooth
    content (sky) moves a few bits under mere noise or re-encoding, as much as under a 1 % camera pan. Thumbnail
    correlation separates the two cleanly (measured on four scikit-image photos at 1280x720: noise, JPEG q40 and
    +10 % brightness give 1 - NCC <= 0.001; a pan of 4 px, 0.3 % of the width, already gives >= 0.009).
    """
    return float((a * b).sum())


def hamming(a: np.ndarray, b: np.ndarray) -> int:
    """Number of differing bits between two bool hashes of the same length."""
    return int(np.count_nonzero(a != b))


def hamming_to_many(h: np.ndarray, others: np.ndarray) -> np.ndarray:
    """Distances from one [B] hash to each row of [M, B] hashes -> [M] int."""
    if len(others) == 0:
        return np.zeros(0, dtype=np.int64)
    return np.count_nonzero(others != h[None, :], axis=1)
