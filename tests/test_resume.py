"""A hard kill loses at most one checkpoint interval: ``kill -9`` of the real train and prune stage processes.

No handler runs on SIGKILL, so the MLflow run stays RUNNING until ``splatflow runs reap`` marks it KILLED; the
rerun of the stage continues from the last periodic checkpoint (train) or the last finished phase (prune) and ends
with the same parameters as an uninterrupted run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from splatflow.gaussians.model import SPLAT_KEYS
from tests._project import drill_project, run, stage_record, tracked_env

pytestmark = pytest.mark.slow  # runs the pipeline through DVC

SCENE = "tiny"


@pytest.fixture(scope="module")
def proj(tmp_path_factory):
    return drill_project(tmp_path_factory.mktemp("resume") / "proj", max_steps=100, checkpoint_every=20)


def _env(root: Path) -> dict:
    return tracked_env(root)


def _stage(root: Path, name: str) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", f"stages.{name}", SCENE], root, env=_env(root))


def _splats(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)["splats"]


def _assert_same(a: dict, b: dict) -> None:
    assert a["means"].shape == b["means"].shape
    for k in SPLAT_KEYS:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


def _kill9_when(root: Path, name: str, ready, timeout: float = 600) -> None:
    """Start the stage, SIGKILL it as soon as ``ready()`` holds (polled), and check it did not finish first."""
    proc = subprocess.Popen([sys.executable, "-m", f"stages.{name}", SCENE], cwd=root, env=_env(root),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t0 = time.monotonic()
    try:
        while not ready():
            assert proc.poll() is None, f"{name} ended (status {proc.returncode}) before the kill"
            assert time.monotonic() - t0 < timeout, f"{name}: nothing to kill at after {timeout} s"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL


def _runs(root: Path, stage: str):
    from splatflow import tracking

    cl = tracking.client(f"sqlite:///{root / 'mlflow.db'}")
    exps = [e.experiment_id for e in cl.search_experiments()]
    return cl.search_runs(exps, filter_string=f"tags.`splatflow.stage.{stage}` != ''",
                          order_by=["attributes.start_time DESC"])


def _reap(root: Path) -> str:
    return run([sys.executable, "-m", "splatflow.cli", "runs", "reap"], root, env=_env(root)).stdout


def _unfinished_ckpt_at_least(path: Path, step: int):
    def ready() -> bool:
        try:
            c = torch.load(path, map_location="cpu", weights_only=False)
        except Exception:  # noqa: BLE001 - not written yet
            return False
        return not c["finished"] and c["step"] >= step
    return ready


def test_kill9_during_training_reap_then_resume_equals_uninterrupted(proj):
    ckpt = proj / "models" / SCENE / "train" / "ckpt.pt"
    _stage(proj, "train")  # uninterrupted
    full = _splats(ckpt)
    assert torch.load(ckpt, weights_only=False)["step"] == 100

    _kill9_when(proj, "train", _unfinished_ckpt_at_least(ckpt, 20))  # a fresh run (the old one finished)
    killed_step = torch.load(ckpt, weights_only=False)["step"]
    assert killed_step in (20, 40, 60, 80)
    killed = _runs(proj, "train")[0]
    assert killed.info.status == "RUNNING"  # no handler ran
    out = _reap(proj)
    assert killed.info.run_id in out and "marked KILLED" in out
    assert _runs(proj, "train")[0].info.status == "KILLED"

    p = _stage(proj, "train")
    m = stage_record(proj, SCENE, "train")
    assert m["resumed_from"] >= killed_step and m["steps"] == 100, p.stdout
    _assert_same(_splats(ckpt), full)
    assert _runs(proj, "train")[0].info.status == "FINISHED"


def test_kill9_during_prune_continues_after_the_last_finished_phase(proj):
    if not (proj / "models" / SCENE / "train" / "ckpt.pt").exists():
        _stage(proj, "train")
    out_ckpt = proj / "models" / SCENE / "prune" / "ckpt.pt"
    phases = proj / "models" / SCENE / "prune" / "phases.pt"
    _stage(proj, "prune")  # uninterrupted
    full = _splats(out_ckpt)
    full_metrics = stage_record(proj, SCENE, "prune")
    assert not phases.exists()  # removed once the result is written
    assert len(full_metrics["phases"]) >= 2, "the test needs a kill between two phases"

    _kill9_when(proj, "prune", phases.exists)
    saved = torch.load(phases, weights_only=False)
    assert saved["next_phase"] >= 2
    _reap(proj)
    assert _runs(proj, "prune")[0].info.status == "KILLED"

    p = _stage(proj, "prune")
    assert f"continued after phase {saved['next_phase'] - 1}" in p.stdout
    m = stage_record(proj, SCENE, "prune")
    assert m["resumed_after_phase"] == saved["next_phase"] - 1
    _assert_same(_splats(out_ckpt), full)
    assert [ph["val_psnr"] for ph in m["phases"]] == pytest.approx([ph["val_psnr"] for ph in full_metrics["phases"]])
    assert not phases.exists()


def test_a_truncated_checkpoint_is_moved_aside_and_training_says_where_it_starts(proj):
    """A checkpoint cut short (a full disk, a copy that stopped) cannot be resumed: the stage keeps the file under
    another name, says what it found and where it moved it, and trains from step 0 instead of starting over
    silently."""

    ckpt = proj / "models" / SCENE / "train" / "ckpt.pt"
    if not ckpt.exists():
        _stage(proj, "train")
    data = ckpt.read_bytes()
    ckpt.write_bytes(data[: len(data) // 2])
    bad = ckpt.read_bytes()

    p = _stage(proj, "train")
    err = " ".join(p.stderr.split())
    assert f"{ckpt}: cannot be read (" in err and "training starts from step 0" in err, err
    aside = list(ckpt.parent.glob("ckpt.pt.unreadable-*"))
    assert len(aside) == 1 and f"moved it to {aside[0]}" in err, err
    assert aside[0].read_bytes() == bad  # kept as it was found
    m = stage_record(proj, SCENE, "train")
    assert m["resumed_from"] is None and m["steps"] == 100
    assert torch.load(ckpt, weights_only=False)["step"] == 100  # a new, readable checkpoint took its place
