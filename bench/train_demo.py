"""Benchmark: train the demo-sized synthetic scene with the DEFAULT params and measure test-view quality.

Scene: our generator, 36 views at 800x600 on a full orbit (larger than a quick demo needs, so the figure
means something), through SfM (pycolmap, `splatflow.scene.sfm.run_sfm`) and the standard split (every 8th view
is a test view, `splatflow.scene.split.write_split`). Training uses ``params.yaml``'s ``train`` section as it is
(the defaults), on the CPU backend with 2 threads. Test PSNR: each test view rendered with its (SfM) camera at
full resolution, no gradients, float RGB clamped to [0, 1] against the undistorted test image (8-bit JPEG
decoded to float; renders not quantised).

Targets: >= 28 dB test PSNR with <= 10 minutes of training on 2 cores; and, for quality per minute, >= 30 dB
within 5 minutes of training (the unpruned model: ``--set prune_during.enabled=false``).

After training, the prune stage's work (``splatflow.compress.prune.run_prune`` with ``params.yaml``'s ``prune`` section)
runs on the checkpoint and is timed, so the prune stage's time is reported beside the train stage's (one ratio per run),
with the test PSNR of the model the prune stage writes. With ``train.prune_during`` on (the default) training
already pruned the model and the prune stage verifies and copies it.

    python bench/train_demo.py [--work DIR] [--json PATH] [--max-steps N] [--threads 2] [--name RUN]
    python bench/train_demo.py --resume-from DIR/ckpt.pt --set prune_during.enabled=false --name ref

``--work`` keeps the generated scene and SfM between runs (reused when present). Training always starts from
nothing: a checkpoint and training CSV left in the work folder by an earlier (e.g. killed) run are deleted first,
since resuming would report that run's steps and seconds as this one's. ``--resume`` continues such a checkpoint
instead, says so, and reports only the time this process trained.

``--resume-from`` continues an unfinished checkpoint of an earlier run whatever its train params (copied to
``--name``'s checkpoint first): two settings that differ only after that step (e.g. with and without
``prune_during``, whose first cut comes later) are then compared on one trajectory, and each run's training time
includes the shared part.
"""

from __future__ import annotations

import argparse
import json
import math
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
import torch  # noqa: E402


def prepare(work: Path, threads: int) -> tuple[Path, Path, dict]:
    """Generate the scene and run SfM + split once; return (undistorted dir, split.json, sfm metrics)."""
    from splatflow.pipeline.config import load_params
    from splatflow.scene.sfm import run_sfm
    from splatflow.scene.split import write_split
    from splatflow.scene.synthetic import write_scene

    params = load_params(ROOT / "params.yaml")
    raw, und, split_json = work / "raw", work / "undistorted", work / "split.json"
    sfm_json = work / "sfm.json"
    if sfm_json.exists() and split_json.exists() and (und / "images").exists():
        return und, split_json, json.loads(sfm_json.read_text())  # prepared earlier (or carried to a GPU machine)
    if not (raw / "images").exists():
        t = time.perf_counter()
        write_scene(raw, n_views=36, width=800, height=600, arc_deg=360.0)
        print(f"generated 36 views 800x600 in {time.perf_counter() - t:.1f} s", flush=True)
    if not sfm_json.exists():
        res = run_sfm(raw / "images", work / "sparse", und, params.sfm, seed=0, threads=threads,
                      ground_truth=raw / "ground_truth")
        sfm = res if isinstance(res, dict) else getattr(res, "metrics", None) or vars(res)
        sfm_json.write_text(json.dumps({k: v for k, v in sfm.items() if isinstance(v, (int, float, str, type(None)))},
                                       indent=1))
    if not split_json.exists():
        write_split(und, split_json, params.split)
    return und, split_json, json.loads(sfm_json.read_text())


@torch.no_grad()
def test_psnr(splats, sh_degree, views) -> list[float]:
    from splatflow.gaussians.model import Splats, render_view
    from splatflow.scene.pixels import read_rgb

    out = []
    splats = Splats.of(splats)
    for v in views:
        gt = torch.from_numpy(read_rgb(v.image_path)).float() / 255.0  # [H, W, 3]
        rgb = render_view(splats, v, sh_degree, "cpu")  # [H, W, 3] clamped to [0, 1]
        mse = float(((rgb - gt) ** 2).mean())
        out.append(-10.0 * math.log10(mse))
    return out


