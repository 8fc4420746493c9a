"""Synthetic scene generator: determinism, option checks, and that the written cameras match the rendered pixels."""

import json

import cv2
import numpy as np
import pytest

pycolmap = pytest.importorskip("pycolmap")

from splatflow.scene.synthetic import DEMO_DEFAULTS, SceneOptions, write_scene

SMALL = dict(n_views=4, width=320, height=240, arc_deg=30.0, n_points=4000)


@pytest.fixture(scope="module")
def small_scene(tmp_path_factory):
    out = tmp_path_factory.mktemp("synthetic")
    info = write_scene(out, progress=False, seed=3, **SMALL)
    return out, info


def _read_rgb(path):
    return cv2.cvtColor(cv2.imread(str(path)), cv2.COLOR_BGR2RGB).astype(np.float64)


def _colour_errors(rec, image_dir, pose_of):
    """Median |pixel - point colour| over all observations, projecting with ``pose_of(image)`` (a Rigid3d)."""
    errs = []
    for image in rec.images.values():
        cam = rec.cameras[image.camera_id]
        img = _read_rgb(image_dir / image.name)
        pose = pose_of(image)
        for p2d in image.points2D:
            if not p2d.has_point3D():
                continue
            point = rec.points3D[p2d.point3D_id]
            uv = cam.img_from_cam(pose * point.xyz)  # None when behind the camera
            if uv is None:
                errs.append(255.0)
                continue
            # Bilinear sample; pixel (row i, col j) has its centre at (j + 0.5, i + 0.5) in COLMAP's convention.
            x, y = uv[0] - 0.5, uv[1] - 0.5
            if 0 <= x < cam.width - 1 and 0 <= y < cam.height - 1:
                c, r = int(x), int(y)
                fx, fy = x - c, y - r
                pix = ((1 - fy) * ((1 - fx) * img[r, c] + fx * img[r, c + 1])
                       + fy * ((1 - fx) * img[r + 1, c] + fx * img[r + 1, c + 1]))
                errs.append(np.abs(pix - point.color).mean())
            else:
                errs.append(255.0)
    return float(np.median(errs)), len(errs)


def test_written_cameras_project_points_onto_their_rendered_pixels(small_scene):
    """Read the ground truth back with COLMAP's own reader and camera model: each 3D point (whose colour is the
    shaded texture at that surface point) must land on a pixel of that colour. A wrong convention (transposed
    rotation, y up instead of down, a neighbour's pose) lands on unrelated texture."""
    out, info = small_scene
    rec = pycolmap.Reconstruction(str(out / "ground_truth"))
    assert rec.num_images() == SMALL["n_views"] and rec.num_points3D() > 500
    good, n_obs = _colour_errors(rec, out / "images", lambda im: im.cam_from_world())
    assert n_obs > 1500
    assert good < 8.0, f"projected points do not match the rendered colours (median error {good:.1f} levels)"

    names = sorted(im.name for im in rec.images.values())
    by_name = {im.name: im for im in rec.images.values()}

    def neighbour_pose(im):
        i = names.index(im.name)
        return by_name[names[i - 1] if i else names[1]].cam_from_world()

    def transposed_pose(im):
        p = im.cam_from_world()
        m = p.matrix()
        return pycolmap.Rigid3d(pycolmap.Rotation3d(m[:3, :3].T.copy()), m[:3, 3].copy())

    def y_up_pose(im):
        m = im.cam_from_world().matrix()
        flip = np.diag([1.0, -1.0, -1.0])  # OpenGL-style camera (y up, looking down -z)
        return pycolmap.Rigid3d(pycolmap.Rotation3d(flip @ m[:3, :3]), flip @ m[:3, 3])

    for wrong in (neighbour_pose, transposed_pose, y_up_pose):
        bad, _ = _colour_errors(rec, out / "images", wrong)
        assert bad > 2.5 * good, f"{wrong.__name__}: error {bad:.1f} not clearly worse than {good:.1f}"


def test_cameras_json_matches_colmap_model(small_scene):
    out, _ = small_scene
    cams = json.loads((out / "ground_truth" / "cameras.json").read_text())
    rec = pycolmap.Reconstruction(str(out / "ground_truth"))
    by_name = {im.name: im for im in rec.images.values()}
    assert [f["name"] for f in cams["frames"]] == sorted(by_name)
    for f in cams["frames"]:
        im = by_name[f["name"]]
        np.testing.assert_allclose(np.asarray(f["world_to_cam"])[:3], im.cam_from_world().matrix(), atol=1e-9)
        np.testing.assert_allclose(np.asarray(f["K"]), rec.cameras[im.camera_id].calibration_matrix(), atol=1e-9)
        assert (f["width"], f["height"]) == (SMALL["width"], SMALL["height"])
        img = cv2.imread(str(out / "images" / f["name"]))
        assert img.shape == (SMALL["height"], SMALL["width"], 3)


def test_neighbouring_views_are_at_most_ten_degrees_apart(small_scene):
    out, _ = small_scene
    cams = json.loads((out / "ground_truth" / "cameras.json").read_text())
    dirs = [np.asarray(f["world_to_cam"])[2, :3] for f in cams["frames"]]  # viewing directions
    for a, b in zip(dirs, dirs[1:]):
        assert np.degrees(np.arccos(np.clip(a @ b, -1, 1))) <= 10.5


def test_deterministic_for_a_seed(tmp_path):
    tiny = dict(n_views=3, width=64, height=48, arc_deg=20.0, n_points=500)
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    write_scene(a, progress=False, seed=7, **tiny)
    write_scene(b, progress=False, seed=7, **tiny)
    write_scene(c, progress=False, seed=8, **tiny)
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert len(files) == 3 + 4
    for rel in files:
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), f"{rel} differs between two runs with one seed"
    assert (a / "images" / "0000.jpg").read_bytes() != (c / "images" / "0000.jpg").read_bytes()


def test_rewriting_removes_stale_views(tmp_path):
    write_scene(tmp_path, progress=False, n_views=4, width=48, height=32, arc_deg=30.0, n_points=200)
    write_scene(tmp_path, progress=False, n_views=2, width=48, height=32, arc_deg=10.0, n_points=200)
    assert sorted(p.name for p in (tmp_path / "images").iterdir()) == ["0000.jpg", "0001.jpg"]


def test_options_are_checked():
    with pytest.raises(ValueError, match="degrees apart"):
        SceneOptions(n_views=30, arc_deg=360.0)
    with pytest.raises(ValueError, match="n_views"):
        SceneOptions(n_views=1)
    with pytest.raises(ValueError, match="radius_m"):
        SceneOptions(radius_m=5.0)
    opts = SceneOptions(**DEMO_DEFAULTS)
    assert opts.step_deg <= 10.0
