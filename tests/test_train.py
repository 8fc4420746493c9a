"""Training on a tiny generated scene: learning, exact resume, guards, SIGTERM, the stage's outputs.

The scene is the project's synthetic room (10 views, 96x72, a 60 degree arc) with its true cameras and
points, so these tests do not depend on SfM. Test views are interior views (3 and 7), never trained on.
"""

import csv
import math
import os
import random
import signal
import subprocess
import sys
import traceback
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from splatflow.pipeline.config import TrainConfig, params_from_dict
from splatflow.gaussians.model import Splats, init_splats, load_checkpoint, load_splats
from splatflow.render import configure_threads
from splatflow.train import GradientHealthError, Trainer, finetune, photometric_loss, train
from splatflow.train.guards import DeferredChecks, StepChecks
from splatflow.train.loop import CSV_FIELDS
from splatflow.train.policies import VisibleAdamStep
from tests._tiny import mean_view_psnr, scene, scene_dir, tiny_train_cfg  # noqa: F401 (fixtures)

ROOT = Path(__file__).resolve().parents[1]


def small_cfg(max_steps=300, **kw) -> TrainConfig:
    """The training mechanics alone (pruning during training has tests of its own), validated every 50 steps."""
    cfg = tiny_train_cfg(max_steps)
    return replace(cfg, early_stop=replace(cfg.early_stop, eval_every=50, val_views=2), **kw)



