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

    python bench/gpu.py [--work DIR] [--json PATH] [--max-steps N] [--set KEY=VALUE ...] [--compare-cpu]
                        [--cpu-steps 1000] [--profile-at 5210 --profile-steps 40]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("SPLATFLOW_TRACKING", "off")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import splatflow  # noqa: E402,F401  (first: its process defaults for OpenMP and numba's cache)
import numpy as np  # noqa: E402
import torch  # noqa: E402


@torch.no_grad()
def test_psnr_on(splats, sh_degree, views, device) -> list[float]:
    """Per-view test PSNR, rendering on ``device`` (one image pair there at a time)."""
    from splatflow.model import Splats, render_view
    from splatflow.scene.pixels import read_rgb

    splats = Splats.of(splats).to(device)
    out = []
    for v in views:
        gt = torch.from_numpy(read_rgb(v.image_path)).to(device).float() / 255.0  # [H, W, 3]
        rgb = render_view(splats, v, sh_degree, "cuda" if device.type == "cuda" else "cpu")  # clamped to [0, 1]
        mse = float(((rgb - gt) ** 2).mean())
        out.append(-10.0 * math.log10(mse))
    return out


def profile_steps(trainer, at: int, n: int, report: dict) -> None:
    """Wrap ``trainer.train_step`` so that steps ``at`` .. ``at + n - 1`` run under torch's profiler; the summary
    lands in ``report`` (wall ms per step, GPU busy ms per step, top operators by self host and self CUDA time)."""
    from torch.profiler import ProfilerActivity, profile

    step_fn, state = trainer.train_step, {}
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])

    def wrapped():
        s = trainer.step
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
            dev_us = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) for e in ka)
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
    args = ap.parse_args(argv)

    if not torch.cuda.is_available():
        print(f"bench/gpu.py: no CUDA GPU on this machine (torch {torch.__version__}, "
              f"torch.cuda.is_available() is False): nothing to measure.")
        return {}

    from bench.train_demo import prepare, train_config
    from splatflow.device import check_gsplat_cuda, reset_peak_memory, resolve, run_record
    from splatflow.render import configure_threads
    from splatflow.scene.dataset import load_scene
    from splatflow.train import Trainer

    configure_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    check_gsplat_cuda()  # first use compiles gsplat's kernels: timed on its own, not as training
    jit_s = time.perf_counter() - t
    und, split_json, sfm = prepare(args.work, args.threads)
    scene = load_scene(und, split_json)
    cfg = replace(train_config(args.max_steps, args.set), backend="cuda", resume=False)
    ckpt = args.work / "gpu_ckpt.pt"
    ckpt.unlink(missing_ok=True)  # a benchmark starts from nothing
    dev = resolve("cuda")
    reset_peak_memory(dev)
    print(f"{torch.cuda.get_device_name(dev.device)}: {len(scene.train_views)} train / {len(scene.test_views)} "
          f"test views, {cfg.max_steps} steps, strategy {cfg.densify.strategy}"
          f"{' with ' + ', '.join(args.set) if args.set else ''}; gsplat kernels loaded in {jit_s:.1f} s", flush=True)
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
        print(f"profile of steps {args.profile_at}..{args.profile_at + args.profile_steps - 1}: "
              f"{prof['profile_wall_ms_per_step']} ms per step, GPU busy {prof['profile_gpu_busy_ms_per_step']} ms")
        for title, key in (("host (self CPU)", "profile_top_host"), ("GPU (self CUDA)", "profile_top_gpu")):
            print(f"  top operators by {title} time, ms per step:")
            for r in prof[key]:
                print(f"    {r['ms_per_step']:8.3f}  x{r['calls_per_step']:<6} {r['op'][:90]}")
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
