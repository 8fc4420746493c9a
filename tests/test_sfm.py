"""SfM: a small synthetic scene and a real benchmark scene against their true cameras; failure messages; helpers."""

import json
import os
from pathlib import Path

import numpy as np
import pytest

pycolmap = pytest.importorskip("pycolmap")

from splatflow.pipeline.config import SfmConfig, load_params
from splatflow.pipeline.errors import UserError
from splatflow.pipeline.paths import ScenePaths
from splatflow.scene.groundtruth import camera_error, read_ground_truth, umeyama
from splatflow.scene.sfm import choose_matcher, run_sfm
from splatflow.scene.synthetic import write_scene

STRECHA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "strecha" / "fountain-P11"
METRIC_KEYS = {"images_total", "images_registered", "points3d", "mean_reprojection_error_px", "mean_track_length",
               "camera_center_error_rel", "seconds"}


@pytest.fixture(scope="module")
def synthetic_project(tmp_path_factory):
    """A throw-away project: params.yaml naming one synthetic scene, its images already where ingest puts them."""
    root = tmp_path_factory.mktemp("proj")
    raw = root / "raw" / "syn"
    write_scene(raw, progress=False, n_views=12, width=320, height=240, arc_deg=90.0, seed=0, n_points=2000)
    (root / "params.yaml").write_text(
        "base:\n  scenes:\n    syn:\n      source: raw/syn/images\n      ground_truth: raw/syn/ground_truth\n"
    )
    paths = ScenePaths("syn", root)
    paths.data_dir.mkdir(parents=True)
    os.symlink(raw / "images", paths.images_dir)
    return root, paths


@pytest.fixture(scope="module")
def synthetic_sfm(synthetic_project):
    from stages import sfm as sfm_stage

    root, paths = synthetic_project
    params = load_params(root / "params.yaml")
    metrics = sfm_stage.run(params, paths)
    return paths, metrics


def test_synthetic_scene_registers_every_view_at_the_true_cameras(synthetic_sfm):
    paths, m = synthetic_sfm
    assert METRIC_KEYS <= set(m)
    assert m["images_total"] == 12 and m["images_registered"] == 12
    assert m["camera_center_error_rel"] < 0.01
    assert m["camera_rotation_error_deg"] < 0.5
    assert m["points3d"] > 300 and m["mean_track_length"] > 2.5
    assert 0 < m["mean_reprojection_error_px"] < 1.0
    json.dumps(m)  # JSON-ready for metrics/<scene>/sfm.json


def test_outputs_are_binary_model_and_pinhole_undistorted_images(synthetic_sfm):
    from splatflow.scene.dataset import load_scene

    paths, m = synthetic_sfm
    assert (paths.sparse_dir / "cameras.bin").exists() and (paths.sparse_dir / "images.bin").exists()
    sparse = pycolmap.Reconstruction(str(paths.sparse_dir))
    assert [c.model_name for c in sparse.cameras.values()] == ["SIMPLE_RADIAL"]  # one shared camera (auto, one size)
    assert m["source"] == "computed" and [c["images"] for c in m["cameras"]] == [12]
    assert sorted(p.name for p in paths.undistorted_dir.iterdir()) == ["images", "sparse"]
    scene = load_scene(paths.undistorted_dir)
    assert len(scene.views) == 12 and len(scene.points) == m["points3d"]
    import cv2

    for v in scene.views:  # train on the undistorted sizes: the images must match their cameras
        img = cv2.imread(str(v.image_path))
        assert img.shape[:2] == (v.height, v.width)
        assert abs(v.width - 320) <= 4 and abs(v.height - 240) <= 4


def test_split_stage_on_sfm_output(synthetic_sfm):
    from splatflow.pipeline.config import Params
    from stages import split as split_stage

    paths, _ = synthetic_sfm
    out = split_stage.run(Params(), paths)
    split = json.loads(paths.split_json.read_text())
    assert split["test"] == ["0000.jpg", "0008.jpg"] and len(split["train"]) == 10
    assert out == {"train_views": 10, "test_views": 2}


def test_sequential_matching_and_global_mapping(synthetic_project, tmp_path):
    """The other matcher and mapper (both reachable from params) run offline and find the same cameras."""
    root, paths = synthetic_project
    cfg = SfmConfig(matcher="sequential", sequential_overlap=5, mapper="global")
    result = run_sfm(paths.images_dir, tmp_path / "sparse", tmp_path / "undistorted", cfg, progress=False,
                     ground_truth=root / "raw" / "syn" / "ground_truth")
    assert result.matcher == "sequential"
    assert result.metrics["images_registered"] == 12
    assert result.metrics["camera_center_error_rel"] < 0.01


