"""Masks: checked and copied by ingest, no gradient from masked pixels, masked pixels left out of the metrics."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import cv2
import numpy as np
import pytest
import torch

from splatflow.pipeline.config import EvaluateConfig, TrainConfig, params_from_dict
from splatflow.pipeline.errors import UserError
from splatflow.scene.dataset import SceneData, View
from splatflow.scene.masks import ingest_masks, read_view_mask

W, H = 64, 48


def _cands(n=3, w=W, h=H):
    return [SimpleNamespace(source=f"IMG_{i}.JPG", out_name=f"IMG_{i}.jpg", width_px=w, height_px=h)
            for i in range(n)]


def _write_masks(d, names, w=W, h=H, left_black=True):
    d.mkdir(parents=True, exist_ok=True)
    for n in names:
        m = np.full((h, w), 255, np.uint8)
        if left_black:
            m[:, : w // 2] = 0
        cv2.imwrite(str(d / n), m)


def test_ingest_copies_binarised_masks_by_stem(tmp_path):
    src = tmp_path / "masks"
    _write_masks(src, ["IMG_0.png", "IMG_1.JPG.png", "IMG_2.JPG"])  # the three naming forms
    m = cv2.imread(str(src / "IMG_0.png"), cv2.IMREAD_GRAYSCALE)
    m[0, -1] = 200  # grey above 50%: kept
    cv2.imwrite(str(src / "IMG_0.png"), m)
    out = ingest_masks(src, _cands(), tmp_path / "data" / "masks")
    assert out == {"masks": 3, "mask_kept_fraction_mean": 0.5}
    got = sorted(p.name for p in (tmp_path / "data" / "masks").iterdir())
    assert got == ["IMG_0.png", "IMG_1.png", "IMG_2.png"]
    m0 = cv2.imread(str(tmp_path / "data" / "masks" / "IMG_0.png"), cv2.IMREAD_GRAYSCALE)
    assert set(np.unique(m0)) == {0, 255} and m0[0, -1] == 255 and m0[0, 0] == 0


def test_masks_of_sub_folder_images_mirror_the_folders(tmp_path):
    """Images read from sub-folders (cam_a/0000.jpg, output cam_a__0000.jpg) have their masks in the same
    sub-folders of the mask folder; a mask of another folder's image is not taken for them."""
    cands = [SimpleNamespace(source=f"{c}/0000.jpg", out_name=f"{c}__0000.jpg", width_px=W, height_px=H)
             for c in ("cam_a", "cam_b")]
    src = tmp_path / "masks"
    _write_masks(src / "cam_a", ["0000.png"])
    _write_masks(src / "cam_b", ["0000.png"], left_black=False)
    out = ingest_masks(src, cands, tmp_path / "data" / "masks")
    assert out == {"masks": 2, "mask_kept_fraction_mean": 0.75}
    assert sorted(p.name for p in (tmp_path / "data" / "masks").iterdir()) == ["cam_a__0000.png", "cam_b__0000.png"]
    (src / "cam_b" / "0000.png").rename(src / "0000.png")  # beside the folders: belongs to no cam_b image
    with pytest.raises(UserError, match=r"no mask for 1 image\(s\) \(e\.g\. cam_b/0000\.jpg\).*cam_b/0000\.png"):
        ingest_masks(src, cands, tmp_path / "data" / "masks")
    (src / "0000.png").rename(src / "cam_b" / "0000.png")
    _write_masks(src / "cam_b", ["0007.png"])
    with pytest.raises(UserError, match=r"match no image of the scene \(e\.g\. cam_b/0007\.png\)"):
        ingest_masks(src, cands, tmp_path / "data" / "masks")


