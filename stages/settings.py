"""DVC stage `settings`: the scene's entry in params.yaml -> ``data/<scene>/settings/<stage>.json``, one per stage.

The first stage of every scene; each later stage depends on its own file rather than on the whole entry, so a
change of ``base.scenes.<scene>.params.export`` reruns export and report only
(:mod:`splatflow.pipeline.scene_settings`). It runs in every ``dvc repro`` (``always_changed``; its files are rewritten
with the same bytes, so nothing after it reruns for that): the whole params.yaml is checked there (a bad key in a
section the stages of this repro do not read still stops it), and so is the scene's source (a capture that is not there
stops the repro before DVC removes the ingest outputs).
"""

from __future__ import annotations

from splatflow.pipeline.config import Params
from splatflow.pipeline.errors import UserError
from splatflow.pipeline.paths import ScenePaths
from splatflow.pipeline.scene_settings import missing_source, write_settings
from splatflow.pipeline.stage import stage_main


def run(params: Params, paths: ScenePaths) -> dict:
    entry = params.scene(paths.scene)
    # This stage runs first in every `dvc repro` (always_changed in dvc.yaml): a capture that is not there stops
    # the repro here, before DVC removes the ingest outputs it would otherwise lose.
    problem = missing_source(paths.root, paths.scene, entry.source)
    if problem:
        raise UserError(f"{problem}\nNothing was run, and the scene's earlier outputs are untouched.")
    written = write_settings(entry, paths.settings_dir)
    own = sorted(entry.params or {})
    print(f"settings [{paths.scene}]: {len(written)} stage files -> {paths.settings_dir}"
          + (f" (this scene's own params: {', '.join(own)})" if own else ""))
    return {"stages": len(written)}


def main(argv: list[str] | None = None) -> None:
    # no MLflow run of its own: it runs in every repro; the first stage that does work opens the scene's run
    stage_main("settings", run, argv, needs_threads=False, record=False)


if __name__ == "__main__":
    main()
