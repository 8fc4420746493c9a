"""Orchestration commands of the ``splatflow`` CLI, as typer sub-apps that ``splatflow.cli`` mounts:

* :data:`servers_app` -- ``ui`` and ``serve`` (Prefect and MLflow servers, work pool, workers, the schedule);
* :data:`flows_app` -- ``flow`` and ``batch`` (Prefect flows);
* :data:`runs_app` -- ``runs list`` and ``runs reap`` (MLflow run maintenance);
* :data:`results_app` -- ``compare``, ``rerun`` and ``plots``.

Heavy imports (prefect, mlflow, dvc) happen inside the commands so the CLI starts fast. A bad input raises
:class:`~splatflow.pipeline.errors.UserError`, which the CLI prints without a traceback (exit 2). See
docs/orchestration.md.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional

import typer

from splatflow.pipeline.config import ConfigError, load_params
from splatflow.pipeline.errors import UserError
from splatflow.orchestrate import servers, shared
from splatflow.orchestrate.plots import render_csv_png
from splatflow.orchestrate.rerun import rerun_commit
from splatflow.orchestrate.dvcrun import check_sources
from splatflow.orchestrate.workspace import apply_overrides, parse_override
from splatflow.pipeline.paths import ScenePaths, repo_root, require_project_root


def _root() -> Path:
    return require_project_root()


def _quiet_env() -> None:
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _use_local_prefect_server(say_temporary: bool = True) -> None:
    """Without ``PREFECT_API_URL``, use a Prefect server on 127.0.0.1 (port ``servers.PREFECT_PORT``) when one
    answers (``splatflow ui``): the runs then show in its UI, and no 6-9 s ephemeral server is started per process."""
    _quiet_env()
    # a temporary server on a busy machine can take longer than Prefect's 20 s default to come up
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    if os.environ.get("PREFECT_API_URL"):
        return
    import urllib.request

    url = f"http://127.0.0.1:{servers.PREFECT_PORT}/api"
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=1) as r:
            if r.status == 200:
                os.environ["PREFECT_API_URL"] = url
    except OSError:
        if say_temporary:
            typer.echo(f"(no Prefect server on 127.0.0.1:{servers.PREFECT_PORT}: using a temporary one; start "
                       "`splatflow ui` to see runs in the Prefect UI)", err=True)


SCENE_DEPLOYMENT = "reconstruct/scene"  # what `splatflow serve` deploys and a batch hands its scenes to
_NO_DEPLOYMENT_FIX = ("`splatflow serve --workers 2` in another terminal and run the batch again, or add --local to "
                      "run the scenes in this process, one after another")


def _require_deployment(name: str) -> None:
    """A batch without --local hands each scene to the deployment ``name`` on the Prefect server; without it every
    scene failed with Prefect's ``ObjectNotFound: None`` under pages of tracebacks. Say what to start instead."""
    url = os.environ.get("PREFECT_API_URL")
    if not url:  # a temporary server was going to be started: it holds no deployments
        raise UserError(f"a batch runs its scenes through the {name!r} deployment's workers, but no Prefect server "
                        f"answers on 127.0.0.1:{servers.PREFECT_PORT} (and PREFECT_API_URL is not set): start "
                        "`splatflow ui`, then " + _NO_DEPLOYMENT_FIX)
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    try:
        with get_client(sync_client=True) as client:
            client.read_deployment_by_name(name)
    except ObjectNotFound:
        raise UserError(f"the Prefect server at {url} has no deployment {name!r} (`splatflow serve` creates it): start "
                        + _NO_DEPLOYMENT_FIX) from None
    except Exception as e:  # connection refused, timeout, a proxy's error page
        raise UserError(f"cannot reach the Prefect server at {url} (PREFECT_API_URL) to find the deployment "
                        f"{name!r}: {type(e).__name__}: {e}. Start it (`splatflow ui`), fix PREFECT_API_URL, or "
                        "add --local to run the scenes in this process") from None


def _flows():
    root = _root()
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return root


