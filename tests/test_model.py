"""Gaussian initialisation from SfM points, scene scale and checkpoint I/O (splatflow.gaussians.model)."""

import math

import numpy as np
import pytest
import torch

from splatflow.pipeline.errors import UserError
from splatflow.gaussians.model import (SH_C0, SPLAT_KEYS, Checkpoint, Splats, init_splats, knn_mean_distance,
                                       load_checkpoint, load_splats, render_view, save_checkpoint, scene_scale)


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


# ----------------------------------------------------------------------------------------------- Splats


def _splats(n: int = 12, sh_degree: int = 1, seed: int = 3) -> Splats:
    rng = np.random.default_rng(seed)
    s = init_splats(rng.normal(size=(n, 3)).astype(np.float32) + np.array([0, 0, 4], np.float32),
                    rng.integers(0, 256, (n, 3)).astype(np.uint8), sh_degree=sh_degree, init_opacity=0.5)
    return s.map(lambda t: t + 0.01 * torch.randn(t.shape, generator=torch.Generator().manual_seed(seed)))


def test_splats_facts_activations_and_size_in_mib():
    s = _splats(12, sh_degree=2)
    assert s.n == 12 and s.max_sh_degree == 2 and list(s) == list(SPLAT_KEYS)
    # 3 + 4 + 3 + 1 + 3 + 8 * 3 floats per Gaussian, float32
    assert s.bytes_per_gaussian == (3 + 4 + 3 + 1 + 3 + 24) * 4 and s.nbytes == 12 * s.bytes_per_gaussian
    assert s.size_mib == s.nbytes / 2**20  # MiB, not MB
    a = s.activated(1)
    torch.testing.assert_close(a.scales, torch.exp(s.scales))
    torch.testing.assert_close(a.opacities, torch.sigmoid(s.opacities))
    assert a.colors.shape == (12, 4, 3) and torch.equal(a.colors[:, 0], s.sh0[:, 0])
    assert torch.equal(a.colors[:, 1:], s.shN[:, :3])
    assert s.activated().colors.shape == (12, 9, 3)  # every band without a degree
    with pytest.raises(ValueError, match="sh_degree 3 needs 16"):
        s.activated(3)


def test_splats_activated_keeps_gradients_to_the_raw_parameters():
    params = {k: torch.nn.Parameter(v.clone()) for k, v in _splats().items()}
    a = Splats.of(params).activated(1)
    (a.scales.sum() + a.opacities.sum() + a.colors.sum()).backward()
    assert all(params[k].grad is not None for k in ("scales", "opacities", "sh0", "shN"))
    torch.testing.assert_close(params["scales"].grad, torch.exp(params["scales"].detach()))


def test_splats_select_copies_rows_and_checks_masks():
    s = _splats(10)
    idx = torch.tensor([7, 2, 5])
    sub = s.select(idx)
    assert sub.n == 3 and all(torch.equal(sub[k], s[k][idx]) for k in SPLAT_KEYS)
    sub.means.add_(1.0)  # a copy: the source is untouched
    assert not torch.equal(sub.means, s.means[idx])
    mask = torch.zeros(10, dtype=torch.bool)
    mask[[1, 4]] = True
    assert s.select(mask).n == 2
    with pytest.raises(ValueError, match=r"shape \(10,\)"):
        s.select(torch.ones(4, dtype=torch.bool))


def test_splats_validate_names_the_problem():
    good = _splats(6)
    assert good.validate() is good

    def broken(**changes):
        return Splats(**{**good.as_dict(), **changes})

    cases = [
        (broken(quats=good.quats[:, :3]), r"model.pt: quats has shape \(6, 3\), expected \(6, 4\)"),
        (broken(opacities=good.opacities[:5]), r"opacities has shape \(5,\), expected \(6,\)"),
        (broken(shN=torch.zeros(6, 5, 3)), r"shN has shape \(6, 5, 3\).*SH degree d in 0..3"),
        (broken(scales=good.scales.to(torch.int64)), "scales has dtype torch.int64"),
        (broken(means=good.means.numpy()), "means is a ndarray, not a tensor"),
        (broken(sh0=torch.full((6, 1, 3), float("nan"))), "sh0 holds NaN/Inf values in 6 of 6 Gaussians"),
        (broken(quats=torch.zeros(6, 4)), "quats holds 6 all-zero quaternions"),
    ]
    for bad, msg in cases:
        with pytest.raises(UserError, match=msg) as e:
            bad.validate("model.pt", "rerun train")
        assert str(e.value).endswith("rerun train")
    with pytest.raises(UserError, match="x.pt: lacks sh0, shN"):
        Splats.of({k: good[k] for k in SPLAT_KEYS[:4]}, "x.pt")
    assert Splats.empty(2).validate().n == 0


