"""Whether splatflow's Triton kernels (:mod:`splatflow.render.ssim_triton`, :mod:`splatflow.train.multi_adam`)
may run on a device, and Triton itself (None where it is not installed).

Triton ships with torch's CUDA builds; CPU installs get it from the test extras, for its interpreter."""

from __future__ import annotations

import os

import torch

try:  # Triton ships with torch's CUDA builds; CPU-only installs lack it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None


def enabled(device: torch.device) -> bool:
    """Triton importable, and a CUDA device (or any device under ``TRITON_INTERPRET=1``, Triton's CPU
    interpreter: tests). On CUDA only with ``SPLATFLOW_TRITON=1`` for now: the compiled kernels have not run on a
    GPU yet (``bench/gpu_check.sh`` sets it)."""
    if triton is None:
        return False
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    return device.type == "cuda" and os.environ.get("SPLATFLOW_TRITON") == "1"
