"""Ingest on crafted captures: every rejection reason, EXIF rotation, untouched input, determinism, video.

The "capture" is a camera pan over scikit-image's astronaut photo (real texture, so blur and duplicate detection
are exercised on real content), plus one bad file per rejection reason.
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import cv2
import numpy as np
import pytest
from PIL import Image
from skimage import data

from splatflow.pipeline.config import IngestConfig, params_from_dict
from splatflow.pipeline.errors import UserError
from splatflow.pipeline.paths import ScenePaths
from splatflow.scene.imagehash import correlation, hamming, phash, sharpness, thumbnail, to_gray_f32
from splatflow.scene.ingest import ingest, neighbour_indices, output_names
from splatflow.scene.video import window_bounds

W, H = 256, 192  # size of every good image in the crafted capture
CFG = IngestConfig()


def _photo() -> np.ndarray:
    return data.astronaut()  # [512, 512, 3] uint8


def _crop(x: int, y: int = 160, w: int = W, h: int = H) -> np.ndarray:
    return np.ascontiguousarray(_photo()[y:y + h, x:x + w])  # [h, w, 3]


def _save_jpg(path: Path, rgb: np.ndarray, **kw) -> None:
    Image.fromarray(rgb).save(path, "JPEG", quality=95, **kw)


def _snapshot(folder: Path) -> dict:
    """Name -> (sha256, size, mtime_ns) of every file: proves the input was not touched."""
    return {p.name: (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.iterdir())}


def _decode(path: Path) -> np.ndarray:
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB")).astype(np.float64)


@pytest.fixture(scope="module")
def capture(tmp_path_factory) -> Path:
    """8 good pan views + one crafted file per rejection reason + one EXIF-rotated good view."""
    src = tmp_path_factory.mktemp("capture")
    for k, x in enumerate(range(0, 256, 32)):  # 00..07: the pan, 32 px (12 %) apart
        _save_jpg(src / f"{k:02d}.jpg", _crop(x))
    # exact pixels of view 03 saved as PNG: a duplicate under another name and format
    Image.fromarray(_crop(96)).save(src / "03_copy.png")
    # a blurred copy of view 05 (a shaken shot)
    _save_jpg(src / "05_blur.jpg", cv2.GaussianBlur(_crop(160), (0, 0), 2.0))
    # too small (rejected), and another size than the majority (kept: several cameras are allowed)
    _save_jpg(src / "06_small.jpg", _crop(192, w=40, h=30))
    _save_jpg(src / "07_odd.jpg", _crop(224, w=200, h=150))
    # a truncated JPEG: the first 60 % of a valid file (OpenCV would decode it with a warning)
    buf = io.BytesIO()
    Image.fromarray(_crop(48)).save(buf, "JPEG", quality=95)
    (src / "08_trunc.jpg").write_bytes(buf.getvalue()[: int(len(buf.getvalue()) * 0.6)])
    (src / "09_empty.jpg").write_bytes(b"")
    (src / "10_notes.jpg").write_text("these are my notes, not a photo\n")
    # a view stored sideways (portrait pixels) with EXIF Orientation 6 = "rotate 90 deg clockwise to display"
    upright = _crop(16, y=260)
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(upright).transpose(Image.Transpose.ROTATE_90).save(
        src / "11_rot.jpg", "JPEG", quality=95, exif=exif.tobytes())
    (src / ".DS_Store").write_bytes(b"\x00\x01junk")
    return src


EXPECTED_REJECTIONS = {
    "03_copy.png": "duplicate",
    "05_blur.jpg": "blurry",
    "06_small.jpg": "too_small",
    "08_trunc.jpg": "unreadable",
    "09_empty.jpg": "empty",
    "10_notes.jpg": "not_image",
}


@pytest.fixture(scope="module")
def ingested(capture, tmp_path_factory):
    before = _snapshot(capture)
    out = tmp_path_factory.mktemp("out") / "images"
    result = ingest(capture, out, CFG, progress=False)
    return before, out, result


def test_each_bad_file_rejected_with_its_reason(ingested):
    _, out, result = ingested
    got = {r.file: r.reason for r in result.rejected}
    assert got == EXPECTED_REJECTIONS
    m = result.metrics()
    assert m["images_in"] == 16 and m["images_kept"] == 10
    assert m["image_sizes"] == {f"{W}x{H}": 9, "200x150": 1}  # another size is no longer a reason to reject
    assert m["image_width_px"] is None and m["image_height_px"] is None
    assert m["rejected_by_reason"] == {r: 1 for r in EXPECTED_REJECTIONS.values()}
    assert m["ignored"] == [".DS_Store"]
    assert json.loads(json.dumps(m)) == m  # JSON-serialisable as it is
    dup = next(r for r in result.rejected if r.reason == "duplicate")
    assert "03.jpg" in dup.detail  # names the image it duplicates
    # stems kept, extension normalised, sorted like the input; only images in the folder (pycolmap reads all)
    assert sorted(p.name for p in out.iterdir()) == [f"{k:02d}.jpg" for k in range(8)] + ["07_odd.jpg",
                                                                                           "11_rot.jpg"]
    assert [c.out_name for c in result.kept] == sorted(c.out_name for c in result.kept)


def test_clean_jpegs_copied_and_others_converted(ingested, capture):
    _, out, result = ingested
    assert (out / "00.jpg").read_bytes() == (capture / "00.jpg").read_bytes()  # no second JPEG generation
    assert {c.out_name: c.written for c in result.kept}["11_rot.jpg"] == "converted"
    for p in out.iterdir():
        with Image.open(p) as im:
            assert im.format == "JPEG" and im.mode == "RGB"
            assert im.size == ((200, 150) if p.name == "07_odd.jpg" else (W, H))


def test_exif_rotation_applied_to_pixels(ingested):
    _, out, _ = ingested
    with Image.open(out / "11_rot.jpg") as im:
        assert im.getexif().get(0x0112, 1) == 1  # no rotation left for a viewer to apply twice
    got = _decode(out / "11_rot.jpg")  # [H, W, 3]
    upright = _crop(16, y=260).astype(np.float64)
    assert got.shape == upright.shape
    err_right = np.abs(got - upright).mean()
    err_flipped = np.abs(got - upright[::-1, ::-1]).mean()  # the 180-degree mistake has the same shape
    assert err_right < 5.0, err_right  # two JPEG generations at q95 (the first one 4:2:0)
    assert err_flipped > 8 * err_right, (err_right, err_flipped)


def test_input_folder_unchanged(ingested, capture):
    before, _, _ = ingested
    assert _snapshot(capture) == before


def test_rerun_gives_identical_files(ingested, capture, tmp_path):
    _, out, _ = ingested
    out2 = tmp_path / "again" / "images"
    ingest(capture, out2, CFG, progress=False)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == {p.name: p.read_bytes() for p in out2.iterdir()}
    # re-running into the same folder replaces it (stale files from an earlier run disappear)
    (out2 / "stale.jpg").write_bytes(b"old")
    ingest(capture, out2, CFG, progress=False)
    assert not (out2 / "stale.jpg").exists()
    assert not any(p.name.startswith(".") for p in out2.parent.iterdir())  # no staging folder left behind


def test_measures_separate_blur_and_duplicates_on_real_content():
    """The measures the thresholds rest on: blur costs far more sharpness than content changes across a pan;
    re-encoding keeps the hash close and the thumbnails correlated, a small pan does not."""
    views = [to_gray_f32(_crop(x)) for x in range(0, 256, 32)]
    s = np.array([sharpness(v, 640) for v in views])
    blurred = sharpness(cv2.GaussianBlur(views[3], (0, 0), 1.0), 640)
    assert s.min() / np.median(s) > CFG.blur_rel_threshold
    assert blurred / np.median(s) < CFG.blur_rel_threshold
    buf = cv2.imencode(".jpg", _crop(96)[..., ::-1], [cv2.IMWRITE_JPEG_QUALITY, 50])[1]
    recoded = to_gray_f32(cv2.imdecode(buf, cv2.IMREAD_GRAYSCALE))
    assert hamming(phash(views[3]), phash(recoded)) <= CFG.dedupe_max_distance
    assert correlation(thumbnail(views[3]), thumbnail(recoded)) >= CFG.dedupe_min_correlation
    # a 3 px pan (1 % of the width) is camera motion, not a duplicate
    shifted = to_gray_f32(_crop(99))
    assert correlation(thumbnail(views[3]), thumbnail(shifted)) < CFG.dedupe_min_correlation
    pans = [hamming(phash(a), phash(b)) for a, b in zip(views, views[1:])]
    assert min(pans) > CFG.dedupe_max_distance


def test_too_few_usable_images_error_counts_reasons(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    _save_jpg(src / "a.jpg", _crop(0))
    _save_jpg(src / "b.jpg", _crop(64))
    _save_jpg(src / "c.jpg", _crop(0))  # duplicate of a
    (src / "d.jpg").write_bytes(b"")
    (src / "e.txt").write_text("hello")
    out = tmp_path / "out" / "images"
    with pytest.raises(UserError) as e:
        ingest(src, out, CFG, progress=False)
    msg = str(e.value)
    assert "only 2 usable images of 5" in msg
    assert "1 duplicate" in msg and "1 empty" in msg and "1 not image" in msg
    assert "c.jpg" in msg and "d.jpg" in msg and "e.txt" in msg
    assert not out.exists() and not any(out.parent.iterdir())  # nothing half-written


def test_folder_of_folders_says_where_to_point(tmp_path):
    (tmp_path / "shoot" / "day1").mkdir(parents=True)
    _save_jpg(tmp_path / "shoot" / "day1" / "a.jpg", _crop(0))
    with pytest.raises(UserError, match="sub-folders.*day1/"):
        ingest(tmp_path / "shoot", tmp_path / "out" / "images", CFG, progress=False)


def test_source_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        ingest(tmp_path / "nope", tmp_path / "out", CFG, progress=False)
    img = tmp_path / "one.jpg"
    _save_jpg(img, _crop(0))
    with pytest.raises(UserError, match="folder of images or a video"):
        ingest(img, tmp_path / "out", CFG, progress=False)
    with pytest.raises(UserError, match="overlaps"):
        ingest(tmp_path, tmp_path / "data" / "images", CFG, progress=False)
    bad_video = tmp_path / "broken.mp4"
    bad_video.write_bytes(b"\x00\x00\x00\x18ftypmp42" + b"garbage" * 100)
    with pytest.raises(UserError, match="broken.mp4"):
        ingest(bad_video, tmp_path / "out2", CFG, progress=False)
    assert bad_video.read_bytes().endswith(b"garbage")


def _write_video(path: Path, n_frames: int, sharp_every: int, sharp_offset: int) -> list[int]:
    """A 320x240 pan over the photo, 4 px per frame; only frames i % sharp_every == sharp_offset are sharp."""
    size = (320, 240)
    for fourcc in ("mp4v", "MJPG"):
        vw = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*fourcc), 24.0, size)
        if vw.isOpened():
            break
    else:  # pragma: no cover - depends on the OpenCV build
        pytest.skip("no OpenCV video encoder available")
    sharp = []
    photo = _photo()
    for i in range(n_frames):
        rgb = photo[140:380, 4 * i:4 * i + 320]  # [240, 320, 3]
        if i % sharp_every == sharp_offset:
            sharp.append(i)
        else:
            rgb = cv2.GaussianBlur(rgb, (0, 0), 2.0)  # motion-blurred frame
        vw.write(np.ascontiguousarray(rgb[..., ::-1]))
    vw.release()
    return sharp


def test_video_keeps_the_sharpest_frame_of_each_window(tmp_path):
    (tmp_path / "raw").mkdir()
    video = tmp_path / "raw" / "walk.mp4"
    sharp = _write_video(video, n_frames=48, sharp_every=8, sharp_offset=5)
    before = _snapshot(video.parent)
    cfg = IngestConfig(video_frames=6)
    out = tmp_path / "data" / "images"
    result = ingest(video, out, cfg, progress=False)
    m = result.metrics()
    assert m["source_kind"] == "video" and m["images_in"] == 6 and m["images_kept"] == 6
    assert m["video"]["chosen_frame_indices"] == sharp == [5, 13, 21, 29, 37, 45]
    assert m["video"]["frames_decoded"] == 48 and m["video"]["width_px"] == 320
    assert sorted(p.name for p in out.iterdir()) == [f"frame_{i:06d}.jpg" for i in sharp]
    got = _decode(out / "frame_000013.jpg")  # the frame's real pixels, not a blurred neighbour
    want = _photo()[140:380, 52:372].astype(np.float64)
    assert np.abs(got - want).mean() < 8.0
    assert _snapshot(video.parent) == before


def test_video_blurry_window_and_static_camera_rejected(tmp_path):
    """A window with only blurred frames is rejected as blurry relative to its neighbours; frames that repeat
    (camera standing still) are duplicates."""
    video = tmp_path / "still.avi"
    vw = cv2.VideoWriter(str(video), cv2.VideoWriter_fourcc(*"MJPG"), 24.0, (320, 240))
    assert vw.isOpened()
    photo = _photo()
    xs = [0, 0, 0, 40, 40, 40, 80, 80, 80, 120, 120, 120, 120, 120, 120, 160, 160, 160]  # 6 windows of 3
    for i, x in enumerate(xs):
        rgb = photo[140:380, x:x + 320]
        if 6 <= i < 9:
            rgb = cv2.GaussianBlur(rgb, (0, 0), 2.5)
        vw.write(np.ascontiguousarray(rgb[..., ::-1]))
    vw.release()
    result = ingest(video, tmp_path / "out" / "images", IngestConfig(video_frames=6), progress=False)
    reasons = {r.file: r.reason for r in result.rejected}
    assert reasons[f"{video.name}#frame=6"] == "blurry"
    assert reasons[f"{video.name}#frame=12"] == "duplicate"
    assert len(result.kept) == 4


# A valid 2-frame 64x64 AV1 MP4 (872 bytes, written once with PyAV's libsvtav1 encoder; PyAV decodes both
# frames). OpenCV's FFmpeg build opens it, reports 2 frames and fourcc AV01, then decodes none, without an error.
AV1_MP4_B64 = (
    "AAAAIGZ0eXBpc29tAAACAGlzb21hdjAxaXNvMm1wNDEAAAAIZnJlZQAAADttZGF0CgoAAAACr/+NXzAIMhAQALCCBRQggQAA"
    "CACVzxmAMhMwAgQJJJI7GAAAAgAAAAAALDpwAAADBW1vb3YAAABsbXZoZAAAAAAAAAAAAAAAAAAAA+gAAABUAAEAAAEAAAAA"
    "AAAAAAAAAAABAAAAAAAAAAAAAAAAAAAAAQAAAAAAAAAAAAAAAAAAQAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAIA"
    "AAIvdHJhawAAAFx0a2hkAAAAAwAAAAAAAAAAAAAAAQAAAAAAAABUAAAAAAAAAAAAAAAAAAAAAAABAAAAAAAAAAAAAAAAAAAA"
    "AQAAAAAAAAAAAAAAAAAAQAAAAABAAAAAQAAAAAAAJGVkdHMAAAAcZWxzdAAAAAAAAAABAAAAVAAAAAAAAQAAAAABp21kaWEA"
    "AAAgbWRoZAAAAAAAAAAAAAAAAAAAMAAAAAQAVcQAAAAAAC1oZGxyAAAAAAAAAAB2aWRlAAAAAAAAAAAAAAAAVmlkZW9IYW5k"
    "bGVyAAAAAVJtaW5mAAAAFHZtaGQAAAABAAAAAAAAAAAAAAAkZGluZgAAABxkcmVmAAAAAAAAAAEAAAAMdXJsIAAAAAEAAAES"
    "c3RibAAAAJJzdHNkAAAAAAAAAAEAAACCYXYwMQAAAAAAAAABAAAAAAAAAAAAAAAAAAAAAABAAEAASAAAAEgAAAAAAAAAAQAA"
    "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAABj//wAAABhhdjFDgQAMAAoKAAAAAq//gF8ACAAAABRidHJ0AAAAAAAA"
    "EyAAABMgAAAAGHN0dHMAAAAAAAAAAQAAAAIAAAIAAAAAFHN0c3MAAAAAAAAAAQAAAAEAAAAcc3RzYwAAAAAAAAABAAAAAQAA"
    "AAIAAAABAAAAHHN0c3oAAAAAAAAAAAAAAAIAAAAeAAAAFQAAABRzdGNvAAAAAAAAAAEAAAAwAAAAYnVkdGEAAABabWV0YQAA"
    "AAAAAAAhaGRscgAAAAAAAAAAbWRpcmFwcGwAAAAAAAAAAAAAAAAtaWxzdAAAACWpdG9vAAAAHWRhdGEAAAABAAAAAExhdmY2"
    "Mi4xMi4xMDI="
)


def test_av1_video_fails_clearly_instead_of_yielding_nothing(tmp_path):
    import base64

    video = tmp_path / "phone.mp4"
    video.write_bytes(base64.b64decode(AV1_MP4_B64))
    with pytest.raises(UserError) as e:
        ingest(video, tmp_path / "out" / "images", CFG, progress=False)
    assert "phone.mp4" in str(e.value) and "AV1" in str(e.value) and "decoded 0 frames" in str(e.value)
    assert "libx264" in str(e.value)  # says how to fix it


def test_helpers():
    assert window_bounds(10, 3) == [(0, 3), (3, 6), (6, 10)]
    assert window_bounds(2, 5) == [(0, 1), (1, 2)]
    assert neighbour_indices(0, 10, 4) == [1, 2, 3, 4]
    assert neighbour_indices(5, 10, 4) == [3, 4, 6, 7]
    assert neighbour_indices(9, 10, 4) == [5, 6, 7, 8]
    assert neighbour_indices(1, 3, 7) == [0, 2]
    names = output_names(["b.JPG", "a.png", "a.jpg", "c.heic"], "jpg")
    assert names == {"a.jpg": "a.jpg", "a.png": "a_png.jpg", "b.JPG": "b.jpg", "c.heic": "c.jpg"}
    names = output_names(["cam_b/0001.png", "cam_a/0001.jpg", "0001.jpg", "rig/cam_c/0001.jpg"], "jpg")
    assert names == {"0001.jpg": "0001.jpg", "cam_a/0001.jpg": "cam_a__0001.jpg", "cam_b/0001.png": "cam_b__0001.jpg",
                     "rig/cam_c/0001.jpg": "rig__cam_c__0001.jpg"}


def _rig(root: Path) -> Path:
    """Two cameras' pans in cam_a/ and cam_b/ (3 views each), plus a hidden folder and an empty file."""
    for cam, xs in (("cam_a", (0, 64, 128)), ("cam_b", (32, 96, 160))):
        (root / cam).mkdir(parents=True)
        for k, x in enumerate(xs):
            _save_jpg(root / cam / f"{k:04d}.jpg", _crop(x))
    (root / ".thumbs").mkdir()
    _save_jpg(root / ".thumbs" / "0000.jpg", _crop(0))
    (root / "cam_b" / "0003.jpg").write_bytes(b"")
    return root


