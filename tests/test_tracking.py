"""MLflow tracking under real DVC: one run per scene per `dvc repro`, SIGTERM -> KILLED with DVC consistent,
reap of runs whose owner died, compare, batched step metrics.

The DVC project here has two trivial stages that go through `splatflow.tracking.stage_tracking` exactly as
`stage_main` does, so each test costs seconds instead of a reconstruction; the real stages are exercised by
tests/test_flows.py.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from splatflow import tracking
from splatflow.orchestrate import dvcrun
from tests._project import BIN, init_repo, run

FAKE_STAGE = textwrap.dedent('''
    """A stand-in stage: params -> step metrics -> an output file -> final metrics, inside stage_tracking."""
    import json, os, pathlib, sys, time
    import yaml
    from splatflow.tracking import stage_tracking, step_logger

    stage, scene = sys.argv[1], sys.argv[2]
    params = yaml.safe_load(open("params.yaml"))
    if os.environ.get("FAKE_LOG"):  # every stage that really runs leaves a line (tests of what reruns)
        with open(os.environ["FAKE_LOG"], "a") as log:
            log.write(f"{stage} {scene}\\n")
    with stage_tracking(stage, scene, params) as tracker:
        if os.environ.get("FAKE_FAIL_SCENE") == scene:
            raise RuntimeError(f"scene {scene} fails on purpose")
        steps = step_logger(stage)
        for i in range(params[stage]["steps"]):
            steps.log(i, {"loss": 1.0 / (i + 1)})
        steps.close()
        pathlib.Path("started").write_text(stage)
        time.sleep(float(os.environ.get("FAKE_SLEEP_" + stage.upper(), "0")))
        out = pathlib.Path(f"out/{scene}/{stage}.ply")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(f"ply {stage} {params[stage]['steps']}")
        metrics = {"psnr": 20.0 + params[stage]["steps"] / 100, "stage_seconds": 0.1}
        pathlib.Path(f"metrics/{scene}").mkdir(parents=True, exist_ok=True)
        pathlib.Path(f"metrics/{scene}/{stage}.json").write_text(json.dumps(metrics))
        tracker.log_result(metrics)
''')

DVC_YAML = textwrap.dedent('''
    stages:
      one:
        foreach: ${base.scenes}
        do:
          cmd: python fake_stage.py one ${key}
          deps:
            - ${item.source}
            - fake_stage.py
          params:
            - base.seed
            - one
          outs:
            - out/${key}/one.ply
          metrics:
            - metrics/${key}/one.json:
                cache: false
      two:
        foreach: ${base.scenes}
        do:
          cmd: python fake_stage.py two ${key}
          deps:
            - out/${key}/one.ply
          params:
            - two
          outs:
            - out/${key}/two.ply
          metrics:
            - metrics/${key}/two.json:
                cache: false
''')


def make_toy_project(root: Path, scenes=("a",), steps_one: int = 3) -> Path:
    """A git + DVC project with the two fake stages above (also used by tests/test_servers.py)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "fake_stage.py").write_text(FAKE_STAGE)
    (root / "dvc.yaml").write_text(DVC_YAML)
    params = {"base": {"scenes": {s: {"source": f"raw/{s}"} for s in scenes}, "seed": 0},
              "one": {"steps": steps_one}, "two": {"steps": 2}}
    (root / "params.yaml").write_text(json.dumps(params, indent=1))
    for s in scenes:
        (root / "raw" / s).mkdir(parents=True, exist_ok=True)
        (root / "raw" / s / "capture.txt").write_text(f"scene {s}")
    (root / ".gitignore").write_text("/mlflow.db\n/mlartifacts/\n/.splatflow/\n/metrics/\n/started\n")
    repo = Path(__file__).resolve().parents[1]
    # The project's own splatflow (linked, as in tests/_project.py): processes that start in the project folder --
    # the stages, Prefect's flow runs -- import the code under test, not whatever the venv has installed.
    (root / "splatflow").symlink_to(repo / "splatflow", target_is_directory=True)
    if (repo / "flows").is_dir():
        import shutil

        shutil.copytree(repo / "flows", root / "flows", ignore=shutil.ignore_patterns("__pycache__"),
                        dirs_exist_ok=True)
    return init_repo(root, "toy project")


