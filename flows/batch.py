"""Prefect flow ``batch``: many scenes and/or a sweep of param overrides, fanned out as scene flow runs.

Each (scene, config) pair becomes its own ``reconstruct`` flow run started through the deployment
``reconstruct/scene`` (``run_deployment``), so the runs spread over every worker polling the ``splatflow`` work
pool -- on this machine or on others (docs/orchestration.md).  At most ``max_concurrent`` are in flight: Prefect
itself enforces that, through a global concurrency limit made for this batch run (``splatflow-batch-<flow run
id>-<attempt>``, shown on the UI's Concurrency page while the batch runs, removed after it) whose slot each scene
holds. Each scene's flow run is created under an idempotency key of the batch run and the scene, so that a request
Prefect's client sends again makes no second run (:func:`launch_scene`).

Rerunning a batch skips the scenes that finished: each child gets ``skip_finished`` (unless ``force``), so a scene
whose earlier run at the same commit with the same overrides still holds (DVC finds every stage up to date with
the dvc.lock that run ended with) runs nothing and records a ``splatflow.skipped=up to date`` run pointing at it.

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
import time
import uuid
from pathlib import Path
from typing import Any, Iterator, Optional

from prefect import flow, get_run_logger, task
from prefect.concurrency.sync import concurrency

from splatflow import tracking
from splatflow.orchestrate import dvcrun, hosts
from splatflow.orchestrate.workspace import resolve_commit

SCENE_DEPLOYMENT = "reconstruct/scene"
HOST_DEPLOYMENT = "reconstruct/host"


def batch_key() -> str:
    """This batch run's key: its flow run's id and attempt (a batch retried from the Prefect UI keeps its id and
    counts up its attempt), or a random one outside a flow run (a direct call in a test)."""
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    if ctx is None or ctx.flow_run is None:
        return uuid.uuid4().hex
    return f"{ctx.flow_run.id}-{ctx.flow_run.run_count}"


@contextlib.contextmanager
def batch_limit(max_concurrent: int, key: str) -> Iterator[str]:
    """A Prefect global concurrency limit of ``max_concurrent`` slots for the batch run of ``key``
    (:func:`batch_key`); yields its name and deletes it afterwards (a limit left by a killed batch holds no slots:
    their leases expire)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate

    name = f"splatflow-batch-{key}"
    with get_client(sync_client=True) as client:
        client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=max(1, max_concurrent)))
    try:
        yield name
    finally:
        with get_client(sync_client=True) as client, contextlib.suppress(Exception):
            client.delete_global_concurrency_limit_by_name(name)


@task(cache_policy=None, persist_result=False)
def launch_scene(job: dict[str, Any], deployment: Optional[str], limit: str, key: str) -> dict[str, Any]:
    """Start one scene flow run (through the deployment, or in-process when ``deployment`` is None) and wait,
    holding one slot of the batch's concurrency limit while it runs.

    The flow run is created with an idempotency key (the batch's ``key`` and the job's name): Prefect's client
    sends a request again when the server answered too late or not at all, and a creation that had gone through
    would otherwise leave a second run of the scene queued, which a worker runs after the first (seen on a loaded
    machine: the server took over a minute to answer, and the scene ran twice)."""
    logger = get_run_logger()
    # strict: a missing limit is an error, not a silent "no limit"; a lease renewal hiccup must not kill a scene
    # that trains for hours (the slot is then merely counted as free early).
    with concurrency(limit, occupy=1, strict=True, raise_on_lease_renewal_failure=False):
        label = job["run_name"]
        if deployment:
            from prefect.deployments import run_deployment

            once = f"splatflow-batch-{key}-{label}"
            if job["workspace"] == "host":  # a host may disappear: the scene then reruns on another
                fr, tries = hosts.run_on_hosts(deployment, job, label, on_line=logger.info, idempotency_key=once)
            else:
                fr, tries = run_deployment(name=deployment, parameters=job, timeout=None, as_subflow=True,
                                           flow_run_name=f"{label}", idempotency_key=once), 1
            state = fr.state.type.value if fr.state else "UNKNOWN"
            logger.info("%s: flow run %s ended %s", label, fr.name, state)
            out = {"job": label, "flow_run_id": str(fr.id), "state": state, "attempts": tries}
            if state != "COMPLETED":
                out["reason"] = dvcrun.failure_reason(fr.state.message if fr.state else "")
                logger.error("%s: %s", label, out["reason"])
            elif job["workspace"] == "host":
                got = hosts.collect_scene(Path(job["repo"]), str(fr.id), job["scene"], on_line=logger.info)
                logger.info("%s: ran on %s in %.0f s; %d stages merged into %s", label, got["host"], got["seconds"],
                            len(got["stages"]), job["repo"])
                out.update(host=got["host"], seconds=got["seconds"])
            return out
        from flows.reconstruct import reconstruct

        st = reconstruct(**job, return_state=True)
        res = st.result(raise_on_failure=False) if st.is_completed() else None
        skipped = res.get("skipped") if isinstance(res, dict) else None
        out = {"job": label, "flow_run_id": "", "state": st.type.value, "skipped": skipped}
        if not st.is_completed():
            out["reason"] = dvcrun.failure_reason(st.message or "")
            logger.error("%s: %s", label, out["reason"])
        return out


