"""The services a team shares, started on one host (``splatflow serve --shared``), and workers that join them.

The server host runs a PostgreSQL cluster of its own (:mod:`splatflow.orchestrate.postgres`), the Prefect server on
its ``prefect`` database, the MLflow tracking server on its ``mlflow`` database with proxied artifact storage (runs
upload and download artifacts through the server, so hosts need no shared disk for them), and names the DVC
remote every host pushes to and pulls from (a folder on that host by default; any URL DVC supports, such as
``ssh://server/srv/dvc``, with ``--dvc-remote``).

The MLflow address and the DVC remote are published as Prefect variables (``splatflow_mlflow_uri``,
``splatflow_dvc_remote``), so a worker joins with one command naming only the Prefect server
(``splatflow worker --server http://server:4200``); the same addresses are written to the user's config file
(:func:`splatflow.orchestrate.hosts.config_path`) for the shell that starts batches.  Environment variables
override both.  The database password never leaves the server host.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from splatflow.orchestrate import postgres, servers
from splatflow.pipeline.errors import UserError

VARIABLES = {"MLFLOW_TRACKING_URI": "splatflow_mlflow_uri", "SPLATFLOW_DVC_REMOTE": "splatflow_dvc_remote"}


def default_state_dir() -> Path:
    return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "splatflow" / "shared"


@dataclass
class SharedStack:
    """What ``serve --shared`` started; ``settings`` are the addresses clients use."""

    state: Path
    cluster: postgres.Cluster
    prefect: servers.Server
    mlflow: servers.Server
    settings: dict[str, str] = field(default_factory=dict)

    def stop(self) -> None:
        for s in (self.prefect, self.mlflow):
            s.stop()
        self.cluster.stop()


def start_shared(state: Path, *, host: str = "127.0.0.1", advertise: Optional[str] = None,
                 prefect_port: int = servers.PREFECT_PORT, mlflow_port: int = servers.MLFLOW_PORT,
                 pg_port: int = 5432, dvc_remote: Optional[str] = None, timeout_s: float = 300.0,
                 prefect_env: Optional[dict[str, str]] = None) -> SharedStack:
    """Start PostgreSQL, Prefect and MLflow under ``state`` (bound to ``host``; clients are told ``advertise``, by
    default ``host``), wait until all answer, publish the shared settings; stops what it started on failure."""
    state = Path(state).resolve()
    state.mkdir(parents=True, exist_ok=True)
    name = advertise or host
    if name in ("0.0.0.0", "::"):
        raise UserError(f"--host {host} binds every address: also pass --advertise with the name other hosts "
                        f"reach this one by")
    remote = dvc_remote or str(state / "dvc-remote")
    if "://" not in remote:
        Path(remote).mkdir(parents=True, exist_ok=True)
    cluster = postgres.start(state / "postgres", host=host, port=pg_port, password=postgres.password_for(state),
                             log=state / "postgres.log")
    started: list[servers.Server] = []
    try:
        pf = servers.start_prefect(prefect_port, host=host, home=state / "prefect", log_dir=state,
                                   db_url=cluster.url("prefect", "asyncpg"), extra_env=prefect_env)
        started.append(pf)
        # MLflow answers only requests addressed to loopback or private IPs unless told the server's name
        allowed = {"MLFLOW_SERVER_ALLOWED_HOSTS": f"localhost,localhost:*,127.0.0.1,127.0.0.1:*,{name},{name}:*"}
        ml = servers.start_mlflow(mlflow_port, host=host, root=state, backend_uri=cluster.url("mlflow"),
                                  artifacts_dir=state / "mlartifacts", log_dir=state, extra_env=allowed)
        started.append(ml)
        for s in started:
            s.wait_healthy(timeout_s)
    except BaseException:
        for s in started:
            s.stop()
        cluster.stop()
        raise
    settings = {"PREFECT_API_URL": f"http://{name}:{prefect_port}/api",
                "MLFLOW_TRACKING_URI": f"http://{name}:{mlflow_port}", "SPLATFLOW_DVC_REMOTE": remote}
    return SharedStack(state, cluster, pf, ml, settings)


def publish(settings: dict[str, str]) -> None:
    """Store the MLflow address and the DVC remote as Prefect variables on the server ``PREFECT_API_URL`` names."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import VariableCreate, VariableUpdate

    with get_client(sync_client=True) as client:
        for key, var in VARIABLES.items():
            if client.read_variable_by_name(var) is None:
                client.create_variable(VariableCreate(name=var, value=settings[key]))
            else:
                client.update_variable(VariableUpdate(name=var, value=settings[key]))


def api_url(server: str) -> str:
    """``http://host:4200`` or ``http://host:4200/api`` -> the API URL."""
    server = server.rstrip("/")
    if "://" not in server:
        raise UserError(f"--server {server!r} is not a URL: give the Prefect server as http://HOST:PORT")
    return server if server.endswith("/api") else server + "/api"


def join_settings(server: str) -> dict[str, str]:
    """The settings a worker joining ``server`` uses: the environment first, then the server's Prefect variables."""
    import httpx

    api = api_url(server)
    out = {"PREFECT_API_URL": api}
    for key, var in VARIABLES.items():
        if os.environ.get(key):
            out[key] = os.environ[key]
            continue
        try:
            r = httpx.get(f"{api}/variables/name/{var}", timeout=10)
        except httpx.HTTPError as e:
            raise UserError(f"cannot reach the Prefect server at {api} ({e}): is `splatflow serve --shared` "
                            f"running there, and is the address right?") from e
        if r.status_code != 200:
            raise UserError(f"the Prefect server at {api} has no variable {var}: start it with `splatflow serve "
                            f"--shared`, or set {key} in this shell")
        out[key] = str(r.json()["value"])
    return out


def worker_env(settings: dict[str, str], clone: Path, name: str, gpu: Optional[str] = None) -> dict[str, str]:
    """The environment of a host's Prefect worker (and so of its flow runs)."""
    env = {**settings, "SPLATFLOW_HOST_CLONE": str(clone), "SPLATFLOW_HOST_NAME": name, "SPLATFLOW_TRACKING": "on"}
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    return env


def check_clone(clone: Path) -> Path:
    clone = Path(clone).expanduser().resolve()
    if not (clone / "dvc.yaml").is_file() or not (clone / ".git").exists():
        raise UserError(f"--clone {clone} is not a clone of the project (no dvc.yaml or .git there): "
                        f"`git clone <the project's git remote> {clone}` first")
    return clone

