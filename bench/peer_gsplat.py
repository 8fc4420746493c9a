"""The peer for ``bench/gpu.py --peer-gsplat PATH``: gsplat's own ``examples/simple_trainer.py``, run from a
user's gsplat checkout (an external program: nothing of it is copied here) on the same scene as splatflow.

What makes the two runs comparable, and how:

* **Same pixels.** simple_trainer's COLMAP parser reads ``DATA/images/`` and ``DATA/sparse/0/`` and, with
  ``--data_factor 1``, uses the images as they are (with a larger factor it would resize JPEGs itself, with PIL).
  :func:`write_peer_dataset` writes every view at splatflow's working size as a lossless PNG (the pixels
  splatflow trains and evaluates on, :func:`splatflow.scene.resolution.read_view_rgb`) and a binary PINHOLE
  model with those sizes and intrinsics, the poses and the SfM points: the peer runs at factor 1.
* **Same split.** simple_trainer sorts the model's image names and holds out index % ``test_every`` == 0: the
  standard protocol splatflow's split stage uses. The PNG names are the original names with their suffix
  replaced; :func:`peer_test_names` applies the peer's rule and the dataset writer refuses a scene where renaming
  would change which views are held out.
* **Time.** simple_trainer writes ``stats/val_stepNNNN.json`` (test PSNR/SSIM/LPIPS; its ``ellipse_time`` is
  render time per image, not training time) at ``--eval_steps`` and ``stats/train_stepNNNN_rank0.json``
  (``ellipse_time``: seconds since training started, evaluations included) at ``--save_steps``. Asking for both at
  the same steps gives one training time per evaluation; the time each evaluation (and checkpoint save) took is
  the gap between the two files' modification times, subtracted from every later point
  (:func:`read_peer_curve`). splatflow's curve leaves its evaluations out the same way.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

PEER_SCRIPT = Path("examples") / "simple_trainer.py"
PEER_PARSER = Path("examples") / "datasets" / "colmap.py"
# what simple_trainer.py imports beyond torch and gsplat (its examples/requirements.txt installs them);
# its pycolmap is an older fork with SceneManager, not the pycolmap package splatflow uses
PEER_MODULES = ("tyro", "viser", "nerfview", "fused_ssim", "torchmetrics", "imageio", "yaml", "gsplat")
PINHOLE = 1  # COLMAP camera model id


class PeerError(ValueError):
    """A bad ``--peer-gsplat`` checkout, peer interpreter or scene: the message names it and the fix."""


# ------------------------------------------------------------------------------------------ the checkout
def check_checkout(path: str | Path) -> Path:
    """``path`` resolved, when it is a gsplat checkout with ``examples/simple_trainer.py`` and its COLMAP parser."""
    root = Path(path).expanduser().resolve()
    if not root.is_dir():
        raise PeerError(f"--peer-gsplat {path}: no such folder; pass the root of a gsplat git checkout "
                        "(a clone of the nerfstudio-project/gsplat repository)")
    for rel in (PEER_SCRIPT, PEER_PARSER):
        if not (root / rel).is_file():
            raise PeerError(f"--peer-gsplat {path}: {rel} is missing; pass the root of a gsplat checkout (the folder "
                            "holding examples/), at a release whose simple_trainer.py reads COLMAP data (v1.5.x)")
    return root


def missing_modules(python: str, modules=PEER_MODULES) -> list[str]:
    """The ``modules`` (and pycolmap's ``SceneManager``) that ``python`` cannot import, checked in a subprocess."""
    code = ("import importlib, json, sys\nbad = []\n"
            f"for m in {list(modules)!r}:\n"
            "    try:\n        importlib.import_module(m)\n    except Exception:\n        bad.append(m)\n"
            "try:\n    from pycolmap import SceneManager  # noqa: F401\n"
            "except Exception:\n    bad.append('pycolmap.SceneManager')\n"
            "print(json.dumps(bad))\n")
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300)
    except FileNotFoundError:
        raise PeerError(f"--peer-python {python}: no such interpreter; pass the python of the environment where "
                        "gsplat's examples/requirements.txt is installed") from None
    if out.returncode != 0:
        raise PeerError(f"--peer-python {python} failed to start ({out.stderr.strip().splitlines()[-1:]}); pass "
                        "a working interpreter")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------ the dataset
