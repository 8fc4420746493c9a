"""Build a throw-away splatflow project (git + DVC) in a temp folder, for tests that run real stages."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

# A scene small enough for every stage to take seconds: 12 views at 320x240 on a 90° arc register 12/12 in ~1 s
# (docs/design.md §5).
TINY_SCENE = dict(n_views=12, width=320, height=240, arc_deg=90.0, seed=0)

# Params as small as every stage allows while still exercising it: 10 training steps at half resolution, one prune
# phase, no LPIPS (the flow, report and viewer tests run the whole pipeline on TINY_SCENE with these).
TINY_PARAMS = {
    "train": {"max_steps": 10, "sh_degree": 1, "sh_degree_interval": 5,
              "resolution": [{"factor": 0.5, "start_fraction": 0.0}],
              "blur": {"sigma_start_px": 0.0, "end_fraction": 0.5}, "densify": {"strategy": "none"},
              "early_stop": {"enabled": False}, "log_every": 2, "progress": False, "checkpoint_every": 1000},
    "prune": {"phases": 1, "finetune_steps": 2, "progress": False, "min_train_views": 0},
    "evaluate": {"lpips_variants": []},
}


# A folder every process of one test run sees (tests/conftest.py sets it: under pytest-xdist, the folder above the
# workers' own temp folders), for what is built once per run and then copied. None outside pytest: built each time.
SHARED: Path | None = None


@contextlib.contextmanager
def shared_lock(name: str):
    """An exclusive lock on ``SHARED/<name>.lock`` across the processes of a test run (no-op without ``SHARED``)."""
    if SHARED is None:
        yield
        return
    SHARED.mkdir(parents=True, exist_ok=True)
    with open(SHARED / f"{name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def write_scene_copy(out_dir: Path, **options) -> Path:
    """``write_scene(out_dir, **options)``, from files generated once per test run and copied: equal options give
    byte-identical files (splatflow.scene.synthetic.write_scene), and rendering the 12 views of TINY_SCENE costs
    ~5 CPU-s that most tests making a project would otherwise pay again."""
    from splatflow.scene.synthetic import write_scene

    if SHARED is None:
        write_scene(out_dir, progress=False, **options)
        return out_dir
    key = json.dumps(options, sort_keys=True)
    cached = SHARED / "scenes" / hashlib.sha1(key.encode()).hexdigest()[:16]
    with shared_lock("scenes"):
        if not cached.is_dir():
            write_scene(cached.with_suffix(".tmp"), progress=False, **options)
            cached.with_suffix(".tmp").rename(cached)
    shutil.copytree(cached, out_dir, dirs_exist_ok=True)
    return out_dir


def project_env() -> dict:
    env = os.environ.copy()
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env["PYTHONPATH"] = ""  # stages import splatflow from the installed (editable) package
    return env


def run(cmd: list[str], cwd: Path, check: bool = True, **kw) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, cwd=cwd, env=kw.pop("env", project_env()), capture_output=True, text=True, **kw)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} failed ({p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}")
    return p


def make_project(root: Path, overrides: dict | None = None, scene: str = "tiny", scene_options: dict | None = None,
                 generate: bool = True) -> Path:
    """Copy the project's code and config to ``root``, point base.scenes at a generated tiny scene, git+dvc init."""
    root.mkdir(parents=True, exist_ok=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    # The library is linked, not copied: `python -m stages.x` imports splatflow from the project folder, and numba
    # files the compiled kernels by their resolved source folder (splatflow/render/_numba_cache.py), so linked
    # projects load the checkout's kernels; a copy would recompile them (~42 s of CPU) in every project.
    (root / "splatflow").symlink_to(REPO / "splatflow", target_is_directory=True)
    for d in ("stages", "flows"):
        if (REPO / d).is_dir():
            shutil.copytree(REPO / d, root / d, ignore=ignore, dirs_exist_ok=True)
    for f in ("dvc.yaml", ".gitignore", ".dvcignore"):
        if (REPO / f).exists():
            shutil.copy(REPO / f, root / f)
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    raw = f"data/raw/{scene}"
    params["base"]["scenes"] = {scene: {"source": f"{raw}/images", "ground_truth": f"{raw}/ground_truth"}}
    for section, values in (overrides or {}).items():
        params.setdefault(section, {})
        if isinstance(params[section], dict):
            params[section].update(values)
        else:
            params[section] = values
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    if generate:
        write_scene_copy(root / raw, **(scene_options or TINY_SCENE))
    return init_repo(root, "test project")


def init_repo(root: Path, message: str) -> Path:
    """git + DVC init ``root`` and commit everything in it (analytics off, a local identity for the commit)."""
    run(["git", "init", "-q"], root)
    run(["git", "config", "user.email", "test@splatflow"], root)
    run(["git", "config", "user.name", "splatflow test"], root)
    run([str(BIN / "dvc"), "init", "-q"], root)
    run([str(BIN / "dvc"), "config", "core.analytics", "false"], root)
    run(["git", "add", "-A"], root)
    run(["git", "commit", "-qm", message], root)
    return root


def dvc(root: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return run([str(BIN / "dvc"), *args], root, check=check)


def drill_project(root: Path, *, max_steps: int, checkpoint_every: int, scene: str = "tiny") -> Path:
    """A tiny project through ``split``, sized for stop/kill drills of the real stage processes: one thread, no
    plateau stop, and the prune stage's own phases (not pruning during training), since those are what is drilled."""
    root = make_project(root, overrides={
        "base": {"threads": 1},
        "train": {"max_steps": max_steps, "progress": False, "log_every": 5, "checkpoint_every": checkpoint_every,
                  "early_stop": {"enabled": False}, "prune_during": {"enabled": False}},
        "prune": {"phases": 3, "finetune_steps": 15, "progress": False, "val_views": 2, "score_rounds": 1,
                  "min_train_views": 0},
    })
    dvc(root, "repro", f"split@{scene}")
    return root


def tracked_env(root: Path, **extra: str) -> dict:
    """The project environment with MLflow tracking on, into ``root/mlflow.db``, and no inherited run."""
    env = project_env()
    env.update({"SPLATFLOW_TRACKING": "on", "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}", **extra})
    env.pop("MLFLOW_RUN_ID", None)
    return env


def stage_record(root: Path, scene: str, stage: str) -> dict:
    """A stage's whole result: the numbers of ``metrics/<scene>/<stage>.json`` and the texts, settings and lists of
    ``metrics/<scene>/info/<stage>.json`` in one dict (:func:`splatflow.pipeline.records.read`)."""
    from splatflow.pipeline import records
    from splatflow.pipeline.paths import ScenePaths

    return records.read(ScenePaths(scene, root), stage)


def task_runs(client, flow_run_id, n: int, timeout_s: float = 120) -> list:
    """The flow run's task runs once all ``n`` are recorded in a final state (the server records task runs from
    the events the client sends, a moment after the flow run returns)."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    deadline = time.monotonic() + timeout_s
    while True:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        if (len(runs) >= n and all(t.state is not None and t.state.is_final() for t in runs)) \
                or time.monotonic() > deadline:
            return runs
        time.sleep(1)
