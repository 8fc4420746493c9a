"""Faults that stop early and say what to do, through the real commands (``splatflow run``, ``dvc repro``, the stage
processes): a tracking server that does not answer, a SIGTERM while the stage waits for it, a damaged ``mlflow.db``,
a scene whose capture is gone under a plain ``dvc repro``, and a bad key in a section the repro's stages do not read.
Each asserts the message, the exit status, the time taken and that no earlier output was lost."""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from splatflow.orchestrate.servers import free_port
from tests._project import BIN, make_project, project_env

SCENE = "tiny"


@pytest.fixture(scope="module")
def proj(tmp_path_factory):
    """A project whose tiny scene went through settings and ingest (tracking off)."""
    root = make_project(tmp_path_factory.mktemp("faults") / "proj")
    r = subprocess.run([str(BIN / "dvc"), "repro", f"ingest@{SCENE}"], cwd=root, env=_env(root), capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    return root


def _env(root: Path, **extra: str) -> dict:
    env = project_env()
    env.pop("MLFLOW_RUN_ID", None)
    env.pop("MLFLOW_TRACKING_URI", None)
    env.update({"SPLATFLOW_TRACKING": "off", **extra})
    return env


def _outputs(root: Path) -> dict[str, bytes]:
    """Every ingest output and settings file, by path: what a fault must leave as it was."""
    files = {}
    for d in (root / "data" / SCENE / "images", root / "data" / SCENE / "settings"):
        files.update({str(p.relative_to(root)): p.read_bytes() for p in sorted(d.iterdir())})
    for f in (root / "metrics" / SCENE / "ingest.json", root / "data" / SCENE / "image_folders.json"):
        files[str(f.relative_to(root))] = f.read_bytes()
    return files


def _timed(cmd: list[str], root: Path, env: dict, timeout: float = 900) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    return r, time.monotonic() - t0


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_a_dead_tracking_server_stops_splatflow_run_in_seconds(proj):
    """Nothing listens on the port: one request, refused, and `splatflow run` stops before DVC starts. The time is
    measured against the same command stopping on an unknown scene just before, so that a loaded machine's slow
    start of Python does not count: the check itself adds seconds, not the minutes of MLflow's retries."""
    url = f"http://127.0.0.1:{free_port()}"
    before = _outputs(proj)
    env = _env(proj, SPLATFLOW_TRACKING="on", MLFLOW_TRACKING_URI=url)
    base, startup = _timed([sys.executable, "-m", "splatflow.cli", "run", "no_such_scene"], proj, env)
    assert base.returncode == 2 and "add-scene" in base.stderr, base.stderr
    r, seconds = _timed([sys.executable, "-m", "splatflow.cli", "run", SCENE], proj, env)
    err = _flat(r.stderr)
    assert r.returncode == 2, r.stdout + r.stderr
    assert seconds - startup < 10, f"took {seconds:.1f} s, {startup:.1f} s of it to start"
    assert f"the MLflow tracking server at {url} is not answering" in err, err
    assert "`splatflow ui`" in err and "MLFLOW_TRACKING_URI=sqlite:///mlflow.db" in err, err
    assert "Traceback" not in r.stderr and "$ dvc repro" not in r.stdout  # DVC was never started
    assert _outputs(proj) == before


def test_a_dead_tracking_server_stops_a_plain_dvc_repro_at_its_first_stage(proj):
    """Under a plain `dvc repro` the settings stage, which runs first in every repro, finds the server dead: the
    repro stops there in seconds, and ingest (whose outputs DVC would remove before running it) is not reached."""
    url = f"http://127.0.0.1:{free_port()}"
    before = _outputs(proj)
    env = _env(proj, SPLATFLOW_TRACKING="on", MLFLOW_TRACKING_URI=url)
    r, seconds = _timed([str(BIN / "dvc"), "repro", "--force", f"ingest@{SCENE}"], proj, env)
    out = _flat(r.stdout + r.stderr)
    assert r.returncode != 0 and "exited with 2" in out, out
    assert f"settings [{SCENE}] failed: the MLflow tracking server at {url} is not answering" in out, out
    assert f"Running stage 'ingest@{SCENE}'" not in out, out
    assert _outputs(proj) == before
    # the stage process itself: the same message, seconds after the stage has started (its run with tracking off,
    # just before, is the measure of starting it)
    base, startup = _timed([sys.executable, "-m", "stages.settings", SCENE], proj, _env(proj))
    assert base.returncode == 0, base.stderr
    r, seconds = _timed([sys.executable, "-m", "stages.settings", SCENE], proj, env)
    assert r.returncode == 2 and f"{url} is not answering" in _flat(r.stderr), r.stderr
    assert seconds - startup < 10, f"took {seconds:.1f} s, {startup:.1f} s of it to start"


def test_sigterm_during_the_reachability_wait_stops_the_stage_at_once(proj):
    """A server that accepts the connection and never answers: the stage waits for its reply; a SIGTERM then ends
    the stage within a second (exit 143), not after the wait."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # connections complete in the kernel's backlog; nothing ever reads or answers them
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        stage = subprocess.Popen([sys.executable, "-m", "stages.settings", SCENE], cwd=proj,
                                 env=_env(proj, SPLATFLOW_TRACKING="on", MLFLOW_TRACKING_URI=url),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            ready, _, _ = select.select([silent], [], [], 120)  # readable: the stage's request is waiting
            assert ready, "the stage never connected"
            t0 = time.monotonic()
            stage.send_signal(signal.SIGTERM)
            rc = stage.wait(timeout=30)
            seconds = time.monotonic() - t0
        finally:
            stage.kill()
            out, err = stage.communicate()
    assert rc == 143, err
    # 0.14 s on an idle machine; the bound leaves room for a loaded one and still catches the minutes a stage used
    # to spend in MLflow's HTTP retries before it looked at the signal
    assert seconds < 3.0, f"exited {seconds:.2f} s after SIGTERM"
    assert f"settings [{SCENE}] stopped: stopped by SIGTERM" in err, err
    assert f"`splatflow run {SCENE}` continues from here" in _flat(err), err


def test_a_damaged_mlflow_db_is_one_line_per_run_and_the_stages_still_run(proj):
    db = proj / "mlflow.db"
    db.write_bytes(b"these are not the pages of an sqlite database\n" * 200)
    damaged = db.read_bytes()
    try:
        env = _env(proj, SPLATFLOW_TRACKING="on", MLFLOW_TRACKING_URI=f"sqlite:///{db}")
        r, _ = _timed([str(BIN / "dvc"), "repro", "--force", f"ingest@{SCENE}"], proj, env)
        text = r.stdout + r.stderr
        assert r.returncode == 0, text
        assert f"Running stage 'ingest@{SCENE}'" in text  # both stages ran, untracked
        notes = [ln for ln in text.splitlines() if "not a readable MLflow database" in ln]
        assert len(notes) == 1, text  # one line for the run, not one per stage
        assert str(db) in notes[0] and f"mv {db} {db}.damaged" in notes[0], notes[0]
        assert "Traceback" not in text and "contextlib" not in text and "SELECT" not in text, text
        assert db.read_bytes() == damaged  # the file is the user's to move: never rewritten
    finally:
        db.unlink()


def test_a_missing_source_under_plain_dvc_repro_loses_nothing(proj):
    """The capture's folder is gone (an unmounted drive): DVC would remove ingest's outputs, the git-tracked
    metrics/tiny/ingest.json included, before failing on the missing dependency. The settings stage stops the repro
    first, naming the path and the fix."""
    source = proj / "data" / "raw" / SCENE / "images"
    away = proj / "elsewhere"
    before = _outputs(proj)
    shutil.move(source, away)
    try:
        r, _ = _timed([str(BIN / "dvc"), "repro"], proj, _env(proj))
        out = _flat(r.stdout + r.stderr)
        assert r.returncode != 0 and "exited with 2" in out, out
        assert f"base.scenes.{SCENE}.source = data/raw/{SCENE}/images: {source} does not exist" in out, out
        assert "connect the drive it is on, or fix the path in params.yaml" in out, out
        assert "earlier outputs are untouched" in out, out
        assert f"Running stage 'ingest@{SCENE}'" not in out, out
        assert _outputs(proj) == before
    finally:
        shutil.move(away, source)
    r, _ = _timed([str(BIN / "dvc"), "status", f"ingest@{SCENE}"], proj, _env(proj))
    assert "ingest@" not in r.stdout, r.stdout  # with the capture back, ingest is up to date: nothing to redo


def test_a_bad_key_stops_any_repro_even_in_a_section_its_stages_do_not_read(proj):
    """`dvc repro ingest@tiny` reads no train params; a typo there still stops it (in the settings stage, which
    checks the whole file in every repro) rather than passing silently until a later run."""
    params = proj / "params.yaml"
    good = params.read_text()
    before = _outputs(proj)
    data = yaml.safe_load(good)
    data["train"]["max_stepz"] = 10
    params.write_text(yaml.safe_dump(data, sort_keys=False))
    try:
        r, _ = _timed([str(BIN / "dvc"), "repro", f"ingest@{SCENE}"], proj, _env(proj))
    finally:
        params.write_text(good)
    out = _flat(r.stdout + r.stderr)
    assert r.returncode != 0 and "exited with 2" in out, out
    assert "splatflow settings:" in out and "max_stepz" in out, out
    assert _outputs(proj) == before


def test_only_outputs_missing_passes_over_the_always_changed_settings_stage(proj):
    """A batch rerun asks whether only outputs are missing; the settings stage is listed as "always changed" by
    `dvc status` in every workspace, which is not a change of results."""
    from splatflow.orchestrate.dvcrun import only_outputs_missing

    ok, why = only_outputs_missing(proj, [f"settings@{SCENE}", f"ingest@{SCENE}"], env=_env(proj))
    assert ok, why