def peer_name(name: str) -> str:
    """The PNG name a view gets in the peer's dataset."""
    return str(Path(name).with_suffix(".png"))


def peer_test_names(names, test_every: int = 8) -> list[str]:
    """The names simple_trainer holds out: sorted, index % ``test_every`` == 0."""
    ordered = sorted(names)
    return [n for i, n in enumerate(ordered) if i % test_every == 0]


def _rotmat_to_qvec(R: np.ndarray) -> np.ndarray:
    """Unit quaternion (w, x, y, z) of a rotation matrix, w >= 0 (COLMAP's convention)."""
    t = np.trace(R)
    if t > 0:
        s = 2.0 * math.sqrt(1.0 + t)
        q = np.array([0.25 * s, (R[2, 1] - R[1, 2]) / s, (R[0, 2] - R[2, 0]) / s, (R[1, 0] - R[0, 1]) / s])
    elif R[0, 0] > R[1, 1] and R[0, 0] > R[2, 2]:
        s = 2.0 * math.sqrt(1.0 + R[0, 0] - R[1, 1] - R[2, 2])
        q = np.array([(R[2, 1] - R[1, 2]) / s, 0.25 * s, (R[0, 1] + R[1, 0]) / s, (R[0, 2] + R[2, 0]) / s])
    elif R[1, 1] > R[2, 2]:
        s = 2.0 * math.sqrt(1.0 + R[1, 1] - R[0, 0] - R[2, 2])
        q = np.array([(R[0, 2] - R[2, 0]) / s, (R[0, 1] + R[1, 0]) / s, 0.25 * s, (R[1, 2] + R[2, 1]) / s])
    else:
        s = 2.0 * math.sqrt(1.0 + R[2, 2] - R[0, 0] - R[1, 1])
        q = np.array([(R[1, 0] - R[0, 1]) / s, (R[0, 2] + R[2, 0]) / s, (R[1, 2] + R[2, 1]) / s, 0.25 * s])
    q = q / np.linalg.norm(q)
    return -q if q[0] < 0 else q


def write_colmap_binary(model_dir: Path, views, points: np.ndarray, colors: np.ndarray,
                        png_names: bool = True) -> None:
    """``cameras.bin``, ``images.bin``, ``points3D.bin`` (COLMAP's binary layout): one PINHOLE camera per view
    (its size and ``K``), the view's world-to-camera pose, no 2D observations; the points with empty tracks.
    Images are named as in the peer's dataset (``png_names``) or by the views' own names."""
    model_dir.mkdir(parents=True, exist_ok=True)
    with open(model_dir / "cameras.bin", "wb") as f:
        f.write(struct.pack("<Q", len(views)))
        for cid, v in enumerate(views, start=1):
            K = np.asarray(v.K, dtype=np.float64)
            f.write(struct.pack("<iiQQ", cid, PINHOLE, int(v.width), int(v.height)))
            f.write(struct.pack("<4d", K[0, 0], K[1, 1], K[0, 2], K[1, 2]))
    with open(model_dir / "images.bin", "wb") as f:
        f.write(struct.pack("<Q", len(views)))
        for iid, v in enumerate(views, start=1):
            w2c = np.asarray(v.world_to_cam, dtype=np.float64)
            f.write(struct.pack("<i", iid))
            f.write(struct.pack("<7d", *_rotmat_to_qvec(w2c[:3, :3]), *w2c[:3, 3]))
            f.write(struct.pack("<i", iid))
            f.write((peer_name(v.name) if png_names else v.name).encode() + b"\x00")
            f.write(struct.pack("<Q", 0))  # no 2D points
    pts = np.asarray(points, dtype=np.float64).reshape(-1, 3)
    rgb = np.asarray(colors, dtype=np.uint8).reshape(-1, 3)
    with open(model_dir / "points3D.bin", "wb") as f:
        f.write(struct.pack("<Q", len(pts)))
        for pid, (p, c) in enumerate(zip(pts, rgb), start=1):
            f.write(struct.pack("<Q3d3Bd", pid, *p, *c, 0.0))
            f.write(struct.pack("<Q", 0))  # empty track