def test_sub_folders_read_with_flat_names_that_keep_the_folder(tmp_path):
    from splatflow.scene.ingest import reads_subfolders

    rig = _rig(tmp_path / "rig")
    # auto reads sub-folders only when the source has no images of its own (a rig's layout)
    assert reads_subfolders(rig, "auto") and reads_subfolders(rig, "per_folder")
    assert not reads_subfolders(rig, "single") and not reads_subfolders(rig, "per_image")
    result = ingest(rig, tmp_path / "out", CFG, progress=False, subfolders=True)
    out = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert out == [f"cam_{c}__{k:04d}.jpg" for c in "ab" for k in range(3)]
    assert (tmp_path / "out" / "cam_b__0001.jpg").read_bytes() == (rig / "cam_b" / "0001.jpg").read_bytes()
    m = result.metrics()
    assert m["image_folders"] == {n: n.split("__")[0] for n in out}
    assert result.folder_counts() == {"cam_a": 3, "cam_b": 3}
    assert [(r["file"], r["reason"]) for r in m["rejected"]] == [("cam_b/0003.jpg", "empty")]  # named by its path
    assert m["ignored"] == [".thumbs/"]

    # a photo of the source's own: auto no longer reads sub-folders (a backup/ beside the photos is no camera) ...
    _save_jpg(rig / "0000.jpg", _crop(200))
    _save_jpg(rig / "0001.jpg", _crop(232))
    _save_jpg(rig / "0002.jpg", _crop(248))
    assert not reads_subfolders(rig, "auto") and reads_subfolders(rig, "per_folder")
    flat = ingest(rig, tmp_path / "out2", CFG, progress=False)
    assert [c.out_name for c in flat.kept] == ["0000.jpg", "0001.jpg", "0002.jpg"]
    assert flat.metrics()["image_folders"] == {} and "cam_a/" in flat.ignored
    # ... while per_folder reads both, the source's own images as folder ""
    both = ingest(rig, tmp_path / "out3", CFG, progress=False, subfolders=True)
    assert both.folder_counts() == {"": 3, "cam_a": 3, "cam_b": 3}


