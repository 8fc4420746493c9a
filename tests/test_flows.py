"""`splatflow run` as a Prefect flow run on a tiny synthetic scene, what it records in Prefect and MLflow, `rerun` of
a past commit, and a batch rerun.

One throw-away project (tests/_project.py, tiny params) is reconstructed once, as a user runs it: ``splatflow run
tiny --view`` against a real Prefect server (the ``prefect_server`` fixture, one for the module), tracking into the
project's sqlite store. The run must show in Prefect as a ``reconstruct`` flow run with one completed task per DVC
stage, named after the stage (also in the UI as headless Chromium sees it), keep DVC's own output in the terminal,
reach the train stage with ``--view``, and a second run must mark the stages DVC skipped (state ``Skipped``). The
scene's MLflow run must hold the params, every stage's final metrics and the exported PLY (read back with
plyfile). Then the project moves on by a commit and ``rerun_commit`` reproduces the previous commit in a worktree
with every stage forced, and must match the original run's metrics within the stated tolerance.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from splatflow import tracking
from splatflow.orchestrate import dvcrun
from tests import _chromium
from tests._project import BIN, TINY_PARAMS, make_project, project_env, run, task_runs, tracked_env

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    return make_project(tmp_path_factory.mktemp("flowproj") / "p", overrides=TINY_PARAMS)


def _store(project: Path) -> str:
    return f"sqlite:///{project / 'mlflow.db'}"


@pytest.fixture(scope="module")
def flow_run(project, prefect_server):
    """``splatflow run tiny --view`` once, on the module's Prefect server, tracking into the project's sqlite store:
    its output, its ``reconstruct`` flow run with the task runs and artifacts, and the scene's MLflow run id."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (ArtifactFilter, ArtifactFilterFlowRunId, FlowFilter, FlowFilterName)

    from splatflow.orchestrate import servers

    env = tracked_env(project, PREFECT_API_URL=prefect_server["api"])
    out = run([str(BIN / "splatflow"), "run", "tiny", "--view", "--view-port", str(servers.free_port())], project,
              env=env)
    stages = dvcrun.stage_order(project, "tiny")
    with get_client(sync_client=True) as client:
        (fr,) = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["reconstruct"])))
        tasks = task_runs(client, fr.id, len(stages))
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(
            any_=[fr.id])))
    cl = tracking.client(_store(project))
    runs = cl.search_runs([e.experiment_id for e in cl.search_experiments()],
                          filter_string=f"tags.`prefect.flow_run_id` = '{fr.id}'")
    assert len(runs) == 1, [r.data.tags for r in runs]
    return {"out": out, "flow_run": fr, "tasks": tasks, "artifacts": artifacts, "run_id": runs[0].info.run_id,
            "stages": stages}