def write_peer_dataset(scene, out: Path, test_every: int = 8, write: bool = True) -> dict:
    """simple_trainer's dataset for ``scene`` (a ``SceneData`` at the working size, split into train and test)
    in ``out``: ``images/*.png`` and ``sparse/0/``. Returns ``{"images", "test", "sizes"}``. Refuses (PeerError)
    a scene whose test views are not the ones the peer's rule would hold out after the renaming. ``write=False``
    checks and describes the dataset without writing it (a call that trains only splatflow's side)."""
    import cv2

    from splatflow.scene.resolution import read_view_rgb

    views = sorted(scene.views, key=lambda v: v.name)
    names = [peer_name(v.name) for v in views]
    if len(set(names)) != len(names):
        raise PeerError(f"{out}: two views would get the same PNG name ({sorted(names)}); rename the photos so "
                        "their names differ in more than the suffix")
    ours = sorted(peer_name(v.name) for v in scene.test_views)
    theirs = peer_test_names(names, test_every)
    if ours != sorted(theirs):
        raise PeerError(f"the scene's test views {ours[:4]}... are not the ones simple_trainer holds out (every "
                        f"{test_every}th sorted name: {theirs[:4]}...); split the scene with the every_nth rule "
                        f"(split.rule: every_nth, every_n: {test_every}) for the comparison")
    info = {"images": len(views), "test": theirs, "sizes": sorted({f"{v.width}x{v.height}" for v in views})}
    if not write:
        return info
    img_dir = out / "images"
    img_dir.mkdir(parents=True, exist_ok=True)
    for v, n in zip(views, names):
        rgb = read_view_rgb(v)  # [H, W, 3] uint8: the pixels splatflow trains and evaluates on
        if not cv2.imwrite(str(img_dir / n), cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR)):
            raise PeerError(f"{img_dir / n}: could not write the image; check the disk and the folder's permissions")
    write_colmap_binary(out / "sparse" / "0", views, scene.points, scene.colors)
    return info


# ------------------------------------------------------------------------------------------ the run
def peer_command(root: Path, python: str, data_dir: Path, result_dir: Path, max_steps: int,
                 eval_steps: list[int], test_every: int = 8, extra: list[str] = ()) -> list[str]:
    """simple_trainer's command line: the ``default`` config (3DGS densification), our dataset at factor 1, no
    viewer or video, evaluations and stats at ``eval_steps`` (1-based step counts, as its options are)."""
    steps = [str(int(s)) for s in eval_steps]
    return [python, str(root / PEER_SCRIPT), "default", "--data_dir", str(data_dir), "--data_factor", "1",
            "--result_dir", str(result_dir), "--test_every", str(test_every), "--max_steps", str(int(max_steps)),
            "--disable_viewer", "--disable_video", "--eval_steps", *steps, "--save_steps", *steps, *extra]


def run_peer(cmd: list[str], cwd: Path, result_dir: Path, log_path: Path, timeout_s: float) -> int:
    """Run the peer, its output to ``log_path``, printing each evaluation as its stats file appears."""
    stats = result_dir / "stats"
    seen: set[str] = set()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
        t0 = time.monotonic()
        while True:
            try:
                rc = proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                rc = None
            for p in sorted(stats.glob("val_step*.json")) if stats.is_dir() else []:
                if p.name not in seen:
                    seen.add(p.name)
                    try:
                        s = json.loads(p.read_text())
                        print(f"  peer {p.stem}: PSNR {s.get('psnr', float('nan')):.2f} dB, "
                              f"{s.get('num_GS', '?')} Gaussians", flush=True)
                    except (OSError, ValueError):
                        seen.discard(p.name)  # still being written
            if rc is not None:
                return rc
            if time.monotonic() - t0 > timeout_s:
                proc.kill()
                proc.wait()
                return -9


_VAL = re.compile(r"val_step(\d+)\.json$")


