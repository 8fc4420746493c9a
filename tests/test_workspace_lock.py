"""One workspace, one writer: a second ``splatflow run`` in the same checkout waits for the first, or (``--no-wait``)
stops at once with a message naming what holds the workspace and what to do -- also when the first is a plain
``dvc repro`` started by hand."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests._project import BIN, make_project, project_env

pytestmark = pytest.mark.slow  # runs the pipeline through DVC

# holds the workspace for argv[2] seconds, or until a line (or EOF) comes on its stdin
HOLD = """
import select, sys
from splatflow.orchestrate.workspace import workspace_lock
with workspace_lock(sys.argv[1]):
    print("held", flush=True)
    select.select([sys.stdin], [], [], float(sys.argv[2]))
"""


@pytest.fixture(scope="module")
def proj(tmp_path_factory):
    # no scene is generated, only its (empty) folder, so that `splatflow run` starts DVC: ingest then fails at once,
    # which is all a run that got the workspace needs to show here
    root = make_project(tmp_path_factory.mktemp("ws") / "proj", generate=False)
    (root / "data" / "raw" / "tiny" / "images").mkdir(parents=True)
    return root


def _cli(root: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "splatflow.cli", *args], cwd=root, env=project_env(),
                          capture_output=True, text=True, timeout=timeout)


def _holder(root: Path, seconds: float) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(root), str(seconds)], cwd=root, env=project_env(),
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_second_run_stops_at_once_naming_the_holder(proj):
    holder = _holder(proj, 120)
    try:
        r = _cli(proj, "run", "tiny", "--no-wait")
    finally:
        holder.kill()
        holder.wait()
    assert r.returncode == 3, r.stdout + r.stderr
    err = " ".join(r.stderr.split())
    assert "is busy" in err and f"pid {holder.pid}" in err, err
    assert "Wait for it to finish" in err and "--worktree" in err
    assert "$ dvc repro" not in r.stdout  # DVC was never started


def _cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


def test_second_run_waits_for_the_first_then_runs(proj):
    import threading

    holder = _holder(proj, 300)  # until the run says it waits (or 300 s)
    cli = subprocess.Popen([sys.executable, "-m", "splatflow.cli", "run", "tiny"], cwd=proj, env=project_env(),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    err: list[str] = []
    waiting = threading.Event()

    def read_stderr():
        for line in cli.stderr:
            err.append(line)
            if "waiting:" in line:
                waiting.set()
        waiting.set()

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    try:
        waiting.wait(300)
        time.sleep(2)
        # it waits instead of running or stopping: alive, and no dvc below it yet
        assert cli.poll() is None, "".join(err)
        assert not [c for c in psutil.Process(cli.pid).children(recursive=True) if "dvc" in _cmdline(c)]
        holder.stdin.close()  # the holder leaves its `with workspace_lock` and ends
        holder.wait(60)
        out = cli.stdout.read()
        cli.wait(300)
        reader.join(60)
    finally:
        for p in (cli, holder):
            if p.poll() is None:
                p.kill()
                p.wait()
    stderr = "".join(err)
    assert "waiting:" in stderr and f"pid {holder.pid}" in " ".join(stderr.split()), stderr
    assert "$ dvc repro" in out and cli.returncode != 3  # the run went ahead once the holder ended


def test_a_plain_dvc_repro_in_the_checkout_is_waited_for_and_named(tmp_path):
    """``dvc repro`` started by hand knows nothing of splatflow's lock: the lock looks for it by its directory."""
    from splatflow.orchestrate import dvcrun
    from splatflow.orchestrate.workspace import WorkspaceBusy, workspace_lock
    from tests.test_tracking import make_toy_project, toy_env

    toy = make_toy_project(tmp_path / "toy")
    env = toy_env(toy, FAKE_SLEEP_ONE="120", SPLATFLOW_TRACKING="off")
    proc = subprocess.Popen([str(BIN / "dvc"), "repro", "--force", "--single-item", "one@a"], cwd=toy, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        t0 = time.monotonic()
        while not (toy / "started").exists():
            assert proc.poll() is None and time.monotonic() - t0 < 120, "dvc never started the stage"
            time.sleep(0.2)
        told = []
        with pytest.raises(WorkspaceBusy) as e:
            with workspace_lock(toy, wait_s=2, on_wait=told.append):
                pass
        msg = str(e.value)
        assert f"pid {proc.pid}" in msg and "dvc repro" in msg and "is busy" in msg, msg
        assert told and told[0] == msg  # told once, when the wait began
    finally:
        dvcrun.kill_group(proc)
    with workspace_lock(toy, wait_s=0):  # free again once that dvc is gone; the holder says who it is
        import json
        import os

        assert json.loads((toy / ".splatflow" / "workspace.lock").read_text())["pid"] == os.getpid()


def test_a_waiting_run_lets_an_older_dvc_repro_finish_its_stages(proj):
    """``splatflow run`` started while a plain ``dvc repro`` works waits without holding the lock: the repro's next
    stage starts (it is not refused as "busy"), and the run starts DVC only after that repro ended."""
    env = _env(proj, SPLATFLOW_STAGE_HOLD_S="15")
    # settings@tiny, then ingest@tiny (which fails on the empty capture folder with its own message)
    older = Background([str(BIN / "dvc"), "repro", "--force", "ingest@tiny"], proj, env)
    waiter = None
    try:
        older.wait_for("holding")  # the older repro is inside its first stage
        waiter = Background(_cli_cmd("run", "tiny"), proj, _env(proj))
        waiter.wait_for("waiting:", timeout=120)  # (while the older repro's first stage still holds)
        older.wait_for("Running stage 'ingest@tiny'", timeout=120)
        older.proc.wait(timeout=300)
        older_out = " ".join(older.rest().split())
        waiter.proc.wait(timeout=300)
        waited = " ".join(waiter.rest().split())
    finally:
        older.kill()
        if waiter is not None:
            waiter.kill()
    assert "is busy" not in older_out and "not started" not in older_out, older_out
    assert "ingest [tiny] failed" in older_out, older_out  # the stage did its own work (an empty capture folder)
    assert f"pid {older.proc.pid}" in waited, waited
    assert waited.index("waiting:") < waited.index("$ dvc repro"), waited  # it ran once the older repro was done


# ------------------------------------------------------------------ a `dvc repro` by hand beside a running writer


@pytest.fixture(scope="module")
def two_scenes(tmp_path_factory):
    """A project with two scenes on the same tiny capture, so that DVC itself would run their stages side by side."""
    raw = "data/raw/tiny"
    spec = {"source": f"{raw}/images", "ground_truth": f"{raw}/ground_truth"}
    return make_project(tmp_path_factory.mktemp("ws2") / "proj", overrides={
        "base": {"scenes": {"tiny": dict(spec), "tiny2": dict(spec)}}})


class Background:
    """A command in its own session, its output read line by line until a marker shows."""

    def __init__(self, cmd: list[str], root: Path, env: dict):
        self.proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.lines: list[str] = []

    def wait_for(self, marker: str, timeout: float = 300) -> None:
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not sel.select(timeout=1):
                continue
            line = self.proc.stdout.readline()
            if not line:
                break
            self.lines.append(line)
            if marker in line:
                return
        self.kill()
        raise AssertionError(f"never saw {marker!r}:\n{''.join(self.lines)}")

    def rest(self) -> str:
        return "".join(self.lines) + (self.proc.stdout.read() or "")

    def kill(self) -> None:
        from splatflow.orchestrate import dvcrun

        dvcrun.kill_group(self.proc, grace_s=30)


def _env(root: Path, **extra: str) -> dict:
    env = project_env()
    env.update({"SPLATFLOW_TRACKING": "off", **extra})
    return env


def _hand_dvc(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "dvc"), *args], cwd=root, env=_env(root), capture_output=True, text=True,
                          timeout=300)


