"""Prepare the real captures of the quality suite from downloaded copies of their public repositories.

Each recipe takes the folder of a downloaded copy (a checkout, or a bare git snapshot: the files are then read
from its newest commit with ``git archive``) and writes ``OUT/<scene>/`` in the layout ``bench/real_scenes.py``
reads: ``images/`` (or ``video.<ext>``) and ``scene.json`` (source, licence, kind, the size the recipe brought the
photos to, and a published figure where the field reports one). Nothing is modified in the source copy; nothing
is downloaded.

    python bench/prepare_scene.py bonsai   PATH [--out DIR]   # github.com/EricXu23/Bonsaidownload
    python bench/prepare_scene.py plush    PATH [--out DIR]   # github.com/noname0310/snowmiku2023plush-splat
    python bench/prepare_scene.py video    PATH --file REL [--name NAME] [--licence TEXT] [--out DIR]
    python bench/prepare_scene.py strecha  PATH [--out DIR]   # a folder with fountain-P11/ and entry-P10/

``--out`` defaults to ``$SPLATFLOW_SUITE_DIR`` or ``../suite`` next to this checkout (outside the repository:
the photos of some scenes may not be redistributed).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JPEG_SUFFIXES = (".jpg", ".jpeg")


def is_bare_git(path: Path) -> bool:
    return (path / "HEAD").is_file() and (path / "objects").is_dir()


def list_files(src: Path) -> list[str]:
    """Every file of the copy, as paths relative to its root (the newest commit for a bare snapshot)."""
    if is_bare_git(src):
        out = subprocess.run(["git", "--git-dir", str(src), "ls-tree", "-r", "--name-only", "HEAD"],
                             check=True, capture_output=True, text=True).stdout
        return [line for line in out.splitlines() if line]
    return sorted(str(p.relative_to(src)) for p in src.rglob("*") if p.is_file() and ".git" not in p.parts)


def read_bytes(src: Path, rel: str) -> bytes:
    if is_bare_git(src):
        return subprocess.run(["git", "--git-dir", str(src), "show", f"HEAD:{rel}"], check=True,
                              capture_output=True).stdout
    return (src / rel).read_bytes()


def commit_of(src: Path) -> str | None:
    git = ["git", "--git-dir", str(src)] if is_bare_git(src) else ["git", "-C", str(src)]
    r = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else None


def export_files(src: Path, rels: list[str], dst: Path) -> None:
    """Copy ``rels`` flat into ``dst`` (one ``git archive`` for a bare snapshot: much faster than one show each)."""
    dst.mkdir(parents=True, exist_ok=True)
    if is_bare_git(src):
        data = subprocess.run(["git", "--git-dir", str(src), "archive", "--format=tar", "HEAD", "--", *rels],
                              check=True, capture_output=True).stdout
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            for member in tar.getmembers():
                if member.isfile():
                    f = tar.extractfile(member)
                    (dst / Path(member.name).name).write_bytes(f.read())
        return
    for rel in rels:
        shutil.copy2(src / rel, dst / Path(rel).name)


def resized_jpegs(src: Path, rels: list[str], dst: Path, max_side: int, quality: int = 95) -> tuple[int, int]:
    """Decode each photo, apply its EXIF orientation to the pixels, bring its long side to ``max_side`` (area
    filter, as the field's dataset scripts do), write a JPEG without EXIF. Returns the last size written."""
    from PIL import Image, ImageOps

    dst.mkdir(parents=True, exist_ok=True)
    size = (0, 0)
    for i, rel in enumerate(rels, 1):
        with Image.open(io.BytesIO(read_bytes(src, rel))) as im:
            im = ImageOps.exif_transpose(im).convert("RGB")
            scale = max_side / max(im.size)
            if scale < 1:
                im = im.resize((round(im.width * scale), round(im.height * scale)), Image.Resampling.BOX)
            im.save(dst / (Path(rel).stem + ".jpg"), "JPEG", quality=quality)
            size = im.size
        print(f"\r  {i}/{len(rels)} photos", end="", flush=True)
    print()
    return size


def write_meta(out: Path, meta: dict) -> None:
    (out / "scene.json").write_text(json.dumps(meta, indent=1) + "\n")
    n = len(list((out / "images").glob("*"))) if (out / "images").is_dir() else 0
    print(f"{out}: {meta['kind']}, {n} photos" + (f", {meta.get('video')}" if meta.get("video") else ""))


def fresh(out: Path) -> Path:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    return out


def prep_bonsai(src: Path, out_root: Path, args) -> None:
    """The Mip-NeRF 360 'bonsai' capture as published in EricXu23/Bonsaidownload: 252 photos at 800x533 at the
    repository's root (a subset of the dataset's 292, brought to 800 px wide by the uploader)."""
    rels = sorted(r for r in list_files(src) if "/" not in r and r.lower().endswith(JPEG_SUFFIXES))
    if len(rels) < 150:
        raise SystemExit(f"{src}: expected the bonsai photos at the root of the copy, found {len(rels)} JPEGs")
    out = fresh(out_root / "bonsai")
    export_files(src, rels, out / "images")
    write_meta(out, {
        "scene": "bonsai", "kind": "object-centred 360° capture, indoor (Mip-NeRF 360 'bonsai')",
        "source": "https://github.com/EricXu23/Bonsaidownload", "commit": commit_of(src),
        "licence": "none stated in the repository; the photos are the Mip-NeRF 360 dataset's (Barron et al., "
                   "CVPR 2022), published for research: not redistributed here",
        "photos": len(rels), "size": "800x533 as published",
        "published": {"psnr": 32.0, "what": "about 32 dB: what the field's 3DGS trainers (Kerbl et al. 2023, "
                      "gsplat) report on bonsai at a comparable size after 30K steps on a GPU"},
    })


def prep_plush(src: Path, out_root: Path, args) -> None:
    """A phone's photos walking around a plush toy on a desk (noname0310/snowmiku2023plush-splat, MIT): the
    ``input/`` photos at 4000x3000 brought to a long side of ``--max-side`` (default 1000)."""
    rels = sorted(r for r in list_files(src) if r.startswith("input/") and r.lower().endswith(JPEG_SUFFIXES))
    if len(rels) < 30:
        raise SystemExit(f"{src}: expected the phone photos under input/, found {len(rels)}")
    out = fresh(out_root / "plush")
    size = resized_jpegs(src, rels, out / "images", args.max_side)
    write_meta(out, {
        "scene": "plush", "kind": "object-centred handheld phone capture (photos)",
        "source": "https://github.com/noname0310/snowmiku2023plush-splat", "commit": commit_of(src),
        "licence": "MIT (the repository's LICENSE)", "photos": len(rels),
        "size": f"{size[0]}x{size[1]} (long side {args.max_side} from 4000x3000, area filter)",
    })


def prep_video(src: Path, out_root: Path, args) -> None:
    """A phone video: the file copied as it is; splatflow's ingest picks the frames."""
    if not args.file:
        raise SystemExit("video: --file REL (the video's path inside the copy) is required")
    if args.file not in set(list_files(src)):
        raise SystemExit(f"{src}: no file {args.file}")
    out = fresh(out_root / args.name)
    target = out / ("video" + Path(args.file).suffix.lower())
    target.write_bytes(read_bytes(src, args.file))
    write_meta(out, {"scene": args.name, "kind": "handheld phone video", "video": target.name,
                     "source": args.source or str(src), "commit": commit_of(src), "file": args.file,
                     "licence": args.licence or "not recorded: pass --licence"})


def prep_strecha(src: Path, out_root: Path, args) -> None:
    """The Strecha scenes (fountain-P11, entry-P10: 3072x2048 with ground-truth cameras), linked, not copied."""
    found = [p for p in sorted(src.iterdir()) if (p / "images").is_dir()] if src.is_dir() else []
    if not found:
        raise SystemExit(f"{src}: no scene folders with images/ (expected fountain-P11/, entry-P10/)")
    for scene in found:
        out = fresh(out_root / scene.name)
        (out / "images").symlink_to(scene.resolve() / "images", target_is_directory=True)
        gt = scene / "gt_dense_cameras"
        if gt.is_dir():
            (out / "ground_truth").symlink_to(gt.resolve(), target_is_directory=True)
        write_meta(out, {"scene": scene.name, "kind": "a few wide-baseline photos of a facade (Strecha et al. 2008)",
                         "source": "Strecha multi-view benchmark (EPFL), ../shared/data/strecha",
                         "licence": "research use (the benchmark's terms): not redistributed here",
                         "downscale": 4, "test_names": ["0005.jpg"] if scene.name == "fountain-P11" else None})


RECIPES = {"bonsai": prep_bonsai, "plush": prep_plush, "video": prep_video, "strecha": prep_strecha}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe", choices=sorted(RECIPES))
    ap.add_argument("path", help="the downloaded copy (checkout or bare git snapshot) or, for strecha, its folder")
    ap.add_argument("--out", default=os.environ.get("SPLATFLOW_SUITE_DIR", str(ROOT.parent / "suite")))
    ap.add_argument("--max-side", type=int, default=1000, help="plush: long side of the prepared photos")
    ap.add_argument("--file", help="video: the video's path inside the copy")
    ap.add_argument("--name", default="video", help="video: the scene's name")
    ap.add_argument("--source", help="video: where the copy came from (recorded in scene.json)")
    ap.add_argument("--licence", help="video: the licence of the video (recorded in scene.json)")
    args = ap.parse_args()
    src = Path(args.path)
    if not src.exists():
        raise SystemExit(f"{src}: no such folder")
    RECIPES[args.recipe](src, Path(args.out), args)


if __name__ == "__main__":
    sys.exit(main())
