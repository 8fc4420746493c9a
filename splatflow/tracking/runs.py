"""Run discovery and reaping: which MLflow run a stage logs into, the runs flows own (:func:`scene_run`,
:func:`batch_run`), finding a scene's earlier finished run, and marking KILLED the runs whose owner died.
Runs side by side: :mod:`splatflow.tracking.compare`."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import socket
import time
import warnings
from pathlib import Path
from typing import Any, Iterable, Iterator

from splatflow.tracking.metadata import (artifact_files, dvc_exp_tags, dvc_lock_tags, flatten_params, git_tags,
                                         log_files, log_train_plot, process_tags, scene_metrics)
from splatflow.tracking.store import (check_reachable, client, enabled, experiment_id, log_batch, run_ui_url,
                                      tracking_uri)


def state_file(root: Path, scene: str) -> Path:
    """Where the stages of one ``dvc repro`` find the scene run the first of them created (untracked)."""
    return root / ".splatflow" / "runs" / f"{scene}.json"


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive file lock next to ``path``, so two stages never both create the scene run."""
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
            if is_dvc_cmd(cmd):
                return proc.pid, proc.create_time()
            proc = proc.parent()
    except psutil.Error:
        return None
    return None


def is_dvc_cmd(cmd: list[str]) -> bool:
    """Whether a process command line is ``dvc`` (its script, or ``python -m dvc``)."""
    for i, arg in enumerate(cmd[:3]):
        name = os.path.basename(arg)
        if name == "dvc" or arg.endswith("dvc/__main__.py"):
            return True
        if arg == "-m" and i + 1 < len(cmd) and cmd[i + 1] == "dvc":
            return True
    return False


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
                **process_tags(owner_pid), **exp_tags, **(tags or {})}
    if parent_run_id:
        all_tags["mlflow.parentRunId"] = parent_run_id
    name = run_name or (f"{scene}-{exp_tags['dvc.exp.name']}" if exp_tags else
                        f"{scene}-{time.strftime('%Y%m%d-%H%M%S')}")
    run = cl.create_run(exp, run_name=name, tags=all_tags)
    run_id = run.info.run_id
    if params is not None:  # every section: the run stands for the whole pipeline state, run or skipped
        log_batch(cl, run_id, params=flatten_params(params))
    if seed_metrics:
        seeded = scene_metrics(root, scene)
        if seeded:
            # timestamp 0 keeps them below anything this run logs itself: MLflow shows the latest value.
            log_batch(cl, run_id, metrics=seeded, timestamp_ms=1)
    return run_id


def finalize_scene_run(cl, run_id: str, root: Path, scene: str, stages: Iterable[str], status: str) -> None:
    """End a scene run owned by a flow/rerun: the final metrics of every stage (``metrics/<scene>/*.json``, also
    for stages DVC skipped), the artifacts of stages that did not log themselves, dvc.lock and its stage hashes,
    then ``status``.  Each step is best effort: the status is always set."""
    try:
        tags = cl.get_run(run_id).data.tags
        log_batch(cl, run_id, metrics=scene_metrics(root, scene), tags=dvc_lock_tags(root, scene))
        if status == "FINISHED":
            for stage in stages:
                base = stage.partition("@")[0]
                if tags.get(f"splatflow.stage.{base}") != "done":
                    log_files(cl, run_id, root, artifact_files(root, base, scene))
                    if base == "train":
                        log_train_plot(cl, run_id, root, scene)
        if (root / "dvc.lock").exists():
            log_files(cl, run_id, root, [root / "dvc.lock"])
    except Exception as e:  # noqa: BLE001
        warnings.warn(f"splatflow tracking: finalising run {run_id} failed: {e}", stacklevel=2)
    finally:
        with contextlib.suppress(Exception):
            cl.set_terminated(run_id, status)


