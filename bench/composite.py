"""Benchmark: the CPU compositing kernels alone, float64 against float32 lanes, on whole views of a real model.

The training kernels (``render/_kernels.rasterize_fwd`` and ``rasterize_bwd_rgb``) keep their per-pixel state in a
float type they are given (the model's: float32 in training; float64 for the exactness tests). This script loads a
checkpoint that ``bench/train_demo.py`` wrote in ``--work`` (its 800x600 scene), projects one training view at the
resolution ``--factor`` of full size, bins its tiles once, and times the forward and the RGB backward on those same
tiles with both float types, alternated ``--rounds`` times in one process, so the ratio holds on whatever machine
runs it. It also prints how far the float32 image is from the float64 one.

    python bench/composite.py --checkpoint WORK/run.pt --work WORK [--factor 1.0] [--view 3] [--repeats 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("SPLATFLOW_TRACKING", "off")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout this script is in, not whichever one is installed

import splatflow  # noqa: E402,F401  (first: its process defaults for OpenMP and numba's cache)
import numpy as np  # noqa: E402
import torch  # noqa: E402


def binned_view(work: Path, ckpt: Path, view: int, factor: float):
    """The binned tiles of one training view of the checkpoint's model (the kernels' inputs) and its size."""
    from splatflow.render import cpu
    from splatflow.render.projection import tile_grid
    from train_step import trainer_from_checkpoint  # bench/ is this script's folder, first on sys.path

    tr = trainer_from_checkpoint(work, ckpt)
    w, h = tr.cache.shape(view, factor)
    _, K = tr.cache.get(view, factor)
    a = tr.state.splats().activated(3, sh_pair=True)
    with torch.no_grad():
        p = cpu.project_cpu(a.means, a.quats, a.scales, a.opacities, a.colors, tr.viewmats[view][None],
                            torch.as_tensor(K, dtype=torch.float32)[None], w, h, near_plane=0.01, far_plane=1e10,
                            eps2d=0.3, antialiased=False, radius_clip=0.0, sh_degree=3)
    tx, ty = tile_grid(w, h)
    arrays = cpu._binned(p["means2d"], p["conics"], p["colors"], p["opacities"], p["radii"], p["depths"], None,
                         tx, ty)
    return arrays, w, h, tx, ty, int(a.means.shape[0])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", type=Path, required=True, help="a checkpoint bench/train_demo.py wrote")
    ap.add_argument("--work", type=Path, required=True, help="bench/train_demo.py's work folder (scene and split)")
    ap.add_argument("--factor", type=float, default=1.0, help="resolution factor of the view (1.0: 800x600)")
    ap.add_argument("--view", type=int, default=3, help="training view index")
    ap.add_argument("--repeats", type=int, default=10, help="timed calls per kernel and float type per round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    from splatflow.render import _kernels as K
    from splatflow.render import configure_threads

    configure_threads(args.threads)
    (offsets, ids, m2, con, col, op, rad, bg), w, h, tx, ty, n = binned_view(args.work, args.checkpoint, args.view,
                                                                             args.factor)
    n_par = args.threads
    grad = np.random.default_rng(0).standard_normal((1, h, w, 3)).astype(np.float32)
    grad_alpha = np.zeros((1, h, w), np.float32)

    def fwd(F):
        return K.rasterize_fwd(offsets, ids, m2, con, col, op, rad, bg, 1, w, h, tx, ty, False, n_par, F)

    def bwd(F, out):
        return K.rasterize_bwd_rgb(offsets, ids, m2, con, col, op, rad, bg, out[1], out[2], grad, grad_alpha, 1, w, h,
                                   tx, ty, n_par, F, None)

    types = (np.float64, np.float32)
    outs = {F: fwd(F) for F in types}  # compiles both, and the images to compare
    for F in types:
        bwd(F, outs[F])
    times = {(F, part): [] for F in types for part in ("fwd", "bwd")}
    for _ in range(args.rounds):
        for F in types:
            for _ in range(args.repeats):
                t = time.perf_counter()
                out = fwd(F)
                t1 = time.perf_counter()
                bwd(F, out)
                t2 = time.perf_counter()
                times[(F, "fwd")].append(t1 - t)
                times[(F, "bwd")].append(t2 - t1)
    print(f"{args.checkpoint.name}: {n} Gaussians, view {args.view} at {w}x{h}, {len(ids)} tile-list entries, "
          f"{args.threads} threads")
    for part in ("fwd", "bwd"):
        a, b = (1e3 * statistics.median(times[(F, part)]) for F in types)
        print(f"  {part}: float64 lanes {a:.1f} ms, float32 lanes {b:.1f} ms (median of {args.rounds * args.repeats}): "
              f"{a / b:.2f}x")
    diff = float(np.abs(outs[np.float32][0].astype(np.float64) - outs[np.float64][0]).max())
    same_last = float((outs[np.float32][2] == outs[np.float64][2]).mean())
    print(f"  float32 image within {diff:.1e} of float64; last contributor equal at {100 * same_last:.3f} % of pixels")
    return 0


if __name__ == "__main__":
    sys.exit(main())
