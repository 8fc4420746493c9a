"""The throw-away git worktrees that batch children, sweeps and reruns run in (splatflow.orchestrate.workspace)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from splatflow.orchestrate.workspace import worktree


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
