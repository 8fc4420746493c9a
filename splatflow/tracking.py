"""MLflow tracking for splatflow: one MLflow run per scene per pipeline run, whoever starts the pipeline.

Why this module exists (DESIGN.md §2): DVC owns the graph and Prefect runs it, but a run of the pipeline must
still show up as *one* MLflow run per scene with the params, live training curves, final metrics of every stage,
the exported PLY/.splat/.spz, renders, plots and ``dvc.lock`` -- whether it was started by a Prefect flow, by a
batch, by ``splatflow rerun`` or by a plain ``dvc repro`` in a checkout.

How a stage finds "its" run (``stage_tracking``), in order:

1. ``SPLATFLOW_TRACKING=off`` -> nothing is logged (unit tests, offline debugging).
2. ``MLFLOW_RUN_ID`` is set -> attach to that run.  Whoever set it (the Prefect ``reconstruct`` flow, a batch
   parent, ``splatflow rerun``) *owns* the run: the stage logs into it but never ends it.
3. Otherwise the stage looks for the ``dvc`` process it runs under (walking up its parent processes).  The first
   stage of a ``dvc repro`` creates the scene run and records ``(run id, dvc pid, dvc start time, tracking URI)``
   in the untracked state file ``.splatflow/runs/<scene>.json``; later stages of the *same* ``dvc repro``
   (same pid *and* start time, so a recycled pid cannot match) attach to it.  A new ``dvc repro`` never matches
   and gets a new run.  Such a run is owned by the stages: each stage marks it RUNNING while it works and
   FINISHED when done (FAILED on error, KILLED on SIGTERM/Ctrl-C), so no run is left RUNNING between stages.
   A new run is seeded with the current ``metrics/<scene>/*.json`` of every stage, so that a repro that only
   reruns ``train`` onwards still has the complete set of final metrics for ``splatflow compare``.
4. A stage run by hand (no dvc parent) gets a run of its own.

Runs left RUNNING by a process that died without a chance to clean up (SIGKILL, power loss) carry the owner's
``splatflow.host``/``splatflow.pid``/``splatflow.pid_start`` tags; :func:`reap` marks them KILLED.

Naming: params are the flattened params.yaml sections a stage declares in dvc.yaml (``train.max_steps``); final
metrics are ``<stage>.<name>`` (``evaluate.psnr``); live step metrics are ``<stage>/<name>`` at their step
(``train/loss``), so the MLflow UI groups the curves per stage.  Artifacts keep their repo-relative paths
(``models/demo/export/scene.ply``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Iterable, Iterator

DEFAULT_EXPERIMENT = "splatflow"
#: Files with these suffixes among a stage's DVC outs/metrics/plots are logged as artifacts (checkpoints are
#: not: they live in the DVC cache and would double the artifact store).
ARTIFACT_SUFFIXES = {".ply", ".splat", ".spz", ".json", ".csv", ".png", ".jpg", ".jpeg", ".html", ".md", ".txt",
                     ".tsv", ".yaml"}
#: Folders among a stage's outs that are logged file by file (renders of test views).
ARTIFACT_DIR_NAMES = {"renders", "export", "reports"}
MAX_ARTIFACT_BYTES = 200 * 1024 * 1024  # one file
MAX_DIR_FILES = 500
STEP_FLUSH_SECONDS = 2.0  # live enough for the UI, cheap enough (one log_batch costs ~20 ms)
STEP_FLUSH_ROWS = 500  # MLflow accepts at most 1000 metrics per log_batch

#: MLflow 3's UI opens an experiment in its GenAI view unless this tag marks it for model training.
EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"
#: Where ``splatflow ui`` serves the MLflow UI (used for links when the tracking URI is a local database).
DEFAULT_UI_URL = "http://127.0.0.1:5000"

_ACTIVE: "StageTracker | None" = None  # the tracker of the stage running in this process


# --------------------------------------------------------------------------------------------- configuration


def enabled() -> bool:
    """False when ``SPLATFLOW_TRACKING`` is ``off``/``0``/``false`` (unit tests)."""
    return os.environ.get("SPLATFLOW_TRACKING", "on").strip().lower() not in {"off", "0", "false", "no"}


from splatflow.paths import repo_root  # noqa: E402,F401  (one way to find the root: splatflow.paths)


def tracking_uri(root: str | Path | None = None) -> str:
    """``MLFLOW_TRACKING_URI`` if set, else ``sqlite:///<repo root>/mlflow.db`` (MLflow 3 refuses the file store)."""
    uri = os.environ.get("MLFLOW_TRACKING_URI", "").strip()
    if uri:
        return uri
    return f"sqlite:///{repo_root(root) / 'mlflow.db'}"


