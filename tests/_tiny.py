"""A tiny generated scene with its TRUE cameras and points (no SfM) and a fixed split, for training tests."""

from __future__ import annotations

import json
from pathlib import Path

TEST_IDS = (3, 7)  # interior views: never trained on


def write_tiny_scene(d: Path, width: int = 96, height: int = 72, n_points: int = 3000) -> Path:
    """10 views on a 60 degree arc of the synthetic room in ``d``, with ``d/split.json`` (test views 3 and 7)."""
    from splatflow.render import configure_threads
    from splatflow.scene.synthetic import write_scene

    configure_threads(2)
    write_scene(d, progress=False, n_views=10, width=width, height=height, arc_deg=60, n_points=n_points,
                supersample=1)
    names = sorted(p.name for p in (d / "images").iterdir())
    split = {"train": [n for i, n in enumerate(names) if i not in TEST_IDS],
             "test": [names[i] for i in TEST_IDS], "rule": "test: interior views 3 and 7"}
    (d / "split.json").write_text(json.dumps(split))
    return d