#: Exceptions (by class name, so this module needs neither Prefect nor the DVC runner) that mean the run was
#: stopped from outside -- Prefect's cancel/termination, a stage killed because its caller was -- not a failure.
STOPPED_EXCEPTIONS = {"TerminationSignal", "CancelledError", "StageCancelled", "StageStopped", "Abort"}


def status_for(exc: BaseException | None) -> str:
    """The MLflow status a run ends with when its body raised ``exc``: KILLED for a stop (Ctrl-C, SIGTERM,
    Prefect's cancel), FAILED for anything else, FINISHED for no exception."""
    if exc is None:
        return "FINISHED"
    if isinstance(exc, (KeyboardInterrupt, SystemExit)) or type(exc).__name__ in STOPPED_EXCEPTIONS:
        return "KILLED"
    return "FAILED"


@dataclasses.dataclass
class SceneRun:
    """The MLflow run a flow owns for one scene (from :func:`scene_run`); ``run_id`` is None when tracking is
    off.  ``status`` may be set by the body (e.g. FAILED for a partial result); otherwise the way the body ends
    decides it."""

    scene: str
    root: Path
    uri: str
    client: Any = None
    run_id: str | None = None
    stages: list[str] = dataclasses.field(default_factory=list)
    status: str | None = None
    finalize: bool = True

    @property
    def active(self) -> bool:
        return self.client is not None and self.run_id is not None

    def log(self, *, params: dict | None = None, metrics: dict | None = None, tags: dict | None = None) -> None:
        """Params, final metrics and tags into the run (nothing when tracking is off); best effort."""
        if self.active:
            try:
                log_batch(self.client, self.run_id, params=params, metrics=metrics, tags=tags)
            except Exception as e:  # noqa: BLE001 - tracking must not stop the pipeline
                warnings.warn(f"splatflow tracking: logging to run {self.run_id} failed: {e}", stacklevel=2)

    def url(self) -> str | None:
        """The run's page in the MLflow UI."""
        if not self.active:
            return None
        return run_ui_url(self.client.get_run(self.run_id).info.experiment_id, self.run_id, self.uri)


@contextlib.contextmanager
def scene_run(scene: str, root: str | Path, *, stages: Iterable[str] = (), params: Any = None,
              uri: str | None = None, parent_run_id: str | None = None, run_name: str | None = None,
              tags: dict | None = None, seed_metrics: bool = True) -> Iterator[SceneRun]:
    """The MLflow run of one scene that a flow (or a rerun) owns while the stages log into it.

    Creates the run (:func:`create_scene_run`: provenance tags, every params section, the current metrics), yields
    a :class:`SceneRun` whose ``run_id`` the stages get as ``MLFLOW_RUN_ID``, and on exit ends it
    (:func:`finalize_scene_run`): FINISHED, KILLED when the body was stopped (:func:`status_for`), FAILED
    otherwise.  With tracking off (``SPLATFLOW_TRACKING=off``) it yields an inactive run and logs nothing.
    """
    root = Path(root)
    uri = uri or tracking_uri(root)
    run = SceneRun(scene, root, uri, stages=list(stages))
    if enabled():
        check_reachable(uri)  # a dead server: stop in seconds, naming it, before any stage starts
        run.client = client(uri)
        run.run_id = create_scene_run(run.client, scene, root, params, uri=uri, parent_run_id=parent_run_id,
                                      run_name=run_name, tags=tags, seed_metrics=seed_metrics)
    def end(status: str) -> None:
        if run.finalize:
            finalize_scene_run(run.client, run.run_id, root, scene, run.stages, status)
        else:
            with contextlib.suppress(Exception):
                run.client.set_terminated(run.run_id, status)

    with _ended_by(run, end):
        yield run


@contextlib.contextmanager
def _ended_by(run: "SceneRun", end: Any) -> Iterator[None]:
    """Run the body; afterwards, if ``run`` is active, ``end(status)``: the status the body set on ``run``, else
    FINISHED, or what :func:`status_for` makes of the exception that left the body (KILLED for a stop)."""
    error: BaseException | None = None
    try:
        yield
    except BaseException as e:
        error = e
        raise
    finally:
        if run.active:
            end(status_for(error) if error is not None or run.status is None else run.status)


