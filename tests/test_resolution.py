"""Working resolution: the 1600 px rule, downscale N, max_side_px, images_N levels and what evaluate.json states."""

from __future__ import annotations


import cv2
import numpy as np
import pytest

from splatflow.pipeline.config import ConfigError, ResolutionConfig, params_from_dict
from splatflow.scene.dataset import SceneData, View, load_scene
from splatflow.scene.resolution import apply_resolution, read_view_rgb, target_size
from splatflow.scene.images import ImageCache
from splatflow.scene.synthetic import write_colmap_text_model
from tests._project import stage_record

BIG_W, BIG_H = 3200, 2000  # a real capture's size class: above the 1600 px default


def _big_scene(tmp_path, w=BIG_W, h=BIG_H, n=2):
    """Views of one large textured image each (noise + gradients), a PINHOLE model and true camera poses."""
    rng = np.random.default_rng(0)
    root = tmp_path / "big"
    img_dir = root / "images"
    img_dir.mkdir(parents=True)
    K = np.array([[2800.0, 0, w / 2 + 3.0], [0, 2750.0, h / 2 - 5.0], [0, 0, 1]])
    names, w2cs = [], []
    for i in range(n):
        img = rng.integers(0, 256, (h // 8, w // 8, 3), dtype=np.uint8)
        img = cv2.resize(img, (w, h), interpolation=cv2.INTER_CUBIC)  # smooth texture at full size
        name = f"{i:04d}.png"
        cv2.imwrite(str(img_dir / name), img)
        names.append(name)
        w2c = np.eye(4)
        w2c[0, 3] = 0.1 * i
        w2cs.append(w2c)
    write_colmap_text_model(root / "sparse", K, w, h, names, w2cs, np.zeros((0, 3)), np.zeros((0, 3), np.uint8),
                            [[] for _ in names])
    return root, K


def _project(K, X):
    p = K @ X
    return p[:2] / p[2]


def test_config_is_strict_and_per_scene_overrides_base():
    p = params_from_dict({"base": {"resolution": {"downscale": 2},
                                   "scenes": {"a": {"source": "x", "resolution": {"max_side_px": 900}},
                                              "b": "y"}}})
    assert p.base.scene_resolution("a") == ResolutionConfig(max_side_px=900)
    assert p.base.scene_resolution("b").downscale == 2
    for bad, key in [({"downscale": 3}, "base.resolution.downscale"),
                     ({"downscale": 2, "max_side_px": 800}, "base.resolution"),
                     ({"max_side_px": 10}, "base.resolution.max_side_px"),
                     ({"downscale": True}, "base.resolution.downscale"),
                     ({"scale": 2}, "base.resolution.scale")]:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            params_from_dict({"base": {"resolution": bad}})
    with pytest.raises(ConfigError, match=r"base\.scenes\.a\.resolution\.downscale"):
        params_from_dict({"base": {"scenes": {"a": {"source": "x", "resolution": {"downscale": 16}}}}})


@pytest.mark.parametrize("cfg, size, rule", [
    (ResolutionConfig(), (1600, 1000), "default"),
    (ResolutionConfig(default_max_side_px=0), (BIG_W, BIG_H), "full resolution"),
    (ResolutionConfig(downscale=4), (800, 500), "downscale 4"),
    (ResolutionConfig(downscale=1), (BIG_W, BIG_H), "downscale 1"),
    (ResolutionConfig(max_side_px=1000), (1000, 625), "max_side_px 1000"),
    (ResolutionConfig(max_side_px=5000), (BIG_W, BIG_H), "smaller"),
])
def test_target_size_rules(cfg, size, rule):
    got, why = target_size(BIG_W, BIG_H, cfg)
    assert got == size and rule in why
    portrait, _ = target_size(BIG_H, BIG_W, cfg)  # the longest side rules, whichever it is
    assert portrait == (size[1], size[0])


@pytest.mark.parametrize("cfg, size", [(ResolutionConfig(), (1600, 1000)), (ResolutionConfig(downscale=4), (800, 500))])
def test_large_image_area_downscaled_with_consistent_intrinsics(tmp_path, cfg, size):
    root, K = _big_scene(tmp_path)
    scene, info = apply_resolution(load_scene(root), cfg)
    assert info["sizes"] == [f"{size[0]}x{size[1]}"] and info["full_sizes"] == [f"{BIG_W}x{BIG_H}"]
    assert info["image_source"].startswith("area-downscaled")
    v = scene.views[0]
    assert (v.width, v.height) == size and v.source_size == (BIG_W, BIG_H)
    s = size[0] / BIG_W
    # a 3D point lands on the same place of the picture: pixel coordinates scale with the image (continuous
    # convention, image spans [0, W]), so fx, fy, cx, cy all scale by W'/W
    X = np.array([0.3, -0.2, 4.0])
    np.testing.assert_allclose(_project(v.K, X), _project(K, X) * s, rtol=1e-12)
    np.testing.assert_allclose(v.K[[0, 1, 0, 1], [0, 1, 2, 2]], K[[0, 1, 0, 1], [0, 1, 2, 2]] * s)
    # the pixels: cv2.INTER_AREA of the full image, decoded on demand
    full = cv2.cvtColor(cv2.imread(str(v.image_path)), cv2.COLOR_BGR2RGB)
    np.testing.assert_array_equal(read_view_rgb(v), cv2.resize(full, size, interpolation=cv2.INTER_AREA))
    # and the training cache holds only working-size images, decoding each file once
    cache = ImageCache(scene.views, budget_mb=64)
    img, K1 = cache.get(0, 1.0)
    assert tuple(img.shape) == (size[1], size[0], 3) and cache.decodes == 1
    np.testing.assert_allclose(K1, v.K)
    cache.get(0, 0.5)
    assert cache.decodes == 1


def test_image_cache_window_is_the_crop_of_the_level(tmp_path):
    """A training window: only its pixels come back (cut before the float conversion), with the whole level's K,
    and ``shape`` gives the level's size without decoding."""
    import torch

    root, _ = _big_scene(tmp_path, w=640, h=480)
    scene = load_scene(root)
    cache = ImageCache(scene.views, budget_mb=64)
    assert cache.shape(0, 0.5) == (320, 240) and cache.decodes == 0
    level, K = cache.get(0, 0.5)
    assert tuple(level.shape) == (240, 320, 3)
    crop, Kw = cache.get(0, 0.5, window=(30, 20, 100, 70))
    assert tuple(crop.shape) == (70, 100, 3) and crop.dtype == torch.float32
    torch.testing.assert_close(crop, level[20:90, 30:130], rtol=0, atol=0)
    np.testing.assert_array_equal(Kw, K)
    assert cache.decodes == 1
    with pytest.raises(ValueError, match=r"window .* 320x240"):
        cache.get(0, 0.5, window=(300, 0, 40, 10))


def _level_scene(tmp_path, n, distorted: bool):
    """A scene folder like data/S: undistorted/ (PINHOLE), sparse/ (the SfM model) and images_N/ with the same
    file names. ``distorted``: the SfM camera is SIMPLE_RADIAL, so images_N (of the distorted photos) must not be
    used for the undistorted cameras."""
    root, K = _big_scene(tmp_path, w=640, h=480)
    data = tmp_path / "data"
    (data / "undistorted").mkdir(parents=True)
    root.rename(data / "undistorted" / "x")
    und = data / "undistorted"
    for sub in ("images", "sparse"):
        (und / "x" / sub).rename(und / sub)
    sparse = data / "sparse"
    sparse.mkdir()
    text = (und / "sparse" / "cameras.txt").read_text()
    if distorted:
        line = [x for x in text.splitlines() if x and not x.startswith("#")][0].split()
        text = text.replace(" ".join(line), f"1 SIMPLE_RADIAL 640 480 {line[4]} {line[6]} {line[7]} 0.05")
    (sparse / "cameras.txt").write_text(text)
    for f in ("images.txt", "points3D.txt"):
        (sparse / f).write_text((und / "sparse" / f).read_text())
    lvl = data / f"images_{n}"
    lvl.mkdir()
    for p in (und / "images").iterdir():
        img = cv2.imread(str(p))
        small = cv2.resize(img, (640 // n, 480 // n), interpolation=cv2.INTER_LINEAR)
        cv2.imwrite(str(lvl / p.name), 255 - small)  # distinguishable from an area-downscaled copy
    return data, K


def test_images_n_used_when_the_camera_needed_no_undistortion(tmp_path):
    data, K = _level_scene(tmp_path, 2, distorted=False)
    scene, info = apply_resolution(load_scene(data / "undistorted"), ResolutionConfig(downscale=2), data_dir=data,
                                   sparse_dir=data / "sparse", undistorted_model=data / "undistorted")
    assert info["image_source"] == "images_2" and "images_2" in info["reason"]
    v = scene.views[0]
    assert v.image_path == data / "images_2" / v.name and v.source_size is None and (v.width, v.height) == (320, 240)
    np.testing.assert_allclose(v.K[:2], K[:2] * 0.5)
    lvl = cv2.cvtColor(cv2.imread(str(data / "images_2" / v.name)), cv2.COLOR_BGR2RGB)
    np.testing.assert_array_equal(read_view_rgb(v), lvl)


def test_images_n_not_used_for_undistorted_cameras(tmp_path):
    data, _ = _level_scene(tmp_path, 2, distorted=True)
    scene, info = apply_resolution(load_scene(data / "undistorted"), ResolutionConfig(downscale=2), data_dir=data,
                                   sparse_dir=data / "sparse", undistorted_model=data / "undistorted")
    assert info["image_source"].startswith("area-downscaled")
    assert "SIMPLE_RADIAL" in info["reason"] and "undistorted" in info["reason"]
    v = scene.views[0]
    assert v.image_path.parent == data / "undistorted" / "images" and v.source_size == (640, 480)


def test_images_n_of_the_wrong_size_is_refused(tmp_path):
    data, _ = _level_scene(tmp_path, 4, distorted=False)
    scene, info = apply_resolution(load_scene(data / "undistorted"), ResolutionConfig(downscale=2), data_dir=data,
                                   sparse_dir=data / "sparse", undistorted_model=data / "undistorted")
    assert info["image_source"].startswith("area-downscaled") and "no images_2/ level" in info["reason"]
    (data / "images_2").mkdir()  # what ingest leaves for a dataset without the level: an empty folder
    scene, info = apply_resolution(load_scene(data / "undistorted"), ResolutionConfig(downscale=2), data_dir=data,
                                   sparse_dir=data / "sparse", undistorted_model=data / "undistorted")
    assert info["image_source"].startswith("area-downscaled") and "no images_2/ level" in info["reason"]
    (data / "images_2").rmdir()
    (data / "images_4").rename(data / "images_2")  # quarter-size files under the name of the half-size level
    scene, info = apply_resolution(load_scene(data / "undistorted"), ResolutionConfig(downscale=2), data_dir=data,
                                   sparse_dir=data / "sparse", undistorted_model=data / "undistorted")
    assert info["image_source"].startswith("area-downscaled") and "not 1/2 of 640x480" in info["reason"]


def test_wrong_file_size_is_a_clear_error(tmp_path):
    root, _ = _big_scene(tmp_path, w=640, h=480, n=1)
    scene, _ = apply_resolution(load_scene(root), ResolutionConfig(downscale=2))
    v = scene.views[0]
    cv2.imwrite(str(v.image_path), np.zeros((100, 100, 3), np.uint8))
    with pytest.raises(Exception, match=r"0000\.png: image is 100x100 but its camera says 320x240 or 640x480"):
        read_view_rgb(v)


def test_evaluate_json_states_resolution_source_and_8bit(tmp_path):
    """The evaluate stage at downscale 2 on a scene whose full-size (96x72) test images are renders of the model."""
    from splatflow.pipeline.stage import write_metrics
    from stages import evaluate as evaluate_stage
    from tests.test_evaluate import build_scene

    paths, splats, test = build_scene(tmp_path / "p", n_views=8, test_every=4, w=96, h=72)
    for quantize in (False, True):
        params = params_from_dict({"base": {"resolution": {"downscale": 2}},
                                   "evaluate": {"lpips_variants": [], "backend": "cpu", "quantize_8bit": quantize}})
        write_metrics(paths, "evaluate", evaluate_stage.run(params, paths))
        out = stage_record(paths.root, paths.scene, "evaluate")
        prot = out["protocol"]
        assert prot["image_sizes"] == ["48x36"]
        assert prot["resolution"]["sizes"] == ["48x36"] and prot["resolution"]["full_sizes"] == ["96x72"]
        assert prot["resolution"]["rule"] == "downscale 2"
        assert prot["resolution"]["image_source"].startswith("area-downscaled")
        assert prot["metrics_on_8bit_images"] is quantize and prot["masks"] is None
        # the 48x36 render against the area-downscaled 96x72 render of the same model: the same picture
        assert out["psnr"] > 25, out["psnr"]


def test_train_and_evaluate_at_downscale_2_through_dvc(tmp_path):
    """The tiny scene (320x240) through `dvc repro` at downscale 2: train, prune and evaluate work at 160x120,
    the metrics say so, and every stage reports its peak memory."""
    from tests._project import dvc, make_project, stage_record

    root = make_project(tmp_path / "proj", overrides={
        "base": {"resolution": {"downscale": 2, "max_side_px": None, "default_max_side_px": 1600}},
        "train": {"max_steps": 60, "progress": False},
        "prune": {"phases": 1, "finetune_steps": 5, "progress": False, "min_train_views": 0},
        "evaluate": {"lpips_variants": []}})
    dvc(root, "repro", "evaluate@tiny")
    m = {s: stage_record(root, "tiny", s)
         for s in ("ingest", "sfm", "split", "train", "prune", "evaluate")}
    for stage, metrics in m.items():
        assert metrics["peak_rss_mb"] > 50, stage
    assert m["sfm"]["matcher"] == "exhaustive"
    for stage in ("train", "prune"):
        assert m[stage]["resolution"]["sizes"] == ["160x120"], stage
        assert m[stage]["resolution"]["rule"] == "downscale 2"
    prot = m["evaluate"]["protocol"]
    assert prot["image_sizes"] == ["160x120"] and prot["resolution"]["sizes"] == ["160x120"]
    assert prot["resolution"]["image_source"].startswith("area-downscaled")  # our own SfM undistorts
    assert m["evaluate"]["psnr"] > 12
    renders = sorted((root / "data/tiny/renders").glob("*.png"))
    assert renders and cv2.imread(str(renders[0])).shape == (120, 3 * 160, 3)
    # changing the resolution reruns train, prune and evaluate, not ingest/sfm/split
    import re

    import yaml

    params = yaml.safe_load((root / "params.yaml").read_text())
    params["base"]["resolution"]["downscale"] = 4
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    out = dvc(root, "status").stdout
    changed = set(re.findall(r"^(\w+)@tiny:", out, flags=re.M))
    assert {"train", "prune", "evaluate"} <= changed and not changed & {"ingest", "sfm", "split"}, out
