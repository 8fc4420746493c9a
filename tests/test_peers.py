"""The quality suite's peer runs (bench/peers.py): the COLMAP project another trainer gets holds exactly our
training views at our working size, with our cameras, poses and points, and never a test view; a PLY written in
the Inria layout scores the same as our own model on our test views."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests._tiny import write_tiny_scene

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from peers import evaluate_ply, read_colmap_project, rotation_to_quaternion, write_colmap_project  # noqa: E402


@pytest.fixture(scope="module")
def scene(tmp_path_factory):
    from splatflow.scene.dataset import load_scene

    d = write_tiny_scene(tmp_path_factory.mktemp("tiny"))
    return load_scene(d, d / "split.json")


def _quat_to_R(q):
    w, x, y, z = q
    return np.array([[1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)],
                     [2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)],
                     [2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)]])


def test_quaternions_round_trip_every_branch():
    rng = np.random.default_rng(0)
    mats = [np.eye(3), np.diag([1, -1, -1]), np.diag([-1, 1, -1]), np.diag([-1, -1, 1])]
    for _ in range(20):
        q = rng.normal(size=4)
        mats.append(_quat_to_R(q / np.linalg.norm(q)))
    for R in mats:
        q = rotation_to_quaternion(R)
        assert q[0] >= 0 and abs(np.linalg.norm(q) - 1) < 1e-12
        assert np.allclose(_quat_to_R(q), R, atol=1e-9)


def test_the_peer_project_holds_the_training_views_only(scene, tmp_path):
    from splatflow.scene.resolution import read_view_rgb

    root = write_colmap_project(scene, tmp_path / "peer")
    got = read_colmap_project(root)
    train = {Path(v.name).with_suffix(".png").name: v for v in scene.train_views}
    test = {Path(v.name).with_suffix(".png").name for v in scene.test_views}
    assert set(got["images"]) == set(train) and not set(got["images"]) & test
    assert sorted(p.name for p in (root / "images").iterdir()) == sorted(train)
    for name, v in train.items():
        im = got["images"][name]
        model, w, h, (fx, fy, cx, cy) = got["cameras"][im["camera"]]
        assert (model, w, h) == (1, v.width, v.height)
        assert np.allclose([fx, fy, cx, cy], [v.K[0, 0], v.K[1, 1], v.K[0, 2], v.K[1, 2]])
        assert np.allclose(_quat_to_R(im["q"]), v.world_to_cam[:3, :3], atol=1e-6)
        assert np.allclose(im["t"], v.world_to_cam[:3, 3], atol=1e-9)
        import cv2

        png = cv2.cvtColor(cv2.imread(str(root / "images" / name)), cv2.COLOR_BGR2RGB)
        assert np.array_equal(png, read_view_rgb(v))  # lossless, the pixels training reads
    assert np.allclose(got["points"][:, :3], scene.points, atol=1e-5)
    assert np.array_equal(got["points"][:, 3:].astype(np.uint8), scene.colors)


def test_a_peer_ply_scores_like_our_own_model(scene, tmp_path):
    from splatflow.pipeline.config import EvaluateConfig
    from splatflow.evaluation.evaluate import evaluate
    from splatflow.formats.ply import write_ply
    from splatflow.gaussians.model import Splats, init_splats

    splats = Splats.of(init_splats(scene.points, scene.colors, sh_degree=1, init_opacity=0.5, init_scale=1.0))
    write_ply(tmp_path / "m.ply", {k: v.numpy() for k, v in splats.items()}, sh_degree=1)
    cfg = EvaluateConfig(lpips_variants=(), save_renders=False, backend="cpu")
    ours, _ = evaluate(splats, 1, scene.test_views, cfg, renders_dir=None, progress=False)
    theirs = evaluate_ply(tmp_path / "m.ply", scene, cfg)
    assert theirs["gaussians"] == splats.n and torch.isfinite(torch.tensor(theirs["psnr"]))
    assert abs(theirs["psnr"] - ours["psnr"]) < 1e-3 and abs(theirs["ssim"] - ours["ssim"]) < 1e-4


def test_a_peer_stopped_at_a_time_hands_back_its_snapshots_by_time_and_step(tmp_path):
    """``run_opensplat(seconds=...)`` passes the snapshot interval, stops a run still going at the limit and lists
    what it saved by time and step (an external trainer's process control: a script stands in for its binary and
    writes snapshots the way OpenSplat's ``-s`` does); a run that saved nothing by then is an error naming it."""
    import stat

    from peers import run_opensplat

    binary = tmp_path / "trainer"
    binary.write_text(f"""#!{sys.executable}
import sys, time
from pathlib import Path
args = sys.argv[1:]
out = Path(args[args.index("-o") + 1])
every = int(args[args.index("-s") + 1]) if "-s" in args else 0
wait = float(Path(args[0], "wait").read_text())
time.sleep(wait)
for step in range(1, int(args[args.index("-n") + 1]) + 1):
    if every and step % every == 0:
        out.with_name(f"{{out.stem}}_{{step}}{{out.suffix}}").write_text("ply")
        time.sleep(0.25)
out.write_text("ply")
""")
    binary.chmod(binary.stat().st_mode | stat.S_IEXEC)
    project = tmp_path / "project"
    project.mkdir()
    (project / "wait").write_text("0")
    ran = run_opensplat(binary, project, 10_000, project / "splat.ply", tmp_path / "log", seconds=1.5, save_every=50)
    assert ran["stopped_at_seconds"] and "-s 50" in ran["command"] and "--cpu" in ran["command"]
    steps = [s for _, s, _ in ran["snapshots"]]
    assert 2 <= len(steps) <= 8 and steps == list(range(50, 50 * len(steps) + 1, 50))
    assert [t for t, _, _ in ran["snapshots"]] == sorted(t for t, _, _ in ran["snapshots"]) and ran["wall_seconds"] < 30
    assert not (project / "splat.ply").exists()
    done = run_opensplat(binary, project, 100, project / "splat.ply", tmp_path / "log", seconds=20, save_every=50)
    assert not done["stopped_at_seconds"] and [s for _, s, _ in done["snapshots"]] == [50, 100]
    (project / "wait").write_text("5")
    with pytest.raises(RuntimeError, match="saved no snapshot"):
        run_opensplat(binary, project, 100, project / "splat.ply", tmp_path / "log", seconds=1, save_every=50)
