"""DVC stage `ingest`: the scene's raw capture -> ``data/<scene>/images/`` (+ ``images_{2,4,8}/``) and
``metrics/<scene>/ingest.json``.

Thin shell: the work (and the reasons behind each check) lives in :mod:`splatflow.scene.ingest`.
"""

from __future__ import annotations

from pathlib import Path

from splatflow.pipeline.config import Params
from splatflow.pipeline.errors import UserError
from splatflow.pipeline import records
from splatflow.pipeline.paths import ScenePaths
from splatflow.scene import colmap
from splatflow.scene.ingest import ingest, reads_subfolders, write_image_folders
from splatflow.pipeline.stage import stage_main


def source_path(params: Params, paths: ScenePaths) -> Path:
    """``base.scenes.<scene>.source``; relative paths are relative to the project root (where params.yaml is)."""
    src = Path(params.scene(paths.scene).source).expanduser()
    return src if src.is_absolute() else paths.root / src


def run(params: Params, paths: ScenePaths) -> dict:
    """Ingest one scene; returns the metrics dict (images_in, images_kept, rejected, ...).

    A COLMAP dataset (``base.scenes.S.colmap`` set) is read from its ``images/`` folder and its ``images_N`` levels
    are copied to ``data/S/images_N``; for every other scene those level folders are left empty
    (docs/CONTRACTS.md).
    """
    scene = params.scene(paths.scene)
    source = source_path(params, paths)
    if scene.colmap is not None:
        colmap.model_dir(source, scene.colmap)  # fail before any work when the model is not where params say
        if not (source / "images").is_dir():
            raise UserError(f"{source}: a COLMAP dataset needs its images in {source / 'images'}; point "
                            f"base.scenes.{paths.scene}.source at the dataset's root folder")
    # A COLMAP dataset's images are named by its model: never flattened from sub-folders.
    subfolders = scene.colmap is None and reads_subfolders(source, params.sfm.camera_mode)
    result = ingest(source / "images" if scene.colmap is not None else source, paths.images_dir, params.ingest,
                    subfolders=subfolders)
    if scene.colmap is not None:
        kept = [(c.source, c.out_name, c.width_px, c.height_px) for c in result.kept]
        levels = colmap.copy_levels(source, kept, paths.data_dir, params.ingest)
    else:
        colmap.empty_levels(paths.data_dir)
        levels = None
    kept, n_in = len(result.kept), result.images_in
    print(f"ingest [{paths.scene}]: kept {kept} of {n_in} {'frames' if result.source_kind == 'video' else 'files'}"
          f" -> {paths.images_dir}")
    per_folder = result.folder_counts()
    if per_folder:  # one camera per sub-folder in the sfm stage
        print(f"ingest [{paths.scene}]: read {len(per_folder)} folder(s) (sfm.camera_mode = {params.sfm.camera_mode}"
              "; one camera each): " + ", ".join(f"{f or '.'} ({n})" for f, n in per_folder.items()))
    summary = result.summary_lines()
    for line in summary:  # one line per reason; each file with its detail is in metrics/S/info/ingest.json
        print(f"ingest [{paths.scene}]: {line}")
    if summary:
        print(f"ingest [{paths.scene}]: details per file: {paths.info_json('ingest')} (\"rejected\", \"ignored\")")
    metrics = result.metrics()
    metrics["source"] = params.scene(paths.scene).source  # as written in params.yaml: same on every clone
    # counts keyed by data (one DVC column per distinct size or reason): the info file keeps them whole
    for key in ("image_sizes", "rejected_by_reason"):
        metrics[key] = records.Info(metrics.get(key) or {})
    # The sfm stage's per-folder cameras read the folders from this file rather than from ingest.json, whose
    # timings change on every run: a rerun of ingest that writes the same images must not rerun SfM.
    write_image_folders(paths.data_dir, metrics["image_folders"])
    if levels is not None:
        metrics["colmap_model"] = scene.colmap
        metrics["levels"] = levels
    metrics.update(_masks(params, paths, result))
    return metrics


def _masks(params: Params, paths: ScenePaths, result) -> dict:
    """Check and copy ``base.scenes.S.masks`` to ``data/S/masks`` (a DVC out, so it exists without masks too,
    holding only a note)."""
    import shutil

    from splatflow.scene.notes import write_empty_note
    from splatflow.scene.masks import ingest_masks

    masks = params.scene(paths.scene).masks
    if masks is None:
        if paths.masks_dir.exists():
            shutil.rmtree(paths.masks_dir)
        write_empty_note(paths.masks_dir, f"scene {paths.scene} has no masks (base.scenes.{paths.scene}.masks is "
                                          "not set): every pixel counts")
        return {"masks": 0}
    if result.source_kind != "folder":
        raise UserError(f"base.scenes.{paths.scene}.masks: masks need a folder of images as the source (frames of a "
                        "video have no names to match); remove the key or extract the frames first")
    src = Path(masks).expanduser()
    out = ingest_masks(src if src.is_absolute() else paths.root / src, result.kept, paths.masks_dir)
    print(f"ingest [{paths.scene}]: {out['masks']} masks checked -> {paths.masks_dir} "
          f"(mean kept fraction {out['mask_kept_fraction_mean']:.3f})")
    return out


def main(argv: list[str] | None = None) -> None:
    stage_main("ingest", run, argv, needs_threads=False)  # no numba/torch here


if __name__ == "__main__":
    main()
