"""Worker hosts that share nothing but the network, exactly as docs/orchestration.md's runbook sets them up.

On one machine (tests/_hosts.py): an OpenSSH server holding the DVC remote, the shared services of ``splatflow serve
--shared`` (a PostgreSQL cluster of their own, Prefect and MLflow on it), worker "hosts" -- each a clone of the
project from a bare git remote with its own venv, DVC cache, ``$HOME`` and SSH key -- that join with ``splatflow
worker --server URL``, and the user's checkout, which starts ``splatflow batch --hosts a b c``.  Everything talks
over loopback; the hosts never see the user's folder.  The scenes are the two-stage toy DVC project of
tests/test_tracking.py (real DVC, real tracking, trivial work), so the tests measure the orchestration.

Skips with the reason when PostgreSQL or the OpenSSH server cannot be run here (Debian: ``apt-get install
postgresql openssh-server``; .ci/run installs them).
"""

from __future__ import annotations

import contextlib
import subprocess
import json
import time
from pathlib import Path

import pytest
import yaml

from tests import _hosts
from tests._project import BIN, run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

SCENES = ("a", "b", "c")


@pytest.fixture(scope="module")
def team(tmp_path_factory):
    why = _hosts.missing_reason()
    if why:
        pytest.skip(why)
    with _hosts.team(tmp_path_factory.mktemp("team"), SCENES) as t:
        config = (t.tmp / "server" / "home" / ".config" / "splatflow" / "shared.yaml").read_text()
        assert t.settings["PREFECT_API_URL"] == f"{t.server}/api"
        assert t.settings["SPLATFLOW_DVC_REMOTE"].startswith(f"ssh://{t.ssh.user}@127.0.0.1:{t.ssh.port}/")
        assert "postgres" not in config, "the database password stays on the server"
        yield t
    assert t.serve.poll() is not None and t.ssh.proc.poll() is not None, "every server is stopped"


def batch(team, *scenes: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    p = team.batch(*scenes)
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-6000:]
    return p, time.monotonic() - t0


def scene_runs(team, scene: str | None = None):
    from splatflow import tracking

    cl = tracking.client(team.settings["MLFLOW_TRACKING_URI"])
    exps = [e.experiment_id for e in cl.search_experiments()]
    query = "tags.`splatflow.workspace` = 'host'" + (f" and tags.`splatflow.scene` = '{scene}'" if scene else "")
    return cl, cl.search_runs(exps, filter_string=query, order_by=["attributes.start_time ASC"])


def test_three_scene_batch_on_two_hosts_lands_in_the_users_checkout(team):
    user = team.user
    hosts = [team.start_host(h) for h in ("host1", "host2")]
    try:
        p, batch_s = batch(team, *SCENES)
        lines = [ln for ln in p.stdout.splitlines() if ": COMPLETED on host" in ln]
        assert len(lines) == 3, p.stdout[-3000:]
        ran_on = {ln.split(" on ")[1].split()[0] for ln in lines}
        assert ran_on == {"host1", "host2"}, f"both hosts take scenes: {lines}"
    finally:
        team.stop_workers()

    # the user's checkout: every scene's lock entries, metrics and outputs, `dvc status` clean
    lock = yaml.safe_load((user / "dvc.lock").read_text())["stages"]
    assert sorted(lock) == sorted(f"{st}@{s}" for s in SCENES for st in ("one", "two"))
    for s in SCENES:
        assert json.loads((user / "metrics" / s / "two.json").read_text())["psnr"] == pytest.approx(20.02)
        assert (user / "out" / s / "two.ply").read_text() == "ply two 2"
    st = run([str(BIN / "dvc"), "status"], user, env=team.user_env)
    assert "up to date" in st.stdout, st.stdout
    # git sees what a local `dvc repro` leaves: dvc.lock, the metrics, .gitignore entries for the outputs
    dirty = run(["git", "status", "--porcelain", "-uall"], user).stdout.split("\n")
    expected = {"dvc.lock", *[f"metrics/{s}/{st}.json" for s in SCENES for st in ("one", "two")],
                *[f"out/{s}/.gitignore" for s in SCENES]}
    assert {ln[3:] for ln in dirty if ln} == expected, dirty

    # each host kept to its own clone and DVC cache; the scenes' outputs are in the hosts' caches, not the user's
    for clone, _, _ in hosts:
        assert any((clone / ".dvc" / "cache").rglob("*")), f"{clone} has its own DVC cache"
        assert not (clone / "dvc.lock").exists()

    # MLflow (on PostgreSQL): the scene runs with their artifacts through the server
    cl, runs = scene_runs(team)
    assert sorted(r.data.tags["splatflow.scene"] for r in runs) == list(SCENES)
    for r in runs:
        assert r.info.status == "FINISHED"
        assert r.info.artifact_uri.startswith("mlflow-artifacts:"), r.info.artifact_uri
        scene = r.data.tags["splatflow.scene"]
        arts = {a.path for a in cl.list_artifacts(r.info.run_id, f"out/{scene}")}
        assert arts == {f"out/{scene}/one.ply", f"out/{scene}/two.ply"}
    assert any((team.state / "srv" / "mlartifacts").rglob("two.ply")), "artifacts are stored by the server"
    exps = [e.experiment_id for e in cl.search_experiments()]
    parents = cl.search_runs(exps, filter_string="tags.`splatflow.kind` = 'batch'")
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    summary = Path(cl.download_artifacts(parents[0].info.run_id, "batch_summary.csv", str(team.tmp)))
    rows = [r.split(",") for r in summary.read_text().splitlines()]
    assert len(rows) == 4 and {r[rows[0].index("host")] for r in rows[1:]} == {"host1", "host2"}
    print(f"three-scene batch on two hosts: {batch_s:.0f} s")


