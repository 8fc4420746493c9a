"""Prune stage: LightGaussian significance, the kept set, early stop, no-op and checkpoint I/O.

The scene is built so the answer is known: 20 large opaque Gaussians on a grid in front of three cameras carry
the picture; 80 others cannot matter (sub-pixel and faint, below the 1/255 alpha threshold, hidden right behind
an opaque one, or behind the cameras). Images are rendered from all 100 plus a little noise.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import cv2
import numpy as np
import pytest
import torch

from splatflow.compress import prune, scoring
from splatflow.pipeline.config import PruneConfig, TrainConfig
from splatflow.gaussians.model import Splats, load_checkpoint, load_splats, render_view, save_checkpoint
from splatflow.render.projection import project_gaussians
from tests._project import stage_record

W, H = 64, 48
K = np.array([[60.0, 0.0, 32.0], [0.0, 60.0, 24.0], [0.0, 0.0, 1.0]])
N_BIG = 20
BACKEND = "cpu"


def _logit(p: float) -> float:
    return math.log(p / (1.0 - p))


def _w2c(x_m: float) -> np.ndarray:
    """Camera at (x_m, 0, 0) looking down +z (OpenCV axes)."""
    m = np.eye(4)
    m[0, 3] = -x_m
    return m


def make_splats(seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]:
    """100 Gaussians: ``groups`` maps big/tiny/transparent/hidden/behind to their indices."""
    g = torch.Generator().manual_seed(seed)
    xs, ys = np.meshgrid(np.linspace(-1.4, 1.4, 5), np.linspace(-1.05, 1.05, 4))
    big = np.stack([xs.ravel(), ys.ravel(), np.full(20, 4.0)], 1)
    tiny = np.stack([np.linspace(-1.5, 1.5, 30), np.full(30, 1.3), np.full(30, 4.0)], 1)  # a row below the grid
    transparent = np.stack([np.linspace(-1.0, 1.0, 25), np.zeros(25), np.full(25, 3.0)], 1)
    hidden = big * 1.5  # on the ray from the middle camera through an opaque one, further away
    behind = np.stack([np.linspace(-0.5, 0.5, 5), np.zeros(5), np.full(5, -1.0)], 1)
    means = np.concatenate([big, tiny, transparent, hidden, behind]).astype(np.float32)  # [100, 3]
    scale = np.concatenate([np.full(20, 0.18), np.full(30, 0.002), np.full(25, 0.3), np.full(20, 0.03),
                            np.full(5, 0.2)])
    # faint: 0.02 is above the 1/255 alpha threshold (drawn); 0.003 is below (never drawn)
    opac = np.concatenate([np.linspace(0.95, 0.99, 20), np.full(30, 0.02), np.full(25, 0.003), np.full(20, 0.5),
                           np.full(5, 0.9)])
    n = len(means)
    perm = torch.randperm(n, generator=g).numpy()  # shuffle so the answer is not "the first 20"
    means, scale, opac = means[perm], scale[perm], opac[perm]
    inv = np.argsort(perm)
    groups = {"big": inv[:20], "tiny": inv[20:50], "transparent": inv[50:75], "hidden": inv[75:95],
              "behind": inv[95:]}
    splats = {
        "means": torch.from_numpy(means),
        "quats": torch.nn.functional.normalize(torch.randn(n, 4, generator=g), dim=-1),
        "scales": torch.log(torch.from_numpy(scale).float())[:, None].repeat(1, 3)
        + 0.1 * torch.randn(n, 3, generator=g) * torch.from_numpy(scale != 0.18)[:, None],  # big: isotropic
        "opacities": torch.tensor([_logit(p) for p in opac], dtype=torch.float32),
        "sh0": (torch.rand(n, 1, 3, generator=g) - 0.5) * 3.0,
        "shN": torch.zeros(n, 3, 3),  # SH degree 1 allocated, zero
    }
    return splats, groups


def cameras() -> list[scoring.Camera]:
    return [scoring.Camera(_w2c(x), K, W, H) for x in (-0.1, 0.0, 0.1)]


@pytest.fixture(scope="module")
def scene_files(tmp_path_factory):
    """Three training views (rendered from the 100 Gaussians + noise) and one test view, as PNG files."""
    splats, groups = make_splats()
    root = tmp_path_factory.mktemp("prune_scene")
    rng = np.random.default_rng(0)
    views = []
    for i, x in enumerate((-0.1, 0.0, 0.1, 0.05)):
        cam = scoring.Camera(_w2c(x), K, W, H)
        img = render_view(Splats.of(splats), cam, 1, BACKEND).numpy()
        img = np.clip(img + rng.normal(0, 0.01, img.shape), 0, 1)
        path = root / f"view{i}.png"
        cv2.imwrite(str(path), cv2.cvtColor((img * 255).round().astype(np.uint8), cv2.COLOR_RGB2BGR))
        views.append(SimpleNamespace(name=path.name, image_path=path, width=W, height=H, K=K,
                                     world_to_cam=_w2c(x)))
    scene = SimpleNamespace(views=views, train_views=views[:3], test_views=views[3:],
                            points=np.zeros((0, 3), np.float32), colors=np.zeros((0, 3), np.uint8))
    ckpt = root / "train" / "ckpt.pt"
    save_checkpoint(ckpt, {"splats": splats, "sh_degree": 1, "step": 123,
                           "optimizers": {"means": {"state": "dummy"}}})
    return SimpleNamespace(splats=splats, groups=groups, scene=scene, ckpt=ckpt, root=root)


# ----------------------------------------------------------------------------------------------- scoring


def brute_force_weight_sums(splats: dict, cams: list[scoring.Camera]) -> torch.Tensor:
    """Dense compositing, no tiles: every pixel against every Gaussian in depth order (gsplat's rules:
    alpha = min(0.999, o exp(-sigma)), skip alpha < 1/255 or sigma < 0, stop before T would reach 1e-4)."""
    a = Splats.of(splats).activated()
    total = torch.zeros(a.means.shape[0], dtype=torch.float64)
    for cam in cams:
        p = project_gaussians(a.means.double(), a.quats.double(), a.scales.double(),
                              a.opacities.double(), torch.from_numpy(cam.world_to_cam)[None],
                              torch.from_numpy(cam.K)[None], cam.width, cam.height)
        valid = (p["radii"][0] > 0).all(-1)  # [N]
        ids = torch.nonzero(valid).flatten()
        ids = ids[torch.argsort(p["depths"][0, ids], stable=True)]  # front to back
        m2, con, op = p["means2d"][0, ids], p["conics"][0, ids], p["opacities"][0, ids]
        yy, xx = torch.meshgrid(torch.arange(cam.height), torch.arange(cam.width), indexing="ij")
        pix = torch.stack([xx.reshape(-1), yy.reshape(-1)], -1).double() + 0.5  # [P, 2]
        dx = m2[None, :, 0] - pix[:, None, 0]  # [P, M]
        dy = m2[None, :, 1] - pix[:, None, 1]
        sigma = 0.5 * (con[:, 0] * dx**2 + con[:, 2] * dy**2) + con[:, 1] * dx * dy
        alpha = torch.clamp(op * torch.exp(-sigma), max=0.999)
        alpha = torch.where((sigma >= 0) & (alpha >= 1 / 255), alpha, 0.0)
        alive = torch.cumprod(1 - alpha, dim=1) > 1e-4
        alpha = torch.where(alive, alpha, 0.0)
        T = torch.cumprod(torch.cat([torch.ones(len(pix), 1, dtype=alpha.dtype), 1 - alpha[:, :-1]], 1), 1)
        total.index_add_(0, ids, (alpha * T).sum(0))
    return total


def test_volume_weight_matches_paper_definition():
    log_s = torch.log(torch.tensor([[1.0, 1.0, 1.0], [0.1, 0.1, 0.1], [0.5, 0.5, 0.5], [2.0, 1.0, 1.0]] * 5))
    w = scoring.volume_weight(log_s, beta=0.1, ref_quantile=0.1)
    v = torch.exp(log_s.double()).prod(-1)
    v_ref = torch.sort(v).values[2]  # floor(0.1 * 20) = 2 in ascending order: 90% are at least this large
    assert torch.allclose(w, torch.clamp(v / v_ref, 0, 1) ** 0.1)
    assert w.max() == 1.0 and math.isclose(float(w.min()), (0.001 / 0.001) ** 0.1)  # ref is itself a 0.1^3 one
    assert torch.equal(scoring.volume_weight(log_s, beta=0.0), torch.ones(20, dtype=torch.float64))


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_significance_matches_brute_force(backend):
    splats, _ = make_splats()
    cams = cameras()
    ours = scoring.significance(splats, cams, beta=0.1, ref_quantile=0.1, backend=backend)
    truth = brute_force_weight_sums(splats, cams)
    vol = torch.exp(splats["scales"].double()).prod(-1)
    v_ref = torch.sort(vol).values[int(0.1 * len(vol))]
    truth = truth * torch.clamp(vol / v_ref, 0, 1) ** 0.1
    assert truth.max() > 10  # the big Gaussians cover many pixels
    torch.testing.assert_close(ours, truth, rtol=1e-4, atol=1e-4)


def test_keeps_exactly_the_significant_gaussians():
    splats, groups = make_splats()
    scores = scoring.significance(splats, cameras(), backend=BACKEND)
    kept = scoring.top_indices(scores, N_BIG)
    assert set(kept.tolist()) == set(groups["big"].tolist())
    # nothing transparent or behind the cameras scores at all; hidden and sub-pixel ones score far less
    assert float(scores[groups["transparent"]].max()) == 0.0 and float(scores[groups["behind"]].max()) == 0.0
    assert scores[groups["big"]].min() > 5 * scores[groups["hidden"]].max()
    assert scores[groups["big"]].min() > 5 * scores[groups["tiny"]].max()
    sub = Splats.of(splats).select(kept)
    assert all(torch.equal(sub[k], splats[k][kept]) for k in sub)


def _targets(splats: dict, cams: list[scoring.Camera], sh_degree: int = 1) -> list[torch.Tensor]:
    return [render_view(Splats.of(splats), cam, sh_degree, "torch") for cam in cams]


def test_removal_scores_equal_removing_each_gaussian():
    """The removal cost is exact: for every Gaussian, the growth of the squared error when the image is rendered
    again without it (the plain-PyTorch oracle, no clamping to [0, 1]), against targets it does not reproduce."""
    from splatflow.render import rasterize

    splats, _ = make_splats()
    cams = cameras()
    g = torch.Generator().manual_seed(1)
    targets = [torch.rand(H, W, 3, generator=g) for _ in cams]
    ours = scoring.removal_scores(splats, 1, cams, targets)
    a = Splats.of(splats).activated()
    n = a.means.shape[0]

    def sq_err(keep: torch.Tensor) -> float:
        total = 0.0
        for cam, tgt in zip(cams, targets):
            img, _, _ = rasterize(a.means[keep], a.quats[keep], a.scales[keep], a.opacities[keep],
                                  a.colors[keep][:, :4], torch.from_numpy(cam.world_to_cam).float()[None],
                                  torch.from_numpy(cam.K).float()[None], W, H, sh_degree=1, backend="torch")
            total += float(((img[0].double() - tgt.double()) ** 2).sum())
        return total

    everything = sq_err(torch.ones(n, dtype=torch.bool))
    truth = torch.tensor([sq_err(torch.arange(n) != j) - everything for j in range(n)], dtype=torch.float64)
    assert truth.abs().max() > 10 and (truth < 0).any()  # some removals help against random targets
    torch.testing.assert_close(ours, truth, rtol=1e-3, atol=2e-3)


def test_removal_scores_rank_by_worth_not_by_coverage():
    """Against the model's own renders the 20 opaque Gaussians are the ones worth keeping; a large Gaussian that
    spoils the picture (absent from the targets) scores lowest, below zero, where LightGaussian ranks it first."""
    splats, groups = make_splats()
    cams = cameras()
    scores = scoring.removal_scores(splats, 1, cams, _targets(splats, cams))
    assert set(scoring.top_indices(scores, N_BIG).tolist()) == set(groups["big"].tolist())
    assert float(scores[groups["transparent"]].abs().max()) == 0.0 and float(scores[groups["behind"]].max()) == 0.0

    spoiler = {k: torch.cat([v, v[groups["big"][:1]]]) for k, v in splats.items()}  # a copy of a big one ...
    spoiler["means"][-1] = torch.tensor([0.0, 0.0, 2.0])  # ... in front of everything, mid-picture
    spoiler["scales"][-1] = math.log(0.4)
    spoiler["sh0"][-1] = -spoiler["sh0"][-1]
    scores = scoring.removal_scores(spoiler, 1, cams, _targets(splats, cams))
    assert float(scores[-1]) < 0 and int(torch.argmin(scores)) == N_BIG * 5  # the first to go
    assert int(torch.argmax(scoring.significance(spoiler, cams, backend=BACKEND))) == N_BIG * 5


def _pair_scene() -> tuple[dict[str, torch.Tensor], list[scoring.Camera], list[torch.Tensor]]:
    """Four white Gaussians apart from each other on black: a semi-opaque pair A, A' at the same place (0, 1),
    then two small opaque ones B (2) and C (3, the smaller). Alone, each of A and A' is nearly free to remove
    (the other still draws the spot); both together are worth more than B or C."""
    n = 4
    splats = {
        "means": torch.tensor([[-1.0, 0.0, 4.0], [-1.0, 0.0, 4.0], [0.3, 0.0, 4.0], [1.2, 0.0, 4.0]]),
        "quats": torch.tensor([[1.0, 0.0, 0.0, 0.0]]).repeat(n, 1),
        "scales": torch.log(torch.tensor([0.2, 0.2, 0.11, 0.1]))[:, None].repeat(1, 3),
        "opacities": torch.tensor([_logit(0.6), _logit(0.6), _logit(0.9), _logit(0.9)]),
        "sh0": torch.full((n, 1, 3), 0.5 / 0.28209479),  # colour 1.0
        "shN": torch.zeros(n, 3, 3),
    }
    cams = [scoring.Camera(_w2c(0.0), K, W, H)]
    return splats, cams, _targets(splats, cams)


def test_rescoring_rounds_keep_one_of_a_redundant_pair():
    """Keeping 2 of 4 in one cut drops both copies of the pair (each alone looks redundant), losing the spot;
    two rounds (4 -> 3 -> 2, re-scored in between) drop one copy, then see the other is now worth keeping, and
    the picture is closer to the target."""
    splats, cams, targets = _pair_scene()
    psnr = {}
    for rounds, survivors in ((1, [2, 3]), (2, [0, 2])):
        cfg = PruneConfig(finetune_steps=0, finetune_growth=0.0, max_psnr_drop_db=math.inf, score="removal",
                          score_rounds=rounds, progress=False)
        res = prune.prune_phases(splats, 1, cfg, score_cameras=cams, val_cameras=cams, val_targets=targets,
                                 keep_fractions=[0.5], finetune=None, score_targets=targets)
        assert res.splats["means"].shape[0] == 2
        assert torch.equal(res.splats["scales"], splats["scales"][survivors])  # (A or A', the same) and B
        psnr[rounds] = res.report["val_psnr_after"]
    assert psnr[2] > psnr[1] + 3.0, psnr


def test_recovery_position_learning_rate(scene_files):
    """``means_lr_factor`` sets the recovery's position rate: Adam's first step moves each mean by about the
    rate (x scene scale); the default is training's final rate, 30x smaller than prune's 0.3."""
    from splatflow.gaussians.model import scene_scale
    from splatflow.train import finetune

    cfg = TrainConfig(backend=BACKEND, image_cache_mb=16)
    sc = scene_scale(np.stack([v.world_to_cam for v in scene_files.scene.train_views]))
    moved = {}
    for f in (None, 0.3):
        out = finetune(scene_files.splats, scene_files.scene, 1, cfg, sh_degree=1, backend=BACKEND,
                       means_lr_factor=f)
        moved[f] = float((out["means"] - scene_files.splats["means"]).abs().max())
    assert moved[0.3] == pytest.approx(cfg.lr.means * sc * 0.3, rel=0.05)
    # the final rate is below float32's resolution at |x| = 4 here: the means hardly move at all
    assert moved[None] <= max(cfg.lr.means * sc * cfg.lr.means_final_factor, 4.0 * 2.0**-23) * 1.05


def test_recovery_continues_adam_from_the_given_moments(scene_files):
    """``moments``: the fine-tune continues Adam from them. Started fresh, Adam's first step moves every opacity
    with a gradient by the full rate (bias-corrected moments of one sample); continued from a long run's moments
    (no momentum, large second moments) the same step hardly moves them."""
    from splatflow.gaussians.model import SPLAT_KEYS
    from splatflow.train import finetune

    cfg = TrainConfig(backend=BACKEND, image_cache_mb=16)
    s = Splats.of(scene_files.splats)
    moments = {k: {"step": torch.tensor(5000.0), "exp_avg": torch.zeros_like(s[k]),
                   "exp_avg_sq": torch.full_like(s[k], 1e4)} for k in SPLAT_KEYS}
    moved = {}
    for name, m in (("fresh", None), ("continued", moments)):
        out = finetune(s, scene_files.scene, 1, cfg, sh_degree=1, backend=BACKEND, moments=m)
        moved[name] = float((out["opacities"] - s["opacities"]).abs().max())
    assert moved["fresh"] == pytest.approx(cfg.lr.opacities, rel=0.01)
    assert moved["continued"] < 1e-3 * moved["fresh"], moved
    bad = {**moments, "scales": {**moments["scales"], "exp_avg": moments["scales"]["exp_avg"][:5]}}
    with pytest.raises(ValueError, match="scales"):
        finetune(s, scene_files.scene, 1, cfg, sh_degree=1, backend=BACKEND, moments=bad)


def test_trained_moments_are_the_checkpoints_adam_state(scene_files, tmp_path):
    """The recovery's Adam state comes from the trained checkpoint, rows brought up to date: the sparse step's
    checkpoint gives the moments dense Adam would hold after the same steps; a checkpoint without a whole
    optimizer state gives None (the recovery then starts Adam from zero)."""
    from dataclasses import replace

    from splatflow.gaussians.model import SPLAT_KEYS, Checkpoint
    from splatflow.train import Trainer

    cfg = TrainConfig(max_steps=8, backend=BACKEND, progress=False, image_cache_mb=16, patch_max_pixels=1024)
    got = {}
    for sparse in (True, False):
        path = tmp_path / f"{sparse}.pt"
        Trainer(scene_files.scene, replace(cfg, sparse_step=sparse), seed=3, splats=scene_files.splats,
                densify=False, ckpt_path=path).run()
        got[sparse] = prune.trained_moments(Checkpoint.load(path))
    for k in SPLAT_KEYS:
        assert got[True][k]["exp_avg"].shape == scene_files.splats[k].shape
        assert float(got[True][k]["step"]) == 8
        for n in ("exp_avg", "exp_avg_sq"):  # equal up to float rounding (rows left behind would differ by far more)
            a, b = got[True][k][n], got[False][k][n]
            assert float((a - b).norm()) <= 1e-3 * float(b.norm()), (k, n)
    assert float(got[True]["opacities"]["exp_avg_sq"].abs().max()) > 0
    assert prune.trained_moments(Checkpoint.load(scene_files.ckpt)) is None  # its optimizer state is a stand-in


def test_a_scene_with_few_training_views_is_copied_not_pruned(scene_files, tmp_path):
    """``prune.min_train_views``: below it the stage copies the trained model and says why; at it, it prunes."""
    n = len(scene_files.scene.train_views)
    for floor, pruned in ((n + 1, False), (n, True)):
        out = tmp_path / f"{floor}.pt"
        m = prune.run_prune(_cfg(keep_first=0.5, score_rounds=1, max_psnr_drop_db=100.0, min_train_views=floor),
                            TrainConfig(), train_ckpt=scene_files.ckpt, out_ckpt=out, scene=scene_files.scene)
        assert (m["gaussians_after"] < m["gaussians_before"]) == pruned
        assert load_splats(out)[0]["means"].shape[0] == m["gaussians_after"]
        if not pruned:
            assert m["stop_reason"].startswith("no-op") and "min_train_views" in m["stop_reason"]


def test_cached_training_images_match_their_cameras(scene_files):
    """The removal score's targets: decoded on demand within the cache budget, each the size of its camera."""
    views = scene_files.scene.train_views
    images = prune.CachedImages(views, 0.5, image_cache_mb=0)  # a zero budget keeps only the last image
    cams = scoring.cameras_at(views, 0.5)
    assert len(images) == len(cams) == 3
    for img, cam in zip(images, cams):
        assert img.shape == (cam.height, cam.width, 3) and img.dtype == torch.float32
    assert len(images.cache._cache) == 1
    with pytest.raises(IndexError):
        images[3]