def read_peer_curve(result_dir: Path) -> list[dict]:
    """simple_trainer's test curve from ``result_dir/stats``: ``[{step, seconds, psnr, ssim, lpips, gaussians}]``
    in step order, ``step`` counted from 1 and ``seconds`` the training time before that evaluation (see the
    module docstring). PeerError naming the file when one is missing or unreadable."""
    stats = Path(result_dir) / "stats"
    vals = sorted(((int(m.group(1)), p) for p in stats.glob("val_step*.json") if (m := _VAL.search(p.name))),
                  key=lambda x: x[0])
    if not vals:
        raise PeerError(f"{stats}: no val_step*.json; simple_trainer evaluated nothing (see its log next to it)")
    curve, overhead = [], 0.0
    for step0, vpath in vals:  # simple_trainer names files by its 0-based step
        tpath = stats / f"train_step{step0:04d}_rank0.json"
        try:
            val, tr = json.loads(vpath.read_text()), json.loads(tpath.read_text())
            elapsed = float(tr["ellipse_time"])
            psnr = float(val["psnr"])
        except (OSError, ValueError, KeyError) as e:
            raise PeerError(f"{tpath if not tpath.exists() else vpath}: unreadable or missing ({e}); run the peer "
                            "with the same --eval_steps and --save_steps (peer_command does)") from None
        curve.append({"step": step0 + 1, "seconds": round(elapsed - overhead, 3), "psnr": psnr,
                      "ssim": _num(val.get("ssim")), "lpips": _num(val.get("lpips")),
                      "gaussians": int(val.get("num_GS", tr.get("num_GS", 0)))})
        overhead += max(0.0, vpath.stat().st_mtime - tpath.stat().st_mtime)  # this checkpoint save + evaluation
    return curve


def _num(x):
    return None if x is None else float(x)


# ------------------------------------------------------------------------------------------ the comparison
def time_to_psnr(curve: list[dict], psnr: float) -> float | None:
    """Training seconds at which ``curve`` first reaches ``psnr`` (linear between its points, from (0 s, the first
    point's PSNR) when the first point already reaches it); None when it never does."""
    prev_t, prev_p = 0.0, None
    for pt in curve:
        t, p = float(pt["seconds"]), float(pt["psnr"])
        if p >= psnr:
            if prev_p is None or prev_p >= p:
                return t
            return prev_t + (t - prev_t) * (psnr - prev_p) / (p - prev_p)
        prev_t, prev_p = t, p
    return None


def compare(ours: list[dict], peer: list[dict]) -> dict:
    """The figures the issue asks for: splatflow's time to the peer's final PSNR over the peer's time to it, the
    same at the highest PSNR both reach, and the final PSNR difference."""
    target = float(peer[-1]["psnr"])
    t_ours, t_peer = time_to_psnr(ours, target), time_to_psnr(peer, target)
    both = min(max(p["psnr"] for p in ours), max(p["psnr"] for p in peer))
    t_ours_b, t_peer_b = time_to_psnr(ours, both), time_to_psnr(peer, both)
    return {
        "peer_final_psnr": round(target, 3), "peer_seconds": round(float(peer[-1]["seconds"]), 2),
        "ours_final_psnr": round(float(ours[-1]["psnr"]), 3), "ours_seconds": round(float(ours[-1]["seconds"]), 2),
        "final_psnr_gain_db": round(float(ours[-1]["psnr"]) - target, 3),
        "ours_seconds_to_peer_final_psnr": None if t_ours is None else round(t_ours, 2),
        "time_ratio_at_peer_final_psnr": None if t_ours is None or not t_peer else round(t_ours / t_peer, 4),
        "highest_common_psnr": round(both, 3),
        "time_ratio_at_highest_common_psnr": None if t_ours_b is None or not t_peer_b else round(t_ours_b / t_peer_b, 4),
    }


def curve_table(name: str, curve: list[dict]) -> str:
    """The curve as aligned text lines."""
    def f(x, d):
        return "n/a" if x is None else f"{x:.{d}f}"

    lines = [f"{name}: step  seconds   PSNR    SSIM   LPIPS  Gaussians"]
    for p in curve:
        lines.append(f"{'':{len(name)}}  {p['step']:>5} {p['seconds']:>8.1f} {f(p['psnr'], 2):>6} "
                     f"{f(p.get('ssim'), 4):>7} {f(p.get('lpips'), 3):>7} {p.get('gaussians', 0):>10}")
    return "\n".join(lines)


def default_python() -> str:
    return os.environ.get("PEER_PYTHON", sys.executable)