def _check_scenes(root: Path, scenes: list[str], override_sets: list[dict] = (), sources: bool = True) -> None:
    """Refuse before Prefect starts: a scene that is not in params.yaml, an override that params.yaml would refuse
    (in a worktree, only a stage's own log would have said so, under the tracebacks of the flow run and of every
    task), and with ``sources`` a capture that is not there."""
    params = load_params(root / "params.yaml")
    for s in scenes:
        params.scene(s)  # an unknown scene: a ConfigError naming `splatflow add-scene`
    for overrides in override_sets:
        if not overrides:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            trial = Path(tmp) / "params.yaml"
            trial.write_text((root / "params.yaml").read_text())
            apply_overrides(trial, overrides)
            try:
                load_params(trial)
            except ConfigError as e:
                given = ",".join(f"{k}={v}" for k, v in overrides.items())
                raise UserError(f"override {given}: {str(e).replace(str(trial), 'params.yaml')}") from None
    if sources:
        check_sources(root, scenes)


servers_app = typer.Typer()
flows_app = typer.Typer()
runs_app = typer.Typer(help="MLflow run maintenance", no_args_is_help=True)
results_app = typer.Typer()
SERVERS, FLOWS, RESULTS = "Servers and schedules", "Prefect flows", "Results"



@contextmanager
def _until_stopped(stopping: str, stop_all: Callable[[], object]) -> Iterator[dict]:
    """The block serves until SIGTERM (which sets the yielded ``stop["now"]``) or Ctrl-C ends it; whatever ends it,
    ``stop_all`` stops the servers, between two lines that say so."""
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__("now", True))
    try:
        yield stop
    except KeyboardInterrupt:
        pass
    finally:
        typer.echo(stopping)
        stop_all()
        typer.echo("stopped")


def _watch(stop: dict, watched: list[tuple[Callable[[], bool], Callable[[], str]]]) -> None:
    """Once a second, ``(alive, exited)`` for each server: the first one found dead ends the watch, its ``exited()``
    message (its log's tail) in red; so does ``stop["now"]``."""
    while not stop["now"]:
        for alive, exited in watched:
            if not alive():
                typer.secho(exited(), fg=typer.colors.RED, err=True)
                stop["now"] = True
        time.sleep(1)


@servers_app.command("ui", rich_help_panel=SERVERS)
def ui(prefect_port: int = typer.Option(servers.PREFECT_PORT, min=1, max=65535, help="Prefect server port"),
       mlflow_port: int = typer.Option(servers.MLFLOW_PORT, min=1, max=65535, help="MLflow server port"),
       host: str = typer.Option("127.0.0.1", help="address to bind (keep loopback unless you mean to share)"),
       prefect_home: Optional[Path] = typer.Option(None, help="Prefect database folder "
                                                   "(default: $PREFECT_HOME or ~/.prefect)")):
    """Start the Prefect and MLflow servers (low-memory settings), print their URLs; Ctrl-C stops both."""
    _quiet_env()

    root = repo_root()  # the project's folder, or the cwd: the MLflow store and server logs go there
    home = prefect_home or Path(os.environ.get("PREFECT_HOME", Path.home() / ".prefect"))
    started = []
    try:
        pf = servers.start_prefect(prefect_port, host=host, home=home, log_dir=root / ".splatflow")
        started.append(pf)
        ml = servers.start_mlflow(mlflow_port, host=host, root=root, log_dir=root / ".splatflow")
        started.append(ml)
        typer.echo(f"starting the Prefect and MLflow servers (a first start takes up to 2 minutes; logs "
                   f"{pf.log.parent}) ...")
        for s in started:
            s.wait_healthy(180, on_wait=lambda t, s=s: typer.echo(f"  {s.name}: not up yet after {t:.0f} s ..."))
            typer.echo(f"  {s.name}: up")
    except (RuntimeError, TimeoutError) as e:
        for s in started:
            s.stop()
        raise UserError(str(e)) from None
    from splatflow import tracking  # lazy: MLflow loads only for the commands that read runs

    store = f"sqlite:///{root / 'mlflow.db'}"
    runs_url = ml.url
    try:  # the experiment's runs table in the model-training view, with the headline metrics as columns
        cl = tracking.client(store)
        runs_url = tracking.experiment_ui_url(tracking.experiment_id(cl, uri=store), ml.url)
    except Exception as e:  # noqa: BLE001 - the bare address still works
        typer.echo(f"(could not prepare the splatflow experiment in {store}: {e})", err=True)
    typer.secho(f"Prefect UI  {pf.url}    (log {pf.log})", fg=typer.colors.GREEN)
    typer.secho(f"MLflow UI   {runs_url}", fg=typer.colors.GREEN)
    typer.echo(f"            (log {ml.log}; store {store})")
    typer.echo(f"\nIn other shells:\n  export PREFECT_API_URL={pf.url}/api\n"
               f"  export MLFLOW_TRACKING_URI=sqlite:///{root / 'mlflow.db'}   # or {ml.url}\n"
               "Ctrl-C stops both servers.")
    with _until_stopped("stopping servers ...", lambda: [s.stop() for s in started]) as stop:
        _watch(stop, [(s.alive, lambda s=s: f"{s.name} server exited ({s.proc.returncode}); log {s.log}:\n{s.tail()}")
                      for s in started])


