"""``splatflow run`` through the ``reconstruct`` Prefect flow: every pipeline run is a flow run in the dashboard.

The scenes run one after another in this process, in place (the caller holds the workspace lock, which the flow
takes again re-entrantly), each as one ``reconstruct`` flow run with one task per DVC stage, against the Prefect
server of ``PREFECT_API_URL`` (``splatflow ui``'s, found by :func:`splatflow.cli.ops._use_local_prefect_server`)
or else Prefect's ephemeral API, whose runs land in the local Prefect database that ``splatflow ui`` serves later.

The terminal keeps what ``splatflow run`` always showed: DVC's and the stages' own output as it comes (the flow's
``echo``), not Prefect's log lines, which go to the Prefect API only (the dashboard's logs of each task).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from splatflow.orchestrate.dvcrun import StageFailed, dvc_executable, stage_env, stage_order
from splatflow.orchestrate.workspace import run_foreground

#: Prefect's own loggers for flow and task runs: their records reach the API handler; on the console they would
#: repeat every line of the stages' output that the echo already showed.
_RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")


@dataclass
class SceneOutcome:
    scene: str
    returncode: int  # 0, the failed DVC's status (as `dvc repro` exits), 130 (Ctrl-C) or 143 (SIGTERM)
    flow_run_id: str | None = None
    flow_run_name: str | None = None
    state: str = ""
    ran: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


class _QuietRuns(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.name.startswith(_RUN_LOGGERS)


@contextlib.contextmanager
def quiet_run_logs() -> Iterator[None]:
    """Keep Prefect's flow- and task-run records off the console handlers (the API still gets them)."""
    import prefect  # noqa: F401 - configures Prefect's logging, whose handlers are filtered here

    quiet = _QuietRuns()
    handlers = [h for h in logging.getLogger().handlers if isinstance(h, logging.StreamHandler)
                and not type(h).__name__.startswith("APILog")]
    for h in handlers:
        h.addFilter(quiet)
    try:
        yield
    finally:
        for h in handlers:
            h.removeFilter(quiet)


def ui_url(flow_run_id: str) -> str | None:
    """The flow run's page in the Prefect UI when a server is configured (None with the ephemeral API)."""
    api = os.environ.get("PREFECT_API_URL", "").rstrip("/")
    if not api:
        return None
    base = api[: -len("/api")] if api.endswith("/api") else api
    return f"{base}/runs/flow-run/{flow_run_id}"


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """SIGTERM raises Prefect's ``TerminationSignal`` in this process, in the flow and between its runs alike.

    Inside a flow run Prefect's own handler raises it, so the running stage's task stops its stage (the whole
    process group below DVC: the stage records its MLflow run KILLED), the scene's run ends KILLED and the flow
    run Crashed. Prefect then hands the signal on to the handler it found when the run began, by sending it to
    this process again: with Python's default there, ``splatflow run`` died on the spot with no exit status of
    its own and no exit handlers, leaving Prefect's ephemeral API server running without a parent. With this
    handler in place the stop reaches :func:`run_scenes` as an exception, ``splatflow run`` exits 143 and the
    ephemeral server is stopped on the way out."""
    from prefect.exceptions import TerminationSignal

    def stop(signum, frame) -> None:  # noqa: ARG001 - the signal module's signature
        raise TerminationSignal(signal=signum)

    old = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def run_scenes(root: Path, scenes: list[str], *, force: bool,
               say: Callable[[str], None] = print) -> list[SceneOutcome]:
    """Each scene through the in-place ``reconstruct`` flow; stops at the first scene that does not finish (like
    ``dvc repro``). A bad input of a scene (a missing capture) raises its UserError before anything runs."""
    with sigterm_raises():
        return _run_scenes(root, scenes, force=force, say=say)


def _run_scenes(root: Path, scenes: list[str], *, force: bool, say: Callable[[str], None]) -> list[SceneOutcome]:
    from prefect.exceptions import TerminationSignal

    if str(root) not in sys.path:  # the flows come from the project that runs, not from the cwd
        sys.path.insert(0, str(root))
    from flows.reconstruct import reconstruct

    outcomes = []
    for scene in scenes:
        out = SceneOutcome(scene, 0)
        outcomes.append(out)
        try:
            with quiet_run_logs():
                state = reconstruct(scene=scene, repo=str(root), workspace="inplace", force=force, echo=True,
                                    return_state=True)
        except KeyboardInterrupt:
            out.returncode, out.state = 130, "Crashed"
            break
        except TerminationSignal:
            out.returncode, out.state = 143, "Crashed"
            break
        except Exception as e:  # noqa: BLE001 - with return_state, only Prefect's own machinery raises here
            # No Prefect API (an ephemeral server that did not start in time on a loaded machine, a server that
            # went away): the stages still run, with DVC alone, as before there was a flow; DVC skips what ran.
            say(f"{scene}: Prefect's API is not available ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                "running the stages with DVC alone: this run does not show in Prefect")
            out.returncode, out.state = _with_dvc_alone(root, scene, force), "DVC alone"
            if out.returncode:
                break
            continue
        out.state = state.name or state.type.value
        out.flow_run_id = str(state.state_details.flow_run_id) if state.state_details.flow_run_id else None
        out.flow_run_name = _flow_run_name(out.flow_run_id)
        if state.is_completed():
            for stage in state.result().get("stages") or []:  # the stage tasks' results, in order
                (out.skipped if stage["skipped"] else out.ran).append(stage["stage"])
            where = ui_url(out.flow_run_id) if out.flow_run_id else None
            say(f"{scene}: Prefect flow run {out.flow_run_name or out.flow_run_id} ({state.name}): "
                f"{len(out.ran)} stage{'s' * (len(out.ran) != 1)} ran, {len(out.skipped)} up to date"
                + (f"; {where}" if where else ""))
            continue
        error = state.result(raise_on_failure=False)
        if isinstance(error, StageFailed):
            out.returncode = error.returncode or 1
        elif isinstance(error, BaseException) and getattr(error, "exit_code", None):  # a UserError of the flow
            raise error
        else:
            out.returncode = 1
            say(f"{scene}: the reconstruct flow run ended {out.state}: {error}")
        break
    return outcomes


def _flow_run_name(flow_run_id: str | None) -> str | None:
    if not flow_run_id:
        return None
    from prefect.client.orchestration import get_client

    with contextlib.suppress(Exception), get_client(sync_client=True) as client:
        return client.read_flow_run(flow_run_id).name
    return None



def _with_dvc_alone(root: Path, scene: str, force: bool) -> int:
    """``dvc repro`` of the scene's stages in the foreground (a stop passed on to the stage); its exit status."""
    cmd = [dvc_executable(), "repro", *stage_order(root, scene)] + (["--force"] if force else [])
    print("$ " + " ".join(["dvc", *cmd[1:]]), flush=True)
    return run_foreground(cmd, root, stage_env())
