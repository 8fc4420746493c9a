import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from splatflow.cli import app
from splatflow.orchestrate.dvcrun import stage_order
from splatflow.config import load_params

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def project(tmp_path, monkeypatch):
    for name in ("params.yaml", "dvc.yaml"):
        shutil.copy(REPO / name, tmp_path / name)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_add_scene_folder_keeps_comments_and_validates(project):
    photos = project / "captures" / "garden"
    photos.mkdir(parents=True)
    r = CliRunner().invoke(app, ["add-scene", "garden", str(photos)])
    assert r.exit_code == 0, r.output
    text = (project / "params.yaml").read_text()
    assert "# splatflow parameters" in text  # comments survive the edit
    p = load_params(project / "params.yaml")
    assert p.scene("garden").source == "captures/garden"
    assert p.scene("demo").source == "data/raw/demo/images"  # existing scenes untouched

    again = CliRunner().invoke(app, ["add-scene", "garden", str(photos)])
    assert again.exit_code == 2 and "already" in again.output


def test_add_scene_video_and_bad_inputs(project):
    video = project / "walk.mp4"
    video.write_bytes(b"\x00")
    assert CliRunner().invoke(app, ["add-scene", "walk", str(video)]).exit_code == 0
    assert load_params(project / "params.yaml").scene("walk").source == "walk.mp4"

    notes = project / "notes.txt"
    notes.write_text("hello")
    r = CliRunner().invoke(app, ["add-scene", "notes", str(notes)])
    assert r.exit_code == 2 and "not a video" in r.output
    r = CliRunner().invoke(app, ["add-scene", "ghost", str(project / "missing")])
    assert r.exit_code == 2 and "does not exist" in r.output
    r = CliRunner().invoke(app, ["add-scene", "bad name", str(project)])
    assert r.exit_code == 2
    assert "notes" not in load_params(project / "params.yaml").base.scenes


def test_run_targets_follow_dvc_yaml_order():
    names = stage_order(REPO, "demo")  # what `splatflow run demo` passes to dvc repro
    assert names[:3] == ["ingest@demo", "sfm@demo", "split@demo"]
    assert names[-2:] == ["export@demo", "report@demo"]


def test_run_unknown_scene_fails_clearly(project):
    r = CliRunner().invoke(app, ["run", "kitchen"])
    assert r.exit_code == 2 and "add-scene" in r.output
