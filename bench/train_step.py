"""Benchmark: one full training step (render, loss, backward, Adam, strategy) on CPU.

Cases: 2K Gaussians at 240x135, 10K at 490x273, 20K at 480x270, on 2 threads.
Target: <= 35 ms per step at 10K@490x273, with SSIM + blur <= 15% of the step.

The step is :meth:`splatflow.train.Trainer.train_step` itself (not a re-implementation), on a synthetic
single-scene setup: Gaussians spread through a box in front of a ring of cameras, a smooth random target image
per view, the training blur at ``--blur-sigma`` (default 2.4 px, the start of the default schedule and its
most expensive point; 0 turns it off), densification statistics being accumulated but no refine event inside
the timed window (refine events are periodic, not per-step, costs). Prints a table and the load average (the
machine is shared).

Each case also prints where the step's time goes: the library's hot functions are wrapped with timers for the
timed steps (rasterize forward/backward, projection forward + backward, SSIM forward + backward, blur forward +
backward, Adam, strategy; where blur, L1 and SSIM are one fused Function, its SSIM kernel call is "SSIM" and
the rest of it "blur": since 2026-11-26 the forward blur runs inside the SSIM kernel, so "SSIM" holds it and
"blur" is the backward's transposed blur and glue, and only their sum compares across versions; a timed call
inside another counts to its own part only); "other" is the rest of the step (Python, image window and target, L1, autograd
glue). Each part is given in wall time and in process CPU time (all threads; on a shared machine the steadier of
the two), and the step's minor page faults (fresh memory touched: allocations the allocator returned to the
system and took back) with the system CPU time they cost. Parts that a given code version does not route through a wrapped function (e.g. a blur done by plain
torch ops, whose backward autograd runs itself) land in "other".

    python bench/train_step.py [--threads 2] [--steps 30] [--blur-sigma 2.4] [--json PATH] [--profile]
    python bench/train_step.py --checkpoint /tmp/splatflow_train_demo/ckpt.pt [--at-step 3050] [--sparse both]

``--checkpoint`` times steps of a real run instead: the 800x600 scene ``bench/train_demo.py`` left in ``--work`` and
a checkpoint of its run (e.g. 120K Gaussians late in training, on training windows of ``train.patch_max_pixels``).
``--sparse both`` times those steps with the dense and the sparse step (``train.sparse_step``) in one process and
prints the ratio; the sparse step's Adam counts as "Adam" and its candidate cull as "cull". Pick ``--at-step`` off
the multiples of ``densify.refine_every``, or every timed step includes a refine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

os.environ.setdefault("SPLATFLOW_TRACKING", "off")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout this script is in, not whichever one is installed

import splatflow  # noqa: E402,F401  (first: its process defaults for OpenMP and numba's cache)
import cv2  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

CASES = [("2K@240x135", 2_000, 240, 135), ("10K@490x273", 10_000, 490, 273), ("20K@480x270", 20_000, 480, 270)]


@dataclass
class _View:
    name: str
    image_path: str
    width: int
    height: int
    K: np.ndarray
    world_to_cam: np.ndarray


@dataclass
class _Scene:
    views: list
    train_views: list
    test_views: list
    points: np.ndarray
    colors: np.ndarray


def make_case(tmp: Path, n: int, w: int, h: int, n_views: int = 4, seed: int = 0):
    """``n`` Gaussians with the statistics of bench/rasterize.py (uniform in a 2 x 1.2 x 2 box 4 units in front
    of the camera, log-normal scales with median 0.012, random rotations, opacities sigmoid(N(0, 1.5)), random
    SH), seen by ``n_views`` cameras shifted by a few cm, with smooth random targets."""
    import math

    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    splats = {
        "means": (torch.rand(n, 3, generator=g) - 0.5) * torch.tensor([2.0, 1.2, 2.0]),  # [N, 3]
        "quats": torch.randn(n, 4, generator=g),
        "scales": torch.randn(n, 3, generator=g) * 0.5 + math.log(0.012),  # log scales
        "opacities": torch.randn(n, generator=g) * 1.5,  # logits
        "sh0": torch.randn(n, 1, 3, generator=g) * 0.8,
        "shN": torch.randn(n, 15, 3, generator=g) * 0.2,
    }
    K = np.array([[0.8 * w, 0, w / 2], [0, 0.8 * w, h / 2], [0, 0, 1.0]])
    views = []
    for i in range(n_views):
        w2c = np.eye(4)
        w2c[:3, 3] = [0.05 * np.cos(i), 0.05 * np.sin(i), 4.0]
        img = cv2.resize(rng.uniform(0, 255, (h // 8 + 1, w // 8 + 1, 3)).astype(np.uint8), (w, h),
                         interpolation=cv2.INTER_CUBIC)
        p = tmp / f"{n}_{i}.png"
        cv2.imwrite(str(p), img)
        views.append(_View(p.name, str(p), w, h, K, w2c))
    pts = splats["means"].numpy()
    return _Scene(views, views, [], pts, np.zeros_like(pts, dtype=np.uint8)), splats


def _minflt() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


PARTS = ("rasterize fwd", "rasterize bwd", "projection", "SSIM", "blur", "Adam", "cull", "strategy")


class PartTimer:
    """Wall time per part of the step, from timers wrapped around the library's hot functions."""

    def __init__(self):
        self.seconds = dict.fromkeys(PARTS, 0.0)
        self.cpu_seconds = dict.fromkeys(PARTS, 0.0)  # process CPU time (all threads) inside each part
        self.faults = dict.fromkeys(PARTS, 0)  # minor page faults inside each part (fresh memory touched)
        self.on = False
        self._stack = []  # the timed calls in progress
        self._undo = []

    def _timed(self, part, fn):
        def wrapper(*a, **k):
            if not self.on:
                return fn(*a, **k)
            # exclusive times: a timed call inside a timed call (a kernel helper inside a Function) counts to its
            # own part, the outer one keeps the rest
            frame = [time.perf_counter(), time.process_time(), _minflt(), 0.0, 0.0, 0]
            self._stack.append(frame)
            try:
                return fn(*a, **k)
            finally:
                self._stack.pop()
                w, c, f = time.perf_counter() - frame[0], time.process_time() - frame[1], _minflt() - frame[2]
                self.seconds[part] += w - frame[3]
                self.cpu_seconds[part] += c - frame[4]
                self.faults[part] += f - frame[5]
                if self._stack:
                    outer = self._stack[-1]
                    outer[3] += w
                    outer[4] += c
                    outer[5] += f
        return wrapper

    def patch(self, owner, attr, part, static=False):
        """Wrap ``owner.attr`` (a class's staticmethod when ``static``); missing attributes are skipped."""
        if owner is None or not hasattr(owner, attr):
            return
        orig = owner.__dict__.get(attr, getattr(owner, attr)) if isinstance(owner, type) else getattr(owner, attr)
        fn = orig.__func__ if isinstance(orig, staticmethod) else orig
        new = self._timed(part, fn)
        # object.__setattr__: strategies may be frozen dataclasses
        setter = setattr if isinstance(owner, type) else object.__setattr__
        setter(owner, attr, staticmethod(new) if static or isinstance(orig, staticmethod) else new)
        self._undo.append((owner, attr, orig, setter))

    def install(self, trainer):
        import importlib

        def mod(name):
            try:
                return importlib.import_module(name)
            except ImportError:
                return None

        cpu = mod("splatflow.render.cpu")
        self.patch(getattr(cpu, "_RasterizeTiles", None), "forward", "rasterize fwd")
        self.patch(getattr(cpu, "_RasterizeTiles", None), "backward", "rasterize bwd")
        self.patch(getattr(cpu, "_ProjectCPU", None), "forward", "projection")
        self.patch(getattr(cpu, "_ProjectCPU", None), "backward", "projection")
        ssim_mod = mod("splatflow.render.ssim")
        filt = mod("splatflow.render.filters")
        for owner in (getattr(ssim_mod, "_SSIM", None), getattr(filt, "SSIMCPU", None)):
            self.patch(owner, "forward", "SSIM")
            self.patch(owner, "backward", "SSIM")
        if filt is not None and hasattr(filt, "GaussianBlurCPU"):
            self.patch(filt.GaussianBlurCPU, "forward", "blur")
            self.patch(filt.GaussianBlurCPU, "backward", "blur")
            # the fused blur + L1 + SSIM Function: its SSIM kernel is "SSIM" (since 2026-11-26 with the forward
            # blur inside), the rest (the backward's transposed blur of the L1 + SSIM gradient formed on the way
            # in, glue) "blur"
            self.patch(getattr(filt, "BlurredL1SSIMCPU", None), "forward", "blur")
            self.patch(getattr(filt, "BlurredL1SSIMCPU", None), "backward", "blur")
            self.patch(filt, "_ssim_kernel", "SSIM")
        gs = trainer.state  # the Gaussians' state (splatflow.train.state)
        for opt in gs.optimizers.values():
            self.patch(opt, "step", "Adam")
        if gs.sparse is not None:  # the sparse step (train.sparse_step): its Adam and its cull
            self.patch(gs.sparse, "step", "Adam")
            self.patch(gs.sparse, "flush", "Adam")
            self.patch(mod("splatflow.train.views"), "candidates", "cull")
        if trainer.strategy is not None:
            self.patch(trainer.strategy, "step_pre_backward", "strategy")
            self.patch(trainer.strategy, "step_post_backward", "strategy")

    def uninstall(self):
        for owner, attr, orig, setter in reversed(self._undo):
            setter(owner, attr, orig)
        self._undo.clear()


