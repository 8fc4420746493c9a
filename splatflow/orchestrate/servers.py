"""Start and stop the Prefect and MLflow servers (``splatflow ui``, the real-server tests).

Both bind to 127.0.0.1 by default and are started with the low-memory settings measured in docs/design.md §3:

* Prefect (default port 4200): ``prefect server start --host 127.0.0.1`` with ``PREFECT_SERVER_ANALYTICS_ENABLED=false``;
  its database lives in ``PREFECT_HOME`` (``<repo>/.splatflow/prefect`` unless set).  Healthy in ~10 s.
* MLflow (default port 5000): ``mlflow server`` on the same ``sqlite:///<repo>/mlflow.db`` the stages write to,
  artifacts served from ``<repo>/mlartifacts``, one worker, ``MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false``
  (2.4 GB -> 0.5 GB) and ``MLFLOW_DISABLE_TELEMETRY=true``.

Every server runs in its own process group so that stopping it stops its worker processes too; processes
it started in groups of their own (a worker's flow runs) get SIGTERM and time to clean up first.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from splatflow.orchestrate.dvcrun import VENV_BIN, _group_members, kill_group

PREFECT_PORT = 4200
MLFLOW_PORT = 5000


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        return s.connect_ex((host, port)) == 0


def low_memory_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = os.environ.copy()
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env.update({
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_UI_ENABLED": "true",
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "DO_NOT_TRACK": "1",
    })
    env.update(extra or {})
    return env


@dataclass
class Server:
    """One started server process (group) with the URL it answers on and the log it writes."""

    name: str
    url: str
    proc: subprocess.Popen
    log: Path
    health: str = ""
    env: dict = field(default_factory=dict, repr=False)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_healthy(self, timeout_s: float = 120.0, on_wait=None, every_s: float = 10.0) -> "Server":
        """Poll the health URL; a process that exits early fails at once with the tail of its log.
        ``on_wait(seconds)`` is called every ``every_s`` while it is not healthy yet (a first start of the Prefect
        server, migrating its database, takes minutes on a busy machine: say that it is still coming)."""
        t0 = time.monotonic()
        told = 0
        while time.monotonic() - t0 < timeout_s:
            waited = time.monotonic() - t0
            if on_wait is not None and waited >= (told + 1) * every_s:
                told = int(waited // every_s)
                on_wait(waited)
            if not self.alive():
                raise RuntimeError(f"{self.name} server exited with {self.proc.returncode}; log {self.log}:\n"
                                   f"{self.tail()}")
            try:
                with urllib.request.urlopen(self.health, timeout=3) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"{self.name} server not healthy at {self.health} after {timeout_s:.0f} s; log {self.log}:"
                           f"\n{self.tail()}")

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def descendant_pids(self) -> set[int]:
        """Pids of every process below this one now (a worker's flow-run processes among them)."""
        import psutil

        try:
            return {k.pid for k in psutil.Process(self.proc.pid).children(recursive=True)}
        except psutil.Error:
            return set()

    def stop(self, grace_s: float = 10.0, children_grace_s: float = 30.0) -> None:
        """SIGTERM the process groups its descendants started for themselves first (a worker's flow runs and
        the DVC stage each one runs), and give them ``children_grace_s`` to clean up -- a Prefect worker that is
        stopped SIGKILLs its flow runs at once, leaving their stage processes running and their runs RUNNING --
        then stop the server's own group (:func:`kill_group`) and SIGKILL whatever is left of the others."""
        groups = _descendant_groups(self.proc.pid) if self.alive() else set()
        _signal_groups(groups, signal.SIGTERM)
        deadline = time.monotonic() + children_grace_s
        while groups and time.monotonic() < deadline and any(_group_members(g) for g in groups):
            time.sleep(0.5)
        kill_group(self.proc, grace_s)
        _signal_groups({g for g in groups if _group_members(g)}, signal.SIGKILL)


def _descendant_groups(pid: int) -> set[int]:
    """Process groups of ``pid``'s descendants other than its own: those a signal to its group never reaches."""
    import psutil

    try:
        own = os.getpgid(pid)
        kids = psutil.Process(pid).children(recursive=True)
    except (OSError, psutil.Error):
        return set()
    groups = set()
    for k in kids:
        try:
            groups.add(os.getpgid(k.pid))
        except OSError:
            continue
    return groups - {own}


def _signal_groups(groups: set[int], sig: int) -> None:
    for g in groups:
        try:
            os.killpg(g, sig)
        except OSError:
            pass


def _spawn(name: str, cmd: list[str], log: Path, env: dict, cwd: Path | None = None) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    fh = open(log, "ab")
    try:
        return subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                cwd=str(cwd) if cwd else None, start_new_session=True)
    finally:
        fh.close()


