"""Worker hosts that share nothing but the network, exactly as docs/orchestration.md's runbook sets them up.

On one machine: the shared services of ``splatflow serve --shared`` (a PostgreSQL cluster started for the test,
Prefect and MLflow on it, a DVC remote folder), two "hosts" -- each a clone of the project from a bare git remote,
with its own DVC cache and ``$HOME`` -- that join with ``splatflow worker --server URL``, and the user's checkout,
which starts ``splatflow batch --hosts a b c``.  Everything talks over loopback; the hosts never see the user's
folder.  The scenes use the two-stage toy DVC project of tests/test_tracking.py (real DVC, real tracking, trivial
work), so the test measures the orchestration.  At the end the user's checkout must hold every scene's dvc.lock
entries, metrics and outputs with ``dvc status`` clean, both hosts must have run scenes, and the MLflow runs must
have their artifacts through the server.

Skips with the reason when PostgreSQL cannot be run here (Debian: ``apt-get install postgresql``; .ci/run
installs it).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from splatflow.orchestrate import postgres, servers
from tests._project import BIN, init_repo, run
from tests.test_tracking import DVC_YAML, FAKE_STAGE

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

SCENES = ("a", "b", "c")
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", autouse=True)
def postgres_available():
    why = postgres.missing_reason()
    if why:
        pytest.skip(f"PostgreSQL for the shared stores: {why}")


def env_for(home: Path, **extra: str) -> dict:
    """A process of one simulated host: its own $HOME (and so its own Prefect, DVC and MLflow user state)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "SPLATFLOW_"))}
    home.mkdir(parents=True, exist_ok=True)
    env.update({"HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"), "XDG_DATA_HOME": str(home / ".local"),
                "XDG_CACHE_HOME": str(home / ".cache"), "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}",
                "PYTHONPATH": "", "OMP_WAIT_POLICY": "PASSIVE", "DO_NOT_TRACK": "1",
                "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "MLFLOW_DISABLE_TELEMETRY": "true",
                "PREFECT_WORKER_QUERY_SECONDS": "1", "DVC_NO_ANALYTICS": "1", **extra})
    return env


def make_user_project(root: Path, origin: Path) -> Path:
    """The toy project with its raw captures added to DVC (the hosts pull them) and metrics in git, pushed to the
    bare git remote ``origin`` the hosts clone from."""
    root.mkdir(parents=True)
    (root / "fake_stage.py").write_text(FAKE_STAGE)
    (root / "dvc.yaml").write_text(DVC_YAML)
    params = {"base": {"scenes": {s: {"source": f"raw/{s}"} for s in SCENES}, "seed": 0},
              "one": {"steps": 3}, "two": {"steps": 2}}
    (root / "params.yaml").write_text(json.dumps(params, indent=1))
    (root / ".gitignore").write_text("/mlflow.db\n/mlartifacts/\n/.splatflow/\n/started\n")
    (root / "splatflow").symlink_to(REPO / "splatflow", target_is_directory=True)
    shutil.copytree(REPO / "flows", root / "flows", ignore=shutil.ignore_patterns("__pycache__"))
    (root / "stages").mkdir()  # what the CLI recognises a project by (the toy's stage lives in fake_stage.py)
    (root / "stages" / "__init__.py").write_text("")
    init_repo(root, "toy project")
    for s in SCENES:  # captures go to DVC, never to git
        (root / "raw" / s).mkdir(parents=True)
        (root / "raw" / s / "capture.txt").write_text(f"scene {s}")
    run([str(BIN / "dvc"), "add", *[f"raw/{s}" for s in SCENES]], root)
    run(["git", "add", "-A"], root)
    run(["git", "commit", "-qm", "raw captures in DVC"], root)
    run(["git", "init", "-q", "--bare", "--initial-branch=main", str(origin)], root)  # clones check out main
    run(["git", "remote", "add", "origin", str(origin)], root)
    run(["git", "push", "-q", "origin", "HEAD:refs/heads/main"], root)
    return root


def wait_for(what: str, check, timeout_s: float, procs=()) -> None:
    t0 = time.monotonic()
    while not check():
        for p, log in procs:
            if p.poll() is not None:
                raise AssertionError(f"{what}: a process exited ({p.returncode}):\n{Path(log).read_text()[-4000:]}")
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"{what}: not after {timeout_s:.0f} s")
        time.sleep(1)


