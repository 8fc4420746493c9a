"""DVC stage ``prune``: verify and copy a model pruned during training (``train.prune_during``, the default), or
prune in phases with a recovery fine-tune after each (LightGaussian's schedule; removal-cost score by default).

Reads ``models/S/train/ckpt.pt`` and the training views; writes ``models/S/prune/ckpt.pt`` (splats and
``sh_degree`` only: the optimizer state of training is dropped) and returns the metrics dict that becomes
``metrics/S/prune.json``. The work is :func:`splatflow.compress.prune.run_prune`.
"""

from __future__ import annotations

from splatflow.pipeline.config import Params
from splatflow.pipeline.paths import ScenePaths
from splatflow.pipeline.stage import stage_main
from splatflow.tracking import step_logger


def run(params: Params, paths: ScenePaths) -> dict:
    """Prune scene ``paths.scene``; write the pruned checkpoint; return the metrics."""
    from splatflow.compress.prune import run_prune
    from splatflow.scene.resolution import describe, load_working_scene

    scene, resolution = load_working_scene(params, paths)  # the size and masks training used
    print(f"prune [{paths.scene}]: {describe(resolution)}")

    logger = step_logger("prune")

    def log_phase(record: dict, splats: dict) -> None:  # one MLflow step per phase: the size/quality curve
        print(f"prune [{paths.scene}]: phase {record['phase']}: {record['gaussians']} Gaussians, validation PSNR "
              f"{record['val_psnr']:.2f} dB ({'accepted' if record['accepted'] else 'rejected'})", flush=True)
        logger.log(record["phase"], {"gaussians": record["gaussians"], "val_psnr": record["val_psnr"],
                                     "keep_fraction": record["keep_fraction"]})

    try:
        metrics = run_prune(params.prune, params.train, train_ckpt=paths.train_ckpt, out_ckpt=paths.prune_ckpt,
                            scene=scene, split_json=paths.split_json, seed=params.base.seed,
                            phase_callback=log_phase, phases_ckpt=paths.prune_phases)
        if str(metrics.get("stop_reason") or "").startswith("no-op"):
            print(f"prune [{paths.scene}]: not pruned, the trained model is copied: "
                  f"{metrics['stop_reason'].removeprefix('no-op: ')}", flush=True)
        if metrics.get("resumed_after_phase") is not None:
            print(f"prune [{paths.scene}]: continued after phase {metrics['resumed_after_phase']}, saved by an "
                  f"interrupted run in {paths.prune_phases}")
        return {**metrics, "resolution": resolution}
    finally:
        logger.close()


def main(argv=None) -> None:
    stage_main("prune", run, argv)  # python -m stages.prune <scene>


if __name__ == "__main__":
    main()
