"""Pack what ``bench/gpu_check.sh`` needs on a GPU machine that has torch and CUDA but no package registry.

A lent GPU machine (or a cluster node without internet) has python3 with torch, numba, numpy, scipy, OpenCV,
Triton, torchmetrics and torchvision, but none of splatflow's other needs nor the peer's. This script writes one
folder, the *kit*, that travels beside the repository; ``KIT=<folder> bash bench/gpu_check.sh`` installs from it
before anything runs. It holds:

* ``site.tar.xz``: the wheels unpacked (a wheel is a zip of its files, so unpacking it installs it) and packed
  with xz (pycolmap's 38 MB wheel packs to about 21 MB): gsplat (without glm's docs and tests, which it never
  reads), pycolmap, and what gsplat's ``examples/simple_trainer.py`` imports that such a machine lacks (tyro,
  viser, nerfview and their small dependencies, splines among them).
* ``gsplat/``: ``examples/`` of a gsplat checkout (the peer's script and its dataset parser; run, never copied
  into the repository).
* ``fused-ssim/``: the fused-ssim sources (simple_trainer's SSIM loss), built for the machine's GPU there.
* ``peer-site/pycolmap``: the old pycolmap with ``SceneManager`` that simple_trainer's parser imports (it shadows
  the real pycolmap in the peer's process only: ``peer-python`` puts it first), with its one NumPy-1-only line
  (``np.uint64(-1)``) written so that NumPy 2 accepts it.
* ``hub/checkpoints/alexnet-owt-7be5be79.pth``: a *placeholder* of torchvision's AlexNet checkpoint (every
  tensor zero, stored as one broadcast element). simple_trainer builds torchmetrics' LPIPS at start, which would
  download ImageNet weights; without a network it stops. With the placeholder it starts, its LPIPS figures are
  meaningless and ``bench/gpu.py --peer-drop-lpips`` discards them (splatflow's own LPIPS is n/a there too
  unless ``splatflow weights fetch`` ran on a machine with a network and its cache travels).
* ``scene/``: a real capture's undistorted COLMAP folder at ``--max-side`` pixels (JPEG, quality 95) with a
  compact PINHOLE model (poses, intrinsics scaled to the new size, the SfM points without their tracks).

    python bench/gpu_kit.py --gsplat GSPLAT_CHECKOUT --fused-ssim FUSED_SSIM_CHECKOUT \\
        --pycolmap-fork RMBRUALLA_PYCOLMAP_CHECKOUT --nerfview NERFVIEW_CHECKOUT \\
        --scene data/<scene>/undistorted [--max-side 512] [--out .gpukit]

The checkouts are the ones gsplat's ``examples/requirements.txt`` pins (fused-ssim 328dc98, pycolmap cc7ea4b,
nerfview 4538024) and gsplat at the tag of the gsplat wheel (v1.5.3). The wheels come from PyPI (``pip download``
for CPython 3.12 on manylinux x86-64, the GPU machine's interpreter; ``--python-version`` to change).
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# what the GPU machine lacks: splatflow's (gsplat, pycolmap) and the peer's (tyro, viser, nerfview's needs)
WHEELS = ["gsplat==1.5.3", "pycolmap==4.2.1", "tyro==0.9.32", "docstring-parser", "typeguard", "shtab",
          "viser==1.1.1", "msgspec", "trimesh", "websockets<16", "zstandard", "splines"]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64", "manylinux_2_5_x86_64", "any"]
FUSED_SSIM_FILES = ("setup.py", "ext.cpp", "ssim.cu", "ssim.h", "fused_ssim")
ALEXNET = "alexnet-owt-7be5be79.pth"


def download_wheels(dest: Path, python_version: str) -> list[Path]:
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
           python_version, "--implementation", "cp", "-d", str(dest)]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    subprocess.run(cmd + WHEELS, check=True)
    return sorted(dest.glob("*.whl"))


def skip_member(name: str) -> bool:
    """gsplat's wheel carries glm's docs and tests, which its build never reads."""
    return "/glm/doc/" in name or "/glm/test/" in name


def pack_site(wheels: list[Path], nerfview: Path, out: Path) -> None:
    """Every wheel's files and the ``nerfview`` package, in one xz tar rooted at the site folder."""
    with tarfile.open(out, "w:xz", preset=6) as tar:
        for whl in wheels:
            with zipfile.ZipFile(whl) as z:
                for info in z.infolist():
                    if info.is_dir() or skip_member(info.filename):
                        continue
                    data = z.read(info)
                    ti = tarfile.TarInfo(info.filename)
                    ti.size = len(data)
                    ti.mode = 0o755 if info.filename.endswith(".so") or ".so." in info.filename else 0o644
                    tar.addfile(ti, io.BytesIO(data))
        tar.add(nerfview / "nerfview", arcname="nerfview")


def numpy2_fix(path: Path) -> None:
    """The fork's one line that NumPy 2 refuses (``np.uint64(-1)``, the invalid point id) written as the same
    value NumPy 2 accepts; GPU machines' images carry NumPy 2, and the fork pins no NumPy."""
    text = path.read_text()
    if "np.uint64(-1)" in text:
        path.write_text(text.replace("np.uint64(-1)", "np.uint64(np.iinfo(np.uint64).max)"))


