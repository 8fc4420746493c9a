"""Mip-Splatting's 3D smoothing filter (train.filter_3d, splatflow/gaussians/smoothing.py).

The filter's value against a hand-computed case; the filtered scales and opacities against the closed form of the
convolved covariance, with float64 gradients checked by gradcheck; the baked raw values against the filtered ones;
the filter kept with its rows by the state's row operations and the prune stage's cuts; a training run with the
filter resumes to the same bits as an unbroken one; evaluation renders the filter, and export bakes it, so a file
renders the image the model renders.
"""

import math
from dataclasses import replace

import cv2
import numpy as np
import pytest
import torch

from splatflow.pipeline.config import EvaluateConfig, PruneConfig
from splatflow.compress.prune import prune_phases
from splatflow.compress.scoring import Camera
from splatflow.evaluation.evaluate import evaluate_scene
from splatflow.formats import read_ply
from splatflow.formats.common import as_numpy_splats, splats_to_torch
from splatflow.gaussians.model import SPLAT_KEYS, Checkpoint, Splats, render_view
from splatflow.gaussians.smoothing import VARIANCE_SCALE, baked, filter_3d, smoothed
from splatflow.present.export import export_model
from splatflow.present.viewer import load_target
from splatflow.train import Trainer, train
from splatflow.train.state import GaussianState
from tests._tiny import scene, scene_dir, tiny_train_cfg  # noqa: F401 (fixtures)

ROOT = math.sqrt(VARIANCE_SCALE)


def _two_cameras():
    """Camera A at the origin looking down +z (focal 100 px); camera B 4 units behind it (focal 200 px); both
    100 x 100 px with the principal point at the centre."""
    a, b = torch.eye(4), torch.eye(4)
    b[2, 3] = 4.0  # world z = -4 is B's centre: depth = z + 4
    ka = torch.tensor([[100.0, 0, 50], [0, 100.0, 50], [0, 0, 1]])
    kb = torch.tensor([[200.0, 0, 50], [0, 200.0, 50], [0, 0, 1]])
    return torch.stack([a, b]), torch.stack([ka, kb])


def test_the_filter_is_set_by_the_highest_sampling_rate_of_the_cameras_that_see_the_centre():
    viewmats, Ks = _two_cameras()
    means = torch.tensor([
        [0.0, 0.0, 2.0],    # A: depth 2, rate 50 px/unit; B: depth 6, rate 33.3 -> A
        [0.0, 0.0, 10.0],   # A: depth 10, rate 10; B: depth 14, rate 14.3 -> B
        [0.0, 0.0, -2.0],   # behind A; B: depth 2, rate 100 -> B
        [100.0, 0.0, 1.0],  # outside both frusta -> the largest filter of the others
        [1.2, 0.0, 2.0],    # A: u = 110 px, beyond the image but within its 15 % margin; rate 50 -> A
        [1.5, 0.0, 2.0],    # A: u = 125 px, outside; B: depth 6, u = 100 px (the edge), rate 33.3 -> B
    ])
    want = torch.tensor([ROOT * 2 / 100, ROOT * 14 / 200, ROOT * 2 / 200, ROOT * 14 / 200, ROOT * 2 / 100,
                         ROOT * 6 / 200], dtype=torch.float64)
    got = filter_3d(means, viewmats, Ks, [100, 100], [100, 100])
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)
    # camera by camera (one per chunk) gives the same filter, and a float64 input computes in float64
    assert torch.equal(filter_3d(means, viewmats, Ks, [100, 100], [100, 100], chunk_elements=1), got)
    got64 = filter_3d(means.double(), viewmats, Ks, [100, 100], [100, 100])
    assert got64.dtype == torch.float64
    torch.testing.assert_close(got64, want, rtol=1e-12, atol=0)
    # nothing seen by any camera: no filter at all
    assert torch.equal(filter_3d(means[3:4], viewmats, Ks, [100, 100], [100, 100]), torch.zeros(1))


