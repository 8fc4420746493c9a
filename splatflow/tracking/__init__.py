"""MLflow tracking for splatflow: one MLflow run per scene per pipeline run, whoever starts the pipeline.

Why this package exists (docs/design.md §2): DVC owns the graph and Prefect runs it, but a run of the pipeline must
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

The package, by concern (every public name is importable from ``splatflow.tracking`` itself):

* :mod:`~splatflow.tracking.store` -- where runs go: the switch, the URI, the client, the experiment, UI links,
  the batched write (:func:`log_batch`).
* :mod:`~splatflow.tracking.metadata` -- run metadata: provenance tags, params/metrics naming, artifact choice.
* :mod:`~splatflow.tracking.runs` -- run discovery and reaping: the scene run of a ``dvc repro``, the runs a flow
  owns (:func:`scene_run`, :func:`batch_run`), a scene's earlier finished run, :func:`reap`.
* :mod:`~splatflow.tracking.compare` -- runs side by side: run ids from what a user types, headline metrics first.
* :mod:`~splatflow.tracking.stage` -- the stage tracker (:func:`stage_tracking`), this process's one SIGTERM
  owner through :mod:`splatflow.pipeline.stop`.
* :mod:`~splatflow.tracking.steps` -- live step metrics (:func:`step_logger`).

The flows and the CLI use only these public names.
"""

from splatflow.tracking.metadata import (ARTIFACT_DIR_NAMES, ARTIFACT_SUFFIXES, MAX_ARTIFACT_BYTES, MAX_DIR_FILES,
                                         artifact_files, backend_tags, device_tags, dvc_exp_tags, dvc_lock_tags,
                                         flatten_params, git_tags, log_files, log_train_plot, numeric_metrics,
                                         process_tags, scene_metrics, stage_files, stage_sections)
from splatflow.tracking.compare import SHORT_ID, compare, curve_note, describe_run, resolve_run_ids, short_id
from splatflow.tracking.runs import (STOPPED_EXCEPTIONS, SceneRun, batch_run, child_runs, create_scene_run,
                                     dvc_ancestor, finalize_scene_run, finished_scene_run, is_dvc_cmd, latest_runs,
                                     pid_alive, reap, scene_run, state_file, status_for)
from splatflow.tracking.stage import StageTracker, log_stage, open_run, preflight, stage_tracking
from splatflow.tracking.steps import STEP_FLUSH_ROWS, STEP_FLUSH_SECONDS, StepLogger, flush_all, step_logger
from splatflow.tracking.store import (DEFAULT_EXPERIMENT, DEFAULT_UI_URL, EXPERIMENT_KIND, EXPERIMENT_KIND_TAG,
                                      HEADLINE_METRICS, TrackingUnreachable, VIEW_KEY, VIEW_TAG, check_reachable,
                                      client, enabled, experiment_id, experiment_ui_url, log_batch, repo_root,
                                      run_ui_url, runs_view_state, store_problem, tracking_uri, ui_base_url)

__all__ = [
    "ARTIFACT_DIR_NAMES", "ARTIFACT_SUFFIXES", "DEFAULT_EXPERIMENT", "DEFAULT_UI_URL", "EXPERIMENT_KIND",
    "EXPERIMENT_KIND_TAG", "HEADLINE_METRICS", "MAX_ARTIFACT_BYTES", "MAX_DIR_FILES", "SHORT_ID", "STEP_FLUSH_ROWS",
    "STEP_FLUSH_SECONDS", "STOPPED_EXCEPTIONS", "SceneRun", "StageTracker", "StepLogger", "TrackingUnreachable",
    "VIEW_KEY", "VIEW_TAG", "artifact_files", "backend_tags", "batch_run", "check_reachable", "child_runs", "client",
    "compare", "create_scene_run", "curve_note", "describe_run", "device_tags", "dvc_ancestor", "dvc_exp_tags",
    "dvc_lock_tags", "enabled", "experiment_id", "experiment_ui_url", "finalize_scene_run", "finished_scene_run",
    "flatten_params", "flush_all", "git_tags", "is_dvc_cmd", "latest_runs", "log_batch", "log_files", "log_stage",
    "log_train_plot", "numeric_metrics", "open_run", "pid_alive", "preflight", "process_tags", "reap", "repo_root",
    "resolve_run_ids", "run_ui_url", "runs_view_state", "scene_metrics", "scene_run", "short_id", "stage_files",
    "stage_sections", "stage_tracking", "state_file", "status_for", "step_logger", "store_problem", "tracking_uri",
    "ui_base_url",
]