def _cli_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "splatflow.cli", *args]


def test_a_dvc_repro_by_hand_beside_splatflow_run_is_told_who_holds_the_workspace(two_scenes):
    """DVC lets a second ``dvc repro`` run any stage whose files the first has not locked (here: the other scene's
    first stage, settings), and both would rewrite dvc.lock. The stage shell stops it before any work, naming
    ``splatflow run`` and its pid; a stage the first run has locked gets DVC's own message, which names the dvc below
    ``splatflow run``."""
    run = Background(_cli_cmd("run", "tiny"), two_scenes, _env(two_scenes, SPLATFLOW_STAGE_HOLD_S="300"))
    try:
        run.wait_for("holding")  # `splatflow run tiny` is inside its first stage, settings@tiny
        other = _hand_dvc(two_scenes, "repro", "--single-item", "settings@tiny2")
        out = " ".join((other.stdout + other.stderr).split())
        assert other.returncode != 0, out
        assert "settings [tiny2] not started" in out and "is busy" in out, out
        assert f"pid {run.proc.pid} (`splatflow run tiny`" in out, out
        assert "Wait for it to finish" in out and "--worktree" in out, out
        assert "exited with 3" in out, out  # DVC reports the stage shell's status: nothing done, nothing recorded
        assert not (two_scenes / "data" / "tiny2" / "settings").exists()  # it wrote nothing

        same = _hand_dvc(two_scenes, "repro", "--single-item", "settings@tiny")
        out = " ".join((same.stdout + same.stderr).split())
        # the dvc below `splatflow run`, which the reconstruct flow runs one stage at a time (its other child,
        # without a Prefect server, is Prefect's ephemeral API)
        dvc_pid = next(c.pid for c in psutil.Process(run.proc.pid).children() if "repro" in c.cmdline())
        assert same.returncode != 0 and "is busy" in out, out
        assert f"(PID {dvc_pid})" in out and "repro --single-item settings@tiny" in out, out
    finally:
        run.kill()


