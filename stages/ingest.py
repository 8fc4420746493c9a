"""DVC stage `ingest`: the scene's raw capture -> ``data/<scene>/images/`` + ``metrics/<scene>/ingest.json``.

Thin shell: the work (and the reasons behind each check) lives in :mod:`splatflow.scene.ingest`.
"""

from __future__ import annotations

from pathlib import Path

from splatflow.config import Params
from splatflow.paths import ScenePaths
from splatflow.scene.ingest import ingest
from splatflow.stage import stage_main


def source_path(params: Params, paths: ScenePaths) -> Path:
    """``base.scenes.<scene>.source``; relative paths are relative to the project root (where params.yaml is)."""
    src = Path(params.scene(paths.scene).source).expanduser()
    return src if src.is_absolute() else paths.root / src


def run(params: Params, paths: ScenePaths) -> dict:
    """Ingest one scene; returns the metrics dict (images_in, images_kept, rejected, ...)."""
    result = ingest(source_path(params, paths), paths.images_dir, params.ingest)
    kept, n_in = len(result.kept), result.images_in
    print(f"ingest [{paths.scene}]: kept {kept} of {n_in} {'frames' if result.source_kind == 'video' else 'files'}"
          f" -> {paths.images_dir}")
    for r in result.rejected:
        print(f"  rejected {r.file}: {r.reason}: {r.detail}")
    metrics = result.metrics()
    metrics["source"] = params.scene(paths.scene).source  # as written in params.yaml: same on every clone
    return metrics


def main(argv: list[str] | None = None) -> None:
    stage_main("ingest", run, argv, needs_threads=False)  # no numba/torch here


if __name__ == "__main__":
    main()
