"""``bench/gpu.py --peer-gsplat``: what can be checked without a GPU. The dataset written for gsplat's
simple_trainer (read back with pycolmap's own reader: names, sizes, intrinsics, poses, points; lossless pixels
equal to what splatflow trains on; the same held-out views), the reading of its stats files into a time curve
(evaluation time left out), the time ratio at equal PSNR, and the argument checks (one-line errors, exit 2; no GPU:
a message and exit 0)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

from bench import peer_gsplat as pg
from tests._tiny import write_tiny_scene

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def scene(tmp_path_factory):
    from splatflow.pipeline.config import ResolutionConfig, SplitConfig
    from splatflow.scene.dataset import load_scene
    from splatflow.scene.resolution import apply_resolution
    from splatflow.scene.split import write_split

    d = write_tiny_scene(tmp_path_factory.mktemp("peer_scene"), width=96, height=72, n_points=800)
    split = d / "every8.json"
    write_split(d, split, SplitConfig(rule="every_nth", every_n=8))
    sc, _ = apply_resolution(load_scene(d, split), ResolutionConfig(max_side_px=64))  # area-downscaled views
    return sc


def test_peer_dataset_reads_back_as_the_same_scene(scene, tmp_path):
    import pycolmap

    from splatflow.scene.resolution import read_view_rgb

    info = pg.write_peer_dataset(scene, tmp_path / "data")
    assert info["images"] == len(scene.views) and info["sizes"] == ["64x48"]
    rec = pycolmap.Reconstruction(str(tmp_path / "data" / "sparse" / "0"))
    by_name = {im.name: im for im in rec.images.values()}
    assert sorted(by_name) == sorted(p.name for p in (tmp_path / "data" / "images").iterdir())
    for v in scene.views:
        im = by_name[pg.peer_name(v.name)]
        cam = rec.cameras[im.camera_id]
        assert cam.model.name == "PINHOLE" and (cam.width, cam.height) == (v.width, v.height) == (64, 48)
        np.testing.assert_allclose(cam.params, [v.K[0, 0], v.K[1, 1], v.K[0, 2], v.K[1, 2]], rtol=1e-12)
        np.testing.assert_allclose(im.cam_from_world().matrix(), v.world_to_cam[:3, :], atol=1e-9)
        png = cv2.cvtColor(cv2.imread(str(tmp_path / "data" / "images" / pg.peer_name(v.name))), cv2.COLOR_BGR2RGB)
        assert np.array_equal(png, read_view_rgb(v))  # lossless: the very pixels splatflow uses
    assert len(rec.points3D) == len(scene.points)
    xyz = np.stack([p.xyz for p in rec.points3D.values()])
    np.testing.assert_allclose(np.sort(xyz, axis=0), np.sort(scene.points.astype(np.float64), axis=0), atol=1e-6)
    # the peer holds out exactly splatflow's test views
    assert info["test"] == sorted(pg.peer_name(v.name) for v in scene.test_views)
    # a call that trains only splatflow's side checks and describes the same dataset without writing it
    assert pg.write_peer_dataset(scene, tmp_path / "none", write=False) == info
    assert not (tmp_path / "none").exists()


def test_quaternions_of_every_branch_rebuild_their_rotation():
    from scipy.spatial.transform import Rotation

    rots = Rotation.from_euler("xyz", [[0, 0, 0], [np.pi, 0, 0], [0, np.pi, 0], [0, 0, np.pi],
                                       [3.0, 0.2, -0.1], [0.1, 3.0, 0.3], [0.2, -0.3, 3.1]]).as_matrix()
    for R in list(rots) + list(Rotation.random(50, random_state=0).as_matrix()):
        q = pg._rotmat_to_qvec(R)  # w, x, y, z
        assert q[0] >= 0 and abs(np.linalg.norm(q) - 1) < 1e-12
        np.testing.assert_allclose(Rotation.from_quat([q[1], q[2], q[3], q[0]]).as_matrix(), R, atol=1e-12)


def test_a_split_the_peer_would_not_reproduce_is_refused(scene, tmp_path):
    import dataclasses

    moved = dataclasses.replace(scene, test_views=scene.train_views[:1], train_views=scene.test_views)
    with pytest.raises(pg.PeerError, match="every_nth"):
        pg.write_peer_dataset(moved, tmp_path / "data")
    assert not (tmp_path / "data").exists()  # refused before writing anything
    assert pg.peer_test_names([f"{i:02d}.jpg" for i in range(17)]) == ["00.jpg", "08.jpg", "16.jpg"]


def _stats(d: Path, step0: int, elapsed: float, psnr: float, t_train: float, t_val: float, n: int = 1000) -> None:
    """One evaluation as simple_trainer writes it (0-based step in the names), file times as they would be."""
    s = d / "stats"
    s.mkdir(parents=True, exist_ok=True)
    tp, vp = s / f"train_step{step0:04d}_rank0.json", s / f"val_step{step0:04d}.json"
    tp.write_text(json.dumps({"mem": 1.5, "ellipse_time": elapsed, "num_GS": n}))
    vp.write_text(json.dumps({"psnr": psnr, "ssim": 0.8, "lpips": 0.2, "ellipse_time": 0.01, "num_GS": n}))
    os.utime(tp, (t_train, t_train))
    os.utime(vp, (t_val, t_val))


def test_peer_curve_leaves_its_evaluations_out(tmp_path):
    # evaluations took 4 s and 6 s; training ran 10 s, then 20 s more, then 30 s more
    _stats(tmp_path, 999, 10.0, 20.0, 1000.0, 1004.0)
    _stats(tmp_path, 1999, 34.0, 24.0, 1024.0, 1030.0)
    _stats(tmp_path, 29999, 70.0, 26.5, 1060.0, 1063.0, n=5000)
    curve = pg.read_peer_curve(tmp_path)
    assert [p["step"] for p in curve] == [1000, 2000, 30000]
    assert [p["seconds"] for p in curve] == [10.0, 30.0, 60.0]
    assert curve[-1]["psnr"] == 26.5 and curve[-1]["gaussians"] == 5000 and curve[0]["lpips"] == 0.2


def test_peer_curve_names_the_missing_file(tmp_path):
    with pytest.raises(pg.PeerError, match="no val_step"):
        pg.read_peer_curve(tmp_path)
    _stats(tmp_path, 999, 10.0, 20.0, 1000.0, 1004.0)
    (tmp_path / "stats" / "train_step0999_rank0.json").unlink()
    with pytest.raises(pg.PeerError, match="train_step0999_rank0.json"):
        pg.read_peer_curve(tmp_path)


def test_time_ratio_at_equal_psnr():
    peer = [{"step": 7000, "seconds": 100.0, "psnr": 25.0}, {"step": 30000, "seconds": 400.0, "psnr": 27.0}]
    ours = [{"step": 1000, "seconds": 20.0, "psnr": 24.0}, {"step": 3000, "seconds": 60.0, "psnr": 28.0},
            {"step": 6000, "seconds": 120.0, "psnr": 28.5}]
    assert pg.time_to_psnr(ours, 27.0) == pytest.approx(50.0)  # between 20 s (24 dB) and 60 s (28 dB)
    assert pg.time_to_psnr(ours, 29.0) is None
    assert pg.time_to_psnr(peer, 27.0) == 400.0
    c = pg.compare(ours, peer)
    assert c["time_ratio_at_peer_final_psnr"] == pytest.approx(50.0 / 400.0)
    assert c["final_psnr_gain_db"] == pytest.approx(1.5) and c["highest_common_psnr"] == 27.0
    slow = [{"step": 1000, "seconds": 900.0, "psnr": 26.0}]
    assert pg.compare(slow, peer)["time_ratio_at_peer_final_psnr"] is None  # never reached: no ratio


def test_peer_command_asks_for_stats_at_every_curve_point(tmp_path):
    cmd = pg.peer_command(tmp_path, "py", tmp_path / "d", tmp_path / "r", 30000, [1000, 30000])
    assert cmd[:3] == ["py", str(tmp_path / "examples" / "simple_trainer.py"), "default"]
    i, j = cmd.index("--eval_steps"), cmd.index("--save_steps")
    assert cmd[i + 1:i + 3] == cmd[j + 1:j + 3] == ["1000", "30000"]
    assert cmd[cmd.index("--data_factor") + 1] == "1" and "--disable_viewer" in cmd


def test_curve_steps_end_at_max_steps():
    from bench.gpu import curve_steps

    s = curve_steps(30000, 8)
    assert s[-1] == 30000 and s == sorted(set(s)) and len(s) == 8 and s[0] < 500
    assert curve_steps(5, 8)[-1] == 5 and curve_steps(100, 1) == [100]


def test_missing_peer_modules_are_named():
    assert pg.missing_modules(sys.executable, ("json", "no_such_module_xyz"))[:1] == ["no_such_module_xyz"]
    with pytest.raises(pg.PeerError, match="--peer-python"):
        pg.missing_modules("/no/such/python")


def _gpu_py(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT), SPLATFLOW_TRACKING="off")
    return subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), *args], capture_output=True, text=True,
                          env=env, timeout=300)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_gpu_bench_arguments_without_a_gpu(tmp_path):
    bad = _gpu_py("--peer-gsplat", str(tmp_path / "nowhere"), "--work", str(tmp_path / "w"))
    assert bad.returncode == 2 and "--peer-gsplat" in bad.stderr and "gsplat" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and "Traceback" not in bad.stderr
    (tmp_path / "co").mkdir()
    bad = _gpu_py("--peer-gsplat", str(tmp_path / "co"), "--work", str(tmp_path / "w"))
    assert bad.returncode == 2 and "examples/simple_trainer.py is missing" in bad.stderr
    for rel in (pg.PEER_SCRIPT, pg.PEER_PARSER):  # a checkout's files, so that the next check is the one seen
        (tmp_path / "co2" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "co2" / rel).write_text("")
    bad = _gpu_py("--peer-gsplat", str(tmp_path / "co2"), "--side", "ours", "--other-json", str(tmp_path / "n.json"))
    assert bad.returncode == 2 and "--other-json" in bad.stderr and "Traceback" not in bad.stderr
    ok = _gpu_py("--work", str(tmp_path / "w"))
    assert ok.returncode == 0 and "no CUDA GPU" in ok.stdout
    assert not (tmp_path / "w").exists()  # nothing prepared or trained


def test_two_side_runs_join_into_one_comparison(tmp_path):
    """A short GPU call per side: --join compares the two JSON files as one run of both would, and names a file
    that holds the wrong side."""
    peer = [{"step": 7000, "seconds": 100.0, "psnr": 25.0}, {"step": 30000, "seconds": 400.0, "psnr": 27.0}]
    ours = [{"step": 1000, "seconds": 20.0, "psnr": 24.0}, {"step": 3000, "seconds": 60.0, "psnr": 28.0}]
    a, b = tmp_path / "ours.json", tmp_path / "peer.json"
    a.write_text(json.dumps({"device_name": "a GPU", "peer": {"ours_curve": ours, "peer_curve": None}}))
    b.write_text(json.dumps({"device_name": "a GPU", "peer": {"ours_curve": None, "peer_curve": peer}}))
    res = _gpu_py("--join", str(a), str(b), "--json", str(tmp_path / "both.json"))
    assert res.returncode == 0, res.stderr
    assert "time ratio 0.125" in res.stdout  # 50 s (27 dB between 24 and 28) against 400 s
    both = json.loads((tmp_path / "both.json").read_text())["peer"]
    assert both["time_ratio_at_peer_final_psnr"] == pytest.approx(0.125) and both["peer_curve"] == peer
    bad = _gpu_py("--join", str(b), str(b))
    assert bad.returncode == 2 and "no ours_curve" in bad.stderr and "Traceback" not in bad.stderr


def test_gpu_busy_time_counts_overlapping_kernels_once():
    """The profile's GPU busy time is the union of the device timeline's spans: an operator and the kernel it
    launched (the same span twice), or two streams' overlapping kernels, are busy once."""
    from bench.gpu import busy_us

    assert busy_us([(0, 10), (5, 15), (20, 30), (22, 25), (20, 30)]) == 25
    assert busy_us([(3, 4)]) == 1 and busy_us([]) == 0


def test_sync_sites_are_counted_per_step_by_their_calling_line():
    """The profile's sync report: each warning of torch's sync debug mode counts once per step under the lines that
    made it (other warnings pass through)."""
    import warnings

    from bench.gpu import sync_sites

    def waits():  # stands for an op that reads a GPU value on the host
        warnings.warn("called a synchronizing CUDA operation", UserWarning)

    report: dict = {}
    with sync_sites(report, steps=2):
        for _ in range(2 * 2):  # two steps, twice each from the same line
            waits()
        with pytest.warns(UserWarning, match="unrelated"):
            warnings.warn("unrelated", UserWarning)
    (site, per_step), = report["sync_sites"].items()
    assert per_step == 2.0 and "waits" in site.split(" <- ")[0]
