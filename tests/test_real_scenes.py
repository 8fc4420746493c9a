"""The real Strecha photos (fountain-P11, 3072x2048) through all seven stages with DVC at downscale 4 (slow).

Skipped when ``../shared/data/strecha`` (or ``$SPLATFLOW_STRECHA_DIR``) is absent: the photos are research data
that the repository does not ship. Step counts are small: this checks that a real capture runs end to end at the
protocol's resolution, not the quality (bench/real_scenes.py measures that with the default params).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from tests._project import REPO, dvc, make_project, stage_record

STRECHA = Path(os.environ.get("SPLATFLOW_STRECHA_DIR", REPO.parent / "shared" / "data" / "strecha"))
SCENE = STRECHA / "fountain-P11"

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (SCENE / "images").is_dir(),
                                 reason=f"{SCENE} is absent (real photos are not shipped with the repository)")]


def test_fountain_through_seven_stages_at_downscale_4(tmp_path):
    root = make_project(tmp_path / "proj", generate=False, overrides={
        "base": {"resolution": {"downscale": 4, "max_side_px": None, "default_max_side_px": 1600}},
        "train": {"max_steps": 300, "progress": False},
        "prune": {"phases": 1, "finetune_steps": 20, "progress": False, "min_train_views": 0},
        "evaluate": {"lpips_variants": []}})
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["base"]["scenes"] = {"fountain": {"source": str(SCENE / "images"),
                                             "ground_truth": str(SCENE / "gt_dense_cameras")}}
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    dvc(root, "repro", "evaluate@fountain", "export@fountain")  # the seven stages (report needs the web build)
    m = {s: stage_record(root, "fountain", s)
         for s in ("ingest", "sfm", "split", "train", "prune", "evaluate", "export")}
    assert m["ingest"]["images_kept"] == 11  # K.txt in the folder is rejected as not an image
    assert m["sfm"]["images_registered"] == 11 and m["sfm"]["camera_center_error_rel"] < 0.01
    assert m["sfm"]["matcher"] == "exhaustive"
    assert m["train"]["resolution"]["sizes"] == ["768x512"]  # 3073x2047 undistorted / 4
    prot = m["evaluate"]["protocol"]
    assert prot["resolution"]["rule"] == "downscale 4" and prot["image_sizes"] == ["768x512"]
    assert m["evaluate"]["test_views"] == 2 and m["evaluate"]["psnr"] > 15
    assert m["export"]["files"]["ply"]["gaussians"] == m["evaluate"]["gaussians"]
    for stage, metrics in m.items():
        assert metrics["peak_rss_mb"] > 50, stage
    # working-size images only: training 11 views at 768x512 stays far below the full-size decode of them all
    assert m["train"]["peak_rss_mb"] < 3000
