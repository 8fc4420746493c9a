"""Scene runs on worker hosts that share nothing with the user's checkout but the network.

A host has its own clone of the project (from the git remote the user pushes to), its own venv, DVC cache and
``$HOME``; it reaches the user's side only through the Prefect API, the MLflow server and a DVC remote.  One scene
run on a host (``reconstruct(workspace="host")``, started through the ``reconstruct/host`` deployment):

1. the deployment's pull step :func:`enter_host_clone` moves the flow-run process into the host's clone
   (``SPLATFLOW_HOST_CLONE``, set by ``splatflow worker``), so the flow's code is the host's own;
2. :func:`fetch_commit` fetches the batch's commit from the clone's git remote, and the run works in a git worktree
   of it (:func:`splatflow.orchestrate.workspace.worktree`, the clone's DVC cache);
3. :func:`pull_inputs` configures the DVC remote (``SPLATFLOW_DVC_REMOTE``) in the worktree and pulls what the
   scene's stages need: the raw capture (a ``dvc add``-ed ``.dvc`` file) and any earlier stage outputs the
   remote has;
4. the stages run as in any other scene run;
5. only when every stage succeeded, :func:`publish_results` pushes the scene's outputs to the DVC remote and
   logs, under the run's ``splatflow-results/`` artifacts, the scene's ``dvc.lock`` entries and the outputs DVC
   does not cache (metrics, plots, small JSON files).  A host that dies before then has pushed nothing the
   user's side would take: the results folder is written last and is what :func:`collect_results` looks for.

On the user's side the batch calls :func:`collect_results` for each finished scene: it downloads the results
folder through the MLflow server, checks every file against the md5 its lock entry records, writes the files,
merges the entries into the checkout's ``dvc.lock`` and ``dvc pull``s the cached outputs, so the checkout ends as
if the scene had run there (``dvc status`` clean).

Addresses come from the environment or a config file (:func:`shared_settings`), never from the repository.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import yaml

from splatflow import tracking
from splatflow.pipeline.errors import UserError
from splatflow.orchestrate import dvcrun
from splatflow.orchestrate.workspace import workspace_lock

#: The artifact folder of a host's scene run that holds its lock entries and uncached outputs.
RESULTS_DIR = "splatflow-results"
LOCK_ENTRIES = "lock.yaml"
#: The DVC remote's name in the worktrees of host runs (``.dvc/config.local``, never committed).
REMOTE_NAME = "splatflow-shared"
#: Keys of the shared settings, each also an environment variable of the same name.
SETTINGS = ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "SPLATFLOW_DVC_REMOTE")


class HostError(UserError):
    """A host or the shared stores are not set up as a host run needs: the message names what and the fix."""


def config_path() -> Path:
    """``$SPLATFLOW_CONFIG``, else ``~/.config/splatflow/shared.yaml``: where ``splatflow serve --shared`` writes the
    addresses a worker or a user's shell needs (not in the repository: they differ per team and hold no secret
    the repository should carry)."""
    env = os.environ.get("SPLATFLOW_CONFIG")
    if env:
        return Path(env).expanduser()
    return Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "splatflow" / "shared.yaml"


def shared_settings(path: Optional[Path] = None) -> dict[str, str]:
    """The shared addresses: each key of :data:`SETTINGS` from the environment when set there, else from the config
    file (:func:`config_path`); keys found in neither are left out."""
    path = path or config_path()
    data: dict[str, Any] = {}
    if path.is_file():
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise HostError(f"{path} is not valid YAML ({e}); rewrite it with `splatflow serve --shared` or fix it "
                            f"by hand (keys: {', '.join(SETTINGS)})") from e
        if not isinstance(data, dict):
            raise HostError(f"{path} must be a mapping of {', '.join(SETTINGS)}; rewrite it with "
                            f"`splatflow serve --shared`")
    out = {k: str(data[k]) for k in SETTINGS if data.get(k)}
    out.update({k: os.environ[k] for k in SETTINGS if os.environ.get(k)})
    return out


def write_shared_settings(settings: dict[str, str], path: Optional[Path] = None) -> Path:
    path = path or config_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({k: settings[k] for k in SETTINGS if k in settings}, sort_keys=False))
    return path


def _run(cmd: list[str], cwd: Path, what: str, env: Optional[dict] = None,
         on_line: Optional[Callable[[str], None]] = None) -> str:
    p = subprocess.run(cmd, cwd=str(cwd), env=env or dvcrun.stage_env(), capture_output=True, text=True)
    out = (p.stdout + p.stderr).strip()
    if on_line is not None:
        for line in out.splitlines():
            on_line(line)
    if p.returncode != 0:
        raise HostError(f"{what} failed in {cwd} (`{' '.join(cmd[:4])} ...`, exit {p.returncode}):\n{out[-3000:]}")
    return out


# --- the host's side ----------------------------------------------------------------------------------------------

def enter_host_clone(**_: Any) -> dict[str, str]:
    """Prefect pull step of ``reconstruct/host``: work in this host's clone (``SPLATFLOW_HOST_CLONE``)."""
    clone = os.environ.get("SPLATFLOW_HOST_CLONE")
    if not clone:
        raise HostError("SPLATFLOW_HOST_CLONE is not set in this worker's environment: start workers for "
                        "`reconstruct/host` with `splatflow worker --server URL --clone PATH`")
    path = Path(clone).expanduser().resolve()
    if not (path / "dvc.yaml").is_file() or not (path / ".git").exists():
        raise HostError(f"SPLATFLOW_HOST_CLONE={clone} is not a clone of the project (no dvc.yaml or .git): "
                        f"`git clone <the project's git remote> {clone}`")
    os.chdir(path)
    return {"directory": str(path)}