def test_heic_is_converted_and_upright(tmp_path):
    pillow_heif = pytest.importorskip("pillow_heif")
    pillow_heif.register_heif_opener()
    src = tmp_path / "src"
    src.mkdir()
    for k, x in enumerate((0, 64)):
        Image.fromarray(_crop(x)).save(src / f"IMG_{k}.HEIC", format="HEIF", quality=95)
    # an iPhone-style portrait-stored shot: sideways pixels + EXIF orientation 6
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(_crop(128)).transpose(Image.Transpose.ROTATE_90).save(
        src / "IMG_2.HEIC", format="HEIF", quality=95, exif=exif.tobytes())
    out = tmp_path / "out" / "images"
    result = ingest(src, out, CFG, progress=False)
    assert result.metrics()["converted"] == 3 and not result.rejected
    assert sorted(p.name for p in out.iterdir()) == ["IMG_0.jpg", "IMG_1.jpg", "IMG_2.jpg"]
    assert np.abs(_decode(out / "IMG_1.jpg") - _crop(64)).mean() < 6.0
    assert np.abs(_decode(out / "IMG_2.jpg") - _crop(128)).mean() < 6.0  # rotated once, not twice


def test_stage_run_writes_images_and_returns_metrics(capture, tmp_path):
    from stages.ingest import run

    params = params_from_dict({"base": {"scenes": {"s": {"source": str(capture)}}}, "ingest": {"image_format": "png"}})
    paths = ScenePaths("s", tmp_path)
    m = run(params, paths)
    assert m["images_kept"] == 10 and {r["file"]: r["reason"] for r in m["rejected"]} == EXPECTED_REJECTIONS
    names = sorted(p.name for p in paths.images_dir.iterdir())
    assert names[0] == "00.png" and len(names) == 10
    # not a COLMAP dataset: the level folders exist (DVC outputs) and hold only a note saying why
    for n in (2, 4, 8):
        level = paths.data_dir / f"images_{n}"
        assert [p.name for p in level.iterdir()] == ["README.txt"]
        assert f"no images_{n} level" in (level / "README.txt").read_text()
    assert "levels" not in m
    assert np.array_equal(_decode(paths.images_dir / "01.png"), _decode(capture / "01.jpg"))  # lossless