def spawn(cmd: list[str], cwd: Path, env: dict, log: Path) -> subprocess.Popen:
    with open(log, "wb") as fh:
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)


def stop(proc: subprocess.Popen, timeout_s: float = 90) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def team(tmp_path_factory):
    """``splatflow serve --shared`` on free loopback ports, and the user's checkout set up as the runbook says:
    the shared addresses in its config file, the DVC remote configured, the raw captures pushed.  Stopped at the
    end of the module (workers are each test's own)."""
    tmp = tmp_path_factory.mktemp("team")
    # The state folder lives outside pytest's (mode 0700) tmp folder: as root, PostgreSQL runs as the postgres
    # user, which must reach its data folder.
    user = make_user_project(tmp / "user" / "project", tmp / "origin.git")
    state = Path(tempfile.mkdtemp(prefix="splatflow-shared-"))
    os.chmod(state, 0o755)
    pport, mport, gport = servers.free_port(), servers.free_port(), servers.free_port()
    serve_log = tmp / "serve.log"
    server_clone = tmp / "server" / "clone"  # the server host deploys from a clone of its own
    run(["git", "clone", "-q", str(tmp / "origin.git"), str(server_clone)], tmp)
    serve = spawn([str(BIN / "splatflow"), "serve", "--shared", "--state-dir", str(state / "srv"),
                   "--prefect-port", str(pport), "--mlflow-port", str(mport), "--pg-port", str(gport)],
                  server_clone, env_for(tmp / "server-home"), serve_log)
    try:
        wait_for("serve --shared", lambda: "Ctrl-C stops the services" in serve_log.read_text(), 600,
                 [(serve, serve_log)])
        config = tmp / "server-home" / ".config" / "splatflow" / "shared.yaml"
        settings = yaml.safe_load(config.read_text())
        assert settings["PREFECT_API_URL"] == f"http://127.0.0.1:{pport}/api"
        assert settings["MLFLOW_TRACKING_URI"] == f"http://127.0.0.1:{mport}"
        assert "postgres" not in config.read_text(), "the database password stays on the server"

        # the user's shell reads the same addresses from its own config file
        user_home = tmp / "user-home"
        (user_home / ".config" / "splatflow").mkdir(parents=True)
        shutil.copy(config, user_home / ".config" / "splatflow" / "shared.yaml")
        user_env = env_for(user_home)
        run([str(BIN / "dvc"), "remote", "add", "--local", "splatflow-shared", settings["SPLATFLOW_DVC_REMOTE"]],
            user, env=user_env)
        run([str(BIN / "dvc"), "push", "-r", "splatflow-shared", *[f"raw/{s}.dvc" for s in SCENES]], user,
            env=user_env)
        yield {"tmp": tmp, "state": state, "user": user, "user_env": user_env, "settings": settings,
               "server": f"http://127.0.0.1:{pport}"}
    finally:
        stop(serve)
        shutil.rmtree(state, ignore_errors=True)
    assert serve.poll() is not None


def start_host(team, name: str, **env: str) -> tuple[Path, subprocess.Popen, Path]:
    """A worker host: a clone of the git remote, its own $HOME and DVC cache, joined with `splatflow worker`."""
    tmp = team["tmp"]
    clone = tmp / name / "clone"
    if not clone.exists():
        run(["git", "clone", "-q", str(tmp / "origin.git"), str(clone)], tmp)
    log = tmp / f"{name}.log"
    w = spawn([str(BIN / "splatflow"), "worker", "--server", team["server"], "--clone", str(clone), "--name", name],
              clone, env_for(tmp / name / "home", **env), log)
    wait_for(f"worker {name}", lambda: "DVC remote" in log.read_text(), 120, [(w, log)])
    return clone, w, log


def batch(team, *scenes: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    p = run([str(BIN / "splatflow"), "batch", "--hosts", *scenes, "--max-concurrent", "2"], team["user"],
            env=team["user_env"], check=False, timeout=1200)
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-6000:]
    return p, time.monotonic() - t0


