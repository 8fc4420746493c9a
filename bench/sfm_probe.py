"""Measure a short training probe on a project's SfM model: per-view PSNR of training and held-out views.

    python bench/sfm_probe.py PROJECT SCENE [--steps 600] [--factor 0.25] [--json out.json]

PROJECT is a splatflow project whose sfm and split stages ran (data/S/undistorted, data/S/split.json). The probe
trains ``--steps`` steps at ``--factor`` x the working size on the training views and renders every training and
test view at that size; it prints the PSNR distributions. It measures how well a model trains, to compare SfM
models of the same photos (docs/experiments.md, "SfM fitness").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("project")
    ap.add_argument("scene")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--factor", type=float, default=0.25)
    ap.add_argument("--budget", type=int, default=30_000)
    ap.add_argument("--json")
    a = ap.parse_args()

    from splatflow.compress.prune import CachedImages
    from splatflow.compress.scoring import cameras_at
    from splatflow.evaluation.metrics import psnr
    from splatflow.gaussians.model import render_view
    from splatflow.pipeline.config import ResolutionPhase, load_params
    from splatflow.pipeline.paths import ScenePaths
    from splatflow.scene.resolution import load_working_scene
    from splatflow.train import Trainer

    proj = Path(a.project)
    os.chdir(proj)
    params = load_params("params.yaml").for_scene(a.scene)  # the scene's own overrides, as the stages read them
    paths = ScenePaths(a.scene)
    scene, _ = load_working_scene(params, paths)
    cfg = params.train
    cfg = dataclasses.replace(
        cfg, max_steps=a.steps, coarse_to_fine=True, resolution=(ResolutionPhase(a.factor, start_fraction=0.0),),
        blur=dataclasses.replace(cfg.blur, sigma_start_px=0.0), patch_max_pixels=0, sh_degree=1,
        early_stop=dataclasses.replace(cfg.early_stop, enabled=False), checkpoint_every=100_000,
        densify=dataclasses.replace(cfg.densify, max_gaussians=a.budget, refine_start_fraction=0.1,
                                    refine_stop_fraction=0.8))
    t0 = time.perf_counter()
    res = Trainer(scene, cfg, seed=0).run()
    t_train = time.perf_counter() - t0

    def per_view(views):
        cams = cameras_at(views, a.factor)
        imgs = CachedImages(views, a.factor)
        return [psnr(render_view(res.splats, cams[i], res.sh_degree, "auto").cpu(), imgs[i]) for i in range(len(views))]

    tr, te = per_view(scene.train_views), per_view(scene.test_views)
    t_all = time.perf_counter() - t0
    out = {"project": str(proj), "scene": a.scene, "steps": a.steps, "factor": a.factor,
           "gaussians": int(res.splats.n), "train_seconds": round(t_train, 1), "seconds": round(t_all, 1),
           "train": {v.name: round(p, 3) for v, p in zip(scene.train_views, tr)},
           "test": {v.name: round(p, 3) for v, p in zip(scene.test_views, te)}}
    for k, vals in (("train", tr), ("test", te)):
        v = np.asarray(vals)
        med = float(np.median(v))
        print(f"{k}: {len(v)} views, mean {v.mean():.2f} median {med:.2f} p10 {np.percentile(v, 10):.2f} "
              f"min {v.min():.2f}; {int(np.sum(v < med - 3))} views > 3 dB under the median")
    print(f"test - train median: {np.median(te) - np.median(tr):+.2f} dB; {res.splats.n} Gaussians; "
          f"{t_train:.0f} s training, {t_all:.0f} s in all")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