def placeholder_alexnet(path: Path) -> None:
    """torchvision's AlexNet state dict with every tensor zero, each stored as one broadcast element."""
    import torch

    shapes = {"features.0": (64, 3, 11, 11), "features.3": (192, 64, 5, 5), "features.6": (384, 192, 3, 3),
              "features.8": (256, 384, 3, 3), "features.10": (256, 256, 3, 3), "classifier.1": (4096, 9216),
              "classifier.4": (4096, 4096), "classifier.6": (1000, 4096)}
    sd = {}
    for name, shape in shapes.items():
        sd[f"{name}.weight"] = torch.zeros(1).expand(*shape)
        sd[f"{name}.bias"] = torch.zeros(1).expand(shape[0])
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(sd, path)


def travel_scene(src: Path, out: Path, max_side: int) -> dict:
    """``src`` (an undistorted COLMAP folder) at ``max_side`` px: JPEGs and a compact PINHOLE model."""
    import cv2
    import numpy as np

    from bench.peer_gsplat import write_colmap_binary
    from splatflow.scene.dataset import load_scene

    scene = load_scene(src)
    views = []
    (out / "images").mkdir(parents=True, exist_ok=True)
    for v in scene.views:
        img = cv2.imread(str(v.image_path), cv2.IMREAD_COLOR)
        if img is None:
            raise SystemExit(f"{v.image_path}: unreadable image; re-run the pipeline's sfm stage for {src}")
        w, h = int(v.width), int(v.height)  # the model's size (the file may be larger: resized below either way)
        s = min(1.0, max_side / max(h, w))
        nw, nh = max(1, round(w * s)), max(1, round(h * s))
        if img.shape[:2] != (nh, nw):
            img = cv2.resize(img, (nw, nh), interpolation=cv2.INTER_AREA)
        name = Path(v.name).with_suffix(".jpg").name
        cv2.imwrite(str(out / "images" / name), img, [cv2.IMWRITE_JPEG_QUALITY, 95])
        K = np.asarray(v.K, dtype=np.float64).copy()
        K[0, :] *= nw / w
        K[1, :] *= nh / h
        views.append(dataclasses.replace(v, name=name, width=nw, height=nh, K=K))
    write_colmap_binary(out / "sparse" / "0", views, scene.points, scene.colors, png_names=False)
    return {"views": len(views), "points": int(len(scene.points)), "size": f"{views[0].width}x{views[0].height}"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gsplat", type=Path, required=True, help="a gsplat checkout at v1.5.3 (holding examples/)")
    ap.add_argument("--fused-ssim", type=Path, required=True, help="a rahul-goel/fused-ssim checkout")
    ap.add_argument("--pycolmap-fork", type=Path, required=True, help="a rmbrualla/pycolmap checkout")
    ap.add_argument("--nerfview", type=Path, required=True, help="a nerfstudio-project/nerfview checkout")
    ap.add_argument("--scene", type=Path, required=True, help="an undistorted COLMAP folder (data/S/undistorted)")
    ap.add_argument("--max-side", type=int, default=512)
    ap.add_argument("--out", type=Path, default=ROOT / ".gpukit")
    ap.add_argument("--python-version", default="3.12")
    ap.add_argument("--wheels", type=Path, help="wheels already downloaded (default: pip download into OUT/whl)")
    a = ap.parse_args(argv)

    for flag, path, must in (("--gsplat", a.gsplat, "examples/simple_trainer.py"),
                             ("--fused-ssim", a.fused_ssim, "ssim.cu"),
                             ("--pycolmap-fork", a.pycolmap_fork, "pycolmap/scene_manager.py"),
                             ("--nerfview", a.nerfview, "nerfview/__init__.py"),
                             ("--scene", a.scene, "images")):
        if not (path / must).exists():
            raise SystemExit(f"{flag} {path}: no {must} there; pass the folder of that checkout or scene")
    out = a.out
    out.mkdir(parents=True, exist_ok=True)
    wheels = sorted(a.wheels.glob("*.whl")) if a.wheels else download_wheels(out / "whl", a.python_version)
    print(f"{len(wheels)} wheels: {', '.join(w.name.split('-')[0] for w in wheels)}", flush=True)
    pack_site(wheels, a.nerfview, out / "site.tar.xz")
    print(f"site.tar.xz: {(out / 'site.tar.xz').stat().st_size / 2**20:.1f} MiB", flush=True)
    shutil.rmtree(out / "whl", ignore_errors=True)
    for sub in ("gsplat", "fused-ssim", "peer-site", "scene"):
        shutil.rmtree(out / sub, ignore_errors=True)
    shutil.copytree(a.gsplat / "examples", out / "gsplat" / "examples",
                    ignore=shutil.ignore_patterns("*.md", "benchmarks", "assets", "results"))
    (out / "fused-ssim").mkdir(parents=True)
    for f in FUSED_SSIM_FILES:
        src = a.fused_ssim / f
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, out / "fused-ssim" / f)
    shutil.copytree(a.pycolmap_fork / "pycolmap", out / "peer-site" / "pycolmap")
    numpy2_fix(out / "peer-site" / "pycolmap" / "scene_manager.py")
    placeholder_alexnet(out / "hub" / "checkpoints" / ALEXNET)
    info = travel_scene(a.scene, out / "scene", a.max_side)
    print(f"scene: {info['views']} views at {info['size']}, {info['points']} points", flush=True)
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"kit {out}: {total / 2**20:.1f} MiB", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
