"""The CPU training kernels compiled in helper processes, on two cores at once, the first time a checkout trains.

numba compiles a kernel at its first call, in the calling process, one kernel after another. The first CPU
training run after an install or a kernel change compiled for 83 s on one core while the other core idled:
that was 40 % of the demo's first run (bench/RESULTS.md, session 13). When numba's cache lacks the training
kernels, :func:`precompile` has two helper processes compile them into the cache at once:
- one compiles the loss kernels (SSIM with the training blur inside, and the transposed blur of its backward: the
  longest part);
- the other compiles the projection, the rasterizer and the sparse step's kernels.
The two halves take about a minute each on the 2-core development VM. With one thread, one helper compiles both.
The training process then loads every kernel from the cache, as every later run does. That matters for more than
time: the rasterizer's backward compiled in the training process computed slightly different gradients from the
same kernel loaded from the cache (after 20 demo steps, 3e-3 apart in a quaternion; after the demo's 2000 steps,
26.22 against 26.11 dB, bench/RESULTS.md session 14), so a first run and its reruns differed. Compiled in a
helper, a first run is a rerun.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

# kernel names as numba's cache index files start (``<module>.<function>-<line>.py311.nbi``), in the folder
# splatflow.render._numba_cache files splatflow's kernels under
_CACHE_SUBFOLDER = "splatflow_render"
LOSS_KERNELS = ("_filter_kernels.ssim_fused", "_filter_kernels.separable_filter")
STEP_KERNELS = ("_proj_kernels.project_fwd", "_proj_kernels.project_bwd", "_kernels.rasterize_fwd",
                "_kernels.rasterize_bwd_rgb", "_sparse_kernels.window_candidates", "_sparse_kernels.adam_rows")


def cached(names: tuple[str, ...], cache_dir: str | os.PathLike | None = None) -> bool:
    """Whether numba's cache holds every kernel in ``names`` (for some signature). Without a ``NUMBA_CACHE_DIR``
    (numba's default location, beside the sources) it answers True: nothing is precompiled then."""
    d = cache_dir if cache_dir is not None else os.environ.get("NUMBA_CACHE_DIR")
    if not d:
        return True
    folder = Path(d) / _CACHE_SUBFOLDER
    return all(any(folder.glob(f"{name}-*.nbi")) for name in names)


def compile_loss_kernels() -> None:
    """Compile the training loss's kernels, as a training step calls them: L1 and SSIM of the [H, W, 3] render and
    target views, with the training blur and without, and the gradient back to the render."""
    import torch

    from splatflow.render.ssim import l1_ssim

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

    from splatflow.model import SPLAT_KEYS, Splats
    from splatflow.render import rasterize, removal_loss
    from splatflow.render._kernels import touch_pool
    from splatflow.train.sparse import SparseAdam, candidates

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
    """Compile the CPU training kernels in helper processes when numba's cache lacks them (see the module
    docstring): two at once with ``threads >= 2``, else one; return the seconds it took, or None when there was
    nothing to do (cached, or no ``NUMBA_CACHE_DIR``: numba's own default cache is left to numba)."""
    if cached(LOSS_KERNELS) and cached(STEP_KERNELS):
        return None
    t0 = time.perf_counter()
    where = "on two cores" if threads >= 2 else "in a helper process"
    print(f"compiling the CPU kernels {where} (once after an install or a kernel change; about a minute, then they "
          "load from numba's cache in seconds)", file=sys.stderr, flush=True)
    import splatflow

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
    finally:
        for h in helpers:
            if h.poll() is None:  # this process failed or was stopped: the helpers' work is no longer wanted
                h.kill()
                h.wait()
    return time.perf_counter() - t0
