"""DVC stage ``prune``: LightGaussian global-significance pruning with recovery (issue 5).

Reads ``models/S/train/ckpt.pt`` and the training views; writes ``models/S/prune/ckpt.pt`` (splats and
``sh_degree`` only: the optimizer state of training is dropped) and returns the metrics dict that becomes
``metrics/S/prune.json``. The work is :func:`splatflow.prune.run_prune`.
"""

from __future__ import annotations

from splatflow.config import Params
from splatflow.paths import ScenePaths
from splatflow.stage import stage_main


def run(params: Params, paths: ScenePaths) -> dict:
    """Prune scene ``paths.scene``; write the pruned checkpoint; return the metrics."""
    from splatflow.prune import run_prune

    return run_prune(params.prune, params.train, train_ckpt=paths.train_ckpt, out_ckpt=paths.prune_ckpt,
                     undistorted_dir=paths.undistorted_dir, split_json=paths.split_json, seed=params.base.seed)


def main(argv=None) -> None:
    stage_main("prune", run, argv)  # python -m stages.prune <scene>


if __name__ == "__main__":
    main()
