"""A tiny generated scene with its TRUE cameras and points (no SfM) and a fixed split, for training tests: the
scene (``scene_dir`` and ``scene``, module-scoped fixtures: import them into a test module), the train settings
the training tests start from, and the PSNR of renders against the views' photos."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

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


@pytest.fixture(scope="module")
def scene_dir(tmp_path_factory):
    return write_tiny_scene(tmp_path_factory.mktemp("tiny_scene"))


@pytest.fixture(scope="module")
def scene(scene_dir):
    from splatflow.scene.dataset import load_scene

    return load_scene(scene_dir, scene_dir / "split.json")


def tiny_train_cfg(max_steps: int = 300):
    """CPU training for ``max_steps`` on the tiny scene: the SH degree rising over the run, a refine every 25 steps,
    no opacity reset, no progress bar, and no pruning during training (tests/test_prune_during.py tests it)."""
    from splatflow.pipeline.config import TrainConfig

    cfg = TrainConfig(max_steps=max_steps, backend="cpu", progress=False, sh_degree_interval=max(1, max_steps // 4))
    return replace(cfg, densify=replace(cfg.densify, refine_every=25, reset_every=0),
                   prune_during=replace(cfg.prune_during, enabled=False))


def mean_view_psnr(splats, views, sh_degree) -> float:
    """Mean PSNR (dB) of the renders of ``views`` against their image files."""
    import cv2
    import numpy as np
    import torch

    from splatflow.gaussians.model import Splats, render_view

    vals = []
    with torch.no_grad():
        for v in views:
            target = torch.from_numpy(cv2.imread(str(v.image_path))[..., ::-1].copy()).float() / 255.0
            rgb = render_view(Splats.of(splats), v, sh_degree, "cpu")  # [H, W, 3] in [0, 1]
            vals.append(-10 * math.log10(float(((rgb - target) ** 2).mean())))
    return float(np.mean(vals))
