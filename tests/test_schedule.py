"""A scheduled deployment fires, and ``splatflow serve`` stops cleanly: the real command against real servers.

Real Prefect and MLflow servers on free loopback ports (the ``stack`` fixture, tests/conftest.py), the toy
two-stage DVC project of tests/test_tracking.py, and ``.venv/bin/splatflow serve --workers 1 --repo <toy>`` as a
subprocess in its own process group, started from outside the project -- exactly what a user runs.

* ``test_served_cron_schedule_fires_a_batch``: with ``--cron '* * * * *'`` the server's scheduler books
  ``batch/nightly`` runs, serve picks one up when it comes due, the batch fans its scene out to
  ``reconstruct/scene`` on the worker serve started, and both flow runs, the MLflow batch parent run and its
  scene run finish.  The cron granularity is one minute, so this takes one to three minutes.  Then SIGTERM to
  serve's process group (what systemd or a supervisor sends).
* ``test_serve_stops_cleanly_with_a_batch_in_flight``: a batch started by hand whose stage sleeps; Ctrl-C (SIGINT
  to serve's process group) while the stage runs.

Either way serve must exit by itself, with its workers and every process below it, and no run may be left
RUNNING in Prefect or MLflow.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from datetime import timedelta
from pathlib import Path

import psutil
import pytest

from splatflow.orchestrate import servers
from splatflow.orchestrate.dvcrun import VENV_BIN, kill_group
from tests.test_tracking import make_toy_project

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

FIRE_TIMEOUT_S = 240  # serve start-up + up to one minute to the next cron tick + the batch and its scene run
STOP_TIMEOUT_S = 150  # serve's own stop: flow runs in flight (15 s grace), then each worker and its flow runs


class Serve:
    """``splatflow serve`` in its own process group, and every process ever seen below it."""

    def __init__(self, stack: dict, toy: Path, tmp_path: Path, *args: str, env: dict | None = None):
        self.toy, self.log = toy, tmp_path / "serve.log"
        full_env = servers.low_memory_env({
            "PREFECT_API_URL": stack["api"], "MLFLOW_TRACKING_URI": stack["mlflow"].url,
            "SPLATFLOW_TRACKING": "on", "PREFECT_HOME": str(tmp_path / "prefect-client"),
            # the served runner and the worker look for due runs every 5 s instead of every 10 s
            "PREFECT_RUNNER_POLL_FREQUENCY": "5", "PREFECT_WORKER_QUERY_SECONDS": "5",
            # the code under test: the `splatflow` script imports the installed package, which in a second
            # checkout of the project is not this one (in the project itself the two are the same)
            "PYTHONPATH": str(Path(__file__).resolve().parents[1]), **(env or {})})
        full_env.pop("MLFLOW_RUN_ID", None)
        cmd = [str(VENV_BIN / "splatflow"), "serve", "--workers", "1", "--repo", str(toy), *args]
        with open(self.log, "wb") as fh:
            # from outside the project: --repo alone says which project is served
            self.proc = subprocess.Popen(cmd, cwd=tmp_path, env=full_env, stdout=fh, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        self.seen: dict[int, tuple[psutil.Process, str]] = {}
        self.stopped_by_itself, self.stop_seconds, self.leftovers = False, None, []

    def remember(self) -> None:
        try:
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                if p.pid not in self.seen:
                    self.seen[p.pid] = (p, " ".join(p.cmdline()))
        except psutil.Error:
            pass

    def check_alive(self) -> None:
        self.remember()
        assert self.proc.poll() is None, f"serve exited with {self.proc.returncode}:\n{self.logs()}"

    def logs(self) -> str:
        parts = [f"--- {self.log}\n{_tail(self.log)}"]
        parts += [f"--- {p}\n{_tail(p)}" for p in sorted((self.toy / ".splatflow").glob("worker-*.log"))]
        return "\n".join(parts)

    def stop(self, sig: int) -> None:
        """``sig`` to serve's process group; it must exit by itself.  Whatever is left is killed (and recorded)."""
        self.remember()
        if self.proc.poll() is None:
            t0 = time.monotonic()
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
                self.stopped_by_itself, self.stop_seconds = True, time.monotonic() - t0
            except subprocess.TimeoutExpired:
                pass
            kill_group(self.proc, 5)  # no-op when it exited; otherwise SIGTERM, then SIGKILL, to the group
        for p, cmdline in self.seen.values():
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    self.leftovers.append(f"{p.pid} {cmdline[:200]}")
                    p.kill()
            except psutil.NoSuchProcess:
                pass

    def assert_stopped_cleanly(self) -> None:
        assert self.stopped_by_itself, f"serve did not exit within {STOP_TIMEOUT_S} s of the signal:\n{self.logs()}"
        assert self.proc.returncode == 0, f"serve exited with {self.proc.returncode}:\n{self.logs()}"
        assert not self.leftovers, f"left alive after serve stopped: {self.leftovers}\n{self.logs()}"
        assert any("worker start --pool splatflow" in c for _, c in self.seen.values()), "serve started no worker"
        print(f"serve stopped {self.stop_seconds:.1f} s after the signal")


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def _child_flow_runs(client, parent_id) -> list:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    return client.read_flow_runs(flow_run_filter=FlowRunFilter(
        parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent_id])))


