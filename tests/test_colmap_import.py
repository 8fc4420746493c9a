"""Existing COLMAP datasets through the real ingest and sfm stages, several cameras, views of several sizes.

The datasets are written from the synthetic room's TRUE cameras and points (tests/_colmap_data.py), so "the
imported cameras equal the given ones" is checked against exact values, and SfM's own entry points are replaced
by functions that fail, so an import that ran SIFT, matching or mapping could not pass.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import cv2
import numpy as np
import pytest

pycolmap = pytest.importorskip("pycolmap")

from splatflow.pipeline.config import SfmConfig, params_from_dict  # noqa: E402
from splatflow.pipeline.errors import UserError  # noqa: E402
from splatflow.pipeline.paths import ScenePaths  # noqa: E402
from splatflow.scene.synthetic import write_scene  # noqa: E402

from tests._colmap_data import (RIG_FOLDERS, write_dataset, write_rig_views,  # noqa: E402
                               write_two_camera_views)

W, H = 200, 150


@pytest.fixture(scope="module")
def raw_scene(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("raw")
    write_scene(d, progress=False, n_views=10, width=W, height=H, arc_deg=60.0, n_points=2000)
    return d


@pytest.fixture
def no_sfm(monkeypatch):
    """SfM's entry points fail loudly: an import must never reach them."""
    def forbidden(*a, **k):
        raise AssertionError("SfM (features/matching/mapping) ran during a COLMAP import")

    for name in ("extract_features", "match_exhaustive", "match_sequential", "incremental_mapping",
                 "global_mapping"):
        monkeypatch.setattr(pycolmap, name, forbidden)


def _run_stages(root: Path, dataset: Path, scene: dict | None = None, **sections) -> tuple[dict, dict, ScenePaths]:
    from stages import ingest as ingest_stage
    from stages import sfm as sfm_stage
    from splatflow.pipeline.stage import write_metrics

    entry = {"source": str(dataset), "colmap": "sparse/0", **(scene or {})}
    params = params_from_dict({"base": {"scenes": {"s": entry}}, **sections})
    paths = ScenePaths("s", root)
    m_ingest = ingest_stage.run(params, paths)
    write_metrics(paths, "ingest", m_ingest)  # what stage_main does; the sfm import reads ingest's reasons
    m_sfm = sfm_stage.run(params, paths)
    return m_ingest, m_sfm, paths


