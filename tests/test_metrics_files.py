"""The metrics files hold numbers only: after a real `dvc repro` of a tiny scene every value of every
metrics/S/*.json is an int or a float (what `dvc metrics show`/`diff` and `dvc exp show` can put in a cell), the
texts and lists are in metrics/S/info/<stage>.json, and the headline file is one narrow row."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from splatflow.pipeline import records
from splatflow.pipeline.paths import ScenePaths
from tests._project import REPO, dvc


def _leaves(d: dict, pre: str = ""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _leaves(v, f"{pre}{k}.")
        else:
            yield f"{pre}{k}", v


def test_split_keeps_numbers_and_moves_the_rest_under_the_same_keys():
    record = {"psnr": 26.1, "steps": 10, "lpips_alex": None, "stopped": "max_steps", "undistorted": False,
              "cameras": [{"model": "PINHOLE", "width": 320}], "nan": float("nan"),
              "device": {"backend": "cpu", "gpu_mib": None, "threads": 2}, "empty": {},
              "image_sizes": records.Info({"320x240": 36})}
    numbers, info = records.split(record)
    assert numbers == {"psnr": 26.1, "steps": 10, "device": {"threads": 2}}
    assert info == {"lpips_alex": None, "stopped": "max_steps", "undistorted": False,
                    "cameras": [{"model": "PINHOLE", "width": 320}], "nan": None,
                    "device": {"backend": "cpu", "gpu_mib": None}, "empty": {}, "image_sizes": {"320x240": 36}}
    assert records.merge(numbers, info) == {**record, "nan": None}


@pytest.mark.slow
def test_every_metrics_file_of_a_real_run_holds_numbers_only(reconstructed):
    paths = ScenePaths("tiny", reconstructed)
    stages = list(yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"])
    files = {f.name for f in paths.metrics_dir.glob("*.json")}
    assert files == {f"{s}.json" for s in stages} | {"headline.json"}
    for name in sorted(files):
        data = json.loads((paths.metrics_dir / name).read_text())
        assert data, name
        for key, value in _leaves(data):
            assert isinstance(value, (int, float)) and not isinstance(value, bool), f"{name}: {key} = {value!r}"
            assert math.isfinite(value), f"{name}: {key} = {value!r}"
    for stage in stages:  # the rest of each result: beside it, under the same keys
        assert paths.info_json(stage).is_file(), stage
    info = records.read_info(paths, "evaluate")
    assert info["device"]["backend"] == "cpu" and "psnr" in info["protocol"]
    assert records.read_info(paths, "train")["stopped"] == "max_steps"
    assert records.read_info(paths, "sfm")["matcher"] == "exhaustive"

    ev, tr = records.read_numbers(paths, "evaluate"), records.read_numbers(paths, "train")
    head = json.loads((paths.metrics_dir / "headline.json").read_text())
    assert head == {name: {"evaluate": ev, "train": tr}[stage][key]
                    for name, (stage, key) in records.HEADLINE.items() if key in {"evaluate": ev, "train": tr}[stage]}
    assert {"test_psnr", "test_ssim", "gaussians_final", "train_s"} <= set(head)

    # the documented command: one row per scene within 120 columns
    shown = dvc(reconstructed, "metrics", "show", "metrics/tiny/headline.json").stdout
    assert "test_psnr" in shown and max(len(line) for line in shown.splitlines()) <= 120, shown