def kill_host(proc: subprocess.Popen) -> None:
    """The host dies: SIGKILL to its worker and every process below it (the flow run, dvc, the stage)."""
    import psutil

    procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.kill()
    proc.wait()


def test_a_host_killed_mid_scene_reruns_it_on_the_other(team):
    user = team.user
    # a new commit for scene a's second stage; on host3 that stage hangs, so host3 is killed in the middle of it
    params = json.loads((user / "toy.yaml").read_text())
    params["two"]["steps"] = 4
    (user / "toy.yaml").write_text(json.dumps(params, indent=1))
    run(["git", "commit", "-qam", "two.steps 4"], user)
    run(["git", "push", "-q", "origin", "HEAD:refs/heads/main"], user)

    fast = {"PREFECT_WORKER_HEARTBEAT_SECONDS": "5"}  # lost after 3 missed reports: 15 s instead of 90 s
    _, doomed, _ = team.start_host("host3", FAKE_SLEEP_TWO="900", **fast)
    clone3 = team.tmp / "host3" / "clone"
    result: dict = {}
    import threading

    t = threading.Thread(target=lambda: result.update(zip(("p", "s"), batch(team, "a"))), daemon=True)
    t.start()
    _hosts.wait_for("host3 reaches stage two@a", lambda: _has_started_two(clone3), 600)
    _, survivor, _ = team.start_host("host4", **fast)
    try:
        kill_host(doomed)
        t.join(900)
        assert not t.is_alive(), "the batch did not end after its host was killed"
    finally:
        team.stop_workers()
    p = result["p"]
    assert "a: COMPLETED on host4" in p.stdout, p.stdout[-4000:]

    # the checkout has the rerun's results, and `dvc status` is clean for scene a (two@b and two@c are stale: the
    # commit changed every scene's `two` steps, and only a ran)
    assert (user / "out" / "a" / "two.ply").read_text() == "ply two 4"
    assert json.loads((user / "metrics" / "a" / "two.json").read_text())["psnr"] == pytest.approx(20.04)
    st = run([str(BIN / "dvc"), "status", "one@a", "two@a"], user, env=team.user_env)
    assert "up to date" in st.stdout, st.stdout

    # the lost run: KILLED in MLflow, naming the host, with nothing published; the rerun FINISHED on host4
    cl, runs = scene_runs(team, "a")
    lost, rerun = runs[-2], runs[-1]
    assert lost.info.status == "KILLED" and lost.data.tags.get("splatflow.lost_host") == "host3"
    assert not cl.list_artifacts(lost.info.run_id, "splatflow-results")
    assert rerun.info.status == "FINISHED" and rerun.data.tags["splatflow.host"] == "host4"

    # and in Prefect the first attempt is Crashed
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: team.settings["PREFECT_API_URL"]}), \
            get_client(sync_client=True) as client:
        tries = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=["a", "a-try2"])))
    states = sorted((fr.name, fr.state.type.value) for fr in tries if "splatflow-host:host3" in fr.tags
                    or "splatflow-host:host4" in fr.tags)
    assert ("a-try2", "COMPLETED") in states and any(s == "CRASHED" for _, s in states), states


def _has_started_two(clone: Path) -> bool:
    return any(f.read_text() == "two" for f in (clone / ".dvc" / "tmp" / "splatflow" / "wt").glob("*/started"))
