"""Benchmark: what Mip-Splatting's 3D smoothing filter (``train.filter_3d``) costs a CPU training run.

Three figures, each in wall time and in process CPU time (all threads; on a shared machine the steadier of the two):

1. one recompute of the filter (:func:`splatflow.gaussians.smoothing.filter_3d`, done at the start and after each
   densification event) for ``--gaussians`` Gaussians in a box seen by ``--cameras`` cameras on a ring at 800x600;
2. what the filter adds to every step, for ``--gaussians`` rows (an upper bound: the sparse step filters only its
   candidate rows): :func:`~splatflow.gaussians.smoothing.smoothed` forward and backward, and the filtered log
   scales of the sparse step's candidate bound;
3. with ``--steps N`` (0: skipped), a short training run on a small synthetic room (10 views at ``--size``, its
   true cameras and points: tests/_tiny.py's generator) with the filter off and on, same seed and settings:
   seconds per step, steps including the refine events and their recomputes; and the test views' PSNR of each.

    python bench/filter_3d.py [--threads 2] [--gaussians 120000] [--cameras 31] [--steps 300] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("SPLATFLOW_TRACKING", "off")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import splatflow  # noqa: E402,F401  (first: its process defaults for OpenMP and numba's cache)
import numpy as np  # noqa: E402
import torch  # noqa: E402


def timed(fn, repeats: int = 3) -> tuple[float, float]:
    """Best wall and best CPU seconds of ``fn()`` over ``repeats`` calls."""
    wall, cpu = [], []
    for _ in range(repeats):
        w, c = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - w)
        cpu.append(time.process_time() - c)
    return min(wall), min(cpu)


def ring_cameras(n: int, radius: float = 4.0, width: int = 800, height: int = 600):
    """``n`` cameras on a horizontal ring looking at the origin: (viewmats [n, 4, 4], Ks [n, 3, 3])."""
    vms = []
    for i in range(n):
        a = 2 * math.pi * i / n
        c = np.array([radius * math.cos(a), 0.0, radius * math.sin(a)])
        fwd = -c / np.linalg.norm(c)
        right = np.cross(np.array([0.0, 1.0, 0.0]), fwd)
        right /= np.linalg.norm(right)
        down = np.cross(fwd, right)
        R = np.stack([right, down, fwd])  # world -> camera rows
        vm = np.eye(4)
        vm[:3, :3], vm[:3, 3] = R, -R @ c
        vms.append(vm)
    f = 0.5 * width / math.tan(math.radians(65) / 2)
    K = np.array([[f, 0, width / 2], [0, f, height / 2], [0, 0, 1]])
    return torch.as_tensor(np.stack(vms), dtype=torch.float32), torch.as_tensor(np.stack([K] * n),
                                                                                 dtype=torch.float32)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gaussians", type=int, default=120_000)
    ap.add_argument("--cameras", type=int, default=31)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--size", default="320x240", help="the room's image size, WxH")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    from splatflow.gaussians.smoothing import filter_3d, smoothed
    from splatflow.render import configure_threads
    from splatflow.scene.dataset import load_scene
    from splatflow.train import train
    from tests._tiny import mean_view_psnr, tiny_train_cfg, write_tiny_scene

    configure_threads(args.threads)
    out: dict = {"load_average_before": os.getloadavg()[0]}
    g = torch.Generator().manual_seed(0)
    means = (torch.rand(args.gaussians, 3, generator=g) - 0.5) * 3.0  # [N, 3] inside the ring
    vms, Ks = ring_cameras(args.cameras)
    wall, cpu = timed(lambda: filter_3d(means, vms, Ks, [800] * args.cameras, [600] * args.cameras))
    out["recompute"] = {"gaussians": args.gaussians, "cameras": args.cameras, "wall_s": round(wall, 4),
                        "cpu_s": round(cpu, 4)}
    print(f"filter recompute: {args.gaussians:,} Gaussians x {args.cameras} cameras: {wall * 1e3:.1f} ms wall, "
          f"{cpu * 1e3:.1f} ms CPU", flush=True)

    filt = filter_3d(means, vms, Ks, [800] * args.cameras, [600] * args.cameras)
    log_s = (torch.randn(args.gaussians, 3, generator=g) - 4.0).requires_grad_(True)
    logit = torch.randn(args.gaussians, generator=g).requires_grad_(True)

    def per_step():
        eff, o = smoothed(torch.exp(log_s), torch.sigmoid(logit), filt)
        (eff.sum() + o.sum()).backward()  # what autograd adds to a step: the filter's share of the backward
        with torch.no_grad():  # the sparse step's candidate bound on the filtered scales
            log_s + 0.5 * torch.log1p((filt * filt)[:, None] * torch.exp(-2.0 * log_s))

    def plain():
        (torch.exp(log_s).sum() + torch.sigmoid(logit).sum()).backward()

    (w1, c1), (w0, c0) = timed(per_step, 5), timed(plain, 5)
    out["per_step"] = {"rows": args.gaussians, "filtered_wall_ms": round(w1 * 1e3, 3),
                       "filtered_cpu_ms": round(c1 * 1e3, 3), "plain_wall_ms": round(w0 * 1e3, 3),
                       "plain_cpu_ms": round(c0 * 1e3, 3)}
    print(f"per step on {args.gaussians:,} rows: activations with the filter {w1 * 1e3:.2f} ms wall / {c1 * 1e3:.2f} "
          f"ms CPU, without {w0 * 1e3:.2f} / {c0 * 1e3:.2f}", flush=True)
    if args.steps <= 0:
        out["load_average_after"] = os.getloadavg()[0]
        if args.json:
            args.json.write_text(json.dumps(out, indent=1))
        return out

    w, h = (int(x) for x in args.size.split("x"))
    with tempfile.TemporaryDirectory() as d:
        write_tiny_scene(Path(d), width=w, height=h)
        scene = load_scene(Path(d), Path(d) / "split.json")
        cfg = tiny_train_cfg(args.steps)
        cfg = replace(cfg, early_stop=replace(cfg.early_stop, enabled=False))
        train(scene, replace(cfg, max_steps=20))  # warm-up: kernels loaded, caches filled
        for name, on in (("off", False), ("on", True)):
            c0 = time.process_time()
            res = train(scene, replace(cfg, filter_3d=on), seed=0)
            cpu_s = time.process_time() - c0
            psnr = mean_view_psnr(res.splats, scene.test_views, res.sh_degree)
            out[name] = {"steps": res.steps, "gaussians": res.splats.n, "train_s": round(res.train_seconds, 3),
                         "ms_per_step": round(1e3 * res.train_seconds / res.steps, 2),
                         "cpu_ms_per_step": round(1e3 * cpu_s / res.steps, 2), "test_psnr": round(psnr, 3),
                         "refine_events": len(res.events)}
            print(f"filter {name}: {out[name]}", flush=True)
    out["ratio_on_off_wall"] = round(out["on"]["ms_per_step"] / out["off"]["ms_per_step"], 3)
    out["ratio_on_off_cpu"] = round(out["on"]["cpu_ms_per_step"] / out["off"]["cpu_ms_per_step"], 3)
    out["load_average_after"] = os.getloadavg()[0]
    print(f"on / off per step: {out['ratio_on_off_wall']:.3f} wall, {out['ratio_on_off_cpu']:.3f} CPU; load average "
          f"{out['load_average_before']:.2f} -> {out['load_average_after']:.2f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
