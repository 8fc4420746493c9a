"""The CPU training kernels compiled in helper processes, on two cores at once, the first time a checkout trains.

numba compiles a kernel at its first call, in the calling process, one kernel after another. The first CPU
training run after an install or a kernel change compiled for 83 s on one core while the other core idled:
that was 40 % of the demo's first run (docs/experiments.md, The demo from a fresh clone, 2026-11-26 15:04).
Until it has done so once for a cache folder and a kind of machine (its marker file, :func:`cached`),
:func:`precompile` has two helper processes compile them into the cache at once:
- one compiles the loss kernels (SSIM with the training blur inside, and the transposed blur of its backward: the
  longest part);
- the other compiles the projection, the rasterizer and the sparse step's kernels.
The two halves take about a minute each on the 2-core development VM. With one thread, one helper compiles both.
The training process then loads every kernel from the cache, as every later run does. That matters for more than
time: the rasterizer's backward compiled in the training process computed slightly different gradients from the
same kernel loaded from the cache (after 20 demo steps, 3e-3 apart in a quaternion; after the demo's 2000 steps,
26.22 against 26.11 dB; docs/experiments.md, The demo from a fresh clone, 2026-11-26 17:05), so a first run and
its reruns differed. Compiled in a helper, a first run is a rerun. tests/test_precompile.py checks it: a training
run after precompile (windows, the blur, the removal-cost cuts) finds every variant it calls in the cache (numba's
own cache-miss counts).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import splatflow
from splatflow.gaussians.model import SPLAT_KEYS, Splats
from splatflow.render import rasterize, removal_loss
from splatflow.render._kernels import touch_pool
from splatflow.render.ssim import l1_ssim
from splatflow.train.sparse import SparseAdam, candidates

# the folder splatflow.render._numba_cache files splatflow's kernels under, inside NUMBA_CACHE_DIR
_CACHE_SUBFOLDER = "splatflow_render"


def _target_tag() -> str:
    """A short digest of the code target numba compiles for (triple, CPU name, CPU features): numba keys its cache
    entries by it, so a cache folder shared by two kinds of machine holds one set of kernels per kind."""
    try:
        from numba.core.registry import cpu_target

        target = repr(cpu_target.target_context.codegen().magic_tuple())
    except Exception:  # pragma: no cover - numba internals moved; one tag for every machine
        target = "any"
    return hashlib.sha1(target.encode()).hexdigest()[:12]


def marker(cache_dir: str | os.PathLike) -> Path:
    """The file :func:`precompile` writes into ``cache_dir`` once its helpers have compiled every variant a CPU
    training run calls, for this machine's code target."""
    return Path(cache_dir) / _CACHE_SUBFOLDER / f"precompiled-{_target_tag()}"


def cached(cache_dir: str | os.PathLike | None = None) -> bool:
    """Whether :func:`precompile` has already filled numba's cache for this machine. Kernel names alone would not
    tell: a bench script or a test may have cached the training variant of a kernel but not the removal-cost
    variant that ``train.prune_during`` calls, which the training process would then compile itself (and a first
    run would differ from its reruns after the first cut). Without a ``NUMBA_CACHE_DIR`` (numba's default
    location, beside the sources) it answers True: nothing is precompiled then."""
    d = cache_dir if cache_dir is not None else os.environ.get("NUMBA_CACHE_DIR")
    if not d:
        return True
    return marker(d).is_file()


def compile_loss_kernels() -> None:
    """Compile the training loss's kernels, as a training step calls them: L1 and SSIM of the [H, W, 3] render and
    target views, with the training blur and without, and the gradient back to the render."""
    import torch

    x = torch.rand(20, 24, 3, device="cpu", requires_grad=True)  # [H, W, 3] like a render
    y = torch.rand(20, 24, 3, device="cpu")
    for sigma in (2.0, 0.0):
        l1, s = l1_ssim(x.permute(2, 0, 1)[None], y.permute(2, 0, 1)[None], blur_sigma=sigma)
        (l1 + s).backward()


