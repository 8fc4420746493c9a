"""The stage tracker: what a DVC stage process holds while it runs, and the one owner of its SIGTERM.

:func:`stage_tracking` wraps a stage's work (``stage_main`` calls it): it installs :mod:`splatflow.pipeline.stop`'s
SIGTERM handler before anything slow, attaches to (or creates) the scene run, and on exit records how the stage ended --
FINISHED, FAILED with the error, or KILLED when it was stopped (SIGTERM, Ctrl-C), whatever exception the stop
surfaced as.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

from splatflow.pipeline import records, stop
from splatflow.tracking import steps
from splatflow.tracking.metadata import (artifact_files, backend_tags, device_tags, dvc_lock_tags, flatten_params,
                                         log_files, log_train_plot, numeric_metrics, process_tags, stage_sections)
from splatflow.tracking.runs import create_scene_run, dvc_ancestor, locked, state_file
from splatflow.tracking.store import (check_reachable, client, enabled, log_batch, repo_root, run_ui_url,
                                      store_problem, tracking_uri)

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
        """Log a stage's final metrics as ``<stage>.<name>`` (called by stage_main after ``run``): the numbers of
        ``metrics/<scene>/<stage>.json``; the device record's strings become tags, and the info file (a stage out)
        an artifact."""
        self.result = dict(metrics or {})
        if self.active:
            new = numeric_metrics(records.split(self.result)[0], self.stage)
            stale = self._safe(self._stale_keys, new) or []
            self._safe(log_batch, self.client, self.run_id, metrics={**new, **dict.fromkeys(stale, float("nan"))},
                       tags=device_tags(self.stage, self.result))

    def _stale_keys(self, new: dict[str, float]) -> list[str]:
        """``<stage>.*`` metrics the run holds that this result lacks: values seeded from an earlier run's
        ``metrics/<scene>/<stage>.json`` (a format no longer exported, an LPIPS variant now null) that would
        otherwise stand in this run as if this stage had produced them. They are logged as NaN (MLflow shows the
        latest value)."""
        held = self.client.get_run(self.run_id).data.metrics
        return sorted(k for k in held if k.startswith(f"{self.stage}.") and k not in new)

    def log_artifacts(self, files: Iterable[Path]) -> None:
        if self.active:
            self._safe(log_files, self.client, self.run_id, self.root, list(files))

    def _safe(self, fn, *args, **kwargs):
        """Tracking must never fail a stage: a store that is down costs the log, not the result."""
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001
            print(f"splatflow: tracking: {getattr(fn, '__name__', fn)} failed: {_first_line(e)}", file=sys.stderr,
                  flush=True)
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
            log_train_plot(self.client, self.run_id, self.root, self.scene)
        lock = self.root / "dvc.lock"
        if lock.exists():
            self.log_artifacts([lock])
        self._safe(log_batch, self.client, self.run_id, tags={**dvc_lock_tags(self.root, self.scene),
                                                               f"splatflow.stage.{self.stage}": "done"})
        self.terminate("FINISHED")


def open_run(stage: str, scene: str, root: Path, params: Any) -> StageTracker:
    """Resolve the scene run (the rules in :mod:`splatflow.tracking`'s docstring) and start logging this stage
    into it."""
    uri = tracking_uri(root)
    cl = client(uri)
    run_id = os.environ.get("MLFLOW_RUN_ID", "").strip() or None
    owns = False
    state = state_file(root, scene)
    if run_id is None:
        anc = dvc_ancestor()
        with locked(state):
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
                with contextlib.suppress(Exception):  # the link is a convenience; logging goes on without it
                    url = run_ui_url(cl.get_run(run_id).info.experiment_id, run_id, uri)
                    print(f"{scene}: MLflow run {run_id[:8]}, {url} (served by `splatflow ui`)", flush=True)
                if anc is not None:
                    state.write_text(json.dumps({"run_id": run_id, "dvc_pid": anc[0], "dvc_start": anc[1],
                                                 "tracking_uri": uri, "created": time.time()}) + "\n")
        owns = True
        cl.update_run(run_id, status="RUNNING")
    tracker = StageTracker(stage, scene, root, params, cl, run_id, owns_status=owns)
    sections = stage_sections(root, stage)
    if sections is not None:  # foreach stages declare per-scene keys (base.scenes.${key})
        sections = [s.replace("${key}", scene) for s in sections]
    tags = {**backend_tags(params), f"splatflow.stage.{stage}": "running"}
    if owns:
        tags.update(process_tags())
    tracker._safe(log_batch, cl, run_id, params=flatten_params(params, sections), tags=tags)
    return tracker


def preflight(root: Path) -> bool:
    """Whether this stage can record: False with tracking off, or (said once per pipeline run) with a damaged
    local database; raises :class:`~splatflow.tracking.store.TrackingUnreachable` (exit 2) for a tracking server
    that does not answer, within :data:`~splatflow.tracking.store.REACH_TIMEOUT_S`."""
    if not enabled():
        return False
    uri = tracking_uri(root)
    check_reachable(uri)
    problem = store_problem(uri)
    if problem:
        _say_once_per_run(root, problem)
        return False
    return True


@contextlib.contextmanager
def stage_tracking(stage: str, scene: str, params: Any = None, paths: Any = None,
                   record: bool = True) -> Iterator[StageTracker]:
    """Wrap one stage's work: attach to (or create) the scene run, log params, then on exit metrics,
    artifacts, provenance tags and the status (FINISHED / FAILED / KILLED on SIGTERM or Ctrl-C).

    Use::

        with stage_tracking("train", scene, params, paths) as tracker:
            metrics = run(params, paths)
            tracker.log_result(metrics)

    A tracking server that does not answer stops the stage before its work (exit 2, naming the URL and the fix);
    any other failure of the store is one line on stderr, never a stage failure. ``record=False`` (the settings
    stage, which runs in every repro) makes the same checks and opens no run.
    """
    root = Path(getattr(paths, "root", None) or repo_root()).resolve()
    # This process's one SIGTERM owner (splatflow.pipeline.stop), installed before anything that may take a while, so a
    # SIGTERM while the run is being opened is recorded too; opening is not interrupted half-way.
    prev_handler = stop.install()
    try:
        # a dead server stops the stage in seconds (UserError, exit 2) before its work; not a cooperative block,
        # so a SIGTERM during the wait stops the stage at once
        on = preflight(root) and record
    except BaseException:
        stop.restore(prev_handler)
        raise
    try:
        with stop.cooperative():
            tracker = open_run(stage, scene, root, params) if on else StageTracker(stage, scene, root, params)
    except Exception as e:  # noqa: BLE001 - tracking must not stop the pipeline
        _say_once_per_run(root, f"tracking is off for this stage: {tracking_uri(root)}: {_first_line(e)}")
        tracker = StageTracker(stage, scene, root, params)
    steps.set_active(tracker)
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
                    tracker._safe(log_batch, tracker.client, tracker.run_id,
                                  tags={f"splatflow.stage.{stage}": "stopped"})
                    tracker.terminate("KILLED")
                elif isinstance(e, SystemExit) and e.code in (0, None):
                    tracker.finish_success()
                else:
                    tracker._safe(log_batch, tracker.client, tracker.run_id,
                                  tags={f"splatflow.stage.{stage}": "failed",
                                        "splatflow.error": f"{stage}: {type(e).__name__}: {e}"[:4000]})
                    tracker.terminate("FAILED")
        raise
    else:
        with stop.cooperative():  # the work is done: finish recording it even if SIGTERM comes now
            tracker.finish_success()
    finally:
        steps.set_active(None)
        with stop.cooperative():
            steps.flush_all()
        stop.restore(prev_handler)


def _first_line(e: BaseException, limit: int = 300) -> str:
    """An error in one line: its type and first line (MLflow's store errors carry whole SQL statements)."""
    text = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {text[:limit]}" + ("..." if len(text) > limit else "")


def _say_once_per_run(root: Path, message: str) -> None:
    """Print ``message`` on stderr once per pipeline run: the first stage of a ``dvc repro`` says it, its later
    stages (same dvc process) stay quiet; a stage run by hand always says it."""
    anc = dvc_ancestor()
    marker = root / ".splatflow" / "tracking-notice.json"
    if anc is not None:
        with contextlib.suppress(OSError, ValueError):
            seen = json.loads(marker.read_text())
            if seen.get("dvc_pid") == anc[0] and abs(seen.get("dvc_start", 0) - anc[1]) < 1e-2 \
                    and seen.get("message") == message:
                return
        with contextlib.suppress(OSError):
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text(json.dumps({"dvc_pid": anc[0], "dvc_start": anc[1], "message": message}) + "\n")
    print(f"splatflow: {message}", file=sys.stderr, flush=True)


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
    log_batch(cl, run_id, params=flatten_params(params, stage_sections(root, stage)) if params else None,
               metrics=numeric_metrics(metrics or {}, stage))
    log_files(cl, run_id, root, artifacts if artifacts is not None else artifact_files(root, stage, scene))