@flow(name="batch", log_prints=True)
def batch(scenes: Optional[list[str]] = None, sweep: Optional[list[dict[str, Any]]] = None,
          max_concurrent: int = 2, deployment: Optional[str] = SCENE_DEPLOYMENT, repo: Optional[str] = None,
          commit: str = "HEAD", force: bool = False, stage_timeout_s: Optional[float] = None) -> list[dict]:
    """Reconstruct ``scenes`` (default: every scene in dvc.yaml) for each config of ``sweep``.

    ``deployment=HOST_DEPLOYMENT`` (``reconstruct/host``) runs each scene on a worker host with a clone of its
    own (docs/orchestration.md, "More than one machine"): the commit must be pushed to the git remote the hosts
    clone from, and each finished scene's lock entries, metrics and outputs are brought back into this checkout.

    ``sweep`` is a list of override dicts (``[{"train.max_steps": 500}, {"train.max_steps": 1000}]``); without it
    each scene runs once with params.yaml as committed.  ``deployment=None`` runs the children in this process
    (no workers needed).  ``force`` reruns every stage even when DVC finds it up to date, and every scene even
    when an earlier run of it finished (otherwise those are skipped).
    """
    logger = get_run_logger()
    main_root = tracking.repo_root(repo or os.environ.get("SPLATFLOW_REPO") or Path.cwd())
    sha = resolve_commit(main_root, commit)
    scenes = list(scenes or dvcrun.scenes_in_graph(main_root))
    configs: list[dict[str, Any]] = list(sweep or [{}])
    if not scenes:
        raise ValueError(f"no scenes: dvc.yaml in {main_root} has no foreach stages over base.scenes")
    if deployment == HOST_DEPLOYMENT and any(configs):
        raise ValueError("a batch on hosts brings each scene's results into your checkout, so it runs params.yaml "
                         "as committed: drop the sweep (-c), or commit the change, or run the sweep on "
                         f"{SCENE_DEPLOYMENT}")

    jobs = []
    tags = {"splatflow.kind": "batch", "splatflow.scenes": ",".join(scenes), "git.commit": sha,
            "mlflow.source.git.commit": sha}
    params = {"batch.scenes": ",".join(scenes), "batch.configs": str(configs), "batch.max_concurrent": str(max_concurrent)}
    with tracking.batch_run(main_root, name=f"batch-{time.strftime('%Y%m%d-%H%M%S')}", tags=tags, params=params,
                            before_end=_summarise) as parent:
        for (scene, (ci, cfg)) in itertools.product(scenes, enumerate(configs)):
            name = scene if len(configs) == 1 else f"{scene}-cfg{ci}"
            jobs.append({"scene": scene, "repo": str(main_root), "commit": sha,
                         "workspace": "host" if deployment == HOST_DEPLOYMENT else "worktree",
                         "overrides": cfg or None, "force": force, "stage_timeout_s": stage_timeout_s,
                         "parent_run_id": parent.run_id, "run_name": name,
                         "tags": {"splatflow.batch_config": str(ci)}, "skip_finished": not force})
        logger.info("batch of %d scene runs (%d scenes x %d configs), %d at a time, via %s", len(jobs), len(scenes),
                    len(configs), max_concurrent, deployment or "this process")
        key = batch_key()
        with batch_limit(max_concurrent, key) as limit:
            futures = [launch_scene.with_options(task_run_name=f"launch-{j['run_name']}").submit(j, deployment, limit,
                                                                                              key)
                       for j in jobs]
            results = [f.result() for f in futures]
        failed = [r for r in results if r["state"] != "COMPLETED"]
        if failed:
            parent.status = "FAILED"
    if parent.active:
        with contextlib.suppress(Exception):
            _publish_table(parent.client, parent.run_id)
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(results)} scene runs did not complete "
                           f"({', '.join(r['job'] for r in results if r not in failed) or 'none'} did):\n"
                           + "\n".join(f"  {r['job']} ({r['state']}): {r.get('reason', '')}" for r in failed))
    return results


