"""The SfM model's fitness measures that need no reconstruction: the camera path's jump (sfm.json)."""

import numpy as np

from splatflow.scene.fitness import JUMP_RATIO, camera_path_jump, fitness_warning


def _walk(n=60):
    t = np.linspace(0, 2 * np.pi, n, endpoint=False)
    return [f"{i:04d}.jpg" for i in range(n)], np.c_[np.cos(t), np.sin(t), np.zeros(n)]


def test_an_even_walk_around_has_no_jump():
    names, centers = _walk()
    out = camera_path_jump(names, centers)
    assert out["camera_path_jump_ratio"] < 1.5
    assert "camera_path_jump_between" not in out
    assert fitness_warning({"fitness_poor": 0, **out}) is None


def test_a_walk_posed_apart_halfway_is_a_jump_named_by_its_photos():
    names, centers = _walk()
    centers[30:] += [0.0, 0.0, 2.0]  # the second half of the walk shifted: drift the matcher could not close
    order = np.random.default_rng(0).permutation(len(names))  # the model's image order is not the name order
    out = camera_path_jump([names[i] for i in order], centers[order])
    assert out["camera_path_jump_ratio"] >= JUMP_RATIO
    assert out["camera_path_jump_between"] == "0029.jpg -> 0030.jpg"
    msg = fitness_warning({"fitness_poor": 1, **out})
    assert "0029.jpg and 0030.jpg" in msg


def test_a_small_jump_against_the_extent_is_not_one():
    names, centers = _walk()
    centers[30:] += [0.0, 0.0, 0.08]  # 0.08 units where the walk spans 2: a step up, not a walk posed apart
    out = camera_path_jump(names, centers)
    assert "camera_path_jump_between" not in out


def test_too_few_cameras_give_no_measure():
    names, centers = _walk(3)
    assert camera_path_jump(names, centers) == {}


def test_auto_mapping_is_global_past_the_exhaustive_limit_and_a_set_value_holds():
    from splatflow.pipeline.config import SfmConfig
    from splatflow.scene.sfm import choose_mapper

    cfg = SfmConfig()  # mapper auto, exhaustive_max_images 120
    assert choose_mapper(cfg, 36) == "incremental"
    assert choose_mapper(cfg, 120) == "incremental"
    assert choose_mapper(cfg, 252) == "global"
    assert choose_mapper(SfmConfig(mapper="incremental"), 252) == "incremental"
    assert choose_mapper(SfmConfig(mapper="global"), 36) == "global"


def test_an_even_error_points_at_the_camera_model_and_a_patchy_one_does_not():
    """A high mean reprojection error spread evenly over the images (a phone's focal length moving between shots
    under one shared camera) gets the per-image camera advice; one from a share of misplaced photos gets only the
    matcher advice."""
    even = {"fitness_poor": 1, "mean_reprojection_error_px": 0.89, "image_reprojection_error_px_median": 0.98,
            "image_reprojection_error_px_p90": 1.03, "images_poorly_placed_fraction": 0.0}
    msg = fitness_warning(even)
    assert "spread evenly" in msg and "sfm.camera_mode: per_image" in msg and "sfm.matcher" in msg
    patchy = {**even, "image_reprojection_error_px_p90": 2.4, "images_poorly_placed_fraction": 0.2}
    msg = fitness_warning(patchy)
    assert "per_image" not in msg and "sfm.matcher" in msg and "20% of the images" in msg
