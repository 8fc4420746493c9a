"""Image files decoded to RGB: the lowest layer of the scene package's readers.

:mod:`splatflow.scene.resolution` and :mod:`splatflow.scene.images` build on it, so it imports neither.
"""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np

from splatflow.pipeline.errors import UserError

# Still-image files a capture folder may hold (ingest reads them; a video source must not be one of them)
IMAGE_FILE_SUFFIXES = {".jpg", ".jpeg", ".png", ".tif", ".tiff", ".bmp", ".webp", ".heic", ".heif"}


def read_rgb(path: str | Path) -> np.ndarray:
    """``[H, W, 3]`` uint8 RGB; UserError naming the file if it cannot be decoded."""
    img = cv2.imread(str(path), cv2.IMREAD_COLOR)
    if img is None:
        raise UserError(f"{path}: cannot read this training image; check the file exists and is a valid "
                        "image, then rerun the sfm stage (it writes data/<scene>/undistorted/images)")
    return cv2.cvtColor(img, cv2.COLOR_BGR2RGB)