def test_splats_to_device_and_meta_default_device():
    s = _splats(5)
    assert s.to("cpu").means is s.means  # nothing to move: no copy
    assert s.to(dtype=torch.float64).means.dtype == torch.float64
    with torch.device("meta"):  # library code must not allocate on the default device
        sub = s.select(torch.tensor([0, 3], device="cpu"))
        e = Splats.empty(1, device="cpu")
        ck = s.to_checkpoint(1)
    assert sub.device.type == "cpu" and e.device.type == "cpu" and ck.splats.device.type == "cpu"


def test_render_view_matches_the_rasterizer_on_activated_inputs():
    from types import SimpleNamespace

    from splatflow.render import rasterize

    s = _splats(30)
    cam = SimpleNamespace(world_to_cam=np.eye(4), K=np.array([[40.0, 0, 16], [0, 40.0, 12], [0, 0, 1]]),
                          width=32, height=24)
    got = render_view(s, cam, 1, "cpu")
    a = s.activated(1)
    ref, _, _ = rasterize(a.means, a.quats, a.scales, a.opacities, a.colors, torch.eye(4)[None],
                          torch.from_numpy(cam.K).float()[None], 32, 24, sh_degree=1, backend="cpu")
    assert got.shape == (24, 32, 3) and float(got.max()) > 0
    torch.testing.assert_close(got, ref[0].clamp(0, 1))


# ----------------------------------------------------------------------------------------------- Checkpoint


def test_checkpoint_round_trip_keeps_the_layout(tmp_path):
    s = _splats(8, sh_degree=2)
    ck = s.to_checkpoint(2, step=40, finished=False, prune_during={"report": {"cuts": 1}},
                         train={"seed": 3, "optimizers": {"means": {}}})
    d = ck.to_dict()
    assert set(d) == {"splats", "sh_degree", "step", "finished", "prune_during", "seed", "optimizers"}
    assert all(d["splats"][k].dtype == torch.float32 for k in SPLAT_KEYS)
    ck.save(tmp_path / "c.pt")
    back = Checkpoint.load(tmp_path / "c.pt")
    assert (back.sh_degree, back.step, back.finished, back.resumable) == (2, 40, False, True)
    assert back.prune_during == {"report": {"cuts": 1}} and back.train == {"seed": 3, "optimizers": {"means": {}}}
    assert all(torch.equal(back.splats[k], s[k]) for k in SPLAT_KEYS)
    assert Splats.from_checkpoint(tmp_path / "c.pt").n == 8 and Splats.from_checkpoint(d).n == 8
    # a model without training state holds exactly the three core entries (what prune writes)
    assert set(s.to_checkpoint(2).to_dict()) == {"splats", "sh_degree", "step"}
    with pytest.raises(ValueError, match="overwrite"):
        s.to_checkpoint(2, train={"step": 1}).to_dict()


