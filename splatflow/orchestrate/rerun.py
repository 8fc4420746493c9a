"""Reproduce a past pipeline run from its git commit and check that its metrics come out the same.

``splatflow rerun <commit>``: check the commit out into a temporary git worktree (its own code, params.yaml and
dvc.yaml; the raw captures linked from this checkout; the DVC cache shared), run every stage of every scene with
``dvc repro --single-item --force`` (forced: a cache hit would restore the old outputs instead of recomputing them,
which proves nothing), log the run to MLflow tagged ``splatflow.rerun_of=<original run id>``, and print each
final metric of the original run next to the rerun's.

Tolerance: a metric matches when ``|rerun - original| <= atol + rtol * |original|`` (defaults ``rtol=1e-2``,
``atol=1e-6``).  One percent is what COLMAP's run-to-run variation allows even with a fixed seed (docs/design.md §3);
training itself is deterministic on the CPU backend for a fixed seed and thread count.  Wall-clock metrics
(``*seconds*``, ``*_s``, ``*time*``, ``*per_s*``, ``*fps*``) and memory (``*rss*``) are shown but never judged.
SfM camera errors, which sit near zero, are judged with the absolute tolerances of :data:`ABS_TOLERANCES`; sizes
in MiB (rounded to 4 decimals) allow one unit of their last digit (:data:`ROUNDED_MB_ATOL`).
PSNR metrics (``*psnr*``) are judged against the run-to-run spread that ``bench/variance.py`` MEASURED (test PSNR
over several training seeds, committed as ``bench/variance.json``): ``|diff| <= spread`` when that file exists.

A rerun with no original run of that commit in MLflow compares nothing: it says so and is not a success.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from splatflow import tracking
from splatflow.orchestrate import dvcrun
from splatflow.orchestrate.workspace import resolve_commit, worktree

RTOL = 1e-2
ATOL = 1e-6
#: Wall-clock and memory measurements: shown, never judged.
TIMING = re.compile(r"(seconds|_s$|_s\b|time|per_s|fps|_ms$|throughput|rss|memory)", re.IGNORECASE)
#: Metrics that are errors near zero, where a relative tolerance is meaningless: absolute tolerances instead.
#: COLMAP's run-to-run jitter (docs/design.md §3) moves camera errors by ~1e-5 of the orbit and ~0.01 deg.
ABS_TOLERANCES = {
    "camera_center_error_rel": 1e-3,  # 0.1 % of the orbit extent
    "camera_rotation_error_deg": 0.05,
    "mean_reprojection_error_px": 0.05,
    "image_reprojection_error_px_median": 0.05,
    "image_reprojection_error_px_p90": 0.05,
    "image_reprojection_error_px_max": 0.1,
    "points_two_view_fraction": 0.01,  # one point in a hundred: the tiny test scene moved 0.35 % -> 0.44 %
}
#: Export round-trip errors (``export.files.<fmt>.max_errors.*``) are quantisation residues of a few 1e-5 that
#: follow every tiny change of the model; the export stage already checks each against its format's bound.
QUANTISATION_ATOL = 1e-3
#: Sizes in MiB are reported rounded to 4 decimals (``*size_mb*``): one unit of that last digit is rounding, not a
#: difference. A 1.9 KB test export that shrank by 5 bytes (0.26 %) once read 0.0019 -> 0.0018 MiB, "5 %".
ROUNDED_MB_ATOL = 1.5e-4  # one unit, and the float slack of subtracting two rounded values


@dataclass
class MetricDiff:
    key: str
    original: float | None
    rerun: float | None
    judged: bool
    ok: bool

    @property
    def diff(self) -> float | None:
        if self.original is None or self.rerun is None:
            return None
        return self.rerun - self.original


@dataclass
class RerunResult:
    scene: str
    commit: str
    original_run_id: str | None
    rerun_run_id: str | None
    diffs: list[MetricDiff] = field(default_factory=list)

    @property
    def compared(self) -> bool:
        """False when there was no original run to compare with (then nothing was checked)."""
        return self.original_run_id is not None

    @property
    def ok(self) -> bool:
        return self.compared and all(d.ok for d in self.diffs if d.judged)


def find_original(cl, commit: str, scene: str):
    """The newest FINISHED run of ``scene`` at ``commit`` that is not itself a rerun (None if there is none)."""
    exps = [e.experiment_id for e in cl.search_experiments()]
    if not exps:
        return None
    runs = cl.search_runs(exps, filter_string=f"tags.`git.commit` = '{commit}' and tags.`splatflow.scene` = '{scene}'"
                          " and attributes.status = 'FINISHED'", order_by=["attributes.start_time DESC"],
                          max_results=50)
    runs = [r for r in runs if "splatflow.rerun_of" not in r.data.tags]
    return runs[0] if runs else None


def measured_psnr_spread(root: str | Path) -> float | None:
    """The test-PSNR spread over training seeds measured by ``bench/variance.py`` (``bench/variance.json`` of
    the project at ``root``), in dB; None when it has not been measured there."""
    f = Path(root) / "bench" / "variance.json"
    try:
        v = json.loads(f.read_text())["psnr_spread_db"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 else None


def diff_metrics(original: dict[str, float], rerun: dict[str, float], rtol: float = RTOL,
                 atol: float = ATOL, psnr_atol: float | None = None) -> list[MetricDiff]:
    """Final metrics (``<stage>.<name>``; live step curves ``<stage>/<name>`` are left out) side by side.

    ``psnr_atol`` (dB), when given, is the absolute tolerance of every ``*psnr*`` metric (the measured spread)."""
    keys = sorted(k for k in set(original) | set(rerun) if "/" not in k)
    out = []
    for k in keys:
        a, b = original.get(k), rerun.get(k)
        judged = not TIMING.search(k.split(".", 1)[-1])
        if a is None or b is None:
            ok = not judged
        else:
            name = k.rsplit(".", 1)[-1]
            abs_tol = max(atol, ABS_TOLERANCES.get(name, 0.0), QUANTISATION_ATOL if ".max_errors." in k else 0.0,
                          ROUNDED_MB_ATOL if "size_mb" in name else 0.0,
                          psnr_atol if psnr_atol is not None and "psnr" in name else 0.0)
            ok = math.isclose(b, a, rel_tol=rtol, abs_tol=abs_tol) or not judged
        out.append(MetricDiff(k, a, b, judged, ok))
    return out


def rerun_commit(main_root: str | Path, rev: str, *, scenes: list[str] | None = None, run_id: str | None = None,
                 rtol: float = RTOL, atol: float = ATOL, keep: bool = False, timeout_s: float | None = None,
                 on_line: Callable[[str], None] | None = None, log: Callable[[str], None] = print) -> list[RerunResult]:
    """Rerun ``rev`` of the project at ``main_root`` (see module docstring); one result per scene."""
    main_root = tracking.repo_root(main_root)
    commit = resolve_commit(main_root, rev)
    psnr_atol = measured_psnr_spread(main_root)
    uri = tracking.tracking_uri(main_root)
    cl = tracking.client(uri)
    results = []
    with worktree(main_root, commit, name=f"rerun-{commit[:8]}-{__import__('os').getpid()}", keep=keep) as wt:
        log(f"worktree of {commit[:12]} at {wt}")
        all_stages = dvcrun.stage_order(wt)
        todo = scenes or [s for s in dict.fromkeys(n.partition("@")[2] for n in all_stages) if s]
        for scene in todo:
            stages = [n for n in all_stages if n.partition("@")[2] == scene]
            if not stages:
                raise ValueError(f"commit {commit[:12]} has no stages for scene {scene!r}")
            orig = cl.get_run(run_id) if run_id else find_original(cl, commit, scene)
            tags = {"splatflow.started_by": "rerun", "splatflow.rerun_commit": commit}
            if orig is not None:
                tags["splatflow.rerun_of"] = orig.info.run_id
            rid = tracking.create_scene_run(cl, scene, wt, None, uri=uri, run_name=f"rerun-{scene}-{commit[:8]}",
                                            tags=tags, seed_metrics=False)
            log(f"{scene}: MLflow run {rid}" + (f" (rerun of {orig.info.run_id})" if orig else
                                                 " (no original run of this commit in MLflow: nothing to compare)"))
            env = dvcrun.stage_env({"MLFLOW_RUN_ID": rid, "MLFLOW_TRACKING_URI": uri})
            status = "FAILED"
            try:
                for stage in stages:
                    log(f"  {stage} ...")
                    res = dvcrun.run_dvc_stage(wt, stage, force=True, timeout_s=timeout_s, env=env, on_line=on_line)
                    log(f"  {stage} done in {res.seconds:.1f} s")
                status = "FINISHED"
            except BaseException as e:
                status = "KILLED" if isinstance(e, KeyboardInterrupt) else "FAILED"
                raise
            finally:
                tracking.finalize_scene_run(cl, rid, wt, scene, stages, status)
            new = cl.get_run(rid).data.metrics
            diffs = diff_metrics(orig.data.metrics, new, rtol, atol, psnr_atol) if orig is not None else \
                [MetricDiff(k, None, v, False, True) for k, v in sorted(new.items()) if "/" not in k]
            results.append(RerunResult(scene, commit, orig.info.run_id if orig else None, rid, diffs))
            verdict = ("not compared (no original run)" if orig is None else
                       "reproduced" if results[-1].ok else "DIFFERS")
            cl.set_tag(rid, "splatflow.rerun_verdict",
                       f"{verdict} (rtol={rtol}, atol={atol}, psnr_atol={psnr_atol})")
    return results
