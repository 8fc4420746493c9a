"""Prefect flow ``batch``: many scenes and/or a sweep of param overrides, fanned out as scene flow runs.

Each (scene, config) pair becomes its own ``reconstruct`` flow run started through the deployment
``reconstruct/scene`` (``run_deployment``), so the runs spread over every worker polling the ``splatflow`` work
pool -- on this machine or on others (docs/orchestration.md).  At most ``max_concurrent`` are in flight.

Concurrency and DVC: two ``dvc repro`` must never share a workspace, so every child runs in its own git worktree
of one fixed commit (``workspace="worktree"``) with its overrides applied to the worktree's params.yaml and the
main checkout's DVC cache shared (:mod:`splatflow.orchestrate.workspace`).  Unchanged upstream stages (ingest,
sfm for the same scene) come out of the cache instead of being recomputed.

MLflow: one parent run for the batch; each child's scene run carries ``mlflow.parentRunId``, so the MLflow UI nests
them, and the parent gets ``batch_summary.csv`` (child run, scene, config, status, final metrics).
"""

from __future__ import annotations

import contextlib
import csv
import io
import itertools
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

from prefect import flow, get_run_logger, task

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `flows.reconstruct` when loaded by file path

from splatflow import tracking  # noqa: E402
from splatflow.orchestrate import dvcrun  # noqa: E402
from splatflow.orchestrate.workspace import resolve_commit  # noqa: E402

SCENE_DEPLOYMENT = "reconstruct/scene"
_SLOTS: dict[str, threading.Semaphore] = {}


@task(cache_policy=None, persist_result=False)
def launch_scene(job: dict[str, Any], deployment: Optional[str], slots_key: str) -> dict[str, Any]:
    """Start one scene flow run (through the deployment, or in-process when ``deployment`` is None) and wait."""
    logger = get_run_logger()
    with _SLOTS[slots_key]:
        label = job["run_name"]
        if deployment:
            from prefect.deployments import run_deployment

            fr = run_deployment(name=deployment, parameters=job, timeout=None, as_subflow=True,
                                flow_run_name=f"{label}")
            state = fr.state.type.value if fr.state else "UNKNOWN"
            logger.info("%s: flow run %s ended %s", label, fr.name, state)
            return {"job": label, "flow_run_id": str(fr.id), "state": state}
        from flows.reconstruct import reconstruct

        st = reconstruct(**job, return_state=True)
        return {"job": label, "flow_run_id": "", "state": st.type.value}


