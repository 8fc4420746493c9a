"""Benchmark: run-to-run variance of training, so a rerun's verdict rests on a measured spread, not a guess.

Trains the 36-view 800x600 benchmark scene (``bench/train_demo.py``'s, SfM and split reused from its work
folder) with the DEFAULT ``train`` params, once per seed in ``--seeds`` (default 0 1 2 0: three seeds, and seed 0
twice), every run from nothing, and prints each run's test PSNR and Gaussian count, the spread over seeds (max -
min, standard deviation) and the same-seed difference. The same seed repeats exactly on the CPU backend with pinned
threads (numba's tile order is fixed, torch's reductions run in a fixed order); a difference there means
nondeterminism. ``--json`` writes the figures, which ``splatflow rerun`` takes as its default tolerance for test
PSNR (``splatflow/orchestrate/rerun.py``).

    python bench/variance.py [--work DIR] [--seeds 0 1 2 0] [--max-steps N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("SPLATFLOW_TRACKING", "off")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import splatflow  # noqa: E402,F401  (first: its process defaults for OpenMP and numba's cache)
import numpy as np  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/splatflow_train_demo"))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 0])
    ap.add_argument("--max-steps", type=int, default=None, help="override train.max_steps (default: params.yaml)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    from bench.train_demo import prepare, test_psnr
    from splatflow.pipeline.config import load_params
    from splatflow.render import configure_threads
    from splatflow.scene.dataset import load_scene
    from splatflow.train import Trainer

    configure_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    und, split_json, _ = prepare(args.work, args.threads)
    scene = load_scene(und, split_json)
    cfg = replace(load_params(ROOT / "params.yaml").train, resume=False, progress=False)
    if args.max_steps:
        cfg = replace(cfg, max_steps=args.max_steps)
    print(f"{len(scene.train_views)} train / {len(scene.test_views)} test views, {cfg.max_steps} steps, "
          f"seeds {args.seeds}; load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores", flush=True)
    runs = []
    for i, seed in enumerate(args.seeds):
        t0 = time.perf_counter()
        res = Trainer(scene, cfg, seed=seed).run()  # no checkpoint path: every run starts from nothing
        psnrs = test_psnr(res.splats, res.sh_degree, scene.test_views)
        run = {"seed": seed, "psnr_test": round(float(np.mean(psnrs)), 4),
               "gaussians": int(res.splats["means"].shape[0]), "steps": res.steps, "stopped": res.stopped,
               "train_seconds": round(res.train_seconds, 1), "wall_seconds": round(time.perf_counter() - t0, 1),
               "loadavg_1min": round(os.getloadavg()[0], 2)}
        runs.append(run)
        print(f"run {i + 1}/{len(args.seeds)} seed {seed}: test PSNR {run['psnr_test']:.3f} dB, "
              f"{run['gaussians']} Gaussians, {run['steps']} steps ({run['stopped']}), {run['train_seconds']} s",
              flush=True)
    by_seed: dict[int, list[dict]] = {}
    for r in runs:
        by_seed.setdefault(r["seed"], []).append(r)
    firsts = [v[0] for v in by_seed.values()]
    p = np.array([r["psnr_test"] for r in firsts])
    g = np.array([r["gaussians"] for r in firsts])
    same = [abs(v[1]["psnr_test"] - v[0]["psnr_test"]) for v in by_seed.values() if len(v) > 1]
    out = {
        "runs": runs,
        "seeds_distinct": len(firsts),
        "psnr_spread_db": round(float(p.max() - p.min()), 4),
        "psnr_std_db": round(float(p.std(ddof=1)) if len(p) > 1 else 0.0, 4),
        "gaussians_spread": int(g.max() - g.min()),
        "gaussians_spread_fraction": round(float((g.max() - g.min()) / g.mean()), 4),
        "same_seed_psnr_diff_db": round(max(same), 4) if same else None,
    }
    print(f"over {len(firsts)} seeds: test PSNR spread {out['psnr_spread_db']:.3f} dB (std {out['psnr_std_db']:.3f}), "
          f"Gaussians spread {out['gaussians_spread']} ({100 * out['gaussians_spread_fraction']:.1f}%); "
          f"same seed twice: {out['same_seed_psnr_diff_db']} dB")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