def compile_step_kernels() -> None:
    """Compile the rest of a CPU training run's kernels, called as :meth:`Trainer.render` and the sparse step
    call them: the candidate bound, projection and rasterizer forward and backward (RGB, a window), the sparse
    step's Adam and its catch-up; and the removal cost ``train.prune_during`` scores its cuts with. A demo run
    compiled nothing more after these (its numba cache folder listed before and after)."""
    import numpy as np
    import torch

    n = 64
    g = torch.Generator(device="cpu").manual_seed(0)
    shapes = {"means": (n, 3), "quats": (n, 4), "scales": (n, 3), "opacities": (n,), "sh0": (n, 1, 3),
              "shN": (n, 15, 3)}
    # device="cpu" throughout: a caller may have set another default device (the tests set "meta")
    params = {k: torch.nn.Parameter(torch.randn(*shapes[k], generator=g, device="cpu") * 0.1)
              for k in SPLAT_KEYS}
    with torch.no_grad():
        params["means"][:, 2] += 3.0
        params["scales"] -= 2.5
    optimizers = {k: torch.optim.Adam([p], lr=1e-3, eps=1e-15) for k, p in params.items()}
    view = torch.eye(4, device="cpu")
    K = torch.tensor([[40.0, 0.0, 16.0], [0.0, 40.0, 16.0], [0.0, 0.0, 1.0]], device="cpu")
    win = (0, 0, 24, 16)
    rows = candidates(params, view, K, 32, 32, win)
    leaves = {k: params[k].detach().index_select(0, rows).requires_grad_(True) for k in SPLAT_KEYS}
    a = Splats.of(leaves).activated(3, sh_pair=True)
    rgb, _, _ = rasterize(a.means, a.quats, a.scales, a.opacities, a.colors, view[None], K[None], 32, 32,
                          sh_degree=3, backend="cpu", window=win)
    rgb.sum().backward()
    adam = SparseAdam(params, optimizers)
    adam.step(params, optimizers, rows, {k: leaves[k].grad for k in SPLAT_KEYS})
    adam.flush(params, optimizers)
    # train.prune_during's removal cost (the rasterizer's backward with its removal columns), and numba's thread pool
    with torch.no_grad():
        removal_loss(a.means, a.quats, a.scales, a.opacities, a.colors, view[None], K[None], 32, 32, sh_degree=3,
                     target=torch.zeros(1, 32, 32, 3, device="cpu"))
    touch_pool(np.zeros(64, dtype=np.float32))


def _helper(env: dict, *functions: str) -> subprocess.Popen:
    """A process that runs this module's ``functions`` (compiling their kernels into numba's cache)."""
    calls = "; ".join(f"{f}()" for f in functions)
    code = f"from splatflow.train.precompile import {', '.join(functions)}; {calls}"
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL, env=env)


def precompile(threads: int) -> float | None:
    """Compile the CPU training kernels in helper processes unless they have done so already for this cache
    and machine (see the module docstring): two at once with ``threads >= 2``, else one (a helper loads what is
    cached and compiles the rest: seconds on a cache that lacks a variant or two); return the seconds it took, or
    None when there was nothing to do (:func:`cached`, or no ``NUMBA_CACHE_DIR``: numba's own default cache is
    left to numba)."""
    if cached():
        return None
    t0 = time.perf_counter()
    where = "on two cores" if threads >= 2 else "in a helper process"
    print(f"compiling the CPU kernels {where} (once after an install or a kernel change; about a minute, then they "
          "load from numba's cache in seconds)", file=sys.stderr, flush=True)

    # the same splatflow as this process (a bench run from another checkout puts its own first on sys.path), and
    # its numba cache folder (NUMBA_CACHE_DIR, set in os.environ by `import splatflow`)
    root = str(Path(splatflow.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    jobs = [("compile_loss_kernels",), ("compile_step_kernels",)] if threads >= 2 else \
        [("compile_loss_kernels", "compile_step_kernels")]
    helpers = []
    try:
        for job in jobs:
            helpers.append(_helper(env, *job))
        failed = [" + ".join(job) for job, h in zip(jobs, helpers) if h.wait() != 0]
        if failed:  # the training step compiles what is missing itself, and raises numba's own error if it fails
            print(f"precompile: {', '.join(failed)} failed (its error is above); the training step compiles the "
                  "kernels itself", file=sys.stderr, flush=True)
        else:  # every variant is in the cache: later runs skip this
            m = marker(os.environ["NUMBA_CACHE_DIR"])
            m.parent.mkdir(parents=True, exist_ok=True)
            m.write_text("written by splatflow.train.precompile after its helpers compiled the training kernels\n")
    finally:
        for h in helpers:
            if h.poll() is None:  # this process failed or was stopped: the helpers' work is no longer wanted
                h.kill()
                h.wait()
    return time.perf_counter() - t0


def before_training(backend: str) -> float | None:
    """:func:`precompile` with numba's thread count before a run on the CPU backend (a first run after an install
    or a kernel change); None for a run on a GPU, whose kernels are gsplat's (compiled on their first use)."""
    if backend != "cpu":
        return None
    import numba

    return precompile(numba.get_num_threads())