def bench_case(name, n, w, h, steps, tmp, profile=False, blur_sigma=2.4):
    from splatflow.pipeline.config import TrainConfig
    from splatflow.train import Trainer
    from splatflow.train.schedules import BlurSchedule, ExpDecay, ResolutionSchedule, Schedules, SHSchedule

    scene, splats = make_case(tmp, n, w, h)
    # whole images (patch_max_pixels=0): the case sizes are the rendered sizes, as the step targets define them;
    # the step alone: no validation, no cut
    cfg = TrainConfig(max_steps=100_000, progress=False, backend="cpu", patch_max_pixels=0)
    cfg = replace(cfg, early_stop=replace(cfg.early_stop, enabled=False),
                  prune_during=replace(cfg.prune_during, enabled=False))
    # the blur schedule's sigma falls linearly to 0 at end_step: an end far away keeps it at blur_sigma
    blur = BlurSchedule(blur_sigma, 10**12) if blur_sigma > 0 else BlurSchedule(0.0, 0)
    sched = Schedules(ResolutionSchedule((0,), (1.0,)), blur, SHSchedule(3, 1, start_degree=3),
                      ExpDecay(1.6e-4, 0.01, 100_000))
    tr = Trainer(scene, cfg, schedules=sched, splats=splats)
    tr.step = 1  # past step 0: the first-backward gradient check is a one-off
    tr.checks.grad_checked = True
    return dict(time_steps(tr, steps, profile), name=name, gaussians=n, width=w, height=h, blur_sigma=blur_sigma)