def test_keep_schedule():
    fr = prune.keep_schedule(0.6, 0.7, 6)
    assert [round(f, 4) for f in fr] == [0.6, 0.42, 0.294, 0.2058, 0.1441, 0.1008]
    assert prune.keep_schedule(1.0, 1.0, 6) == [] and prune.keep_schedule(0.6, 0.7, 0) == []


# ----------------------------------------------------------------------------------------------- phases


def _val(scene_files):
    return prune.val_set(scene_files.scene, 3, 1.0)


def test_early_stop_keeps_last_phase_within_tolerance(scene_files):
    """Phases keeping >= 20 lose only negligible Gaussians; the 5th (14 of 100) removes opaque ones: rejected."""
    cams, targets = _val(scene_files)
    seen = []
    cfg = PruneConfig(finetune_steps=0, finetune_growth=0.0, max_psnr_drop_db=0.5, score="significance",
                      score_rounds=1, backend=BACKEND, progress=False)
    res = prune.prune_phases(scene_files.splats, 1, cfg, score_cameras=cameras(), val_cameras=cams,
                             val_targets=targets, keep_fractions=prune.keep_schedule(0.6, 0.7, 6), finetune=None,
                             phase_callback=lambda rec, s: seen.append(s["means"].shape[0]))
    r = res.report
    assert [p["gaussians"] for p in r["phases"]] == [60, 42, 29, 21, 14] == seen
    assert [p["accepted"] for p in r["phases"]] == [True, True, True, True, False]
    assert r["stopped_early"] and "phase 5" in r["stop_reason"]
    assert r["gaussians_after"] == 21 and res.splats["means"].shape[0] == 21
    assert r["val_psnr_before"] - r["val_psnr_after"] <= 0.5
    assert r["val_psnr_before"] - r["phases"][-1]["val_psnr"] > 0.5
    # the survivors are the 20 opaque Gaussians plus one more
    kept_means = {tuple(m) for m in res.splats["means"].tolist()}
    assert {tuple(m) for m in scene_files.splats["means"][scene_files.groups["big"]].tolist()} <= kept_means


