"""Thread hygiene for numba + torch in one process (docs/design.md §3).

numba's parallel loops and torch's intra-op pool each run on an OpenMP runtime. With the default *active* wait
policy an idle OpenMP thread spins for a while after each parallel region, so when the two runtimes take turns
(numba rasterizes, torch does the optimizer step) each one's spinning threads steal the cores the other needs.
The fix measured here: ``OMP_WAIT_POLICY=PASSIVE`` set before the first runtime starts (``splatflow/__init__.py``
sets it as a default, since the policy is read once), then start numba's thread pool, then (re-)set torch's thread
count, because starting the second runtime can reset the first one's notion of how many threads to use.
"""

from __future__ import annotations

import os

from ._kernels import touch_pool

_configured: int | None = None


def configure_threads(n: int | None = None) -> int:
    """Use ``n`` threads (default: all cores) in numba and torch without the two OpenMP pools fighting.

    Returns the thread count in effect. Safe to call more than once.
    """
    global _configured
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import numba
    import torch

    if n is None or n <= 0:
        n = os.cpu_count() or 1
    n_numba = max(1, min(int(n), numba.config.NUMBA_NUM_THREADS))
    numba.set_num_threads(n_numba)
    _start_numba_pool()
    torch.set_num_threads(int(n))
    keep_freed_memory()
    _configured = int(n)
    return _configured


#: glibc ``mallopt`` parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def keep_freed_memory(mmap_threshold_mb: int = 64, trim_threshold_mb: int = 256) -> bool:
    """Stop glibc from handing image-sized blocks back to the OS after every training step.

    A step allocates and frees the same few-MB tensors (renders, targets, gradients) every time. glibc serves
    blocks above its mmap threshold with fresh ``mmap`` calls and unmaps them on free, so each step page-faults
    its buffers in again: 170-1,700 faults and 1-4 ms of system CPU per step at 490x273 (bench/train_step.py
    prints both). Serving blocks up to ``mmap_threshold_mb`` from the heap and keeping up to ``trim_threshold_mb``
    of freed heap took the step from 23.0-23.7 to 21.0-21.2 ms and the faults to ~60 (docs/experiments.md). The
    same as setting ``MALLOC_MMAP_THRESHOLD_``/``MALLOC_TRIM_THRESHOLD_`` before the process starts; a no-op
    (returns False) where the C library is not glibc.
    """
    import ctypes
    import ctypes.util
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold_mb) << 20)
        ok &= libc.mallopt(_M_TRIM_THRESHOLD, int(trim_threshold_mb) << 20)
    except (OSError, AttributeError):
        return False
    return bool(ok)


def _start_numba_pool() -> None:
    """Run a trivial parallel kernel so numba's threading layer is loaded now, not mid-training."""
    import numpy as np

    touch_pool(np.zeros(64, dtype=np.float32))
