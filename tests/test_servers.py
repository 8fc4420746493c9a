"""Real servers: a Prefect server and an MLflow server on loopback (free ports), the ``reconstruct/scene``
deployment on a process work pool, two workers, and a two-scene batch that must spread over both workers.

The scenes use the two-stage toy DVC project of tests/test_tracking.py (real DVC, real tracking, trivial work), so
the test measures orchestration rather than reconstruction (tests/test_flows.py runs the real stages).  Everything
started is stopped at the end, also on failure (the ``stack`` fixture, tests/conftest.py).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from splatflow.orchestrate import servers
from tests.test_tracking import make_toy_project

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def test_two_scene_batch_on_two_workers(stack, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName, FlowRunFilter

    from flows.batch import batch, child_runs
    from flows.deployments import deploy_scene, ensure_pool, served_deployments
    from splatflow import tracking

    toy = make_toy_project(tmp_path / "toy", scenes=("a", "b"))
    pool = "splatflow-test"
    ensure_pool(pool)
    deploy_scene(toy, pool)
    # workers poll every second (Prefect's default is 10 s): a toy flow run takes ~8 s, and once a CI run saw the
    # second worker's first poll lose the race for run a and its next poll come after run a had finished, so the
    # first worker ran both (2026-11-26)
    worker_env = {"MLFLOW_TRACKING_URI": stack["mlflow"].url, "SPLATFLOW_TRACKING": "on",
                  "PREFECT_WORKER_QUERY_SECONDS": "1"}
    workers = [servers.start_worker(pool, api_url=stack["api"], name=f"w{i}", limit=1, log_dir=tmp_path,
                                    cwd=toy, extra_env=worker_env) for i in range(2)]
    stack["started"].extend(workers)
    # both workers polling before any run exists: a worker still starting (tens of seconds on a loaded machine)
    # leaves both runs to the other one (2026-11-27, a CI run beside other jobs: [[], [a, b]])
    deadline = time.monotonic() + 180
    with get_client(sync_client=True) as client:
        while True:
            online = {w.name for w in client.read_workers_for_work_pool(pool) if w.status.value == "ONLINE"}
            if {"w0", "w1"} <= online:
                break
            assert time.monotonic() < deadline, f"online after 180 s: {sorted(online)}; worker logs in {tmp_path}"
            time.sleep(1)

    # the served deployments register with their schedule; the server's scheduler books the upcoming nightly runs
    for dep in served_deployments(toy, cron="0 3 * * *"):
        dep.apply()

    results = batch(scenes=["a", "b"], max_concurrent=2, repo=str(toy))
    assert sorted(r["job"] for r in results) == ["a", "b"]
    assert all(r["state"] == "COMPLETED" for r in results)

    # spread over both workers: each worker ran exactly one of the two flow runs (a flow run's own log lines,
    # "View at .../flow-run/<id>", appear in the log of the worker that ran it; both workers may *try* to submit
    # the same run, and the server aborts the second submission)
    ids = [r["flow_run_id"] for r in results]
    per_worker = [[i for i in ids if f"View at {stack['prefect'].url}/runs/flow-run/{i}" in w.log.read_text(errors="replace")]
                  for w in workers]
    assert sorted(len(x) for x in per_worker) == [1, 1], per_worker
    # each scene's flow run was created under a key of the batch and the scene: a creation request that Prefect's
    # client sends again (the server answered too late) returns that run instead of queueing a second run of the
    # scene (seen on a loaded machine, 2026-12-01: scene a ran twice, two MLflow runs)
    with get_client(sync_client=True) as client:
        runs = [client.read_flow_run(i) for i in ids]
        keys = [fr.idempotency_key or "" for fr in runs]
        assert [k.rsplit("-", 1)[-1] for k in keys] == ["a", "b"]
        assert all(k.startswith("splatflow-batch-") for k in keys)
        again = client.create_flow_run_from_deployment(runs[0].deployment_id, parameters=runs[0].parameters,
                                                       idempotency_key=keys[0])
        assert again.id == runs[0].id

    cl = tracking.client()
    exp = tracking.experiment_id(cl)
    parents = cl.search_runs([exp], filter_string="tags.`splatflow.kind` = 'batch'")
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    children = child_runs(cl, parents[0].info.run_id)
    assert sorted(c.data.tags["splatflow.scene"] for c in children) == ["a", "b"]
    for c in children:
        scene = c.data.tags["splatflow.scene"]
        assert c.info.status == "FINISHED"
        assert c.data.metrics["two.psnr"] == pytest.approx(20.02)
        assert c.data.tags["splatflow.workspace"] == "worktree"
        arts = {a.path for a in cl.list_artifacts(c.info.run_id, f"out/{scene}")}
        assert arts == {f"out/{scene}/one.ply", f"out/{scene}/two.ply"}
    assert "batch_summary.csv" in {a.path for a in cl.list_artifacts(parents[0].info.run_id)}
    # worktrees are gone; the main checkout's DVC cache holds the results
    assert not any((toy / ".dvc" / "tmp" / "splatflow" / "wt").iterdir())
    assert any((toy / ".dvc" / "cache").rglob("*"))

    with get_client(sync_client=True) as client:
        deadline = time.monotonic() + 60
        while True:
            runs = client.read_flow_runs(deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=["nightly"])),
                                         flow_run_filter=FlowRunFilter())
            scheduled = [r for r in runs if r.state and r.state.is_scheduled()]
            if scheduled or time.monotonic() > deadline:
                break
            time.sleep(1)
    assert scheduled, "the cron deployment got no scheduled runs"
    assert all(r.expected_start_time.hour == 3 and r.expected_start_time.minute == 0 for r in scheduled)

    for w in workers:
        w.stop()
    assert not any(w.alive() for w in workers)
    assert os.path.exists(Path(stack["prefect"].log))