def train_off_and_on(scene, switch: str) -> dict:
    """{False: (held-out PSNR, Gaussians), True: (...)} of two 300-step runs from seed 0 on quarter-view windows
    with densification, the train setting ``switch`` off and on (a helper, not a test)."""
    cfg = small_cfg(300, patch_max_pixels=96 * 72 // 4)
    cfg = replace(cfg, early_stop=replace(cfg.early_stop, enabled=False))
    out = {}
    for on in (False, True):
        res = train(scene, replace(cfg, **{switch: on}), seed=0)
        out[on] = (mean_view_psnr(res.splats, scene.test_views, res.sh_degree), Splats.of(res.splats).n)
    return out


@pytest.mark.parametrize("strategy", ["mcmc", "default"])
def test_training_lifts_test_view_psnr_well_above_the_initial_render(scene, tmp_path, strategy):
    init = init_splats(scene.points, scene.colors, sh_degree=3)
    before = mean_view_psnr(init, scene.test_views, 0)
    cfg = small_cfg(300)
    cfg = replace(cfg, densify=replace(cfg.densify, strategy=strategy),  # the plateau stop has its own tests
                  early_stop=replace(cfg.early_stop, enabled=False))
    res = train(scene, cfg, ckpt_path=tmp_path / "ckpt.pt", csv_path=tmp_path / "train.csv")
    after = mean_view_psnr(res.splats, scene.test_views, res.sh_degree)
    assert res.steps == 300 and res.stopped == "max_steps"
    # MCMC grows by 5% per refine, so in these 300 steps it ends with fewer Gaussians than ADC and learns less
    lift, floor = (5.0, 21.0) if strategy == "default" else (4.0, 20.5)
    assert after > before + lift, (before, after)
    assert after > floor, (before, after)
    assert res.splats["means"].shape[0] > init["means"].shape[0]  # densification grew the model
    if strategy == "default":
        assert any(e.get("splits", 0) + e.get("clones", 0) > 0 for e in res.events)
    else:
        assert any(e.get("added", 0) > 0 for e in res.events)
    # outputs: a checkpoint the contract's reader accepts, and a CSV with one row per log_every steps
    splats, deg = load_splats(tmp_path / "ckpt.pt")
    assert deg == res.sh_degree == 3 and torch.equal(splats["means"], res.splats["means"])
    rows = list(csv.DictReader(open(tmp_path / "train.csv")))
    assert tuple(rows[0].keys()) == CSV_FIELDS and len(rows) == 30
    assert rows[0]["resolution"] == "12x9" and rows[-1]["resolution"] == "96x72"  # 1/8 -> full
    assert float(rows[0]["sigma"]) > 2.0 and float(rows[-1]["sigma"]) == 0.0
    assert all(5.0 < float(r["psnr"]) < 60.0 and float(r["loss"]) > 0 for r in rows)  # real per-step values


def test_resume_equals_uninterrupted_run(scene, tmp_path):
    # refine events (splits/clones with random offsets) and a phase change fall inside both halves
    cfg = small_cfg(60, checkpoint_every=1000)
    cfg = replace(cfg, densify=replace(cfg.densify, refine_every=10, refine_start_fraction=0.1))
    full = train(scene, cfg, ckpt_path=tmp_path / "a.pt")
    part = train(scene, cfg, ckpt_path=tmp_path / "b.pt", stop_after=33)
    assert part.steps == 33 and not load_checkpoint(tmp_path / "b.pt")["finished"]
    torch.manual_seed(123)  # disturb every RNG: the checkpoint must restore them
    np.random.seed(123)
    resumed = Trainer(scene, cfg, ckpt_path=tmp_path / "b.pt")
    res = resumed.run()
    assert resumed.resumed_from == 33 and res.steps == 60
    assert full.splats["means"].shape == res.splats["means"].shape
    for k in full.splats:
        torch.testing.assert_close(res.splats[k], full.splats[k], rtol=1e-5, atol=1e-6)
    # a finished checkpoint is not resumed: rerunning trains from scratch
    again = Trainer(scene, cfg, ckpt_path=tmp_path / "b.pt")
    again.run()
    assert again.resumed_from is None


def test_an_unfinished_run_resumes_only_on_the_same_scene_data(scene, tmp_path, capsys):
    """A stopped run whose scene changed since (new photos, a new SfM model, another split) trains afresh and
    says why; on the same data it resumes and says so. Before, only params and seed were compared, and a capture
    with one photo more continued the old model without a word."""
    cfg = small_cfg(30, checkpoint_every=1000)
    train(scene, cfg, ckpt_path=tmp_path / "b.pt", stop_after=12)
    capsys.readouterr()
    moved = replace(scene, points=scene.points + np.float32(0.01))  # another SfM model of the same views
    tr = Trainer(moved, cfg, ckpt_path=tmp_path / "b.pt", stop_after=13)
    tr.run()
    err = capsys.readouterr().err
    assert tr.resumed_from is None and "not resumed because the scene's data differ" in err
    assert "stopped at step 12" in err
    train(scene, cfg, ckpt_path=tmp_path / "c.pt", stop_after=12)
    resplit = replace(scene, train_views=scene.train_views[1:], test_views=scene.test_views + scene.train_views[:1])
    tr = Trainer(resplit, cfg, ckpt_path=tmp_path / "c.pt")
    tr.run()
    assert tr.resumed_from is None  # another split
    train(scene, cfg, ckpt_path=tmp_path / "d.pt", stop_after=12)
    capsys.readouterr()
    tr = Trainer(scene, cfg, ckpt_path=tmp_path / "d.pt")
    tr.run()
    assert tr.resumed_from == 12 and "resuming the unfinished run from step 12" in capsys.readouterr().err


def test_gradient_guard_fires_on_a_detached_render(scene):
    tr = Trainer(scene, small_cfg(20))
    tr.loss_fn = lambda pred, gt, s, lam: photometric_loss(pred.detach(), gt, s, lam)
    with pytest.raises(GradientHealthError, match="detached"):
        tr.run()
    # connected but with zero gradient (e.g. a render that ignores the Gaussians' values)
    tr2 = Trainer(scene, small_cfg(20))

    def zero_grad_loss(pred, gt, s, lam):
        loss, l1, ss = photometric_loss(pred.detach(), gt, s, lam)
        return loss + 0.0 * pred.sum(), l1, ss

    tr2.loss_fn = zero_grad_loss
    with pytest.raises(GradientHealthError, match="means, sh0"):  # (under MCMC opacities get a regulariser grad)
        tr2.run()


def test_nan_guard_stops_and_keeps_the_last_good_checkpoint(scene, tmp_path):
    tr = Trainer(scene, small_cfg(50, checkpoint_every=5), ckpt_path=tmp_path / "c.pt")

    def nan_after_12(pred, gt, s, lam):
        loss, l1, ss = photometric_loss(pred, gt, s, lam)
        return (loss * float("nan") if tr.step >= 12 else loss), l1, ss

    tr.loss_fn = nan_after_12
    res = tr.run()
    assert res.stopped.startswith("nonfinite") and "step 10" in res.stopped
    ckpt = load_checkpoint(tmp_path / "c.pt")
    assert ckpt["step"] == 10 and not ckpt["finished"]
    assert all(torch.isfinite(v).all() for v in res.splats.values())
    torch.testing.assert_close(res.splats["means"], ckpt["splats"]["means"])


def test_deferred_checks_keep_a_nan_loss_out_of_the_parameters_and_stop(scene, tmp_path):
    """A GPU run's guards read nothing back per step (``splatflow.train.guards.DeferredChecks``, on for CUDA;
    forced here on the CPU with the dense step, as on a GPU): a non-finite loss makes fused Adam skip its update on
    the device, and the run stops at the next settle with the last good checkpoint, as the per-step check does."""
    cfg = small_cfg(50, checkpoint_every=5, sparse_step=False)
    tr = Trainer(scene, cfg, ckpt_path=tmp_path / "c.pt")
    assert not tr.checks.deferred  # a CPU run checks every step
    tr.checks = DeferredChecks()
    seen = {}

    def nan_from_12(pred, gt, s, lam):
        loss, l1, ss = photometric_loss(pred, gt, s, lam)
        if tr.step == 12:
            seen["before"] = {k: v.detach().clone() for k, v in tr.state.params.items()}
        return (loss * float("nan") if tr.step >= 12 else loss), l1, ss

    tr.loss_fn = nan_from_12
    res = tr.run()
    assert res.stopped.startswith("nonfinite: the loss became NaN/Inf at one of steps 10 to 14")
    assert "kept the last good checkpoint (step 10)" in res.stopped
    for k, v in seen["before"].items():  # steps 12-14 changed nothing: Adam skipped them on the device
        assert torch.equal(tr.state.params[k].detach(), v), k
    assert load_checkpoint(tmp_path / "c.pt")["step"] == 10
    assert all(torch.isfinite(v).all() for v in res.splats.values())


def test_deferred_checks_train_the_same_model_with_numbers_in_the_rows(scene, tmp_path):
    """With nothing non-finite, the deferred checks change nothing: the same parameters to the bit as checking
    every step, and the logged rows hold numbers."""
    cfg = small_cfg(30, sparse_step=False)
    results = []
    for defer in (False, True):
        tr = Trainer(scene, cfg, csv_path=tmp_path / f"t{defer}.csv")
        tr.checks = DeferredChecks() if defer else StepChecks()
        results.append(tr.run())
        rows = list(csv.DictReader(open(tmp_path / f"t{defer}.csv")))
        assert rows and all(math.isfinite(float(r["loss"])) and math.isfinite(float(r["ssim"])) for r in rows)
    for k in results[0].splats.keys():
        assert torch.equal(results[0].splats[k], results[1].splats[k]), k


# operations that make the host wait for a GPU: a number read back, a size that depends on the data, or a tensor made
# from Python numbers (copied to the device while the host waits)
_WAITS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "unique_dim", "unique_consecutive",
          "repeat_interleave", "lift_fresh", "lift_fresh_copy", "equal", "is_nonzero", "allclose"}