@servers_app.command("serve", rich_help_panel=SERVERS)
def serve(pool: str = typer.Option("splatflow", help="process work pool name"),
          workers: int = typer.Option(1, min=0, help="workers to start on this machine (0: start them yourself)"),
          cron: str = typer.Option("0 3 * * *", help="schedule of the batch/nightly deployment ('' = none)"),
          scenes: Optional[list[str]] = typer.Option(None, "--scene", help="scenes of the scheduled batch "
                                                     "(default: all)"),
          max_concurrent: int = typer.Option(2, min=1, help="scene runs in flight per batch"),
          repo: Optional[Path] = typer.Option(None, help="project folder workers run from (default: here)"),
          shared: bool = typer.Option(False, help="start the team's shared services instead: PostgreSQL, Prefect "
                                      "and MLflow on it, a DVC remote; hosts join with `splatflow worker`"),
          host: str = typer.Option("127.0.0.1", help="--shared: address the servers bind to"),
          advertise: Optional[str] = typer.Option(None, help="--shared: the name other hosts reach this one by "
                                                  "(default: --host)"),
          prefect_port: int = typer.Option(servers.PREFECT_PORT, min=1, max=65535,
                                           help="--shared: Prefect server port"),
          mlflow_port: int = typer.Option(servers.MLFLOW_PORT, min=1, max=65535,
                                          help="--shared: MLflow server port"),
          pg_port: int = typer.Option(5432, min=1, max=65535, help="--shared: PostgreSQL port"),
          state_dir: Optional[Path] = typer.Option(None, help="--shared: databases, artifacts, logs (default: "
                                                   "~/.local/share/splatflow/shared)"),
          dvc_remote: Optional[str] = typer.Option(None, help="--shared: the DVC remote hosts share (default: "
                                                   "STATE_DIR/dvc-remote; or ssh://..., s3://...)"),
          start_timeout: float = typer.Option(300.0, min=1.0, help="--shared: seconds each server may take to "
                                              "answer before start-up is abandoned (a loaded host needs more)")):
    """Create the work pool and deployments, start workers, and serve the scheduled batch until Ctrl-C."""
    if shared:
        return _serve_shared(pool, host, advertise, prefect_port, mlflow_port, pg_port, state_dir, dvc_remote,
                             start_timeout)
    _use_local_prefect_server()
    if not os.environ.get("PREFECT_API_URL"):
        raise UserError("`serve` needs a Prefect server: run `splatflow ui` first (or set PREFECT_API_URL)")
    # the flows (and the served deployments' entrypoints) come from the project served, not from the cwd
    root = Path(repo).resolve() if repo else _root()
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from flows.deployments import deploy_scene, ensure_pool, serve_forever

    ensure_pool(pool)
    deploy_scene(root, pool)
    typer.echo(f"work pool {pool!r} (process) with deployment reconstruct/scene from {root}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # SIGTERM during start-up still stops the workers
    started = []
    try:
        for i in range(workers):
            started.append(servers.start_worker(pool, api_url=os.environ["PREFECT_API_URL"], limit=1,
                                                name=f"{os.uname().nodename}-{i}", log_dir=root / ".splatflow",
                                                cwd=root))
            typer.echo(f"{started[-1].name} (log {started[-1].log})")
        serve_forever(root, cron=cron or None, scenes=scenes or None, max_concurrent=max_concurrent)
    finally:
        for s in (signal.SIGTERM, signal.SIGINT):  # let the workers' flow runs finish cleaning up
            signal.signal(s, signal.SIG_IGN)
        if started:
            typer.echo(f"stopping {len(started)} worker(s) and their flow runs ...")
        pids = set().union(*(w.descendant_pids() for w in started))
        for w in started:
            w.stop()
        try:
            for name in servers.settle_flow_runs(pool, pids) if pids else []:
                typer.echo(f"flow run {name}: its worker stopped before it had ended")
        except Exception as e:  # the server gone too: Prefect ends such runs itself after its cancelling timeout
            typer.echo(f"could not check the workers' flow runs on the Prefect server: {e}", err=True)


def _serve_shared(pool: str, host: str, advertise: Optional[str], prefect_port: int, mlflow_port: int, pg_port: int,
                  state_dir: Optional[Path], dvc_remote: Optional[str], start_timeout: float = 300.0) -> None:
    """``serve --shared``: the shared services until Ctrl-C or SIGTERM (docs/orchestration.md, "Hosts")."""
    from splatflow.orchestrate import hosts  # lazy: MLflow (hosts imports splatflow.tracking)

    _quiet_env()
    _flows()  # the deployment is made from this clone's flows/ (the same on every host)
    state = (state_dir or shared.default_state_dir()).expanduser()
    typer.echo(f"starting PostgreSQL, Prefect and MLflow in {state} ...")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # during start-up: start_shared stops what it started
    stack = shared.start_shared(state, host=host, advertise=advertise, prefect_port=prefect_port,
                                mlflow_port=mlflow_port, pg_port=pg_port, dvc_remote=dvc_remote,
                                timeout_s=start_timeout)
    with _until_stopped("stopping the shared services ...", stack.stop) as stop:
        os.environ["PREFECT_API_URL"] = stack.settings["PREFECT_API_URL"]
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings(updates={PREFECT_API_URL: stack.settings["PREFECT_API_URL"]}):
            shared.publish(stack.settings)
            from flows.deployments import deploy_host_scene, ensure_pool

            ensure_pool(pool)
            deploy_host_scene(pool)
        cfg = hosts.write_shared_settings(stack.settings)
        server = stack.settings["PREFECT_API_URL"].removesuffix("/api")
        typer.secho(f"Prefect  {server}   (PostgreSQL database prefect; log {stack.prefect.log})", fg="green")
        typer.secho(f"MLflow   {stack.settings['MLFLOW_TRACKING_URI']}   (PostgreSQL database mlflow, artifacts "
                    f"proxied to {state / 'mlartifacts'})", fg="green")
        typer.secho(f"DVC      {stack.settings['SPLATFLOW_DVC_REMOTE']}", fg="green")
        typer.echo(f"work pool {pool!r} with deployment reconstruct/host; addresses written to {cfg}\n"
                   f"On each worker host (a clone of the project, `make venv`):\n"
                   f"  .venv/bin/splatflow worker --server {server} --clone $PWD\n"
                   f"In your checkout: `splatflow batch --hosts` (reads {cfg}). Ctrl-C stops the services.")
        _watch(stop, [*((s.alive, lambda s=s: f"{s.name} server exited; log {s.log}:\n{s.tail()}")
                        for s in (stack.prefect, stack.mlflow)),
                      (stack.cluster.alive, lambda: f"PostgreSQL exited; log {stack.cluster.log}")])


@servers_app.command("worker", rich_help_panel=SERVERS)
def worker_cmd(server: str = typer.Option(..., help="the Prefect server of `splatflow serve --shared`, "
                                           "http://HOST:4200"),
               clone: Path = typer.Option(Path("."), help="this host's clone of the project"),
               name: Optional[str] = typer.Option(None, help="this worker's name in runs and summaries "
                                                  "(default: the hostname, with the GPU)"),
               gpu: Optional[str] = typer.Option(None, help="CUDA_VISIBLE_DEVICES of this worker: start one worker "
                                                 "per GPU"),
               pool: str = typer.Option("splatflow", help="work pool")):
    """Join the shared services as a worker host: take scene runs of `splatflow batch --hosts` until Ctrl-C."""
    _quiet_env()
    clone = shared.check_clone(clone)
    settings = shared.join_settings(server)
    name = name or (f"{os.uname().nodename}-gpu{gpu}" if gpu is not None else os.uname().nodename)
    w = servers.start_worker(pool, api_url=settings["PREFECT_API_URL"], name=name, limit=1,
                             log_dir=clone / ".splatflow", cwd=clone,
                             extra_env=shared.worker_env(settings, clone, name, gpu))
    typer.echo(f"worker {name} on {settings['PREFECT_API_URL']} (clone {clone}; MLflow "
               f"{settings['MLFLOW_TRACKING_URI']}; DVC remote {settings['SPLATFLOW_DVC_REMOTE']}); log {w.log}")
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__("now", True))
    try:
        while not stop["now"] and w.alive():
            time.sleep(1)
        if not w.alive():
            typer.secho(f"the worker exited; log {w.log}:\n{w.tail()}", fg="red", err=True)
    except KeyboardInterrupt:
        pass
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        w.stop()