def host_name() -> str:
    """This host's name in runs and summaries: ``SPLATFLOW_HOST_NAME`` (set by ``splatflow worker --name``), else the
    machine's hostname."""
    return os.environ.get("SPLATFLOW_HOST_NAME") or socket.gethostname()


def fetch_commit(clone: Path, commit: str) -> str:
    """Make ``commit`` available in the host's clone (``git fetch`` from its remotes when it is not there yet)."""
    have = subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=clone, capture_output=True)
    if have.returncode != 0:
        _run(["git", "fetch", "--quiet", "--all"], clone, "git fetch")
        have = subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=clone, capture_output=True)
        if have.returncode != 0:
            raise HostError(f"commit {commit[:12]} is not on this host's git remote (clone {clone}): push it "
                            f"(`git push`) before starting the batch")
    return commit


def remote_url() -> str:
    url = shared_settings().get("SPLATFLOW_DVC_REMOTE")
    if not url:
        raise HostError("no DVC remote: set SPLATFLOW_DVC_REMOTE (or start the worker with `splatflow worker "
                        "--server URL`, which reads it from the server)")
    return url


def use_remote(root: Path, url: str) -> None:
    """Point the workspace's DVC at the shared remote, in ``.dvc/config.local`` (never committed)."""
    dvc = _dvc()
    _run([dvc, "remote", "add", "--local", "--force", REMOTE_NAME, url], root, "dvc remote add")


def _dvc() -> str:
    return dvcrun.dvc_executable()


def pull_inputs(root: Path, stages: list[str], on_line: Optional[Callable[[str], None]] = None) -> None:
    """``dvc pull`` of what the stages read and the outputs the remote already holds (``--allow-missing``: a stage
    that never ran anywhere has none yet), so DVC runs only what is stale."""
    _run([_dvc(), "pull", "--allow-missing", "--with-deps", "-r", REMOTE_NAME, *stages], root,
         "dvc pull of the scene's inputs", on_line=on_line)