def test_a_younger_dvc_repro_is_stopped_beside_an_older_one(two_scenes):
    """Two ``dvc repro`` by hand, neither through splatflow: the stage of the younger one stops, naming the older."""
    older = Background([str(BIN / "dvc"), "repro", "--single-item", "settings@tiny"], two_scenes,
                       _env(two_scenes, SPLATFLOW_STAGE_HOLD_S="300"))
    try:
        older.wait_for("holding")
        younger = _hand_dvc(two_scenes, "repro", "--single-item", "settings@tiny2")
        out = " ".join((younger.stdout + younger.stderr).split())
        assert younger.returncode != 0 and "not started" in out, out
        assert f"pid {older.proc.pid} (`dvc repro --single-item settings@tiny`" in out, out
    finally:
        older.kill()


def test_splatflow_run_passes_sigterm_on_to_the_stage(two_scenes):
    """``kill <pid of splatflow run>`` reaches only the CLI; it stops the stage below DVC, which records its run
    KILLED, waits for it, and exits 143 -- nothing of the run is left behind working in the checkout, nor Prefect's
    ephemeral API server that the run started (Prefect's SIGTERM handler in a flow run hands the signal on to the
    handler it found: with Python's default there, the CLI died without its exit handlers, which stop that server)."""
    from splatflow import tracking
    from splatflow.orchestrate.workspace import workspace_lock

    db = two_scenes / "mlflow.db"
    env = _env(two_scenes, SPLATFLOW_TRACKING="on", MLFLOW_TRACKING_URI=f"sqlite:///{db}",
               SPLATFLOW_STAGE_HOLD_S="ingest:300")  # settings, which runs first, opens no run
    env.pop("MLFLOW_RUN_ID", None)
    run = Background(_cli_cmd("run", "tiny"), two_scenes, env)
    below: list[psutil.Process] = []
    try:
        run.wait_for("holding")
        below = psutil.Process(run.proc.pid).children(recursive=True)
        run.proc.send_signal(signal.SIGTERM)
        rc = run.proc.wait(timeout=120)
        psutil.wait_procs(below, timeout=30)
        left = [_described(p) for p in below if _alive(p)]
        text = "".join(run.lines) if left else run.rest()  # what is left would hold the output open: no rest()
    finally:
        run.kill()
        for p in below:  # (once the CLI is gone, run.kill() no longer reaches its group)
            try:
                p.kill()
            except psutil.Error:
                pass
    assert not left, left  # the stage ended too
    assert rc == 143, text
    assert "stopped (SIGTERM)" in text and "`splatflow run tiny` continues from there" in text, text
    runs = tracking.latest_runs(5, uri=f"sqlite:///{db}", scene="tiny", status=None)
    assert runs and runs[0].info.status == "KILLED", [r.info.status for r in runs]
    with workspace_lock(two_scenes, wait_s=0):
        pass  # the workspace is free again


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _described(p: psutil.Process) -> str:
    try:
        return f"{p.pid}: {' '.join(p.cmdline())[:200]}"
    except psutil.Error:
        return str(p.pid)


@pytest.mark.parametrize("child_rc, expected", [(0, 0), (3, 128 + signal.SIGINT)])
def test_a_ctrl_c_after_the_run_finished_does_not_turn_success_into_a_stop(tmp_path, child_rc, expected):
    """``splatflow run`` waits for DVC in the foreground; a Ctrl-C that arrives while DVC still completes its run
    must not report the finished run as stopped (it printed "stopped (Ctrl-C)" and exited 130 after a successful
    run); a run that did fail after the Ctrl-C is a stop."""
    import os
    import threading

    from splatflow.orchestrate.workspace import run_foreground

    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()  # to this process only, as a late Ctrl-C
    rc = run_foreground([sys.executable, "-c", f"import time, sys; time.sleep(1.5); sys.exit({child_rc})"], tmp_path)
    assert rc == expected
