"""The working resolution on imported COLMAP datasets: a pinhole dataset's own images_N is used at downscale N,
a distorted one's is not (its files show the distorted photos), and masks follow the undistortion."""

from __future__ import annotations

import cv2
import numpy as np
import pycolmap
import pytest

from splatflow.pipeline.config import params_from_dict
from splatflow.scene.resolution import load_working_scene, read_view_rgb
from splatflow.scene.synthetic import write_scene
from tests._colmap_data import write_dataset

W, H = 200, 150


@pytest.fixture(scope="module")
def raw_scene(tmp_path_factory):
    d = tmp_path_factory.mktemp("raw")
    write_scene(d, progress=False, n_views=10, width=W, height=H, arc_deg=60.0, n_points=2000)
    return d


def _stages(root, dataset, scene_extra=None, resolution=None):
    from splatflow.pipeline.paths import ScenePaths
    from splatflow.scene.split import write_split
    from splatflow.pipeline.stage import write_metrics
    from stages import ingest as ingest_stage
    from stages import sfm as sfm_stage

    entry = {"source": str(dataset), "colmap": "sparse/0", **(scene_extra or {})}
    params = params_from_dict({"base": {"scenes": {"s": entry}, "resolution": resolution or {}}})
    paths = ScenePaths("s", root)
    write_metrics(paths, "ingest", ingest_stage.run(params, paths))
    sfm_stage.run(params, paths)
    write_split(paths.undistorted_dir, paths.split_json, params.split)
    return params, paths


def test_pinhole_dataset_trains_on_its_own_images_2(raw_scene, tmp_path):
    dataset = write_dataset(raw_scene, tmp_path / "ds", levels=(2,))
    params, paths = _stages(tmp_path / "proj", dataset, resolution={"downscale": 2})
    scene, info = load_working_scene(params, paths)
    assert info["image_source"] == "images_2" and info["sizes"] == [f"{W // 2}x{H // 2}"]
    v = scene.train_views[0]
    assert v.image_path == paths.data_dir / "images_2" / v.name
    full = np.asarray(pycolmap.Reconstruction(str(paths.undistorted_dir / "sparse")).cameras[1].calibration_matrix())
    np.testing.assert_allclose(v.K[:2], full[:2] * 0.5)
    lvl = cv2.cvtColor(cv2.imread(str(dataset / "images_2" / v.name)), cv2.COLOR_BGR2RGB)
    np.testing.assert_array_equal(read_view_rgb(v), lvl)
    # downscale 4 has no level in this dataset (ingest left images_4/ empty): area-downscaled
    scene, info = load_working_scene(params_from_dict({"base": {"scenes": {"s": {"source": str(dataset),
                                                                                "colmap": "sparse/0"}},
                                                                 "resolution": {"downscale": 4}}}), paths)
    assert info["image_source"].startswith("area-downscaled") and "no images_4/ level" in info["reason"]


def test_distorted_dataset_is_area_downscaled_and_masks_follow(raw_scene, tmp_path):
    dataset = write_dataset(raw_scene, tmp_path / "ds", levels=(2,), model="SIMPLE_RADIAL", extra_params=(0.08,))
    masks = tmp_path / "masks"
    masks.mkdir()
    for p in sorted((dataset / "images").iterdir()):
        m = np.full((H, W), 255, np.uint8)
        m[:, : W // 4] = 0  # the left quarter of every distorted photo is masked
        cv2.imwrite(str(masks / (p.stem + ".png")), m)
    params, paths = _stages(tmp_path / "proj", dataset, {"masks": str(masks)}, resolution={"downscale": 2})
    scene, info = load_working_scene(params, paths)
    assert info["image_source"].startswith("area-downscaled") and "SIMPLE_RADIAL" in info["reason"]
    assert info["masks"] is True
    v = scene.train_views[0]
    assert v.image_path.parent == paths.undistorted_dir / "images" and v.mask_camera is not None
    from splatflow.scene.masks import read_view_mask

    keep = read_view_mask(v)
    assert keep.shape == (v.height, v.width)
    # the undistorted image's left edge comes from the masked quarter, its right half from kept pixels
    assert not keep[:, 0].any() and keep[:, v.width // 2:].all()
