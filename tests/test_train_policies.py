"""Training policies in isolation: schedules, plateau stop, blur, image cache, relocation, Gaussian budget."""

import math
from dataclasses import dataclass

import cv2
import numpy as np
import pytest
import torch

from splatflow.pipeline.config import ConfigError, TrainConfig, params_from_dict
from splatflow.scene.cameras import scale_intrinsics
from splatflow.scene.images import ImageCache
from splatflow.render.blur import gaussian_blur
from splatflow.train.schedules import ExpDecay, PlateauStopper, Schedules
from splatflow.train.strategies import (BudgetedDefaultStrategy, Strategy, TorchMCMCStrategy,
                                        compute_relocation_torch, relocate, relocation_coefficients, rendered,
                                        sample_add)


def test_default_resolution_phases_and_boundaries():
    s = Schedules.from_config(TrainConfig(max_steps=1000), scene_scale=1.0)
    # default: 1/8 from 0, 1/4 from 5%, 1/2 from 15%, 3/4 from 35%, full from 60%
    expect = {0: 0.125, 49: 0.125, 50: 0.25, 149: 0.25, 150: 0.5, 349: 0.5, 350: 0.75, 599: 0.75, 600: 1.0,
              999: 1.0}
    for step, f in expect.items():
        assert s.resolution.factor(step) == f, step
    assert [s.resolution.phase(x) for x in (0, 50, 150, 350, 600)] == [0, 1, 2, 3, 4]


def test_phases_by_absolute_step_and_validation():
    p = params_from_dict({"train": {"max_steps": 100, "resolution": [
        {"factor": 0.5, "start_step": 0}, {"factor": 1.0, "start_step": 30}]}})
    s = Schedules.from_config(p.train, 1.0)
    assert s.resolution.factor(29) == 0.5 and s.resolution.factor(30) == 1.0
    with pytest.raises(ConfigError, match="train.resolution"):
        params_from_dict({"train": {"resolution": [{"factor": 0.5, "start_step": 10}]}})  # must start at 0
    with pytest.raises(ConfigError, match="increasing"):
        params_from_dict({"train": {"resolution": [{"factor": 0.5, "start_step": 0},
                                                   {"factor": 1.0, "start_fraction": 0.0}]}})
    with pytest.raises(ConfigError, match="exactly one"):
        params_from_dict({"train": {"resolution": [{"factor": 0.5}]}})


def test_blur_sigma_is_linear_to_zero_and_sh_degree_steps():
    s = Schedules.from_config(TrainConfig(max_steps=1000, sh_degree_interval=1000), 1.0)  # sigma 2.4 -> 0 at 50%
    assert s.blur.sigma(0) == pytest.approx(2.4)
    assert s.blur.sigma(250) == pytest.approx(1.2)
    assert s.blur.sigma(499) == pytest.approx(2.4 / 500)
    assert s.blur.sigma(500) == 0.0 and s.blur.sigma(900) == 0.0
    assert [s.sh.degree(x) for x in (0, 999, 1000, 2000, 3000, 9000)] == [0, 0, 1, 2, 3, 3]


def test_position_lr_decays_exponentially_to_final_factor():
    d = ExpDecay(1.6e-4 * 3.0, 0.01, 1000)
    assert d.lr(0) == pytest.approx(4.8e-4)
    assert d.lr(500) == pytest.approx(4.8e-4 * 0.1)  # geometric midpoint
    assert d.lr(1000) == pytest.approx(4.8e-6)


def test_plateau_stopper_on_synthetic_psnr_sequence():
    st = PlateauStopper(patience_steps=300, min_delta_db=0.1, active_from=200)
    seq = [(100, 30.0), (200, 20.0), (300, 21.0), (400, 22.0), (500, 22.05), (600, 22.09), (700, 22.0)]
    reasons = [st.update(step, v) for step, v in seq]
    # step 100 is before active_from (ignored), 400 is the last real improvement; 700 - 400 = 300 -> stop
    assert reasons[:-1] == [None] * 6
    assert reasons[-1] is not None and "plateau" in reasons[-1] and "step 400" in reasons[-1]
    st2 = PlateauStopper(300, 0.1)
    st2.load_state_dict(st.state_dict())
    assert (st2.best_db, st2.best_step) == (22.0, 400)
    # steady improvement never stops
    st3 = PlateauStopper(200, 0.1)
    assert all(st3.update(i * 100, 20 + 0.2 * i) is None for i in range(50))


