"""DVC stage `export`: ``models/<scene>/prune/ckpt.pt`` -> ``models/<scene>/export/scene.{ply,splat,spz}``.

Thin shell: writing and the independent read-back check of every file live in :mod:`splatflow.present.export`;
``metrics/<scene>/export.json`` lists each file with its size, Gaussian count and the errors measured on read-back.
"""

from __future__ import annotations

from pathlib import Path

from splatflow.pipeline.config import Params
from splatflow.present.export import export_model
from splatflow.gaussians.model import load_splats
from splatflow.pipeline.paths import ScenePaths
from splatflow.pipeline.stage import stage_main


def run(params: Params, paths: ScenePaths) -> dict:
    splats, sh_degree = load_splats(paths.prune_ckpt)
    cfg = params.export
    metrics = export_model(splats, sh_degree, paths.export_dir, formats=cfg.formats, spz_version=cfg.spz_version,
                           spz_from_coordinates=cfg.spz_from_coordinates)
    for fmt, info in metrics["files"].items():
        try:  # project-relative paths, so export.json is the same in every clone
            info["path"] = str(Path(info["path"]).resolve().relative_to(Path(paths.root).resolve()))
        except ValueError:
            pass
        print(f"export [{paths.scene}]: {info['path']} {info['size_mb']:.2f} MiB, {info['gaussians']} Gaussians, "
              f"verified with {info['verified_with']}")
    return metrics


def main(argv: list[str] | None = None) -> None:
    stage_main("export", run, argv, needs_threads=False)


if __name__ == "__main__":
    main()