class _HostWaits(TorchDispatchMode):
    """Records, per training step, the operations of :data:`_WAITS` (and indexing by a boolean mask) made by the
    training loop's own code: the rasterizer and the CPU loss kernels are left out (``splatflow/render``: a GPU runs
    gsplat's kernels and the torch or Triton loss instead, tests/test_ssim.py checks those on the meta device), as
    is the host's image decoding (``splatflow/scene/images.py``: a GPU run uploads from pinned memory without
    waiting)."""

    def __init__(self):
        super().__init__()
        self.sites: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        bool_index = name in ("index", "index_put", "index_put_") and any(
            isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in (args[1] or ()))
        if name in _WAITS or bool_index:
            ours = [f for f in traceback.extract_stack() if "/splatflow/" in f.filename]
            if ours and "/splatflow/render/" not in ours[-1].filename and not ours[-1].filename.endswith("images.py"):
                self.sites.append(f"{name} at {Path(ours[-1].filename).name}:{ours[-1].lineno}")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("strategy", ["default", "mcmc"])
def test_a_gpu_step_makes_the_host_wait_only_at_refines(scene, strategy):
    """As a GPU run trains (whole images, the dense step, the deferred checks, no validation), a step asks the
    device for nothing the host must wait for, except on the first step (the gradient health check) and at a
    refine (densification counts what it adds and removes). One tensor made from Python numbers per step was
    enough to stall the GPU's queue at every step (the densification gradients' NDC scale, until 2026-12-01)."""
    cfg = small_cfg(60, sparse_step=False, patch_max_pixels=0, coarse_to_fine=False, log_every=1000)
    cfg = replace(cfg, early_stop=replace(cfg.early_stop, enabled=False),
                  densify=replace(cfg.densify, strategy=strategy))
    tr = Trainer(scene, cfg)
    tr.checks = DeferredChecks()
    per_step, step_fn = {}, tr.train_step

    def audited():
        with _HostWaits() as mode:
            row = step_fn()
        per_step[tr.step] = mode.sites
        return row

    tr.train_step = audited
    tr.run()
    every = cfg.densify.refine_every
    refines = [s for s in per_step if s > 0 and s % every == 0 and tr.strategy.refine_start_iter < s]
    assert len(per_step) == 60 and refines, (len(per_step), refines)
    waits = {s: sites for s, sites in per_step.items() if sites and s != 0 and s not in refines}
    assert not waits, waits
    assert any(per_step[s] for s in refines)  # the audit sees what it looks for