def time_steps(tr, steps: int, profile: bool = False) -> dict:
    """Time ``steps`` calls of ``tr.train_step()`` (after 3 warm-up steps) with the part timers installed. The
    views and windows are drawn from a fixed seed, so two code versions time the same steps."""
    import random

    random.seed(0)
    torch.manual_seed(0)
    for _ in range(3):  # warm-up: numba kernels (cached compile), caches
        tr.train_step()
    times = []
    parts = PartTimer()
    parts.install(tr)
    parts.on = True
    prof = None
    if profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    cpu0, flt0 = os.times(), _minflt()
    for _ in range(steps):
        t0 = time.perf_counter()
        tr.train_step()
        times.append(time.perf_counter() - t0)
    cpu1, flt1 = os.times(), _minflt()
    parts.on = False
    parts.uninstall()
    # process CPU time per step: on a shared machine the wall time also counts other jobs; CPU time / threads
    # is the wall time the step would take on dedicated cores with perfect scaling (a lower bound)
    cpu_ms = 1000 * ((cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)) / steps
    if prof is not None:
        import pstats

        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
    return {"step_ms": round(1000 * statistics.median(times), 2), "step_ms_mean": round(1000 * statistics.mean(times), 2),
            "step_ms_min": round(1000 * min(times), 2), "cpu_ms": round(cpu_ms, 2),
            "parts_ms": _shares(parts.seconds, sum(times), steps),
            "parts_cpu_ms": _shares(parts.cpu_seconds, cpu_ms * steps / 1000, steps),
            "sys_ms": round(1000 * (cpu1.system - cpu0.system) / steps, 2),
            "faults": {**{k: round(v / steps) for k, v in parts.faults.items()},
                       "step": round((flt1 - flt0) / steps)}}


