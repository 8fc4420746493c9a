"""Benchmark: the GPU path end to end on the 36-view 800x600 benchmark scene (``bench/train_demo.py``'s).

Trains with the DEFAULT ``train`` params on CUDA (``backend: cuda``: gsplat's kernels, every tensor on the GPU),
then renders the test views on the GPU and prints wall time, steps/s, test PSNR, Gaussians and peak GPU memory
(allocated and reserved). With ``--compare-cpu`` it also runs the first ``--cpu-steps`` steps of the same run on
the CUDA and the CPU backend and prints the steps/s ratio measured in this one run. ``--profile-at STEP`` runs
torch's profiler (CPU and CUDA) over ``--profile-steps`` steps of the run from that step and prints where a step's
time goes: wall time per step, the GPU's busy time, the top operators by host and by GPU time (those steps are in
the run's time; the profiler adds a little). ``--set key=value`` overrides a ``train`` param (as
``bench/train_demo.py``), e.g. to measure GPU-sized settings. On a machine without a GPU it says so and exits 0
without figures (so a CPU-only CI can call it).

``--peer-gsplat PATH`` compares with gsplat's own trainer on the same GPU: ``PATH/examples/simple_trainer.py``
of a user's gsplat checkout (run by ``--peer-python``, the environment where its examples/requirements.txt is
installed) trains ``--peer-steps`` steps on the same scene (``--scene DIR``: an undistorted COLMAP folder with
``images/`` and a PINHOLE ``sparse/`` model, such as a pipeline's ``data/S/undistorted``; default the benchmark
scene), the same split (every 8th name-sorted view held out) and the same pixels (``--max-side``), written for it
by :mod:`bench.peer_gsplat`. Both runs are evaluated on the test views at ``--curve-points`` points (evaluation
time left out of both clocks); the script prints both PSNR/SSIM/LPIPS-vs-time curves and the time ratio at equal
PSNR. Its checks of the checkout and the peer's interpreter run before anything is trained.

    python bench/gpu.py [--work DIR] [--json PATH] [--max-steps N] [--set KEY=VALUE ...] [--compare-cpu]
                        [--cpu-steps 1000] [--profile-at 5210 --profile-steps 40]
                        [--peer-gsplat PATH [--peer-python PY] [--scene DIR] [--max-side PX]
                         [--peer-steps 30000] [--curve-points 8] [--peer-timeout S]
                         [--side ours|peer [--other-json PATH]]]

A lent GPU's calls are short: ``--side ours --json A`` in one call and ``--side peer --json B`` in the next (same
GPU) measure one side each; ``--join A B`` (anywhere) prints the comparison one run of both would
(``--other-json A`` in the second call does it there).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("SPLATFLOW_TRACKING", "off")

T0 = time.monotonic()  # the script's start (--deadline)
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import splatflow  # noqa: E402,F401  (first: its process defaults for OpenMP and numba's cache)
import numpy as np  # noqa: E402
import torch  # noqa: E402


def print_busy_share(prof: dict, args, what: str) -> float:
    """Print the profiled steps' time and the GPU's busy share of it; return that share (3 decimals)."""
    busy = prof["profile_gpu_busy_ms_per_step"] / max(prof["profile_wall_ms_per_step"], 1e-9)
    print(f"profile of {what} {args.profile_at}..{args.profile_at + args.profile_steps - 1}: "
          f"{prof['profile_wall_ms_per_step']} ms per step, GPU busy {prof['profile_gpu_busy_ms_per_step']} ms "
          f"({100 * busy:.0f} % of the step)")
    for site, n in sorted(prof.get("sync_sites", {}).items(), key=lambda kv: -kv[1]):
        print(f"  host waits for the GPU {n:g} times a step at {site}")
    return round(busy, 3)

@torch.no_grad()
def test_psnr_on(splats, sh_degree, views, device) -> list[float]:
    """Per-view test PSNR, rendering on ``device`` (one image pair there at a time)."""
    from splatflow.gaussians.model import Splats, render_view
    from splatflow.scene.pixels import read_rgb

    splats = Splats.of(splats).to(device)
    out = []
    for v in views:
        gt = torch.from_numpy(read_rgb(v.image_path)).to(device).float() / 255.0  # [H, W, 3]
        rgb = render_view(splats, v, sh_degree, "cuda" if device.type == "cuda" else "cpu")  # clamped to [0, 1]
        mse = float(((rgb - gt) ** 2).mean())
        out.append(-10.0 * math.log10(mse))
    return out


def busy_us(spans) -> float:
    """The time covered by the union of ``spans`` ((start, end) pairs, microseconds): a GPU is busy while any of its
    kernels runs, once however many overlap."""
    total, end = 0.0, -math.inf
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


@contextlib.contextmanager
def sync_sites(report: dict, steps: int):
    """Count, by the Python lines that called it, each operation that made the host wait for the GPU (torch's sync
    debug mode, "warn") while the block runs; the counts per step land in ``report["sync_sites"]``."""
    import traceback

    sites = report.setdefault("sync_sites", {})
    show = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return show(message, category, filename, lineno, file, line)
        frames = [f for f in traceback.extract_stack()[:-1]
                  if any(k in f.filename for k in ("splatflow", "gsplat", "bench"))]
        key = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames[-4:]))
        sites[key] = round(sites.get(key, 0) + 1.0 / steps, 2)

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        try:
            yield
        finally:
            warnings.showwarning = show
            if cuda:
                torch.cuda.set_sync_debug_mode("default")


def profile_steps(trainer, at: int, n: int, report: dict, sync_steps: int = 5) -> None:
    """Wrap ``trainer.train_step`` so that steps ``at`` .. ``at + n - 1`` run under torch's profiler; the summary
    lands in ``report`` (wall ms per step, GPU busy ms per step, top operators by self host and self CUDA time)."""
    from torch.profiler import ProfilerActivity, profile

    step_fn, state = trainer.train_step, {}
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])

    def wrapped():
        s = trainer.step
        if cuda and at + n <= s < at + n + sync_steps:  # after the profile: where the host waits for the GPU
            with sync_sites(report, sync_steps):
                return step_fn()
        if s == at:
            sync()
            state["prof"] = profile(activities=acts)
            state["prof"].__enter__()
            state["t0"] = time.perf_counter()
        row = step_fn()
        if s == at + n - 1 and "prof" in state:
            sync()
            wall = time.perf_counter() - state["t0"]
            prof = state.pop("prof")
            prof.__exit__(None, None, None)
            ka = prof.key_averages()
            # the GPU timeline's own events (kernels, copies, fills), not the operators that launched them: an
            # operator's self device time repeats its kernels' (summing both counted _RasterizeToPixelsBackward twice)
            dev_us = busy_us([(e.time_range.start, e.time_range.end) for e in prof.events()
                              if e.device_type != torch.autograd.DeviceType.CPU])
            rows = []
            for key in ("self_cpu_time_total", "self_device_time_total"):
                top = sorted(ka, key=lambda e: getattr(e, key, 0), reverse=True)[:15]
                rows.append([{"op": e.key, "calls_per_step": round(e.count / n, 1),
                              "ms_per_step": round(getattr(e, key, 0) / 1e3 / n, 3)} for e in top])
            report.update(profile_from_step=at, profile_steps=n, profile_wall_ms_per_step=round(wall * 1e3 / n, 2),
                          profile_gpu_busy_ms_per_step=round(dev_us / 1e3 / n, 2),
                          profile_top_host=rows[0], profile_top_gpu=rows[1])
        return row

    trainer.train_step = wrapped


def curve_steps(max_steps: int, points: int) -> list[int]:
    """``points`` step counts (1-based) spread over a run of ``max_steps``, geometric from 1/64 of the run
    (time-to-quality curves rise fastest early, and the time to another trainer's final PSNR falls late), the
    last one ``max_steps``."""
    points = max(1, int(points))
    first = max(1, max_steps // 64) if points > 1 else max_steps
    out = sorted({int(round(first * (max_steps / first) ** (i / max(points - 1, 1)))) for i in range(points)})
    return sorted(set(out[:-1] + [max_steps]))


class CurveRecorder:
    """Evaluates a trainer's model on the test views after the steps in ``at`` (1-based counts) and keeps
    ``{step, seconds, psnr, ssim, lpips, gaussians}``; ``seconds`` is the time since the first step began minus
    the evaluations before (the GPU is synchronised around each, so queued work is counted where it ran)."""

    def __init__(self, trainer, views, at: list[int], lpips=None):
        self.trainer, self.views, self.at, self.lpips = trainer, views, set(at), lpips
        self.points: list[dict] = []
        self.t0: float | None = None
        self.eval_s = 0.0
        step_fn = trainer.train_step

        def wrapped():
            if self.t0 is None:
                self.t0 = time.perf_counter()
            row = step_fn()
            if trainer.step + 1 in self.at:
                self.record(trainer.step + 1)
            return row

        trainer.train_step = wrapped

    @torch.no_grad()
    def record(self, step: int) -> None:
        from splatflow.evaluation.metrics import psnr, ssim
        from splatflow.gaussians.model import render_view
        from splatflow.scene.resolution import read_view_rgb

        tr = self.trainer
        if tr.device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        seconds = t - self.t0 - self.eval_s
        tr.state.flush()
        splats = tr.state.splats().detach()
        deg = tr.sched.sh.degree(step - 1)
        backend = "cuda" if tr.device.type == "cuda" else "cpu"
        ps, ss, ls = [], [], []
        for v in self.views:
            gt = torch.from_numpy(read_view_rgb(v)).to(tr.device).float() / 255.0  # [H, W, 3]
            rgb = render_view(splats, v, deg, backend)  # [H, W, 3] clamped to [0, 1]
            ps.append(psnr(rgb, gt))
            ss.append(ssim(rgb, gt))
            if self.lpips is not None:
                ls.append(self.lpips(rgb.permute(2, 0, 1)[None], gt.permute(2, 0, 1)[None])["lpips_alex"])
        self.points.append({"step": step, "seconds": round(seconds, 3), "psnr": float(np.mean(ps)),
                            "ssim": float(np.mean(ss)),
                            "lpips": float(np.mean(ls)) if ls and None not in ls else None,
                            "gaussians": int(splats.n)})
        p = self.points[-1]  # as it comes: a run stopped by a time limit leaves its curve so far in the log
        print(f"  splatflow step {step}: {p['seconds']:.1f} s, {p['psnr']:.2f} dB, SSIM {p['ssim']:.4f}, "
              f"{p['gaussians']} Gaussians", flush=True)
        if tr.device.type == "cuda":
            torch.cuda.synchronize()
        self.eval_s += time.perf_counter() - t


def load_bench_scene(scene_dir: Path | None, work: Path, threads: int, max_side: int | None):
    """The comparison's scene: ``scene_dir`` (an undistorted COLMAP folder) or the benchmark scene, split every
    8th name-sorted view (simple_trainer's rule), at most ``max_side`` px on its longest side."""
    from bench.train_demo import prepare
    from splatflow.pipeline.config import ResolutionConfig, SplitConfig
    from splatflow.scene.dataset import load_scene
    from splatflow.scene.resolution import apply_resolution
    from splatflow.scene.split import write_split

    if scene_dir is None:
        scene_dir, _, _ = prepare(work, threads)
    split_json = work / "peer_split.json"
    write_split(scene_dir, split_json, SplitConfig(rule="every_nth", every_n=8))
    scene = load_scene(scene_dir, split_json)
    return apply_resolution(scene, ResolutionConfig(max_side_px=max_side, default_max_side_px=1600))


def peer_compare(args, cfg, dev, out: dict) -> None:
    """``--peer-gsplat``: splatflow and simple_trainer on the same scene and GPU; figures into ``out``."""
    from bench import peer_gsplat as pg
    from splatflow.evaluation.lpips import LpipsSet
    from splatflow.train import Trainer

    import shutil

    scene, res_info = load_bench_scene(args.scene, args.work, args.threads, args.max_side)
    data, result = args.work / "peer_data", args.work / "peer_result"
    for d in (data, result):  # an earlier comparison's files would mix into this one's
        shutil.rmtree(d, ignore_errors=True)
    info = pg.write_peer_dataset(scene, data, write=args.side != "ours")  # a call for our side only writes no PNGs
    print(f"comparison scene: {len(scene.train_views)} train / {len(scene.test_views)} test views at "
          f"{', '.join(info['sizes'])} ({res_info['image_source']})"
          + (f"; simple_trainer's dataset in {data}" if args.side != "ours" else ""), flush=True)
    lp = LpipsSet(["lpips_alex"]).to(dev.device)
    lpips = lp if lp.models.get("alex") is not None else None
    if lpips is None:
        print(f"LPIPS (AlexNet, [-1, 1]) for splatflow's curve: n/a, {lp.reason('lpips_alex')}")
    ours, peer, rc, other = None, None, None, {}
    if args.other_json is not None:  # the other side, measured by an earlier call on the same GPU
        other = json.loads(args.other_json.read_text()).get("peer") or {}
    if args.side in ("both", "ours"):
        ckpt = args.work / "peer_ours_ckpt.pt"
        ckpt.unlink(missing_ok=True)
        trainer = Trainer(scene, cfg, ckpt_path=ckpt, seed=0)
        # trainer.cfg: the plan resolved (train.max_steps "auto" is sized from the scene and the GPU)
        rec = CurveRecorder(trainer, scene.test_views, curve_steps(trainer.cfg.max_steps, args.curve_points), lpips)
        prof: dict = {}
        if args.peer_only and args.profile_at is not None:
            profile_steps(trainer, args.profile_at, args.profile_steps, prof)
        res = trainer.run()
        if not rec.points or rec.points[-1]["step"] != res.steps:  # stopped early (plateau): its end is a point too
            rec.record(res.steps)
        ours = rec.points
        print(pg.curve_table("splatflow", ours), flush=True)
        out["ours_plan"] = res.plan
        if prof:
            prof["profile_gpu_busy_share"] = print_busy_share(prof, args, "splatflow's steps")
            out.update(prof)
    if args.side in ("both", "peer"):
        cmd = pg.peer_command(args.peer_root, args.peer_python, data, result, args.peer_steps,
                              curve_steps(args.peer_steps, args.curve_points))
        print(f"running simple_trainer ({args.peer_steps} steps; log {args.work / 'peer.log'}):\n  {' '.join(cmd)}",
              flush=True)
        timeout = args.peer_timeout
        if args.deadline is not None:  # what is left of the whole script's time, less a margin to read and print
            timeout = min(timeout, args.deadline - (time.monotonic() - T0) - 15.0)
            print(f"simple_trainer gets {timeout:.0f} s (--deadline {args.deadline:.0f} s); its curve so far is read "
                  "if it is stopped", flush=True)
        rc = pg.run_peer(cmd, args.peer_root / "examples", result, args.work / "peer.log", max(timeout, 1.0))
        if rc != 0:
            print(f"simple_trainer exited with {rc}: see {args.work / 'peer.log'}; its curve so far, if any:")
        peer = pg.read_peer_curve(result)
        if args.peer_drop_lpips:  # its AlexNet trunk was a placeholder (no ImageNet weights offline): not a figure
            peer = [{**p, "lpips": None} for p in peer]
        print(pg.curve_table("gsplat simple_trainer", peer))
    ours = ours if ours is not None else other.get("ours_curve")
    if peer is None:
        peer, rc = other.get("peer_curve"), other.get("peer_exit")
    out.update(peer={"scene": str(args.scene or "benchmark scene"), "sizes": info["sizes"],
                     "resolution": res_info, "peer_steps": args.peer_steps, "peer_exit": rc, "ours_curve": ours,
                     "peer_curve": peer, "lpips_variant": "lpips_alex (AlexNet, [-1, 1]; gsplat's)",
                     "sides_from": {"ours": "this run" if args.side != "peer" else str(args.other_json),
                                    "peer": "this run" if args.side != "ours" else str(args.other_json)}})
    if not ours or not peer:
        print(f"only {args.side} measured in this run (pass --other-json with the other side's --json to compare)")
        return
    out["peer"].update(print_comparison(ours, peer))


def print_comparison(ours: list[dict], peer: list[dict]) -> dict:
    """Both curves' figures (:func:`bench.peer_gsplat.compare`), printed in one sentence."""
    from bench import peer_gsplat as pg

    cmp = pg.compare(ours, peer)
    print(f"at simple_trainer's final {cmp['peer_final_psnr']:.2f} dB ({cmp['peer_seconds']:.1f} s): splatflow "
          + ("never reached it" if cmp["ours_seconds_to_peer_final_psnr"] is None else
             f"{cmp['ours_seconds_to_peer_final_psnr']:.1f} s, time ratio {cmp['time_ratio_at_peer_final_psnr']}")
          + f"; splatflow ends at {cmp['ours_final_psnr']:.2f} dB ({cmp['final_psnr_gain_db']:+.2f} dB) in "
          f"{cmp['ours_seconds']:.1f} s; at the highest PSNR both reach ({cmp['highest_common_psnr']:.2f} dB) the "
          f"time ratio is {cmp['time_ratio_at_highest_common_psnr']}")
    return cmp


def join(ours_json: Path, peer_json: Path) -> dict:
    """``--join``: one comparison from two ``--side`` runs' JSON files (no GPU needed)."""
    from bench import peer_gsplat as pg

    sides = []
    for path, key in ((ours_json, "ours_curve"), (peer_json, "peer_curve")):
        try:
            curve = (json.loads(Path(path).read_text()).get("peer") or {}).get(key)
        except (OSError, ValueError) as e:
            raise pg.PeerError(f"--join {path}: cannot read it ({e}); pass the --json of a --side run") from None
        if not curve:
            raise pg.PeerError(f"--join {path}: no {key} in it; pass the --json of a --side "
                               f"{key.split('_')[0]} run")
        sides.append(curve)
    print(pg.curve_table("splatflow", sides[0]))
    print(pg.curve_table("gsplat simple_trainer", sides[1]))
    base = json.loads(Path(ours_json).read_text())
    peer_side = json.loads(Path(peer_json).read_text())["peer"]
    base["peer"].update(peer_curve=sides[1], peer_exit=peer_side.get("peer_exit"),
                        sides_from={"ours": str(ours_json), "peer": str(peer_json)},
                        **print_comparison(*sides))
    return base


def _peer_or_exit(args, cfg, dev, out: dict) -> None:
    """:func:`peer_compare`, a bad scene or peer output reported in one line (exit 2) instead of a traceback."""
    from bench.peer_gsplat import PeerError
    from splatflow.pipeline.errors import UserError

    try:
        peer_compare(args, cfg, dev, out)
    except (PeerError, UserError) as e:
        print(f"bench/gpu.py: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/splatflow_gpu_bench"))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--max-steps", type=int, default=None, help="override train.max_steps (default: params.yaml)")
    ap.add_argument("--compare-cpu", action="store_true", help="also time CPU steps of the same run")
    ap.add_argument("--cpu-steps", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="CPU threads for --compare-cpu")
    ap.add_argument("--set", action="append", default=[], help="override a train param, e.g. patch_max_pixels=0")
    ap.add_argument("--profile-at", type=int, help="profile the run's steps from this one (see above)")
    ap.add_argument("--profile-steps", type=int, default=40)
    ap.add_argument("--peer-gsplat", type=Path, metavar="PATH", help="a gsplat checkout: compare with its "
                    "examples/simple_trainer.py (see above)")
    ap.add_argument("--peer-python", default=None, help="the interpreter that runs simple_trainer (default: "
                    "$PEER_PYTHON, else this one)")
    ap.add_argument("--scene", type=Path, help="undistorted COLMAP folder for --peer-gsplat (default: the "
                    "benchmark scene)")
    ap.add_argument("--max-side", type=int, default=None, help="longest image side for --peer-gsplat, px")
    ap.add_argument("--peer-steps", type=int, default=30_000)
    ap.add_argument("--curve-points", type=int, default=8)
    ap.add_argument("--peer-timeout", type=float, default=3600.0, help="seconds before the peer is stopped")
    ap.add_argument("--deadline", type=float, default=None, help="seconds this script may run in all: the peer "
                    "is stopped in time for its curve so far to be read and compared")
    ap.add_argument("--peer-drop-lpips", action="store_true", help="discard the peer's LPIPS (where its AlexNet "
                    "trunk is a placeholder: bench/gpu_kit.py, a machine with no network)")
    ap.add_argument("--side", choices=("both", "ours", "peer"), default="both",
                    help="with --peer-gsplat: train both (default) or one side only (a lent GPU's calls are short: "
                         "one side per call, the two joined by --other-json)")
    ap.add_argument("--other-json", type=Path, help="with --side: the --json of an earlier run on the same GPU that "
                                                     "measured the other side")
    ap.add_argument("--join", type=Path, nargs=2, metavar=("OURS_JSON", "PEER_JSON"),
                    help="compare the --json files of a --side ours and a --side peer run (no GPU needed)")
    ap.add_argument("--peer-only", action="store_true", help="with --peer-gsplat: only the comparison, not the "
                    "default run on the benchmark scene")
    args = ap.parse_args(argv)

    if args.join is not None:
        from bench import peer_gsplat as pg

        try:
            out = join(*args.join)
        except pg.PeerError as e:
            print(f"bench/gpu.py: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        if args.json:
            args.json.write_text(json.dumps(out, indent=2))
        return out

    if args.peer_gsplat is not None:  # bad arguments are reported before anything else, with or without a GPU
        from bench import peer_gsplat as pg

        try:
            args.peer_root = pg.check_checkout(args.peer_gsplat)
            if args.scene is not None and not (args.scene / "images").is_dir():
                raise pg.PeerError(f"--scene {args.scene}: no images/ folder; pass an undistorted COLMAP folder "
                                   "(images/ and a PINHOLE sparse/ model, e.g. data/<scene>/undistorted)")
            if args.other_json is not None and not args.other_json.is_file():
                raise pg.PeerError(f"--other-json {args.other_json}: no such file; pass the --json an earlier "
                                   "--side run wrote")
            if args.other_json is not None and args.side == "both":
                raise pg.PeerError("--other-json needs --side ours or --side peer (the side this run measures)")
            for name in ("peer_steps", "curve_points"):
                if getattr(args, name) < 1:
                    raise pg.PeerError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be at least 1")
        except pg.PeerError as e:
            print(f"bench/gpu.py: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        args.peer_python = args.peer_python or pg.default_python()

    if not torch.cuda.is_available():
        print(f"bench/gpu.py: no CUDA GPU on this machine (torch {torch.__version__}, "
              f"torch.cuda.is_available() is False): nothing to measure.")
        return {}
    if args.peer_gsplat is not None:  # before any training: the peer's environment is the likeliest to be wrong
        from bench import peer_gsplat as pg

        missing = pg.missing_modules(args.peer_python)
        if missing:
            print(f"bench/gpu.py: --peer-python {args.peer_python} cannot import {', '.join(missing)}: install "
                  f"{args.peer_root / 'examples' / 'requirements.txt'} into it (its pycolmap is the fork with "
                  "SceneManager, which needs an environment of its own), or pass another --peer-python",
                  file=sys.stderr)
            raise SystemExit(2)

    from bench.train_demo import prepare, train_config
    from splatflow.pipeline.device import check_gsplat_cuda, reset_peak_memory, resolve, run_record
    from splatflow.render import configure_threads
    from splatflow.scene.dataset import load_scene
    from splatflow.train import Trainer

    configure_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    check_gsplat_cuda()  # first use compiles gsplat's kernels: timed on its own, not as training
    jit_s = time.perf_counter() - t
    cfg = replace(train_config(args.max_steps, args.set), backend="cuda", resume=False)
    if args.peer_only and args.scene is not None:  # the comparison's own scene: the benchmark scene is not needed
        scene = load_bench_scene(args.scene, args.work, args.threads, args.max_side)[0]
    else:
        und, split_json, sfm = prepare(args.work, args.threads)
        scene = load_scene(und, split_json)
    ckpt = args.work / "gpu_ckpt.pt"
    ckpt.unlink(missing_ok=True)  # a benchmark starts from nothing
    dev = resolve("cuda")
    reset_peak_memory(dev)
    print(f"{torch.cuda.get_device_name(dev.device)}: {len(scene.train_views)} train / {len(scene.test_views)} "
          f"test views, {cfg.max_steps} steps, strategy {cfg.densify.strategy}"
          f"{' with ' + ', '.join(args.set) if args.set else ''}; gsplat kernels loaded in {jit_s:.1f} s", flush=True)
    if args.peer_only:  # the comparison alone (a lent GPU's time is short)
        rec = run_record(dev)
        out = {k: rec[k] for k in ("device_name", "torch", "gsplat", "cuda")}
        _peer_or_exit(args, cfg, dev, out)
        rec = run_record(dev)
        out.update(gpu_peak_allocated_mib=rec["gpu_peak_allocated_mib"],
                   gpu_peak_reserved_mib=rec["gpu_peak_reserved_mib"])
        if args.json:
            args.json.write_text(json.dumps(out, indent=2))
        return out
    prof: dict = {}
    t0 = time.perf_counter()
    trainer = Trainer(scene, cfg, ckpt_path=ckpt, seed=0)
    if args.profile_at is not None:
        profile_steps(trainer, args.profile_at, args.profile_steps, prof)
    res = trainer.run()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    rec = run_record(dev)
    psnrs = test_psnr_on(res.splats, res.sh_degree, scene.test_views, dev.device)
    out = {
        "device_name": rec["device_name"], "torch": rec["torch"], "gsplat": rec["gsplat"], "cuda": rec["cuda"],
        "steps": res.steps, "stopped": res.stopped, "train_seconds": round(res.train_seconds, 1),
        "wall_seconds": round(wall, 1), "steps_per_s": round(res.it_per_s, 2),
        "psnr_test": round(float(np.mean(psnrs)), 3), "gaussians": int(res.splats["means"].shape[0]),
        "gpu_peak_allocated_mib": rec["gpu_peak_allocated_mib"], "gpu_peak_reserved_mib": rec["gpu_peak_reserved_mib"],
        "gsplat_load_seconds": round(jit_s, 1), "overrides": list(args.set), **prof,
    }
    print(f"CUDA: {out['steps']} steps in {out['train_seconds']} s ({out['steps_per_s']} steps/s), test PSNR "
          f"{out['psnr_test']:.2f} dB, {out['gaussians']} Gaussians, peak GPU memory "
          f"{out['gpu_peak_allocated_mib']} MiB allocated / {out['gpu_peak_reserved_mib']} MiB reserved")
    if prof:
        out["profile_gpu_busy_share"] = print_busy_share(prof, args, "steps")
        for title, key in (("host (self CPU)", "profile_top_host"), ("GPU (self CUDA)", "profile_top_gpu")):
            print(f"  top operators by {title} time, ms per step:")
            for r in prof[key]:
                print(f"    {r['ms_per_step']:8.3f}  x{r['calls_per_step']:<6} {r['op'][:90]}")
    if args.peer_gsplat is not None:
        _peer_or_exit(args, cfg, dev, out)
    if args.compare_cpu:
        # the first --cpu-steps steps of the same default run (same schedule: stop_after, not a shorter
        # max_steps, which would compress every schedule into those steps)
        cpu_cfg = replace(cfg, backend="cpu", early_stop=replace(cfg.early_stop, enabled=False))
        gpu_cfg = replace(cpu_cfg, backend="cuda")
        rates = {}
        for name, c in (("cuda", gpu_cfg), ("cpu", cpu_cfg)):  # one run each, in this process
            r = Trainer(scene, c, seed=0, stop_after=args.cpu_steps).run()
            rates[name] = r.it_per_s
        out.update(cpu_steps=args.cpu_steps, cpu_threads=args.threads, cpu_steps_per_s=round(rates["cpu"], 2),
                   cuda_steps_per_s_same_steps=round(rates["cuda"], 2),
                   speedup_cuda_over_cpu=round(rates["cuda"] / max(rates["cpu"], 1e-9), 1))
        print(f"first {args.cpu_steps} steps: CUDA {rates['cuda']:.1f} steps/s, CPU ({args.threads} threads) "
              f"{rates['cpu']:.1f} steps/s: CUDA {out['speedup_cuda_over_cpu']}x")
    if args.json:
        args.json.write_text(json.dumps(dict(out, per_view=[round(p, 3) for p in psnrs]), indent=2))
    return out


if __name__ == "__main__":
    main()