def _poses(rec) -> dict[str, np.ndarray]:
    return {im.name: np.asarray(im.cam_from_world().matrix()) for im in rec.images.values() if im.has_pose}


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "text"])
def test_import_uses_the_given_cameras_and_runs_no_sfm(raw_scene, tmp_path, no_sfm, binary):
    dataset = write_dataset(raw_scene, tmp_path / "garden", binary=binary, levels=(2,))
    m_ingest, m, paths = _run_stages(tmp_path / "proj", dataset,
                                     scene={"ground_truth": str(raw_scene / "ground_truth")})
    truth = pycolmap.Reconstruction(str(raw_scene / "ground_truth"))

    assert m["source"] == "imported" and m["images_registered"] == m["images_total"] == 10
    assert m["images_dropped"] == [] and m["undistorted"] is False and m["camera_models"] == ["PINHOLE"]
    assert m["points3d"] == truth.num_points3D()
    assert m["camera_center_error_rel"] < 1e-9 and m["camera_rotation_error_deg"] < 1e-4  # arccos: ~1e-6
    assert not list((tmp_path / "proj").rglob("*.db"))  # no feature database was ever created
    # the same outputs as an SfM run: binary model, undistorted images + model, nothing else
    assert (paths.sparse_dir / "cameras.bin").exists() and (paths.sparse_dir / "points3D.bin").exists()
    assert sorted(p.name for p in paths.undistorted_dir.iterdir()) == ["images", "sparse"]
    for folder in (paths.sparse_dir, paths.undistorted_dir / "sparse"):
        rec = pycolmap.Reconstruction(str(folder))
        (cam,) = rec.cameras.values()
        assert cam.model_name == "PINHOLE" and (cam.width, cam.height) == (W, H)
        np.testing.assert_allclose(cam.params, truth.cameras[1].params, rtol=1e-9)
        got, want = _poses(rec), _poses(truth)
        assert sorted(got) == sorted(want)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], atol=1e-9)
    # pinhole: images copied byte for byte (the pixels published metrics are computed on)
    for p in sorted((dataset / "images").iterdir()):
        assert (paths.undistorted_dir / "images" / p.name).read_bytes() == p.read_bytes()
    # images_2 copied under ingest's names, images_4/8 absent (folders with only a note: DVC outputs)
    assert m_ingest["levels"]["images_2"] == {"copied": 10}
    assert m_ingest["levels"]["images_4"] == {"absent": True}
    assert sorted(p.name for p in (paths.data_dir / "images_2").iterdir()) == sorted(
        p.name for p in paths.images_dir.iterdir())
    assert [p.name for p in (paths.data_dir / "images_4").iterdir()] == ["README.txt"]
    with_level = cv2.imread(str(paths.data_dir / "images_2" / "0003.jpg"))
    assert with_level.shape[:2] == (H // 2, W // 2)
    json.dumps(m)

    from splatflow.scene.dataset import load_scene

    scene = load_scene(paths.undistorted_dir)
    assert len(scene.views) == 10 and len(scene.points) == truth.num_points3D()


@pytest.mark.parametrize("model,extra", [("OPENCV", (0.08, 0.02, 0.001, -0.001)),
                                         ("OPENCV_FISHEYE", (0.8, 0.0, 0.0, 0.0)),
                                         ("SIMPLE_RADIAL", (0.06,))])
def test_distorted_models_are_undistorted_to_pinhole(raw_scene, tmp_path, no_sfm, model, extra):
    """The undistorted images must show what the true pinhole camera saw (the renders before distortion)."""
    dataset = write_dataset(raw_scene, tmp_path / "ds", model=model, extra_params=extra, levels=())
    _, m, paths = _run_stages(tmp_path / "proj", dataset)
    assert m["source"] == "imported" and m["undistorted"] is True and m["camera_models"] == [model]
    rec = pycolmap.Reconstruction(str(paths.undistorted_dir / "sparse"))
    (cam,) = rec.cameras.values()
    assert cam.model_name == "PINHOLE"
    assert pycolmap.Reconstruction(str(paths.sparse_dir)).cameras[1].model_name == model  # sparse/ as given

    K_true = np.asarray(pycolmap.Reconstruction(str(raw_scene / "ground_truth")).cameras[1].calibration_matrix())
    K_new = np.asarray(cam.calibration_matrix())
    # Both are pinhole cameras at the same pose: pixel u of the new one is pixel K_true K_new^-1 u of the original.
    A = (K_true @ np.linalg.inv(K_new))[:2]  # [2, 3], COLMAP pixel coordinates (centres at +0.5)
    shift = np.array([[1, 0, 0.5], [0, 1, 0.5], [0, 0, 1]])  # OpenCV's pixel centres are at +0
    M = (np.vstack([A, [0, 0, 1]]) @ shift)[:2] - np.array([[0, 0, 0.5], [0, 0, 0.5]])
    errs, errs_raw = [], []
    for name in ("0002.jpg", "0005.jpg", "0008.jpg"):
        und = cv2.imread(str(paths.undistorted_dir / "images" / name)).astype(np.float32)
        orig = cv2.imread(str(raw_scene / "images" / name)).astype(np.float32)
        dist = cv2.imread(str(dataset / "images" / name)).astype(np.float32)
        assert und.shape[:2] == (cam.height, cam.width)
        expect = cv2.warpAffine(orig, M, (cam.width, cam.height), flags=cv2.INTER_LINEAR | cv2.WARP_INVERSE_MAP)
        h, w = und.shape[:2]
        inner = (slice(h // 8, h - h // 8), slice(w // 8, w - w // 8))
        raw = cv2.resize(dist, (w, h), interpolation=cv2.INTER_AREA)  # the distorted image, not undistorted
        # a light blur evens out what resampling and sensor noise do to single pixels; misplaced texture remains
        und, expect, raw = (cv2.GaussianBlur(x, (0, 0), 1.0) for x in (und, expect, raw))
        errs.append(np.abs(und - expect)[inner].mean())
        errs_raw.append(np.abs(raw - expect)[inner].mean())
    assert max(errs) < 4.0, errs  # two bilinear resamplings and JPEG: a few grey levels
    assert min(errs_raw) > 2.2 * max(errs), (errs, errs_raw)  # without undistortion the geometry is off


def test_images_ingest_rejects_are_dropped_from_the_model_and_named(raw_scene, tmp_path, no_sfm):
    dataset = write_dataset(raw_scene, tmp_path / "ds", levels=(2,))
    data = (dataset / "images" / "0004.jpg").read_bytes()
    (dataset / "images" / "0004.jpg").write_bytes(data[: len(data) // 2])  # truncated: ingest rejects it
    (dataset / "images" / "0007.jpg").unlink()  # in the model, but not in the dataset
    m_ingest, m, paths = _run_stages(tmp_path / "proj", dataset)
    assert m["images_total"] == 10 and m["images_registered"] == 8
    dropped = {d["image"]: d["reason"] for d in m["images_dropped"]}
    assert set(dropped) == {"0004.jpg", "0007.jpg"}
    assert "rejected by ingest: unreadable" in dropped["0004.jpg"] and "not in" in dropped["0007.jpg"]
    rec = pycolmap.Reconstruction(str(paths.undistorted_dir / "sparse"))
    assert sorted(im.name for im in rec.images.values() if im.has_pose) == sorted(
        p.name for p in (paths.undistorted_dir / "images").iterdir())
    assert "0004.jpg" not in {p.name for p in (paths.data_dir / "images_2").iterdir()}
    assert m_ingest["levels"]["images_2"] == {"copied": 8}

    # too many dropped: a clear error with the count and the reasons
    with pytest.raises(UserError, match=r"only 8 of the model's 10 registered images.*0004.jpg"):
        _run_stages(tmp_path / "proj2", dataset, sfm={"min_registered_fraction": 0.9})


def test_renamed_images_and_mismatched_sizes(raw_scene, tmp_path, no_sfm):
    """PNG images become JPEGs at ingest: the model's names follow. Images of another size than their camera
    (a downscaled folder given as images/) are refused."""
    dataset = write_dataset(raw_scene, tmp_path / "png", levels=())
    for p in sorted((dataset / "images").iterdir()):
        cv2.imwrite(str(p.with_suffix(".png")), cv2.imread(str(p)))
        p.unlink()
    rec = pycolmap.Reconstruction(str(dataset / "sparse/0"))
    for im in rec.images.values():
        im.name = im.name.replace(".jpg", ".png")
    rec.write_binary(str(dataset / "sparse/0"))
    _, m, paths = _run_stages(tmp_path / "proj", dataset)
    assert m["images_registered"] == 10
    names = sorted(im.name for im in pycolmap.Reconstruction(str(paths.sparse_dir)).images.values())
    assert names == sorted(p.name for p in paths.images_dir.iterdir()) and names[0] == "0000.jpg"

    small = write_dataset(raw_scene, tmp_path / "small", levels=(2,))
    shutil.rmtree(small / "images")
    shutil.copytree(small / "images_2", small / "images")
    shutil.rmtree(small / "images_2")
    with pytest.raises(UserError, match=r"is 100x75 px but its camera 1 .* is 200x150"):
        _run_stages(tmp_path / "proj2", small)


def test_a_level_that_does_not_match_is_skipped_not_half_copied(raw_scene, tmp_path, no_sfm):
    dataset = write_dataset(raw_scene, tmp_path / "ds", levels=(2, 4))
    (dataset / "images_4" / "0003.jpg").unlink()
    img = cv2.imread(str(dataset / "images_2" / "0005.jpg"))
    cv2.imwrite(str(dataset / "images_2" / "0005.jpg"), cv2.resize(img, (60, 45)))
    m_ingest, _, paths = _run_stages(tmp_path / "proj", dataset)
    levels = m_ingest["levels"]
    assert "0005.jpg" in levels["images_2"]["skipped"] and "not 1/2" in levels["images_2"]["skipped"]
    assert "0003.jpg" in levels["images_4"]["skipped"] and "missing" in levels["images_4"]["skipped"]
    for n, why in ((2, "not 1/2"), (4, "missing")):  # nothing half copied: only the note, saying why
        level = paths.data_dir / f"images_{n}"
        assert [p.name for p in level.iterdir()] == ["README.txt"] and why in (level / "README.txt").read_text()


def test_bad_dataset_paths_and_unsupported_cameras(raw_scene, tmp_path, no_sfm):
    dataset = write_dataset(raw_scene, tmp_path / "ds", levels=())
    with pytest.raises(UserError, match=r"no COLMAP model here.*has one in sparse/0"):
        _run_stages(tmp_path / "p1", dataset, scene={"colmap": "sparse"})
    rec = pycolmap.Reconstruction(str(dataset / "sparse/0"))
    rec.cameras[1] = pycolmap.Camera.create_from_model_name(1, "EQUIRECTANGULAR", 1.0, W, H)
    rec.write_binary(str(dataset / "sparse/0"))
    with pytest.raises(UserError, match="EQUIRECTANGULAR cannot be undistorted"):
        _run_stages(tmp_path / "p2", dataset)


def test_add_scene_recognises_colmap_datasets(raw_scene, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from splatflow.cli import app
    from splatflow.pipeline.config import load_params

    repo = Path(__file__).resolve().parents[1]
    proj = tmp_path / "proj"
    proj.mkdir()
    for name in ("params.yaml", "dvc.yaml"):
        shutil.copy(repo / name, proj / name)
    monkeypatch.chdir(proj)
    mip = write_dataset(raw_scene, proj / "captures" / "garden", levels=(2, 4))
    flat = write_dataset(raw_scene, proj / "captures" / "flat", binary=False, levels=(), model_dir="sparse")
    r = CliRunner().invoke(app, ["add-scene", "garden", str(mip)])
    assert r.exit_code == 0 and "COLMAP dataset" in r.output, r.output
    r = CliRunner().invoke(app, ["add-scene", "flat", str(flat)])
    assert r.exit_code == 0, r.output
    p = load_params(proj / "params.yaml")
    assert (p.scene("garden").source, p.scene("garden").colmap) == ("captures/garden", "sparse/0")
    assert p.scene("flat").colmap == "sparse"
    # images/ without a model: not silently treated as a capture folder of sub-folders
    shutil.rmtree(flat / "sparse")
    r = CliRunner().invoke(app, ["add-scene", "nomodel", str(flat)])
    assert r.exit_code == 2 and "no COLMAP model" in r.output


# --------------------------------------------------------------------------------------------- several cameras


@pytest.fixture(scope="module")
def two_cameras(tmp_path_factory) -> tuple[Path, dict]:
    d = tmp_path_factory.mktemp("two")
    return d, write_two_camera_views(d)


def test_two_camera_collection_registers_with_two_cameras(two_cameras, tmp_path):
    """Two sizes and two focal lengths, no EXIF: camera_mode auto gives one camera per size; ingest keeps both."""
    from stages import ingest as ingest_stage
    from stages import sfm as sfm_stage

    d, truth = two_cameras
    params = params_from_dict({"base": {"scenes": {"s": {"source": str(d / "images"),
                                                         "ground_truth": str(d / "sparse")}}}})
    paths = ScenePaths("s", tmp_path)
    m_ingest = ingest_stage.run(params, paths)
    assert m_ingest["images_kept"] == 16 and m_ingest["image_sizes"] == {"320x240": 8, "400x300": 8}
    m = sfm_stage.run(params, paths)
    assert m["source"] == "computed" and m["camera_mode"] == "auto"
    assert m["images_registered"] == 16 and m["camera_center_error_rel"] < 0.01
    rec = pycolmap.Reconstruction(str(paths.sparse_dir))
    assert rec.num_cameras() == 2
    by_size = {}
    for im in rec.images.values():
        cam = rec.cameras[im.camera_id]
        by_size.setdefault((cam.width, cam.height), set()).add(im.camera_id)
        c, K, _ = truth[im.name]
        assert abs(cam.mean_focal_length() - K[0, 0]) / K[0, 0] < 0.03  # each camera found its own focal length
    assert sorted(by_size) == [(320, 240), (400, 300)]
    assert all(len(ids) == 1 for ids in by_size.values())  # one camera per size, shared by its 8 images
    assert sorted((c["width"], c["height"], c["images"]) for c in m["cameras"]) == [(320, 240, 8), (400, 300, 8)]


def test_camera_modes_group_by_size_and_exif(tmp_path):
    from PIL import Image

    from splatflow.scene.sfm import camera_groups, exif_camera

    def save(name, size, make=None, model=None, f_mm=None, f35=None, plane=None):
        exif = Image.Exif()
        if make:
            exif[0x010F], exif[0x0110] = make, model
        sub = {}
        if f_mm:
            sub[0x920A] = f_mm
        if f35:
            sub[0xA405] = f35
        if plane:
            sub[0xA20E], sub[0xA210], sub[0xA002] = plane
        if sub:
            exif[0x8769] = sub
        Image.new("RGB", size, (90, 120, 150)).save(tmp_path / name, "JPEG", exif=exif.tobytes())

    save("a0.jpg", (400, 300), "Canon", "EOS 5D", 24.0, 38)
    save("a1.jpg", (400, 300), "Canon", "EOS 5D", 24.0, 38)
    save("b0.jpg", (400, 300), "Canon", "EOS 5D", 50.0, 80)  # same body and size, other focal length
    save("c0.jpg", (300, 400))  # portrait, no EXIF
    save("c1.jpg", (300, 400))
    save("d0.jpg", (1000, 750), "Sony", "A7", 35.0, None, (2000.0, 3, 2000))  # 2000 px/cm, image at half size
    names = sorted(p.name for p in tmp_path.iterdir())

    e = exif_camera(tmp_path / "a0.jpg", 400, 300)
    assert (e.make, e.model, e.focal_from) == ("Canon", "EOS 5D", "exif_35mm")
    assert e.focal_px == pytest.approx(38 / 36 * 400)
    d = exif_camera(tmp_path / "d0.jpg", 1000, 750)  # 35 mm x 200 px/mm x (1000 / 2000)
    assert d.focal_from == "exif_focal_plane" and d.focal_px == pytest.approx(3500.0)
    assert exif_camera(tmp_path / "c0.jpg", 300, 400).focal_px is None

    auto = camera_groups(tmp_path, names, "auto")
    assert [g.names for g in auto] == [["a0.jpg", "a1.jpg"], ["b0.jpg"], ["c0.jpg", "c1.jpg"], ["d0.jpg"]]
    assert len(camera_groups(tmp_path, names, "per_image")) == len(names)
    with pytest.raises(UserError, match="camera_mode = single.*camera_mode: auto"):
        camera_groups(tmp_path, names, "single")
    (single,) = camera_groups(tmp_path, ["a0.jpg", "a1.jpg", "b0.jpg"], "single")
    assert single.exif.focal_px == pytest.approx(38 / 36 * 400)  # the median prior of its images


def test_per_folder_cameras_follow_the_sub_folders(tmp_path):
    """per_folder: one camera per source sub-folder, also for identical bodies (same size and EXIF) that auto
    without folders would merge; auto splits by folder too; a folder of two sizes is an error naming it."""
    from PIL import Image

    from splatflow.scene.sfm import camera_groups

    def save(name, size, f35=None):
        exif = Image.Exif()
        if f35:
            exif[0x010F], exif[0x0110] = "Canon", "EOS 5D"
            exif[0x8769] = {0xA405: f35}
        Image.new("RGB", size, (90, 120, 150)).save(tmp_path / name, "JPEG", exif=exif.tobytes())

    for k in range(2):
        save(f"cam_a__{k}.jpg", (400, 300), 38)
        save(f"cam_b__{k}.jpg", (400, 300), 38 if k == 0 else 40)  # the same body; the second frame zoomed
    save("top.jpg", (300, 400))
    names = sorted(p.name for p in tmp_path.iterdir())
    folders = {n: n.split("__")[0] if "__" in n else "" for n in names}

    per_folder = camera_groups(tmp_path, names, "per_folder", folders)
    assert [(g.folder, g.names) for g in per_folder] == [
        ("cam_a", ["cam_a__0.jpg", "cam_a__1.jpg"]), ("cam_b", ["cam_b__0.jpg", "cam_b__1.jpg"]), ("", ["top.jpg"])]
    assert per_folder[0].exif.focal_px == pytest.approx(38 / 36 * 400)
    assert per_folder[1].exif.focal_px == pytest.approx(39 / 36 * 400)  # the median prior of the folder
    assert per_folder[2].exif.focal_px is None
    # auto without folders merges the identical bodies; with them, each folder (and size/EXIF within) is apart
    assert [g.names for g in camera_groups(tmp_path, names, "auto")][0] == ["cam_a__0.jpg", "cam_a__1.jpg",
                                                                           "cam_b__0.jpg"]
    assert [g.names for g in camera_groups(tmp_path, names, "auto", folders)] == [
        ["cam_a__0.jpg", "cam_a__1.jpg"], ["cam_b__0.jpg"], ["cam_b__1.jpg"], ["top.jpg"]]
    with pytest.raises(UserError, match="sub-folder 'cam_a' have 2 different sizes.*per_folder"):
        camera_groups(tmp_path, names, "per_folder", {**folders, "top.jpg": "cam_a"})


@pytest.fixture(scope="module")
def rig(tmp_path_factory) -> tuple[Path, dict]:
    d = tmp_path_factory.mktemp("rig")
    return d, write_rig_views(d)


def test_rig_in_sub_folders_registers_one_camera_per_folder(rig, tmp_path):
    """A two-camera rig stored as cam_a/, cam_b/ (one size, two focal lengths, no EXIF), camera_mode auto: ingest
    reads the sub-folders because the source has no images of its own, and SfM gives each folder its camera."""
    from stages import ingest as ingest_stage
    from stages import sfm as sfm_stage

    d, truth = rig
    params = params_from_dict({"base": {"scenes": {"s": {"source": str(d / "rig"),
                                                         "ground_truth": str(d / "sparse")}}}})
    paths = ScenePaths("s", tmp_path)
    m_ingest = ingest_stage.run(params, paths)
    assert m_ingest["images_kept"] == 16 and m_ingest["ignored"] == []
    assert m_ingest["image_folders"] == {n: RIG_FOLDERS[c] for n, (c, _, _) in truth.items()}
    assert sorted(p.name for p in paths.images_dir.iterdir()) == sorted(truth)
    assert json.loads((paths.data_dir / "image_folders.json").read_text()) == m_ingest["image_folders"]

    m = sfm_stage.run(params, paths)
    assert m["camera_mode"] == "auto" and m["images_registered"] == 16 and m["camera_center_error_rel"] < 0.01
    assert sorted((c["folder"], c["images"], c["width"]) for c in m["cameras"]) == [
        ("cam_a", 8, 320), ("cam_b", 8, 320)]
    rec = pycolmap.Reconstruction(str(paths.sparse_dir))
    assert rec.num_cameras() == 2
    for im in rec.images.values():
        c, K, _ = truth[im.name]
        cam = rec.cameras[im.camera_id]
        assert abs(cam.mean_focal_length() - K[0, 0]) / K[0, 0] < 0.03  # each folder's own focal length


def test_exif_focal_prior_reaches_colmap(tmp_path):
    """With an EXIF focal length, the camera COLMAP starts from is marked as a prior at that focal length."""
    from PIL import Image

    from splatflow.scene.sfm import run_sfm

    write_scene(tmp_path / "s", progress=False, n_views=8, width=160, height=120, arc_deg=40.0, n_points=200)
    fx = json.loads((tmp_path / "s/ground_truth/cameras.json").read_text())["frames"][0]["K"][0][0]
    images = tmp_path / "s" / "images"
    for p in sorted(images.iterdir()):  # 35 mm-equivalent focal length of the true camera
        exif = Image.Exif()
        exif[0x8769] = {0xA405: int(round(fx / 160 * 36))}
        with Image.open(p) as im:
            im.load()
            im.save(p, "JPEG", quality=95, exif=exif.tobytes())
    result = run_sfm(images, tmp_path / "sparse", tmp_path / "und", SfmConfig(), progress=False)
    (cam,) = result.metrics["cameras"]
    assert cam["focal_prior_from"] == "exif_35mm"
    assert cam["focal_prior_px"] == pytest.approx(round(fx / 160 * 36) / 36 * 160, abs=1e-3)
    assert abs(cam["focal_px"] - fx) / fx < 0.03


def test_training_handles_views_of_two_sizes(two_cameras):
    """Every step renders one view at its own size and intrinsics: a collection of two sizes trains, and both
    sizes improve (the true cameras and points of the two-camera views, so no SfM is involved)."""
    from dataclasses import replace

    import torch

    from splatflow.pipeline.config import TrainConfig
    from splatflow.render import configure_threads, rasterize
    from splatflow.scene.dataset import load_scene
    from splatflow.train import train
    from splatflow.scene.pixels import read_rgb

    configure_threads(2)
    d, _ = two_cameras
    scene = load_scene(d)
    assert {(v.width, v.height) for v in scene.views} == {(320, 240), (400, 300)}
    cfg = TrainConfig(max_steps=120, backend="cpu", progress=False, sh_degree=1, sh_degree_interval=60,
                      patch_max_pixels=0)
    cfg = replace(cfg, early_stop=replace(cfg.early_stop, enabled=False),
                  prune_during=replace(cfg.prune_during, enabled=False))
    res = train(scene, cfg, seed=0)
    assert res.steps == 120

    def psnr(splats, v, sh_degree):
        k = (sh_degree + 1) ** 2
        colors = torch.cat([splats["sh0"], splats["shN"][:, : k - 1]], dim=1)
        rgb, _, _ = rasterize(splats["means"], splats["quats"], torch.exp(splats["scales"]),
                              torch.sigmoid(splats["opacities"]), colors,
                              torch.from_numpy(v.world_to_cam).float()[None], torch.from_numpy(v.K).float()[None],
                              v.width, v.height, sh_degree=sh_degree, backend="cpu")
        gt = torch.from_numpy(read_rgb(v.image_path)).float() / 255.0
        assert rgb.shape[1:3] == gt.shape[:2] == (v.height, v.width)
        return float(-10 * torch.log10(((rgb[0].clamp(0, 1) - gt) ** 2).mean()))

    from splatflow.gaussians.model import init_splats

    init = init_splats(scene.points, scene.colors, sh_degree=1, init_opacity=cfg.init_opacity,
                       init_scale=cfg.init_scale)
    for size in ((320, 240), (400, 300)):
        v = next(v for v in scene.views if (v.width, v.height) == size)
        before, after = psnr(init, v, 0), psnr(res.splats, v, res.sh_degree)
        assert after > before + 1.0, (size, before, after)  # measured: +1.9 dB and more after 120 steps


def test_dvc_pipeline_imports_a_colmap_dataset_and_reruns_when_its_model_changes(tmp_path):
    """Through `dvc repro`: ingest copies the levels (DVC outputs), sfm imports, split takes the named test views;
    a changed model file reruns the sfm stage (the dataset folder is its dependency)."""
    import re

    import yaml

    from tests._project import dvc, make_project, stage_record

    root = make_project(tmp_path / "proj", scene="garden",
                        scene_options=dict(n_views=10, width=W, height=H, arc_deg=60.0, n_points=2000))
    dataset = write_dataset(root / "data/raw/garden", tmp_path / "datasets/garden", binary=True, levels=(2, 4))
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["base"]["scenes"] = {"garden": {"source": str(dataset), "colmap": "sparse/0"}}
    params["split"]["test_names"] = ["0003.jpg", "0006.jpg"]
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))

    first = dvc(root, "repro", "split@garden")
    assert re.findall(r"Running stage '([^']+)'", first.stdout) == ["settings@garden", "ingest@garden", "sfm@garden",
                                                                                  "split@garden"]
    sfm = stage_record(root, "garden", "sfm")
    ingest = stage_record(root, "garden", "ingest")
    assert sfm["source"] == "imported" and sfm["images_registered"] == 10
    assert ingest["levels"]["images_4"] == {"copied": 10} and len(list((root / "data/garden/images_4").iterdir())) == 10
    assert json.loads((root / "data/garden/split.json").read_text())["test"] == ["0003.jpg", "0006.jpg"]
    assert not list(root.rglob("*.db"))

    rec = pycolmap.Reconstruction(str(dataset / "sparse/0"))
    rec.delete_point3D(next(iter(rec.points3D)))  # the dataset's model changes, its images do not
    rec.write_binary(str(dataset / "sparse/0"))
    for extra in ("rigs.bin", "frames.bin"):
        (dataset / "sparse/0" / extra).unlink()
    second = dvc(root, "repro", "split@garden")
    assert "sfm@garden" in re.findall(r"Running stage '([^']+)'", second.stdout)
    assert stage_record(root, "garden", "sfm")["points3d"] == sfm["points3d"] - 1


def test_an_empty_or_damaged_model_file_is_named_with_the_fix(raw_scene, tmp_path, no_sfm):
    """pycolmap says "Rig with ID 1 does not exist" for an empty cameras.bin and "Camera model does not exist" for a
    garbage one, naming only the folder: the import names the file, what is wrong with it and the fix."""
    dataset = write_dataset(raw_scene, tmp_path / "ds", levels=())
    model = dataset / "sparse/0"
    fix = r"re-export the model from COLMAP .*or drop base\.scenes\.<scene>\.colmap so the sfm stage runs"
    cases = {
        "cameras.bin": [(b"", r"the file is empty \(0 bytes\)"),
                        (bytes(range(256)) * 2, r"its header counts [\d,]+ cameras, which need at least"),
                        (None, "camera record 1 of 1 .* is cut off")],  # None: the real file less its last byte
        "images.bin": [(b"\x01\x00", r"2 bytes is too short for the 8-byte record count"),
                       (None, r"image record 10 of 10 \('0009.jpg'\) counts")],
        "points3D.bin": [(b"", r"the file is empty"), (None, r"point record ([\d,]+) of \1 runs past the end")],
    }
    for name, variants in cases.items():
        good = (model / name).read_bytes()
        for i, (content, why) in enumerate(variants):
            (model / name).write_bytes(good[:-1] if content is None else content)
            with pytest.raises(UserError, match=rf"sparse/0/{name}: cannot read this COLMAP model file: {why}.*{fix}"):
                colmap_import_model(model, tmp_path)
            with pytest.raises(UserError, match=rf"sparse/0/{name}: .*{why}"):  # the stages: ingest stops first
                _run_stages(tmp_path / f"p-{name}-{i}", dataset)
        (model / name).write_bytes(good)
    # the intact model still imports, and an empty text file left beside a binary model is not what is read
    (model / "cameras.txt").write_text("")
    _, m, _ = _run_stages(tmp_path / "ok", dataset)
    assert m["images_registered"] == 10

    text = write_dataset(raw_scene, tmp_path / "txt", levels=(), binary=False)
    (text / "sparse/0/images.txt").write_text("")
    with pytest.raises(UserError, match=r"sparse/0/images\.txt: cannot read this COLMAP model file: the file is "
                                        r"empty"):
        _run_stages(tmp_path / "p-txt", text)


def colmap_import_model(model: Path, tmp: Path):
    from splatflow.scene.colmap import import_model

    return import_model(model, tmp / "images", tmp / "out/sparse", tmp / "out/undistorted", SfmConfig())


def test_a_model_without_points_or_with_a_bad_camera_line_names_the_file_and_the_fix(raw_scene, tmp_path, no_sfm,
                                                                                     monkeypatch):
    """A model exported without points3D was told it had "no COLMAP model"; a poses-only model why but not what to
    do; a camera line COLMAP's own check refuses showed `Check failed: camera.VerifyParams()`. Each names the file,
    what is wrong and the fix (re-export with points, or SfM on the images)."""
    from typer.testing import CliRunner

    from splatflow.cli import app

    # points3D.bin missing: add-scene and the stages say which file and both ways out
    no_points = write_dataset(raw_scene, tmp_path / "nopts", levels=())
    (no_points / "sparse/0/points3D.bin").unlink()
    proj = tmp_path / "proj"
    proj.mkdir()
    repo = Path(__file__).resolve().parents[1]
    for name in ("params.yaml", "dvc.yaml"):
        shutil.copy(repo / name, proj / name)
    monkeypatch.chdir(proj)
    r = CliRunner().invoke(app, ["add-scene", "nopts", str(no_points)])
    out = " ".join(r.output.split())
    assert r.exit_code == 2, out
    assert "sparse/0: the COLMAP model has cameras and images but no points3D" in out, out
    assert "re-export the model with its points" in out and f"give {no_points / 'images'} to" in out, out
    with pytest.raises(UserError, match=r"sparse/0: the COLMAP model has cameras and images but no points3D.*"
                                        r"drop base\.scenes\.<scene>\.colmap"):
        _run_stages(tmp_path / "p1", no_points)

    # poses only: the file is there, with no point in it
    poses = write_dataset(raw_scene, tmp_path / "poses", levels=())
    rec = pycolmap.Reconstruction(str(poses / "sparse/0"))
    for pid in list(rec.points3D):
        rec.delete_point3D(pid)
    rec.write_binary(str(poses / "sparse/0"))
    with pytest.raises(UserError, match=r"sparse/0/points3D\.bin: the model has camera poses but no 3D points; "
                                        r"training starts from the model's 3D points: re-export .*point_triangulator"):
        _run_stages(tmp_path / "p2", poses)

    # a camera line with the wrong number of parameters for its model (text models only: .bin implies the count)
    text = write_dataset(raw_scene, tmp_path / "txt", levels=(), binary=False)
    cams = text / "sparse/0/cameras.txt"
    lines = cams.read_text().splitlines()
    i = next(k for k, ln in enumerate(lines) if ln and not ln.startswith("#"))
    lines[i] = " ".join(lines[i].split()[:-2])  # two parameters short
    cams.write_text("\n".join(lines) + "\n")
    with pytest.raises(UserError, match=rf"sparse/0/cameras\.txt: cannot read this COLMAP model file: line {i + 1} "
                                        r"\(camera 1\): PINHOLE takes 4 parameters, the line has 2; re-export"):
        _run_stages(tmp_path / "p3", text)
