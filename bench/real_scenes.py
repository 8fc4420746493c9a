"""Benchmark: the real-capture quality suite through the real stages, with the default params.

Every scene folder under ``--suite`` (made by ``bench/prepare_scene.py`` from downloaded copies of public
repositories: ``images/`` or ``video.*``, and ``scene.json`` with the source and licence) becomes a throw-away
project under ``--work`` (this checkout's ``splatflow`` linked, ``stages/``, ``dvc.yaml`` and ``params.yaml``
copied), and each stage runs as ``python -m stages.<name> <scene>``, exactly what ``dvc repro`` runs, one process
per stage, so each stage's ``peak_rss_mb`` is its own. Printed per scene: registered images, the SfM model's
fitness, test PSNR/SSIM/LPIPS (every 8th view unless the scene names its test views), Gaussians, train time, peak
memory, and with ``--curve`` test PSNR at several points of the same run (the training checkpoints copied as they
are written, evaluated after the run so the curve costs the run nothing but the checkpoint writes).

The Strecha scenes keep their earlier protocol: ``downscale: 4`` and, for fountain-P11, the single test view
``0005.jpg`` (the view a C++ CPU trainer was measured on).

    python bench/real_scenes.py [--suite DIR] [--scenes S ...] [--set KEY=VALUE ...] [--curve N]
                                [--start-at STAGE] [--tag NAME] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

from splatflow.pipeline import records
from splatflow.pipeline.paths import ScenePaths

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("settings", "ingest", "sfm", "split", "train", "prune", "evaluate", "export")


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def set_key(params: dict, dotted: str, value) -> None:
    """``train.densify.max_gaussians=400000`` into the params dict (the value parsed as YAML)."""
    node = params
    *parents, leaf = dotted.split(".")
    for k in parents:
        if not isinstance(node.get(k), dict):
            raise SystemExit(f"--set {dotted}: params.yaml has no section {k!r} there")
        node = node[k]
    node[leaf] = value


def make_project(work: Path, scene_dir: Path, meta: dict, overrides: list[tuple[str, object]],
                 keep: bool = False) -> Path:
    """The scene's project under ``work`` (replaced, unless ``keep``: then only params.yaml is rewritten)."""
    scene = scene_dir.name
    proj = work / scene
    if not keep:
        if proj.exists():
            shutil.rmtree(proj)
        proj.mkdir(parents=True)
        (proj / "splatflow").symlink_to(ROOT / "splatflow", target_is_directory=True)  # numba's cache stays shared
    shutil.rmtree(proj / "stages", ignore_errors=True)  # this checkout's stages, also for --start-at
    shutil.copytree(ROOT / "stages", proj / "stages", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "dvc.yaml", proj / "dvc.yaml")
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    videos = sorted(scene_dir.glob("video.*"))
    source = videos[0] if videos else scene_dir / "images"
    entry = {"source": str(source.resolve())}
    if (scene_dir / "ground_truth").is_dir():
        entry["ground_truth"] = str((scene_dir / "ground_truth").resolve())
    params["base"]["scenes"] = {scene: entry}
    if meta.get("downscale"):
        params["base"].setdefault("resolution", {})["downscale"] = meta["downscale"]
    if meta.get("test_names"):
        params["split"]["test_names"] = list(meta["test_names"])
    for key, value in overrides:
        set_key(params, key, value)
    (proj / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return proj


class CheckpointCopier:
    """Copies the training checkpoint each time the train stage rewrites it (for the quality-vs-time curve)."""

    def __init__(self, ckpt: Path, dest: Path):
        self.ckpt, self.dest = ckpt, dest
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        dest.mkdir(parents=True, exist_ok=True)

    def _run(self) -> None:
        seen = None
        while not self.stop.wait(1.0):
            try:
                st = self.ckpt.stat()
            except FileNotFoundError:
                continue
            if (st.st_mtime_ns, st.st_size) != seen and time.time() - st.st_mtime > 0.5:
                seen = (st.st_mtime_ns, st.st_size)
                shutil.copy(self.ckpt, self.dest / f"ckpt_{len(list(self.dest.iterdir())):03d}.pt")

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def run_stage(proj: Path, scene: str, stage: str, log_dir: Path, curve_dir: Path | None = None) -> dict:
    env = os.environ.copy()
    env.update({"OMP_WAIT_POLICY": "PASSIVE", "SPLATFLOW_TRACKING": "off", "PYTHONPATH": str(proj)})
    log = log_dir / f"{scene}.{stage}.log"
    t0 = time.perf_counter()
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(log, "w") as f:
        cmd = [sys.executable, "-m", f"stages.{stage}", scene]
        if curve_dir is not None:
            with CheckpointCopier(proj / "models" / scene / "train" / "ckpt.pt", curve_dir):
                p = subprocess.run(cmd, cwd=proj, env=env, stdout=f, stderr=subprocess.STDOUT)
        else:
            p = subprocess.run(cmd, cwd=proj, env=env, stdout=f, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    # CPU seconds of the stage process (all threads): on a loaded machine, cpu / threads estimates the wall time
    # the stage would take on 2 free cores (a lower bound: contention also slows each CPU second)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    if p.returncode != 0:
        tail = log.read_text()[-3000:]
        raise SystemExit(f"{scene}: stage {stage} failed ({p.returncode}); log {log}:\n{tail}")
    metrics = records.read(ScenePaths(scene, proj), stage)  # numbers and texts (metrics/S/info/<stage>.json)
    print(f"[{scene}] {stage}: {wall:.1f} s ({cpu:.1f} CPU-s), peak {metrics.get('peak_rss_mb')} MiB  "
          f"(load {load_average()})", flush=True)
    record = {"wall_seconds": round(wall, 1), "cpu_seconds": round(cpu, 1), "load_after": load_average(),
              "metrics": metrics}
    (proj / f"bench.{stage}.json").write_text(json.dumps(record, indent=1) + "\n")  # for --start-at
    return record


def evaluate_curve(proj: Path, scene: str, curve_dir: Path) -> list[dict]:
    """Test PSNR/SSIM of every copied checkpoint (LPIPS off: the curve is for the shape, the end has LPIPS)."""
    return evaluate_checkpoints(proj, scene, sorted(curve_dir.glob("ckpt_*.pt")))


def evaluate_checkpoints(proj: Path, scene: str, ckpts: list[Path]) -> list[dict]:
    """Test PSNR/SSIM of each checkpoint on the scene's test views (our evaluator, LPIPS off)."""
    if not ckpts:
        return []
    code = f"""
import dataclasses, json, sys, torch
from pathlib import Path
from splatflow.pipeline.config import load_params
from splatflow.pipeline.paths import ScenePaths
from splatflow.scene.resolution import load_working_scene
from splatflow.evaluation.evaluate import evaluate
from splatflow.gaussians.model import load_checkpoint, load_splats
params = load_params('params.yaml').for_scene({scene!r})
paths = ScenePaths({scene!r})
scene, _ = load_working_scene(params, paths)
cfg = dataclasses.replace(params.evaluate, lpips_variants=[], save_renders=False)
out = []
for p in {[str(c) for c in ckpts]!r}:
    p = Path(p)
    ck = load_checkpoint(p)
    splats, deg = load_splats(p)
    s, _ = evaluate(splats, deg, scene.test_views, cfg, renders_dir=None, progress=False)
    out.append({{'step': ck['step'], 'train_seconds': round(ck.get('elapsed_seconds') or 0.0, 1), 'gaussians': s['gaussians'],
                'psnr': s['psnr'], 'ssim': s['ssim']}})
    print(json.dumps(out[-1]), flush=True)
"""
    env = os.environ.copy()
    env.update({"OMP_WAIT_POLICY": "PASSIVE", "SPLATFLOW_TRACKING": "off", "PYTHONPATH": str(proj)})
    p = subprocess.run([sys.executable, "-c", code], cwd=proj, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        print(f"[{scene}] curve failed:\n{p.stderr[-2000:]}", flush=True)
        return []
    return [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]


def sfm_fitness(sfm: dict) -> dict:
    keys = ("reprojection_error_px", "mean_track_length", "points", "fitness")
    return {k: sfm.get(k) for k in keys if k in sfm}


def summarise(scene: str, meta: dict, stages: dict) -> dict:
    m = {k: v["metrics"] for k, v in stages.items()}
    ev, sfm, tr, ex = m["evaluate"], m["sfm"], m["train"], m["export"]
    return {
        "scene": scene,
        "kind": meta.get("kind"), "source": meta.get("source"), "licence": meta.get("licence"),
        "published_psnr": (meta.get("published") or {}).get("psnr"),
        "registered": f"{sfm.get('images_registered')}/{sfm.get('images_total')}",
        "sfm": sfm_fitness(sfm),
        "camera_center_error_rel": sfm.get("camera_center_error_rel"),
        "resolution": ev["protocol"].get("resolution"),
        "split": ev["protocol"].get("split_rule"),
        "test_views": ev["test_views"],
        "psnr": ev["psnr"], "ssim": ev["ssim"],
        "lpips": {k: ev.get(k) for k in ("lpips_vgg_01", "lpips_vgg", "lpips_alex")},
        "gaussians_train": tr["gaussians"], "gaussians": ev["gaussians"],
        "train_steps": tr["steps"], "train_stopped": tr["stopped"], "train_seconds": tr["train_seconds"],
        "plan": tr.get("plan"),
        "prune_during": tr.get("prune_during"),
        "export_mb": {k: v["size_mb"] for k, v in ex["files"].items()},
        "stage_seconds": {k: v["wall_seconds"] for k, v in stages.items()},
        "stage_cpu_seconds": {k: v["cpu_seconds"] for k, v in stages.items()},
        "train_it_per_s": tr["it_per_s"],
        "peak_rss_mb": {k: v["metrics"].get("peak_rss_mb") for k, v in stages.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", default=os.environ.get("SPLATFLOW_SUITE_DIR", str(ROOT.parent / "suite")),
                    help="prepared scene folders (bench/prepare_scene.py; default $SPLATFLOW_SUITE_DIR or ../suite)")
    ap.add_argument("--work", default="/tmp/splatflow-real-scenes", help="projects go here (replaced per scene)")
    ap.add_argument("--scenes", nargs="*", help="subset of the scene folders (default: all)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a params.yaml value for every scene, e.g. train.max_steps=15000 (repeatable; YAML value)")
    ap.add_argument("--curve", action="store_true",
                    help="test PSNR at each training checkpoint of the run (train.checkpoint_every apart)")
    ap.add_argument("--renders", default=str(ROOT / "bench" / "renders"),
                    help="copy up to 3 test views' render | ground truth | error PNG here as JPEG ('' = no copy)")
    ap.add_argument("--tag", default="", help="a name for this run's renders and records (e.g. 'default')")
    ap.add_argument("--start-at", choices=STAGES, default=STAGES[0],
                    help="keep the projects in --work and rerun from this stage (e.g. train with other --set); "
                         "earlier stages' figures are read from their bench.<stage>.json")
    ap.add_argument("--peer-opensplat", metavar="PATH",
                    help="an OpenSplat binary you built (its --cpu build): trained on the same training views, "
                         "cameras, points and size, scored on the same test views (bench/peers.py)")
    ap.add_argument("--peer-steps", type=int, help="OpenSplat's steps (default: the steps splatflow's plan ran)")
    ap.add_argument("--peer-times", type=float, nargs="+", metavar="X",
                    help="at equal time instead of to the end: stop OpenSplat at the largest X times splatflow's "
                         "training time and score its last snapshot before each X (e.g. 1 2 4)")
    ap.add_argument("--peer-save-every", type=int, default=100, help="with --peer-times: OpenSplat's snapshot "
                                                                     "interval in steps")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    if args.peer_opensplat and not Path(args.peer_opensplat).is_file():
        raise SystemExit(f"--peer-opensplat {args.peer_opensplat}: no such file; give the path of the opensplat "
                         "binary you built (github.com/pierotofy/OpenSplat, its CPU build)")

    suite = Path(args.suite)
    if not suite.is_dir():
        raise SystemExit(f"{suite}: no prepared scenes here; make them with bench/prepare_scene.py or pass --suite")
    scenes = sorted(p.name for p in suite.iterdir() if (p / "scene.json").is_file())
    if args.scenes:
        unknown = sorted(set(args.scenes) - set(scenes))
        if unknown:
            raise SystemExit(f"unknown scene(s) {unknown}; found {scenes} in {suite}")
        scenes = [s for s in args.scenes]
    overrides = []
    for item in args.set:
        key, eq, value = item.partition("=")
        if not eq:
            raise SystemExit(f"--set {item!r}: expected KEY=VALUE, e.g. train.max_steps=15000")
        overrides.append((key, yaml.safe_load(value)))
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.start_at != STAGES[0]:  # every scene's earlier stages before any work, not after the first scene's hour
        missing = [str(work / scene / f"bench.{stage}.json") for scene in scenes
                   for stage in STAGES[:STAGES.index(args.start_at)]
                   if not (work / scene / f"bench.{stage}.json").exists()]
        if missing:
            raise SystemExit(f"--start-at {args.start_at}: {missing[0]} is missing ({len(missing)} record(s) in all); "
                             "run the earlier stages of those scenes first, or leave them out of --scenes")
    started = {"load_average": load_average(), "time": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
               "cpus": os.cpu_count(), "commit": git_commit(), "set": args.set}
    print(f"real scenes {scenes}; load {started['load_average']} on {started['cpus']} CPUs; "
          f"commit {started['commit']}; set {args.set or 'nothing'}", flush=True)
    results = []
    for scene in scenes:
        meta = json.loads((suite / scene / "scene.json").read_text())
        keep = args.start_at != STAGES[0]
        proj = make_project(work, suite / scene, meta, overrides, keep=keep)
        stages = {}
        curve_dir = proj / "curve"
        for stage in STAGES:
            if STAGES.index(stage) < STAGES.index(args.start_at):  # measured by an earlier run of this bench
                rec = proj / f"bench.{stage}.json"
                if not rec.exists():
                    raise SystemExit(f"--start-at {args.start_at}: {rec} is missing; run the earlier stages first")
                stages[stage] = json.loads(rec.read_text())
                continue
            if stage == "train" and args.curve:
                shutil.rmtree(curve_dir, ignore_errors=True)
            stages[stage] = run_stage(proj, scene, stage, work,
                                      curve_dir if (stage == "train" and args.curve) else None)
        res = summarise(scene, meta, stages)
        if res["gaussians"] != res["gaussians_train"]:  # the prune stage cut the model: score the uncut one too
            whole = evaluate_checkpoints(proj, scene, [proj / "models" / scene / "train" / "ckpt.pt"])
            res["unpruned"] = whole[0] if whole else None
        if args.curve:
            res["curve"] = evaluate_curve(proj, scene, curve_dir)
        if args.peer_opensplat:
            res["peer_opensplat"] = run_peer(proj, scene, Path(args.peer_opensplat),
                                             args.peer_steps or res["train_steps"], work,
                                             times=args.peer_times, train_seconds=res["train_seconds"],
                                             save_every=args.peer_save_every)
        if args.renders:
            res["renders"] = copy_renders(proj / "data" / scene / "renders", Path(args.renders),
                                          f"{scene}{'_' + args.tag if args.tag else ''}")
        results.append(res)
        print_result(res)
    out = {"started": started, "finished": {"load_average": load_average(),
                                            "time": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())},
           "start_at": args.start_at, "tag": args.tag, "scenes": results}
    print_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.json}")


def run_peer(proj: Path, scene: str, binary: Path, steps: int, log_dir: Path, times=None,
             train_seconds: float | None = None, save_every: int = 100) -> dict:
    """OpenSplat on the scene's training views at the working size; its PLY scored on the same test views. With
    ``times`` (multiples of splatflow's ``train_seconds``) it runs until the largest and its last snapshot before
    each is scored: ``marks``."""
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "bench"))
    import dataclasses

    from peers import evaluate_ply, run_opensplat, write_colmap_project

    from splatflow.pipeline.config import load_params
    from splatflow.pipeline.paths import ScenePaths
    from splatflow.scene.resolution import load_working_scene

    params = load_params(proj / "params.yaml").for_scene(scene)
    data, _ = load_working_scene(params, ScenePaths(scene, proj))
    project = write_colmap_project(data, proj / "peer_opensplat")
    limit = max(times) * train_seconds if times else None
    print(f"[{scene}] OpenSplat: {len(data.train_views)} training views in {project}, {steps} steps"
          + (f", stopped after {limit:.0f} s" if limit else "") + " ...", flush=True)
    ran = run_opensplat(binary, project, steps, project / "splat.ply", log_dir / f"{scene}.opensplat.log",
                        seconds=limit, save_every=save_every)
    cfg = dataclasses.replace(params.evaluate, save_renders=False)
    if not times:
        scores = evaluate_ply(project / "splat.ply", data, cfg)
        print(f"[{scene}] OpenSplat: {ran['wall_seconds']:.0f} s, PSNR {scores['psnr']:.2f} dB, SSIM "
              f"{scores['ssim']:.4f}, {scores['gaussians']} Gaussians", flush=True)
        return {**ran, **scores, "steps": steps}
    marks = []
    for x in sorted(times):
        before = [s for s in ran["snapshots"] if s[0] <= x * train_seconds]
        if not before:
            print(f"[{scene}] OpenSplat: no snapshot within {x:g}x splatflow's time", flush=True)
            continue
        at, step, path = before[-1]
        scores = evaluate_ply(Path(path), data, cfg)
        marks.append({"times": x, "seconds": at, "step": step, **scores})
        print(f"[{scene}] OpenSplat at {x:g}x splatflow's training time ({at:.0f} s): step {step}, PSNR "
              f"{scores['psnr']:.2f} dB, SSIM {scores['ssim']:.4f}, {scores['gaussians']} Gaussians", flush=True)
    last = marks[-1] if marks else {}
    return {**ran, **{k: last.get(k) for k in ("psnr", "ssim", "lpips_alex", "lpips_vgg", "gaussians")},
            "steps": last.get("step"), "planned_steps": steps, "marks": marks}