def _capture_with_everything(capture: Path, dst: Path) -> Path:
    """The crafted capture plus a sub-folder, a black lens-cap frame and a white frame (noisy, as a sensor gives)."""
    import shutil

    shutil.copytree(capture, dst)
    (dst / "extras").mkdir()
    (dst / "extras" / "99.jpg").write_bytes((capture / "00.jpg").read_bytes())
    rng = np.random.default_rng(0)
    for name, level in (("12_cap.jpg", 4), ("13_white.jpg", 252)):
        frame = np.clip(level + rng.normal(0, 3, (H, W, 3)), 0, 255).astype(np.uint8)  # [H, W, 3]
        _save_jpg(dst / name, frame)
    return dst


def test_featureless_frames_rejected_with_their_reason(capture, tmp_path):
    src = _capture_with_everything(capture, tmp_path / "cap")
    result = ingest(src, tmp_path / "out", CFG, progress=False)
    got = {r.file: r for r in result.rejected}
    assert got["12_cap.jpg"].reason == "featureless" and got["13_white.jpg"].reason == "featureless"
    assert "lens-cap" in got["12_cap.jpg"].detail and "uniform" in got["12_cap.jpg"].detail
    # the textured views all pass the check, also the darkest crop of the pan
    assert {f for f, r in got.items() if r.reason == "featureless"} == {"12_cap.jpg", "13_white.jpg"}
    assert result.metrics()["rejected_by_reason"]["featureless"] == 2