def test_deterministic_sfm_gives_the_same_model_twice(synthetic_project, tmp_path):
    """``sfm.deterministic``: COLMAP on one thread, so two runs write the same cameras, poses and points, bit for
    bit (on two threads the demo's point count varied by up to 9 between runs)."""
    root, paths = synthetic_project
    cfg = SfmConfig(deterministic=True)
    models = []
    for i in range(2):
        run_sfm(paths.images_dir, tmp_path / f"sparse{i}", tmp_path / f"und{i}", cfg, progress=False, threads=2)
        rec = pycolmap.Reconstruction(str(tmp_path / f"sparse{i}"))
        poses = {im.name: np.asarray(im.cam_from_world().matrix()) for im in rec.images.values()}
        points = np.array(sorted(tuple(p.xyz) for p in rec.points3D.values()))
        cams = [np.asarray(c.params) for c in rec.cameras.values()]
        models.append((poses, points, cams))
    (p0, x0, c0), (p1, x1, c1) = models
    assert len(p0) == 12 and p0.keys() == p1.keys()
    assert all(np.array_equal(p0[k], p1[k]) for k in p0)
    assert x0.shape == x1.shape and np.array_equal(x0, x1)
    assert all(np.array_equal(a, b) for a, b in zip(c0, c1))


def test_too_few_registered_images_fail_with_counts_and_advice(tmp_path):
    """Half the images are featureless: SfM registers only the textured half and must say so."""
    import cv2

    write_scene(tmp_path / "s", progress=False, n_views=4, width=160, height=120, arc_deg=24.0, n_points=100)
    images = tmp_path / "s" / "images"
    for i in range(4, 8):
        cv2.imwrite(str(images / f"{i:04d}.jpg"), np.full((120, 160, 3), 128, np.uint8))
    with pytest.raises(UserError) as e:
        run_sfm(images, tmp_path / "sparse", tmp_path / "undistorted", SfmConfig(), progress=False)
    msg = str(e.value)
    assert "of 8 images were registered" in msg and "overlap" in msg and "texture" in msg
    assert not (tmp_path / "sparse").exists() and not (tmp_path / "undistorted").exists()


def test_mixed_image_sizes_are_refused_before_sfm_with_one_shared_camera(tmp_path):
    """camera_mode single shares one camera, which cannot hold two sizes (auto gives each size its own)."""
    import cv2

    for i, shape in enumerate([(60, 80, 3)] * 3 + [(80, 60, 3)]):
        cv2.imwrite(str(tmp_path / f"{i}.png"), np.zeros(shape, np.uint8))
    (tmp_path / "notes.txt").write_text("not an image")  # ignored, as COLMAP would choke on it
    with pytest.raises(UserError, match="different sizes.*3.png.*camera_mode: auto"):
        run_sfm(tmp_path, tmp_path / "sp", tmp_path / "un", SfmConfig(camera_mode="single"), progress=False)


def test_matcher_choice():
    cfg = SfmConfig(exhaustive_max_images=50)
    assert choose_matcher(cfg, 50) == "exhaustive"
    assert choose_matcher(cfg, 51) == "sequential"
    assert choose_matcher(cfg, 10, ordered_sequence=True) == "sequential"
    assert choose_matcher(SfmConfig(matcher="exhaustive"), 500, ordered_sequence=True) == "exhaustive"


def test_abort_prone_features_are_not_reachable_from_params():
    """Vocab-tree matching, loop detection and ALIKED abort pycolmap offline: params must not be able to ask."""
    from splatflow.pipeline.config import ConfigError, params_from_dict

    for key, value in [("matcher", "vocab_tree"), ("feature_type", "ALIKED"), ("loop_detection", True),
                       ("vocab_tree_path", "/tmp/tree.bin")]:
        with pytest.raises(ConfigError, match=f"sfm.{key}"):
            params_from_dict({"sfm": {key: value}})


def test_umeyama_recovers_a_similarity():
    rng = np.random.default_rng(0)
    src = rng.normal(size=(20, 3))
    q, _ = np.linalg.qr(rng.normal(size=(3, 3)))
    R = q if np.linalg.det(q) > 0 else -q
    dst = 2.5 * src @ R.T + np.array([1.0, -2.0, 0.5])
    s, R_est, t = umeyama(src, dst)
    assert s == pytest.approx(2.5) and np.allclose(R_est, R) and np.allclose(t, [1.0, -2.0, 0.5])
    # A mirrored target still yields a proper rotation.
    _, R_m, _ = umeyama(src, dst * np.array([1, 1, -1]))
    assert np.linalg.det(R_m) == pytest.approx(1.0)


