"""Every stop recorded as what it was: SIGTERM to a real ``python -m stages.<name>`` process on a tiny scene.

Each stage must exit 143 (stopped, not failed: DVC records nothing, Prefect sees a stop), its MLflow run must end
KILLED (not FAILED, not left RUNNING), and partial work must be kept where the stage has any (train's checkpoint).
train and prune are stopped in the middle of their real work (prune after it imported pycolmap lazily, whose glog
handler used to take SIGTERM away from Python); the stages that take a fraction of a second on this scene are held
open with ``SPLATFLOW_STAGE_HOLD_S`` and stopped at that known moment. (Items kept: train's checkpoint, prune's
finished phases.)
"""

from __future__ import annotations

import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from tests._project import drill_project, tracked_env

pytestmark = pytest.mark.slow  # runs the pipeline through DVC

SCENE = "tiny"


@pytest.fixture(scope="module")
def proj(tmp_path_factory):
    return drill_project(tmp_path_factory.mktemp("stop") / "proj", max_steps=40, checkpoint_every=1000)


def _env(root: Path, **extra) -> dict:
    return tracked_env(root, **extra)


class Stage:
    """``python -m stages.<name> tiny`` with its output read line by line in the background."""

    def __init__(self, root: Path, name: str, **env):
        self.proc = subprocess.Popen([sys.executable, "-m", f"stages.{name}", SCENE], cwd=root, env=_env(root, **env),
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.out: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put("")

    def wait_for(self, marker: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=1)
            except queue.Empty:
                continue
            self.out.append(line)
            if marker in line:
                return
            if line == "":
                break
        self.proc.kill()
        raise AssertionError(f"never saw {marker!r}:\n{''.join(self.out)}")

    def stop(self, timeout: float = 120, sig: int = signal.SIGTERM) -> int:
        self.proc.send_signal(sig)
        rc = self.proc.wait(timeout)
        time.sleep(0.2)
        while not self.lines.empty():
            self.out.append(self.lines.get())
        return rc

    @property
    def text(self) -> str:
        return "".join(self.out)


def _last_run(root: Path, stage: str):
    from splatflow import tracking

    cl = tracking.client(f"sqlite:///{root / 'mlflow.db'}")
    exps = [e.experiment_id for e in cl.search_experiments()]
    runs = cl.search_runs(exps, filter_string=f"tags.`splatflow.stage.{stage}` != ''",
                          order_by=["attributes.start_time DESC"], max_results=1)
    assert runs, f"no MLflow run of stage {stage}"
    return runs[0]


def _assert_stopped(root: Path, stage: str, st: Stage, rc: int) -> None:
    assert rc == 143, f"{stage}: exit status {rc}, expected 143 (stopped):\n{st.text}"
    assert "SIGTERM received" not in st.text and "*** Check failure" not in st.text, st.text  # glog's handler
    assert "stopped" in st.text and "Traceback" not in st.text, st.text
    run = _last_run(root, stage)
    assert run.info.status == "KILLED", f"{stage}: MLflow run {run.info.run_id} is {run.info.status}"
    assert run.data.tags[f"splatflow.stage.{stage}"] == "stopped"


@pytest.mark.parametrize("stage", ["ingest", "sfm", "split"])
def test_sigterm_stops_a_short_stage_killed(proj, stage):
    before = (proj / "metrics" / SCENE / f"{stage}.json").read_text()
    st = Stage(proj, stage, SPLATFLOW_STAGE_HOLD_S="120")
    st.wait_for("holding")
    _assert_stopped(proj, stage, st, st.stop())
    assert (proj / "metrics" / SCENE / f"{stage}.json").read_text() == before  # the stopped run wrote nothing


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_a_stop_during_training_keeps_the_checkpoint_and_ends_killed(proj, sig):
    """SIGTERM, and Ctrl-C (SIGINT to the foreground group): both the same clean stop. Ctrl-C used to raise
    KeyboardInterrupt inside a numba callback: a SystemError traceback, exit 1, a FAILED run, the steps since the
    last periodic checkpoint lost."""
    import torch

    params = yaml.safe_load((proj / "params.yaml").read_text())
    params["train"]["max_steps"] = 100000
    (proj / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    for f in (proj / "models" / SCENE / "train" / "ckpt.pt", proj / "plots" / SCENE / "train.csv"):
        f.unlink(missing_ok=True)  # each case from step 0 (the other case's checkpoint would resume)
    try:
        st = Stage(proj, "train")
        csv = proj / "plots" / SCENE / "train.csv"
        t0 = time.monotonic()
        while not (csv.exists() and len(csv.read_text().splitlines()) >= 3):  # header + 2 logged rows: training
            assert st.proc.poll() is None and time.monotonic() - t0 < 600, st.text
            time.sleep(0.2)
        _assert_stopped(proj, "train", st, st.stop(sig=sig))
        assert not (proj / "metrics" / SCENE / "train.json").exists()  # a stopped stage reports no result
        ckpt = torch.load(proj / "models" / SCENE / "train" / "ckpt.pt", weights_only=False)
        assert not ckpt["finished"] and ckpt["step"] >= 10
        assert ckpt["stopped"].startswith(signal.Signals(sig).name.lower())
        assert "checkpoint saved" in st.text
    finally:
        params["train"]["max_steps"] = 40
        (proj / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def test_sigterm_during_prune_reaches_python_after_pycolmap_loaded(proj):
    from tests._project import run

    run([sys.executable, "-m", "stages.train", SCENE], proj, env=_env(proj))  # a finished model to prune
    import torch

    phases = proj / "models" / SCENE / "prune" / "phases.pt"
    st = Stage(proj, "prune")
    st.wait_for("phase 1:")  # the work is under way; pycolmap (imported lazily by the dataset loader) is loaded
    t0 = time.monotonic()
    while not phases.exists():  # phase 1 is saved right after its line
        assert st.proc.poll() is None and time.monotonic() - t0 < 120, st.text
        time.sleep(0.05)
    _assert_stopped(proj, "prune", st, st.stop())
    assert not (proj / "metrics" / SCENE / "prune.json").exists()
    assert torch.load(phases, weights_only=False)["next_phase"] >= 2  # the finished phases are kept


@pytest.mark.parametrize("stage", ["evaluate", "export", "report"])
def test_sigterm_stops_evaluate_export_and_report_killed(proj, stage):
    if not (proj / "models" / SCENE / "prune" / "ckpt.pt").exists():
        from tests._project import run

        run([sys.executable, "-m", "stages.train", SCENE], proj, env=_env(proj))
        run([sys.executable, "-m", "stages.prune", SCENE], proj, env=_env(proj))
    st = Stage(proj, stage, SPLATFLOW_STAGE_HOLD_S="120")
    st.wait_for("holding")
    _assert_stopped(proj, stage, st, st.stop())
