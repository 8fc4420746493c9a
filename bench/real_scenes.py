"""Benchmark: real photos (the Strecha scenes) through all seven stages at ``downscale: 4`` with the default params.

Every scene folder under ``--data`` (default ``../shared/data/strecha``: fountain-P11, entry-P10, 3072x2048 JPEGs
with ground-truth cameras in ``gt_dense_cameras/``) becomes a throw-away project under ``--work`` (this
checkout's ``splatflow`` linked, ``stages/`` and ``params.yaml`` copied, ``base.resolution.downscale`` set), and
each stage runs as ``python -m stages.<name> <scene>``, exactly what ``dvc repro`` runs, one process per stage,
so each stage's ``peak_rss_mb`` is its own. Printed per scene: registered images, camera-centre error against the
ground truth, test PSNR/SSIM (evaluate.json), Gaussians after training and after pruning, export sizes, seconds
and peak memory per stage, and the machine's load average before and after.

Hold-out: ``--test-name fountain-P11=0005.jpg`` (the default for that scene) makes that view the only test view,
the view a C++ CPU trainer was measured on (23.4 dB at 767x510 after 8.6 min). With ``split.test_names`` in
``splatflow.config.SplitConfig`` it is set there; on a checkout without it the bench rewrites ``split.json``
after the split stage (the same names, recorded as ``"split": "local"`` in the output). Other scenes use the
standard every-8th split.

Target: fountain-P11 at downscale 4 with test view 0005.jpg at >= 25.4 dB with <= 9 minutes of training.

    python bench/real_scenes.py [--data DIR] [--work DIR] [--steps N] [--prune-steps N] [--start-at STAGE]
                                [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("ingest", "sfm", "split", "train", "prune", "evaluate", "export")
DEFAULT_TEST_NAMES = {"fountain-P11": ["0005.jpg"]}


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def has_test_names() -> bool:
    sys.path.insert(0, str(ROOT))
    from splatflow.config import SplitConfig

    return "test_names" in {f.name for f in dataclasses.fields(SplitConfig)}


def make_project(work: Path, scene: str, scene_dir: Path, downscale: int, steps: int | None,
                 prune_steps: int | None, test_names: list[str] | None, native_test_names: bool,
                 keep: bool = False, prune_phases: int | None = None) -> Path:
    """The scene's project under ``work`` (replaced, unless ``keep``: then only params.yaml is rewritten)."""
    proj = work / scene
    if not keep:
        if proj.exists():
            shutil.rmtree(proj)
        proj.mkdir(parents=True)
        (proj / "splatflow").symlink_to(ROOT / "splatflow", target_is_directory=True)  # numba's cache stays shared
        shutil.copytree(ROOT / "stages", proj / "stages", ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy(ROOT / "dvc.yaml", proj / "dvc.yaml")
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    gt = scene_dir / "gt_dense_cameras"
    params["base"]["scenes"] = {scene: {"source": str((scene_dir / "images").resolve()),
                                        **({"ground_truth": str(gt.resolve())} if gt.is_dir() else {})}}
    params["base"].setdefault("resolution", {})["downscale"] = downscale
    if steps is not None:
        params["train"]["max_steps"] = steps
    if prune_steps is not None:
        params["prune"]["finetune_steps"] = prune_steps
    if prune_phases is not None:
        params["prune"]["phases"] = prune_phases  # 0: the prune stage copies the trained model (still measured)
    if test_names and native_test_names:
        params["split"]["test_names"] = list(test_names)
    (proj / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return proj


def local_test_names(proj: Path, scene: str, names: list[str]) -> None:
    """Make ``names`` the test views in ``data/S/split.json`` (for a checkout without ``split.test_names``)."""
    path = proj / "data" / scene / "split.json"
    split = json.loads(path.read_text())
    every = sorted(split["train"] + split["test"])
    missing = [n for n in names if n not in every]
    if missing:
        raise SystemExit(f"{scene}: test view(s) {missing} were not registered by SfM")
    split = {"train": [n for n in every if n not in names], "test": sorted(names),
             "rule": f"named test views {sorted(names)} (set by bench/real_scenes.py)"}
    path.write_text(json.dumps(split, indent=1) + "\n")


def run_stage(proj: Path, scene: str, stage: str, log_dir: Path) -> dict:
    env = os.environ.copy()
    env.update({"OMP_WAIT_POLICY": "PASSIVE", "SPLATFLOW_TRACKING": "off", "PYTHONPATH": str(proj)})
    log = log_dir / f"{scene}.{stage}.log"
    t0 = time.perf_counter()
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(log, "w") as f:
        p = subprocess.run([sys.executable, "-m", f"stages.{stage}", scene], cwd=proj, env=env, stdout=f,
                           stderr=subprocess.STDOUT)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    # CPU seconds of the stage process (all threads): on a loaded machine, cpu / threads estimates the wall time
    # the stage would take on 2 free cores (a lower bound: contention also slows each CPU second)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    if p.returncode != 0:
        tail = log.read_text()[-3000:]
        raise SystemExit(f"{scene}: stage {stage} failed ({p.returncode}); log {log}:\n{tail}")
    metrics = json.loads((proj / "metrics" / scene / f"{stage}.json").read_text())
    print(f"[{scene}] {stage}: {wall:.1f} s ({cpu:.1f} CPU-s), peak {metrics.get('peak_rss_mb')} MiB  "
          f"(load {load_average()})", flush=True)
    record = {"wall_seconds": round(wall, 1), "cpu_seconds": round(cpu, 1), "load_after": load_average(),
              "metrics": metrics}
    (proj / f"bench.{stage}.json").write_text(json.dumps(record, indent=1) + "\n")  # for --start-at
    return record


def summarise(scene: str, stages: dict, split_mode: str) -> dict:
    m = {k: v["metrics"] for k, v in stages.items()}
    ev, sfm, tr, pr, ex = m["evaluate"], m["sfm"], m["train"], m["prune"], m["export"]
    return {
        "scene": scene,
        "registered": f"{sfm.get('images_registered')}/{sfm.get('images_total')}",
        "camera_center_error_rel": sfm.get("camera_center_error_rel"),
        "resolution": ev["protocol"].get("resolution"),
        "split": split_mode,
        "test_views": ev["test_views"],
        "psnr": ev["psnr"], "ssim": ev["ssim"],
        "lpips": {k: ev.get(k) for k in ("lpips_vgg_01", "lpips_vgg", "lpips_alex")},
        "gaussians_train": tr["gaussians"], "gaussians": ev["gaussians"],
        "train_steps": tr["steps"], "train_stopped": tr["stopped"], "train_seconds": tr["train_seconds"],
        "export_mb": {k: v["size_mb"] for k, v in ex["files"].items()},
        "stage_seconds": {k: v["wall_seconds"] for k, v in stages.items()},
        "stage_cpu_seconds": {k: v["cpu_seconds"] for k, v in stages.items()},
        "train_it_per_s": tr["it_per_s"],
        "peak_rss_mb": {k: v["metrics"].get("peak_rss_mb") for k, v in stages.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default=os.environ.get("SPLATFLOW_STRECHA_DIR",
                                                     str(ROOT.parent / "shared" / "data" / "strecha")),
                    help="scene folders (default: $SPLATFLOW_STRECHA_DIR or ../shared/data/strecha)")
    ap.add_argument("--work", default="/tmp/splatflow-real-scenes", help="projects go here (replaced per scene)")
    ap.add_argument("--scenes", nargs="*", help="subset of the scene folders (default: all)")
    ap.add_argument("--downscale", type=int, default=4)
    ap.add_argument("--steps", type=int, help="train.max_steps (default: params.yaml's)")
    ap.add_argument("--prune-steps", type=int, help="prune.finetune_steps (default: params.yaml's)")
    ap.add_argument("--prune-phases", type=int, help="prune.phases (0: no pruning; default: params.yaml's)")
    ap.add_argument("--test-name", action="append", default=[], metavar="SCENE=NAME",
                    help="a named test view (repeatable); default fountain-P11=0005.jpg")
    ap.add_argument("--renders", default=str(ROOT / "bench" / "renders"),
                    help="copy each test view's render | ground truth | error PNG here as JPEG ('' = no copy)")
    ap.add_argument("--start-at", choices=STAGES, default=STAGES[0],
                    help="keep the projects in --work and rerun from this stage (e.g. prune with other "
                         "--prune-steps); earlier stages' figures are read from their bench.<stage>.json")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    data = Path(args.data)
    if not data.is_dir():
        raise SystemExit(f"{data}: no Strecha data here; pass --data DIR (scene folders with images/)")
    scenes = sorted(p.name for p in data.iterdir() if (p / "images").is_dir())
    if args.scenes:
        unknown = sorted(set(args.scenes) - set(scenes))
        if unknown:
            raise SystemExit(f"unknown scene(s) {unknown}; found {scenes}")
        scenes = [s for s in scenes if s in args.scenes]
    given: dict[str, list[str]] = {}
    for item in args.test_name:
        scene, _, name = item.partition("=")
        if not name:
            raise SystemExit(f"--test-name {item!r}: expected SCENE=NAME, e.g. fountain-P11=0005.jpg")
        given.setdefault(scene, []).append(name)
    test_names = {**DEFAULT_TEST_NAMES, **given}  # names given for a scene replace its default
    native = has_test_names()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    started = {"load_average": load_average(), "time": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
               "cpus": os.cpu_count()}
    print(f"real scenes {scenes} at downscale {args.downscale}; load {started['load_average']} on "
          f"{started['cpus']} CPUs; split.test_names {'in the config' if native else 'local (split.json rewritten)'}",
          flush=True)
    results = []
    for scene in scenes:
        names = test_names.get(scene)
        keep = args.start_at != STAGES[0]
        proj = make_project(work, scene, data / scene, args.downscale, args.steps, args.prune_steps, names, native,
                            keep=keep, prune_phases=args.prune_phases)
        stages = {}
        for stage in STAGES:
            if STAGES.index(stage) < STAGES.index(args.start_at):  # measured by an earlier run of this bench
                rec = proj / f"bench.{stage}.json"
                if not rec.exists():
                    raise SystemExit(f"--start-at {args.start_at}: {rec} is missing; run the earlier stages first")
                stages[stage] = json.loads(rec.read_text())
                continue
            stages[stage] = run_stage(proj, scene, stage, work)
            if stage == "split" and names and not native:
                local_test_names(proj, scene, names)
        split_mode = ("every 8th (standard)" if not names else
                      f"test_names {names} ({'split.test_names' if native else 'local: split.json rewritten'})")
        res = summarise(scene, stages, split_mode)
        if args.renders:
            res["renders"] = copy_renders(proj / "data" / scene / "renders", Path(args.renders), scene)
        results.append(res)
        print_result(res)
    out = {"started": started, "finished": {"load_average": load_average(),
                                            "time": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())},
           "downscale": args.downscale, "steps": args.steps, "prune_steps": args.prune_steps,
           "prune_phases": args.prune_phases, "start_at": args.start_at, "scenes": results}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.json}")


def copy_renders(src: Path, dst: Path, scene: str) -> list[str]:
    from PIL import Image

    dst.mkdir(parents=True, exist_ok=True)
    out = []
    for p in sorted(src.glob("*.png")):
        target = dst / f"{scene}_{p.stem}.jpg"
        with Image.open(p) as im:
            im.convert("RGB").save(target, "JPEG", quality=90)
        try:
            out.append(str(target.relative_to(ROOT)))
        except ValueError:
            out.append(str(target))
    return out


def print_result(r: dict) -> None:
    res = r["resolution"] or {}
    print(f"\n== {r['scene']}: registered {r['registered']}, centre error {r['camera_center_error_rel']}, "
          f"{', '.join(res.get('sizes', []))} from {res.get('image_source')}")
    print(f"   split {r['split']}: {r['test_views']} test view(s): PSNR {r['psnr']:.2f} dB, SSIM {r['ssim']:.4f}")
    print(f"   Gaussians {r['gaussians_train']} trained -> {r['gaussians']} pruned; train {r['train_steps']} steps "
          f"({r['train_stopped']}) in {r['train_seconds']:.0f} s; export "
          + ", ".join(f"{k} {v:.2f} MB" for k, v in r["export_mb"].items()))
    print("   stage   " + " ".join(f"{s:>9}" for s in STAGES))
    print("   seconds " + " ".join(f"{r['stage_seconds'][s]:>9.1f}" for s in STAGES))
    print("   CPU-s   " + " ".join(f"{r['stage_cpu_seconds'][s]:>9.1f}" for s in STAGES))
    print("   peakMiB " + " ".join(f"{(r['peak_rss_mb'][s] or 0):>9.0f}" for s in STAGES))
    if r.get("renders"):
        print("   renders " + ", ".join(r["renders"]))
    print(flush=True)


if __name__ == "__main__":
    main()