@contextlib.contextmanager
def batch_run(root: str | Path, *, name: str, tags: dict | None = None, params: dict | None = None,
              uri: str | None = None, before_end: Any = None) -> Iterator[SceneRun]:
    """The parent MLflow run of a batch: the scene runs of its children name it as ``mlflow.parentRunId``.

    Owned by this process (host/pid tags, so :func:`reap` finds it if the process dies); ``before_end(client,
    run_id)`` runs before the status is set (a summary of the children); the status follows the rules of
    :func:`scene_run`.  Inactive when tracking is off.
    """
    root = Path(root)
    uri = uri or tracking_uri(root)
    run = SceneRun("", root, uri, finalize=False)
    if enabled():
        check_reachable(uri)
        run.client = client(uri)
        exp = experiment_id(run.client, uri=uri)
        created = run.client.create_run(exp, run_name=name, tags={**(tags or {}), **process_tags()})
        run.run_id = created.info.run_id
        run.log(params=params)
    def end(status: str) -> None:
        if before_end is not None:
            try:
                before_end(run.client, run.run_id)
            except Exception as e:  # noqa: BLE001
                warnings.warn(f"splatflow tracking: closing batch run {run.run_id}: {e}", stacklevel=2)
        with contextlib.suppress(Exception):
            run.client.set_terminated(run.run_id, status)

    with _ended_by(run, end):
        yield run


def child_runs(cl, parent_id: str) -> list:
    """The runs that name ``parent_id`` as their parent (a batch's scene runs)."""
    exps = [e.experiment_id for e in cl.search_experiments()]
    return cl.search_runs(exps, filter_string=f"tags.`mlflow.parentRunId` = '{parent_id}'", max_results=1000)


def finished_scene_run(cl, scene: str, commit: str, overrides: str = ""):
    """The latest FINISHED run of ``scene`` at git ``commit`` with the same param overrides (``splatflow.overrides``
    tag, "" for none) that ran its stages itself (not a run that skipped them) and kept ``dvc.lock``; None if
    there is none.  Whether its results still hold for the inputs of now is for DVC to say
    (:func:`splatflow.orchestrate.dvcrun.up_to_date_with`)."""
    exps = [e.experiment_id for e in cl.search_experiments()]
    if not exps:
        return None
    runs = cl.search_runs(exps, filter_string=(f"attributes.status = 'FINISHED' and tags.`splatflow.scene` = "
                                               f"'{scene}' and tags.`git.commit` = '{commit}'"),
                          order_by=["attributes.start_time DESC"], max_results=50)
    for r in runs:
        t = r.data.tags
        if t.get("splatflow.overrides", "") != overrides or t.get("splatflow.skipped") or t.get("splatflow.kind"):
            continue
        if t.get("git.dirty") == "true" and t.get("splatflow.workspace") != "worktree":
            continue  # a checkout with uncommitted edits: the commit alone does not say what ran
        if any(a.path == "dvc.lock" for a in cl.list_artifacts(r.info.run_id)):
            return r
    return None


def pid_alive(pid: int, start: float | None) -> bool:
    """Whether ``pid`` runs and is the same process that started at ``start`` (None: any)."""
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
            if not pid_alive(int(pid), start):
                reason = f"owner pid {pid} on {host} is gone"
        elif older_than_hours is not None and now_ms - run.info.start_time > older_than_hours * 3600e3:
            reason = f"RUNNING for more than {older_than_hours} h with no live owner known here"
        if reason:
            if not dry_run:
                cl.set_tag(run.info.run_id, "splatflow.reaped", reason)
                cl.set_terminated(run.info.run_id, "KILLED")
            reaped.append({"run_id": run.info.run_id, "scene": t.get("splatflow.scene", ""), "reason": reason})
    return reaped


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
