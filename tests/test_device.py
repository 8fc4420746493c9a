"""One device per run: nothing the library allocates may land anywhere but the run's device.

No GPU here, so the check is inverted: the data and the run's device are the CPU while torch's DEFAULT device is
``meta``. Any tensor the library makes without an explicit ``device=`` (or ``new_*``/``*_like`` of a tensor on
the run's device) lands on ``meta``, and the first operation mixing it with a CPU tensor raises. On a GPU the same
forgotten ``device=`` would put a tensor on the CPU next to CUDA tensors: the crash this test prevents.

Also here: checkpoints are device-independent (every tensor saved on the CPU, loadable with any
``map_location``), the run records what ran, and the CUDA-marked tests that a GPU machine runs.
"""

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from splatflow.pipeline.config import EvaluateConfig, PruneConfig, TrainConfig
from splatflow.evaluation.lpips import LpipsSet
from splatflow.gaussians.model import init_splats, load_checkpoint
from tests._tiny import write_tiny_scene



@pytest.fixture(scope="module")
def scene(tmp_path_factory):
    from splatflow.scene.dataset import load_scene

    d = write_tiny_scene(tmp_path_factory.mktemp("device_scene"), width=64, height=48, n_points=1500)
    return load_scene(d, d / "split.json")


@pytest.fixture()
def strict_default_device():
    """torch's default device is ``meta`` for the duration of the test (restored afterwards, also on failure)."""
    torch.set_default_device("meta")
    try:
        yield
    finally:
        torch.set_default_device(None)


def _cfg(strategy: str, steps: int = 40, backend: str = "cpu") -> TrainConfig:
    cfg = TrainConfig(max_steps=steps, backend=backend, progress=False, sh_degree_interval=10,
                      random_background=True, checkpoint_every=15)
    # refine, opacity reset and MCMC relocation/add all happen inside these steps; windows on, validation on
    return replace(cfg, patch_max_pixels=1500,
                   densify=replace(cfg.densify, strategy=strategy, refine_every=5, refine_start_fraction=0.1,
                                   refine_stop_fraction=0.9, reset_every=20, max_gaussians=4000),
                   early_stop=replace(cfg.early_stop, eval_every=10, val_views=2, patience_steps=10_000),
                   prune_during=replace(cfg.prune_during, enabled=False))  # cut on the device: test_prune_during


def test_strict_default_device_catches_a_forgotten_device(strict_default_device):
    # the mechanism itself: a tensor made without device= cannot be mixed with the run's (CPU) tensors
    x = torch.ones(3, device="cpu")
    with pytest.raises((RuntimeError, NotImplementedError)):
        float((x + torch.ones(3)).sum())


@pytest.mark.parametrize("strategy,filter_3d", [("default", False), ("mcmc", False), ("default", True)])
def test_training_allocates_only_on_the_run_device(scene, tmp_path, strict_default_device, strategy, filter_3d):
    from splatflow.train import Trainer

    tr = Trainer(scene, replace(_cfg(strategy), filter_3d=filter_3d), ckpt_path=tmp_path / "ckpt.pt",
                 csv_path=tmp_path / "t.csv", seed=1)
    res = tr.run()
    assert res.steps == 40 and res.stopped == "max_steps"
    assert any(("clones" in e and e["clones"] + e["splits"] > 0) or e.get("added", 0) > 0 for e in res.events)
    if strategy == "default":
        assert any(e.get("opacity_reset") for e in res.events)
    assert all(v.device.type == "cpu" for v in res.splats.values())
    assert (res.splats.filter_3d is not None) == filter_3d  # (the 3D smoothing filter, recomputed on the device)
    assert res.device["backend"] == "cpu" and res.device["gpu_peak_allocated_mib"] is None