def test_camera_error_is_zero_for_a_similar_copy_and_matches_names_by_stem(tmp_path):
    write_scene(tmp_path, progress=False, n_views=5, width=48, height=32, arc_deg=40.0, n_points=100)
    truth = read_ground_truth(tmp_path / "ground_truth")
    assert truth.keys() == read_ground_truth(tmp_path / "ground_truth" / "cameras.json").keys()
    # The same cameras in a world scaled by 3, rotated and shifted, with .png names (as ingest may write).
    rot = np.array([[0.0, -1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    est = {}
    for name, cam in truth.items():
        w2c = cam.world_to_cam.copy()
        c_new = 3.0 * rot @ cam.center + np.array([5.0, 0.0, 1.0])
        w2c[:3, :3] = w2c[:3, :3] @ rot.T
        w2c[:3, 3] = -w2c[:3, :3] @ c_new
        est[name.replace(".jpg", ".png")] = w2c
    err = camera_error(est, truth)
    assert err.matched == 5 and err.center_error_rel < 1e-9 and err.rotation_error_deg < 1e-4
    # Moving one camera by 10% of the extent shows up as 2% mean error over five cameras.
    name = sorted(est)[0]
    w2c = est[name].copy()
    w2c[:3, 3] -= w2c[:3, :3] @ (np.array([0.1, 0.0, 0.0]) * err.orbit_extent * 3.0)
    est[name] = w2c
    assert camera_error(est, truth).center_error_rel == pytest.approx(0.02, rel=0.3)


@pytest.mark.skipif(not (STRECHA / "images").is_dir(), reason=f"{STRECHA} not present")
@pytest.mark.slow
def test_strecha_fountain_registers_all_views_at_the_true_cameras(tmp_path):
    result = run_sfm(STRECHA / "images", tmp_path / "sparse", tmp_path / "undistorted", SfmConfig(),
                     ground_truth=STRECHA / "gt_dense_cameras", progress=False)
    m = result.metrics
    assert m["images_total"] == 11 and m["images_registered"] == 11
    assert m["camera_center_error_rel"] < 0.01
    # The benchmark's R is the camera orientation in world coordinates (x ~ K R^T (X - C)): a wrong reading of
    # that convention would show up here as a large orientation error.
    assert m["camera_rotation_error_deg"] < 1.0


def test_degenerate_reconstruction_tables_are_rejected(tmp_path):
    """pandera checks catch what COLMAP happily writes: a collapsed focal length, a principal point off the image."""
    from splatflow.scene.schemas import validate_reconstruction

    write_scene(tmp_path, progress=False, n_views=3, width=48, height=32, arc_deg=20.0, n_points=200)
    gt = tmp_path / "ground_truth"
    cams, imgs, pts = validate_reconstruction(pycolmap.Reconstruction(str(gt)), str(gt))
    assert len(cams) == 1 and len(imgs) == 3 and len(pts) > 10 and (pts.track_length >= 2).all()
    for bad in ("1 PINHOLE 48 32 1.5 1.5 24 16", "1 PINHOLE 48 32 40 40 90 16"):
        (gt / "cameras.txt").write_text(bad + "\n")
        with pytest.raises(UserError, match="cameras table is invalid"):
            validate_reconstruction(pycolmap.Reconstruction(str(gt)), str(gt))


MATCH_WITH_PROGRESS = """
import sys
from pathlib import Path
import pycolmap
from splatflow.scene.sfm import _MatchProgress
db, images = Path(sys.argv[1]), sys.argv[2]
pycolmap.extract_features(db, images, camera_mode=pycolmap.CameraMode.SINGLE)
with _MatchProgress(db, int(sys.argv[3]), True, every_s=0.001) as bar:
    pycolmap.match_exhaustive(db)
print("counted", bar.last, flush=True)
"""


def test_the_match_progress_bar_never_disturbs_the_matcher(synthetic_project, tmp_path):
    """The pair count is read while pycolmap writes its WAL-mode database. Read from pycolmap's own process (a
    second SQLite library there, blind to the first's locks) it truncated the WAL index under the matcher, which
    died of SIGBUS; here it is polled every millisecond through the whole match, which must finish and be
    counted to the last pair."""
    import subprocess
    import sys

    _, paths = synthetic_project
    n = len(list(paths.images_dir.iterdir()))
    pairs = n * (n - 1) // 2
    for attempt in range(3):  # the old reader crashed the matcher in a few of these polls
        db = tmp_path / f"db{attempt}.db"
        proc = subprocess.run([sys.executable, "-c", MATCH_WITH_PROGRESS, str(db), str(paths.images_dir), str(pairs)],
                              capture_output=True, text=True, timeout=300,
                              cwd=Path(__file__).resolve().parents[1])
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert f"counted {pairs}" in proc.stdout
