"""Test data for COLMAP import and several cameras, made from the synthetic room's TRUE cameras and points.

* :func:`write_dataset`: a COLMAP dataset in the Inria / Mip-NeRF 360 layout (``images/``, ``images_N/``,
  ``sparse/0/`` binary or text) from a scene written by :func:`splatflow.scene.synthetic.write_scene`; optionally
  with a distorting camera model, in which case the images are really distorted (resampled through that model), so
  the import's undistortion can be checked against the original pinhole renders.
* :func:`write_two_camera_views`: views of one orbit from two cameras (two sizes, two focal lengths), with a COLMAP
  text model of the true cameras (two PINHOLE cameras) and points.
* :func:`write_rig_views`: the same from two cameras of ONE size, stored as a rig stores them, one sub-folder per
  camera (``cam_a/``, ``cam_b/``): only the folders tell the two cameras apart.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import cv2
import numpy as np

from splatflow.scene import synthetic


def _resize_area(src: Path, dst: Path, n: int) -> None:
    img = cv2.imread(str(src), cv2.IMREAD_COLOR)
    h, w = img.shape[:2]
    cv2.imwrite(str(dst), cv2.resize(img, (round(w / n), round(h / n)), interpolation=cv2.INTER_AREA),
                [cv2.IMWRITE_JPEG_QUALITY, 95])


def distort_image(img: np.ndarray, K: np.ndarray, cam) -> np.ndarray:
    """The pinhole image ``img`` (intrinsics ``K``) as seen through the pycolmap camera ``cam`` (same size).

    Every output pixel centre is unprojected through ``cam`` (its distortion) and looked up in the pinhole
    image; COLMAP puts pixel centres at +0.5, OpenCV's remap at +0.
    """
    h, w = img.shape[:2]
    xs, ys = np.meshgrid(np.arange(w) + 0.5, np.arange(h) + 0.5)
    rays = np.asarray(cam.cam_from_img(np.stack([xs.ravel(), ys.ravel()], axis=1)))  # [H*W, 2] normalised
    map_x = (K[0, 0] * rays[:, 0] + K[0, 2] - 0.5).reshape(h, w).astype(np.float32)
    map_y = (K[1, 1] * rays[:, 1] + K[1, 2] - 0.5).reshape(h, w).astype(np.float32)
    return cv2.remap(img, map_x, map_y, cv2.INTER_LINEAR, borderMode=cv2.BORDER_CONSTANT)


def write_dataset(scene: Path, out: Path, *, binary: bool = True, levels: tuple[int, ...] = (2,),
                  model: str | None = None, extra_params: tuple[float, ...] = (), model_dir: str = "sparse/0") -> Path:
    """``scene`` (write_scene's output) -> a COLMAP dataset at ``out``; returns ``out``.

    ``model``/``extra_params``: replace the PINHOLE camera by this model with the true fx, fy, cx, cy (or f, cx, cy)
    and these distortion parameters; the images are distorted to match and the 2D points re-projected.
    """
    import pycolmap

    rec = pycolmap.Reconstruction(str(scene / "ground_truth"))
    (out / "images").mkdir(parents=True, exist_ok=True)
    if model is None:
        for p in sorted((scene / "images").iterdir()):
            shutil.copyfile(p, out / "images" / p.name)
    else:
        cam = rec.cameras[1]
        K = np.asarray(cam.calibration_matrix())
        new = pycolmap.Camera.create_from_model_name(1, model, float(K[0, 0]), cam.width, cam.height)
        n_focal_pp = len(new.params) - len(extra_params)
        base = [K[0, 0], K[1, 1], K[0, 2], K[1, 2]] if n_focal_pp == 4 else [K[0, 0], K[0, 2], K[1, 2]]
        new.params = np.array(base + list(extra_params), dtype=np.float64)
        rec.cameras[1] = new
        cam = rec.cameras[1]
        for im in rec.images.values():
            img = cv2.imread(str(scene / "images" / im.name), cv2.IMREAD_COLOR)
            cv2.imwrite(str(out / "images" / im.name), distort_image(img, K, cam), [cv2.IMWRITE_JPEG_QUALITY, 95])
            for p2d in im.points2D:  # keep the observations consistent with the distorting camera
                if p2d.has_point3D():
                    p2d.xy = im.project_point(rec.points3D[p2d.point3D_id].xyz)
    for n in levels:
        (out / f"images_{n}").mkdir(exist_ok=True)
        for p in sorted((out / "images").iterdir()):
            _resize_area(p, out / f"images_{n}" / p.name, n)
    (out / model_dir).mkdir(parents=True, exist_ok=True)
    if binary:
        rec.write_binary(str(out / model_dir))
    else:
        rec.write_text(str(out / model_dir))
    for extra in ("rigs", "frames"):  # pycolmap 4 adds these; published datasets have the three classic files
        for suffix in (".bin", ".txt"):
            (out / model_dir / f"{extra}{suffix}").unlink(missing_ok=True)
    return out


CAMERAS_2 = ({"width": 320, "height": 240, "hfov_deg": 65.0}, {"width": 400, "height": 300, "hfov_deg": 52.0})


def write_two_camera_views(out: Path, n_views: int = 16, arc_deg: float = 90.0, seed: int = 0,
                           cameras=CAMERAS_2, supersample: int = 2) -> dict:
    """Views 0, 2, 4, ... by camera A and 1, 3, 5, ... by camera B, one orbit; ``out/images`` and ``out/sparse``
    (COLMAP text model of the true cameras, two PINHOLE cameras, and the points seen by two views or more).
    Returns ``{name: (camera index, K, world_to_cam)}``."""
    opts = [synthetic.SceneOptions(n_views=n_views, arc_deg=arc_deg, seed=seed, **c) for c in cameras]
    room = synthetic.build_room(seed)
    ks = [synthetic.orbit_cameras(o)[0] for o in opts]
    _, w2cs = synthetic.orbit_cameras(opts[0])  # the orbit does not depend on the camera
    xyz, rgb = synthetic.sample_surface_points(room, 3000, np.random.default_rng(seed + 2))
    noise = np.random.default_rng(seed + 3)
    (out / "images").mkdir(parents=True, exist_ok=True)
    truth, seen, uvs = {}, np.zeros((n_views, len(xyz)), bool), []
    for i, w2c in enumerate(w2cs):
        c = i % 2
        o, K = opts[c], ks[c]
        img, depth = synthetic.render_view(room, K, w2c, o.width, o.height, supersample)
        img8 = np.clip(np.round(img * 255.0 + noise.normal(0, 1.5, img.shape)), 0, 255).astype(np.uint8)
        name = f"{i:04d}.jpg"
        cv2.imwrite(str(out / "images" / name), cv2.cvtColor(img8, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, 95])
        uv, z = synthetic._project(K, w2c, xyz)
        seen[i] = synthetic.visible_points(uv, z, depth, o.width, o.height)
        uvs.append(uv)
        truth[name] = (c, K, w2c)
    keep = seen.sum(axis=0) >= 2
    model = out / "sparse"
    model.mkdir(exist_ok=True)
    with open(model / "cameras.txt", "w") as f:
        for c, (o, K) in enumerate(zip(opts, ks)):
            f.write(f"{c + 1} PINHOLE {o.width} {o.height} {K[0, 0]:.10g} {K[1, 1]:.10g} {K[0, 2]:.10g} "
                    f"{K[1, 2]:.10g}\n")
    tracks: dict[int, list[str]] = {}
    with open(model / "images.txt", "w") as f:
        for i, (name, (c, K, w2c)) in enumerate(truth.items()):
            q, t = synthetic._rotmat_to_qvec(w2c[:3, :3]), w2c[:3, 3]
            f.write(f"{i + 1} {' '.join(f'{v:.12g}' for v in q)} {' '.join(f'{v:.12g}' for v in t)} {c + 1} "
                    f"{name}\n")
            pts = np.nonzero(seen[i] & keep)[0]
            f.write(" ".join(f"{uvs[i][p, 0]:.3f} {uvs[i][p, 1]:.3f} {p + 1}" for p in pts) + "\n")
            for k, p in enumerate(pts):
                tracks.setdefault(int(p), []).append(f"{i + 1} {k}")
    with open(model / "points3D.txt", "w") as f:
        for p in sorted(tracks):
            f.write(f"{p + 1} {xyz[p, 0]:.8g} {xyz[p, 1]:.8g} {xyz[p, 2]:.8g} {rgb[p, 0]} {rgb[p, 1]} {rgb[p, 2]} 0 "
                    f"{' '.join(tracks[p])}\n")
    return truth


#: Two cameras of one size and two focal lengths (a rig of two lenses on identical bodies).
RIG_CAMERAS = ({"width": 320, "height": 240, "hfov_deg": 65.0}, {"width": 320, "height": 240, "hfov_deg": 50.0})
RIG_FOLDERS = ("cam_a", "cam_b")


def write_rig_views(out: Path, n_views: int = 16, cameras=RIG_CAMERAS) -> dict:
    """:func:`write_two_camera_views` with camera A's views in ``out/rig/cam_a/`` and B's in ``out/rig/cam_b/``;
    the true model in ``out/sparse`` names the images as ingest flattens them (``cam_a__0000.jpg``).
    Returns ``{flat name: (camera index, K, world_to_cam)}``."""
    truth = write_two_camera_views(out, n_views=n_views, cameras=cameras)
    flat = {}
    for name, (c, K, w2c) in truth.items():
        folder = out / "rig" / RIG_FOLDERS[c]
        folder.mkdir(parents=True, exist_ok=True)
        (out / "images" / name).rename(folder / name)
        flat[f"{RIG_FOLDERS[c]}__{name}"] = (c, K, w2c)
    (out / "images").rmdir()
    model = out / "sparse" / "images.txt"
    lines = model.read_text().splitlines()
    for i in range(0, len(lines), 2):  # image lines end with the camera id and the name
        head, cam_id, name = lines[i].rsplit(" ", 2)
        lines[i] = f"{head} {cam_id} {RIG_FOLDERS[int(cam_id) - 1]}__{name}"
    model.write_text("\n".join(lines) + "\n")
    return flat