def test_recovery_steps_grow_as_the_model_shrinks(scene_files):
    """``finetune_growth``: phase k recovers for finetune_steps x keep^-growth steps (the fine-tune is called with
    exactly that many steps, on exactly the kept Gaussians)."""
    cams, targets = _val(scene_files)
    calls = []

    def fake_recovery(s, deg, steps, desc, rows):  # records the request; returns the pruned model unchanged
        assert torch.equal(s["means"], scene_files.splats["means"][rows])  # rows name the kept Gaussians
        calls.append((s["means"].shape[0], steps))
        return s

    cfg = PruneConfig(finetune_steps=100, finetune_growth=0.5, max_psnr_drop_db=100.0, score="significance",
                      score_rounds=1, backend=BACKEND, progress=False)
    res = prune.prune_phases(scene_files.splats, 1, cfg, score_cameras=cameras(), val_cameras=cams,
                             val_targets=targets, keep_fractions=prune.keep_schedule(0.6, 0.7, 3),
                             finetune=fake_recovery)
    assert calls == [(60, round(100 / 0.6 ** 0.5)), (42, round(100 / 0.42 ** 0.5)), (29, round(100 / 0.294 ** 0.5))]
    assert [p["finetune_steps"] for p in res.report["phases"]] == [c[1] for c in calls]


