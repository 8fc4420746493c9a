"""Benchmark: model size vs TEST PSNR along the pruning phases (the goal: ~10% of the
Gaussians for <= 1 dB of test PSNR).

Runs the prune stage's work (:func:`splatflow.compress.prune.run_prune`, recovery fine-tune included) on a trained
checkpoint and, after every phase, renders the split's TEST views under ``torch.no_grad`` at full resolution.
Test views only measure; nothing is fitted to them (the stage's early stop uses training views). By default the
early stop is off here (``--max-drop-db inf``) so the whole curve is seen; pass the stage's value to reproduce
what the stage keeps. The pruned checkpoint goes to a temporary folder, never over the DVC output. The prune
stage's time is printed beside the training time of the checkpoint it pruned (the checkpoint's own training time,
or ``metrics/<scene>/train.json``'s), so the ratio is one figure of one run.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/prune_curve.py demo
    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/prune_curve.py demo --finetune-steps 300 --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scene", nargs="?", default="demo")
    ap.add_argument("--params", default=str(ROOT / "params.yaml"))
    ap.add_argument("--ckpt", default=None, help="trained checkpoint (default models/<scene>/train/ckpt.pt)")
    ap.add_argument("--undistorted", default=None, help="scene folder (default data/<scene>/undistorted)")
    ap.add_argument("--split", default=None, help="split.json (default data/<scene>/split.json)")
    ap.add_argument("--finetune-steps", type=int, default=None, help="override prune.finetune_steps")
    ap.add_argument("--phases", type=int, default=None, help="override prune.phases")
    ap.add_argument("--finetune-growth", type=float, default=None, help="override prune.finetune_growth")
    ap.add_argument("--score", choices=("significance", "removal"), default=None, help="override prune.score")
    ap.add_argument("--score-rounds", type=int, default=None, help="override prune.score_rounds")
    ap.add_argument("--finetune-means-lr", type=float, default=None, help="override prune.finetune_means_lr")
    ap.add_argument("--finetune-adam", choices=("trained", "fresh"), default=None, help="override prune.finetune_adam")
    ap.add_argument("--keep-first", type=float, default=None, help="override prune.keep_first")
    ap.add_argument("--max-drop-db", type=float, default=math.inf,
                    help="early-stop tolerance on validation PSNR (default inf: run every phase)")
    ap.add_argument("--test-factor", type=float, default=1.0, help="resolution factor of the test renders")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None, help="also write the curve to this JSON file")
    args = ap.parse_args(argv)

    import torch

    from splatflow.compress import prune, scoring
    from splatflow.pipeline.config import load_params
    from splatflow.gaussians.model import load_splats
    from splatflow.pipeline.paths import ScenePaths
    from splatflow.render import configure_threads
    from splatflow.scene.dataset import load_scene
    from splatflow.scene.images import ImageCache

    params = load_params(args.params)
    configure_threads(args.threads or params.base.threads)
    torch.manual_seed(params.base.seed)
    paths = ScenePaths(args.scene, Path(args.params).resolve().parent)
    ckpt = Path(args.ckpt) if args.ckpt else paths.train_ckpt
    cfg = params.prune
    over = {"max_psnr_drop_db": args.max_drop_db if math.isfinite(args.max_drop_db) else 1e9}
    for name in ("finetune_steps", "finetune_growth", "phases", "score", "score_rounds", "finetune_means_lr",
                 "finetune_adam", "keep_first"):
        if getattr(args, name) is not None:
            over[name] = getattr(args, name)
    cfg = dataclasses.replace(cfg, **over)

    split_json = Path(args.split) if args.split else paths.split_json
    scene = load_scene(Path(args.undistorted) if args.undistorted else paths.undistorted_dir, split_json)
    if not scene.test_views:
        raise SystemExit(f"{split_json}: no test views to measure on")
    cache = ImageCache(scene.test_views, 512)
    test_cams, test_targets = [], []
    for i, v in enumerate(scene.test_views):
        img, K = cache.get(i, args.test_factor)  # [H, W, 3], [3, 3]
        test_cams.append(scoring.Camera(v.world_to_cam, K, img.shape[1], img.shape[0]))
        test_targets.append(img)

    splats, deg = load_splats(ckpt)
    t0 = time.perf_counter()
    psnr0 = scoring.mean_psnr(splats, deg, test_cams, test_targets, cfg.backend)
    render_s = (time.perf_counter() - t0) / len(test_cams)
    n0 = splats["means"].shape[0]
    rows = [{"phase": 0, "keep_fraction": 1.0, "gaussians": n0, "size_mb": round(splats.size_mib, 3),
             "val_psnr": None, "test_psnr": psnr0, "test_drop_db": 0.0, "render_s_per_view": render_s,
             "seconds": 0.0, "accepted": True}]
    print(f"{args.scene}: {n0} Gaussians, {len(scene.train_views)} train / {len(scene.test_views)} test views, "
          f"test PSNR {psnr0:.3f} dB; prune cfg {cfg}", flush=True)

    def on_phase(rec: dict, s: dict) -> None:
        t = time.perf_counter()
        p = scoring.mean_psnr(s, deg, test_cams, test_targets, cfg.backend)
        rows.append({**{k: rec[k] for k in ("phase", "keep_fraction", "gaussians", "size_mb", "val_psnr",
                                             "seconds", "accepted")},
                     "test_psnr": p, "test_drop_db": psnr0 - p,
                     "render_s_per_view": (time.perf_counter() - t) / len(test_cams)})
        print(f"phase {rec['phase']}: keep {rec['keep_fraction']:.3f} -> {rec['gaussians']} Gaussians, "
              f"val {rec['val_psnr']:.3f} dB, test {p:.3f} dB (drop {psnr0 - p:+.3f}), {rec['seconds']:.0f} s",
              flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        t_all = time.perf_counter()
        metrics = prune.run_prune(cfg, params.train, train_ckpt=ckpt, out_ckpt=Path(tmp) / "ckpt.pt", scene=scene,
                                  seed=params.base.seed, phase_callback=on_phase)
        total_s = time.perf_counter() - t_all
    rows[0]["val_psnr"] = metrics["val_psnr_before"]
    train_s = _train_seconds(ckpt, paths)

    print()
    print("| phase | keep | Gaussians | size (MiB) | val PSNR (train views) | test PSNR | test drop (dB) | "
          "render s/view | phase s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        val = "—" if r["val_psnr"] is None else f"{r['val_psnr']:.2f}"
        print(f"| {r['phase']} | {r['keep_fraction']:.3f} | {r['gaussians']} | {r['size_mb']:.2f} | {val} | "
              f"{r['test_psnr']:.2f} | {r['test_drop_db']:+.2f} | {r['render_s_per_view']:.3f} | "
              f"{r['seconds']:.0f} |")
    last = rows[-1]
    verdict = last["test_drop_db"] <= 1.0
    print(f"\nfinal phase keeps {last['gaussians'] / n0:.1%} of the Gaussians; test PSNR drop "
          f"{last['test_drop_db']:.2f} dB -> target (<= 1 dB at ~10%) {'MET' if verdict else 'NOT MET'}; "
          f"total {total_s:.0f} s")
    if train_s:
        print(f"prune {total_s:.0f} s beside the training of this checkpoint, {train_s:.0f} s: ratio "
              f"{total_s / train_s:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"scene": args.scene, "ckpt": str(ckpt), "config": dataclasses.asdict(cfg),
                                               "rows": rows, "stage_metrics": metrics, "total_seconds": total_s,
                                               "train_seconds": train_s,
                                               "prune_over_train": total_s / train_s if train_s else None},
                                              indent=2, default=str))


def _train_seconds(ckpt: Path, paths) -> float | None:
    """Training time of ``ckpt`` (its recorded training time without validation; the train stage's metrics when
    the checkpoint does not say)."""
    from splatflow.gaussians.model import load_checkpoint

    s = load_checkpoint(ckpt).get("elapsed_seconds")
    if not s and paths.metrics_json("train").exists():
        s = json.loads(paths.metrics_json("train").read_text()).get("train_seconds")
    return float(s) if s else None


if __name__ == "__main__":
    main()