def test_prune_and_evaluate_allocate_only_on_the_run_device(scene, tmp_path, strict_default_device):
    from splatflow.compress import prune, scoring
    from splatflow.evaluation.evaluate import evaluate
    from splatflow.train import finetune

    cfg = _cfg("default", steps=30)
    with torch.device("cpu"):  # the starting model only: not the code under test
        splats = init_splats(scene.points, scene.colors, sh_degree=1)
    cams = scoring.cameras_at(scene.train_views, 1.0)
    targets = prune.CachedImages(scene.train_views, 1.0)

    def recover(s, deg, steps, desc, rows):
        return finetune(s, scene, steps, cfg, sh_degree=deg, means_lr_factor=0.3)

    for score in ("removal", "significance"):
        pcfg = PruneConfig(finetune_steps=10, finetune_growth=0.0, max_psnr_drop_db=50.0, score=score,
                           score_rounds=2, backend="cpu", progress=False)
        res = prune.prune_phases(splats, 1, pcfg, score_cameras=cams, val_cameras=cams[:2],
                                 val_targets=[targets[0], targets[1]], keep_fractions=[0.5], finetune=recover,
                                 score_targets=targets)
        assert res.report["gaussians_after"] == round(0.5 * splats["means"].shape[0])
        assert res.report["phases"][0]["finetune_steps"] == 10
    summary, df = evaluate(res.splats, 1, scene.test_views, EvaluateConfig(backend="cpu"),
                           renders_dir=tmp_path / "r", progress=False, lpips=LpipsSet([], None))
    assert summary["test_views"] == 2 and 5.0 < summary["psnr"] < 60.0
    assert summary["device"]["backend"] == "cpu" and summary["device"]["torch"] == torch.__version__
    assert (tmp_path / "r" / Path(scene.test_views[0].name).with_suffix(".png")).exists()


def test_checkpoints_hold_host_tensors_and_load_on_any_device(scene, tmp_path):
    from splatflow.train import Trainer

    cfg = _cfg("default", steps=20)
    tr = Trainer(scene, cfg, ckpt_path=tmp_path / "a.pt", seed=0)
    tr.run()
    ckpt = load_checkpoint(tmp_path / "a.pt")

    def devices(obj, out):
        if isinstance(obj, torch.Tensor):
            out.add(obj.device.type)
        elif isinstance(obj, dict):
            for v in obj.values():
                devices(v, out)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                devices(v, out)
        return out

    assert devices(ckpt, set()) == {"cpu"}
    # loaded onto another device with map_location: the same values
    meta = torch.load(tmp_path / "a.pt", map_location="meta", weights_only=False)
    assert meta["splats"]["means"].device.type == "meta"
    assert meta["splats"]["means"].shape == ckpt["splats"]["means"].shape
    # and a stopped run resumes from it (optimizer and strategy state moved to the run's device)
    part = Trainer(scene, replace(cfg, max_steps=30), ckpt_path=tmp_path / "b.pt", seed=0, stop_after=12)
    part.run()
    resumed = Trainer(scene, replace(cfg, max_steps=30), ckpt_path=tmp_path / "b.pt", seed=0)
    res = resumed.run()
    assert resumed.resumed_from == 12 and res.steps == 30


def test_cuda_without_a_gpu_is_a_user_error():
    from splatflow.pipeline.device import resolve
    from splatflow.pipeline.errors import UserError

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(UserError, match="needs a CUDA GPU"):
        resolve("cuda")
    assert resolve("auto").backend == "cpu"


# ------------------------------------------------------------------------------------------ on a GPU only


@pytest.mark.cuda
def test_cpu_and_cuda_rasterizers_agree():
    from splatflow.render import rasterize

    g = torch.Generator().manual_seed(0)
    N, W, H = 400, 64, 48
    means = torch.randn(N, 3, generator=g) * 0.4
    means[:, 2] += 3.0
    quats = torch.randn(N, 4, generator=g)
    scales = torch.rand(N, 3, generator=g) * 0.05 + 0.01
    opac = torch.rand(N, generator=g) * 0.8 + 0.1
    sh = torch.randn(N, 16, 3, generator=g) * 0.3
    view = torch.eye(4)[None]
    K = torch.tensor([[[60.0, 0, 32], [0, 60.0, 24], [0, 0, 1]]])
    out = {}
    for backend, dev in (("cpu", "cpu"), ("cuda", "cuda")):
        ins = [t.detach().to(dev).requires_grad_() for t in (means, quats, scales, opac, sh)]  # fresh leaves
        img, _, _ = rasterize(*ins, view.to(dev), K.to(dev), W, H, sh_degree=3, backend=backend)
        (img * torch.linspace(0, 1, 3, device=dev)).sum().backward()
        out[backend] = (img.detach().cpu(), [t.grad.cpu() for t in ins])
    torch.testing.assert_close(out["cuda"][0], out["cpu"][0], atol=1e-4, rtol=0)
    for gc, gg in zip(out["cpu"][1], out["cuda"][1]):
        rel = float((gg - gc).norm() / gc.norm().clamp_min(1e-12))
        assert rel < 1e-3, rel


