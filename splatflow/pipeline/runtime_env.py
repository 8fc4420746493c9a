"""Process-wide defaults, set by ``import splatflow`` before numba or torch is imported (both read them once,
when they start):

* ``OMP_WAIT_POLICY=PASSIVE``: numba and torch each bring an OpenMP runtime; with the default (active) wait
  policy their idle threads spin and steal the other runtime's cores (docs/design.md §3).
* ``GOMP_SPINCOUNT=20000``: with the passive policy alone, libgomp puts a thread to sleep the moment its parallel
  region ends, and waking it for the next region costs about 50 us. A training step runs dozens of short
  regions. With a short spin (20,000 polls, tens of microseconds) before sleeping, the 36-view benchmark run
  trained 9-10 % faster on 2 cores with the identical model, for 4-5 % more CPU time (docs/experiments.md,
  Training, 2026-11-26 14:16). The spin is short enough that a runtime which is not working sleeps, as the
  passive policy wants.
* ``NUMBA_CACHE_DIR``: the compiled CPU kernels are cached in a folder named after a hash of the kernel sources
  (``splatflow/render/__pycache__/numba-<hash>``). numba checks a cached kernel only against its own file, and
  a checkout updated over an old cache was measured to fail compiling a changed kernel (an internal numba
  ``AssertionError: key already in dictionary``) until the old cache files were deleted; a new folder per
  version of the kernels avoids that. Workspace copies of DVC experiments use their repo's folder, and inside it
  :mod:`splatflow.render._numba_cache` files the kernels under one name whatever path they were imported from.
  Both only set defaults: a value in the environment wins.
"""

import hashlib as _hashlib
import os as _os
import resource as _resource
from pathlib import Path as _Path

from splatflow.pipeline.paths import experiment_origin

_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
_os.environ.setdefault("GOMP_SPINCOUNT", "20000")


def _kernel_cache_dir(render: _Path | None = None) -> str:
    """``render/__pycache__/numba-<hash of the kernel sources>`` of this checkout; for a copy of the workspace that
    ``dvc exp run --temp`` or the experiment queue makes in ``<repo>/.dvc/tmp/exps/``, the folder of the repo it
    was copied from, so each experiment loads the kernels compiled before instead of compiling them again."""
    render = render or _Path(__file__).resolve().parents[1] / "render"
    h = _hashlib.sha1()
    for src in sorted(render.glob("*.py")):
        h.update(src.name.encode())
        h.update(src.read_bytes())

    origin = experiment_origin(render)
    home = origin / "splatflow" / "render" if origin is not None else render
    if not home.is_dir():  # a copy whose repo has no splatflow/ of its own: the copy's folder
        home = render
    return str(home / "__pycache__" / f"numba-{h.hexdigest()[:12]}")


if "NUMBA_CACHE_DIR" not in _os.environ:
    try:
        _os.environ["NUMBA_CACHE_DIR"] = _kernel_cache_dir()
    except OSError:  # an unreadable install: numba's own default cache location applies
        pass


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, in MiB (Linux reports ``ru_maxrss`` in KiB): the host memory
    every stage's metrics report (``peak_rss_mb``)."""
    return _resource.getrusage(_resource.RUSAGE_SELF).ru_maxrss / 1024.0
