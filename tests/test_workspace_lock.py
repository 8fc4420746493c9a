"""One workspace, one writer: a second ``splatflow run`` in the same checkout waits for the first, or (``--no-wait``)
stops at once with a message naming what holds the workspace and what to do -- also when the first is a plain
``dvc repro`` started by hand."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests._project import BIN, make_project, project_env

HOLD = """
import sys, time
from splatflow.orchestrate.workspace import workspace_lock
with workspace_lock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
"""


@pytest.fixture(scope="module")
def proj(tmp_path_factory):
    # no scene is generated: ingest fails at once, which is all a run that got the workspace needs to show here
    return make_project(tmp_path_factory.mktemp("ws") / "proj", generate=False)


def _cli(root: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "splatflow.cli", *args], cwd=root, env=project_env(),
                          capture_output=True, text=True, timeout=timeout)


def _holder(root: Path, seconds: float) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(root), str(seconds)], cwd=root, env=project_env(),
                         stdout=subprocess.PIPE, text=True)
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


def test_second_run_waits_for_the_first_then_runs(proj):
    holder = _holder(proj, 20)  # longer than the CLI takes to start on a loaded machine
    r = _cli(proj, "run", "tiny")
    assert holder.poll() is not None  # the run went ahead only after the holder ended
    assert "waiting:" in r.stderr and f"pid {holder.pid}" in " ".join(r.stderr.split()), r.stderr
    assert "$ dvc repro" in r.stdout and r.returncode != 3


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