def test_zero_tolerance_rejects_first_phase_and_keeps_the_model(scene_files):
    cams, targets = _val(scene_files)
    cfg = PruneConfig(finetune_steps=0, finetune_growth=0.0, max_psnr_drop_db=0.0, score="significance",
                      score_rounds=1, backend=BACKEND, progress=False)
    res = prune.prune_phases(scene_files.splats, 1, cfg, score_cameras=cameras(), val_cameras=cams,
                             val_targets=targets, keep_fractions=[0.1], finetune=None)
    assert res.report["stopped_early"] and res.report["gaussians_after"] == 100
    assert all(torch.equal(res.splats[k], scene_files.splats[k]) for k in res.splats)


# ----------------------------------------------------------------------------------------------- stage work


def _cfg(**kw) -> PruneConfig:
    base = dict(val_views=3, val_factor=1.0, backend=BACKEND, progress=False, finetune_steps=0, finetune_growth=0.0,
                min_train_views=0)  # the scene has 3 training views
    base.update(kw)
    return PruneConfig(**base)


@pytest.mark.parametrize("cfg", [dict(enabled=False), dict(phases=0), dict(keep_first=1.0, keep_decay=1.0)])
def test_noop_copies_the_model_and_writes_outputs(scene_files, tmp_path, cfg):
    out = tmp_path / "prune" / "ckpt.pt"
    m = prune.run_prune(_cfg(**cfg), TrainConfig(), train_ckpt=scene_files.ckpt, out_ckpt=out,
                        scene=scene_files.scene)
    splats, deg = load_splats(out)
    assert deg == 1 and all(torch.equal(splats[k], scene_files.splats[k]) for k in splats)
    assert m["gaussians_before"] == m["gaussians_after"] == 100 and m["phases"] == []
    assert m["size_mb_before"] == m["size_mb_after"] > 0
    assert m["val_psnr_before"] == m["val_psnr_after"] > 30  # the noisy targets: ~40 dB
    assert m["stop_reason"].startswith("no-op")