@pytest.mark.parametrize("case, message", [
    ("missing", r"no mask for 1 image\(s\) \(e\.g\. IMG_2\.JPG\)"),
    ("size", r"IMG_1\.png: mask is 32x48 but its image IMG_1\.JPG is 64x48"),
    ("orphan", r"1 mask\(s\) match no image of the scene \(e\.g\. IMG_9\.png\)"),
    ("black", r"IMG_0\.png: the mask is black everywhere"),
    ("folder", r"mask folder not found"),
    ("unreadable", r"IMG_1\.png: cannot read this mask"),
])
def test_ingest_mask_errors_name_the_file_and_the_fix(tmp_path, case, message):
    src = tmp_path / "masks"
    _write_masks(src, ["IMG_0.png", "IMG_1.png", "IMG_2.png"])
    if case == "missing":
        (src / "IMG_2.png").unlink()
    elif case == "size":
        cv2.imwrite(str(src / "IMG_1.png"), np.full((H, W // 2), 255, np.uint8))
    elif case == "orphan":
        _write_masks(src, ["IMG_9.png"])
    elif case == "black":
        cv2.imwrite(str(src / "IMG_0.png"), np.zeros((H, W), np.uint8))
    elif case == "folder":
        src = tmp_path / "nowhere"
    elif case == "unreadable":
        (src / "IMG_1.png").write_bytes(b"not a png")
    out = tmp_path / "data" / "masks"
    with pytest.raises(UserError, match=message):
        ingest_masks(src, _cands(), out)
    assert not out.exists()


def _scene_with_masks(tmp_path, n_views=3):
    """Random-texture training views of a random model, each with a mask whose left half is black."""
    from tests.test_evaluate import cameras, make_model

    K, w2cs = cameras(n_views)
    rng = np.random.default_rng(1)
    img_dir, mask_dir = tmp_path / "images", tmp_path / "masks"
    img_dir.mkdir()
    _write_masks(mask_dir, [f"v{i}.png" for i in range(n_views)])
    views = []
    for i, w2c in enumerate(w2cs):
        cv2.imwrite(str(img_dir / f"v{i}.png"), rng.integers(0, 256, (H, W, 3), dtype=np.uint8))
        views.append(View(f"v{i}.png", img_dir / f"v{i}.png", W, H, K, w2c, mask_path=mask_dir / f"v{i}.png"))
    splats = make_model()
    pts = splats["means"].numpy()
    scene = SceneData(views=views, points=pts, colors=np.full((len(pts), 3), 128, np.uint8), train_views=views,
                      test_views=[])
    return scene


def _plain_cfg(**kw):
    return dataclasses.replace(
        params_from_dict({"train": {"max_steps": 5, "backend": "cpu", "patch_max_pixels": 0, "progress": False,
                                    "resolution": [{"factor": 1.0, "start_step": 0}],
                                    "blur": {"sigma_start_px": 0.0}, "early_stop": {"enabled": False},
                                    "densify": {"strategy": "none"}, "prune_during": {"enabled": False}}}).train,
        **kw)


@pytest.mark.parametrize("ssim_lambda", [0.0, 0.2])
def test_masked_pixels_get_no_gradient(tmp_path, ssim_lambda):
    from splatflow.train import Trainer

    scene = _scene_with_masks(tmp_path)
    grads = {}
    for masked in (True, False):
        sc = scene if masked else dataclasses.replace(
            scene, train_views=[dataclasses.replace(v, mask_path=None) for v in scene.views])
        tr = Trainer(sc, _plain_cfg(ssim_lambda=ssim_lambda), seed=0)
        orig, seen = tr.render, {}

        def render(*a, **k):
            rgb, target, info = orig(*a, **k)
            rgb.retain_grad()
            seen.update(rgb=rgb, target=target, mask=info["loss_mask"])
            return rgb, target, info

        tr.render = render
        row = tr.train_step()
        grads[masked] = seen["rgb"].grad  # [H, W, 3]
        if masked:
            keep = seen["mask"]
            assert keep.shape == (H, W) and not keep[:, : W // 2].any() and keep[:, W // 2:].all()
            if ssim_lambda == 0.0:  # the loss is the L1 mean over the KEPT pixels, not diluted by the masked ones
                err = (seen["rgb"].detach() - seen["target"]).abs()[keep].mean()
                assert row["loss"] == pytest.approx(float(err), rel=1e-5)
    g = grads[True]
    assert torch.count_nonzero(g[:, : W // 2]) == 0  # masked pixels: no gradient at all
    assert torch.count_nonzero(g[:, W // 2:]) > 0.9 * g[:, W // 2:].numel()
    assert torch.count_nonzero(grads[False][:, : W // 2]) > 0  # (without the mask they have one)


def test_masked_pixels_left_out_of_the_metrics(tmp_path):
    """Test images equal to the renders except a corrupted block inside the masked (black) half."""
    import splatflow.evaluation.evaluate as ev
    from tests.test_evaluate import build_scene

    paths, splats, test = build_scene(tmp_path / "p", n_views=8, test_every=4)
    from splatflow.scene.dataset import load_scene

    scene = load_scene(paths.undistorted_dir, paths.split_json)
    mdir = tmp_path / "masks"
    _write_masks(mdir, [n for n in test], w=48, h=36)
    for v in scene.test_views:
        img = cv2.imread(str(v.image_path))
        img[5:30, 2:20] = 255 - img[5:30, 2:20]  # only inside the masked left half (x < 24)
        cv2.imwrite(str(v.image_path), img)
    cfg = EvaluateConfig(lpips_variants=(), backend="cpu", save_renders=False)
    plain, _ = ev.evaluate(splats, 1, scene.test_views, cfg, progress=False)
    views = [dataclasses.replace(v, mask_path=mdir / v.name) for v in scene.test_views]
    masked, df = ev.evaluate(splats, 1, views, cfg, progress=False)
    assert plain["psnr"] < 20  # the corruption counts without the mask
    assert masked["psnr"] > 45 and masked["ssim"] > 0.99  # ... and not at all with it
    assert masked["protocol"]["masks"]["views"] == len(test)
    assert masked["protocol"]["masks"]["masked_fraction_mean"] == pytest.approx(0.5)
    assert "kept (white) pixels only" in masked["protocol"]["masks"]["rule"]


def test_mask_follows_the_undistortion(tmp_path):
    """A mask drawn on the distorted photo lands where the undistorted image shows the same scene point."""
    import pycolmap

    w, h = 640, 480
    cam = pycolmap.Camera.create_from_model_name(1, "SIMPLE_RADIAL", 500.0, w, h)
    cam.params = [500.0, 320.0, 240.0, -0.2]
    m = np.full((h, w), 255, np.uint8)
    m[420:440, 560:580] = 0  # a black square near a corner, where distortion moves pixels most
    cv2.imwrite(str(tmp_path / "m.png"), m)
    K_und = np.array([[500.0, 0, 320.0], [0, 500.0, 240.0], [0, 0, 1]])
    v = View("m.jpg", tmp_path / "x.jpg", w, h, K_und, np.eye(4), mask_path=tmp_path / "m.png", mask_camera=cam)
    keep = read_view_mask(v)
    ray = cam.cam_from_img(np.array([[570.0, 430.0]]))[0]  # centre of the square, distorted pixel -> ray
    u = K_und @ np.array([ray[0], ray[1], 1.0])
    x, y = int(u[0]), int(u[1])
    assert (x, y) != (570, 430)  # the distortion does move it
    assert not keep[y, x] and keep[240, 320] and keep[10, 10]
    # no distortion: the identity
    cam.params = [500.0, 320.0, 240.0, 0.0]
    keep0 = read_view_mask(dataclasses.replace(v, mask_camera=cam))
    np.testing.assert_array_equal(keep0, m >= 128)


def test_add_scene_records_masks_and_downscale(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from splatflow.cli import app
    from splatflow.pipeline.config import load_params
    from tests._project import REPO

    (tmp_path / "params.yaml").write_text((REPO / "params.yaml").read_text())
    (tmp_path / "dvc.yaml").write_text((REPO / "dvc.yaml").read_text())
    (tmp_path / "photos").mkdir()
    (tmp_path / "masks").mkdir()
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, ["add-scene", "g", "photos", "--masks", "masks", "--downscale", "4"])
    assert r.exit_code == 0, r.output
    s = load_params(tmp_path / "params.yaml").scene("g")
    assert s.masks == "masks" and s.resolution.downscale == 4
    r = CliRunner().invoke(app, ["add-scene", "h", "photos", "--downscale", "3"])
    assert r.exit_code == 2 and "base.scenes.h.resolution.downscale" in r.output
    r = CliRunner().invoke(app, ["add-scene", "k", "photos", "--masks", "nowhere"])
    assert r.exit_code == 2 and "not a folder" in r.output