def lock_entries(root: Path, stages: list[str]) -> dict[str, Any]:
    lock = yaml.safe_load((root / "dvc.lock").read_text()) or {}
    entries = lock.get("stages") or {}
    missing = [s for s in stages if s not in entries]
    if missing:
        raise HostError(f"dvc.lock in {root} has no entry for {', '.join(missing)} after the stages ran")
    return {s: entries[s] for s in stages}


def uncached_outs(entries: dict[str, Any], root: Path) -> list[str]:
    """The files the entries' stages write that DVC does not cache (``cache: false`` metrics, plots, outs), as
    ``root``'s dvc.yaml declares them."""
    from dvc.repo import Repo

    cached = set()
    with Repo(str(root)) as repo:
        for stage in repo.index.stages:
            if getattr(stage, "name", None) in entries:  # a .dvc file's stage has no name
                cached.update(out.def_path for out in stage.outs if out.use_cache)
    return [out["path"] for entry in entries.values() for out in entry.get("outs") or []
            if out["path"] not in cached]


def publish_results(root: Path, stages: list[str], run_id: Optional[str], client: Any,
                    on_line: Optional[Callable[[str], None]] = None) -> dict[str, Any]:
    """After every stage succeeded: push the cached outputs to the DVC remote, then log the lock entries and the
    uncached outputs as ``splatflow-results/`` artifacts of the scene's MLflow run (last: their presence says the
    push is complete)."""
    _run([_dvc(), "push", "-r", REMOTE_NAME, *stages], root, "dvc push of the scene's outputs", on_line=on_line)
    entries = lock_entries(root, stages)
    if client is None or run_id is None:
        raise HostError("a host run reports its results through MLflow: set MLFLOW_TRACKING_URI to the MLflow "
                        "server (and leave SPLATFLOW_TRACKING on)")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / LOCK_ENTRIES).write_text(yaml.safe_dump({"stages": entries}, sort_keys=False))
        for rel in uncached_outs(entries, root):
            src = root / rel
            if src.is_file():
                dst = tmp / "files" / rel
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dst)
        client.log_artifacts(run_id, str(tmp), artifact_path=RESULTS_DIR)
    return entries


# --- the user's side ----------------------------------------------------------------------------------------------

def _md5(path: Path) -> str:
    h = hashlib.md5()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def merge_lock(lock_path: Path, entries: dict[str, Any], stage_order: list[str]) -> None:
    """Put ``entries`` into ``lock_path`` (replacing those stages' old entries), stages in ``stage_order``'s order
    (DVC's own writes keep a stage where it was; new ones go where the pipeline order puts them)."""
    lock = yaml.safe_load(lock_path.read_text()) if lock_path.exists() else None
    lock = lock or {"schema": "2.0", "stages": {}}
    stages = dict(lock.get("stages") or {})
    stages.update(entries)
    pos = {s: i for i, s in enumerate(stage_order)}
    ordered = sorted(stages, key=lambda s: (pos.get(s, len(pos)), list(stages).index(s)))
    lock["stages"] = {s: stages[s] for s in ordered}
    tmp = lock_path.with_name(lock_path.name + ".tmp")
    tmp.write_text(yaml.safe_dump(lock, sort_keys=False, width=1 << 16))
    os.replace(tmp, lock_path)