def scene_runs(team, scene: str | None = None):
    from splatflow import tracking

    cl = tracking.client(team["settings"]["MLFLOW_TRACKING_URI"])
    exps = [e.experiment_id for e in cl.search_experiments()]
    query = "tags.`splatflow.workspace` = 'host'" + (f" and tags.`splatflow.scene` = '{scene}'" if scene else "")
    return cl, cl.search_runs(exps, filter_string=query, order_by=["attributes.start_time ASC"])


def test_three_scene_batch_on_two_hosts_lands_in_the_users_checkout(team):
    user = team["user"]
    hosts = [start_host(team, h) for h in ("host1", "host2")]
    try:
        p, batch_s = batch(team, *SCENES)
        lines = [ln for ln in p.stdout.splitlines() if ": COMPLETED on host" in ln]
        assert len(lines) == 3, p.stdout[-3000:]
        ran_on = {ln.split(" on ")[1].split()[0] for ln in lines}
        assert ran_on == {"host1", "host2"}, f"both hosts take scenes: {lines}"
    finally:
        for _, w, _ in hosts:
            stop(w)

    # the user's checkout: every scene's lock entries, metrics and outputs, `dvc status` clean
    lock = yaml.safe_load((user / "dvc.lock").read_text())["stages"]
    assert sorted(lock) == sorted(f"{st}@{s}" for s in SCENES for st in ("one", "two"))
    for s in SCENES:
        assert json.loads((user / "metrics" / s / "two.json").read_text())["psnr"] == pytest.approx(20.02)
        assert (user / "out" / s / "two.ply").read_text() == "ply two 2"
    st = run([str(BIN / "dvc"), "status"], user, env=team["user_env"])
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
    assert any((team["state"] / "srv" / "mlartifacts").rglob("two.ply")), "artifacts are stored by the server"
    exps = [e.experiment_id for e in cl.search_experiments()]
    parents = cl.search_runs(exps, filter_string="tags.`splatflow.kind` = 'batch'")
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    summary = Path(cl.download_artifacts(parents[0].info.run_id, "batch_summary.csv", str(team["tmp"])))
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
    user = team["user"]
    # a new commit for scene a's second stage; on host3 that stage hangs, so host3 is killed in the middle of it
    params = json.loads((user / "params.yaml").read_text())
    params["two"]["steps"] = 4
    (user / "params.yaml").write_text(json.dumps(params, indent=1))
    run(["git", "commit", "-qam", "two.steps 4"], user)
    run(["git", "push", "-q", "origin", "HEAD:refs/heads/main"], user)

    fast = {"PREFECT_WORKER_HEARTBEAT_SECONDS": "5"}  # lost after 3 missed reports: 15 s instead of 90 s
    _, doomed, _ = start_host(team, "host3", FAKE_SLEEP_TWO="900", **fast)
    clone3 = team["tmp"] / "host3" / "clone"
    result: dict = {}
    import threading

    t = threading.Thread(target=lambda: result.update(zip(("p", "s"), batch(team, "a"))), daemon=True)
    t.start()
    wait_for("host3 reaches stage two@a", lambda: _has_started_two(clone3), 600)
    _, survivor, _ = start_host(team, "host4", **fast)
    try:
        kill_host(doomed)
        t.join(900)
        assert not t.is_alive(), "the batch did not end after its host was killed"
    finally:
        stop(survivor)
    p = result["p"]
    assert "a: COMPLETED on host4" in p.stdout, p.stdout[-4000:]

    # the checkout has the rerun's results, and `dvc status` is clean
    assert (user / "out" / "a" / "two.ply").read_text() == "ply two 4"
    assert json.loads((user / "metrics" / "a" / "two.json").read_text())["psnr"] == pytest.approx(20.04)
    st = run([str(BIN / "dvc"), "status"], user, env=team["user_env"])
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

    with temporary_settings(updates={PREFECT_API_URL: team["settings"]["PREFECT_API_URL"]}), \
            get_client(sync_client=True) as client:
        tries = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=["a", "a-try2"])))
    states = sorted((fr.name, fr.state.type.value) for fr in tries if "splatflow-host:host3" in fr.tags
                    or "splatflow-host:host4" in fr.tags)
    assert ("a-try2", "COMPLETED") in states and any(s == "CRASHED" for _, s in states), states


def _has_started_two(clone: Path) -> bool:
    return any(f.read_text() == "two" for f in (clone / ".dvc" / "tmp" / "splatflow" / "wt").glob("*/started"))
