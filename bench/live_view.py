"""Benchmark: what the live view (`splatflow run SCENE --view`) costs a training run, and that it changes nothing.

Trains the demo scene (its undistorted model and split from `make demo`, with its own settings from params.yaml)
for ``--steps`` steps, alternately without and with the live view at ``--every`` seconds between refreshes,
``--rounds`` times each in one process, so the ratio holds on whatever machine runs it. No browser is needed for
the cost of snapshots and of the viewer's conversion and serialisation; ``--browser`` also keeps a headless
Chromium on the page (what a watching user adds: the websocket traffic to a client). Prints seconds per run, the
steps per second, the CPU seconds of the process (training and the viewer's thread: the figure that holds on a
loaded machine), the median ratios and whether the watched runs' parameters equal the unwatched ones.

    nice -n 19 .venv/bin/python bench/live_view.py [--steps 600] [--rounds 2] [--every 5] [--browser]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("SPLATFLOW_TRACKING", "off")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout this script is in, not whichever one is installed

import splatflow  # noqa: E402,F401  (first: its process defaults for OpenMP and numba's cache)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scene", default="demo")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--every", type=float, default=5.0, help="seconds between two refreshes")
    ap.add_argument("--browser", action="store_true", help="keep headless Chromium on the live page")
    args = ap.parse_args()

    from dataclasses import replace

    import torch

    from splatflow.pipeline.config import load_params
    from splatflow.present.live_view import LiveView
    from splatflow.gaussians.model import SPLAT_KEYS
    from splatflow.orchestrate.servers import free_port
    from splatflow.pipeline.paths import ScenePaths
    from splatflow.render import configure_threads
    from splatflow.present.report import scene_cameras
    from splatflow.scene.resolution import load_working_scene
    from splatflow.train import train

    params = load_params(ROOT / "params.yaml").for_scene(args.scene)
    paths = ScenePaths(args.scene, ROOT)
    if not paths.split_json.exists():
        sys.exit(f"{paths.split_json} not found: run `make demo` (or `splatflow run {args.scene}`) first")
    configure_threads(params.base.threads)
    scene, _ = load_working_scene(params, paths)
    cfg = replace(params.train, max_steps=args.steps, progress=False,
                  early_stop=replace(params.train.early_stop, enabled=False))
    cams = scene_cameras(paths)
    times: dict[bool, list[float]] = {False: [], True: []}
    cpus: dict[bool, list[float]] = {False: [], True: []}  # this process's CPU-s: training and the viewer's thread
    results: dict[bool, object] = {}
    warm = replace(cfg, max_steps=5, prune_during=replace(cfg.prune_during, enabled=False))
    train(scene, warm, seed=0)  # kernels loaded, caches warm: not timed
    for r in range(args.rounds):
        for watched in (False, True):
            watchers, browser = [], None
            if watched:
                live = LiveView(cams, title=args.scene, port=free_port(), every_s=args.every, log=lambda s: None)
                watchers = [live]
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                if watched and args.browser:
                    browser = _open_when_served(live)
                res = train(scene, cfg, seed=0, watchers=watchers)
            finally:
                if browser is not None:
                    browser.close()
                for h in watchers:
                    h.close()
            dt, cpu = time.perf_counter() - t0, time.process_time() - c0
            times[watched].append(dt)
            cpus[watched].append(cpu)
            results[watched] = res
            extra = f", {watchers[0].refreshes} refreshes" if watchers else ""
            print(f"round {r}: {'with' if watched else 'without'} live view: {dt:.2f} s "
                  f"({args.steps / dt:.2f} steps/s{extra}), {cpu:.1f} CPU-s", flush=True)
    same = all(torch.equal(results[False].splats[k], results[True].splats[k]) for k in SPLAT_KEYS)
    ratio = statistics.median(b / a for a, b in zip(times[False], times[True]))
    cpu_ratio = statistics.median(b / a for a, b in zip(cpus[False], cpus[True]))
    print(f"\n{args.scene}, {args.steps} steps, refresh every {args.every:g} s"
          f"{', Chromium on the page' if args.browser else ''}: without {statistics.median(times[False]):.2f} s, "
          f"with {statistics.median(times[True]):.2f} s; time ratio with/without {ratio:.3f} "
          f"({(ratio - 1) * 100:+.1f} %); CPU-s ratio {cpu_ratio:.3f} ({(cpu_ratio - 1) * 100:+.1f} %, what a loaded machine "
          f"still measures); same parameters: {same}")


def _open_when_served(live):
    """A headless Chromium tab on the live page once its server is up (it starts with the first step)."""
    import threading

    from tests import _chromium

    holder: dict = {}

    def attach():
        while live.url is None and not holder.get("stop"):
            time.sleep(0.2)
        if holder.get("stop"):
            return
        tab = _chromium._Tab(size=(1000, 700))
        tab.goto(live.url)
        holder["tab"] = tab

    t = threading.Thread(target=attach, daemon=True)
    t.start()

    class Closer:
        def close(self):
            holder["stop"] = True
            t.join(timeout=30)
            if "tab" in holder:
                holder["tab"].close()

    return Closer()


if __name__ == "__main__":
    main()