def collect_results(main_root: Path, run_id: str, client: Any, stage_order: list[str],
                    on_line: Optional[Callable[[str], None]] = None) -> list[str]:
    """Bring one host scene run's results into the user's checkout ``main_root`` (see the module docstring);
    returns the stages it merged.  Every file is checked against its lock entry's md5 before anything is written,
    so a results folder that does not match leaves the checkout as it was."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            got = Path(client.download_artifacts(run_id, RESULTS_DIR, tmp))
        except Exception as e:  # noqa: BLE001 - MLflow raises several kinds for a missing artifact
            raise HostError(f"MLflow run {run_id} has no {RESULTS_DIR}/ artifacts: its host did not finish "
                            f"publishing ({e})") from e
        entries = (yaml.safe_load((got / LOCK_ENTRIES).read_text()) or {}).get("stages") or {}
        if not entries:
            raise HostError(f"MLflow run {run_id}: {RESULTS_DIR}/{LOCK_ENTRIES} lists no stages")
        files = []
        for rel in uncached_outs(entries, main_root):
            md5 = next(o.get("md5") for e in entries.values() for o in e.get("outs") or [] if o["path"] == rel)
            src = got / "files" / rel
            if not src.is_file():
                raise HostError(f"MLflow run {run_id}: {rel} is missing from {RESULTS_DIR}/files")
            if md5 and _md5(src) != md5:
                raise HostError(f"MLflow run {run_id}: {rel} does not match its dvc.lock md5 (a corrupt upload): "
                                f"nothing of this scene was written; rerun the scene")
            files.append((src, main_root / rel))
        for src, dst in files:
            dst.parent.mkdir(parents=True, exist_ok=True)
            part = dst.with_name(dst.name + ".part")
            shutil.copy2(src, part)
            os.replace(part, dst)
    merge_lock(main_root / "dvc.lock", entries, stage_order)
    targets = list(entries)
    _run([_dvc(), "pull", "-r", REMOTE_NAME, *targets], main_root, "dvc pull of the scene's outputs",
         on_line=on_line)
    ignore_outputs(main_root, targets)
    return targets


def ignore_outputs(root: Path, stages: list[str]) -> None:
    """Git-ignore the stages' cached outputs as ``dvc repro`` does when it writes them (``.gitignore`` entries,
    staged when ``core.autostage`` is on): a pull alone does not, and they would show as untracked files."""
    from dvc.repo import Repo

    with Repo(str(root)) as repo, repo.scm_context(quiet=True):
        for stage in repo.index.stages:
            if getattr(stage, "name", None) in stages:  # a .dvc file's stage has no name
                for out in stage.outs:
                    out.ignore()


_collect_lock = threading.Lock()


def collect_scene(main_root: Path, flow_run_id: str, scene: str,
                  on_line: Optional[Callable[[str], None]] = None) -> dict[str, Any]:
    """The user's side of one finished host scene run (its Prefect flow run ``flow_run_id``): find its MLflow run,
    :func:`collect_results` into ``main_root`` as the checkout's only writer (scene by scene), and say where and how
    long it ran."""
    cl = tracking.client()
    exps = [e.experiment_id for e in cl.search_experiments()]
    runs = cl.search_runs(exps, filter_string=f"tags.`prefect.flow_run_id` = '{flow_run_id}'",
                          order_by=["attributes.start_time DESC"])
    if not runs:
        raise HostError(f"scene {scene}: no MLflow run of flow run {flow_run_id} at {tracking.tracking_uri()}: the "
                        f"host and this machine must use the same MLflow server (MLFLOW_TRACKING_URI)")
    run = runs[0]
    use_remote(main_root, remote_url())
    with _collect_lock, workspace_lock(main_root):
        stages = collect_results(main_root, run.info.run_id, cl, dvcrun.stage_order(main_root), on_line=on_line)
    seconds = ((run.info.end_time or run.info.start_time) - run.info.start_time) / 1000.0
    return {"run_id": run.info.run_id, "host": run.data.tags.get("splatflow.host", ""), "stages": stages,
            "seconds": round(seconds, 1)}


# --- a host that disappears -----------------------------------------------------------------------------------------

def _mlflow_run_of(flow_run_id: str):
    cl = tracking.client()
    exps = [e.experiment_id for e in cl.search_experiments()]
    runs = cl.search_runs(exps, filter_string=f"tags.`prefect.flow_run_id` = '{flow_run_id}'")
    return cl, (runs[0] if runs else None)


HOST_TAG = "splatflow-host:"


def announce_host(flow_run_id: Any) -> str:
    """Tag this host's flow run with the host's (worker's) name first thing, so the batch can tell when the host
    running it disappears (:func:`run_on_hosts`)."""
    from prefect.client.orchestration import get_client

    name = host_name()
    with get_client(sync_client=True) as client:
        fr = client.read_flow_run(flow_run_id)
        client.update_flow_run(flow_run_id, tags=[*(fr.tags or []), f"{HOST_TAG}{name}"])
    return name


def worker_alive(workers: list, name: str) -> bool:
    """Whether the pool's worker ``name`` still heartbeats: Prefect workers report every
    ``heartbeat_interval_seconds``; three missed reports (what Prefect's own OFFLINE status waits for) mean the
    host is gone.  A name the pool does not know counts as gone too."""
    for w in workers:
        if w.name == name:
            if w.last_heartbeat_time is None:
                return False
            interval = float(getattr(w, "heartbeat_interval_seconds", None) or 30)
            age = (dt.datetime.now(dt.timezone.utc) - w.last_heartbeat_time).total_seconds()
            return age <= 3 * interval
    return False


def abandon(client: Any, flow_run_id: Any, host: str, on_line: Callable[[str], None]) -> None:
    """A scene run whose host stopped heartbeating: its flow run becomes CRASHED and its MLflow run KILLED (tagged
    with the lost host), so neither stays RUNNING; the host published nothing (it publishes only at the end)."""
    from prefect.states import Crashed

    why = f"host {host} stopped heartbeating while it ran this scene"
    client.set_flow_run_state(flow_run_id, Crashed(message=f"crashed: {why}"), force=True)
    with contextlib.suppress(Exception):
        cl, run = _mlflow_run_of(str(flow_run_id))
        if run is not None and run.info.status == "RUNNING":
            cl.set_tag(run.info.run_id, "splatflow.lost_host", host)
            cl.set_terminated(run.info.run_id, "KILLED")
    on_line(f"{why}: flow run crashed, MLflow run killed")


def run_on_hosts(deployment: str, parameters: dict[str, Any], flow_run_name: str, *, attempts: int = 3,
                 poll_s: float = 2.0, on_line: Callable[[str], None] = print,
                 idempotency_key: str | None = None) -> tuple[Any, int]:
    """Start the scene through ``deployment`` and wait for it; when the host running it stops heartbeating, end that
    run (:func:`abandon`) and start the scene again, for another worker of the pool to take, up to ``attempts``
    times.  Returns the last flow run and the number of attempts made. With ``idempotency_key`` each attempt's flow
    run is created under that key and the attempt's number (a request the client sends again makes no second
    run)."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    with get_client(sync_client=True) as client:
        pool = client.read_deployment_by_name(deployment).work_pool_name
    fr = None
    for attempt in range(1, attempts + 1):
        name = flow_run_name if attempt == 1 else f"{flow_run_name}-try{attempt}"
        fr = run_deployment(name=deployment, parameters=parameters, timeout=0, as_subflow=True, flow_run_name=name,
                            idempotency_key=None if idempotency_key is None else f"{idempotency_key}-try{attempt}")
        host, lost = None, None
        while True:
            time.sleep(poll_s)
            with get_client(sync_client=True) as client:
                fr = client.read_flow_run(fr.id)
                if fr.state is not None and fr.state.is_final():
                    break
                if fr.state is None or not fr.state.is_running():
                    continue
                if host is None:
                    host = next((t[len(HOST_TAG):] for t in fr.tags or [] if t.startswith(HOST_TAG)), None)
                    if host:
                        on_line(f"{name}: running on {host}")
                if host and not worker_alive(client.read_workers_for_work_pool(pool), host):
                    abandon(client, fr.id, host, on_line)
                    lost = host
                    fr = client.read_flow_run(fr.id)
                    break
        if lost is None:
            return fr, attempt
        if attempt < attempts:
            on_line(f"{flow_run_name}: starting it again for another host (attempt {attempt + 1} of {attempts})")
    return fr, attempts
