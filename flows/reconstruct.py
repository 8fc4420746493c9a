"""Prefect flow ``reconstruct``: one scene through the whole DVC pipeline, one Prefect task per DVC stage.

Only wiring (docs/design.md §2): DVC owns the graph and decides what is stale; this flow asks DVC for the stage order,
runs each stage with ``dvc repro --single-item <stage>@<scene>`` in its own process group
(:mod:`splatflow.orchestrate.dvcrun`), and owns the scene's MLflow run, which the stages attach to through
``MLFLOW_RUN_ID``.  Tasks are not cached: DVC already skips unchanged stages in about a second, and a Prefect cache
would skip a stage whose outputs were deleted.

Retries: only :class:`~splatflow.orchestrate.dvcrun.WorkspaceBusy` (another dvc holds the workspace lock) is
retried; a stage that fails on its inputs or code fails the same way again, so it is not.

Run it: ``python flows/reconstruct.py demo`` or ``splatflow flow demo``; as a deployment see docs/orchestration.md.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Literal, Optional

from prefect import flow, get_run_logger, task
from prefect.context import get_run_context
from prefect.states import Completed, State

from splatflow import tracking
from splatflow.orchestrate import dvcrun, hosts
from splatflow.orchestrate.workspace import workspace_lock, worktree


#: The name of a stage task's state when DVC found the stage up to date (a Completed state: the flow goes on).
SKIPPED = "Skipped"


def _retry_only_when_busy(task_obj, task_run, state) -> bool:  # noqa: ARG001 - Prefect's hook signature
    try:
        state.result()
    except dvcrun.WorkspaceBusy:
        return True
    except BaseException:  # noqa: BLE001
        return False
    return False


@task(retries=3, retry_delay_seconds=[5, 15, 30], retry_condition_fn=_retry_only_when_busy, cache_policy=None,
      persist_result=False)
def run_stage(root: str, stage: str, run_id: Optional[str], tracking_uri: str, force: bool = False,
              timeout_s: Optional[float] = None, echo: bool = False):
    """One DVC stage (``train@demo``) as a Prefect task; its output streams into the task's log (and, with
    ``echo``, to this process's stdout as it comes). A stage DVC found up to date ends in a Completed state named
    ``Skipped``, so the dashboard tells it from a stage that ran."""
    logger = get_run_logger()
    env = dvcrun.stage_env({"MLFLOW_RUN_ID": run_id, "MLFLOW_TRACKING_URI": tracking_uri})
    if run_id is None:
        env["SPLATFLOW_TRACKING"] = "off"
    res = dvcrun.run_dvc_stage(root, stage, force=force, timeout_s=timeout_s, env=env, on_line=logger.info,
                               echo=sys.stdout if echo else None)
    logger.info("%s %s in %.1f s", stage, "up to date (skipped)" if res.skipped else "ran", res.seconds)
    out = {"stage": stage, "seconds": round(res.seconds, 3), "skipped": res.skipped}
    if res.skipped:
        return Completed(name=SKIPPED, message=f"{stage}: DVC found it up to date and did not run it", data=out)
    return out


def _params_for_logging(path: Path, scene: str):
    """The scene's effective strict Params (what its stages log too, so values agree); the raw YAML if it does
    not load -- the failing stage will then say why."""
    import yaml

    from splatflow.pipeline.config import ConfigError, load_params

    try:
        return load_params(path).for_scene(scene)
    except ConfigError:
        return yaml.safe_load(path.read_text()) or {}


def _flow_run_tags() -> dict[str, str]:
    with contextlib.suppress(Exception):
        ctx = get_run_context()
        fr = ctx.flow_run
        return {"prefect.flow_run_id": str(fr.id), "prefect.flow_run_name": fr.name or "",
                "prefect.deployment_id": str(fr.deployment_id or "")}
    return {}


def reproduce(root: Path, scene: str, *, main_root: Path, force: bool, stage_timeout_s: Optional[float],
              parent_run_id: Optional[str], run_name: Optional[str], tags: dict[str, str],
              skip_finished: bool = False, on_host: bool = False, echo: bool = False) -> dict[str, Any]:
    """The body shared by the flow's workspace modes: MLflow run, stages as tasks, final logging.  ``on_host``:
    pull the scene's inputs from the DVC remote first and publish its results after (:mod:`~splatflow.orchestrate
    .hosts`)."""
    logger = get_run_logger()
    stages = dvcrun.stage_order(root, scene)
    if not stages:
        raise ValueError(f"dvc.yaml in {root} has no stages for scene {scene!r}: add it to base.scenes in params.yaml")
    if on_host:
        logger.info("scene %s on host %s: pulling its inputs from the DVC remote", scene, hosts.host_name())
        hosts.pull_inputs(root, stages, on_line=logger.info)
    dvcrun.check_sources(root, [scene])  # a missing capture: a clear error before DVC removes the scene's outputs
    logger.info("scene %s: %d stages from DVC's graph: %s", scene, len(stages), " -> ".join(stages))

    uri = tracking.tracking_uri(main_root)
    params = _params_for_logging(root / "params.yaml", scene)
    common = dict(uri=uri, params=params, parent_run_id=parent_run_id, run_name=run_name)
    prior = finished_run_still_valid(root, scene, stages, uri, tags) if skip_finished and not force else None
    if prior is not None:
        metrics = {k: v for k, v in prior.data.metrics.items() if "/" not in k}  # final metrics, not curves
        with tracking.scene_run(scene, root, seed_metrics=False, **common,
                                tags={"splatflow.started_by": "prefect", **tags, "splatflow.skipped": "up to date",
                                      "splatflow.same_as": prior.info.run_id}) as run:
            run.log(metrics=metrics)
        logger.info("scene %s skipped: up to date (every stage as in finished MLflow run %s)", scene,
                    prior.info.run_id)
        return {"scene": scene, "run_id": run.run_id, "stages": [], "metrics": metrics, "workspace": str(root),
                "artifact_id": None, "skipped": "up to date", "same_as": prior.info.run_id}

    results = []
    with tracking.scene_run(scene, root, stages=stages, tags={"splatflow.started_by": "prefect", **tags},
                            **common) as run:
        if run.active:
            logger.info("MLflow run %s at %s", run.run_id, uri)
        for stage in stages:
            name = stage.partition("@")[0]
            res = run_stage.with_options(name=name, task_run_name=stage)(
                str(root), stage, run.run_id, uri, force, stage_timeout_s, echo)
            # a skipped stage's task returns its Skipped state, which the call hands back as it is: its record
            results.append(res.result() if isinstance(res, State) else res)
        if on_host:  # only after every stage succeeded: a host that dies earlier has published nothing
            hosts.publish_results(root, stages, run.run_id, run.client, on_line=logger.info)
            logger.info("scene %s: outputs pushed to the DVC remote, lock entries and metrics logged to MLflow", scene)
    metrics = run.client.get_run(run.run_id).data.metrics if run.active else {}
    artifact = publish_summary(root, scene, main_root=main_root, run=run)
    return {"scene": scene, "run_id": run.run_id, "stages": results, "metrics": metrics, "workspace": str(root),
            "artifact_id": artifact, "skipped": None, "same_as": None}


def finished_run_still_valid(root: Path, scene: str, stages: list[str], uri: str, tags: dict[str, str]):
    """The scene's earlier FINISHED MLflow run at this worktree's commit with the same overrides, when DVC finds
    every stage up to date with the ``dvc.lock`` that run ended with; else None (and the committed dvc.lock
    stays).  This is what lets a rerun of a batch skip the scenes that finished: a fresh worktree has none of
    their outputs, and DVC's run cache cannot restore the training stage (its checkpoint is a persistent output),
    so without this every scene would train again."""
    import shutil
    import tempfile

    logger = get_run_logger()
    if not tracking.enabled():
        return None
    cl = tracking.client(uri)
    commit = tracking.git_tags(root).get("git.commit", "none")
    prior = tracking.finished_scene_run(cl, scene, commit, tags.get("splatflow.overrides", ""))
    if prior is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(cl.download_artifacts(prior.info.run_id, "dvc.lock", tmp), root / "dvc.lock")
    try:
        ok, why = dvcrun.only_outputs_missing(root, stages)
    except dvcrun.StageFailed as e:
        ok, why = False, str(e)
    if not ok:
        logger.info("scene %s: earlier run %s does not hold any more (%s): running the stages", scene,
                    prior.info.run_id, why)
        subprocess.run(["git", "checkout", "--", "dvc.lock"], cwd=root, capture_output=True, check=False)
        return None
    return prior


def publish_summary(root: Path, scene: str, *, main_root: Path, run: tracking.SceneRun) -> Optional[str]:
    """A Prefect markdown artifact in this flow run: headline metrics, the MLflow run's link, the report."""
    from prefect.artifacts import create_markdown_artifact

    from splatflow.pipeline.paths import ScenePaths
    from splatflow.present.report import summary_markdown

    paths = ScenePaths(scene, root)
    run_url = run.url()
    # A worktree run's files vanish with its worktree: then the MLflow artifact is where the report lives.
    location = str(paths.report_html) if paths.report_html.exists() and root == main_root else None
    key = "splatflow-" + "".join(ch if ch.isalnum() else "-" for ch in scene.lower())
    return str(create_markdown_artifact(summary_markdown(paths, run_url=run_url, report_location=location),
                                        key=key, description=f"splatflow results of scene {scene}"))


@flow(name="reconstruct", log_prints=True)
def reconstruct(scene: str = "demo", repo: Optional[str] = None,
                workspace: Literal["inplace", "worktree", "host"] = "inplace", commit: str = "HEAD",
                overrides: Optional[dict[str, Any]] = None, force: bool = False,
                stage_timeout_s: Optional[float] = None, parent_run_id: Optional[str] = None,
                run_name: Optional[str] = None, tags: Optional[dict[str, str]] = None,
                skip_finished: bool = False, echo: bool = False) -> dict[str, Any]:
    """Reconstruct one scene: every DVC stage of ``scene`` as a task, logged to one MLflow run.

    ``workspace="inplace"`` reproduces in the checkout ``repo`` (updating its dvc.lock and outputs, like
    ``dvc repro``), holding a workspace lock so two flows never reproduce there at once.  ``"worktree"`` runs in
    a throw-away git worktree of ``commit`` with ``overrides`` applied to its params.yaml and the DVC cache shared
    (what batches, sweeps and reruns use); results live in MLflow and the DVC cache.  ``skip_finished`` (worktree
    only; batches set it): when an earlier FINISHED run of the scene at the same commit with the same overrides
    still holds -- DVC finds every stage up to date with the dvc.lock it ended with -- nothing runs, and a new
    MLflow run tagged ``splatflow.skipped=up to date`` points at it (``splatflow.same_as``) with its metrics.
    ``"host"`` (the ``reconstruct/host`` deployment): a worktree of ``commit`` in this worker host's own clone,
    inputs pulled from the DVC remote, results pushed and reported back (:mod:`splatflow.orchestrate.hosts`);
    ``repo`` names the user's checkout there and is not used here.
    ``echo``: each stage's output also goes to stdout as it comes (``splatflow run`` shows DVC's own output).
    """
    main_root = tracking.repo_root(repo or os.environ.get("SPLATFLOW_REPO") or Path.cwd())
    tags = {**_flow_run_tags(), **(tags or {}), "splatflow.workspace": workspace}
    if overrides:
        tags["splatflow.overrides"] = ",".join(f"{k}={v}" for k, v in sorted(overrides.items()))
    common = dict(main_root=main_root, force=force, stage_timeout_s=stage_timeout_s, parent_run_id=parent_run_id,
                  run_name=run_name, tags=tags, echo=echo)
    if workspace == "host":
        clone = tracking.repo_root(Path.cwd())  # the deployment's pull step moved this process into the clone
        tags["splatflow.host"] = hosts.announce_host(get_run_context().flow_run.id)
        common["main_root"] = clone
        with worktree(clone, hosts.fetch_commit(clone, commit), overrides=overrides) as wt:
            hosts.use_remote(wt, hosts.remote_url())
            return reproduce(wt, scene, on_host=True, **common)
    if workspace == "worktree":
        with worktree(main_root, commit, overrides=overrides) as wt:
            return reproduce(wt, scene, skip_finished=skip_finished, **common)
    if overrides:
        raise ValueError("param overrides need workspace='worktree' (they are never written to your params.yaml)")
    with workspace_lock(main_root):
        return reproduce(main_root, scene, **common)


if __name__ == "__main__":
    reconstruct(scene=sys.argv[1] if len(sys.argv) > 1 else "demo")
