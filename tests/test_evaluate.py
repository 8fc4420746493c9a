"""The evaluate stage on a constructed scene whose test images are renders of the model itself.

Training images are written as undecodable bytes, so opening any of them would fail the run; the image reader is
also instrumented to list every file it opened.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from PIL import Image

import splatflow.evaluation.evaluate as ev
from splatflow.pipeline.config import params_from_dict
from splatflow.evaluation.lpips import BACKBONE_FILES, LPIPS, LpipsSet
from splatflow.gaussians.model import Splats, render_view, save_checkpoint
from splatflow.pipeline.paths import ScenePaths
from splatflow.scene.synthetic import write_colmap_text_model
from splatflow.pipeline.stage import write_metrics
from stages import evaluate as evaluate_stage
from tests._project import stage_record

W, H = 48, 36


def make_model(n=150, seed=0):
    g = torch.Generator().manual_seed(seed)
    means = torch.rand(n, 3, generator=g) * torch.tensor([4.0, 3.0, 2.0]) + torch.tensor([-2.0, -1.5, 3.0])
    return {"means": means, "quats": torch.randn(n, 4, generator=g),
            "scales": torch.full((n, 3), -1.6) + 0.3 * torch.randn(n, 3, generator=g),
            "opacities": torch.full((n,), 1.5), "sh0": torch.randn(n, 1, 3, generator=g) * 0.8,
            "shN": torch.randn(n, 3, 3, generator=g) * 0.05}


def cameras(n_views, w=W, h=H):
    K = np.array([[40.0 * w / W, 0, w / 2], [0, 40.0 * w / W, h / 2], [0, 0, 1]])
    w2cs = []
    for i in range(n_views):
        w2c = np.eye(4)
        w2c[0, 3] = -0.6 + 1.2 * i / max(n_views - 1, 1)  # cameras slide along x, looking along +z
        w2cs.append(w2c)
    return K, w2cs


def build_scene(root, n_views, test_every, w=W, h=H):
    """Undistorted scene + split + checkpoint under ``root``; test images = 8-bit renders of the model."""
    paths = ScenePaths("t", root)
    splats = make_model()
    save_checkpoint(paths.prune_ckpt, {"splats": splats, "sh_degree": 1, "step": 1})
    K, w2cs = cameras(n_views, w, h)
    names = [f"img_{i:03d}.png" for i in range(n_views)]
    write_colmap_text_model(paths.undistorted_dir / "sparse", K, w, h, names, w2cs, np.zeros((0, 3)),
                            np.zeros((0, 3), np.uint8), [[] for _ in names])
    test = [n for i, n in enumerate(names) if i % test_every == 0]
    train = [n for n in names if n not in test]
    paths.split_json.parent.mkdir(parents=True, exist_ok=True)
    paths.split_json.write_text(json.dumps({"train": train, "test": test, "rule": f"index % {test_every} == 0"}))
    img_dir = paths.undistorted_dir / "images"
    img_dir.mkdir(parents=True, exist_ok=True)
    model = Splats.of(splats)
    from splatflow.scene.dataset import View
    for name, w2c in zip(names, w2cs):
        if name in test:
            v = View(name, img_dir / name, w, h, K, w2c)
            img = (render_view(model, v, 1, "cpu").numpy() * 255 + 0.5).astype(np.uint8)
            Image.fromarray(img).save(img_dir / name, compress_level=1)
        else:
            (img_dir / name).write_bytes(b"training image: evaluation must never open this")
    return paths, splats, test


def alex_trunk_dir(tmp_path):
    d = tmp_path / "hub"
    d.mkdir()
    torch.manual_seed(0)
    torch.save({"features." + k: v for k, v in LPIPS("alex").features.state_dict().items()},
               d / BACKBONE_FILES["alex"])
    return d


@pytest.fixture
def opened(monkeypatch):
    seen = []
    real = ev.read_rgb

    def spy(path, width, height):
        seen.append(path.name)
        return real(path, width, height)

    monkeypatch.setattr(ev, "read_rgb", spy)
    return seen


def test_render_equal_to_gt_scores_perfect_and_only_test_views_are_read(tmp_path, opened):
    paths, splats, test = build_scene(tmp_path / "p", n_views=12, test_every=4)
    hub = alex_trunk_dir(tmp_path)
    params = params_from_dict({"evaluate": {"lpips_variants": ["lpips_alex", "lpips_vgg"],
                                            "lpips_backbone_dir": str(hub), "backend": "cpu"}})
    summary = evaluate_stage.run(params, paths)
    write_metrics(paths, "evaluate", summary)

    assert sorted(opened) == sorted(test)  # training images (undecodable bytes) were never opened
    out = stage_record(paths.root, paths.scene, "evaluate")
    assert out["test_views"] == 3 and out["gaussians"] == 150
    assert out["psnr"] > 45  # only 8-bit rounding of the ground truth differs
    assert out["ssim"] > 0.995
    assert 0 <= out["lpips_alex"] < 0.01
    assert out["lpips_vgg"] is None and BACKBONE_FILES["vgg"] in out["protocol"]["lpips_null_reasons"]["lpips_vgg"]
    assert out["fps"] > 0 and out["model_size_mb"] > 0 and out["peak_rss_mb_evaluate"] > 0
    assert out["protocol"]["split_rule"] == "index % 4 == 0" and out["protocol"]["image_sizes"] == ["48x36"]

    import pandas as pd
    df = ev.per_view_schema().validate(pd.read_csv(paths.per_view_csv))
    assert list(df["view"]) == sorted(test) and df["lpips_vgg"].isna().all()
    pngs = sorted(p.name for p in paths.renders_dir.glob("*.png"))
    assert pngs == sorted(n.replace(".png", ".png") for n in test)
    assert Image.open(paths.renders_dir / pngs[0]).size == (3 * W, H)  # render | gt | error


def test_metrics_respond_to_a_wrong_model(tmp_path):
    paths, splats, test = build_scene(tmp_path / "p", n_views=8, test_every=4)
    from splatflow.scene.dataset import load_scene
    scene = load_scene(paths.undistorted_dir, paths.split_json)
    cfg = params_from_dict({"evaluate": {"lpips_variants": ["lpips_alex"], "backend": "cpu"}}).evaluate
    lp = LpipsSet(["lpips_alex"], alex_trunk_dir(tmp_path))
    good, _ = ev.evaluate(splats, 1, scene.test_views, cfg, progress=False, lpips=lp)
    bad_splats = {**splats, "sh0": splats["sh0"] + 0.4}  # every colour off by ~0.11
    bad, _ = ev.evaluate(bad_splats, 1, scene.test_views, cfg, progress=False, lpips=lp)
    assert good["psnr"] - bad["psnr"] > 15 and bad["psnr"] < 30
    assert bad["ssim"] < good["ssim"] and bad["lpips_alex"] > good["lpips_alex"]


def test_memory_flat_across_many_views(tmp_path):
    w, h, n = 192, 144, 32
    paths, splats, test = build_scene(tmp_path / "p", n_views=n, test_every=1, w=w, h=h)
    from splatflow.scene.dataset import load_scene
    scene = load_scene(paths.undistorted_dir, paths.split_json)
    cfg = params_from_dict({"evaluate": {"lpips_variants": ["lpips_alex"], "backend": "cpu",
                                         "save_renders": True}}).evaluate
    lp = LpipsSet(["lpips_alex"], alex_trunk_dir(tmp_path))
    _, df = ev.evaluate(splats, 1, scene.test_views, cfg, renders_dir=tmp_path / "r", progress=False, lpips=lp)
    assert len(df) == n and math.isfinite(df["psnr"].min())
    rss = df["rss_mb"].to_numpy()
    # Keeping each view's (render, gt) pair alive would add 2 * h * w * 3 float32 per view (~0.63 MB here, ~20 MB
    # over the last 24 views). After a few views of allocator warm-up, growth must stay well below that.
    pair_mb = 2 * h * w * 3 * 4 / 2**20
    growth = rss[8:].max() - rss[7]
    assert growth < 0.3 * pair_mb * (n - 8), (growth, rss)


def test_no_test_views_is_a_user_error(tmp_path):
    from splatflow.pipeline.errors import UserError

    cfg = params_from_dict({}).evaluate
    with pytest.raises(UserError, match="no test views"):
        ev.evaluate(make_model(), 1, [], cfg, progress=False)


def test_8bit_quantised_render_reproduces_the_saved_ground_truth_exactly(tmp_path):
    """The ground truth here is the 8-bit PNG of the same render, so with quantize_8bit the pair is identical."""
    paths, splats, test = build_scene(tmp_path / "p", n_views=8, test_every=4)
    from splatflow.scene.dataset import load_scene
    scene = load_scene(paths.undistorted_dir, paths.split_json)
    cfg = params_from_dict({"evaluate": {"lpips_variants": ["lpips_alex"], "backend": "cpu",
                                         "quantize_8bit": True}}).evaluate
    summary, df = ev.evaluate(splats, 1, scene.test_views, cfg, progress=False, lpips=LpipsSet([], None))
    assert (df["psnr"] == math.inf).all() and summary["psnr"] == math.inf
    assert summary["protocol"]["render_quantized_8bit"] is True and "inf" in summary["protocol"]["note"]
    assert df["ssim"].min() > 0.99999


def test_summary_line_without_lpips_has_no_empty_item():
    """With `evaluate.lpips_variants: []` (a quick run) the console line read `SSIM 0.5436, ; 56.5 FPS`."""
    summary = {"test_views": 3, "psnr": 21.714, "ssim": 0.54361, "fps": 56.49, "gaussians": 463,
               "lpips_alex": 0.12345, "lpips_vgg": None}
    assert evaluate_stage.summary_line(summary, []) == \
        "3 test views: PSNR 21.71 dB, SSIM 0.5436; 56.5 FPS, 463 Gaussians"
    assert evaluate_stage.summary_line(summary, ["lpips_alex", "lpips_vgg"]) == \
        "3 test views: PSNR 21.71 dB, SSIM 0.5436, lpips_alex 0.1235, lpips_vgg n/a; 56.5 FPS, 463 Gaussians"