def test_gaussian_blur_keeps_constants_and_mass():
    img = torch.rand(1, 3, 40, 50)
    assert gaussian_blur(img, 0.0) is img
    const = torch.full((1, 3, 30, 30), 0.7)
    torch.testing.assert_close(gaussian_blur(const, 2.4), const)
    dot = torch.zeros(1, 1, 41, 41)
    dot[0, 0, 20, 20] = 1.0
    out = gaussian_blur(dot, 2.0)
    assert float(out.sum()) == pytest.approx(1.0, abs=1e-5)
    var = float((out[0, 0, 20] / out[0, 0, 20].sum() * (torch.arange(41) - 20.0) ** 2).sum())
    assert var == pytest.approx(4.0, rel=0.05)  # sigma^2


@dataclass
class _V:
    name: str
    image_path: str
    width: int
    height: int
    K: np.ndarray


def test_image_cache_area_downsamples_once_and_scales_intrinsics(tmp_path):
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, (64, 96, 3), dtype=np.uint8)
    cv2.imwrite(str(tmp_path / "a.png"), img[..., ::-1])  # RGB -> BGR on disk
    K = np.array([[80.0, 0, 48.0], [0, 80.0, 32.0], [0, 0, 1]])
    cache = ImageCache([_V("a.png", str(tmp_path / "a.png"), 96, 64, K)], budget_mb=64)
    half, K2 = cache.get(0, 0.5)
    assert half.shape == (32, 48, 3)
    block_mean = img.reshape(32, 2, 48, 2, 3).mean(axis=(1, 3)) / 255.0  # area filter = 2x2 block mean
    np.testing.assert_allclose(half.numpy(), block_mean, atol=1 / 255 + 1e-6)
    np.testing.assert_allclose(K2, [[40.0, 0, 24.0], [0, 40.0, 16.0], [0, 0, 1]])
    full, K1 = cache.get(0, 1.0)
    np.testing.assert_allclose(full.numpy() * 255, img, atol=1e-3)
    np.testing.assert_allclose(K1, K)
    for _ in range(5):
        cache.get(0, 0.5)
        cache.get(0, 1.0)
    assert cache.decodes == 2  # once per level, never per step
    np.testing.assert_allclose(scale_intrinsics(K, 96, 64, 12, 8)[:2, 2], [6.0, 4.0])


def _relocation_brute(o: float, s: float, n: int) -> tuple[float, float]:
    """3DGS-MCMC Eq. 9 written out literally (independent of the vectorised coefficients)."""
    o_new = 1 - (1 - o) ** (1 / n)
    denom = sum(math.comb(i - 1, k) * (-1) ** k * o_new ** (k + 1) / math.sqrt(k + 1)
                for i in range(1, n + 1) for k in range(i))
    return o_new, s * o / denom


