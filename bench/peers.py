"""Other trainers on exactly our photos: the same training views, cameras, points and working size, so the
test views score both trainers alike.

:func:`write_colmap_project` writes a scene's TRAINING views (never the test views) as a COLMAP project, the layout
the field's trainers read (``images/`` and ``sparse/0/{cameras,images,points3D}.bin``): the images at the working
size the splatflow run trained on, PINHOLE cameras scaled to it, the SfM points. :func:`run_opensplat` runs a
user-built OpenSplat binary on it (an external program: nothing of it is in this repository) with its coordinates
kept (``--keep-crs``), and :func:`evaluate_ply` scores the PLY it writes on our test views with our evaluator.
"""

from __future__ import annotations

import struct
import subprocess
import time
from pathlib import Path

import numpy as np

PINHOLE = 1  # COLMAP's camera model id


def rotation_to_quaternion(R: np.ndarray) -> np.ndarray:
    """``[w, x, y, z]`` (COLMAP's order, w >= 0) of a 3x3 rotation matrix (the synthetic scene writer's)."""
    from splatflow.scene.synthetic import _rotmat_to_qvec

    return _rotmat_to_qvec(np.asarray(R, dtype=np.float64))


def write_colmap_project(scene, out: Path) -> Path:
    """The training views of ``scene`` (a working-size :class:`splatflow.scene.dataset.SceneData`) as a COLMAP
    project in ``out``: PNG images, one PINHOLE camera per view, poses, and the SfM points without tracks."""
    import cv2

    from splatflow.scene.resolution import read_view_rgb

    out = Path(out)
    images, sparse = out / "images", out / "sparse" / "0"
    images.mkdir(parents=True, exist_ok=True)
    sparse.mkdir(parents=True, exist_ok=True)
    views = list(scene.train_views)
    with open(sparse / "cameras.bin", "wb") as f:
        f.write(struct.pack("<Q", len(views)))
        for cid, v in enumerate(views, 1):
            K = np.asarray(v.K, dtype=np.float64)
            f.write(struct.pack("<iiQQ", cid, PINHOLE, int(v.width), int(v.height)))
            f.write(struct.pack("<4d", K[0, 0], K[1, 1], K[0, 2], K[1, 2]))
    with open(sparse / "images.bin", "wb") as f:
        f.write(struct.pack("<Q", len(views)))
        for iid, v in enumerate(views, 1):
            name = Path(v.name).with_suffix(".png").name
            w2c = np.asarray(v.world_to_cam, dtype=np.float64)
            f.write(struct.pack("<i", iid))
            f.write(struct.pack("<4d", *rotation_to_quaternion(w2c[:3, :3])))
            f.write(struct.pack("<3d", *w2c[:3, 3]))
            f.write(struct.pack("<i", iid) + name.encode() + b"\0")
            f.write(struct.pack("<Q", 0))  # no 2D observations
            rgb = read_view_rgb(v)  # [H, W, 3] uint8 at the working size, as training reads it
            cv2.imwrite(str(images / name), cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR))
    points = np.asarray(scene.points, dtype=np.float64)
    colors = np.asarray(scene.colors)
    colors = (np.clip(colors, 0, 1) * 255).round().astype(np.uint8) if colors.dtype != np.uint8 else colors
    with open(sparse / "points3D.bin", "wb") as f:
        f.write(struct.pack("<Q", len(points)))
        for pid, (p, c) in enumerate(zip(points, colors), 1):
            f.write(struct.pack("<Q3d3Bd", pid, *p, *c, 0.0))
            f.write(struct.pack("<Q", 0))  # empty track
    return out