@flow(name="batch", log_prints=True)
def batch(scenes: Optional[list[str]] = None, sweep: Optional[list[dict[str, Any]]] = None,
          max_concurrent: int = 2, deployment: Optional[str] = SCENE_DEPLOYMENT, repo: Optional[str] = None,
          commit: str = "HEAD", force: bool = False, stage_timeout_s: Optional[float] = None) -> list[dict]:
    """Reconstruct ``scenes`` (default: every scene in dvc.yaml) for each config of ``sweep``.

    ``sweep`` is a list of override dicts (``[{"train.max_steps": 500}, {"train.max_steps": 1000}]``); without it
    each scene runs once with params.yaml as committed.  ``deployment=None`` runs the children in this process
    (no workers needed).  ``force`` reruns every stage even when DVC finds it up to date.
    """
    logger = get_run_logger()
    main_root = tracking.repo_root(repo or os.environ.get("SPLATFLOW_REPO") or Path.cwd())
    sha = resolve_commit(main_root, commit)
    scenes = list(scenes or dvcrun.scenes_in_graph(main_root))
    configs: list[dict[str, Any]] = list(sweep or [{}])
    if not scenes:
        raise ValueError(f"no scenes: dvc.yaml in {main_root} has no foreach stages over base.scenes")

    parent_id, cl = None, None
    if tracking.enabled():
        cl = tracking.client(tracking.tracking_uri(main_root))
        exp = tracking.experiment_id(cl)
        tags = {"splatflow.kind": "batch", "splatflow.scenes": ",".join(scenes), "git.commit": sha,
                "mlflow.source.git.commit": sha, **tracking._process_tags()}
        parent = cl.create_run(exp, run_name=f"batch-{time.strftime('%Y%m%d-%H%M%S')}", tags=tags)
        parent_id = parent.info.run_id
        tracking._log_batch(cl, parent_id, params={"batch.scenes": ",".join(scenes), "batch.configs": str(configs),
                                                     "batch.max_concurrent": str(max_concurrent)})

    jobs = []
    for (scene, (ci, cfg)) in itertools.product(scenes, enumerate(configs)):
        name = scene if len(configs) == 1 else f"{scene}-cfg{ci}"
        jobs.append({"scene": scene, "repo": str(main_root), "workspace": "worktree", "commit": sha,
                     "overrides": cfg or None, "force": force, "stage_timeout_s": stage_timeout_s,
                     "parent_run_id": parent_id, "run_name": name, "tags": {"splatflow.batch_config": str(ci)}})
    logger.info("batch of %d scene runs (%d scenes x %d configs), %d at a time, via %s", len(jobs), len(scenes),
                len(configs), max_concurrent, deployment or "this process")

    key = f"{os.getpid()}-{time.monotonic_ns()}"
    _SLOTS[key] = threading.Semaphore(max(1, max_concurrent))
    status = "FAILED"
    try:
        futures = [launch_scene.with_options(task_run_name=f"launch-{j['run_name']}").submit(j, deployment, key)
                   for j in jobs]
        results = [f.result() for f in futures]
        failed = [r for r in results if r["state"] != "COMPLETED"]
        status = "FINISHED" if not failed else "FAILED"
    except BaseException:
        status = "KILLED"
        raise
    finally:
        _SLOTS.pop(key, None)
        if cl is not None:
            with contextlib.suppress(Exception):
                _summarise(cl, parent_id)
            with contextlib.suppress(Exception):
                cl.set_terminated(parent_id, status)
    if cl is not None:
        with contextlib.suppress(Exception):
            _publish_table(cl, parent_id)
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(results)} scene runs did not complete: "
                           + ", ".join(f"{r['job']} ({r['state']})" for r in failed))
    return results


def child_runs(cl, parent_id: str) -> list:
    exps = [e.experiment_id for e in cl.search_experiments()]
    return cl.search_runs(exps, filter_string=f"tags.`mlflow.parentRunId` = '{parent_id}'", max_results=1000)


def _summarise(cl, parent_id: str) -> None:
    """``batch_summary.csv`` in the parent run: one row per child with its status and final metrics."""
    runs = child_runs(cl, parent_id)
    keys = sorted({k for r in runs for k in r.data.metrics if "/" not in k})
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["run_id", "run_name", "scene", "config", "overrides", "status", *keys])
    for r in sorted(runs, key=lambda r: r.info.run_name or ""):
        t = r.data.tags
        w.writerow([r.info.run_id, r.info.run_name, t.get("splatflow.scene"), t.get("splatflow.batch_config"),
                    t.get("splatflow.overrides", ""), r.info.status, *[r.data.metrics.get(k, "") for k in keys]])
    with tempfile.TemporaryDirectory() as tmp:
        p = Path(tmp) / "batch_summary.csv"
        p.write_text(buf.getvalue())
        cl.log_artifact(parent_id, str(p))


def _publish_table(cl, parent_id: str) -> None:
    """A Prefect table artifact in the batch flow run: one row per scene run with its headline metrics."""
    from prefect.artifacts import create_table_artifact

    rows = []
    for r in sorted(child_runs(cl, parent_id), key=lambda r: r.info.run_name or ""):
        m, t = r.data.metrics, r.data.tags
        rows.append({"run": r.info.run_name, "scene": t.get("splatflow.scene"),
                     "overrides": t.get("splatflow.overrides", ""), "status": r.info.status,
                     "psnr": m.get("evaluate.psnr"), "ssim": m.get("evaluate.ssim"),
                     "gaussians": m.get("evaluate.gaussians"), "train_s": m.get("train.train_seconds"),
                     "mlflow_run": tracking.run_ui_url(r.info.experiment_id, r.info.run_id)})
    if rows:
        create_table_artifact(rows, key="splatflow-batch", description="scene runs of this batch")


if __name__ == "__main__":
    batch(scenes=sys.argv[1:] or None, deployment=None)
