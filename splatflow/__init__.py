"""splatflow: reproducible 3D Gaussian Splatting reconstruction (CPU and CUDA).

The first import sets the process defaults numba and torch read when they start (:mod:`splatflow.pipeline.runtime_env`).
"""

from splatflow.pipeline import runtime_env as _runtime_env  # noqa: F401  (must run before numba or torch is imported)

__version__ = "0.1.0"