def train_config(max_steps: int | None = None, sets: list[str] | tuple = ()):
    """``params.yaml``'s ``train`` section with ``max_steps`` and ``key=value`` overrides (dotted keys into the
    section, YAML values, e.g. ``densify.max_gaussians=400000``), validated like params.yaml itself."""
    import yaml

    from splatflow.pipeline.config import params_from_dict

    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    tr = raw["train"]
    if max_steps:
        tr["max_steps"] = max_steps
    for item in sets:
        key, val = item.split("=", 1)
        d = tr
        *parents, leaf = key.split(".")
        for p in parents:
            d = d[p]
        d[leaf] = yaml.safe_load(val)
    return params_from_dict(raw).train


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/splatflow_train_demo"))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-steps", type=int, default=None, help="override train.max_steps (default: params.yaml)")
    ap.add_argument("--set", action="append", default=[],
                    help="override a train param for experiments, e.g. --set densify.grow_grad2d=0.0001")
    ap.add_argument("--resume", action="store_true",
                    help="continue the unfinished checkpoint in --work instead of starting from nothing (reported)")
    ap.add_argument("--name", default="ckpt", help="checkpoint/CSV name in --work (several runs side by side)")
    ap.add_argument("--resume-from", type=Path, metavar="CKPT",
                    help="continue this unfinished checkpoint whatever train params wrote it (copied first)")
    ap.add_argument("--no-prune", action="store_true", help="skip the prune stage after training")
    ap.add_argument("--seed", type=int, default=0, help="the training run's seed (the scene and SfM stay the same)")
    ap.add_argument("--eval-only", type=Path, metavar="CKPT",
                    help="only measure test PSNR of a checkpoint (e.g. one saved on SIGTERM) and print its step")
    args = ap.parse_args(argv)

    from splatflow.pipeline.config import load_params
    from splatflow.render import configure_threads
    from splatflow.scene.dataset import load_scene
    from splatflow.train import train

    configure_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    und, split_json, sfm = prepare(args.work, args.threads)
    scene = load_scene(und, split_json)
    if args.eval_only:
        from splatflow.gaussians.model import load_checkpoint, load_splats

        splats, deg = load_splats(args.eval_only)
        ck = load_checkpoint(args.eval_only)
        psnrs = test_psnr(splats, deg, scene.test_views)
        print(f"{args.eval_only}: step {ck['step']} ({ck.get('stopped') or 'periodic'}), {len(splats['means'])} "
              f"Gaussians, SH degree {deg}, training {ck.get('elapsed_seconds', 0):.0f} s: test PSNR "
              f"{np.mean(psnrs):.2f} dB (per view: {', '.join(f'{p:.2f}' for p in psnrs)})")
        return {"psnr_test": float(np.mean(psnrs)), "steps": int(ck["step"])}
    cfg = train_config(args.max_steps, args.set)
    print(f"scene: {len(scene.train_views)} train / {len(scene.test_views)} test views, {len(scene.points)} SfM "
          f"points; {cfg.max_steps} steps, strategy {cfg.densify.strategy}", flush=True)
    ckpt = args.work / f"{args.name}.pt"
    csv = args.work / ("train.csv" if args.name == "ckpt" else f"{args.name}.csv")
    prior_s, prior_step = 0.0, 0
    if args.resume:
        cfg = replace(cfg, resume=True)
        if ckpt.exists():
            from splatflow.gaussians.model import load_checkpoint

            ck = load_checkpoint(ckpt)
            prior_s, prior_step = float(ck.get("elapsed_seconds", 0.0)), int(ck["step"])
    elif not args.resume_from:  # a benchmark starts from nothing: never continue an earlier run's checkpoint
        cfg = replace(cfg, resume=False)
        for stale in (ckpt, csv):
            if stale.exists():
                print(f"removing {stale} left by an earlier run (this benchmark starts from nothing)", flush=True)
                stale.unlink()
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    cpu0 = os.times()
    if args.resume_from:
        import shutil

        from splatflow.gaussians.model import load_checkpoint
        from splatflow.train import Trainer

        class Forked(Trainer):  # resumes whatever config wrote the checkpoint (the benchmark's fork)
            def resume(self) -> bool:
                self.load_state_dict(load_checkpoint(self.ckpt_path))
                return True

        if args.resume_from.resolve() != ckpt.resolve():
            shutil.copy(args.resume_from, ckpt)
        res = Forked(scene, cfg, ckpt_path=ckpt, csv_path=csv, seed=args.seed).run()
        print(f"continued {args.resume_from} from step {res.resumed_from}: the training time below is the whole "
              "run's, the part before the fork included", flush=True)
    else:
        res = train(scene, cfg, ckpt_path=ckpt, csv_path=csv, seed=args.seed)
    wall = time.perf_counter() - t0
    if res.resumed_from is not None and not args.resume_from:
        if not args.resume:
            raise RuntimeError(f"training resumed from step {res.resumed_from} although resume was off")
        own = res.train_seconds - prior_s
        print(f"!!! RESUMED from the checkpoint at step {res.resumed_from} ({prior_s:.0f} s of earlier training): "
              f"the figures below count only this process's {own:.0f} s and {res.steps - prior_step} steps; "
              "the test PSNR is that of the whole (combined) run !!!", flush=True)
        res = replace(res, train_seconds=own)
    cpu1 = os.times()
    # On a shared machine wall time measures the other people's jobs too; the process's CPU time divided by the
    # thread count is what the same run costs on `threads` dedicated cores (a lower bound: it assumes perfect
    # parallel efficiency, so it is reported next to, never instead of, the wall time).
    cpu_s = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    load1 = os.getloadavg()
    psnrs = test_psnr(res.splats, res.sh_degree, scene.test_views)
    out = {"psnr_test": round(float(np.mean(psnrs)), 3), "train_seconds": round(res.train_seconds, 1),
           "steps": res.steps, "gaussians": int(res.splats["means"].shape[0]),
           "cpu_seconds": round(cpu_s, 1), "cpu_seconds_per_thread": round(cpu_s / args.threads, 1),
           "resumed_from": res.resumed_from}
    print(f"test PSNR {out['psnr_test']:.2f} dB (per view: {', '.join(f'{p:.2f}' for p in psnrs)})")
    print(f"training {out['train_seconds']:.0f} s (wall incl. validation {wall:.0f} s), {res.steps} steps "
          f"({res.stopped}), {out['gaussians']} Gaussians, val PSNR {res.val_psnr}")
    print(f"process CPU time {cpu_s:.0f} s = {cpu_s / args.threads:.0f} s per thread ({args.threads} threads)")
    print(f"load average 1-min before {load0[0]:.2f} after {load1[0]:.2f}, 15-min after {load1[2]:.2f} on "
          f"{os.cpu_count()} cores; sfm: {sfm.get('images_registered')} registered, {sfm.get('points3d')} points")
    print(f"target >= 28 dB in <= 600 s: PSNR {'MET' if out['psnr_test'] >= 28 else 'NOT MET'}, "
          f"time {'MET' if res.train_seconds <= 600 else 'NOT MET'}")
    print(f"target >= 30 dB in <= 300 s: PSNR {'MET' if out['psnr_test'] >= 30 else 'NOT MET'}, "
          f"time {'MET' if res.train_seconds <= 300 else 'NOT MET'}")
    if res.prune_during:
        pd = res.prune_during
        cuts = ", ".join(f"step {r['step']}: {r['gaussians']} ({r['score_seconds']:.0f} s scoring, val "
                         f"{r['val_psnr']:.2f} dB {'kept' if r['accepted'] else 'undone'})" for r in pd["phases"])
        print(f"pruned during training from {pd['gaussians_before']} Gaussians (val {pd['val_psnr_before']:.2f} dB): "
              f"{cuts}; {pd['stop_reason'] or 'all phases kept'}")
        out["prune_during"] = pd
    if not args.no_prune:
        from splatflow.gaussians.model import load_splats
        from splatflow.compress.prune import run_prune

        prune_cfg = load_params(ROOT / "params.yaml").prune
        t = time.perf_counter()
        pm = run_prune(prune_cfg, cfg, train_ckpt=ckpt, out_ckpt=args.work / f"{args.name}_pruned.pt", scene=scene,
                       seed=0)
        prune_s = time.perf_counter() - t
        pruned, pdeg = load_splats(args.work / f"{args.name}_pruned.pt")
        pp = test_psnr(pruned, pdeg, scene.test_views)
        # the denominator is the training time without validation (the whole run's, also when forked): the
        # ratio is then an upper bound of the prune stage's share
        out.update({"prune_seconds": round(prune_s, 1), "prune_over_train": round(prune_s / res.train_seconds, 3),
                    "gaussians_pruned": int(pruned["means"].shape[0]), "psnr_test_pruned": round(float(np.mean(pp)), 3),
                    "prune_stop_reason": pm["stop_reason"]})
        print(f"prune stage {prune_s:.0f} s beside training's {res.train_seconds:.0f} s: ratio "
              f"{prune_s / res.train_seconds:.2f}; {out['gaussians_pruned']} Gaussians, test PSNR {out['psnr_test_pruned']:.2f} dB "
              f"(per view: {', '.join(f'{p:.2f}' for p in pp)}); {pm['stop_reason']}")
        print(f"load average 1-min after pruning {os.getloadavg()[0]:.2f}")
    if args.json:
        args.json.write_text(json.dumps(dict(out, stopped=res.stopped, wall_seconds=round(wall, 1),
                                             per_view=[round(p, 3) for p in psnrs],
                                             loadavg=[round(x, 2) for x in load1]), indent=2, default=str))
    return out


if __name__ == "__main__":
    main()
