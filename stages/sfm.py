"""DVC stage `sfm`: ``data/<scene>/images/`` -> ``data/<scene>/sparse/``, ``data/<scene>/undistorted/`` and
``metrics/<scene>/sfm.json``; for a COLMAP dataset (``base.scenes.S.colmap``) its model is imported instead.

Thin shell: the work (and the reasons behind each choice) lives in :mod:`splatflow.scene.sfm`.
"""

from __future__ import annotations

from pathlib import Path

from splatflow.pipeline import records
from splatflow.pipeline.config import Params
from splatflow.pipeline.paths import ScenePaths
from splatflow.scene import colmap
from splatflow.scene.ingest import read_image_folders
from splatflow.scene.sfm import run_sfm
from splatflow.pipeline.stage import stage_main

def _project_path(paths: ScenePaths, value: str) -> Path:
    """A path from params.yaml: relative paths are relative to the project root (where params.yaml is)."""
    p = Path(value).expanduser()
    return p if p.is_absolute() else paths.root / p


def _import(params: Params, paths: ScenePaths, gt: Path | None):
    """Import the dataset's model for the images ingest kept (splatflow.scene.colmap)."""
    scene = params.scene(paths.scene)
    source = _project_path(paths, scene.source)
    model = colmap.model_dir(source, scene.colmap)
    rejected = {}
    # why ingest rejected a file, to name it when the model references that file
    rejected = {r["file"]: f"rejected by ingest: {r['reason']}: {r['detail']}"
                for r in records.read_info(paths, "ingest").get("rejected", [])}
    return colmap.import_model(model, paths.images_dir, paths.sparse_dir, paths.undistorted_dir, params.sfm,
                               name_map=colmap.output_name_map(source / "images", params.ingest.image_format),
                               rejected=rejected, threads=params.base.threads, ground_truth=gt)


def run(params: Params, paths: ScenePaths) -> dict:
    """SfM for one scene; returns the sfm.json metrics."""
    scene = params.scene(paths.scene)
    gt = _project_path(paths, scene.ground_truth) if scene.ground_truth else None
    # Frames of a video are an ordered sequence: sequential matching fits them (when sfm.matcher is "auto").
    # (a file source is a video: ingest takes no other file, splatflow.scene.video.check_video_source)
    from_video = _project_path(paths, scene.source).is_file()
    if scene.colmap is not None:  # an existing COLMAP dataset: import its model, no SfM
        result = _import(params, paths, gt)
    else:
        result = run_sfm(paths.images_dir, paths.sparse_dir, paths.undistorted_dir, params.sfm,
                         seed=params.base.seed, threads=params.base.threads, ordered_sequence=from_video,
                         ground_truth=gt, folders=read_image_folders(paths.data_dir))
    m = result.metrics
    m.setdefault("matcher", result.matcher)  # what sfm.matcher: auto chose
    print(f"sfm [{paths.scene}]: {m['images_registered']}/{m['images_total']} images registered, {m['points3d']} "
          f"points, reprojection error {m['mean_reprojection_error_px']:.3f} px "
          f"({'imported model' if result.matcher == 'imported' else result.matcher + ' matching'}) "
          f"-> {paths.undistorted_dir}")
    return m


def main(argv: list[str] | None = None) -> None:
    stage_main("sfm", run, argv, needs_threads=False)  # pycolmap gets its thread count from base.threads


if __name__ == "__main__":
    main()
