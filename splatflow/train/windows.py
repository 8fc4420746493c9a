"""Training windows: which part of a view a step renders when the whole view would cost too much.

Rendering a random window of ``train.patch_max_pixels`` pixels instead of the whole view lets every step see
full-detail pixels at a fraction of the cost (the rasterizer's ``window`` renders exactly those pixels of the whole
view). The window is drawn so that every pixel is trained equally often, see :func:`patch_window`.
"""

from __future__ import annotations

import functools
import random

import numpy as np

PATCH_MIN_SIDE = 16  # a training window is never thinner than this (SSIM needs room)


def _mean_clipped_length(size: int, nominal: int, min_side: int = PATCH_MIN_SIDE) -> float:
    """Mean length of ``[x0, x0 + nominal)`` clipped to ``[0, size)`` over x0 uniform in
    ``[min_side - nominal, size - min_side]`` (every placement overlapping the image by ``min_side`` or more)."""
    x0 = np.arange(min_side - nominal, size - min_side + 1)
    return float((np.minimum(size, x0 + nominal) - np.maximum(0, x0)).mean())


@functools.lru_cache(maxsize=64)
def _patch_plan(width: int, height: int, max_pixels: int) -> tuple[int, int, float]:
    """``(nominal_w, nominal_h, p_whole)`` for :func:`patch_window`: the nominal window whose mean clipped area is
    ``max_pixels``, and the probability of training on the whole image instead, used when even a nominal window
    the size of the image clips to less than ``max_pixels`` on average (levels under ~4x the budget)."""
    def nominal(s: float) -> tuple[int, int]:
        return (max(PATCH_MIN_SIDE, min(width, round(width * s))),
                max(PATCH_MIN_SIDE, min(height, round(height * s))))

    def mean_area(s: float) -> float:
        w, h = nominal(s)
        return _mean_clipped_length(width, w) * _mean_clipped_length(height, h)

    full = mean_area(1.0)
    if full <= max_pixels:  # mix whole images in: mean area p * W H + (1 - p) * full = max_pixels
        return width, height, (max_pixels - full) / (width * height - full)
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if mean_area(mid) < max_pixels else (lo, mid)
    return (*nominal(hi), 0.0)


def level_budget(max_pixels: int, factor: float, exponent: float) -> int:
    """Window area of a resolution level at ``factor`` of full size: ``max_pixels / factor^exponent`` (0 stays 0: whole
    images). Measured on the 800x600 benchmark scene (docs/experiments.md, Training, 2026-11-25 22:50): at the same
    training time, windows of the same 60K pixels at every level gave 29.35 dB, exponent 1 (whole images at 1/2,
    80K-pixel windows at 3/4) 30.04 dB, and windows shrinking with the level (a fixed share of the view) 28.90 dB: a
    coarse step's cost is mostly per Gaussian, not per pixel, so there more pixels per step are nearly free."""
    if not max_pixels or factor >= 1.0:
        return int(max_pixels)
    return int(round(max_pixels / factor ** exponent))


def patch_window(width: int, height: int, max_pixels: int,
                 rng: random.Random) -> tuple[int, int, int, int] | None:
    """A random training window ``(x0, y0, w, h)`` of ``max_pixels`` pixels ON AVERAGE, or None for the whole
    image (always when the image is small enough), drawn from ``rng`` (in training the run's own generator,
    :attr:`splatflow.train.rng.RunRNG.python`).

    Every pixel of the image is covered with the same probability (up to the ``PATCH_MIN_SIDE`` pixels at the
    very edge): a nominal window of the image's aspect ratio is placed anywhere it overlaps the image and clipped
    to it. Windows kept inside the image would cover a band a window deep along the border far less often than the
    centre (a corner pixel once per ~500 windows at 800x600): measured, the border band of the training views
    ended ~4 dB below their centre (docs/experiments.md, Training, 2026-11-23).
    """
    if not max_pixels or width * height <= max_pixels:
        return None
    pw, ph, p_whole = _patch_plan(int(width), int(height), int(max_pixels))
    if p_whole > 0.0 and rng.random() < p_whole:
        return None
    x0 = rng.randint(PATCH_MIN_SIDE - pw, width - PATCH_MIN_SIDE)
    y0 = rng.randint(PATCH_MIN_SIDE - ph, height - PATCH_MIN_SIDE)
    xa, ya = max(0, x0), max(0, y0)
    return xa, ya, min(width, x0 + pw) - xa, min(height, y0 + ph) - ya