def trainer_from_checkpoint(work: Path, ckpt: Path, **train_overrides):
    """A CPU ``Trainer`` on ``bench/train_demo.py``'s scene in ``work``, in the state of its checkpoint ``ckpt``,
    with ``params.yaml``'s train section (no progress bar, no resume, no plateau stop, no pruning during training)
    and ``train_overrides``."""
    from splatflow.pipeline.config import load_params
    from splatflow.gaussians.model import Checkpoint
    from splatflow.scene.dataset import load_scene
    from splatflow.train import Trainer

    cfg = load_params(ROOT / "params.yaml").train
    cfg = replace(cfg, progress=False, backend="cpu", resume=False,
                  early_stop=replace(cfg.early_stop, enabled=False),
                  prune_during=replace(cfg.prune_during, enabled=False), **train_overrides)
    tr = Trainer(load_scene(work / "undistorted", work / "split.json"), cfg)
    tr.load_state_dict(Checkpoint.load(ckpt))
    return tr


def checkpoint_case(work: Path, ckpt: Path, step: int | None, steps: int, profile: bool = False,
                    sparse: bool = True) -> dict:
    """Steps of a real run: ``bench/train_demo.py``'s scene in ``work`` and a checkpoint it wrote, continued at
    ``step`` (default: the checkpoint's) with ``params.yaml``'s train section (the schedules of that step:
    resolution, training window, blur, SH degree; densification statistics accumulate, no refine event is timed),
    with the sparse step (``train.sparse_step``) on or off."""
    tr = trainer_from_checkpoint(work, ckpt, sparse_step=sparse)
    tr.checks.grad_checked = True
    if step is not None:
        tr.step = step
    r = time_steps(tr, steps, profile)
    w, h = tr.cache.shape(0, tr.sched.resolution.factor(tr.step))
    return dict(r, name=f"{ckpt.name}@{tr.step}{'' if sparse else ' dense'}", sparse=sparse, gaussians=tr.state.n, width=w, height=h,
                blur_sigma=tr.sched.blur.sigma(tr.step), patch_max_pixels=tr.window_pixels)