def git_commit() -> str:
    r = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return r.stdout.strip() + ("+changes" if dirty else "")


def copy_renders(src: Path, dst: Path, name: str, limit: int = 3) -> list[str]:
    from PIL import Image

    dst.mkdir(parents=True, exist_ok=True)
    out = []
    for p in sorted(src.glob("*.png"))[:limit]:
        target = dst / f"{name}_{p.stem}.jpg"
        with Image.open(p) as im:
            im = im.convert("RGB")
            if im.width > 1800:
                im = im.resize((1800, round(im.height * 1800 / im.width)))
            im.save(target, "JPEG", quality=85)
        try:
            out.append(str(target.relative_to(ROOT)))
        except ValueError:
            out.append(str(target))
    return out


def _lp(r: dict) -> str:
    v = (r.get("lpips") or {}).get("lpips_alex")
    return "n/a" if v is None else f"{v:.3f}"


def print_result(r: dict) -> None:
    res = r["resolution"] or {}
    print(f"\n== {r['scene']} ({r['kind']}): registered {r['registered']}, SfM {r['sfm']}, "
          f"{', '.join(res.get('sizes', []))} from {res.get('image_source')}")
    print(f"   {r['test_views']} test view(s): PSNR {r['psnr']:.2f} dB, SSIM {r['ssim']:.4f}, LPIPS(alex) {_lp(r)}")
    print(f"   Gaussians {r['gaussians_train']} trained -> {r['gaussians']} evaluated; train {r['train_steps']} steps "
          f"({r['train_stopped']}) in {r['train_seconds']:.0f} s; plan {r.get('plan')}")
    print("   stage   " + " ".join(f"{s:>9}" for s in STAGES))
    print("   seconds " + " ".join(f"{r['stage_seconds'][s]:>9.1f}" for s in STAGES))
    print("   CPU-s   " + " ".join(f"{r['stage_cpu_seconds'][s]:>9.1f}" for s in STAGES))
    print("   peakMiB " + " ".join(f"{(r['peak_rss_mb'][s] or 0):>9.0f}" for s in STAGES))
    if r.get("unpruned"):
        u = r["unpruned"]
        print(f"   unpruned (train stage's model): PSNR {u['psnr']:.2f} dB, SSIM {u['ssim']:.4f}, {u['gaussians']} "
              f"Gaussians -> pruned {r['psnr'] - u['psnr']:+.2f} dB with {r['gaussians'] / u['gaussians']:.0%} "
              "of them")
    for c in r.get("curve") or []:
        print(f"   curve: step {c['step']:>6}  {c['train_seconds']:>7.1f} s  {c['gaussians']:>7} G  "
              f"PSNR {c['psnr']:.2f}  SSIM {c['ssim']:.4f}")
    if r.get("renders"):
        print("   renders " + ", ".join(r["renders"]))
    print(flush=True)


