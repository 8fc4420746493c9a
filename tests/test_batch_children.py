"""What a batch child needs: the throw-away git worktree it runs in (splatflow.orchestrate.workspace), and a one-line
reason when its scene fails (splatflow.orchestrate.dvcrun)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from splatflow.orchestrate import dvcrun
from splatflow.orchestrate.workspace import worktree
from tests._project import make_project


def _git(root: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.email=t@splatflow", "-c", "user.name=t", *args], cwd=root, check=True,
                   capture_output=True)


def test_worktree_gets_the_report_viewer_script_of_the_checkout(tmp_path):
    """The viewer script (`make web`) is git-ignored, so a worktree of a real checkout had none and every scene of a
    `splatflow batch` failed at its report stage ("splat-viewer.js is missing: run `make web`"), after training.
    (The test projects link splatflow/ itself, which hid it.)"""
    main = tmp_path / "proj"
    web = main / "splatflow" / "web"
    (web / "dist").mkdir(parents=True)
    (web / "package.json").write_text("{}\n")
    (main / ".gitignore").write_text("splatflow/web/dist/\n")
    (main / "params.yaml").write_text("base:\n  scenes: {}\n")
    _git(main, "init", "-q")
    _git(main, "add", "-A")
    _git(main, "commit", "-qm", "project")
    (web / "dist" / "splat-viewer.js").write_text("/* bundle */\n")
    (web / "dist" / "sources.sha256").write_text("abc\n")

    with worktree(main) as wt:
        assert wt != main and (wt / "splatflow" / "web" / "package.json").is_file()
        for name in ("splat-viewer.js", "sources.sha256"):
            copied = wt / "splatflow" / "web" / "dist" / name
            assert copied.is_file() and not copied.is_symlink()
            assert copied.read_bytes() == (web / "dist" / name).read_bytes()
    assert not wt.exists()


def test_a_failed_stage_says_its_own_exit_status_and_one_line_why(tmp_path):
    """A batch over a good scene and a two-photo folder ended in `walkrot (FAILED), two (FAILED)` and a traceback:
    no reason (it was in a worker's log), and StageFailed said `exit code 255` -- DVC's status for any failed stage --
    so its `bad input or setting` hint never showed. The real ingest stage of a two-image scene, through DVC:"""
    root = make_project(tmp_path / "proj", scene="two",
                        scene_options=dict(n_views=2, width=160, height=120, arc_deg=8.0, seed=0))
    env = dvcrun.stage_env({"SPLATFLOW_TRACKING": "off"})
    dvcrun.run_dvc_stage(root, "settings@two", env=env)  # as the flows do: one stage after the other
    with pytest.raises(dvcrun.StageFailed) as e:
        dvcrun.run_dvc_stage(root, "ingest@two", env=env)
    text = str(e.value)
    assert text.startswith("stage ingest@two failed with exit code 2 (dvc: 255) (bad input or setting"), text[:300]
    reason = dvcrun.failure_reason(text)
    assert reason.startswith("splatflow ingest [two] failed: ") and "only 2 images and none was rejected" in reason, reason
    assert "\n" not in reason
    # a Prefect state's message wraps the same text; a failure with no stage message gives its first line
    assert dvcrun.failure_reason(f"Flow run encountered an exception: StageFailed: {text}") == reason
    assert dvcrun.failure_reason("Flow run encountered an exception: ValueError: no scenes\nmore") == \
        "Flow run encountered an exception: ValueError: no scenes"


def test_a_finished_run_still_holds_when_a_stage_reads_part_of_an_upstream_output_folder(tmp_path):
    """A rerun of a batch skips the scenes that finished: in a fresh worktree with the earlier run's dvc.lock, every
    change DVC reports must be an absent output. split depends on data/S/undistorted/sparse, a folder inside sfm's
    output data/S/undistorted, which DVC reports as a deleted dep of its own: the check said the earlier run "does not
    hold any more (split@walkrot: changed deps data/walkrot/undistorted/sparse deleted)", and every scheduled batch
    trained every scene again."""
    import shutil

    from tests._project import BIN, init_repo, project_env, run

    root = tmp_path / "p"
    root.mkdir()
    (root / "params.yaml").write_text("two: {n: 1}\n")
    (root / "dvc.yaml").write_text(
        "stages:\n"
        "  one:\n"
        "    cmd: mkdir -p out/dir/sub && echo a > out/dir/sub/a.txt && echo b > out/dir/b.txt\n"
        "    outs: [out/dir]\n"
        "  two:\n"
        "    cmd: cat out/dir/sub/a.txt > out/two.txt\n"
        "    deps: [out/dir/sub]\n"
        "    params: [two]\n"
        "    outs: [out/two.txt]\n")
    (root / ".gitignore").write_text("/out/\n")
    init_repo(root, "toy")
    run([str(BIN / "dvc"), "repro"], root)
    shutil.rmtree(root / "out")  # what a fresh worktree with that dvc.lock looks like
    env = project_env()
    ok, why = dvcrun.only_outputs_missing(root, ["one", "two"], env)
    assert ok, why
    (root / "params.yaml").write_text("two: {n: 2}\n")  # a real change still counts
    ok, why = dvcrun.only_outputs_missing(root, ["one", "two"], env)
    assert not ok and "two" in why, why
