"""DVC stage `settings`: the scene's entry in params.yaml -> ``data/<scene>/settings/<stage>.json``, one per stage.

The first stage of every scene; each later stage depends on its own file rather than on the whole entry, so a
change of ``base.scenes.<scene>.params.export`` reruns export and report only (:mod:`splatflow.scene_settings`).
"""

from __future__ import annotations

from splatflow.config import Params
from splatflow.paths import ScenePaths
from splatflow.scene_settings import write_settings
from splatflow.stage import stage_main


def run(params: Params, paths: ScenePaths) -> dict:
    entry = params.scene(paths.scene)
    written = write_settings(entry, paths.settings_dir)
    own = sorted(entry.params or {})
    print(f"settings [{paths.scene}]: {len(written)} stage files -> {paths.settings_dir}"
          + (f" (this scene's own params: {', '.join(own)})" if own else ""))
    return {"stages": len(written)}


def main(argv: list[str] | None = None) -> None:
    stage_main("settings", run, argv, needs_threads=False)


if __name__ == "__main__":
    main()