def print_table(results: list[dict]) -> None:
    print("| scene | registered | test PSNR / SSIM / LPIPS(alex) | Gaussians | unpruned PSNR (Gaussians) | steps | "
          "train s | train CPU-s | peak train MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        u = r.get("unpruned")
        unp = f"{u['psnr']:.2f} ({u['gaussians']:,})" if u else "(not pruned)"
        print(f"| {r['scene']} | {r['registered']} | {r['psnr']:.2f} / {r['ssim']:.3f} / {_lp(r)} | {r['gaussians']:,} | "
              f"{unp} | {r['train_steps']} | {r['train_seconds']:.0f} | {r['stage_cpu_seconds']['train']:.0f} | "
              f"{r['peak_rss_mb'].get('train') or 0:.0f} |")
        peer = r.get("peer_opensplat")
        for m in (peer.get("marks") or [peer]) if peer else []:
            lp = "n/a" if m.get("lpips_alex") is None else f"{m['lpips_alex']:.3f}"
            when = f" at {m['times']:g}x the time" if "times" in m else ""
            print(f"| {r['scene']}: OpenSplat (--cpu){when} | same views | {m['psnr']:.2f} / {m['ssim']:.3f} / {lp} | "
                  f"{m['gaussians']:,} | | {m.get('step', m.get('steps'))} | {m.get('seconds', peer['wall_seconds']):.0f} | | |")
    if results and not any(r.get("peer_opensplat") for r in results):
        print("(no peer row: pass --peer-opensplat PATH, an OpenSplat binary you built, to train it on the same "
              "views and score it on the same test views)")


if __name__ == "__main__":
    main()
