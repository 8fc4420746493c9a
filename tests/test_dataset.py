"""load_scene reads a COLMAP model (here the synthetic ground truth) into the SceneData contract."""

import json

import numpy as np
import pytest

pytest.importorskip("pycolmap")

from splatflow.pipeline.errors import UserError
from splatflow.scene.dataset import load_scene
from splatflow.scene.synthetic import write_scene


@pytest.fixture(scope="module")
def scene_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("scene")
    write_scene(out, progress=False, seed=1, n_views=9, width=96, height=72, arc_deg=80.0, n_points=3000)
    return out


def test_loads_synthetic_ground_truth_as_in_the_contract(scene_dir):
    scene = load_scene(scene_dir)
    truth = json.loads((scene_dir / "ground_truth" / "cameras.json").read_text())["frames"]
    assert [v.name for v in scene.views] == [f["name"] for f in truth] == sorted(v.name for v in scene.views)
    for v, f in zip(scene.views, truth):
        assert v.image_path == scene_dir / "images" / f["name"] and v.image_path.exists()
        assert (v.width, v.height) == (96, 72)
        assert v.K.shape == (3, 3) and v.K.dtype == np.float64
        assert v.world_to_cam.shape == (4, 4) and v.world_to_cam.dtype == np.float64
        np.testing.assert_allclose(v.K, f["K"], atol=1e-9)
        np.testing.assert_allclose(v.world_to_cam, f["world_to_cam"], atol=1e-9)
    assert scene.points.dtype == np.float32 and scene.points.ndim == 2 and scene.points.shape[1] == 3
    assert scene.colors.dtype == np.uint8 and scene.colors.shape == scene.points.shape
    assert len(scene.points) > 100
    # Points lie inside the 8 x 8 x 3 m room.
    assert np.all(np.abs(scene.points[:, :2]) <= 4.0 + 1e-4)
    assert np.all((scene.points[:, 2] >= -1e-4) & (scene.points[:, 2] <= 3.0 + 1e-4))
    assert scene.train_views == scene.views and scene.test_views == []


def test_split_divides_views(scene_dir, tmp_path):
    split = tmp_path / "split.json"
    split.write_text(json.dumps({"train": ["0001.jpg", "0002.jpg", "0003.jpg"], "test": ["0000.jpg", "0008.jpg"],
                                 "rule": "every_nth:8"}))
    scene = load_scene(scene_dir, split)
    assert [v.name for v in scene.train_views] == ["0001.jpg", "0002.jpg", "0003.jpg"]
    assert [v.name for v in scene.test_views] == ["0000.jpg", "0008.jpg"]
    assert len(scene.views) == 9


@pytest.mark.parametrize("payload, match", [
    ({"train": ["0001.jpg", "nope.jpg"], "test": [], "rule": "x"}, "not registered"),
    ({"train": ["0001.jpg"], "test": ["0001.jpg"], "rule": "x"}, "both train and test"),
    ({"train": "0001.jpg"}, "expected"),
])
def test_bad_split_is_a_user_error(scene_dir, tmp_path, payload, match):
    split = tmp_path / "split.json"
    split.write_text(json.dumps(payload))
    with pytest.raises(UserError, match=match):
        load_scene(scene_dir, split)


def test_distorted_model_is_refused(scene_dir, tmp_path):
    gt = tmp_path / "s" / "ground_truth"
    gt.mkdir(parents=True)
    for name in ("images.txt", "points3D.txt"):
        (gt / name).write_text((scene_dir / "ground_truth" / name).read_text())
    (gt / "cameras.txt").write_text("1 SIMPLE_RADIAL 96 72 80 48 36 0.01\n")
    (tmp_path / "s" / "images").symlink_to(scene_dir / "images")
    with pytest.raises(UserError, match="PINHOLE"):
        load_scene(tmp_path / "s")


def test_missing_folder_or_model_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="sfm stage"):
        load_scene(tmp_path / "absent")
    with pytest.raises(UserError, match="no COLMAP model"):
        load_scene(tmp_path)
