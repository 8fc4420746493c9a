"""DVC stage ``train``: Gaussians from the undistorted COLMAP model, trained on the training views only.

Reads ``data/S/undistorted/`` and ``data/S/split.json``; writes ``models/S/train/ckpt.pt``,
``plots/S/train.csv`` and (through ``stage_main``) ``metrics/S/train.json``. All logic is in
:mod:`splatflow.train`.
"""

from __future__ import annotations

from splatflow.pipeline import stop
from splatflow.pipeline.config import Params
from splatflow.pipeline.errors import UserError
from splatflow.pipeline.paths import ScenePaths
from splatflow.pipeline.runtime_env import peak_rss_mb
from splatflow.pipeline.stage import stage_main
from splatflow.pipeline.stop import StageStopped
from splatflow.tracking import step_logger


def run(params: Params, paths: ScenePaths) -> dict:
    """Train scene ``paths.scene``; write the checkpoint and CSV; return the metrics dict."""
    from splatflow.pipeline.device import resolve
    from splatflow.scene.resolution import describe, load_working_scene
    from splatflow.train import Trainer

    resolve(params.train.backend)  # a missing GPU or a broken gsplat build is reported before anything else
    if not paths.undistorted_dir.exists():
        raise UserError(f"{paths.undistorted_dir}: not found; run the sfm stage first (`dvc repro sfm@{paths.scene}`)")
    if not paths.split_json.exists():
        raise UserError(f"{paths.split_json}: not found; run the split stage first (`dvc repro split@{paths.scene}`)")
    scene, resolution = load_working_scene(params, paths)
    print(f"train [{paths.scene}]: {describe(resolution)}")
    cfg = params.train
    from splatflow.present import live_view

    watchers = live_view.from_env(paths)  # `splatflow run --view`: the splat being trained in the browser
    try:
        trainer = Trainer(scene, cfg, ckpt_path=paths.train_ckpt, csv_path=paths.train_csv, seed=params.base.seed,
                          step_logger=step_logger("train"), watchers=watchers)
        print(f"train [{paths.scene}]: {trainer.plan.describe()}")
        res = trainer.run()
    finally:
        for w in watchers:
            w.close()
    if stop.is_stop_label(res.stopped):
        # Not a finished stage: exit 143 so DVC records nothing and MLflow marks the run KILLED; the checkpoint
        # lets the next run resume.
        raise StageStopped(f"{res.stopped}; checkpoint saved to {paths.train_ckpt}, rerun the stage to resume")
    if res.stopped.startswith("nonfinite"):
        raise UserError(f"training diverged: {res.stopped}. The last good checkpoint is {paths.train_ckpt}; "
                        "lower train.lr.* (e.g. lr.means or lr.opacities) and rerun")
    refine = [e for e in res.events if "gaussians" in e]
    return {
        "steps": res.steps,
        "stopped": res.stopped,
        "gaussians": int(res.splats["means"].shape[0]),
        "train_seconds": round(res.train_seconds, 3),
        # the CPU kernels compiled before the first step (a first run after an install or a kernel change)
        "compile_seconds": None if res.compile_seconds is None else round(res.compile_seconds, 1),
        "it_per_s": round(res.it_per_s, 3),
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "val_psnr": None if res.val_psnr is None else round(res.val_psnr, 4),
        "refine_events": len(refine),
        "resumed_from": res.resumed_from,
        "device": res.device,  # backend, device name, versions, peak GPU memory (null on the CPU)
        "resolution": resolution,
        "plan": res.plan,  # steps and Gaussian budget as resolved for this scene and device (train.max_steps: auto)
        "window_pixels": res.window_pixels,  # train.patch_max_pixels as resolved for the backend (0 = whole images)
        "prune_during": res.prune_during,  # train.prune_during's cuts (null when off)
        "appearance": res.appearance,  # train.appearance: the transforms' deviation from identity (null when off)
    }


def main(argv=None) -> None:
    stage_main("train", run, argv)  # python -m stages.train <scene>


if __name__ == "__main__":
    main()
