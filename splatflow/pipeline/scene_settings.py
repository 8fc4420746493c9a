"""Each stage's share of a scene's own entry in params.yaml, one small file per stage, so that DVC reruns only the
stages a change of that entry touches.

DVC tracks a params key as one value: every stage declared the whole ``base.scenes.<scene>`` entry, so changing a
scene's ``params: {export: ...}`` reran that scene's ingest, SfM and training too (it cannot declare
``base.scenes.<scene>.params.export``: DVC refuses a declared key the file lacks, and most scenes have none).
The ``settings`` stage declares the entry and writes ``data/<scene>/settings/<stage>.json`` for every stage; each
stage depends on its own file instead. A file holds the entry without its ``params`` (source, masks, resolution, ...:
every stage reads those or runs on what they decide) plus the scene's overrides of the sections that stage reads
(:data:`STAGE_PARAMS`), written so that equal settings give equal bytes: DVC then finds the other stages' files
unchanged and skips them.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from splatflow.pipeline.config import SceneSource

#: The params sections (or single keys) each stage reads besides ``base.*``: exactly what the stage declares
#: under ``params`` in dvc.yaml (tests/test_dvc_deps.py checks both agree). A scene's own override of one of them
#: changes that stage's settings file.
STAGE_PARAMS: dict[str, tuple[str, ...]] = {
    "ingest": ("ingest", "sfm.camera_mode"),
    "sfm": ("ingest.image_format", "sfm"),
    "split": ("split",),
    "train": ("train",),
    "prune": ("train", "prune"),
    "evaluate": ("evaluate",),
    "export": ("export",),
    "report": ("prune.max_psnr_drop_db", "evaluate.error_gain", "report"),
}


def stage_settings(entry: SceneSource, stage: str) -> dict:
    """``{"scene": the entry without params, "params": {declared key: this scene's override}}`` for ``stage``."""
    own = entry.params or {}
    picked = {}
    for key in STAGE_PARAMS[stage]:
        section, _, sub = key.partition(".")
        if section not in own:
            continue
        if not sub:
            picked[key] = own[section]
        elif isinstance(own[section], dict) and sub in own[section]:
            picked[key] = own[section][sub]
    scene = {k: v for k, v in dataclasses.asdict(entry).items() if k != "params"}
    return {"scene": scene, "params": picked}


def write_settings(entry: SceneSource, out_dir: str | Path) -> dict[str, Path]:
    """Write ``<out_dir>/<stage>.json`` for every stage of :data:`STAGE_PARAMS`; the bytes depend on the settings
    only (sorted keys), so an unchanged share leaves its file as it was."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for stage in STAGE_PARAMS:
        path = out_dir / f"{stage}.json"
        path.write_text(json.dumps(stage_settings(entry, stage), indent=1, sort_keys=True, default=str) + "\n")
        written[stage] = path
    return written


def missing_source(root: str | Path, scene: str, source: str) -> str | None:
    """One line naming a scene's ``source`` that does not exist and the fix, or None when it is there.

    Asked before DVC reaches the ingest stage (``splatflow run``, the reconstruct flow, and the ``settings`` stage,
    which runs first in every ``dvc repro``): DVC, finding ingest's source dependency missing, removes that stage's
    outputs -- the git-tracked ``metrics/<scene>/ingest.json`` included -- before it fails on the dependency."""
    root = Path(root)
    path = Path(source).expanduser()
    path = path if path.is_absolute() else root / path
    if path.exists():
        return None
    if scene == "demo" and Path(source) == Path("data/raw/demo/images"):
        fix = "write it with `splatflow demo-scene` (or run `make demo`)"
    else:
        fix = (f"connect the drive it is on, or fix the path in params.yaml (`splatflow add-scene {scene} PATH "
               f"--force` rewrites the entry)")
    return f"base.scenes.{scene}.source = {source}: {path} does not exist; {fix}"
