import os
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from splatflow.cli import app
from splatflow.orchestrate.dvcrun import stage_order
from splatflow.pipeline.config import load_params
from tests._project import stage_record

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
    # every other line as it was (nulls spelled out, lists where they were): the diff is the new entry alone
    import difflib

    before = (REPO / "params.yaml").read_text().splitlines()
    changed = [d for d in difflib.unified_diff(before, text.splitlines(), lineterm="", n=0)
               if d[:1] in "+-" and not d.startswith(("+++", "---"))]
    assert changed == ["+    garden:", "+      source: captures/garden"], changed
    p = load_params(project / "params.yaml")
    assert p.scene("garden").source == "captures/garden"
    assert p.scene("demo").source == "data/raw/demo/images"  # existing scenes untouched

    again = CliRunner().invoke(app, ["add-scene", "garden", str(photos)])
    assert again.exit_code == 2 and "already" in again.output
    twin = CliRunner().invoke(app, ["add-scene", "Garden", str(photos)])  # one folder on macOS / Windows
    assert twin.exit_code == 2 and "only in case" in twin.output and "'garden'" in twin.output
    accent = CliRunner().invoke(app, ["add-scene", "café", str(photos)])
    assert accent.exit_code == 2 and "ASCII letters" in accent.output


def test_add_scene_video_and_bad_inputs(project):
    """A file is a video when OpenCV opens it and decodes a frame, as ingest will: a camera's .mts (and a video
    under a suffix no list has) is taken, and ingest reads the same file; a .mp4 that does not decode is not."""
    from splatflow.pipeline.config import IngestConfig
    from splatflow.scene.ingest import ingest
    from tests.test_ingest import _write_video

    for name in ("clip.mts", "clip.vid"):
        video = project / name
        written = video if name.endswith(".mts") else project / "clip.avi"  # OpenCV writes no .vid: rename one
        _write_video(written, n_frames=24, sharp_every=4, sharp_offset=1)
        written.rename(video)
        scene = name.replace(".", "_")
        r = CliRunner().invoke(app, ["add-scene", scene, str(video)])
        assert r.exit_code == 0, r.output
        assert load_params(project / "params.yaml").scene(scene).source == name
        result = ingest(video, project / "data" / scene / "images", IngestConfig(video_frames=6), progress=False)
        assert result.source_kind == "video" and len(result.kept) >= 3

    broken = project / "walk.mp4"
    broken.write_bytes(b"\x00" * 64)
    r = CliRunner().invoke(app, ["add-scene", "walk", str(broken)])
    assert r.exit_code == 2 and "walk.mp4: OpenCV cannot open this video" in r.output and "ffmpeg" in r.output
    notes = project / "notes.txt"
    notes.write_text("hello")
    r = CliRunner().invoke(app, ["add-scene", "notes", str(notes)])
    assert r.exit_code == 2 and "not a video OpenCV can open" in " ".join(r.output.split()), r.output
    assert ".mts" in r.output  # the formats known by suffix are listed
    photo = project / "one.jpg"
    photo.write_bytes(b"\xff\xd8\xff")
    r = CliRunner().invoke(app, ["add-scene", "one", str(photo)])
    assert r.exit_code == 2 and "single image" in r.output
    r = CliRunner().invoke(app, ["add-scene", "ghost", str(project / "missing")])
    assert r.exit_code == 2 and "does not exist" in r.output
    r = CliRunner().invoke(app, ["add-scene", "bad name", str(project)])
    assert r.exit_code == 2
    assert "notes" not in load_params(project / "params.yaml").base.scenes


def test_run_targets_follow_dvc_yaml_order():
    names = stage_order(REPO, "demo")  # what `splatflow run demo` passes to dvc repro
    assert names[:4] == ["settings@demo", "ingest@demo", "sfm@demo", "split@demo"]
    assert names[-2:] == ["export@demo", "report@demo"]


def test_run_unknown_scene_fails_clearly(project):
    r = CliRunner().invoke(app, ["run", "kitchen"])
    assert r.exit_code == 2 and "add-scene" in r.output


def test_run_refuses_a_missing_capture_before_dvc_touches_anything(project):
    """A scene whose source is not there (the demo before `splatflow demo-scene`, a capture on an unmounted drive):
    one message per scene naming the path and the fix, exit 2, and the scene's earlier outputs left alone (DVC
    removed ingest's outputs, the git-tracked metrics included, before failing on the missing dependency)."""
    import yaml

    params = yaml.safe_load((project / "params.yaml").read_text())
    params["base"]["scenes"]["kitchen"] = {"source": str(project / "gone" / "kitchen")}
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    kept = project / "metrics" / "kitchen" / "ingest.json"
    kept.parent.mkdir(parents=True)
    kept.write_text("{}")
    r = CliRunner().invoke(app, ["run", "kitchen"])
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert f"base.scenes.kitchen.source = {project / 'gone' / 'kitchen'}" in r.output
    assert "does not exist" in r.output and "add-scene kitchen" in r.output and "Nothing was run" in r.output
    assert kept.read_text() == "{}"
    r = CliRunner().invoke(app, ["run"])  # every scene: the demo's is not written yet either
    assert r.exit_code == 2 and "splatflow demo-scene" in r.output and "base.scenes.kitchen" in r.output
    assert "splatflow run SCENE" in r.output


def test_every_command_line_of_the_docs_still_parses():
    """The commands moved into sub-apps keep their command lines: each answers --help at its documented place."""
    for args in (["demo-scene"], ["add-scene"], ["run"], ["ui"], ["serve"], ["flow"], ["batch"], ["runs", "reap"],
                 ["runs", "list"], ["compare"], ["rerun"], ["plots"], ["view"], ["report"], ["build-web"]):
        r = CliRunner().invoke(app, [*args, "--help"])
        assert r.exit_code == 0 and "Usage:" in r.output, (args, r.output)