def _quiet_mlflow_env() -> None:
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")


def client(uri: str | None = None):
    """An ``MlflowClient`` on the splatflow tracking URI."""
    _quiet_mlflow_env()
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri or tracking_uri())


def experiment_id(cl, name: str | None = None, uri: str | None = None) -> str:
    """Get or create the experiment (``MLFLOW_EXPERIMENT_NAME`` or ``splatflow``).

    With a local sqlite store the artifact root is pinned next to the database (``mlartifacts/``): MLflow's own
    default is ``./mlruns`` relative to whatever the cwd is, which scatters artifacts over worktrees.
    """
    name = name or os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT
    exp = cl.get_experiment_by_name(name)
    if exp is not None:
        if EXPERIMENT_KIND_TAG not in (exp.tags or {}):
            with contextlib.suppress(Exception):
                cl.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
        return exp.experiment_id
    uri = uri or getattr(getattr(cl, "_tracking_client", None), "tracking_uri", None)
    location = None
    if uri and uri.startswith("sqlite:///"):
        location = (Path(uri[len("sqlite:///"):]).parent / "mlartifacts").resolve().as_uri()
    try:
        return cl.create_experiment(name, artifact_location=location, tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
    except Exception:  # another process created it between our get and create
        exp = cl.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def run_ui_url(experiment: str, run_id: str, uri: str | None = None) -> str:
    """The run's page in the MLflow UI: the tracking server itself, or ``SPLATFLOW_MLFLOW_UI`` (default
    ``splatflow ui``'s address) when runs go to a local database.  ``workflowType=machine_learning`` opens MLflow
    3.17's UI in its model-training view (its default is the GenAI one, a per-browser setting)."""
    uri = uri or tracking_uri()
    base = uri if uri.startswith(("http://", "https://")) else os.environ.get("SPLATFLOW_MLFLOW_UI", DEFAULT_UI_URL)
    return f"{base.rstrip('/')}/#/experiments/{experiment}/runs/{run_id}?workflowType=machine_learning"


# --------------------------------------------------------------------------------------------- provenance


def _git(root: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_tags(root: Path) -> dict[str, str]:
    """Commit and dirty flag (tracked files only: untracked outputs don't make a run unreproducible)."""
    commit = _git(root, "rev-parse", "HEAD")
    tags = {"git.commit": commit or "none"}
    if commit:
        tags["mlflow.source.git.commit"] = commit
        status = _git(root, "status", "--porcelain", "--untracked-files=no")
        tags["git.dirty"] = "true" if status else "false"
        branch = _git(root, "rev-parse", "--abbrev-ref", "HEAD")
        if branch:
            tags["git.branch"] = branch
    return tags


def dvc_lock_tags(root: Path, scene: str) -> dict[str, str]:
    """One tag per stage of ``scene`` in dvc.lock: a short digest of its deps, params and outs hashes.

    Two runs with equal ``dvc.hash.<stage>`` tags ran that stage on identical inputs and produced identical
    outputs (DVC's own md5s); tags carry the state of dvc.lock when they were logged.
    """
    lock = root / "dvc.lock"
    if not lock.exists():
        return {}
    import yaml

    try:
        data = yaml.safe_load(lock.read_text()) or {}
    except Exception:
        return {}
    tags = {}
    for name, entry in (data.get("stages") or {}).items():
        base, _, item = name.partition("@")
        if item and item != scene:
            continue
        digest = hashlib.sha1(json.dumps(entry, sort_keys=True, default=str).encode()).hexdigest()[:16]
        tags[f"dvc.hash.{base}"] = digest
    return tags


def dvc_exp_tags(root: Path, params: Any = None) -> dict[str, str]:
    """Under ``dvc exp run`` (DVC sets ``DVC_EXP_NAME``/``DVC_EXP_BASELINE_REV`` for every stage): the
    experiment's name, its baseline commit and its param overrides (``train.max_steps=2000``: every key whose
    value differs from params.yaml at the baseline), so the run shows which experiment it is. {} otherwise."""
    name = os.environ.get("DVC_EXP_NAME", "").strip()
    if not name:
        return {}
    tags = {"dvc.exp.name": name}
    base = os.environ.get("DVC_EXP_BASELINE_REV", "").strip()
    if base:
        tags["dvc.exp.baseline"] = base
    if params is not None:
        with contextlib.suppress(Exception):  # best effort: the tag is information, not provenance
            import yaml

            from splatflow.config import params_from_dict

            text = _git(root, "show", f"{base or 'HEAD'}:params.yaml")
            if text is not None:
                before = flatten_params(params_from_dict(yaml.safe_load(text)))
                now = flatten_params(params)
                changed = sorted(k for k in now if before.get(k) != now[k])
                tags["splatflow.overrides"] = ",".join(f"{k}={now[k]}" for k in changed)
    return tags


def _process_tags(pid: int | None = None) -> dict[str, str]:
    import psutil

    proc = psutil.Process(pid or os.getpid())
    return {"splatflow.host": socket.gethostname(), "splatflow.pid": str(proc.pid),
            "splatflow.pid_start": f"{proc.create_time():.3f}"}


def _backend_tag(params: Any) -> dict[str, str]:
    tags = {}
    train = getattr(params, "train", None)
    if train is not None and hasattr(train, "backend"):
        tags["train.backend"] = str(train.backend)
    torch = sys.modules.get("torch")  # never import torch just for a tag
    if torch is not None:  # whether a GPU exists; what each stage actually ran on is tagged by log_result
        tags["gpu_available"] = str(bool(torch.cuda.is_available())).lower()
    return tags


def device_tags(stage: str, metrics: dict) -> dict[str, str]:
    """``<stage>.backend``, ``<stage>.device_name``, ``<stage>.torch``, ... from a stage's ``device`` record
    (:func:`splatflow.device.run_record`): the backend and versions that actually ran."""
    rec = (metrics or {}).get("device")
    if not isinstance(rec, dict):
        return {}
    return {f"{stage}.{k}": str(v) for k, v in rec.items() if isinstance(v, str)}


# --------------------------------------------------------------------------------------------- params / metrics


def flatten_params(params: Any, sections: Iterable[str] | None = None) -> dict[str, str]:
    """``Params`` (or a plain dict) -> ``{"train.lr.means": "0.00016", ...}`` for the given sections.

    A section may be a dotted key (``base.seed``), as dvc.yaml allows.  Values are strings (MLflow params are).
    """
    from splatflow.config import flatten, section_dict

    data = section_dict(params) if dataclasses.is_dataclass(params) else dict(params or {})
    flat = flatten(data)
    if sections is None:
        keep = flat
    else:
        prefixes = list(sections)
        keep = {k: v for k, v in flat.items() if any(k == p or k.startswith(p + ".") for p in prefixes)}
    return {k: json.dumps(v) if isinstance(v, (list, dict, tuple)) else str(v) for k, v in keep.items()}


def numeric_metrics(metrics: dict, prefix: str) -> dict[str, float]:
    """Flatten a metrics dict to finite floats named ``<prefix>.<key>``; strings/None/lists are skipped."""
    out: dict[str, float] = {}

    def walk(d: dict, pre: str) -> None:
        for k, v in d.items():
            key = f"{pre}.{k}"
            if isinstance(v, dict):
                walk(v, key)
            elif isinstance(v, bool):
                out[key] = float(v)
            elif isinstance(v, (int, float)) and math.isfinite(float(v)):
                out[key] = float(v)

    walk(metrics or {}, prefix)
    return out


def _log_batch(cl, run_id: str, *, params: dict | None = None, metrics: dict | None = None, step: int = 0,
               tags: dict | None = None, timestamp_ms: int | None = None) -> None:
    from mlflow.entities import Metric, Param, RunTag

    ts = timestamp_ms or int(time.time() * 1000)
    m = [Metric(k, v, ts, step) for k, v in (metrics or {}).items()]
    p = [Param(k, v[:6000]) for k, v in (params or {}).items()]
    t = [RunTag(k, str(v)[:5000]) for k, v in (tags or {}).items()]
    # MLflow limits one batch to 1000 metrics, 100 params, 100 tags.
    while m or p or t:
        cl.log_batch(run_id, metrics=m[:1000], params=p[:100], tags=t[:100])
        m, p, t = m[1000:], p[100:], t[100:]


def _stage_sections(root: Path, stage: str) -> list[str] | None:
    """The params a stage declares in dvc.yaml (``base.seed``, ``train``); None if dvc.yaml can't say."""
    import yaml

    try:
        data = yaml.safe_load((root / "dvc.yaml").read_text()) or {}
        spec = data["stages"][stage]
    except Exception:
        return None
    spec = spec.get("do", spec)
    out = []
    for p in spec.get("params") or []:
        if isinstance(p, str):
            out.append(p)
        elif isinstance(p, dict):  # {params_file: [keys]}
            for keys in p.values():
                out.extend(keys or [])
    return out


def _stage_files(root: Path, stage: str, scene: str) -> list[Path]:
    """The outs, metrics and plots of ``<stage>@<scene>`` as dvc.yaml declares them (``${key}`` filled in)."""
    import yaml

    try:
        data = yaml.safe_load((root / "dvc.yaml").read_text()) or {}
        spec = data["stages"][stage]
    except Exception:
        return []
    spec = spec.get("do", spec)
    files = []
    for field_name in ("outs", "metrics", "plots"):
        for entry in spec.get(field_name) or []:
            path = entry if isinstance(entry, str) else next(iter(entry), None)
            if isinstance(path, str):
                files.append(root / path.replace("${key}", scene).replace("${item}", scene))
    return files


def artifact_files(root: Path, stage: str, scene: str) -> list[Path]:
    """Files worth keeping in MLflow from one stage: exports, renders, reports, metrics, plots (no checkpoints)."""
    from splatflow.paths import ScenePaths

    paths = ScenePaths(scene, root)
    candidates = _stage_files(root, stage, scene) or [paths.metrics_json(stage)]
    candidates.append(paths.metrics_json(stage))
    out: list[Path] = []
    for c in candidates:
        if c.is_file() and c.suffix.lower() in ARTIFACT_SUFFIXES and c.stat().st_size <= MAX_ARTIFACT_BYTES:
            out.append(c)
        elif c.is_dir() and (c.name in ARTIFACT_DIR_NAMES):
            files = sorted(f for f in c.rglob("*") if f.is_file() and f.suffix.lower() in ARTIFACT_SUFFIXES
                           and f.stat().st_size <= MAX_ARTIFACT_BYTES)
            out.extend(files[:MAX_DIR_FILES])
    seen, unique = set(), []
    for f in out:
        if f.resolve() not in seen:
            seen.add(f.resolve())
            unique.append(f)
    return unique


def log_files(cl, run_id: str, root: Path, files: Iterable[Path]) -> int:
    """Log files under their repo-relative folder (``models/demo/export/scene.ply``); returns how many."""
    n = 0
    for f in files:
        try:
            rel = f.resolve().relative_to(root.resolve())
            folder = str(rel.parent) if str(rel.parent) != "." else None
        except ValueError:
            folder = None
        cl.log_artifact(run_id, str(f), artifact_path=folder)
        n += 1
    return n


# --------------------------------------------------------------------------------------------- run state file


def _state_file(root: Path, scene: str) -> Path:
    return root / ".splatflow" / "runs" / f"{scene}.json"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def dvc_ancestor() -> tuple[int, float] | None:
    """(pid, start time) of the nearest ``dvc`` process above this one, or None when not run by DVC.

    DVC runs a stage's ``cmd`` through a shell, so the stage's parent is ``sh`` (or the stage itself when the
    shell execs); walking up finds the ``dvc repro`` / ``dvc exp run`` process shared by all stages of one run.
    """
    import psutil

    try:
        proc = psutil.Process().parent()
        while proc is not None and proc.pid > 1:
            try:
                cmd = proc.cmdline()
            except (psutil.AccessDenied, psutil.ZombieProcess):
                cmd = []
            if _is_dvc_cmd(cmd):
                return proc.pid, proc.create_time()
            proc = proc.parent()
    except psutil.Error:
        return None
    return None


def _is_dvc_cmd(cmd: list[str]) -> bool:
    for i, arg in enumerate(cmd[:3]):
        name = os.path.basename(arg)
        if name == "dvc" or arg.endswith("dvc/__main__.py"):
            return True
        if arg == "-m" and i + 1 < len(cmd) and cmd[i + 1] == "dvc":
            return True
    return False


# --------------------------------------------------------------------------------------------- the stage tracker


class StageTracker:
    """What ``stage_main`` holds while a stage runs: the scene run, and whether this process owns its status."""

    def __init__(self, stage: str, scene: str, root: Path, params: Any, cl=None, run_id: str | None = None,
                 owns_status: bool = False):
        self.stage, self.scene, self.root, self.params = stage, scene, root, params
        self.client, self.run_id, self.owns_status = cl, run_id, owns_status
        self.result: dict | None = None

    @property
    def active(self) -> bool:
        return self.client is not None and self.run_id is not None

    def log_result(self, metrics: dict) -> None:
        """Log a stage's final metrics as ``<stage>.<name>`` (called by stage_main after ``run``)."""
        self.result = dict(metrics or {})
        if self.active:
            self._safe(_log_batch, self.client, self.run_id, metrics=numeric_metrics(self.result, self.stage),
                       tags=device_tags(self.stage, self.result))

    def log_artifacts(self, files: Iterable[Path]) -> None:
        if self.active:
            self._safe(log_files, self.client, self.run_id, self.root, list(files))

    def _safe(self, fn, *args, **kwargs):
        """Tracking must never fail a stage: a store that is down costs the log, not the result."""
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001
            warnings.warn(f"splatflow tracking: {getattr(fn, '__name__', fn)} failed: {e}", stacklevel=2)
            return None

    def terminate(self, status: str) -> None:
        if not self.active:
            return
        if status == "KILLED" or self.owns_status:
            self._safe(self.client.set_terminated, self.run_id, status)

    def finish_success(self) -> None:
        """Artifacts, refreshed provenance tags, then FINISHED (only when this process owns the status)."""
        if not self.active:
            return
        files = self._safe(artifact_files, self.root, self.stage, self.scene) or []
        self.log_artifacts(files)
        if self.stage == "train":
            self._log_train_png()
        lock = self.root / "dvc.lock"
        if lock.exists():
            self.log_artifacts([lock])
        self._safe(_log_batch, self.client, self.run_id, tags={**dvc_lock_tags(self.root, self.scene),
                                                               f"splatflow.stage.{self.stage}": "done"})
        self.terminate("FINISHED")

    def _log_train_png(self) -> None:
        from splatflow.paths import ScenePaths

        csv = ScenePaths(self.scene, self.root).train_csv
        if not csv.exists():
            return
        from splatflow.orchestrate.plots import render_csv_png

        with tempfile.TemporaryDirectory() as tmp:
            png = self._safe(render_csv_png, csv, Path(tmp) / "train.png", title=f"{self.scene}: train")
            if png:
                self._safe(self.client.log_artifact, self.run_id, str(png), f"plots/{self.scene}")


def _open_run(stage: str, scene: str, root: Path, params: Any) -> StageTracker:
    """Resolve the scene run as the module docstring describes, and start logging this stage into it."""
    uri = tracking_uri(root)
    cl = client(uri)
    run_id = os.environ.get("MLFLOW_RUN_ID", "").strip() or None
    owns = False
    state = _state_file(root, scene)
    if run_id is None:
        anc = dvc_ancestor()
        with _locked(state):
            prev = None
            if anc is not None and state.exists():
                with contextlib.suppress(Exception):
                    prev = json.loads(state.read_text())
            if (prev and anc and prev.get("dvc_pid") == anc[0] and abs(prev.get("dvc_start", 0) - anc[1]) < 1e-2
                    and prev.get("tracking_uri") == uri):
                run_id = prev["run_id"]
            else:
                run_id = create_scene_run(cl, scene, root, params, uri=uri,
                                          tags={"splatflow.started_by": "dvc" if anc else "stage"})
                if anc is not None:
                    state.write_text(json.dumps({"run_id": run_id, "dvc_pid": anc[0], "dvc_start": anc[1],
                                                 "tracking_uri": uri, "created": time.time()}) + "\n")
        owns = True
        cl.update_run(run_id, status="RUNNING")
    tracker = StageTracker(stage, scene, root, params, cl, run_id, owns_status=owns)
    sections = _stage_sections(root, stage)
    if sections is not None:  # foreach stages declare per-scene keys (base.scenes.${key})
        sections = [s.replace("${key}", scene) for s in sections]
    tags = {**_backend_tag(params), f"splatflow.stage.{stage}": "running"}
    if owns:
        tags.update(_process_tags())
    tracker._safe(_log_batch, cl, run_id, params=flatten_params(params, sections), tags=tags)
    return tracker


def create_scene_run(cl, scene: str, root: Path, params: Any = None, *, uri: str | None = None,
                     parent_run_id: str | None = None, run_name: str | None = None, tags: dict | None = None,
                     seed_metrics: bool = True, owner_pid: int | None = None) -> str:
    """Create the MLflow run of one scene for one pipeline run; returns its id.

    Tags: scene, git commit/dirty, dvc.lock stage hashes, host and owner pid (for :func:`reap`), the parent
    (``mlflow.parentRunId``) for batch children.  ``seed_metrics`` logs the current ``metrics/<scene>/*.json``
    so the run has every stage's final metrics even when DVC skips the unchanged stages.
    """
    exp = experiment_id(cl, uri=uri)
    exp_tags = dvc_exp_tags(root, params)
    all_tags = {"splatflow.scene": scene, **git_tags(root), **dvc_lock_tags(root, scene),
                **_process_tags(owner_pid), **exp_tags, **(tags or {})}
    if parent_run_id:
        all_tags["mlflow.parentRunId"] = parent_run_id
    name = run_name or (f"{scene}-{exp_tags['dvc.exp.name']}" if exp_tags else
                        f"{scene}-{time.strftime('%Y%m%d-%H%M%S')}")
    run = cl.create_run(exp, run_name=name, tags=all_tags)
    run_id = run.info.run_id
    if params is not None:  # every section: the run stands for the whole pipeline state, run or skipped
        _log_batch(cl, run_id, params=flatten_params(params))
    if seed_metrics:
        from splatflow.paths import ScenePaths

        mdir = ScenePaths(scene, root).metrics_dir
        seeded = {}
        for f in sorted(mdir.glob("*.json")) if mdir.exists() else []:
            with contextlib.suppress(Exception):
                seeded.update(numeric_metrics(json.loads(f.read_text()), f.stem))
        if seeded:
            # timestamp 0 keeps them below anything this run logs itself: MLflow shows the latest value.
            _log_batch(cl, run_id, metrics=seeded, timestamp_ms=1)
    return run_id


@contextlib.contextmanager
def stage_tracking(stage: str, scene: str, params: Any = None, paths: Any = None) -> Iterator[StageTracker]:
    """Wrap one stage's work: attach to (or create) the scene run, log params, then on exit metrics,
    artifacts, provenance tags and the status (FINISHED / FAILED / KILLED on SIGTERM or Ctrl-C).

    Use::

        with stage_tracking("train", scene, params, paths) as tracker:
            metrics = run(params, paths)
            tracker.log_result(metrics)

    A failure to reach the tracking store is a warning, never a stage failure.
    """
    global _ACTIVE
    from splatflow import stop

    root = Path(getattr(paths, "root", None) or repo_root()).resolve()
    # This process's one SIGTERM owner (splatflow.stop), installed before anything that may take a while, so a
    # SIGTERM while the run is being opened is recorded too; opening is not interrupted half-way.
    prev_handler = stop.install()
    try:
        with stop.cooperative():
            tracker = _open_run(stage, scene, root, params) if enabled() else StageTracker(stage, scene, root, params)
    except Exception as e:  # noqa: BLE001 - tracking must not stop the pipeline
        warnings.warn(f"splatflow tracking disabled for this stage: cannot reach {tracking_uri(root)}: {e}",
                      stacklevel=2)
        tracker = StageTracker(stage, scene, root, params)
    _ACTIVE = tracker
    try:
        stop.raise_if_requested("before the stage started")
        yield tracker
    except BaseException as e:
        with stop.cooperative():  # the status must be written whole, also when a second SIGTERM comes
            if tracker.active:
                if isinstance(e, (KeyboardInterrupt, stop.StageStopped)) or (
                        isinstance(e, SystemExit) and e.code == stop.STOP_EXIT_CODE) or (
                        stop.requested() and not (isinstance(e, SystemExit) and e.code in (0, None))):
                    # (the last: a stop raised inside a callback from native code, e.g. numba's, reaches us
                    # wrapped in another exception; it is still the stop)
                    tracker._safe(_log_batch, tracker.client, tracker.run_id,
                                  tags={f"splatflow.stage.{stage}": "stopped"})
                    tracker.terminate("KILLED")
                elif isinstance(e, SystemExit) and e.code in (0, None):
                    tracker.finish_success()
                else:
                    tracker._safe(_log_batch, tracker.client, tracker.run_id,
                                  tags={f"splatflow.stage.{stage}": "failed",
                                        "splatflow.error": f"{stage}: {type(e).__name__}: {e}"[:4000]})
                    tracker.terminate("FAILED")
        raise
    else:
        with stop.cooperative():  # the work is done: finish recording it even if SIGTERM comes now
            tracker.finish_success()
    finally:
        _ACTIVE = None
        with stop.cooperative():
            flush_all()
        stop.restore(prev_handler)


def finalize_scene_run(cl, run_id: str, root: Path, scene: str, stages: Iterable[str], status: str) -> None:
    """End a scene run owned by a flow/rerun: the final metrics of every stage (``metrics/<scene>/*.json``, also
    for stages DVC skipped), the artifacts of stages that did not log themselves, dvc.lock and its stage hashes,
    then ``status``.  Each step is best effort: the status is always set."""
    from splatflow.paths import ScenePaths

    try:
        tags = cl.get_run(run_id).data.tags
        metrics = {}
        mdir = ScenePaths(scene, root).metrics_dir
        for f in sorted(mdir.glob("*.json")) if mdir.exists() else []:
            with contextlib.suppress(Exception):
                metrics.update(numeric_metrics(json.loads(f.read_text()), f.stem))
        _log_batch(cl, run_id, metrics=metrics, tags=dvc_lock_tags(root, scene))
        if status == "FINISHED":
            for stage in stages:
                base = stage.partition("@")[0]
                if tags.get(f"splatflow.stage.{base}") != "done":
                    log_files(cl, run_id, root, artifact_files(root, base, scene))
                    if base == "train":
                        StageTracker(base, scene, root, None, cl, run_id)._log_train_png()
        if (root / "dvc.lock").exists():
            log_files(cl, run_id, root, [root / "dvc.lock"])
    except Exception as e:  # noqa: BLE001
        warnings.warn(f"splatflow tracking: finalising run {run_id} failed: {e}", stacklevel=2)
    finally:
        with contextlib.suppress(Exception):
            cl.set_terminated(run_id, status)


def log_stage(scene: str, stage: str, params: Any = None, metrics: dict | None = None,
              artifacts: Iterable[Path] | None = None, run_id: str | None = None, root: Path | None = None) -> None:
    """Log one stage's params, final metrics and artifacts into a given run (or ``MLFLOW_RUN_ID``) at once.

    For code that does not go through ``stage_main`` (e.g. a flow logging results it read back).
    """
    if not enabled():
        return
    root = Path(root or repo_root()).resolve()
    run_id = run_id or os.environ.get("MLFLOW_RUN_ID")
    if not run_id:
        raise ValueError("log_stage needs a run id (argument or MLFLOW_RUN_ID)")
    cl = client(tracking_uri(root))
    _log_batch(cl, run_id, params=flatten_params(params, _stage_sections(root, stage)) if params else None,
               metrics=numeric_metrics(metrics or {}, stage))
    log_files(cl, run_id, root, artifacts if artifacts is not None else artifact_files(root, stage, scene))


# --------------------------------------------------------------------------------------------- step metrics


class StepLogger:
    """Buffered live step metrics (``train/loss`` at step 120): flushed every ``STEP_FLUSH_SECONDS`` or
    ``STEP_FLUSH_ROWS`` values, and on ``close()``; a no-op when there is no run or tracking is off."""

    def __init__(self, stage: str, run_id: str | None, cl=None):
        self.stage, self.run_id, self.client = stage, run_id, cl
        self._buf: list = []
        self._last_flush = time.monotonic()
        self._failed = False
        self._lock = threading.Lock()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self.run_id is None or self._failed:
            return
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        for k, v in metrics.items():
            v = float(v)
            if math.isfinite(v):
                self._buf.append(Metric(f"{self.stage}/{k}", v, ts, int(step)))
        if len(self._buf) >= STEP_FLUSH_ROWS or time.monotonic() - self._last_flush >= STEP_FLUSH_SECONDS:
            self.flush()

    def flush(self) -> None:
        with self._lock:
            buf, self._buf = self._buf, []
            self._last_flush = time.monotonic()
            if not buf or self.run_id is None or self._failed:
                return
            try:
                for i in range(0, len(buf), 1000):
                    self.client.log_batch(self.run_id, metrics=buf[i : i + 1000])
            except Exception as e:  # noqa: BLE001
                self._failed = True
                warnings.warn(f"splatflow tracking: step metrics disabled: {e}", stacklevel=2)

    def close(self) -> None:
        self.flush()
        with contextlib.suppress(ValueError):
            _LOGGERS.remove(self)


_LOGGERS: list[StepLogger] = []


def flush_all() -> None:
    for lg in list(_LOGGERS):
        lg.flush()


def step_logger(stage: str) -> StepLogger:
    """The step logger of the stage running in this process (see docs/CONTRACTS.md "Tracking")."""
    if not enabled():
        return StepLogger(stage, None)
    if _ACTIVE is not None:
        if not _ACTIVE.active:
            return StepLogger(stage, None)
        lg = StepLogger(stage, _ACTIVE.run_id, _ACTIVE.client)
    else:
        run_id = os.environ.get("MLFLOW_RUN_ID") or None
        if run_id is None:
            return StepLogger(stage, None)
        try:
            lg = StepLogger(stage, run_id, client())
        except Exception as e:  # noqa: BLE001
            warnings.warn(f"splatflow tracking: step metrics disabled: {e}", stacklevel=2)
            return StepLogger(stage, None)
    _LOGGERS.append(lg)
    return lg


# --------------------------------------------------------------------------------------------- maintenance


def _pid_alive(pid: int, start: float | None) -> bool:
    import psutil

    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return start is None or abs(proc.create_time() - start) < 1.0
    except psutil.Error:
        return False


def reap(uri: str | None = None, *, older_than_hours: float | None = None, dry_run: bool = False) -> list[dict]:
    """Mark KILLED the runs left RUNNING by a process that no longer exists.

    A run is stale when its ``splatflow.host`` is this host and its ``splatflow.pid`` (with the same start time,
    so a recycled pid does not count) is gone.  Runs from other hosts, or without those tags, are only reaped
    when ``older_than_hours`` is given and they started longer ago than that.  Returns what was (or would be)
    reaped: ``[{"run_id", "scene", "reason"}]``.
    """
    cl = client(uri)
    exps = [e.experiment_id for e in cl.search_experiments()]
    if not exps:
        return []
    host = socket.gethostname()
    now_ms = time.time() * 1000
    reaped = []
    runs = cl.search_runs(exps, filter_string="attributes.status = 'RUNNING'", max_results=5000)
    for run in runs:
        t = run.data.tags
        reason = None
        pid = t.get("splatflow.pid")
        if t.get("splatflow.host") == host and pid and pid.isdigit():
            start = float(t["splatflow.pid_start"]) if t.get("splatflow.pid_start") else None
            if not _pid_alive(int(pid), start):
                reason = f"owner pid {pid} on {host} is gone"
        elif older_than_hours is not None and now_ms - run.info.start_time > older_than_hours * 3600e3:
            reason = f"RUNNING for more than {older_than_hours} h with no live owner known here"
        if reason:
            if not dry_run:
                cl.set_tag(run.info.run_id, "splatflow.reaped", reason)
                cl.set_terminated(run.info.run_id, "KILLED")
            reaped.append({"run_id": run.info.run_id, "scene": t.get("splatflow.scene", ""), "reason": reason})
    return reaped


def compare(run_ids: list[str], uri: str | None = None, *, all_params: bool = False):
    """Side-by-side table of runs: the params that differ (all with ``all_params``) and every final metric.

    Returns a ``pandas.DataFrame`` indexed by ``("param"|"metric"|"tag", key)`` with one column per run (named
    by the run name and short id); missing values are NaN.  With exactly two runs a ``delta`` column holds
    metric differences (second minus first).
    """
    import pandas as pd

    cl = client(uri)
    runs = [cl.get_run(r) for r in run_ids]
    cols = [f"{r.info.run_name or ''} [{r.info.run_id[:8]}]" for r in runs]
    rows: dict[tuple[str, str], list] = {}
    for key in ("git.commit", "git.dirty", "splatflow.scene"):
        rows[("tag", key)] = [r.data.tags.get(key) for r in runs]
    rows[("tag", "status")] = [r.info.status for r in runs]
    pkeys = sorted(set().union(*(r.data.params for r in runs)))
    for k in pkeys:
        vals = [r.data.params.get(k) for r in runs]
        if all_params or len(set(vals)) > 1:
            rows[("param", k)] = vals
    mkeys = sorted(set().union(*(r.data.metrics for r in runs)))
    for k in mkeys:
        rows[("metric", k)] = [r.data.metrics.get(k) for r in runs]
    df = pd.DataFrame.from_dict(rows, orient="index", columns=cols)
    df.index = pd.MultiIndex.from_tuples(df.index, names=["kind", "key"])
    if len(runs) == 2:
        delta = []
        for (kind, _), a, b in zip(df.index, df.iloc[:, 0], df.iloc[:, 1]):
            ok = kind == "metric" and isinstance(a, (int, float)) and isinstance(b, (int, float))
            delta.append(b - a if ok and not (pd.isna(a) or pd.isna(b)) else None)
        df["delta"] = delta
    return df


def latest_runs(n: int = 2, uri: str | None = None, scene: str | None = None, status: str | None = "FINISHED"):
    """The ``n`` most recent runs (optionally of one scene and status), newest first."""
    cl = client(uri)
    exps = [e.experiment_id for e in cl.search_experiments()]
    if not exps:
        return []
    filters = []
    if status:
        filters.append(f"attributes.status = '{status}'")
    if scene:
        filters.append(f"tags.`splatflow.scene` = '{scene}'")
    return cl.search_runs(exps, filter_string=" and ".join(filters), max_results=n,
                          order_by=["attributes.start_time DESC"])
