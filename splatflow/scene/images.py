"""Training targets per resolution level: decoded once, area-downsampled, cached within a memory budget.

Part of the scene package (not of training) because resolution, masks, pruning and evaluation read images the
same way; living here keeps those stages independent of the training code.

Decoding a JPEG costs more than a low-resolution training step, so every (view, level) is produced once:
the full-resolution undistorted image is decoded, resized with area averaging (``cv2.INTER_AREA``: each
output pixel is the mean of the input pixels it covers, the right low-pass filter for downsampling), and
kept as uint8 (4x smaller than float). The intrinsics are scaled by the same per-axis ratios, so the
downsampled camera sees exactly the downsampled image (COLMAP's continuous pixel convention: the image spans
``[0, W]``, so ``fx, cx`` scale by ``W'/W``).
"""

from __future__ import annotations

from collections import OrderedDict

import cv2
import numpy as np
import torch

from splatflow.scene.cameras import level_size, scale_intrinsics
from splatflow.scene.masks import read_view_mask
from splatflow.scene.resolution import read_view_rgb


class ImageCache:
    """Targets ``[H, W, 3]`` float32 in [0, 1] and scaled ``K`` per (view, factor), LRU within ``budget_mb``."""

    def __init__(self, views, budget_mb: int = 2048):
        self.views = list(views)
        self.budget_bytes = int(budget_mb) * 1024 * 1024
        self._cache: OrderedDict[tuple[int, float], np.ndarray] = OrderedDict()
        self._bytes = 0
        self.decodes = 0  # number of JPEG/PNG decodes (tests check images are decoded once per level)

    def _put(self, key, arr: np.ndarray) -> None:
        self._cache[key] = arr
        self._bytes += arr.nbytes
        while self._bytes > self.budget_bytes and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self._bytes -= old.nbytes

    def _get_u8(self, i: int, factor: float) -> np.ndarray:
        key = (i, float(factor))
        arr = self._cache.get(key)
        if arr is not None:
            self._cache.move_to_end(key)
            return arr
        v = self.views[i]
        full = self._cache.get((i, 1.0))
        if full is None:
            # the view's working size (area-downscaled on decode when base.resolution asks for less than the file)
            full = read_view_rgb(v)
            self.decodes += 1
        if factor == 1.0:
            arr = full
        else:
            w, h = level_size(v.width, v.height, factor)
            arr = cv2.resize(full, (w, h), interpolation=cv2.INTER_AREA)
        self._put(key, arr)
        return arr

    def shape(self, i: int, factor: float) -> tuple[int, int]:
        """``(width, height)`` of view ``i`` at ``factor``, without decoding anything (the size :meth:`get` returns
        for the whole level)."""
        v = self.views[i]
        return level_size(v.width, v.height, factor)

    def intrinsics(self, i: int, factor: float) -> np.ndarray:
        """``K [3, 3]`` of view ``i`` at ``factor`` (the whole level's, as :meth:`get` returns it)."""
        v = self.views[i]
        return scale_intrinsics(v.K, v.width, v.height, *self.shape(i, factor))

    def mask(self, i: int, factor: float, window: tuple[int, int, int, int] | None = None) -> torch.Tensor | None:
        """``[H, W]`` bool keep-mask of view ``i`` at ``factor`` (None: the view has no mask), or of ``window``
        ``(x0, y0, w, h)`` of it. A pixel of a smaller level is kept only when every working-size pixel it averages
        is (splatflow.scene.masks)."""
        if getattr(self.views[i], "mask_path", None) is None:
            return None
        key = (i, float(factor), "mask")
        arr = self._cache.get(key)
        if arr is None:
            base = self._cache.get((i, 1.0, "mask"))
            if base is None:
                base = read_view_mask(self.views[i]).astype(np.uint8)  # [H, W] 0/1
                self._put((i, 1.0, "mask"), base)
            arr = base
            if factor != 1.0:
                v = self.views[i]
                w, h = level_size(v.width, v.height, factor)
                arr = (cv2.resize(base.astype(np.float32), (w, h), interpolation=cv2.INTER_AREA) >= 0.999
                       ).astype(np.uint8)
                self._put(key, arr)
        else:
            self._cache.move_to_end(key)
        return torch.from_numpy(_crop(arr, window).astype(bool))

    def get(self, i: int, factor: float, device: torch.device | str = "cpu",
            window: tuple[int, int, int, int] | None = None) -> tuple[torch.Tensor, np.ndarray]:
        """``(image [H, W, 3] float32 in [0, 1] on device, K [3, 3])`` of view ``i`` at resolution ``factor``.

        The cache holds uint8 on the host; the upload to a GPU moves those bytes (4x fewer than float32) and
        converts there. With ``window = (x0, y0, w, h)`` (a training patch) only those pixels are converted and
        uploaded (``[h, w, 3]``), while ``K`` stays that of the whole level: the rasterizer's ``window`` renders
        that part of the whole view with the whole view's camera.
        """
        src = torch.from_numpy(_crop(self._get_u8(i, factor), window))
        if torch.device(device).type == "cuda":
            # from pinned memory (torch's caching host allocator) and asynchronous: a copy from pageable memory
            # waits until the GPU has run everything queued, so the host could not prepare the next step meanwhile
            src = src.contiguous().pin_memory().to(device, non_blocking=True)
        img = src.to(device).float().mul_(1.0 / 255.0)  # [H, W, 3] or [h, w, 3]
        return img, self.intrinsics(i, factor)


def _crop(arr: np.ndarray, window: tuple[int, int, int, int] | None) -> np.ndarray:
    """``arr [H, W, ...]`` cut to ``window (x0, y0, w, h)`` (a view, no copy); ValueError when it leaves the image."""
    if window is None:
        return arr
    x0, y0, w, h = (int(x) for x in window)
    H, W = arr.shape[:2]
    if not (0 <= x0 and 0 <= y0 and w > 0 and h > 0 and x0 + w <= W and y0 + h <= H):
        raise ValueError(f"window {window} (x0, y0, w, h) does not lie inside the {W}x{H} image")
    return arr[y0:y0 + h, x0:x0 + w]