def test_run_shows_in_prefect_with_skipped_stages_marked(project, flow_run, prefect_server):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName
    from prefect.client.schemas.sorting import FlowRunSort

    stages = flow_run["stages"]
    first = flow_run["out"]
    assert "$ dvc repro --single-item train@tiny" in first.stdout  # DVC's own output, as `splatflow run` showed
    assert "Running stage 'train@tiny'" in first.stdout
    assert "live view: open http://127.0.0.1:" in first.stdout, first.stdout[-3000:]
    assert f"{len(stages)} stages ran, 0 up to date" in first.stdout
    assert "Task run" not in first.stdout + first.stderr, "Prefect's log lines repeat the stages' output"

    # untracked (what is checked is Prefect's record and the terminal): the rerun test below finds the first run
    # as the one MLflow run of its commit
    env = {**project_env(), "PREFECT_API_URL": prefect_server["api"], "SPLATFLOW_TRACKING": "off"}
    second = run([str(BIN / "splatflow"), "run", "tiny"], project, env=env)
    # settings runs in every repro (dvc.yaml: always_changed); DVC finds every later stage up to date
    assert f"1 stage ran, {len(stages) - 1} up to date" in second.stdout, second.stdout[-3000:]
    assert f"{prefect_server['prefect'].url}/runs/flow-run/" in second.stdout

    with get_client(sync_client=True) as client:
        flow_runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["reconstruct"])),
                                          sort=FlowRunSort.START_TIME_ASC)
        assert len(flow_runs) == 2 and all(fr.state.is_completed() for fr in flow_runs)
        assert flow_runs[0].id == flow_run["flow_run"].id
        ran, skipped = (task_runs(client, fr.id, len(stages)) for fr in flow_runs)
    assert sorted(t.name for t in ran) == sorted(stages) == sorted(t.name for t in skipped)
    assert {t.state.name for t in ran} == {"Completed"}, "a fresh project: every stage ran"
    assert {t.name: t.state.name for t in skipped} == {s: "Completed" if s.startswith("settings@") else "Skipped"
                                                        for s in stages}, "nothing changed: DVC skipped the stages"
    assert all(t.state.is_completed() for t in skipped)  # skipped is a way of finishing: the flow goes on

    if _chromium.find() is None:
        pytest.skip(_chromium.SKIP_REASON)
    train = next(t for t in skipped if t.name == "train@tiny")
    page = f"{prefect_server['prefect'].url}/runs/task-run/{train.id}"
    dom = _chromium.dump_dom_until(page, lambda d: "train@tiny" in d and "Skipped" in d)
    assert "train@tiny" in dom and "Skipped" in dom, "the Prefect UI does not show the stage as skipped"
    ran_train = next(t for t in ran if t.name == "train@tiny")
    dom = _chromium.dump_dom_until(f"{prefect_server['prefect'].url}/runs/task-run/{ran_train.id}",
                                   lambda d: "train@tiny" in d and "Completed" in d)
    assert "Completed" in dom and "Skipped" not in dom


def test_scene_flow_runs_every_stage_and_logs_to_mlflow(project, flow_run, tmp_path):
    assert flow_run["flow_run"].state.is_completed(), flow_run["out"].stdout[-3000:]
    stages = dvcrun.stage_order(project, "tiny")
    assert [s.partition("@")[0] for s in stages] == ["settings", "ingest", "sfm", "split", "train", "prune", "evaluate",
                                                     "export", "report"]
    tasks = {t.name: t for t in flow_run["tasks"]}
    assert set(tasks) == set(stages), "one Prefect task per DVC stage, named after it"
    assert all(t.state.is_completed() for t in tasks.values())

    cl = tracking.client(_store(project))
    run_id = flow_run["run_id"]
    r = cl.get_run(run_id)
    assert r.info.status == "FINISHED"
    assert r.data.params["train.max_steps"] == "10" and r.data.params["base.seed"] == "0"
    m = r.data.metrics
    for stage in ("ingest", "sfm", "split", "train", "prune", "evaluate", "export", "report"):
        assert any(k.startswith(stage + ".") for k in m), f"no final metrics of {stage}"
    assert m["sfm.images_registered"] == 12
    assert m["evaluate.psnr"] > 12.0  # a flat grey image scores ~9 dB on this scene
    assert len(cl.get_metric_history(run_id, "train/loss")) >= 3  # live step metrics, batched
    assert r.data.tags["splatflow.started_by"] == "prefect"
    assert r.data.tags["prefect.flow_run_id"] == str(flow_run["flow_run"].id)
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

    assert flow_run["flow_run"].state.is_completed()
    original = flow_run["run_id"]
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