def test_user_errors_of_any_sub_app_are_one_message_and_exit_2(project, tmp_path_factory, monkeypatch):
    r = CliRunner().invoke(app, ["flow", "demo", "-S", "nonsense"])  # the flows sub-app, before Prefect starts
    assert r.exit_code == 2 and "error: override 'nonsense' must look like section.key=value" in r.output, r.output
    assert "Traceback" not in r.output
    r = CliRunner().invoke(app, ["plots", "demo"])  # the results sub-app
    assert r.exit_code == 2 and "train.csv does not exist" in r.output and "splatflow run demo" in r.output

    monkeypatch.chdir(tmp_path_factory.mktemp("elsewhere"))  # not a project: the message says where to run from
    for args in (["run", "demo"], ["plots", "demo"]):
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 2 and "no params.yaml and dvc.yaml" in r.output, (args, r.output)


def test_one_repo_root(tmp_path):
    """The CLI, the stages and tracking find the project the same way, also from DVC's temporary experiment
    workspaces (``.dvc/tmp/exps/<tmp>``, a full checkout), whose tracking store must be the repository's."""
    from splatflow import tracking
    from splatflow.pipeline import paths

    assert tracking.repo_root is paths.repo_root
    exp = tmp_path / "repo" / ".dvc" / "tmp" / "exps" / "tmpabc"
    for d in (tmp_path / "repo", exp):
        d.mkdir(parents=True, exist_ok=True)
        for name in ("params.yaml", "dvc.yaml"):
            (d / name).write_text("")
    assert paths.project_root(exp / "stages") == exp  # where the experiment's stages read and write
    assert paths.repo_root(exp / "stages") == tmp_path / "repo"  # where its MLflow store is
    assert paths.require_project_root(tmp_path / "repo" / "data") == tmp_path / "repo"


def test_batch_without_a_served_deployment_says_what_to_start(project):
    """`splatflow batch A B` (the README's line) with no `splatflow serve` running ended, after a temporary Prefect
    server had started, in every scene's `ObjectNotFound: None` under ~600 lines of tracebacks. It now stops at once
    and names `splatflow serve` and --local."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    exe = str(Path(sys.executable).parent / "splatflow")
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    # no server at all: `ui` and `serve` to start (the port looked for is servers.PREFECT_PORT: point it at the dead one)
    code = ("import sys; from splatflow.orchestrate import servers; servers.PREFECT_PORT = int(sys.argv[1]); "
            "from splatflow.cli.main import main; sys.argv = ['splatflow', 'batch', 'demo']; main()")
    r = subprocess.run([sys.executable, "-c", code, str(dead)], cwd=project, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "no Prefect server answers" in r.stderr and "splatflow serve" in r.stderr and "--local" in r.stderr
    assert "Traceback" not in r.stderr and "temporary" not in r.stderr
    # a server that does not answer at PREFECT_API_URL
    r = subprocess.run([exe, "batch", "demo"], cwd=project, capture_output=True, text=True, timeout=60,
                       env={**env, "PREFECT_API_URL": f"http://127.0.0.1:{dead}/api"})
    assert r.returncode == 2 and "cannot reach the Prefect server" in r.stderr and "--local" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_runs_list_takes_the_usual_count_option(project, monkeypatch):
    """`splatflow runs list -n 5` said `No such option: -n` (only the odd `--n` existed)."""
    monkeypatch.setenv("SPLATFLOW_TRACKING", "on")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{project / 'mlflow.db'}")
    for flag in ("-n", "--limit", "--n"):
        r = CliRunner().invoke(app, ["runs", "list", flag, "5"])
        assert r.exit_code == 0, (flag, r.output)


def test_add_scene_warns_at_once_about_a_folder_too_small_for_sfm(project):
    """A folder of two photos was added without a word; `splatflow run` then stopped at ingest."""
    two = project / "two"
    two.mkdir()
    for name in ("a.jpg", "b.JPG", "notes.txt"):
        (two / name).write_bytes(b"x")
    r = CliRunner().invoke(app, ["add-scene", "two", str(two)])
    assert r.exit_code == 0 and "added scene 'two'" in r.output, r.output
    assert "holds 2 image files" in r.output and "at least 3" in r.output, r.output
    for name in ("c.jpg", "d.png"):
        (two / name).write_bytes(b"x")
    r = CliRunner().invoke(app, ["add-scene", "four", str(two)])
    assert r.exit_code == 0 and "warning" not in r.output, r.output


def test_metrics_table_fits_120_columns_and_offers_the_lpips_weights(project):
    """`splatflow metrics`: the headline numbers of each scene in one table a terminal shows whole (`dvc metrics
    show` printed 134 columns in lines of 4,000+ characters); --all lists every number, one per line."""
    shutil.copytree(REPO / "metrics" / "demo", project / "metrics" / "demo")
    r = CliRunner().invoke(app, ["metrics"])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert max(len(line) for line in lines) <= 120
    assert lines[0].split()[:4] == ["scene", "PSNR", "dB", "SSIM"]
    row = lines[1].split()

    ev = stage_record(REPO, "demo", "evaluate")
    assert row[0] == "demo" and row[1] == f"{ev['psnr']:.2f}" and row[4] == f"{ev['gaussians']:,}"
    if ev["lpips_alex"] is None:
        assert row[3] == "n/a" and "splatflow weights fetch" in r.output
    full = CliRunner().invoke(app, ["metrics", "demo", "--all"])
    assert full.exit_code == 0 and max(len(line) for line in full.output.splitlines()) <= 120
    assert "demo / evaluate  (metrics/demo/evaluate.json)" in full.output and "test_views" in full.output
