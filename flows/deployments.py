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

No ``sys.path`` edits: every process that loads a flow by its file path starts in the project folder -- the
worker's runs through the deployment's pull step (``from_source``), the served runs because :func:`serve_forever`
serves from there -- and Prefect puts that folder on ``sys.path``, so ``flows`` and the project's ``splatflow``
import from it.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Iterator, Optional

from flows.batch import HOST_DEPLOYMENT, SCENE_DEPLOYMENT, batch
from flows.reconstruct import reconstruct

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


def deploy_host_scene(pool: str = POOL, parameters: Optional[dict[str, Any]] = None) -> str:
    """Register ``reconstruct/host`` on the work pool: one scene on a worker host with a clone of its own.

    No code location is recorded: its pull step (``splatflow.orchestrate.hosts.enter_host_clone``) moves each flow
    run into the clone of the host that runs it (``SPLATFLOW_HOST_CLONE``, set by ``splatflow worker``), so hosts
    need not share a path, a disk or the deploying machine's layout."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import DeploymentUpdate

    dep = reconstruct.to_deployment(name="host", work_pool_name=pool, parameters={"workspace": "host",
                                                                                   **(parameters or {})},
                                    tags=["splatflow"],
                                    description="One scene on a worker host: pulls its inputs from the DVC remote, "
                                                "runs its stages, pushes its outputs and reports back")
    dep.entrypoint = "flows/reconstruct.py:reconstruct"  # relative to the host's clone
    dep_id = dep.apply()
    with get_client(sync_client=True) as client:
        client.update_deployment(dep_id, DeploymentUpdate(
            pull_steps=[{"splatflow.orchestrate.hosts.enter_host_clone": {}}], path=None))
    return HOST_DEPLOYMENT


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
                  max_concurrent: int = 2, limit: Optional[int] = None, stop_grace_s: float = 15.0) -> None:
    """``prefect.serve`` of :func:`served_deployments` until SIGTERM or Ctrl-C, with a clean stop.

    Prefect 3.8's runner, on SIGTERM, never awaits its own stop (``Runner.stop()`` called inside the event loop
    returns an un-awaited coroutine) and exits at once, SIGKILLing the flow runs it is executing: a batch in
    flight never marked its MLflow run KILLED nor its flow run Crashed/Cancelled.  Here SIGTERM and the first
    Ctrl-C stop polling for new runs, give the runs in flight up to ``stop_grace_s`` to exit on their own (a
    signal to the whole process group -- Ctrl-C, systemd, ``kill -- -PGID`` -- reached them too), and then
    await the runner's stop, which cancels whatever still runs (SIGTERM, then SIGKILL after 30 s).  A second
    Ctrl-C stops at once.
    """
    import asyncio

    from prefect.runner import Runner

    class _Runner(Runner):
        stop_requested = False
        stop_task: Optional[asyncio.Task] = None

        def handle_sigterm(self, *args: Any, **kwargs: Any) -> None:
            if not self.stop_soon("SIGTERM") and not self.stop_requested:
                raise SystemExit(0)  # no loop running (yet, or any more): exit, the caller's `finally` cleans up

        def stop_soon(self, why: str) -> bool:
            """Begin the stop from a signal handler; False when there is no running loop or a stop is under way."""
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return False
            if self.stop_requested or not self.started:
                return False
            self.stop_requested = True
            self._logger.info("%s received: no new runs; runs in flight get %.0f s to stop, then the runner stops",
                              why, stop_grace_s)
            self.stopping = True
            if getattr(self, "_scheduled_run_poller", None) is not None:
                self._scheduled_run_poller.stopping = True
            loop.call_soon_threadsafe(self._start_stop_task, loop)  # wakes the loop out of its select()
            return True

        def _start_stop_task(self, loop: asyncio.AbstractEventLoop) -> None:
            self.stop_task = loop.create_task(self._stop())

        async def _stop(self) -> None:
            await asyncio.to_thread(_wait_for_flow_runs, stop_grace_s)
            await self.astop()

    with _working_directory(repo):  # the served runs start here: their entrypoints are relative to it
        _serve(_Runner(limit=limit), served_deployments(repo, cron, scenes, max_concurrent))


@contextlib.contextmanager
def _working_directory(path: str | Path) -> Iterator[None]:
    previous = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(previous)


def _serve(runner: Any, deployments: list) -> None:
    """Run ``runner`` with ``deployments`` until it stops: SIGINT asks for the clean stop, as SIGTERM does."""
    import asyncio
    import signal

    from prefect.exceptions import TerminationSignal

    for dep in deployments:
        runner.add_deployment(dep)
    print("serving " + ", ".join(f"{d.flow_name}/{d.name}" for d in deployments) + "; Ctrl-C stops", flush=True)

    def on_sigint(signum, frame):  # noqa: ARG001
        if not runner.stop_soon("SIGINT"):
            raise KeyboardInterrupt

    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, on_sigint)
    try:
        asyncio.run(runner.start())  # installs runner.handle_sigterm
    except (KeyboardInterrupt, TerminationSignal):
        pass
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _wait_for_flow_runs(timeout_s: float) -> None:
    """Wait up to ``timeout_s`` until the flow-run processes this process started have exited: its children in
    its own process group (the workers ``splatflow serve`` starts have sessions of their own)."""
    import os
    import time

    import psutil

    try:
        kids = [c for c in psutil.Process().children() if os.getpgid(c.pid) == os.getpgrp()]
    except (OSError, psutil.Error):
        return
    deadline = time.monotonic() + timeout_s
    while kids and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = []
        for k in kids:
            try:
                if k.status() != psutil.STATUS_ZOMBIE:  # a zombie has exited; the runner reaps it
                    alive.append(k)
            except psutil.NoSuchProcess:
                pass
        kids = alive
