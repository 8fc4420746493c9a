"""Gaussian initialisation from SfM points, scene scale and checkpoint I/O (splatflow.model)."""

import math

import numpy as np
import pytest
import torch

from splatflow.errors import UserError
from splatflow.model import (SH_C0, init_splats, knn_mean_distance, load_splats, save_checkpoint, scene_scale)


def test_knn_mean_distance_matches_brute_force_across_chunks():
    rng = np.random.default_rng(0)
    pts = rng.normal(size=(700, 3)).astype(np.float32)
    d = np.linalg.norm(pts[:, None] - pts[None], axis=-1)  # [P, P]
    np.fill_diagonal(d, np.inf)
    expected = np.sort(d, axis=1)[:, :3].mean(axis=1)
    got = knn_mean_distance(pts, k=3, chunk=128)  # several chunks
    np.testing.assert_allclose(got, expected, rtol=1e-5)


def test_init_splats_layout_and_values():
    rng = np.random.default_rng(1)
    pts = rng.uniform(-1, 1, (50, 3)).astype(np.float32)
    cols = rng.integers(0, 256, (50, 3)).astype(np.uint8)
    s = init_splats(pts, cols, sh_degree=3, init_opacity=0.1)
    assert s["means"].shape == (50, 3) and s["quats"].shape == (50, 4) and s["scales"].shape == (50, 3)
    assert s["opacities"].shape == (50,) and s["sh0"].shape == (50, 1, 3) and s["shN"].shape == (50, 15, 3)
    assert all(v.dtype == torch.float32 for v in s.values())
    torch.testing.assert_close(s["quats"], torch.tensor([[1.0, 0, 0, 0]]).expand(50, 4))
    torch.testing.assert_close(torch.sigmoid(s["opacities"]), torch.full((50,), 0.1))
    # isotropic, equal to the mean distance to the 3 nearest neighbours
    torch.testing.assert_close(torch.exp(s["scales"][:, 0]), torch.from_numpy(knn_mean_distance(pts)))
    assert torch.equal(s["scales"][:, 0], s["scales"][:, 2])
    # the DC term evaluates back to the point colour (gsplat: rgb = SH_C0 * sh0 + 0.5)
    torch.testing.assert_close(SH_C0 * s["sh0"][:, 0] + 0.5, torch.from_numpy(cols / 255.0).float())
    assert float(s["shN"].abs().sum()) == 0.0
    assert init_splats(pts, cols, sh_degree=1)["shN"].shape == (50, 3, 3)


def test_init_splats_rejects_too_few_or_bad_points():
    with pytest.raises(UserError, match="at least 4 SfM points"):
        init_splats(np.zeros((2, 3), np.float32), np.zeros((2, 3), np.uint8))
    bad = np.ones((10, 3), np.float32)
    bad[3, 1] = np.nan
    with pytest.raises(UserError, match="NaN"):
        init_splats(bad, np.zeros((10, 3), np.uint8))


def test_scene_scale_from_camera_centres():
    # cameras on a circle of radius 2 around (5, 0, 1), rotated arbitrarily: extent = 1.1 x 2
    w2cs = []
    for a in np.linspace(0, 2 * np.pi, 8, endpoint=False):
        c = np.array([5 + 2 * math.cos(a), 2 * math.sin(a), 1.0])
        R = np.array([[math.cos(a), -math.sin(a), 0], [math.sin(a), math.cos(a), 0], [0, 0, 1.0]])
        w2c = np.eye(4)
        w2c[:3, :3] = R
        w2c[:3, 3] = -R @ c
        w2cs.append(w2c)
    assert scene_scale(np.stack(w2cs)) == pytest.approx(2.2, rel=1e-9)


def test_checkpoint_roundtrip_and_atomic_write(tmp_path):
    rng = np.random.default_rng(2)
    s = init_splats(rng.normal(size=(20, 3)).astype(np.float32), np.full((20, 3), 128, np.uint8))
    path = tmp_path / "m" / "ckpt.pt"
    save_checkpoint(path, {"splats": s, "sh_degree": 2, "step": 7, "extra": "ignored"})
    loaded, deg = load_splats(path)
    assert deg == 2
    for k in s:
        assert torch.equal(loaded[k], s[k])
    # a payload that cannot be pickled fails mid-write: the old checkpoint stays, no temp file is left
    with pytest.raises(Exception):
        save_checkpoint(path, {"splats": s, "bad": lambda x: x})
    assert load_splats(path)[1] == 2
    assert [p.name for p in path.parent.iterdir()] == ["ckpt.pt"]


def test_load_splats_errors_name_the_file(tmp_path):
    with pytest.raises(UserError, match="not found"):
        load_splats(tmp_path / "nope.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(UserError, match="junk.pt"):
        load_splats(tmp_path / "junk.pt")
