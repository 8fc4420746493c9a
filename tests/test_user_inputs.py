"""From capture to splat as a user does it: `splatflow add-scene NAME PATH`, then `dvc repro` to the export (slow).

Three kinds of input, each in its own throw-away project with no hand edit of params.yaml after add-scene (only the
step counts are made small when the project is made: 50 training steps already give 19-20 dB on these scenes, where
the check is > 10 dB, and 150 cost each test another ~100 steps of training):

* a COLMAP dataset in the Mip-NeRF 360 layout (``images/``, ``images_2/``, ``sparse/0/``), trained at downscale 2;
* a phone video (portrait mp4, 270x480: a quarter of 1080x1920) of an orbit;
* a folder of photos from two cameras (two image sizes, two focal lengths, EXIF focal lengths);
* a two-camera rig stored as one sub-folder per camera (one image size, two focal lengths, no EXIF), through
  the split.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import cv2
import numpy as np
import pytest
import yaml

from tests._project import BIN, dvc, make_project, run, stage_record

pytestmark = pytest.mark.slow

# Small enough for seconds per stage; not a quality check (bench/ measures quality with the default params).
FAST = {
    "train": {"max_steps": 50, "progress": False},
    "prune": {"phases": 1, "finetune_steps": 20, "score_rounds": 1, "val_views": 2, "progress": False,
              "min_train_views": 0},
    "evaluate": {"lpips_variants": [], "save_renders": False},
}


STAGES = ("ingest", "sfm", "split", "train", "prune", "evaluate", "export")


def _project(tmp_path: Path, overrides: dict | None = None) -> Path:
    o = {k: dict(v) for k, v in FAST.items()}
    for section, values in (overrides or {}).items():
        o.setdefault(section, {}).update(values)
    root = make_project(tmp_path / "proj", overrides=o, generate=False)
    # The user's project starts with no scene of its own: add-scene is what registers one.
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["base"]["scenes"] = {}
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    run(["git", "commit", "-qam", "no scenes yet"], root)
    return root


def _add_scene(root: Path, *args: str) -> str:
    p = run([str(BIN / "python"), "-m", "splatflow.cli", "add-scene", *args], root)
    return p.stdout + p.stderr


def _repro_to_export(root: Path, name: str) -> tuple[dict, float]:
    import time

    t0 = time.perf_counter()
    out = dvc(root, "repro", f"evaluate@{name}", f"export@{name}").stdout  # all but the report (web build)
    seconds = time.perf_counter() - t0
    ran = re.findall(r"Running stage '([^']+)'", out)
    assert sorted(ran) == sorted(f"{s}@{name}" for s in ("settings", *STAGES)), out
    m = {s: stage_record(root, name, s) for s in STAGES}
    ply = m["export"]["files"]["ply"]
    from plyfile import PlyData

    path = root / ply["path"]
    vertex = PlyData.read(str(path))["vertex"]
    assert vertex.count == ply["gaussians"] == m["evaluate"]["gaussians"] > 0
    assert math.isfinite(m["evaluate"]["psnr"]) and m["evaluate"]["psnr"] > 10
    print(f"{name}: dvc repro to export in {seconds:.1f} s")
    return m, seconds


def test_mipnerf360_layout_dataset(tmp_path):
    from splatflow.scene.synthetic import write_scene
    from tests._colmap_data import write_dataset

    scene = tmp_path / "synthetic"
    write_scene(scene, progress=False, n_views=12, width=320, height=240, arc_deg=90.0, seed=0, n_points=3000)
    dataset = write_dataset(scene, tmp_path / "captures" / "garden", binary=True, levels=(2,))
    root = _project(tmp_path)
    said = _add_scene(root, "garden", str(dataset), "--downscale", "2")
    assert "COLMAP dataset" in said, said
    m, _ = _repro_to_export(root, "garden")
    assert m["sfm"]["source"] == "imported" and m["sfm"]["images_registered"] == 12
    assert m["ingest"]["levels"]["images_2"] == {"copied": 12}
    res = m["evaluate"]["protocol"]["resolution"]
    assert res["rule"] == "downscale 2" and res["image_source"] == "images_2" and res["sizes"] == ["160x120"]
    assert m["train"]["resolution"]["image_source"] == "images_2"


def _write_phone_video(path: Path, n_frames: int, width: int, height: int) -> None:
    """A handheld-style orbit around the synthetic room, portrait, as a phone records it (mp4)."""
    from splatflow.scene import synthetic

    opts = synthetic.SceneOptions(n_views=n_frames, width=width, height=height, arc_deg=60.0, seed=0,
                                  hfov_deg=45.0)
    room = synthetic.build_room(opts.seed)
    K, w2cs = synthetic.orbit_cameras(opts)
    # MPEG-4 part 2: the pip OpenCV wheels have no H.264 encoder; decoding either goes through the same FFmpeg path
    vw = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), 30.0, (width, height))
    if not vw.isOpened():  # pragma: no cover - depends on the OpenCV build
        pytest.skip("no OpenCV mp4 encoder available")
    noise = np.random.default_rng(1)
    for w2c in w2cs:
        img, _ = synthetic.render_view(room, K, w2c, width, height, supersample=1)
        img8 = np.clip(np.round(img * 255.0 + noise.normal(0, 1.5, img.shape)), 0, 255).astype(np.uint8)
        vw.write(np.ascontiguousarray(img8[..., ::-1]))
    vw.release()


def test_phone_video(tmp_path):
    video = tmp_path / "captures" / "IMG_0042.mp4"
    video.parent.mkdir(parents=True)
    _write_phone_video(video, n_frames=36, width=270, height=480)
    root = _project(tmp_path, {"ingest": {"video_frames": 12}})
    said = _add_scene(root, "walk", str(video))
    assert "video" in said.lower(), said
    m, _ = _repro_to_export(root, "walk")
    assert m["ingest"]["source_kind"] == "video" and m["ingest"]["images_kept"] >= 10
    assert m["ingest"]["video"]["width_px"] == 270
    assert m["sfm"]["matcher"] == "sequential"
    assert m["sfm"]["images_registered"] == m["ingest"]["images_kept"]
    (size,) = m["train"]["resolution"]["sizes"]  # the undistorted frame, ~270x480 (undistortion may trim a pixel)
    w, h = map(int, size.split("x"))
    assert h > w >= 260  # portrait, at full size


def test_mixed_camera_photo_folder(tmp_path):
    from PIL import Image

    from tests._colmap_data import CAMERAS_2, write_two_camera_views

    folder = tmp_path / "two"
    truth = write_two_camera_views(folder, n_views=16)
    photos = folder / "images"
    for name, (c, K, _) in truth.items():  # the 35 mm-equivalent focal length each camera writes, as phones do
        cam = CAMERAS_2[c]
        exif = Image.Exif()
        exif[0x010F], exif[0x0110] = "Splatflow", f"Cam{c}"
        exif[0x8769] = {0xA405: int(round(K[0, 0] / cam["width"] * 36))}
        with Image.open(photos / name) as im:
            im.load()
            im.save(photos / name, "JPEG", quality=95, exif=exif.tobytes())
    root = _project(tmp_path)
    _add_scene(root, "desk", str(photos))
    m, _ = _repro_to_export(root, "desk")
    assert m["ingest"]["image_sizes"] == {"320x240": 8, "400x300": 8}
    assert m["sfm"]["source"] == "computed" and m["sfm"]["images_registered"] == 16
    cams = sorted((c["width"], c["height"], c["images"], c["focal_prior_from"]) for c in m["sfm"]["cameras"])
    assert cams == [(320, 240, 8, "exif_35mm"), (400, 300, 8, "exif_35mm")]
    assert len(m["train"]["resolution"]["sizes"]) == 2  # each camera's views train at their own size


def test_rig_in_sub_folders(tmp_path):
    """add-scene on rig/ (cam_a/, cam_b/, nothing else): sfm.camera_mode auto reads the sub-folders, and SfM gives
    each folder its own camera although both have one size and no EXIF (one camera would fit neither lens)."""
    from tests._colmap_data import write_rig_views

    truth = write_rig_views(tmp_path / "two", n_views=16)
    root = _project(tmp_path)
    _add_scene(root, "rig", str(tmp_path / "two" / "rig"))
    # Through the split only: from there on the views are flat-named images like any other scene's (the
    # mixed-camera test above trains, evaluates and exports such a scene), so the rest would repeat its minute.
    out = dvc(root, "repro", "split@rig").stdout
    assert sorted(re.findall(r"Running stage '([^']+)'", out)) == ["ingest@rig", "settings@rig", "sfm@rig",
                                                                               "split@rig"], out
    m = {s: stage_record(root, "rig", s) for s in ("ingest", "sfm")}
    assert sorted(m["ingest"]["image_folders"]) == sorted(truth) and m["ingest"]["ignored"] == []
    assert m["sfm"]["images_registered"] == 16
    cams = sorted((c["folder"], c["images"]) for c in m["sfm"]["cameras"])
    assert cams == [("cam_a", 8), ("cam_b", 8)]
    views = json.loads((root / "data/rig/split.json").read_text())
    assert all("__" in n for n in views["train"] + views["test"])  # the flat names reach the split
