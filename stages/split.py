"""DVC stage `split`: ``data/<scene>/undistorted/`` -> ``data/<scene>/split.json`` (+ ``metrics/<scene>/split.json``).

Thin shell: the rule and why it is the standard one live in :mod:`splatflow.scene.split`.
"""

from __future__ import annotations

from splatflow.pipeline.config import Params
from splatflow.pipeline.paths import ScenePaths
from splatflow.scene.split import write_split
from splatflow.pipeline.stage import stage_main


def run(params: Params, paths: ScenePaths) -> dict:
    split = write_split(paths.undistorted_dir, paths.split_json, params.split)
    print(f"split [{paths.scene}]: {len(split['train'])} train, {len(split['test'])} test ({split['rule']}) "
          f"-> {paths.split_json}")
    return {"train_views": len(split["train"]), "test_views": len(split["test"])}


def main(argv: list[str] | None = None) -> None:
    stage_main("split", run, argv, needs_threads=False)


if __name__ == "__main__":
    main()
