"""Deployments: the ``splatflow`` process work pool, the pool deployment of ``reconstruct``, and the served,
scheduled deployments (``splatflow serve``).

* ``reconstruct/scene`` -- deployed to the work pool ``splatflow`` (type ``process``) from the project folder
  (``flow.from_source(<repo>, "flows/reconstruct.py:reconstruct")``).  Any worker started with
  ``prefect worker start --pool splatflow`` runs it, here or on another machine that has the project at the same
  path (or its own clone: pass ``--repo``).  Defaults to ``workspace="worktree"`` so concurrent runs never share
  a DVC workspace.
* ``batch/nightly`` -- served by the ``splatflow serve`` process itself, with a cron schedule: fans out every scene
  to ``reconstruct/scene``.  ``batch/on-demand`` and ``reconstruct/inplace`` (reproduce in the checkout itself,
  like ``dvc repro``) are served without a schedule, to start from the UI.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flows.batch import SCENE_DEPLOYMENT, batch  # noqa: E402
from flows.reconstruct import reconstruct  # noqa: E402

POOL = "splatflow"
NIGHTLY_CRON = "0 3 * * *"  # 03:00 every day, in the server's timezone (UTC unless set)


def ensure_pool(name: str = POOL, concurrency_limit: Optional[int] = None) -> str:
    """Create the process work pool if it does not exist yet; returns its name."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists

    with get_client(sync_client=True) as client:
        try:
            client.create_work_pool(WorkPoolCreate(name=name, type="process", concurrency_limit=concurrency_limit))
        except ObjectAlreadyExists:
            pass
    return name


def deploy_scene(repo: str | Path, pool: str = POOL, parameters: Optional[dict[str, Any]] = None) -> str:
    """Register ``reconstruct/scene`` on the work pool, its code pulled from the project folder ``repo``."""
    repo = Path(repo).resolve()
    params = {"repo": str(repo), "workspace": "worktree", **(parameters or {})}
    flow = reconstruct.from_source(source=str(repo), entrypoint="flows/reconstruct.py:reconstruct")
    flow.deploy(name="scene", work_pool_name=pool, build=False, push=False, parameters=params,
                print_next_steps=False, ignore_warnings=True, tags=["splatflow"],
                description="One scene through every DVC stage, in a git worktree (worker pool)")
    return SCENE_DEPLOYMENT


def served_deployments(repo: str | Path, cron: Optional[str] = NIGHTLY_CRON, scenes: Optional[list[str]] = None,
                       max_concurrent: int = 2) -> list:
    """The deployments ``splatflow serve`` runs in its own process (schedules fire while it runs)."""
    repo = str(Path(repo).resolve())
    common = {"repo": repo, "scenes": scenes, "max_concurrent": max_concurrent, "deployment": SCENE_DEPLOYMENT}
    deps = [
        batch.to_deployment(name="on-demand", parameters=common, tags=["splatflow"],
                            description="All scenes (or a sweep) fanned out to the work pool"),
        reconstruct.to_deployment(name="inplace", parameters={"repo": repo, "workspace": "inplace"},
                                  tags=["splatflow"], description="One scene reproduced in the checkout itself"),
    ]
    if cron:
        deps.append(batch.to_deployment(name="nightly", cron=cron, parameters=common, tags=["splatflow"],
                                        description=f"Scheduled batch ({cron})"))
    return deps


def serve_forever(repo: str | Path, cron: Optional[str] = NIGHTLY_CRON, scenes: Optional[list[str]] = None,
                  max_concurrent: int = 2, limit: Optional[int] = None) -> None:
    from prefect import serve

    serve(*served_deployments(repo, cron, scenes, max_concurrent), limit=limit, print_starting_message=True)