def test_torch_relocation_matches_the_paper_formula():
    coef = relocation_coefficients(51)
    o = torch.tensor([0.3, 0.9, 0.05, 0.6, 0.99])
    s = torch.rand(5, 3) + 0.1
    r = torch.tensor([1, 2, 3, 7, 12])
    new_o, new_s = compute_relocation_torch(o, s, r, coef)
    for j in range(5):
        eo, es = _relocation_brute(float(o[j]), 1.0, int(r[j]))
        assert float(new_o[j]) == pytest.approx(eo, rel=1e-5)
        torch.testing.assert_close(new_s[j], s[j] * es, rtol=1e-4, atol=1e-7)
    # r copies at the new opacity composite back to the old opacity; r = 1 is the identity
    torch.testing.assert_close(1 - (1 - new_o) ** r, o, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(new_s[0], s[0])


def _params(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    p = {"means": torch.randn(n, 3, generator=g), "quats": torch.randn(n, 4, generator=g),
         "scales": torch.full((n, 3), math.log(0.005)) + 0.1 * torch.randn(n, 3, generator=g),
         "opacities": torch.randn(n, generator=g), "sh0": torch.randn(n, 1, 3, generator=g),
         "shN": torch.zeros(n, 15, 3)}
    p = {k: torch.nn.Parameter(v) for k, v in p.items()}
    opts = {k: torch.optim.Adam([v], lr=1e-3) for k, v in p.items()}
    for k, v in p.items():  # one step so the optimizers have moment buffers the strategy must resize
        v.grad = torch.zeros_like(v)
        opts[k].step()
    return p, opts


def _fake_info(n, grad_scale):
    means2d = torch.zeros(1, n, 2, requires_grad=True)
    means2d.grad = torch.full((1, n, 2), grad_scale)
    return {"means2d": means2d, "radii": torch.ones(1, n, 2, dtype=torch.int32), "width": 100, "height": 100,
            "n_cameras": 1}


def test_default_strategy_never_exceeds_the_budget():
    p, opts = _params(200)
    strat = BudgetedDefaultStrategy(cap=300, refine_start_iter=0, refine_stop_iter=10_000, refine_every=10,
                                    reset_every=0, grow_grad2d=1e-4, prune_opa=0.0)
    state = strat.initialize_state(scene_scale=1.0)
    counts = []
    for step in range(1, 61):
        # every Gaussian "wants" to grow
        strat.step_post_backward(p, opts, state, step, _fake_info(p["means"].shape[0], 1.0))
        counts.append(p["means"].shape[0])
        if strat.last_event:
            ev = strat.last_event
            assert ev["gaussians"] == ev["before"] + ev["clones"] + ev["splits"] - ev["prunes"]
    assert max(counts) == 300 and counts[-1] == 300
    assert all(o.state[p[k]]["exp_avg"].shape[0] == 300 for k, o in opts.items())


def test_budget_ramp_grows_the_cap_linearly_to_the_whole_budget():
    """With ``budget_ramp_fraction`` the count may reach the cap only at the ramp's end: between the refine start
    and it the allowed count rises linearly from the initial count, and growth never passes it."""
    p, opts = _params(200)
    strat = BudgetedDefaultStrategy(cap=400, initial_count=200, ramp_end_iter=50, refine_start_iter=10,
                                    refine_stop_iter=10_000, refine_every=5, reset_every=0, grow_grad2d=1e-4,
                                    prune_opa=0.0)
    assert [strat.cap_at(s) for s in (0, 10, 30, 50, 80)] == [200, 200, 300, 400, 400]
    state = strat.initialize_state(scene_scale=1.0)
    for step in range(1, 81):
        strat.step_post_backward(p, opts, state, step, _fake_info(p["means"].shape[0], 1.0))
        assert p["means"].shape[0] <= strat.cap_at(step)
        if step == 30:
            assert p["means"].shape[0] == 300  # every Gaussian wants to grow: the ramp is what holds them back
    assert p["means"].shape[0] == 400
    # no ramp (the default): the whole cap from the start
    assert BudgetedDefaultStrategy(cap=400, initial_count=200, refine_start_iter=10).cap_at(11) == 400


def test_default_strategy_grows_only_the_highest_gradients_when_budget_is_short():
    p, opts = _params(100)
    strat = BudgetedDefaultStrategy(cap=110, refine_start_iter=0, refine_stop_iter=100, refine_every=1,
                                    reset_every=0, grow_grad2d=1e-4, prune_opa=0.0)
    state = strat.initialize_state(1.0)
    info = _fake_info(100, 1.0)
    info["means2d"].grad[0, :, :] = torch.linspace(0.01, 1.0, 100)[:, None]
    before = p["means"].detach().clone()
    strat.step_post_backward(p, opts, state, 1, info)
    assert strat.last_event["clones"] + strat.last_event["splits"] == 10
    # the 10 duplicates appended are the 10 Gaussians with the largest gradient (indices 90..99)
    torch.testing.assert_close(p["means"][100:].detach(), before[90:])


def test_mcmc_strategy_runs_on_cpu_and_respects_cap():
    p, opts = _params(200)
    with torch.no_grad():
        p["opacities"][:20] = -10.0  # dead
    strat = TorchMCMCStrategy(cap_max=215, refine_start_iter=0, refine_stop_iter=1000, refine_every=1)
    state = strat.initialize_state()
    strat.step_post_backward(p, opts, state, 1, {}, lr=1e-3)
    ev = strat.last_event
    assert ev["relocated"] == 20 and ev["added"] == 10 and p["means"].shape[0] == 210
    assert float(torch.sigmoid(p["opacities"].detach()).min()) > 0.005  # the dead ones were moved onto live ones
    for step in range(2, 6):
        strat.step_post_backward(p, opts, state, step, {}, lr=1e-3)
    assert p["means"].shape[0] == 215
    assert torch.isfinite(p["means"]).all()


def test_relocate_and_sample_add_take_gsplats_arguments_and_keep_the_composite_opacity():
    """The torch ops called as gsplat's are (params, optimizers, state, mask | n, table, min_opacity)."""
    coef = relocation_coefficients(51)
    p, opts = _params(50)
    with torch.no_grad():
        p["opacities"][:5] = -10.0  # dead
    stat = torch.arange(50, dtype=torch.float32) + 1.0  # a per-Gaussian running statistic
    state = {"stat": stat}
    o_before = torch.sigmoid(p["opacities"].detach()).clone()
    dead = torch.sigmoid(p["opacities"].detach()) <= 0.005
    torch.manual_seed(0)
    relocate(p, opts, state, dead, coef, 0.005)
    o = torch.sigmoid(p["opacities"].detach())
    assert p["means"].shape[0] == 50 and bool((o > 0.005).all())
    # each dead row is now a copy of a live one; that one and its copies (r in all) share its opacity so that
    # r of them composite to the opacity it had
    changed = (~dead) & (o != o_before)
    assert int(changed.sum()) >= 1 and int(changed.sum()) <= 5 and state["stat"][changed].eq(0).all()
    for j in changed.nonzero().flatten().tolist():
        copies = int((p["means"].detach() == p["means"].detach()[j]).all(-1).sum())
        assert 1 - (1 - float(o[j])) ** copies == pytest.approx(float(o_before[j]), rel=1e-4)
        assert opts["means"].state[p["means"]]["exp_avg"][j].eq(0).all()
    assert torch.equal(state["stat"][~dead & ~changed], stat[~dead & ~changed])
    sample_add(p, opts, state, 7, coef, 0.005)
    assert p["means"].shape[0] == 57 and state["stat"].shape[0] == 57 and state["stat"][50:].eq(0).all()
    assert all(o.state[p[k]]["exp_avg"].shape[0] == 57 for k, o in opts.items())
    sample_add(p, opts, state, 0, coef)  # nothing to add: a no-op
    relocate(p, opts, state, torch.ones(57, dtype=torch.bool), coef)  # nothing alive to move onto: a no-op
    assert p["means"].shape[0] == 57


def test_torch_ops_take_gsplats_arguments_in_gsplats_order():
    """The MCMC strategy calls either set positionally (gsplat's CUDA ops on a GPU, ours on the CPU)."""
    import inspect

    from gsplat.strategy import ops as gsplat_ops

    from splatflow.train.strategies import inject_noise_to_position

    for ours, theirs in ((relocate, gsplat_ops.relocate), (sample_add, gsplat_ops.sample_add),
                         (inject_noise_to_position, gsplat_ops.inject_noise_to_position)):
        names = ["binoms" if n == "coef" else n for n in inspect.signature(ours).parameters]  # the table differs
        assert names == list(inspect.signature(theirs).parameters), ours.__name__


def test_rendered_is_one_mask_for_both_radii_layouts():
    r2 = torch.tensor([[[3, 2], [0, 0], [4, 0]], [[0, 0], [0, 0], [1, 1]]])  # [C=2, N=3, 2]
    assert rendered({"radii": r2}).tolist() == [True, False, True]
    assert rendered({"radii": r2}, per_view=True).tolist() == [[True, False, False], [False, False, True]]
    assert rendered({"radii": r2[..., 0]}).tolist() == [True, False, True]  # [C, N]


def test_the_loop_needs_only_the_strategy_protocol(tmp_path):
    """Any object with the protocol's methods plugs into the loop: its loss terms are added to the loss, and its
    hooks run in order with the step's position learning rate."""
    from dataclasses import replace

    from splatflow.scene.dataset import load_scene
    from splatflow.train import Trainer
    from tests._tiny import write_tiny_scene

    d = write_tiny_scene(tmp_path, width=64, height=48, n_points=300)
    scene = load_scene(d, d / "split.json")
    cfg = TrainConfig(max_steps=10, backend="cpu", progress=False)
    cfg = replace(cfg, early_stop=replace(cfg.early_stop, enabled=False),
                  densify=replace(cfg.densify, strategy="none"), prune_during=replace(cfg.prune_during, enabled=False))

    class Recorder:
        def __init__(self, term):
            self.term, self.calls, self.last_event = term, [], None

        def initialize_state(self, scene_scale=1.0, device="cpu"):
            return {}

        def loss_terms(self, params, info):
            self.calls.append("loss_terms")
            return None if self.term is None else params["opacities"].sum() * 0.0 + self.term

        def step_pre_backward(self, params, optimizers, state, step, info):
            self.calls.append("pre")

        def step_post_backward(self, params, optimizers, state, step, info, *, lr=0.0):
            self.calls.append(("post", step, lr))
            self.last_event = {"step": step, "added": 0, "gaussians": params["means"].shape[0]}

    losses = []
    for term in (None, 0.25):
        tr = Trainer(scene, cfg, seed=0)
        tr.strategy = Recorder(term)
        assert isinstance(tr.strategy, Strategy) and isinstance(BudgetedDefaultStrategy(cap=1), Strategy) \
            and isinstance(TorchMCMCStrategy(), Strategy)
        torch.manual_seed(0)  # (the view comes from the run's own generator, seeded 0 in both trainers)
        losses.append(tr.train_step()["loss"])
        assert tr.strategy.calls == ["pre", "loss_terms", ("post", 0, tr.sched.means_lr.lr(0))]
        assert tr.events and tr.events[-1]["step"] == 0  # the strategy's event is logged
    assert losses[1] == pytest.approx(losses[0] + 0.25, rel=1e-6)