SIGTERM_SCRIPT = """
import sys
from dataclasses import replace
from splatflow.pipeline.config import TrainConfig
from splatflow.render import configure_threads
from splatflow.scene.dataset import load_scene
from splatflow.train import train
configure_threads(1)
scene = load_scene(sys.argv[1], sys.argv[1] + "/split.json")
class Announce:
    def log(self, step, metrics):
        print("step", step, flush=True)
    def close(self):
        pass
cfg = TrainConfig(max_steps=100000, backend="cpu", progress=False, checkpoint_every=100000, log_every=5)
cfg = replace(cfg, early_stop=replace(cfg.early_stop, enabled=False),
              prune_during=replace(cfg.prune_during, enabled=False))
res = train(scene, cfg, ckpt_path=sys.argv[2], step_logger=Announce())
print("STOPPED", res.stopped, res.steps, flush=True)
"""


def test_sigterm_saves_a_resumable_checkpoint_and_exits_cleanly(scene_dir, tmp_path):
    ckpt = tmp_path / "s.pt"
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", SPLATFLOW_TRACKING="off")
    proc = subprocess.Popen([sys.executable, "-c", SIGTERM_SCRIPT, str(scene_dir), str(ckpt)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # training is under way
        assert line.startswith("step"), line + proc.stderr.read()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "STOPPED sigterm" in out
    c = load_checkpoint(ckpt)
    assert c["step"] >= 5 and not c["finished"] and c["stopped"].startswith("sigterm")
    assert int(out.split()[-1]) == c["step"]


def test_finetune_improves_a_perturbed_model_without_densifying(scene):
    init = init_splats(scene.points, scene.colors, sh_degree=1)
    before = mean_view_psnr(init, scene.train_views[:3], 0)
    out = finetune(init, scene, 60, small_cfg(60), sh_degree=0)
    assert out["means"].shape == init["means"].shape  # no densification
    assert mean_view_psnr(out, scene.train_views[:3], 0) > before + 1.0
    assert torch.equal(init["means"], init_splats(scene.points, scene.colors, sh_degree=1)["means"])  # untouched


def test_train_stage_writes_contract_outputs(scene_dir, tmp_path):
    import shutil

    from splatflow.pipeline.paths import ScenePaths
    from stages.train import run

    paths = ScenePaths("tiny", tmp_path)
    und = paths.undistorted_dir
    shutil.copytree(scene_dir / "images", und / "images")
    shutil.copytree(scene_dir / "ground_truth", und / "sparse")
    shutil.copy(scene_dir / "split.json", paths.split_json)
    params = params_from_dict({"train": {"max_steps": 30, "backend": "cpu", "progress": False,
                                         "early_stop": {"eval_every": 10, "val_views": 2}}})
    metrics = run(params, paths)
    assert {"steps", "stopped", "gaussians", "train_seconds", "it_per_s", "peak_rss_mb", "val_psnr"} <= set(metrics)
    assert metrics["steps"] == 30 and metrics["stopped"] == "max_steps" and metrics["val_psnr"] > 10
    splats, _ = load_splats(paths.train_ckpt)
    assert splats["means"].shape[0] == metrics["gaussians"]
    assert len(list(csv.DictReader(open(paths.train_csv)))) == 3


def test_patch_windows_cover_every_pixel_equally_and_average_the_budget():
    """Training windows stay inside the image, average ``patch_max_pixels`` pixels, and cover the border as often
    as the centre (windows kept inside the image starve a band a window deep along the border)."""
    import random

    from splatflow.train.windows import PATCH_MIN_SIDE, patch_window

    rng = random.Random(3)
    assert patch_window(96, 72, 0, rng) is None and patch_window(96, 72, 96 * 72, rng) is None
    for W, H, budget in ((800, 600, 60000), (400, 300, 60000)):  # the second mixes in whole images
        rng.seed(3)
        cover = np.zeros((H, W))
        areas = []
        for _ in range(3000):
            win = patch_window(W, H, budget, rng)
            x0, y0, w, h = win if win is not None else (0, 0, W, H)
            assert 0 <= x0 and x0 + w <= W and 0 <= y0 and y0 + h <= H
            assert w >= PATCH_MIN_SIDE and h >= PATCH_MIN_SIDE
            cover[y0:y0 + h, x0:x0 + w] += 1
            areas.append(w * h)
        assert abs(np.mean(areas) - budget) < 0.05 * budget, np.mean(areas)
        centre = cover[H // 2 - 20:H // 2 + 20, W // 2 - 20:W // 2 + 20].mean()
        for band in (cover[:, :PATCH_MIN_SIDE], cover[:, -PATCH_MIN_SIDE:], cover[:PATCH_MIN_SIDE], cover[-16:],
                     cover[:, W // 8:W // 8 + 8]):
            assert 0.85 < band.mean() / centre < 1.15, band.mean() / centre


def test_patch_render_is_the_window_of_the_whole_render(scene):
    """Training on a patch renders exactly the pixels of the whole view inside the window (the shifted principal
    point is right), with the matching window of the target, and densification still sees the level's size."""
    import random

    from splatflow.train.windows import patch_window

    cfg = small_cfg(patch_max_pixels=1500)
    tr = Trainer(scene, cfg, seed=0)
    with torch.no_grad():
        full, full_t, _ = tr.render(1, 1.0, 1)
        x0, y0, w, h = patch_window(96, 72, 1500, random.Random(11))
        tr.rng.python.seed(11)  # the run's own generator draws the render's window: the same one
        part, part_t, info = tr.render(1, 1.0, 1, patch=True)
    assert part.shape == (h, w, 3) and (w, h) != (96, 72)
    assert (info["width"], info["height"]) == (96, 72)
    torch.testing.assert_close(part_t, full_t[y0:y0 + h, x0:x0 + w])
    torch.testing.assert_close(part, full[y0:y0 + h, x0:x0 + w], atol=1e-5, rtol=1e-5)


def test_coarse_levels_train_on_larger_windows(scene):
    """``train.patch_level_exponent``: a level at factor f < 1 gets windows of patch_max_pixels / f^exponent (whole
    images once that covers the level), full resolution keeps patch_max_pixels, 0 keeps it everywhere, and a bad
    exponent is rejected naming the key."""
    from splatflow.pipeline.config import ConfigError, params_from_dict
    from splatflow.train.windows import level_budget

    assert level_budget(60000, 1.0, 1.0) == 60000 and level_budget(60000, 0.75, 1.0) == 80000
    assert level_budget(60000, 0.5, 1.0) == 120000 and level_budget(60000, 0.5, 2.0) == 240000
    assert level_budget(60000, 0.5, 0.0) == 60000 and level_budget(0, 0.5, 1.0) == 0
    areas = {}
    for exponent in (0.0, 1.0):
        tr = Trainer(scene, small_cfg(patch_max_pixels=1200, patch_level_exponent=exponent), seed=0)
        tr.rng.python.seed(5)
        with torch.no_grad():
            sizes = [tr.render(0, 0.5, 0, patch=True)[0].shape[:2] for _ in range(40)]  # level 48x36 = 1728 px
            full = [tr.render(0, 1.0, 0, patch=True)[0].shape[:2] for _ in range(40)]  # 96x72: windows both ways
        areas[exponent] = (np.mean([h * w for h, w in sizes]), np.mean([h * w for h, w in full]))
    assert areas[0.0][0] < 1728 and areas[1.0][0] == 1728  # 1200 / 0.5 = 2400 > 1728: the whole level
    assert abs(areas[0.0][1] - 1200) < 240 and abs(areas[1.0][1] - 1200) < 240
    with pytest.raises(ConfigError, match="train.patch_level_exponent"):
        params_from_dict({"train": {"patch_level_exponent": -1}})


def test_auto_windows_are_the_cpu_budget_and_whole_images_on_cuda(scene):
    """``train.patch_max_pixels: auto`` (the default) = CPU_WINDOW_PIXELS-pixel windows on the CPU backend and whole
    images on CUDA, whose step is launch-bound (bench/RESULTS.md "GPU path"); an integer means the same on every
    backend; anything else is rejected naming the key. The trainer keeps what it resolved for its backend."""
    from splatflow.pipeline.config import CPU_WINDOW_PIXELS, ConfigError, load_params

    auto = params_from_dict({}).train
    assert auto.patch_max_pixels == "auto" and load_params(ROOT / "params.yaml").train.patch_max_pixels == "auto"
    assert auto.window_pixels("cpu") == auto.window_pixels("torch") == CPU_WINDOW_PIXELS == 60000
    assert auto.window_pixels("cuda") == 0
    fixed = params_from_dict({"train": {"patch_max_pixels": 5000}}).train
    assert fixed.window_pixels("cpu") == fixed.window_pixels("cuda") == 5000
    for bad in ("whole", 500, 1.5):
        with pytest.raises(ConfigError, match="train.patch_max_pixels"):
            params_from_dict({"train": {"patch_max_pixels": bad}})
    assert Trainer(scene, small_cfg(patch_max_pixels="auto"), seed=0).window_pixels == 60000
    assert Trainer(scene, small_cfg(patch_max_pixels=1200), seed=0).window_pixels == 1200


def test_patch_training_learns(scene):
    """Training on windows of a quarter of each view (a quarter of the pixels per step) still fits the held-out
    views: the same 300 steps as the whole-view test above lift them by more than 3 dB."""
    cfg = small_cfg(max_steps=300, patch_max_pixels=96 * 72 // 4)
    res = train(scene, cfg, seed=0)
    init = init_splats(scene.points, scene.colors, sh_degree=cfg.sh_degree)
    before = mean_view_psnr(init, scene.test_views, 0)
    after = mean_view_psnr(res.splats, scene.test_views, res.sh_degree)
    assert after > before + 3.0, (before, after)


def test_visible_adam_leaves_unseen_gaussians_and_their_moments_alone(scene):
    cfg = small_cfg(visible_adam=True)
    tr = Trainer(scene, cfg, seed=0)
    n = tr.state.params["means"].shape[0]
    g = torch.Generator().manual_seed(0)
    radii = torch.randint(1, 5, (1, n, 2), generator=g, dtype=torch.int32)
    unseen = torch.zeros(n, dtype=torch.bool)
    unseen[::3] = True
    radii[0, unseen] = 0
    for step in range(2):  # the second step also has moments to keep
        before = {k: p.detach().clone() for k, p in tr.state.params.items()}
        moments = {k: {m: t.clone() for m, t in opt.state[tr.state.params[k]].items() if m != "step"}
                   for k, opt in tr.state.optimizers.items() if tr.state.params[k] in opt.state}
        for p in tr.state.params.values():
            p.grad = torch.randn(p.shape, generator=g)
        VisibleAdamStep().step(tr.state, {"radii": radii})  # the optimizer step of train.visible_adam
        for k, p in tr.state.params.items():
            assert torch.equal(p.detach()[unseen], before[k][unseen]), k
            assert not torch.equal(p.detach()[~unseen], before[k][~unseen]), k
            for m, t in moments.get(k, {}).items():
                now = tr.state.optimizers[k].state[p][m]
                assert torch.equal(now[unseen], t[unseen]), (k, m)
                assert not torch.equal(now[~unseen], t[~unseen]), (k, m)
        assert all(p.grad is None for p in tr.state.params.values())
    assert step == 1 and moments  # the check above ran on real moments


def test_mcmc_regulariser_only_pulls_on_rendered_gaussians(scene):
    """3DGS-MCMC's opacity/scale regularisers act on the Gaussians a step renders: an unseen one (outside the
    training window) gets no gradient, which Adam would otherwise blow up to a full step towards opacity 0."""
    cfg = small_cfg()
    tr = Trainer(scene, replace(cfg, densify=replace(cfg.densify, strategy="mcmc")), seed=0)
    n = tr.state.params["means"].shape[0]
    radii = torch.full((1, n, 2), 3, dtype=torch.int32)
    unseen = torch.zeros(n, dtype=torch.bool)
    unseen[1::2] = True
    radii[0, unseen] = 0
    reg = tr.strategy.loss_terms(tr.state.params, {"radii": radii})
    p = tr.state.params  # the paper's means over the rendered ones, here without a boolean index (no host sync)
    expect = 0.01 * torch.sigmoid(p["opacities"][~unseen]).mean() + 0.01 * torch.exp(p["scales"][~unseen]).mean()
    assert tr.strategy.opacity_reg == tr.strategy.scale_reg == 0.01
    assert torch.allclose(reg, expect, rtol=1e-5)
    reg.backward()
    for k in ("opacities", "scales"):
        grad = tr.state.params[k].grad
        assert torch.all(grad[unseen] == 0), k
        assert torch.all(grad[~unseen] != 0), k
    nothing = tr.strategy.loss_terms(tr.state.params, {"radii": torch.zeros_like(radii)})
    assert float(nothing) == 0.0


def test_a_run_draws_only_from_its_own_generators(scene, tmp_path):
    """The trainer's random numbers come from generators seeded by the run seed: the caller's global state neither
    changes a run nor is changed by it, so a fine-tune inside another stage saves and restores nothing."""
    cfg = small_cfg(24, checkpoint_every=1000)
    cfg = replace(cfg, densify=replace(cfg.densify, refine_every=8, refine_start_fraction=0.1))
    random.seed(1), torch.manual_seed(1)
    a = train(scene, cfg, seed=4)
    random.seed(2), torch.manual_seed(2)
    before = random.getstate(), torch.get_rng_state()
    b = train(scene, cfg, seed=4)
    assert random.getstate() == before[0] and torch.equal(torch.get_rng_state(), before[1])
    assert all(torch.equal(a.splats[k], b.splats[k]) for k in a.splats)
    tuned = finetune(a.splats, scene, 5, cfg, sh_degree=a.sh_degree, seed=7)
    assert random.getstate() == before[0] and torch.equal(torch.get_rng_state(), before[1])
    assert not torch.equal(tuned.means, a.splats.means)


def test_resume_from_a_checkpoint_with_global_rng_states(scene, tmp_path):
    """Checkpoints written when the trainer seeded the global generators hold their states (and numpy's, which
    training never drew from): such a file resumes into the run's own generators with the same result."""
    from splatflow.gaussians.model import Checkpoint

    cfg = small_cfg(30, checkpoint_every=1000)
    cfg = replace(cfg, densify=replace(cfg.densify, refine_every=8, refine_start_fraction=0.1))
    full = train(scene, cfg, ckpt_path=tmp_path / "a.pt")
    train(scene, cfg, ckpt_path=tmp_path / "b.pt", stop_after=13)
    d = load_checkpoint(tmp_path / "b.pt")
    d["rng"]["numpy"] = np.random.get_state()  # the old layout: the global generators' states
    d["prune_during"] = None
    torch.save(d, tmp_path / "b.pt")
    assert Checkpoint.load(tmp_path / "b.pt").resumable
    tr = Trainer(scene, cfg, ckpt_path=tmp_path / "b.pt")
    res = tr.run()
    assert tr.resumed_from == 13 and res.splats.n == full.splats.n
    for k in full.splats:
        torch.testing.assert_close(res.splats[k], full.splats[k], rtol=1e-5, atol=1e-6)