def _random_model(n=40, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, 4, generator=g, dtype=dtype)
    log_s = torch.randn(n, 3, generator=g, dtype=dtype) - 2.0
    logit = torch.randn(n, generator=g, dtype=dtype)
    f = torch.rand(n, generator=g, dtype=dtype) * 0.2
    return q, log_s, logit, f


def _rotmat(q: torch.Tensor) -> torch.Tensor:
    w, x, y, z = (q / q.norm(dim=1, keepdim=True)).unbind(1)
    return torch.stack([1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y),
                        2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x),
                        2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)], 1).reshape(-1, 3, 3)


def test_the_filtered_gaussian_is_the_convolution_with_its_integral_kept():
    q, log_s, logit, f = _random_model()
    s, o = torch.exp(log_s), torch.sigmoid(logit)
    eff, o_eff = smoothed(s, o, f)
    R = _rotmat(q)
    cov = R @ torch.diag_embed(s * s) @ R.transpose(1, 2)  # [N, 3, 3]
    conv = cov + (f * f)[:, None, None] * torch.eye(3, dtype=cov.dtype)  # the convolution with N(0, f^2 I)
    torch.testing.assert_close(R @ torch.diag_embed(eff * eff) @ R.transpose(1, 2), conv, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(o_eff, o * torch.sqrt(torch.linalg.det(cov) / torch.linalg.det(conv)), rtol=1e-10,
                               atol=0)
    assert bool((o_eff < o).all()) and bool((eff > s).all())
    # through the raw parameters, as training differentiates them
    model = lambda ls, lo: smoothed(torch.exp(ls), torch.sigmoid(lo), f)  # noqa: E731
    assert torch.autograd.gradcheck(model, (log_s.clone().requires_grad_(True), logit.clone().requires_grad_(True)))
    splats = Splats(torch.zeros(len(f), 3, dtype=f.dtype), q, log_s, logit, torch.zeros(len(f), 1, 3, dtype=f.dtype),
                    torch.zeros(len(f), 0, 3, dtype=f.dtype), filter_3d=f)
    a = splats.activated()
    assert torch.equal(a.scales, eff) and torch.equal(a.opacities, o_eff)


def test_baked_parameters_are_the_filtered_gaussians_even_at_extremes():
    _, log_s, logit, f = _random_model(seed=3)
    log_s = torch.cat([log_s, torch.tensor([[-20.0, 3.0, 0.0], [0.0, 0.0, 0.0], [-5.0, -5.0, -5.0]],
                                           dtype=log_s.dtype)])
    logit = torch.cat([logit, torch.tensor([40.0, 40.0, -30.0], dtype=logit.dtype)])  # sigmoid(40) is 1 in float64
    f = torch.cat([f, torch.tensor([1e-3, 0.0, 1.0], dtype=f.dtype)])
    b_s, b_o = baked(log_s, logit, f)
    assert torch.isfinite(b_s).all() and torch.isfinite(b_o).all()
    eff, o_eff = smoothed(torch.exp(log_s), torch.sigmoid(logit), f)
    torch.testing.assert_close(torch.exp(b_s), eff, rtol=1e-12, atol=0)
    torch.testing.assert_close(torch.sigmoid(b_o), o_eff, rtol=1e-12, atol=0)
    assert b_o[-2] == logit[-2] and torch.equal(b_s[-2], log_s[-2])  # a zero filter changes nothing
    assert b_o[-3] < 40.0 - 10.0  # a near-opaque, needle-thin Gaussian loses most of its opacity


def _state_with_filter(n=30) -> GaussianState:
    g = torch.Generator().manual_seed(2)
    shapes = {"means": (3,), "quats": (4,), "scales": (3,), "opacities": (), "sh0": (1, 3), "shN": (3, 3)}
    splats = Splats.of({k: torch.randn((n,) + s, generator=g) for k, s in shapes.items()})
    return GaussianState(splats.with_filter(torch.arange(n, dtype=torch.float32)), dict.fromkeys(shapes, 1e-2), "cpu")


def test_row_operations_move_the_filter_with_its_gaussians():
    gs = _state_with_filter()
    gs.reorder_spatially()
    assert torch.equal(gs.filter_3d, gs.splats().filter_3d)
    order = gs.filter_3d.long()  # each filter names the row it started in
    snap = gs.snapshot()
    gs.keep(torch.tensor([2, 5, 9]))
    assert torch.equal(gs.filter_3d, order[[2, 5, 9]].float())
    gs.restore(snap)
    assert torch.equal(gs.filter_3d, order.float())
    gs.relocate(torch.tensor([0]), torch.tensor([7]))
    assert gs.filter_3d[0] == gs.filter_3d[7]
    gs.append({k: gs.params[k].detach()[:2] for k in SPLAT_KEYS})
    assert gs.filter_3d.shape == (gs.n,) and torch.equal(gs.filter_3d[-2:], torch.zeros(2))
    round_trip = GaussianState(_state_with_filter().splats(), dict.fromkeys(SPLAT_KEYS, 1e-2), "cpu")
    round_trip.load_state_dict(gs.state_dict())
    assert torch.equal(round_trip.filter_3d, gs.filter_3d)
    gs.filter_3d = gs.filter_3d[:-1]  # rows changed without the filter: a row operation refuses to guess
    with pytest.raises(RuntimeError, match="recomputed"):
        gs.reorder_spatially()


def test_the_checkpoint_keeps_the_filter_and_a_bad_one_is_named(tmp_path):
    gs = _state_with_filter()
    ck = gs.splats().to_checkpoint(sh_degree=1)
    ck.save(tmp_path / "a.pt")
    back = Checkpoint.load(tmp_path / "a.pt")
    assert torch.equal(back.splats.filter_3d, gs.filter_3d)
    d = ck.to_dict()
    assert "filter_3d" in d and "filter_3d" not in d["splats"]
    d["filter_3d"] = -d["filter_3d"]
    with pytest.raises(Exception, match="filter_3d holds negative"):
        Checkpoint.from_dict(d, "x.pt")
    d["filter_3d"] = torch.zeros(3)
    with pytest.raises(Exception, match=r"filter_3d has shape \(3,\)"):
        Checkpoint.from_dict(d, "x.pt")
    plain = Splats.of(ck.splats.as_dict()).to_checkpoint(1).to_dict()
    assert "filter_3d" not in plain and Checkpoint.from_dict(plain).splats.filter_3d is None


def test_the_prune_stage_keeps_each_filter_with_its_gaussian(scene):  # noqa: F811
    gs = _state_with_filter(200)
    splats = gs.splats().stored()
    cams = [Camera(v.world_to_cam, v.K, v.width, v.height) for v in scene.train_views[:3]]
    cfg = PruneConfig(score="significance", backend="cpu", progress=False, score_rounds=2)
    out = prune_phases(splats, 1, cfg, score_cameras=cams, val_cameras=cams[:1],
                       val_targets=[torch.zeros(cams[0].height, cams[0].width, 3)], keep_fractions=[0.5],
                       finetune=None).splats
    assert out.n == 100 and out.filter_3d.shape == (100,)
    rows = out.filter_3d.long()  # the filter names the row it came from
    for k in SPLAT_KEYS:
        assert torch.equal(out[k], splats[k][rows]), k


def cfg_filtered(steps: int):
    cfg = tiny_train_cfg(steps)
    return replace(cfg, filter_3d=True, checkpoint_every=1000, early_stop=replace(cfg.early_stop, enabled=False),
                   densify=replace(cfg.densify, refine_every=10, refine_start_fraction=0.1))


def test_training_with_the_filter_recomputes_it_and_resumes_to_the_same_bits(scene, tmp_path):  # noqa: F811
    cfg = cfg_filtered(60)
    full = Trainer(scene, cfg, ckpt_path=tmp_path / "a.pt")
    first = full.state.filter_3d.clone()  # computed when the run was built, from the SfM points
    views = full.views
    want = filter_3d(full.state.params["means"].detach(), torch.as_tensor(np.stack([v.world_to_cam for v in views])),
                     torch.as_tensor(np.stack([v.K for v in views])), [v.width for v in views],
                     [v.height for v in views])
    torch.testing.assert_close(first, want.float())
    a = full.run()
    assert len(full.events) >= 3 and a.splats.filter_3d.shape == (a.splats.n,)
    assert a.splats.n != first.shape[0]  # densification grew the model; the filter followed
    ckpt = Checkpoint.load(tmp_path / "a.pt")
    assert torch.equal(ckpt.splats.filter_3d, a.splats.filter_3d)
    train(scene, cfg, ckpt_path=tmp_path / "b.pt", stop_after=33)
    resumed = Trainer(scene, cfg, ckpt_path=tmp_path / "b.pt")
    b = resumed.run()
    assert resumed.resumed_from == 33
    for k in SPLAT_KEYS:
        assert torch.equal(b.splats[k], a.splats[k]), k
    assert torch.equal(b.splats.filter_3d, a.splats.filter_3d)
    # with the filter off the same run trains other Gaussians (the filter changes what is rendered)
    plain = train(scene, replace(cfg, filter_3d=False))
    assert plain.splats.filter_3d is None and not torch.equal(plain.splats["means"][:10], a.splats["means"][:10])


@pytest.fixture(scope="module")
def filtered_ckpt(scene, tmp_path_factory):  # noqa: F811
    d = tmp_path_factory.mktemp("filtered")
    train(scene, cfg_filtered(40), ckpt_path=d / "ckpt.pt")
    return d / "ckpt.pt"


def test_evaluation_renders_the_model_with_its_filter(filtered_ckpt, scene, scene_dir, tmp_path):  # noqa: F811
    ckpt = Checkpoint.load(filtered_ckpt)
    v = scene.test_views[0]
    with_filter = render_view(ckpt.splats, v, ckpt.sh_degree, "cpu")
    without = render_view(ckpt.splats.with_filter(None), v, ckpt.sh_degree, "cpu")
    assert float((with_filter - without).abs().max()) > 1e-3  # the filter changes the picture
    ev = EvaluateConfig(lpips_variants=(), save_renders=False, backend="cpu")
    evaluate_scene(filtered_ckpt, scene_dir, scene_dir / "split.json", ev, renders_dir=None,
                   per_view_csv=tmp_path / "pv.csv", progress=False)
    target = torch.from_numpy(cv2.imread(str(v.image_path))[..., ::-1].copy()).float() / 255.0
    want = -10 * math.log10(float(((with_filter - target) ** 2).mean()))
    got = float(__import__("pandas").read_csv(tmp_path / "pv.csv")["psnr"].iloc[0])
    assert abs(got - want) < 1e-3, (got, want)


def test_export_bakes_the_filter_so_the_file_renders_what_the_model_renders(filtered_ckpt, scene, tmp_path):  # noqa: F811,E501
    ckpt = Checkpoint.load(filtered_ckpt)
    export_model(ckpt.splats, ckpt.sh_degree, tmp_path, progress=False)  # verified against the baked model
    ply, degree = read_ply(tmp_path / "scene.ply")
    from_file = Splats.of(ply)
    assert from_file.filter_3d is None
    for v in scene.test_views:
        model = render_view(ckpt.splats, v, ckpt.sh_degree, "cpu")
        file = render_view(from_file, v, degree, "cpu")
        torch.testing.assert_close(file, model, rtol=0, atol=2e-5)
    raw = render_view(ckpt.splats.with_filter(None), scene.test_views[0], ckpt.sh_degree, "cpu")
    assert float((raw - model).abs().max()) > 1e-3  # the unbaked parameters would render another picture
    # the viewer shows a checkpoint baked, as the export (the live view hands the training state over the same way)
    root = tmp_path / "project"
    (root / "models" / "tiny" / "train").mkdir(parents=True)
    (root / "models" / "tiny" / "train" / "ckpt.pt").write_bytes(filtered_ckpt.read_bytes())
    shown = load_target("tiny", root, stage="train").splats
    exported = as_numpy_splats(splats_to_torch({k: np.asarray(ply[k]) for k in SPLAT_KEYS}))
    for k in ("scales", "opacities"):
        np.testing.assert_array_equal(shown[k], exported[k])
