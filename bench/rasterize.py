"""Benchmark: CPU rasterizer (numba) vs the plain-PyTorch oracle, forward + backward, in one process.

Cases: 2K Gaussians at 240x135, 10K at 490x273, 20K at 480x270, 50K at 960x540; SH degree 3; 2 threads;
an L1 loss against a fixed target image, so the backward is a real one. Both backends get identical inputs.
For every case it prints ms forward and backward of the CPU backend (projection + SH + compositing), ms of the
oracle's forward + backward, their ratio, and the process peak RSS after the case (CPU cases run first, smallest
to largest, so each case's figure is the peak up to and including it). It then fits
``log t = a log N + b log pixels + c`` over the cases and prints the growth exponents a and b.

Scenes: Gaussians uniformly in a 2 x 1.2 x 2 box 4 units in front of one camera (field of view ~64 degrees),
log-normal world scales (median 0.012), random rotations, opacities sigmoid(N(0, 1.5)), random SH coefficients.
The same world statistics for every case, so more Gaussians means more overlap, as in a densified scene.

Usage: python bench/rasterize.py [--json PATH] [--repeats 5] [--threads 2] [--no-compile-time]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import splatflow  # noqa: E402,F401  (first: its process defaults for OpenMP and numba's cache)
import numpy as np  # noqa: E402
import torch  # noqa: E402

from splatflow.pipeline.runtime_env import peak_rss_mb  # noqa: E402

CASES = [
    ("2K@240x135", 2_000, 240, 135),
    ("10K@490x273", 10_000, 490, 273),
    ("20K@480x270", 20_000, 480, 270),
    ("50K@960x540", 50_000, 960, 540),
]


def make_scene(n: int, width: int, height: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    means = (torch.rand(n, 3, generator=g) - 0.5) * torch.tensor([2.0, 1.2, 2.0])  # [N, 3]
    quats = torch.randn(n, 4, generator=g)
    scales = torch.exp(torch.randn(n, 3, generator=g) * 0.5 + math.log(0.012))
    opacities = torch.sigmoid(torch.randn(n, generator=g) * 1.5)
    sh = torch.randn(n, 16, 3, generator=g) * 0.2
    sh[:, 0] = torch.randn(n, 3, generator=g) * 0.8
    viewmat = torch.eye(4)
    viewmat[2, 3] = 4.0
    f = 0.8 * width
    K = torch.tensor([[f, 0.0, width / 2], [0.0, f, height / 2], [0.0, 0.0, 1.0]])
    target = torch.rand(1, height, width, 3, generator=g)
    return dict(means=means, quats=quats, scales=scales, opacities=opacities, colors=sh,
                viewmats=viewmat[None], Ks=K[None], width=width, height=height, target=target)


def run_once(scene: dict, backend: str) -> tuple[float, float, float]:
    """One forward + backward; returns (forward s, backward s, process CPU s of both)."""
    from splatflow.render import rasterize

    params = {k: scene[k].clone().requires_grad_() for k in ("means", "quats", "scales", "opacities", "colors")}
    c0 = time.process_time()
    t0 = time.perf_counter()
    img, _alpha, info = rasterize(**params, viewmats=scene["viewmats"], Ks=scene["Ks"], width=scene["width"],
                                  height=scene["height"], sh_degree=3, backend=backend)
    loss = (img - scene["target"]).abs().mean()
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, time.process_time() - c0


def compile_times() -> dict:
    """Start-up cost of the CPU kernels in fresh processes: with an empty numba cache, then with a warm one.

    Reports the wall seconds of ``warmup()`` and the CPU seconds it used (less sensitive to other load)."""
    code = ("import os, time; os.environ.setdefault('OMP_WAIT_POLICY','PASSIVE'); from splatflow.render import warmup;"
            " c = time.process_time(); w = warmup(); print(w, time.process_time() - c)")
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, NUMBA_CACHE_DIR=tmp)
        for label in ("first_compile", "cached_start"):
            r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
            wall, cpu = r.stdout.strip().splitlines()[-1].split()
            out[f"{label}_s"] = float(wall)
            out[f"{label}_cpu_s"] = float(cpu)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=str, default=None, help="write the results to this JSON file")
    ap.add_argument("--repeats", type=int, default=5, help="timed repetitions per case (best is reported)")
    ap.add_argument("--oracle-repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-compile-time", action="store_true", help="skip the fresh-process compile/start timing")
    args = ap.parse_args(argv)

    from splatflow.render import configure_threads, warmup

    threads = configure_threads(args.threads)
    warm_s = warmup()
    print(f"threads: {threads}   warm-up in this process: {warm_s:.2f} s")
    scenes = {name: make_scene(n, w, h) for name, n, w, h in CASES}
    rows = []
    from tqdm import tqdm

    for name, n, w, h in tqdm(CASES, desc="cpu", leave=False):
        run_once(scenes[name], "cpu")
        fw, bw, pc = [], [], []
        for _ in range(args.repeats):
            f, b, c = run_once(scenes[name], "cpu")
            fw.append(f)
            bw.append(b)
            pc.append(c)
        best = int(np.argmin(np.add(fw, bw)))
        rows.append(dict(name=name, gaussians=n, width=w, height=h, cpu_forward_ms=1e3 * fw[best],
                         cpu_backward_ms=1e3 * bw[best], peak_rss_mb=peak_rss_mb(),
                         cpu_process_ms=1e3 * min(pc)))
    for row in tqdm(rows, desc="oracle", leave=False):
        ts = [run_once(scenes[row["name"]], "torch") for _ in range(args.oracle_repeats)]
        row["oracle_ms"] = 1e3 * min(f + b for f, b, _ in ts)
        row["oracle_process_ms"] = 1e3 * min(c for _, _, c in ts)
        row["ratio"] = row["oracle_ms"] / (row["cpu_forward_ms"] + row["cpu_backward_ms"])

    logN = np.log([r["gaussians"] for r in rows])
    logP = np.log([r["width"] * r["height"] for r in rows])
    logT = np.log([r["cpu_forward_ms"] + r["cpu_backward_ms"] for r in rows])
    A = np.stack([logN, logP, np.ones_like(logN)], axis=1)
    (exp_n, exp_p, _), *_ = np.linalg.lstsq(A, logT, rcond=None)
    logC = np.log([r["cpu_process_ms"] for r in rows])
    (exp_n_cpu, exp_p_cpu, _), *_ = np.linalg.lstsq(A, logC, rcond=None)

    print(f"{'case':<14}{'fwd ms':>9}{'bwd ms':>9}{'cpu ms':>9}{'oracle ms':>11}{'ratio':>8}{'peak MB':>9}"
          f"{'CPU-time ms':>13}")
    for r in rows:
        print(f"{r['name']:<14}{r['cpu_forward_ms']:>9.1f}{r['cpu_backward_ms']:>9.1f}"
              f"{r['cpu_forward_ms'] + r['cpu_backward_ms']:>9.1f}{r['oracle_ms']:>11.1f}{r['ratio']:>8.1f}"
              f"{r['peak_rss_mb']:>9.0f}{r['cpu_process_ms']:>13.1f}")
    print("(CPU-time: process CPU seconds of the CPU backend's forward + backward, all threads; on a machine shared "
          "with other work, wall time is inflated and CPU-time / threads estimates the unloaded wall time)")
    load = os.getloadavg()
    print(f"load average during the run: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} on {os.cpu_count()} cores")
    print(f"growth exponent (wall time): gaussians {exp_n:.2f}, pixels {exp_p:.2f};"
          f"  (CPU time): gaussians {exp_n_cpu:.2f}, pixels {exp_p_cpu:.2f}")
    result = {"threads": threads, "cases": rows, "exponent_gaussians": float(exp_n), "exponent_pixels": float(exp_p),
              "exponent_gaussians_cpu_time": float(exp_n_cpu), "exponent_pixels_cpu_time": float(exp_p_cpu),
              "load_average": list(os.getloadavg())}
    if not args.no_compile_time:
        ct = compile_times()
        print(f"numba kernels: first compile {ct['first_compile_s']:.1f} s ({ct['first_compile_cpu_s']:.1f} CPU s), "
              f"cached start {ct['cached_start_s']:.2f} s ({ct['cached_start_cpu_s']:.2f} CPU s)")
        result.update(ct)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    return result


if __name__ == "__main__":
    main()