child_runs = tracking.child_runs  # the batch's scene runs (kept here: tests and users import it from the flow)


def _summarise(cl, parent_id: str) -> None:
    """``batch_summary.csv`` in the parent run: one row per child with its status and final metrics."""
    runs = child_runs(cl, parent_id)
    keys = sorted({k for r in runs for k in r.data.metrics if "/" not in k})
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["run_id", "run_name", "scene", "config", "overrides", "host", "seconds", "status", "skipped", *keys])
    for r in sorted(runs, key=lambda r: r.info.run_name or ""):
        t = r.data.tags
        w.writerow([r.info.run_id, r.info.run_name, t.get("splatflow.scene"), t.get("splatflow.batch_config"),
                    t.get("splatflow.overrides", ""), t.get("splatflow.host", ""), _seconds(r), r.info.status,
                    t.get("splatflow.skipped", ""),
                    *[r.data.metrics.get(k, "") for k in keys]])
    with tempfile.TemporaryDirectory() as tmp:
        p = Path(tmp) / "batch_summary.csv"
        p.write_text(buf.getvalue())
        cl.log_artifact(parent_id, str(p))


def _seconds(r) -> str:
    """How long a scene run took (start to end), or '' while it has not ended."""
    return f"{(r.info.end_time - r.info.start_time) / 1000:.1f}" if r.info.end_time and r.info.start_time else ""


def _publish_table(cl, parent_id: str) -> None:
    """A Prefect table artifact in the batch flow run: one row per scene run with its headline metrics."""
    from prefect.artifacts import create_table_artifact

    rows = []
    for r in sorted(child_runs(cl, parent_id), key=lambda r: r.info.run_name or ""):
        m, t = r.data.metrics, r.data.tags
        rows.append({"run": r.info.run_name, "scene": t.get("splatflow.scene"),
                     "overrides": t.get("splatflow.overrides", ""), "host": t.get("splatflow.host", ""),
                     "seconds": _seconds(r), "status": r.info.status,
                     "skipped": t.get("splatflow.skipped", ""),
                     "psnr": m.get("evaluate.psnr"), "ssim": m.get("evaluate.ssim"),
                     "gaussians": m.get("evaluate.gaussians"), "train_s": m.get("train.train_seconds"),
                     "mlflow_run": tracking.run_ui_url(r.info.experiment_id, r.info.run_id)})
    if rows:
        create_table_artifact(rows, key="splatflow-batch", description="scene runs of this batch")


if __name__ == "__main__":
    batch(scenes=sys.argv[1:] or None, deployment=None)