def toy_env(root: Path, **extra) -> dict:
    env = dvcrun.stage_env({"SPLATFLOW_TRACKING": "on", "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}",
                            "MLFLOW_RUN_ID": None, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return make_toy_project(tmp_path_factory.mktemp("toy"))


@pytest.fixture()
def mlflow_client(toy, monkeypatch):
    monkeypatch.setenv("SPLATFLOW_TRACKING", "on")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{toy / 'mlflow.db'}")
    return tracking.client()


def scene_runs(cl, scene: str):
    exps = [e.experiment_id for e in cl.search_experiments()]
    return cl.search_runs(exps, filter_string=f"tags.`splatflow.scene` = '{scene}'",
                          order_by=["attributes.start_time DESC"])


def test_dvc_repro_logs_one_run_per_scene(toy, mlflow_client):
    p = run([str(BIN / "dvc"), "repro"], toy, env=toy_env(toy))
    assert "Running stage 'two@a'" in p.stdout
    runs = scene_runs(mlflow_client, "a")
    assert len(runs) == 1, "both stages of one dvc repro must share one MLflow run"
    r = runs[0]
    assert r.info.status == "FINISHED"
    # params of the sections each stage declares in dvc.yaml, final metrics with stage prefix, step metrics
    assert r.data.params["one.steps"] == "3" and r.data.params["two.steps"] == "2"
    assert r.data.params["base.seed"] == "0"
    assert r.data.metrics["one.psnr"] == pytest.approx(20.03)
    assert r.data.metrics["two.psnr"] == pytest.approx(20.02)
    history = mlflow_client.get_metric_history(r.info.run_id, "one/loss")
    assert [m.step for m in history] == [0, 1, 2]
    tags = r.data.tags
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=toy, capture_output=True, text=True).stdout.strip()
    assert tags["git.commit"] == head and tags["git.dirty"] == "false"
    assert tags["splatflow.started_by"] == "dvc" and tags["splatflow.host"]
    assert "dvc.hash.one" in tags  # stage one's dvc.lock entry existed when stage two logged
    arts = {a.path for a in mlflow_client.list_artifacts(r.info.run_id, "out/a")}
    assert arts == {"out/a/one.ply", "out/a/two.ply"}
    state = json.loads((toy / ".splatflow" / "runs" / "a.json").read_text())
    assert state["run_id"] == r.info.run_id

    # a param change reruns only stage two, in a *new* run seeded with stage one's current metrics
    params = json.loads((toy / "params.yaml").read_text())
    params["two"]["steps"] = 5
    (toy / "params.yaml").write_text(json.dumps(params, indent=1))
    p = run([str(BIN / "dvc"), "repro"], toy, env=toy_env(toy))
    assert "Running stage 'two@a'" in p.stdout and "Running stage 'one@a'" not in p.stdout
    runs = scene_runs(mlflow_client, "a")
    assert len(runs) == 2
    new = runs[0]
    assert new.info.run_id != r.info.run_id and new.info.status == "FINISHED"
    assert new.data.metrics["two.psnr"] == pytest.approx(20.05)
    assert new.data.metrics["one.psnr"] == pytest.approx(20.03)  # seeded from metrics/a/one.json
    assert new.data.tags["git.dirty"] == "true"  # params.yaml differs from the commit

    table = tracking.compare([r.info.run_id, new.info.run_id])
    assert ("param", "two.steps") in table.index and ("param", "one.steps") not in table.index
    assert table.loc[("metric", "two.psnr"), "delta"] == pytest.approx(0.03)
    run(["git", "checkout", "params.yaml"], toy)


def test_sigterm_marks_run_killed_and_dvc_reruns_the_stage(toy, mlflow_client):
    run([str(BIN / "dvc"), "repro"], toy, env=toy_env(toy))  # everything up to date first
    params = json.loads((toy / "params.yaml").read_text())
    params["one"]["steps"] = 4
    (toy / "params.yaml").write_text(json.dumps(params, indent=1))
    (toy / "started").unlink(missing_ok=True)
    before = len(scene_runs(mlflow_client, "a"))

    # dvc repro in its own process group, killed by the same code path a flow timeout/cancel uses
    env = toy_env(toy, FAKE_SLEEP_ONE="60")
    proc = subprocess.Popen([str(BIN / "dvc"), "repro", "--single-item", "one@a"], cwd=toy, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    t0 = time.monotonic()
    while not (toy / "started").exists():
        assert proc.poll() is None and time.monotonic() - t0 < 120, "stage never started"
        time.sleep(0.2)
    dvcrun.kill_group(proc)
    runs = scene_runs(mlflow_client, "a")
    assert len(runs) == before + 1
    assert runs[0].info.status == "KILLED"

    # DVC is consistent: the killed stage is stale, and the next repro reruns it and completes
    status = run([str(BIN / "dvc"), "status", "one@a"], toy, env=toy_env(toy))
    assert "one@a" in status.stdout and "up to date" not in status.stdout
    p = run([str(BIN / "dvc"), "repro"], toy, env=toy_env(toy))
    assert "Running stage 'one@a'" in p.stdout
    assert (toy / "out/a/one.ply").read_text() == "ply one 4"
    assert scene_runs(mlflow_client, "a")[0].info.status == "FINISHED"
    run(["git", "checkout", "params.yaml"], toy)


def test_reap_marks_runs_of_dead_owners_killed(toy, mlflow_client):
    import psutil

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    start = psutil.Process(dead.pid).create_time()
    dead.wait()
    orphan = tracking.create_scene_run(mlflow_client, "reap", toy, owner_pid=None, seed_metrics=False,
                                       tags={"splatflow.pid": str(dead.pid), "splatflow.pid_start": f"{start:.3f}"})
    alive = tracking.create_scene_run(mlflow_client, "reap", toy, seed_metrics=False)  # owned by this process
    assert mlflow_client.get_run(orphan).info.status == "RUNNING"

    dry = tracking.reap(dry_run=True)
    assert orphan in [r["run_id"] for r in dry] and mlflow_client.get_run(orphan).info.status == "RUNNING"
    reaped = tracking.reap()
    ids = [r["run_id"] for r in reaped]
    assert orphan in ids and alive not in ids
    assert mlflow_client.get_run(orphan).info.status == "KILLED"
    assert mlflow_client.get_run(alive).info.status == "RUNNING"
    mlflow_client.set_terminated(alive, "FINISHED")


def test_step_logger_batches_and_is_off_when_disabled(toy, mlflow_client, monkeypatch):
    run_id = tracking.create_scene_run(mlflow_client, "steps", toy, seed_metrics=False)
    monkeypatch.setenv("MLFLOW_RUN_ID", run_id)
    calls = []
    lg = tracking.step_logger("train")
    real = lg.client.log_batch
    lg.client.log_batch = lambda *a, **k: (calls.append(len(k.get("metrics", []))), real(*a, **k))[1]
    for step in range(1200):
        lg.log(step, {"loss": 1.0 / (step + 1), "psnr": float(step)})
    lg.close()
    history = mlflow_client.get_metric_history(run_id, "train/loss")
    assert len(history) == 1200 and history[-1].step == 1199
    assert sum(calls) == 2400 and len(calls) <= 2400 // tracking.STEP_FLUSH_ROWS + 2  # batched, not per step

    monkeypatch.setenv("SPLATFLOW_TRACKING", "off")
    off = tracking.step_logger("train")
    off.log(0, {"loss": 1.0})
    off.close()
    assert off.run_id is None
    mlflow_client.set_terminated(run_id, "FINISHED")


def test_tracking_uri_defaults_to_sqlite_at_repo_root(toy, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert tracking.tracking_uri(toy) == f"sqlite:///{toy.resolve() / 'mlflow.db'}"
    exp_tmp = toy / ".dvc" / "tmp" / "exps" / "tmpabc"
    exp_tmp.mkdir(parents=True)
    (exp_tmp / "params.yaml").write_text("{}")
    (exp_tmp / "dvc.yaml").write_text("stages: {}")
    # `dvc exp run --temp` workspaces log to the main repo's store, not into a folder that vanishes
    assert tracking.repo_root(exp_tmp) == toy.resolve()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5999")
    assert tracking.tracking_uri(toy) == "http://127.0.0.1:5999"


def test_rerun_tolerance_rules():
    from splatflow.orchestrate.rerun import diff_metrics

    orig = {"evaluate.psnr": 25.0, "sfm.camera_rotation_error_deg": 0.06, "train.train_seconds": 100.0,
            "train.peak_rss_mb": 900.0, "train/loss": 0.1}
    same = {"evaluate.psnr": 25.2, "sfm.camera_rotation_error_deg": 0.09, "train.train_seconds": 150.0,
            "train.peak_rss_mb": 990.0, "train/loss": 0.5}
    diffs = {d.key: d for d in diff_metrics(orig, same)}
    assert "train/loss" not in diffs  # live curves are not final metrics
    assert all(d.ok for d in diffs.values())
    assert not diffs["train.train_seconds"].judged and not diffs["train.peak_rss_mb"].judged
    worse = dict(same, **{"evaluate.psnr": 24.0, "sfm.camera_rotation_error_deg": 0.2})
    bad = {d.key for d in diff_metrics(orig, worse) if not d.ok}
    assert bad == {"evaluate.psnr", "sfm.camera_rotation_error_deg"}
    q = "export.files.splat.max_errors.quat"
    assert all(d.ok for d in diff_metrics({q: 2.18e-5}, {q: 2.34e-5}))  # quantisation residue: absolute tolerance
    assert not all(d.ok for d in diff_metrics({q: 2.18e-5}, {q: 5e-3}))
    mb = "export.files.spz.size_mb"  # rounded to 4 decimals: one unit of the last digit is rounding
    assert all(d.ok for d in diff_metrics({mb: 0.0019}, {mb: 0.0018}))
    assert not all(d.ok for d in diff_metrics({mb: 0.0019}, {mb: 0.0016}))
    missing = {d.key: d for d in diff_metrics(orig, {"evaluate.psnr": 25.0})}
    assert not missing["sfm.camera_rotation_error_deg"].ok  # a metric that vanished is a difference
    # PSNR is judged against the measured run-to-run spread when there is one
    spread = {d.key: d.ok for d in diff_metrics({"evaluate.psnr": 25.0}, {"evaluate.psnr": 25.4}, psnr_atol=0.5)}
    assert spread["evaluate.psnr"]
    assert not all(d.ok for d in diff_metrics({"evaluate.psnr": 25.0}, {"evaluate.psnr": 25.6}, psnr_atol=0.5))


def test_rerun_without_an_original_is_not_a_success(tmp_path):
    from splatflow.orchestrate.rerun import MetricDiff, RerunResult, measured_psnr_spread

    res = RerunResult("demo", "abc", None, "run1", [MetricDiff("evaluate.psnr", None, 25.0, False, True)])
    assert not res.compared and not res.ok
    assert measured_psnr_spread(tmp_path) is None
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "variance.json").write_text('{"psnr_spread_db": 0.31}')
    assert measured_psnr_spread(tmp_path) == 0.31


def test_a_stage_rerun_does_not_keep_seeded_metrics_it_no_longer_produces(tmp_path, monkeypatch):
    """A new scene run is seeded with the current metrics/<scene>/*.json. Rerunning export with only `formats: [spz]`
    left the run claiming the earlier run's `export.files.ply.bytes` and `.gaussians` (and an LPIPS variant now null
    kept its old score): `splatflow compare` and the MLflow UI showed a PLY this run never wrote. What the stage's
    new result lacks is logged as NaN."""
    from splatflow.tracking.runs import create_scene_run
    from splatflow.tracking.stage import StageTracker

    monkeypatch.setenv("SPLATFLOW_TRACKING", "on")
    (tmp_path / "metrics" / "s").mkdir(parents=True)
    (tmp_path / "metrics" / "s" / "export.json").write_text(json.dumps(
        {"gaussians": 463, "files": {"ply": {"bytes": 116352}, "spz": {"bytes": 8665}}}))
    (tmp_path / "metrics" / "s" / "evaluate.json").write_text(json.dumps({"psnr": 21.7, "lpips_vgg": 0.3}))
    cl = tracking.client(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = create_scene_run(cl, "s", tmp_path)
    assert cl.get_run(run_id).data.metrics["export.files.ply.bytes"] == 116352  # seeded

    StageTracker("export", "s", tmp_path, None, cl, run_id).log_result(
        {"gaussians": 461, "files": {"spz": {"bytes": 7913}}})
    StageTracker("evaluate", "s", tmp_path, None, cl, run_id).log_result({"psnr": 21.8, "lpips_vgg": None})
    m = cl.get_run(run_id).data.metrics
    assert m["export.gaussians"] == 461 and m["export.files.spz.bytes"] == 7913 and m["evaluate.psnr"] == 21.8
    assert math.isnan(m["export.files.ply.bytes"]) and math.isnan(m["evaluate.lpips_vgg"])