@pytest.mark.cuda
@pytest.mark.parametrize("strategy", ["default", "mcmc"])
def test_tiny_training_on_cuda(scene, tmp_path, strategy):
    from splatflow.train import Trainer

    cfg = _cfg(strategy, steps=200, backend="cuda")
    # one opacity reset (step 60) with time to recover: _cfg's reset every 20 steps up to step 180 leaves the
    # model at ~12 dB on either backend (measured on a GPU, 2026-11-26)
    cfg = replace(cfg, densify=replace(cfg.densify, reset_every=60, refine_stop_fraction=0.6))
    res = Trainer(scene, cfg, ckpt_path=tmp_path / "c.pt", seed=0).run()
    assert res.device["backend"] == "cuda" and res.device["gpu_peak_allocated_mib"] > 0
    assert res.val_psnr is not None and res.val_psnr > 18.0
    # the same run on the CPU backend lands within rounding-driven drift of the GPU's
    cpu = Trainer(scene, replace(cfg, backend="cpu"), seed=0).run()
    assert abs(res.val_psnr - cpu.val_psnr) < 1.5, (res.val_psnr, cpu.val_psnr)
    # trained on the GPU, resumed/evaluated on the CPU: the checkpoint is host tensors
    ckpt = load_checkpoint(tmp_path / "c.pt")
    assert all(v.device.type == "cpu" for v in ckpt["splats"].values())
    assert np.isfinite(float(ckpt["splats"]["means"].sum()))


def test_backend_cuda_without_a_gpu_stops_the_stage_like_any_user_error(tmp_path):
    from tests._project import make_project, run, stage_record

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    root = make_project(tmp_path / "p", overrides={"train": {"backend": "cuda"}}, generate=False)
    p = run([sys.executable, "-m", "stages.train", "tiny"], root, check=False)
    assert p.returncode == 2, p.stderr
    assert "needs a CUDA GPU" in p.stderr and "backend='cpu'" in p.stderr
    assert "Traceback" not in p.stderr


def test_gsplat_kernels_that_cannot_load_give_a_clear_error(monkeypatch):
    import types

    from splatflow.pipeline import device

    fake = types.ModuleType("gsplat.cuda._backend")
    fake._C = None  # what gsplat leaves when its JIT build fails
    monkeypatch.setitem(sys.modules, "gsplat.cuda._backend", fake)
    monkeypatch.setattr(device, "_GSPLAT_CHECKED", False)
    with pytest.raises(device.GsplatUnavailableError) as e:
        device.check_gsplat_cuda()
    msg = str(e.value)
    assert "nvcc" in msg and "ninja" in msg and "backend" in msg and "Traceback" not in msg


@pytest.mark.cuda
@pytest.mark.slow
def test_whole_pipeline_on_cuda_matches_the_cpu_run(tmp_path):
    """The seven stages through DVC on the tiny scene, once with every backend on CUDA and once on the CPU: the
    GPU run's test PSNR is within 0.5 dB of the CPU run's, and its metrics say it ran on the GPU."""
    from tests._project import dvc, make_project

    # whole images on both backends (auto would give the CPU windows and CUDA whole images: not the same run)
    small = {"max_steps": 600, "patch_max_pixels": 0}
    results = {}
    for backend in ("cuda", "cpu"):
        root = make_project(tmp_path / backend, overrides={
            "train": {**small, "backend": backend}, "prune": {"backend": backend, "phases": 1, "min_train_views": 0},
            "evaluate": {"backend": backend, "lpips_variants": []}})
        dvc(root, "repro")
        ev = stage_record(root, "tiny", "evaluate")
        tr = stage_record(root, "tiny", "train")
        assert tr["device"]["backend"] == backend and ev["device"]["backend"] == backend
        if backend == "cuda":
            assert tr["device"]["gpu_peak_allocated_mib"] > 0 and ev["device"]["gpu_peak_reserved_mib"] > 0
        results[backend] = ev["psnr"]
    assert abs(results["cuda"] - results["cpu"]) <= 0.5, results