@flows_app.command("flow", rich_help_panel=FLOWS)
def flow_cmd(scene: str = typer.Argument("demo", help="scene to reconstruct"),
             force: bool = typer.Option(False, help="rerun stages DVC finds up to date"),
             worktree: bool = typer.Option(False, help="run in a throw-away git worktree of HEAD"),
             set_: Optional[list[str]] = typer.Option(None, "--set", "-S",
                                                      help="param override key=value (implies --worktree)"),
             stage_timeout: Optional[float] = typer.Option(None, min=1.0, help="seconds before a stage is killed")):
    """Run one scene through the Prefect ``reconstruct`` flow (one task per DVC stage)."""
    overrides = dict(parse_override(s) for s in set_ or []) or None
    root = _flows()
    _check_scenes(root, [scene], [overrides or {}])
    _use_local_prefect_server()
    from flows.reconstruct import reconstruct

    ws = "worktree" if (worktree or overrides) else "inplace"
    res = reconstruct(scene=scene, repo=str(root), workspace=ws, overrides=overrides, force=force,
                      stage_timeout_s=stage_timeout)
    typer.echo(f"{scene}: MLflow run {res['run_id']}")


@flows_app.command("batch", rich_help_panel=FLOWS)
def batch_cmd(scenes: Optional[list[str]] = typer.Argument(None, help="scenes (default: all)"),
              sweep: Optional[list[str]] = typer.Option(None, "--config", "-c",
                                                        help="one sweep config: 'k=v,k2=v2' (repeatable)"),
              max_concurrent: int = typer.Option(2, min=1, help="scene runs in flight"),
              local: bool = typer.Option(False, help="run children in this process instead of the work pool"),
              hosts_: bool = typer.Option(False, "--hosts", help="run the scenes on worker hosts of `splatflow "
                                          "serve --shared` and bring their results into this checkout"),
              force: bool = typer.Option(False, help="rerun stages DVC finds up to date")):
    """Run many scenes and/or a sweep as one batch (children via the work pool unless --local)."""
    configs = [dict(parse_override(kv) for kv in c.split(",") if kv.strip()) for c in sweep or []] or None
    root = _flows()
    # the captures are checked where each scene runs (a worker's worktree may see other paths)
    _check_scenes(root, list(scenes or sorted(load_params(root / "params.yaml").base.scenes)), configs or [],
                  sources=False)
    deployment = None if local else SCENE_DEPLOYMENT
    if hosts_:
        from splatflow.orchestrate import hosts  # lazy: MLflow (hosts imports splatflow.tracking)

        if local:
            raise UserError("--hosts and --local exclude each other: --hosts runs the scenes on worker hosts")
        os.environ.update(hosts.shared_settings())  # the environment wins: shared_settings reads it first
        for key in hosts.SETTINGS:
            if not os.environ.get(key):
                raise UserError(f"--hosts needs {key}: set it, or write {hosts.config_path()} with `splatflow serve "
                                f"--shared` (its addresses)")
        os.environ["SPLATFLOW_TRACKING"] = "on"
        deployment = "reconstruct/host"
    _use_local_prefect_server(say_temporary=local)
    if not local:
        _require_deployment(deployment)
    from flows.batch import batch

    state = batch(scenes=scenes or None, sweep=configs, max_concurrent=max_concurrent,
                  deployment=deployment, repo=str(root), force=force, return_state=True)
    res = state.result(raise_on_failure=False)
    if isinstance(res, BaseException):  # some scene failed: each one's reason, after Prefect's log of the flow
        typer.secho(f"\nbatch: {res}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1)
    for r in res:
        typer.echo(f"{r['job']}: {r['state']}" + (f" ({r['skipped']})" if r.get("skipped") else "")
                   + (f" on {r['host']} in {r['seconds']:.0f} s" if r.get("host") else ""))


@runs_app.command("reap")
def reap_cmd(older_than_hours: Optional[float] = typer.Option(
                 None, min=0.0, help="also reap RUNNING runs of other hosts / without owner tags older than this"),
             dry_run: bool = typer.Option(False, help="only list what would be reaped")):
    """Mark KILLED the runs left RUNNING by a process that no longer exists."""
    from splatflow import tracking  # lazy: MLflow loads only for the commands that read runs

    reaped = tracking.reap(older_than_hours=older_than_hours, dry_run=dry_run)
    for r in reaped:
        typer.echo(f"{'would reap' if dry_run else 'reaped'} {r['run_id']} ({r['scene']}): {r['reason']}")
    typer.echo(f"{len(reaped)} run(s) {'to reap' if dry_run else 'marked KILLED'}")


@runs_app.command("list")
def list_cmd(n: int = typer.Option(10, "-n", "--n", "--limit", min=1, help="how many"),
             scene: Optional[str] = typer.Option(None, help="only the runs of this scene")):
    """The newest runs (any status) with their headline metrics; `compare` takes the ids shown."""
    from splatflow import tracking  # lazy: MLflow loads only for the commands that read runs

    runs = tracking.latest_runs(n, scene=scene, status=None)
    if not runs:
        typer.echo(f"no runs{f' of scene {scene}' if scene else ''} in {tracking.tracking_uri()}")
        return
    typer.echo(f"{'run':{tracking.SHORT_ID}s}  {'status':9s} {'scene':10s} {'commit':10s} {'PSNR':>7s} {'SSIM':>6s} "
               f"{'LPIPS':>6s} {'Gaussians':>9s} {'train s':>8s}  name")
    for r in runs:
        t, m = r.data.tags, r.data.metrics

        def num(key: str, spec: str, width: int) -> str:
            v = m.get(key)
            return f"{v:{width}{spec}}" if v is not None else f"{'-':>{width}s}"

        typer.echo(f"{tracking.short_id(r.info.run_id)}  {r.info.status:9s} {t.get('splatflow.scene', '-'):10s} "
                   f"{(t.get('git.commit') or '')[:10]:10s} {num('evaluate.psnr', '.2f', 7)} "
                   f"{num('evaluate.ssim', '.3f', 6)} {num('evaluate.lpips_alex', '.3f', 6)} "
                   f"{num('evaluate.gaussians', ',.0f', 9)} {num('train.train_seconds', '.1f', 8)}  "
                   f"{r.info.run_name}")


def _cell(v, width: int = 14) -> str:
    """A value of the compare table: numbers to 6 significant digits, nothing for a missing one."""
    import math

    if v is None or (isinstance(v, float) and math.isnan(v)):
        text = "-"
    elif isinstance(v, float):
        text = f"{v:.6g}"
    else:
        text = str(v)
    return text if len(text) <= width else text[:width - 1] + "~"


def _signed(v) -> str:
    import math

    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    return f"{v:+.4g}"


@results_app.command("compare", rich_help_panel=RESULTS)
def compare_cmd(run_ids: Optional[list[str]] = typer.Argument(None, help="two or more runs: an id, a unique start "
                                                               "of one (as `runs list` prints) or a run name "
                                                               "(default: the two newest finished scene runs)"),
                all_params: bool = typer.Option(False, help="show equal params too"),
                all_metrics: bool = typer.Option(False, "--all", help="show every final metric, equal ones too"),
                scene: Optional[str] = typer.Option(None, help="with no RUNs: newest runs of this scene"),
                html_out: Optional[Path] = typer.Option(None, "--html", help="also write a side-by-side page of "
                                                        "two runs (params, metric deltas, curves, test views)")):
    """Runs side by side: headline metrics and their deltas, the params that differ, then the other metrics."""
    from splatflow import tracking  # lazy: MLflow loads only for the commands that read runs

    ids = list(run_ids or [])
    if len(ids) == 1:
        raise UserError(f"compare needs two or more runs, got one ({ids[0]}): add another run id from "
                        "`splatflow runs list`, or give none to compare the two newest")
    if html_out is not None and len(ids) not in (0, 2):
        raise UserError(f"--html compares exactly two runs, got {len(ids)}")
    if not ids:
        ids = [r.info.run_id for r in tracking.latest_runs(2, scene=scene)
               if r.data.tags.get("splatflow.kind") != "batch"]
        if len(ids) < 2:
            raise UserError("fewer than two finished runs to compare; pass run ids (`splatflow runs list`)")
    ids = tracking.resolve_run_ids(ids)
    if len(set(ids)) < len(ids):
        raise UserError("the runs given name the same run twice; give different runs (`splatflow runs list`)")
    cl = tracking.client()
    runs = [cl.get_run(i) for i in ids]
    letters = [chr(ord("A") + i) for i in range(len(runs))]
    for letter, r in zip(letters, runs):
        typer.echo(f"{letter}  {tracking.describe_run(r)}")
    df = tracking.compare(ids, all_params=all_params, all_metrics=all_metrics)
    two = "delta" in df.columns
    header = "".join(f"{x:>14s}" for x in letters) + (f"{'B - A':>12s}" if two else "")

    def section(kind: str, title: str, width: int) -> int:
        part = df[[k == kind for k, _ in df.index]]
        if part.empty:
            return 0
        typer.echo(f"\n{title:{width}s}{header}")
        for (_, key), row in part.iterrows():
            cells = "".join(f"{_cell(v):>14s}" for v in row.iloc[:len(runs)])
            shown = key if len(key) <= width - 1 else key[:width - 2] + "~"
            typer.echo(f"{shown:{width}s}{cells}" + (f"{_signed(row['delta']):>12s}" if two else ""))
        return len(part)

    section("headline", "headline metrics", 24)
    if not section("param", "params that differ" if not all_params else "params", 44):
        typer.echo("\nparams: all equal")
    n_other = sum(1 for r in runs for k in r.data.metrics if "/" not in k)
    if not section("metric", "other final metrics" + ("" if all_metrics else " that differ"), 44) and n_other:
        typer.echo("\nother final metrics: all equal")
    if not all_metrics:
        typer.echo("(--all: every final metric, equal ones too)")
    notes = [(letter, tracking.curve_note(cl, r)) for letter, r in zip(letters, runs)]
    missing = [f"{letter} has none: {note}" for letter, note in notes if note]
    typer.echo("\ntraining curves: " + ("; ".join(missing) if missing else "every run has one")
               + ("" if html_out is not None or len(missing) == len(runs) else " (--html OUT plots them)"))
    if html_out is not None:
        # lazy: MLflow loads only for the commands that read runs
        from splatflow.present.compare_html import write_compare_html

        typer.echo(f"wrote {write_compare_html(ids[0], ids[1], html_out)}")


@results_app.command("rerun", rich_help_panel=RESULTS)
def rerun_cmd(commit: str = typer.Argument(..., help="git commit (or ref) to reproduce"),
              scene: Optional[list[str]] = typer.Option(None, "--scene", help="scenes (default: all at that "
                                                        "commit)"),
              run: Optional[str] = typer.Option(None, help="original MLflow run to compare with (default: the "
                                                "newest finished run of that commit and scene)"),
              rtol: float = typer.Option(1e-2, help="relative tolerance for equal metrics"),
              atol: float = typer.Option(1e-6, help="absolute tolerance for equal metrics"),
              keep: bool = typer.Option(False, help="keep the worktree for inspection"),
              verbose: bool = typer.Option(False, "-v", help="stream DVC output")):
    """Reproduce a commit in a temporary worktree, log it to MLflow linked to the original, diff metrics."""
    _quiet_env()
    root = _root()
    if run is not None:  # a short id or a run name, as `runs list` prints them
        from splatflow import tracking  # lazy: MLflow loads only for the commands that read runs

        run = tracking.resolve_run_ids([run])[0]
    try:
        results = rerun_commit(root, commit, scenes=scene or None, run_id=run, rtol=rtol, atol=atol,
                               keep=keep, on_line=typer.echo if verbose else None, log=typer.echo)
    except ValueError as e:  # a commit without that scene's stages
        raise UserError(str(e)) from None
    bad = False
    for res in results:
        typer.echo(f"\n{res.scene} @ {res.commit[:12]}: rerun {res.rerun_run_id} vs original "
                   f"{res.original_run_id or '(none)'}  [match: |diff| <= {atol:g} + {rtol:g}*|original|]")
        typer.echo(f"  {'metric':40s} {'original':>14s} {'rerun':>14s} {'diff':>12s}")
        for d in res.diffs:
            mark = "ok" if d.ok else "DIFFERS"
            if not d.judged:
                mark = "(timing)" if res.original_run_id else ""
            fmt = lambda v: f"{v:14.6g}" if v is not None else f"{'-':>14s}"  # noqa: E731
            diff = f"{d.diff:12.3g}" if d.diff is not None else f"{'-':>12s}"
            typer.echo(f"  {d.key:40s} {fmt(d.original)} {fmt(d.rerun)} {diff}  {mark}")
        if res.compared:
            typer.echo("  => " + ("reproduced within tolerance" if res.ok else "metrics DIFFER beyond tolerance"))
        else:
            typer.echo(f"  => NOT COMPARED: MLflow has no finished run of scene {res.scene} at commit "
                       f"{res.commit[:12]} (run the pipeline at that commit first, or pass --run RUN_ID); the "
                       "rerun's metrics above are logged, nothing was checked")
        bad |= not res.ok
    raise typer.Exit(1 if bad else 0)


@results_app.command("plots", rich_help_panel=RESULTS)
def plots_cmd(scene: str = typer.Argument("demo")):
    """Render plots/<scene>/train.csv to plots/<scene>/train.png (DVC's HTML plots need the web)."""
    root = _root()
    load_params(root / "params.yaml").scene(scene)  # an unknown scene: a ConfigError naming `splatflow add-scene`
    paths = ScenePaths(scene, root)
    if not paths.train_csv.exists():
        raise UserError(f"{paths.train_csv} does not exist: run the train stage first (`splatflow run {scene}`)")
    out = render_csv_png(paths.train_csv, paths.train_csv.with_suffix(".png"), title=f"{scene}: train")
    typer.echo(f"wrote {out}")