def test_stage_says_everything_it_left_out_one_line_per_reason(capture, tmp_path, capsys):
    from stages.ingest import run

    src = _capture_with_everything(capture, tmp_path / "cap")
    params = params_from_dict({"base": {"scenes": {"s": {"source": str(src)}}}})
    run(params, ScenePaths("s", tmp_path))
    out = capsys.readouterr().out.splitlines()
    lines = [ln for ln in out if ln.startswith("ingest [s]: ") and not ln.startswith("ingest [s]: kept")]
    reasons = {*EXPECTED_REJECTIONS.values(), "featureless"}
    rejected = [ln for ln in lines if ln.startswith("ingest [s]: rejected ")]
    assert len(rejected) == len(reasons)  # one line per reason, not one per file
    for reason in reasons:
        n = 2 if reason == "featureless" else 1
        line = next(ln for ln in rejected if ln.startswith(f"ingest [s]: rejected {n} {reason.replace('_', ' ')}:"))
        assert "(fix: " in line
    assert any(ln.startswith("ingest [s]: rejected 2 featureless: 12_cap.jpg, 13_white.jpg") for ln in rejected)
    assert "ingest [s]: skipped 1 sub-folder (ingest reads only the files directly in" in "\n".join(lines)
    assert any("extras/" in ln for ln in lines)
    assert any(ln.startswith("ingest [s]: skipped 1 hidden file: .DS_Store") for ln in lines)
    assert any("details per file" in ln and "ingest.json" in ln for ln in lines)


def test_too_small_a_capture_with_nothing_rejected_says_to_add_photos(tmp_path):
    """Two good photos read `only 2 usable images of 2; ... Rejected 0. Fix: add more images to the source.`"""
    src = tmp_path / "src"
    src.mkdir()
    _save_jpg(src / "a.jpg", _crop(0))
    _save_jpg(src / "b.jpg", _crop(64))
    with pytest.raises(UserError) as e:
        ingest(src, tmp_path / "out" / "images", CFG, progress=False)
    msg = str(e.value)
    assert "only 2 images and none was rejected" in msg and "at least 3 overlapping views" in msg, msg
    assert "Rejected 0" not in msg and "20 to 200 photos" in msg