def test_prune_with_recovery_writes_a_loadable_checkpoint(scene_files, tmp_path):
    """The full stage work with the real recovery fine-tune; the checkpoint round-trips without optimizer state."""
    out = tmp_path / "prune" / "ckpt.pt"
    m = prune.run_prune(_cfg(keep_first=0.5, keep_decay=0.5, phases=2, finetune_steps=5, max_psnr_drop_db=3.0),
                        TrainConfig(backend=BACKEND, image_cache_mb=16), train_ckpt=scene_files.ckpt,
                        out_ckpt=out, scene=scene_files.scene)
    assert [p["gaussians"] for p in m["phases"]] == [50, 25]
    assert all(p["finetune_steps"] == 5 and p["accepted"] for p in m["phases"])
    assert m["gaussians_after"] == 25 and not m["stopped_early"]
    assert m["size_mb_after"] == pytest.approx(m["size_mb_before"] / 4)
    raw = load_checkpoint(out)
    assert set(raw) == {"splats", "sh_degree", "step"} and raw["step"] == 123 and raw["sh_degree"] == 1
    splats, deg = load_splats(out)
    assert splats["means"].shape == (25, 3) and splats["shN"].shape == (25, 3, 3) and deg == 1
    assert all(v.dtype == torch.float32 and torch.isfinite(v).all() for v in splats.values())
    # the fine-tune moved the parameters (recovery ran) and the opaque ones all survived
    big = scene_files.splats["means"][scene_files.groups["big"]]
    dist = torch.cdist(big, splats["means"]).min(dim=1).values
    assert float(dist.max()) < 0.05
    nearest = torch.cdist(splats["means"], scene_files.splats["means"]).argmin(dim=1)  # [25] original index
    assert float((splats["sh0"] - scene_files.splats["sh0"][nearest]).abs().max()) > 1e-4  # recovery ran
    assert m["val_psnr_after"] > m["val_psnr_before"] - 3.0