def test_served_cron_schedule_fires_a_batch(stack, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

    from flows.batch import child_runs
    from splatflow import tracking

    toy = make_toy_project(tmp_path / "toy", scenes=("a",))
    serve = Serve(stack, toy, tmp_path, "--cron", "* * * * *")
    t0, fired = time.monotonic(), None
    try:
        with get_client(sync_client=True) as client:
            while fired is None:
                serve.check_alive()
                assert time.monotonic() - t0 < FIRE_TIMEOUT_S, (f"no scheduled batch/nightly run completed within "
                                                                f"{FIRE_TIMEOUT_S} s:\n{serve.logs()}")
                runs = client.read_flow_runs(
                    deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=["nightly"])))
                bad = [r for r in runs if r.state and r.state.is_final() and not r.state.is_completed()]
                assert not bad, (f"nightly run {bad[0].name} ended {bad[0].state.type.value}: "
                                 f"{bad[0].state.message}\n{serve.logs()}")
                done = sorted((r for r in runs if r.state and r.state.is_completed()),
                              key=lambda r: r.expected_start_time)
                if done:
                    fired = done[0]
                    print(f"scheduled run {fired.name} completed {time.monotonic() - t0:.0f} s after serve started")
                else:
                    time.sleep(3)

            # booked by the server's scheduler from the cron schedule, not started by hand
            nightly = client.read_deployment_by_name("batch/nightly")
            assert fired.deployment_id == nightly.id
            assert fired.auto_scheduled
            assert (fired.idempotency_key or "").startswith(f"scheduled {nightly.id} ")
            assert [s.schedule.cron for s in nightly.schedules] == ["* * * * *"]
            assert fired.expected_start_time.second == 0 and fired.expected_start_time.microsecond == 0
            # started when it came due (the runner prefetches due runs up to 10 s early)
            assert fired.start_time >= fired.expected_start_time - timedelta(seconds=15)
            assert fired.parameters["repo"] == str(toy.resolve())

            # its scene ran as a child flow run of reconstruct/scene, on the worker serve started, and completed
            scene_dep = client.read_deployment_by_name("reconstruct/scene")
            kids = _child_flow_runs(client, fired.id)
            assert [k.name for k in kids] == ["a"], kids
            kid = kids[0]
            assert kid.deployment_id == scene_dep.id
            assert kid.state.is_completed(), kid.state
            assert kid.parameters["scene"] == "a" and kid.parameters["workspace"] == "worktree"
            worker_logs = "".join(p.read_text(errors="replace") for p in (toy / ".splatflow").glob("worker-*.log"))
            assert str(kid.id) in worker_logs

        # MLflow: the scene run of that child flow run, nested under the batch parent run of the scheduled batch
        cl = tracking.client()
        exps = [e.experiment_id for e in cl.search_experiments()]
        scene_runs = cl.search_runs(exps, filter_string=f"tags.`prefect.flow_run_id` = '{kid.id}'")
        assert len(scene_runs) == 1, scene_runs
        run = scene_runs[0]
        assert run.info.status == "FINISHED"
        assert run.data.tags["splatflow.scene"] == "a"
        assert run.data.tags["splatflow.workspace"] == "worktree"
        assert run.data.metrics["two.psnr"] == pytest.approx(20.02)
        assert {a.path for a in cl.list_artifacts(run.info.run_id, "out/a")} == {"out/a/one.ply", "out/a/two.ply"}
        parent = cl.get_run(run.data.tags["mlflow.parentRunId"])
        assert parent.data.tags["splatflow.kind"] == "batch"
        assert parent.data.tags["splatflow.scenes"] == "a"
        assert parent.info.status == "FINISHED"
        assert [c.info.run_id for c in child_runs(cl, parent.info.run_id)] == [run.info.run_id]
        assert "batch_summary.csv" in {a.path for a in cl.list_artifacts(parent.info.run_id)}
    finally:
        serve.stop(signal.SIGTERM)  # as systemd or a supervisor stops it
    serve.assert_stopped_cleanly()