def test_checkpoint_reads_the_older_dict_layout(tmp_path):
    """Files written before the Checkpoint type: a bare dict, splats as float64 parameters (possibly strided),
    no ``finished`` (a prune output) or a train dict whose resume keys sit at the top level."""
    s = _splats(6)
    old = {"splats": {k: torch.nn.Parameter(v.double()) for k, v in s.items()}, "step": 9}
    old["splats"]["means"] = old["splats"]["means"].detach().t().contiguous().t()  # non-contiguous
    save_checkpoint(tmp_path / "old.pt", old)
    ck = Checkpoint.load(tmp_path / "old.pt")
    assert ck.sh_degree == 0 and ck.step == 9 and ck.finished is None and not ck.resumable and ck.train == {}
    assert all(ck.splats[k].dtype == torch.float32 and ck.splats[k].is_contiguous() for k in SPLAT_KEYS)
    torch.testing.assert_close(ck.splats.means, s.means)
    train_old = {"splats": s.as_dict(), "sh_degree": 1, "step": 30, "finished": False, "stopped": "",
                 "config_hash": "abc", "seed": 0, "optimizers": {}, "rng": {}, "prune_during": None}
    ck = Checkpoint.from_dict(train_old)
    assert ck.resumable and ck.train["config_hash"] == "abc" and "prune_during" not in ck.train
    assert set(ck.to_dict()) == set(train_old) - {"prune_during"}  # None is not written back


def test_checkpoint_errors_name_the_file(tmp_path):
    s = _splats(4)
    save_checkpoint(tmp_path / "bad.pt", {"splats": {**s.as_dict(), "scales": torch.zeros(3, 3)}, "sh_degree": 1})
    with pytest.raises(UserError, match=r"bad.pt: scales has shape \(3, 3\), expected \(4, 3\)"):
        Checkpoint.load(tmp_path / "bad.pt")
    save_checkpoint(tmp_path / "nosh.pt", {"splats": {k: s[k] for k in SPLAT_KEYS if k != "shN"}})
    with pytest.raises(UserError, match="nosh.pt: lacks shN"):
        load_splats(tmp_path / "nosh.pt")
    assert "splats" in load_checkpoint(tmp_path / "nosh.pt")  # the raw reader does not validate


def test_a_missing_checkpoint_names_the_stage_and_scene_that_write_it(tmp_path):
    """export/evaluate read the PRUNE checkpoint and prune reads the train one: the hint names that stage for that
    scene only (`dvc repro train` would train every scene), from the path layout models/<scene>/<stage>/ckpt.pt."""
    from splatflow.pipeline.config import params_from_dict
    from splatflow.pipeline.paths import ScenePaths
    from stages import export as export_stage

    paths = ScenePaths("garden", tmp_path)
    params = params_from_dict({"base": {"scenes": {"garden": str(tmp_path / "photos")}}})
    with pytest.raises(UserError) as e:
        export_stage.run(params, paths)  # the real export stage, before prune has run
    assert str(e.value) == (f"{paths.prune_ckpt}: checkpoint not found; the prune stage of scene 'garden' writes it: "
                            f"run `splatflow run garden` (or `dvc repro prune@garden`)")
    with pytest.raises(UserError, match=r"train/ckpt\.pt: checkpoint not found; the train stage of scene 'garden' "
                                        r"writes it: run `splatflow run garden` \(or `dvc repro train@garden`\)"):
        Checkpoint.load(paths.train_ckpt)  # what the prune stage reads
    with pytest.raises(UserError, match=r"models/garden/prune/ckpt\.pt: .*`dvc repro prune@garden`"):
        load_splats("models/garden/prune/ckpt.pt")  # a project-relative path reads the same
    # any other path: the generic hint
    with pytest.raises(UserError, match=r"elsewhere\.pt: checkpoint not found; run the stage that writes it"):
        load_checkpoint(tmp_path / "elsewhere.pt")
    # once the file exists it is read (the hint is only for a missing file)
    _splats(4).to_checkpoint(0).save(paths.prune_ckpt)
    assert load_splats(paths.prune_ckpt)[0].n == 4


def test_a_checkpoint_is_created_with_the_umask_like_any_file(tmp_path):
    """Written through a temporary file (mkstemp: mode 0600) and renamed: the result must carry the mode open()
    would give, or a model trained by hand is unreadable to the other users of a shared machine."""
    import os

    save_checkpoint(tmp_path / "c.pt", {"splats": {}, "sh_degree": 0, "step": 0})
    plain = tmp_path / "plain"
    plain.write_bytes(b"")
    assert (tmp_path / "c.pt").stat().st_mode & 0o777 == plain.stat().st_mode & 0o777
    assert os.access(tmp_path / "c.pt", os.R_OK)