def test_stage_main_writes_checkpoint_and_metrics(scene_files, tmp_path):
    """`python -m stages.prune S` through stage_main: params.yaml, scene on disk, outputs at the contract paths."""
    import json
    import shutil

    import yaml

    from splatflow.pipeline.paths import ScenePaths
    from splatflow.scene.synthetic import write_colmap_text_model
    from stages import prune as stage

    root = tmp_path / "proj"
    paths = ScenePaths("t", root)
    views = scene_files.scene.views
    (paths.undistorted_dir / "images").mkdir(parents=True)
    for v in views:
        shutil.copy(v.image_path, paths.undistorted_dir / "images" / v.name)
    write_colmap_text_model(paths.undistorted_dir / "sparse", K, W, H, [v.name for v in views],
                            [v.world_to_cam for v in views], np.zeros((0, 3)), np.zeros((0, 3), np.uint8),
                            [[] for _ in views])
    paths.split_json.write_text(json.dumps({"train": [v.name for v in views[:3]], "test": [views[3].name],
                                            "rule": "test"}))
    shutil.copytree(scene_files.ckpt.parent, paths.train_ckpt.parent)
    params = {"base": {"scenes": {"t": {"source": "unused"}}, "threads": 1},
              "train": {"backend": BACKEND, "image_cache_mb": 16, "progress": False},
              "prune": {"keep_first": 0.3, "phases": 1, "finetune_steps": 2, "val_views": 2, "min_train_views": 0,
                        "val_factor": 1.0, "max_psnr_drop_db": 5.0, "backend": BACKEND, "progress": False}}
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    stage.main(["t", "--params", str(root / "params.yaml")])
    m = stage_record(paths.root, paths.scene, "prune")
    assert m["gaussians_before"] == 100 and m["gaussians_after"] == 30 and len(m["phases"]) == 1
    assert m["val_views"] == 2 and m["val_psnr_after"] > 25
    assert load_splats(paths.prune_ckpt)[0]["means"].shape == (30, 3)