def test_serve_stops_cleanly_with_a_batch_in_flight(stack, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment
    from prefect.exceptions import ObjectNotFound

    from splatflow import tracking

    toy = make_toy_project(tmp_path / "toy", scenes=("a",))
    # no schedule; the toy stage `one` sleeps long enough to be caught running
    serve = Serve(stack, toy, tmp_path, "--cron", "", env={"FAKE_SLEEP_ONE": "600"})
    t0 = time.monotonic()
    try:
        with get_client(sync_client=True) as client:
            while True:  # serve registers its deployments once it has started the worker
                serve.check_alive()
                assert time.monotonic() - t0 < FIRE_TIMEOUT_S, f"batch/on-demand never appeared:\n{serve.logs()}"
                try:
                    client.read_deployment_by_name("batch/on-demand")
                    break
                except ObjectNotFound:
                    time.sleep(2)
        batch_run = run_deployment("batch/on-demand", timeout=0, as_subflow=False)
        while not list(toy.glob(".dvc/tmp/splatflow/wt/*/started")):  # stage `one` of scene a is running
            serve.check_alive()
            assert time.monotonic() - t0 < FIRE_TIMEOUT_S, f"the scene's stage never started:\n{serve.logs()}"
            time.sleep(2)
        serve.remember()
        assert any("fake_stage.py one a" in c for _, c in serve.seen.values())
    finally:
        serve.stop(signal.SIGINT)  # Ctrl-C in the terminal serve runs in
    serve.assert_stopped_cleanly()

    with get_client(sync_client=True) as client:
        batch_run = client.read_flow_run(batch_run.id)
        kids = _child_flow_runs(client, batch_run.id)
    assert batch_run.state.type.value in ("CANCELLED", "CRASHED"), batch_run.state
    assert [k.name for k in kids] == ["a"]
    assert kids[0].state.type.value in ("CANCELLED", "CRASHED"), kids[0].state
    cl = tracking.client()
    runs = cl.search_runs([e.experiment_id for e in cl.search_experiments()])
    assert sorted((r.data.tags.get("splatflow.kind", "scene"), r.info.status) for r in runs) == \
        [("batch", "KILLED"), ("scene", "KILLED")]
    assert not any((toy / ".dvc" / "tmp" / "splatflow" / "wt").iterdir()), "the scene's worktree was left behind"
    _check_settle_ends_only_the_stopped_workers_runs()


def _check_settle_ends_only_the_stopped_workers_runs():
    """Serve's last step: a run its stopped workers left CANCELLING (the server marks a parent's child runs
    CANCELLING in its own time, maybe after the worker polled for the last time) becomes CANCELLED, one left
    RUNNING CRASHED; a run whose process was not a worker's of this serve, or is still alive, is not touched."""
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling, Running

    dead = subprocess.Popen(["true"])
    dead.wait()
    ours, live = {dead.pid, os.getpid()}, os.getpid()
    with get_client(sync_client=True) as client:
        dep = client.read_deployment_by_name("reconstruct/scene")
        cases = {"stuck-cancelling": (dead.pid, "CANCELLING"), "stuck-running": (dead.pid, "RUNNING"),
                 "other-host": (dead.pid + 1 if dead.pid + 1 not in ours else dead.pid + 2, "CANCELLING"),
                 "alive": (live, "CANCELLING")}
        ids = {}
        for name, (pid, state) in cases.items():
            run = client.create_flow_run_from_deployment(dep.id, name=name)
            client.update_flow_run(run.id, infrastructure_pid=f"somehost:{pid}" if name == "other-host" else str(pid))
            client.set_flow_run_state(run.id, Running(), force=True)
            if state == "CANCELLING":
                client.set_flow_run_state(run.id, Cancelling(), force=True)
            ids[name] = run.id
        settled = servers.settle_flow_runs(dep.work_pool_name, ours)
        after = {name: client.read_flow_run(i).state.type.value for name, i in ids.items()}
    assert sorted(settled) == ["stuck-cancelling (CANCELLED)", "stuck-running (CRASHED)"], settled
    assert after == {"stuck-cancelling": "CANCELLED", "stuck-running": "CRASHED", "other-host": "CANCELLING",
                     "alive": "CANCELLING"}, after


def test_flows_load_by_file_path_from_the_project_folder(tmp_path):
    """What a worker or ``splatflow serve`` does with a deployment's entrypoint: Prefect loads ``flows/<x>.py`` by
    its file path in a process started in the project folder, with no PYTHONPATH and no ``sys.path`` edit in the
    flows.  ``flows`` and the project's ``splatflow`` must then import from the project itself."""
    import ast
    import textwrap

    toy = make_toy_project(tmp_path / "toy", scenes=("a",))
    for f in (toy / "flows").glob("*.py"):
        uses = [n.lineno for n in ast.walk(ast.parse(f.read_text())) if isinstance(n, ast.Attribute)
                and n.attr == "path" and isinstance(n.value, ast.Name) and n.value.id == "sys"]
        assert not uses, f"{f.name} touches sys.path (line {uses[0]})"
    probe = textwrap.dedent("""
        import sys
        from prefect.flows import load_flow_from_entrypoint
        from prefect.utilities.importtools import load_script_as_module

        for ep in ("flows/reconstruct.py:reconstruct", "flows/batch.py:batch"):
            print(ep, load_flow_from_entrypoint(ep).name)
        dep = load_script_as_module("flows/deployments.py")
        print("deployments", dep.SCENE_DEPLOYMENT, dep.batch.name)
        import flows.batch, splatflow.tracking
        print("flows", flows.batch.__file__)
        print("splatflow", splatflow.tracking.__file__)
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PREFECT_API_URL")}
    p = subprocess.run([str(VENV_BIN / "python"), "-c", probe], cwd=toy, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    out = dict(line.split(" ", 1) for line in p.stdout.splitlines() if " " in line)
    assert out["flows/reconstruct.py:reconstruct"] == "reconstruct" and out["flows/batch.py:batch"] == "batch"
    assert out["deployments"] == "reconstruct/scene batch"
    assert Path(out["flows"]) == toy / "flows" / "batch.py"
    assert Path(out["splatflow"]).parent == toy / "splatflow" / "tracking"