def read_colmap_project(root: Path) -> dict:
    """What :func:`write_colmap_project` wrote, read back (the tests check it against the scene)."""
    sparse = Path(root) / "sparse" / "0"
    cams, ims, pts = {}, {}, []
    with open(sparse / "cameras.bin", "rb") as f:
        for _ in range(struct.unpack("<Q", f.read(8))[0]):
            cid, model, w, h = struct.unpack("<iiQQ", f.read(24))
            cams[cid] = (model, w, h, struct.unpack("<4d", f.read(32)))
    with open(sparse / "images.bin", "rb") as f:
        for _ in range(struct.unpack("<Q", f.read(8))[0]):
            iid = struct.unpack("<i", f.read(4))[0]
            q, t = struct.unpack("<4d", f.read(32)), struct.unpack("<3d", f.read(24))
            cid = struct.unpack("<i", f.read(4))[0]
            name = b""
            while (ch := f.read(1)) != b"\0":
                name += ch
            n2d = struct.unpack("<Q", f.read(8))[0]
            f.read(24 * n2d)
            ims[name.decode()] = {"camera": cid, "q": np.array(q), "t": np.array(t)}
    with open(sparse / "points3D.bin", "rb") as f:
        for _ in range(struct.unpack("<Q", f.read(8))[0]):
            pid, x, y, z, r, g, b, err = struct.unpack("<Q3d3Bd", f.read(43))
            f.read(8 * struct.unpack("<Q", f.read(8))[0])
            pts.append((x, y, z, r, g, b))
    return {"cameras": cams, "images": ims, "points": np.array(pts)}


def run_opensplat(binary: Path, project: Path, steps: int, out_ply: Path, log: Path, cpu: bool = True,
                  seconds: float | None = None, save_every: int = 100) -> dict:
    """Train with OpenSplat on ``project``; returns the wall time, the command and, with ``seconds``, its
    snapshots. ``--keep-crs`` keeps our coordinates, so its PLY renders from our cameras.

    ``seconds``: stop it after that long (SIGTERM) if it has not finished, having saved a snapshot
    (``<out>_<step>.ply``) every ``save_every`` steps: what its run holds at a given time, e.g. the time splatflow
    took. The snapshots are returned as ``(seconds since the start, step, path)``, the time being the file's
    modification time (the save's end)."""
    cmd = [str(binary), str(project), "-n", str(int(steps)), "-o", str(out_ply), "--keep-crs"]
    if cpu:
        cmd.append("--cpu")
    if seconds is not None:
        cmd += ["-s", str(int(save_every))]
    out_ply = Path(out_ply)
    for old in out_ply.parent.glob(f"{out_ply.stem}_*{out_ply.suffix}"):
        old.unlink()
    t0, wall0 = time.perf_counter(), time.time()
    stopped = False
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        try:
            p.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            stopped = True
            p.terminate()
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    wall = time.perf_counter() - t0
    snapshots = sorted((round(q.stat().st_mtime - wall0, 1), int(q.stem.rsplit("_", 1)[1]), str(q))
                       for q in out_ply.parent.glob(f"{out_ply.stem}_*{out_ply.suffix}")
                       if q.stem.rsplit("_", 1)[1].isdigit())
    if not stopped and (p.returncode != 0 or not out_ply.exists()):
        tail = Path(log).read_text()[-1500:]
        raise RuntimeError(f"{binary} failed ({p.returncode}); its log {log}:\n{tail}")
    if stopped and not snapshots:
        raise RuntimeError(f"{binary} saved no snapshot in {seconds:.0f} s (every {save_every} steps); its log {log}")
    return {"wall_seconds": round(wall, 1), "command": " ".join(cmd), "stopped_at_seconds": stopped,
            "snapshots": snapshots}


def evaluate_ply(ply: Path, scene, evaluate_cfg) -> dict:
    """Test PSNR/SSIM/LPIPS of an Inria-layout PLY on ``scene``'s test views (our evaluator, our protocol)."""
    import torch

    from splatflow.evaluation.evaluate import evaluate
    from splatflow.formats.ply import read_ply
    from splatflow.gaussians.model import Splats

    splats, deg = read_ply(ply)
    model = Splats.of({k: torch.as_tensor(np.asarray(v), dtype=torch.float32) for k, v in splats.items()})
    summary, _ = evaluate(model, deg, scene.test_views, evaluate_cfg, renders_dir=None, progress=False)
    return {k: summary.get(k) for k in ("psnr", "ssim", "lpips_alex", "lpips_vgg", "gaussians")}
