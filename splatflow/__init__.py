"""splatflow: reproducible 3D Gaussian Splatting reconstruction (CPU and CUDA).

numba and torch each bring an OpenMP runtime; with the default (active) wait policy their idle threads spin and
steal the other runtime's cores (DESIGN.md §3). The policy is read once, when the first runtime starts, so the
only place early enough to set a default is here, before either is imported. It only sets a default.
"""

import os as _os

_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
