"""The Prefect scene flow on a tiny synthetic scene (Prefect's test harness) and `rerun` of a past commit.

One throw-away project (tests/_project.py, tiny params) is reconstructed once by the ``reconstruct`` flow:
every DVC stage must be a completed Prefect task named after the stage, and the scene's MLflow run must hold the
params, every stage's final metrics and the exported PLY (read back with plyfile).  Then the project moves on by a
commit and ``rerun_commit`` reproduces the previous commit in a worktree with every stage forced, and must match
the original run's metrics within the stated tolerance.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from splatflow import tracking
from splatflow.orchestrate import dvcrun
from tests._project import TINY_PARAMS, make_project, run

pytestmark = pytest.mark.slow



@pytest.fixture(scope="module")
def project(tmp_path_factory):
    return make_project(tmp_path_factory.mktemp("flowproj") / "p", overrides=TINY_PARAMS)


@pytest.fixture(scope="module")
def flow_run(project):
    """Run the reconstruct flow once, in Prefect's test harness, tracking into the project's sqlite store."""
    from prefect.testing.utilities import prefect_test_harness

    mp = pytest.MonkeyPatch()
    mp.setenv("SPLATFLOW_TRACKING", "on")
    mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{project / 'mlflow.db'}")
    mp.delenv("MLFLOW_RUN_ID", raising=False)
    try:
        with prefect_test_harness(server_startup_timeout=300):
            from prefect.client.orchestration import get_client
            from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

            from flows.reconstruct import reconstruct

            state = reconstruct(scene="tiny", repo=str(project), return_state=True)
            result = state.result(raise_on_failure=False)
            from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

            with get_client(sync_client=True) as client:
                frid = state.state_details.flow_run_id
                tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[frid])))
                artifacts = client.read_artifacts(
                    artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[frid])))
            yield {"state": state, "result": result, "tasks": tasks, "artifacts": artifacts}
    finally:
        mp.undo()


def test_scene_flow_runs_every_stage_and_logs_to_mlflow(project, flow_run, monkeypatch, tmp_path):
    assert flow_run["state"].is_completed(), flow_run["result"]
    stages = dvcrun.stage_order(project, "tiny")
    assert [s.partition("@")[0] for s in stages] == ["ingest", "sfm", "split", "train", "prune", "evaluate", "export",
                                                     "report"]
    tasks = {t.name: t for t in flow_run["tasks"]}
    assert set(tasks) == set(stages), "one Prefect task per DVC stage, named after it"
    assert all(t.state.is_completed() for t in tasks.values())

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{project / 'mlflow.db'}")
    cl = tracking.client()
    run_id = flow_run["result"]["run_id"]
    r = cl.get_run(run_id)
    assert r.info.status == "FINISHED"
    assert r.data.params["train.max_steps"] == "10" and r.data.params["base.seed"] == "0"
    m = r.data.metrics
    for stage in ("ingest", "sfm", "split", "train", "prune", "evaluate", "export", "report"):
        assert any(k.startswith(stage + ".") for k in m), f"no final metrics of {stage}"
    assert m["sfm.images_registered"] == 12
    assert m["evaluate.psnr"] > 12.0  # a flat grey image scores ~9 dB on this scene
    assert len(cl.get_metric_history(run_id, "train/loss")) >= 3  # live step metrics, batched
    assert r.data.tags["splatflow.started_by"] == "prefect" and r.data.tags["prefect.flow_run_id"]
    assert r.data.tags["dvc.hash.export"]

    from plyfile import PlyData

    local = cl.download_artifacts(run_id, "models/tiny/export/scene.ply", str(tmp_path))
    ply = PlyData.read(local)
    assert ply["vertex"].count == int(m["export.gaussians"])
    names = {a.path for a in cl.list_artifacts(run_id, "models/tiny/export")}
    assert {"models/tiny/export/scene.splat", "models/tiny/export/scene.spz"} <= names
    assert {a.path for a in cl.list_artifacts(run_id, "plots/tiny")} >= {"plots/tiny/train.png"}
    # The report is an artifact of the scene run (MLflow previews HTML), the same file the stage wrote.
    report = cl.download_artifacts(run_id, "reports/tiny/index.html", str(tmp_path))
    assert Path(report).read_bytes() == (project / "reports/tiny/index.html").read_bytes()
    exp = cl.get_experiment(r.info.experiment_id)
    assert exp.tags.get("mlflow.experimentKind") == "custom_model_development"  # the UI's model-training view

    # The Prefect flow run holds a markdown artifact with the headline metrics and the MLflow run's link.
    (md,) = [a for a in flow_run["artifacts"] if a.type == "markdown"]
    assert md.key == "splatflow-tiny" and run_id in md.data
    assert f"| test PSNR (dB) | {m['evaluate.psnr']:.2f} |" in md.data
    assert str(project / "reports/tiny/index.html") in md.data


def test_rerun_of_previous_commit_reproduces_its_metrics(project, flow_run, monkeypatch):
    from splatflow.orchestrate.rerun import rerun_commit

    assert flow_run["state"].is_completed()
    original = flow_run["result"]["run_id"]
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=project, capture_output=True, text=True).stdout.strip()
    (project / "NOTES.md").write_text("a later commit\n")
    run(["git", "add", "NOTES.md"], project)
    run(["git", "commit", "-qm", "later"], project)

    monkeypatch.setenv("SPLATFLOW_TRACKING", "on")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{project / 'mlflow.db'}")
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    (res,) = rerun_commit(project, "HEAD~1", log=lambda s: None)
    assert res.commit == commit and res.original_run_id == original
    judged = {d.key: d for d in res.diffs if d.judged}
    assert {"evaluate.psnr", "evaluate.ssim", "sfm.images_registered", "export.gaussians"} <= set(judged)
    assert res.ok, [d for d in res.diffs if not d.ok]
    cl = tracking.client()
    new = cl.get_run(res.rerun_run_id)
    assert new.info.status == "FINISHED"
    assert new.data.tags["splatflow.rerun_of"] == original and new.data.tags["git.commit"] == commit
    assert new.data.tags["splatflow.rerun_verdict"].startswith("reproduced")
    # the rerun recomputed (forced), and left no worktree behind
    assert not any((project / ".dvc" / "tmp" / "splatflow" / "wt").iterdir())
    assert Path(project / "NOTES.md").exists()