def _shares(seconds: dict, total_s: float, steps: int) -> dict:
    """Mean ms per step of each part, with "other" = the rest of the mean step."""
    out = {k: round(1000 * v / steps, 2) for k, v in seconds.items()}
    out["other"] = round(1000 * (total_s - sum(seconds.values())) / steps, 2)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--profile", action="store_true", help="cProfile the timed steps of each case")
    ap.add_argument("--cases", default="all", help="comma-separated case names (default: all)")
    ap.add_argument("--blur-sigma", type=float, default=2.4,
                    help="training blur sigma in px during the timed steps (default 2.4, the schedule's start; 0: off)")
    ap.add_argument("--checkpoint", type=Path, metavar="CKPT", action="append", default=[],
                    help="also time steps of a real run: a checkpoint bench/train_demo.py wrote in --work")
    ap.add_argument("--work", type=Path, default=Path("/tmp/splatflow_train_demo"),
                    help="bench/train_demo.py's work folder (scene and split) for --checkpoint")
    ap.add_argument("--at-step", type=int, default=None,
                    help="continue --checkpoint at this step's schedules (default: the checkpoint's step)")
    ap.add_argument("--sparse", choices=("on", "off", "both"), default="on",
                    help="--checkpoint steps with train.sparse_step on (the default), off, or both (dense first, "
                         "then sparse, alternated --rounds times; prints the ratio)")
    ap.add_argument("--rounds", type=int, default=1, help="with --sparse both: dense/sparse pairs to alternate")
    args = ap.parse_args(argv)

    from splatflow.render import configure_threads

    configure_threads(args.threads)
    load0 = os.getloadavg()[0]
    results = []
    jobs = [(name, n, w, h) for name, n, w, h in CASES if args.cases == "all" or name in args.cases.split(",")]
    if args.checkpoint and args.cases == "all":  # --checkpoint alone times only the real run
        jobs = []
    modes = {"on": [True], "off": [False], "both": [False, True] * max(1, args.rounds)}[args.sparse]
    jobs += [(ck, None, None, sp) for ck in args.checkpoint for sp in modes]
    with tempfile.TemporaryDirectory() as d:
        for name, n, w, h in jobs:
            if n is None:
                r = checkpoint_case(args.work, name, args.at_step, args.steps, args.profile, sparse=h)
                name = f"{r['name']} ({r['gaussians']} G, {r['width']}x{r['height']})"
            else:
                r = bench_case(name, n, w, h, args.steps, Path(d), args.profile, args.blur_sigma)
            results.append(r)
            print(f"{name:>12}: {r['step_ms']:7.1f} ms/step (median of {args.steps}; min {r['step_ms_min']:.1f}); "
                  f"CPU {r['cpu_ms']:.1f} ms/step = {r['cpu_ms'] / args.threads:.1f} ms per thread", flush=True)
            for label, key in (("wall", "parts_ms"), ("CPU ", "parts_cpu_ms")):
                pm = r[key]
                mean = sum(pm.values())
                print(f"        {label}: " + ", ".join(f"{k} {v:.1f} ms ({100 * v / mean:.0f}%)" for k, v in pm.items())
                      + f"  [mean step {mean:.1f} ms]", flush=True)
            # page faults: each is a fresh page of memory touched (kernel time, in the CPU figures above)
            print(f"        faults per step {r['faults']['step']} (system CPU {r['sys_ms']:.1f} ms/step): "
                  + ", ".join(f"{k} {v}" for k, v in r["faults"].items() if k != "step"), flush=True)
    load1 = os.getloadavg()[0]
    ck_runs = [r for r in results if "sparse" in r]
    if args.sparse == "both" and ck_runs:
        dense = [r["step_ms_mean"] for r in ck_runs if not r["sparse"]]
        sparse = [r["step_ms_mean"] for r in ck_runs if r["sparse"]]
        print(f"sparse step vs dense (mean step, alternated {len(dense)}x): dense {', '.join(f'{x:.1f}' for x in dense)} "
              f"ms, sparse {', '.join(f'{x:.1f}' for x in sparse)} ms: {sum(dense) / sum(sparse):.2f}x")
    print(f"threads={args.threads} torch={torch.__version__} load average before/after: {load0:.2f}/{load1:.2f} "
          f"on {os.cpu_count()} cores")
    ten = [r for r in results if r["name"] == "10K@490x273"]
    if ten:
        pm, pc = ten[0]["parts_ms"], ten[0]["parts_cpu_ms"]
        share = (pm["SSIM"] + pm["blur"]) / sum(pm.values())
        share_cpu = (pc["SSIM"] + pc["blur"]) / sum(pc.values())
        print(f"10K@490x273 target 35 ms: {'MET' if ten[0]['step_ms'] <= 35 else 'NOT MET'} "
              f"({ten[0]['step_ms']:.1f} ms); SSIM + blur <= 15% of the step: "
              f"{'MET' if share <= 0.15 else 'NOT MET'} ({100 * share:.1f}% of the wall time, "
              f"{100 * share_cpu:.1f}% of the CPU time; blur sigma {args.blur_sigma} px)")
    if args.json:
        args.json.write_text(json.dumps({"cases": results, "threads": args.threads, "blur_sigma": args.blur_sigma,
                                         "loadavg": [round(load0, 2), round(load1, 2)]}, indent=2))
    return results


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