def test_batch_rerun_skips_the_scenes_that_finished(prefect_server, tmp_path, monkeypatch):
    """A batch where scene ``b`` fails, then the same batch again: ``a`` finished the first time, so the rerun
    runs none of its stages (it records a skipped run pointing at the first) while ``b`` runs to the end.  One
    scene at a time (``max_concurrent=1``), enforced by the batch's Prefect concurrency limit: the scene runs of
    a batch never overlap, and the limit is gone afterwards."""
    from prefect.client.orchestration import get_client

    from flows.batch import batch
    from tests.test_tracking import make_toy_project

    toy = make_toy_project(tmp_path / "toy", scenes=("a", "b"))
    # Stage one keeps a persistent output, as train does (its checkpoint): DVC's run cache then cannot restore it
    # in a fresh worktree, so only the skip keeps a finished scene from computing again.
    dvc_yaml = (toy / "dvc.yaml").read_text()
    (toy / "dvc.yaml").write_text(dvc_yaml.replace("- out/${key}/one.ply\n", "- out/${key}/one.ply:\n              persist: true\n", 1))
    run(["git", "commit", "-qam", "stage one keeps its output"], toy)
    log = tmp_path / "stages.log"  # one line per stage process that really ran
    monkeypatch.setenv("SPLATFLOW_TRACKING", "on")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{toy / 'mlflow.db'}")
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    monkeypatch.setenv("FAKE_LOG", str(log))
    monkeypatch.setenv("FAKE_FAIL_SCENE", "b")
    cl = tracking.client()

    def children():  # the latest batch's parent run and its scene runs by scene
        parents = cl.search_runs([tracking.experiment_id(cl)], filter_string="tags.`splatflow.kind` = 'batch'",
                                 order_by=["attributes.start_time DESC"])
        return parents[0], {r.data.tags["splatflow.scene"]: r for r in tracking.child_runs(cl, parents[0].info.run_id)}

    first = batch(scenes=["a", "b"], deployment=None, repo=str(toy), max_concurrent=1, return_state=True)
    assert first.is_failed()
    parent1, kids1 = children()
    assert parent1.info.status == "FAILED"
    assert kids1["a"].info.status == "FINISHED" and kids1["b"].info.status == "FAILED"
    runs_1 = sorted(kids1.values(), key=lambda r: r.info.start_time)
    assert runs_1[0].info.end_time <= runs_1[1].info.start_time, "max_concurrent=1 but the scene runs overlapped"
    assert sorted(log.read_text().split("\n")[:-1]) == ["one a", "one b", "two a"]

    log.write_text("")
    monkeypatch.delenv("FAKE_FAIL_SCENE")
    second = batch(scenes=["a", "b"], deployment=None, repo=str(toy), max_concurrent=1, return_state=True)
    assert second.is_completed(), second
    results = {r["job"]: r for r in second.result()}
    with get_client(sync_client=True) as client:
        limits = client.read_global_concurrency_limits(limit=200)
    assert not [c.name for c in limits if c.name.startswith("splatflow-batch-")], "the batch left its limit"

    # scene a: no stage ran again; its new run says so, points at the finished one and carries its results
    assert sorted(log.read_text().split("\n")[:-1]) == ["one b", "two b"]
    assert results["a"]["skipped"] == "up to date" and results["b"]["skipped"] is None
    parent2, kids2 = children()
    assert parent2.info.status == "FINISHED" and parent2.info.run_id != parent1.info.run_id
    a1, a2 = kids1["a"], kids2["a"]
    assert a2.info.status == "FINISHED" and a2.data.tags["splatflow.skipped"] == "up to date"
    assert a2.data.tags["splatflow.same_as"] == a1.info.run_id
    assert a2.data.metrics["two.psnr"] == a1.data.metrics["two.psnr"] == pytest.approx(20.02)
    assert not cl.get_metric_history(a2.info.run_id, "one/loss"), "the skipped scene logged training steps"
    # the same stage outputs: the dvc.lock entries (deps, params and outs md5s) of the run that computed them
    assert {k: v for k, v in a2.data.tags.items() if k.startswith("dvc.hash.")} == \
        {k: v for k, v in a1.data.tags.items() if k.startswith("dvc.hash.")}
    # scene b ran to the end this time, all of its stages
    b2 = kids2["b"]
    assert b2.info.status == "FINISHED" and "splatflow.skipped" not in b2.data.tags
    assert b2.data.metrics["two.psnr"] == pytest.approx(20.02)
    summary = cl.download_artifacts(parent2.info.run_id, "batch_summary.csv", str(tmp_path))
    rows = {line.split(",")[2]: line for line in Path(summary).read_text().splitlines()[1:]}
    assert "up to date" in rows["a"] and "up to date" not in rows["b"]
