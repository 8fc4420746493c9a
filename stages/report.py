"""DVC stage `report`: the scene's stage outputs -> ``reports/<scene>/index.html`` (one self-contained page).

Thin shell: the page is built by :mod:`splatflow.present.report` (metrics, SfM summary, curves, test views and an
embedded 3D viewer of the exported splat); ``metrics/<scene>/report.json`` records its size and what the preview holds.
"""

from __future__ import annotations

from splatflow.pipeline.config import Params
from splatflow.pipeline.paths import ScenePaths
from splatflow.present.report import build_report
from splatflow.pipeline.stage import stage_main


def run(params: Params, paths: ScenePaths) -> dict:
    metrics = build_report(paths, params.report, max_psnr_drop_db=params.prune.max_psnr_drop_db,
                           error_gain=params.evaluate.error_gain)
    print(f"report [{paths.scene}]: {metrics['path']} ({metrics['bytes'] / 2**20:.1f} MB; 3D preview of "
          f"{metrics['preview_gaussians']} of {metrics['model_gaussians']} Gaussians)")
    return metrics


def main(argv: list[str] | None = None) -> None:
    stage_main("report", run, argv, needs_threads=False)


if __name__ == "__main__":
    main()
