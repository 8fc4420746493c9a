"""Process-wide defaults, set by ``import splatflow`` before numba or torch is imported (both read them once,
when they start):

* ``OMP_WAIT_POLICY=PASSIVE``: numba and torch each bring an OpenMP runtime; with the default (active) wait
  policy their idle threads spin and steal the other runtime's cores (docs/design.md §3).
* ``NUMBA_CACHE_DIR``: the compiled CPU kernels are cached in a folder named after a hash of the kernel sources
  (``splatflow/render/__pycache__/numba-<hash>``). numba checks a cached kernel only against its own file, and
  a checkout updated over an old cache was measured to fail compiling a changed kernel (an internal numba
  ``AssertionError: key already in dictionary``) until the old cache files were deleted; a new folder per
  version of the kernels avoids that. Both only set defaults: a value in the environment wins.
"""

import hashlib as _hashlib
import os as _os
from pathlib import Path as _Path

_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _kernel_cache_dir() -> str:
    render = _Path(__file__).resolve().parent / "render"
    h = _hashlib.sha1()
    for src in sorted(render.glob("*.py")):
        h.update(src.name.encode())
        h.update(src.read_bytes())
    return str(render / "__pycache__" / f"numba-{h.hexdigest()[:12]}")


if "NUMBA_CACHE_DIR" not in _os.environ:
    try:
        _os.environ["NUMBA_CACHE_DIR"] = _kernel_cache_dir()
    except OSError:  # an unreadable install: numba's own default cache location applies
        pass

