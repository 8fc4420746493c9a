"""Test PSNR against training steps for train-setting variants (*arms*) on one real scene, on any backend.

Each arm trains the same scene from nothing with ``params.yaml``'s ``train`` section plus its own ``--set``
overrides, and is evaluated on the test views (every 8th name-sorted view, the standard hold-out) at
``--points`` step counts spaced geometrically up to ``--max-steps``. The table gives PSNR/SSIM at equal steps and
the training seconds of each point (evaluations left out).

Equal steps is the measure that carries over to a GPU: there a step's time depends little on the image size or
the schedule (the step is launch-bound at these sizes: bench/RESULTS.md "GPU path"), so the arm that is ahead at
equal steps on the CPU is ahead at equal time on the GPU. ``--set patch_max_pixels=0`` trains whole images, as a
GPU run does.

    python bench/curve.py --scene data/bonsai/undistorted --max-steps 3000 \\
        --common patch_max_pixels=0 --common densify.max_gaussians=300000 \\
        --arm base= --arm whole="resolution=[{factor: 1.0, start_fraction: 0.0}];blur.sigma_start_px=0"
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("SPLATFLOW_TRACKING", "off")

import splatflow  # noqa: E402,F401  (first: its process defaults for OpenMP and numba's cache)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scene", type=Path, required=True, help="an undistorted COLMAP folder (data/S/undistorted)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/splatflow_curve"))
    ap.add_argument("--max-steps", type=int, default=3000)
    ap.add_argument("--points", type=int, default=6)
    ap.add_argument("--stop-after", type=int, default=None, help="end each arm after this many steps (the start "
                    "of a longer run: its schedules still span --max-steps)")
    ap.add_argument("--max-side", type=int, default=None, help="longest image side, px (default: the scene's)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--backend", default="auto", help="train.backend for every arm")
    ap.add_argument("--common", action="append", default=[], help="KEY=VALUE override for every arm")
    ap.add_argument("--arm", action="append", required=True,
                    help="NAME=KEY=VALUE;KEY=VALUE... (NAME= alone: the common settings)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)

    import torch

    from bench.gpu import CurveRecorder, curve_steps, load_bench_scene
    from bench.train_demo import train_config
    from splatflow.pipeline.errors import UserError
    from splatflow.render import configure_threads
    from splatflow.train import Trainer

    if not (a.scene / "images").is_dir():
        raise SystemExit(f"--scene {a.scene}: no images/ folder; pass an undistorted COLMAP folder")
    arms = []
    for spec in a.arm:
        name, _, rest = spec.partition("=")
        arms.append((name, [s for s in rest.split(";") if s]))
    configure_threads(a.threads)
    a.work.mkdir(parents=True, exist_ok=True)
    scene, info = load_bench_scene(a.scene, a.work, a.threads, a.max_side)
    print(f"{a.scene}: {len(scene.train_views)} train / {len(scene.test_views)} test views at "
          f"{', '.join(info['sizes'])}; {a.max_steps} steps per arm", flush=True)
    at = [n for n in curve_steps(a.max_steps, a.points) if a.stop_after is None or n < a.stop_after]
    if a.stop_after is not None:
        at = sorted(set(at + [a.stop_after]))
    results = {}
    for name, sets in arms:
        try:
            cfg = train_config(a.max_steps, list(a.common) + sets)
        except (UserError, KeyError, ValueError) as e:
            raise SystemExit(f"--arm {name}: {e}") from None
        cfg = replace(cfg, backend=a.backend, resume=False, progress=False,
                      early_stop=replace(cfg.early_stop, enabled=False))
        torch.manual_seed(0)
        tr = Trainer(scene, cfg, ckpt_path=a.work / f"{name}.pt", seed=0, stop_after=a.stop_after)
        (a.work / f"{name}.pt").unlink(missing_ok=True)
        rec = CurveRecorder(tr, scene.test_views, at)
        tr.run()
        results[name] = {"sets": sets, "curve": rec.points}
        print(f"{name}: " + "  ".join(f"{p['step']}: {p['psnr']:.2f} dB/{p['ssim']:.3f} ({p['seconds']:.0f} s, "
                                      f"{p['gaussians']})" for p in rec.points), flush=True)
    print("\ntest PSNR dB/SSIM at equal steps\nstep   " + "  ".join(f"{n:>14}" for n, _ in arms))
    for i, step in enumerate(at):
        row = []
        for n, _ in arms:
            pts = results[n]["curve"]
            row.append(f"{pts[i]['psnr']:.2f}/{pts[i]['ssim']:.3f}" if i < len(pts) else "-")
        print(f"{step:<6} " + "  ".join(f"{r:>14}" for r in row))
    if a.json:
        a.json.write_text(json.dumps({"scene": str(a.scene), "max_steps": a.max_steps, "common": a.common,
                                      "arms": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
