"""The shared shell around every DVC stage: arguments, params, seeds, threads, metrics, errors, tracking.

A stage module keeps only its work (``run(params, paths) -> metrics``); everything every stage must do the
same way lives here, so that a stage run by ``dvc repro``, by a Prefect task or by hand behaves identically.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path
from typing import Callable

from splatflow import tracking
from splatflow.pipeline import progress, records, stop
from splatflow.pipeline.config import ConfigError, Params, load_params
from splatflow.pipeline.errors import UserError, fail
from splatflow.orchestrate.workspace import WorkspaceBusy, busy_message, foreign_writer
from splatflow.pipeline.paths import ScenePaths
from splatflow.pipeline.runtime_env import peak_rss_mb

RunFn = Callable[[Params, ScenePaths], dict]


def write_metrics(paths: ScenePaths, stage: str, metrics: dict) -> Path:
    """Write one stage's result dict, once: its numbers to ``metrics/<scene>/<stage>.json`` and the rest to
    ``metrics/<scene>/info/<stage>.json`` (:mod:`splatflow.pipeline.records`; NaN/Inf become null in the info file)."""
    return records.write(paths, stage, metrics)[0]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:  # pragma: no cover - numpy is a hard dependency
        pass
    if "torch" in sys.modules:
        sys.modules["torch"].manual_seed(seed)


def configure_threads(n: int) -> None:
    """Pin numba and torch thread counts without their OpenMP runtimes fighting (docs/design.md §3)."""
    # settings, ingest, sfm and split need neither (2-3 s of start-up in every one of their processes)
    from splatflow.render import configure_threads as _configure  # lazy: torch and numba

    _configure(n)



def _tracking(stage: str, scene: str, params: Params, paths: ScenePaths, record: bool = True):
    return tracking.stage_tracking(stage, scene, params, paths, record=record)


def _drill_hold(stage: str, scene: str) -> None:
    """``SPLATFLOW_STAGE_HOLD_S=<seconds>`` (every stage) or ``<stage>:<seconds>`` (that stage only): wait that
    long with the run open, before the work starts.

    For stop drills and their tests: stages that take a fraction of a second on a small scene can then be stopped
    at a known moment (the stage shell, its run and its SIGTERM owner are all in place). Unset in normal runs.
    """
    hold = os.environ.get("SPLATFLOW_STAGE_HOLD_S", "").strip()
    only, _, seconds = hold.rpartition(":")
    if seconds and (not only or only == stage):
        print(f"splatflow {stage} [{scene}]: holding {float(seconds):g} s before the work (SPLATFLOW_STAGE_HOLD_S)",
              flush=True)
        time.sleep(float(seconds))


def _check_sole_writer(stage: str, scene: str, root: Path) -> None:
    """Stop before any work when another run writes in this checkout (a ``dvc repro`` started by hand beside a
    ``splatflow run``: DVC itself lets it run any stage whose files that run has not locked yet)."""
    who = foreign_writer(root)
    if who is not None:
        fail(f"\nsplatflow {stage} [{scene}] not started: {busy_message(root, who)}", WorkspaceBusy.exit_code)


def _resume_hint(scene: str) -> str:
    return (f"`splatflow run {scene}` continues from here (train from its checkpoint, prune after its last finished "
            f"phase; other stages start over)")


def stage_main(stage: str, run: RunFn, argv: list[str] | None = None, *, needs_threads: bool = True,
               record: bool = True) -> None:
    """Entry point shared by ``python -m stages.<stage> <scene>``.

    Exit status: 0 done, 2 a bad input or setting (the message says which and how to fix it), 3 not started
    because another run writes in this checkout (the message names it), 143 stopped by SIGTERM or Ctrl-C (partial
    work kept where the stage has any, e.g. train's checkpoint; rerun to continue), 1 a bug. ``record=False``: the
    stage checks the tracking store like the others but opens no MLflow run (the settings stage, which runs in
    every repro, would otherwise make a run of every no-op ``dvc repro``).
    """
    stop.install()  # SIGTERM and Ctrl-C from here on are a clean stop (exit 143), also while numba/torch load
    progress.install_for_logs()  # captured output (DVC, a worker's log): progress as lines, not \r frames
    parser = argparse.ArgumentParser(prog=f"python -m stages.{stage}", description=f"splatflow {stage} stage")
    parser.add_argument("scene", help="scene name (a key of base.scenes in params.yaml)")
    parser.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    args = parser.parse_args(argv)
    try:
        # the scene's effective params (its base.scenes.<scene>.params overrides applied); fails clearly for an
        # unknown scene
        params = load_params(args.params).for_scene(args.scene)
    except ConfigError as e:
        fail(f"splatflow {stage}: {e}")

    paths = ScenePaths(args.scene, Path(args.params).resolve().parent)
    _check_sole_writer(stage, args.scene, paths.root)
    seed_everything(params.base.seed)
    if needs_threads:
        configure_threads(params.base.threads)

    t0 = time.perf_counter()
    try:
        with _tracking(stage, args.scene, params, paths, record) as tracker:
            _drill_hold(stage, args.scene)
            metrics = run(params, paths)
            metrics = dict(metrics or {})
            metrics.setdefault("stage_seconds", round(time.perf_counter() - t0, 3))
            # of this stage's process (memory on real captures)
            metrics.setdefault("peak_rss_mb", round(peak_rss_mb(), 1))
            write_metrics(paths, stage, metrics)
            tracker.log_result(metrics)
    except (UserError, ConfigError) as e:
        fail(f"\nsplatflow {stage} [{args.scene}] failed: {e}", getattr(e, "exit_code", 2))
    except stop.StageStopped as e:
        print(f"\nsplatflow {stage} [{args.scene}] stopped: {e}; {_resume_hint(args.scene)}", file=sys.stderr)
        raise SystemExit(stop.STOP_EXIT_CODE) from None
    except Exception as e:
        if not stop.requested():
            raise
        # The stop was raised inside a callback from native code (numba's dispatcher, for one), which wrapped it
        # in an error of its own: it is still the stop, not a failure.
        print(f"\nsplatflow {stage} [{args.scene}] stopped: stopped by {stop.label().upper()} (surfaced as "
              f"{type(e).__name__}); {_resume_hint(args.scene)}", file=sys.stderr)
        raise SystemExit(stop.STOP_EXIT_CODE) from None
    print(f"splatflow {stage} [{args.scene}]: done in {time.perf_counter() - t0:.1f} s "
          f"-> {paths.metrics_json(stage)}")