def start_prefect(port: int = PREFECT_PORT, *, host: str = "127.0.0.1", home: Path | None = None,
                  log_dir: Path | None = None, db_url: str | None = None,
                  extra_env: dict[str, str] | None = None) -> Server:
    """``prefect server start`` on ``host:port``; returns at once (call ``wait_healthy``)."""
    if port_in_use(port, host):
        raise RuntimeError(f"port {port} on {host} is in use: stop what runs there or pass another --prefect-port")
    home = Path(home or Path.cwd() / ".splatflow" / "prefect")
    home.mkdir(parents=True, exist_ok=True)
    extra = {"PREFECT_HOME": str(home), "PREFECT_SERVER_API_HOST": host, "PREFECT_SERVER_API_PORT": str(port),
             "PREFECT_API_URL": f"http://{host}:{port}/api"}
    if db_url:
        extra["PREFECT_API_DATABASE_CONNECTION_URL"] = db_url
    extra.update(extra_env or {})
    env = low_memory_env(extra)
    cmd = [str(VENV_BIN / "prefect"), "server", "start", "--host", host, "--port", str(port)]
    log = (log_dir or home) / "prefect-server.log"
    proc = _spawn("prefect", cmd, log, env)
    return Server("prefect", f"http://{host}:{port}", proc, log, health=f"http://{host}:{port}/api/health", env=env)


def start_mlflow(port: int = MLFLOW_PORT, *, host: str = "127.0.0.1", root: Path | None = None,
                 backend_uri: str | None = None, artifacts_dir: Path | None = None,
                 log_dir: Path | None = None, extra_env: dict[str, str] | None = None) -> Server:
    """``mlflow server`` on ``host:port`` over the project's sqlite store; returns at once (call ``wait_healthy``)."""
    if port_in_use(port, host):
        raise RuntimeError(f"port {port} on {host} is in use: stop what runs there or pass another --mlflow-port")
    root = Path(root or Path.cwd()).resolve()
    backend_uri = backend_uri or f"sqlite:///{root / 'mlflow.db'}"
    artifacts_dir = Path(artifacts_dir or root / "mlartifacts")
    artifacts_dir.mkdir(parents=True, exist_ok=True)
    cmd = [str(VENV_BIN / "mlflow"), "server", "--host", host, "--port", str(port),
           "--artifacts-destination", str(artifacts_dir), "--workers", "1"]
    env = low_memory_env(extra_env)
    env.pop("MLFLOW_TRACKING_URI", None)
    if "@" in backend_uri.partition("://")[2]:  # credentials: in the environment, not in every `ps` listing
        env["MLFLOW_BACKEND_STORE_URI"] = backend_uri
    else:
        cmd += ["--backend-store-uri", backend_uri]
    log = (log_dir or root / ".splatflow") / "mlflow-server.log"
    proc = _spawn("mlflow", cmd, log, env, cwd=root)
    return Server("mlflow", f"http://{host}:{port}", proc, log, health=f"http://{host}:{port}/health", env=env)


def start_worker(pool: str, *, api_url: str, name: str | None = None, limit: int | None = 1,
                 log_dir: Path, cwd: Path | None = None, extra_env: dict[str, str] | None = None) -> Server:
    """``prefect worker start --pool <pool> --type process``: one per machine (or per GPU), ``--limit`` runs each."""
    env = low_memory_env({"PREFECT_API_URL": api_url, **(extra_env or {})})
    name = name or f"{socket.gethostname()}-{os.getpid()}-{time.monotonic_ns() % 100000}"
    cmd = [str(VENV_BIN / "prefect"), "worker", "start", "--pool", pool, "--type", "process", "--name", name]
    if limit:
        cmd += ["--limit", str(limit)]
    log = log_dir / f"worker-{name}.log"
    proc = _spawn("worker", cmd, log, env, cwd=cwd)
    return Server(f"worker {name}", api_url, proc, log, env=env)


def settle_flow_runs(pool: str, pids: set[int]) -> list[str]:
    """After this machine's workers of ``pool`` have stopped: end the flow runs they were running that are not
    in a final state, and return their names.

    A worker kills a run that turns CANCELLING (its parent batch was cancelled) the next time it polls; a
    worker stopped before then leaves the run CANCELLING, and Prefect's server only cancels it itself after
    ``cancelling_timeout_seconds`` (5 minutes), so the UI showed a stopped batch's scene still being cancelled.
    A run is ours when its ``infrastructure_pid`` (the flow-run process a process worker started) is one of
    ``pids``, the workers' processes taken before they were stopped (and now gone): CANCELLING becomes
    CANCELLED, anything else not final CRASHED."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType
    from prefect.client.schemas.filters import WorkPoolFilter, WorkPoolFilterName
    from prefect.client.schemas.objects import StateType
    from prefect.states import Cancelled, Crashed

    import psutil

    live = ("PENDING", "RUNNING", "CANCELLING", "PAUSED")
    settled = []
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(state=FlowRunFilterState(
                type=FlowRunFilterStateType(any_=[StateType(t) for t in live]))),
            work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[pool])))
        for run in runs:
            pid = str(run.infrastructure_pid or "").rpartition(":")[2]
            if not pid.isdigit() or int(pid) not in pids or psutil.pid_exists(int(pid)):
                continue
            why = "its worker was stopped by `splatflow serve`"
            state = (Cancelled(message=f"cancelled: {why}") if run.state.type == StateType.CANCELLING
                     else Crashed(message=f"crashed: {why} while it ran"))
            client.set_flow_run_state(run.id, state, force=True)
            settled.append(f"{run.name} ({state.type.value})")
    return settled

