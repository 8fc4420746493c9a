"""Shared test settings: quiet, offline, deterministic, and no MLflow unless a test asks for it."""

import json
import os
import shutil
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("SPLATFLOW_TRACKING", "off")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")

import pytest  # noqa: E402


def pytest_configure(config):
    # pytest-xdist (>= 3.6) hands out the files of `--dist loadfile` by their number of tests, most first, unless
    # told otherwise: that put the end-to-end files (one to three tests each, minutes each) last, to run alone at
    # the end of the suite. Its own order off, the files go out in the order pytest_collection_modifyitems makes.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_sessionstart(session):
    import tests._project

    # What tests build once per run and copy (tests/_project.py: the generated scenes, the reconstructed project)
    # goes where every pytest-xdist worker of this run finds it: the folder above the workers' own temp folders.
    base = session.config._tmp_path_factory.getbasetemp()
    worker = hasattr(session.config, "workerinput")
    tests._project.SHARED = (base.parent if worker else base) / "shared"

    # The CPU training kernels compile once, in the controller, before the pytest-xdist workers start: a fresh
    # clone's numba cache is empty, and the first test of each worker compiling them at once cost about a minute
    # of CPU twice over (splatflow.train.precompile: two helper processes on two cores; nothing when cached).
    if worker or getattr(session.config.option, "numprocesses", None) in (None, 0):
        return
    import torch

    if torch.cuda.is_available():
        return
    from splatflow.train.precompile import precompile

    precompile(2)


def pytest_collection_modifyitems(config, items):
    import torch

    # Modules holding a `slow` test first (in their own order): with `-n 2 --dist loadfile` (make test) the long
    # end-to-end files start at once and the short ones fill in around them, instead of one long file at the end
    # running alone (pytest_configure keeps pytest-xdist from reordering them).
    slow_modules = {item.module.__name__ for item in items if "slow" in item.keywords}
    items.sort(key=lambda item: item.module.__name__ not in slow_modules)
    # The files reading the shared reconstructed project (the fixture below): the first in that order builds it, the
    # others wait for it, so they go after the other slow files, by when it is built, instead of waiting idle beside
    # its build.
    readers = list(dict.fromkeys(item.module.__name__ for item in items if "reconstructed" in item.fixturenames))
    later = set(readers[1:])
    items.sort(key=lambda item: (item.module.__name__ not in slow_modules, item.module.__name__ in later))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def _servers(tmp_path, monkeypatch, mlflow: bool):
    from splatflow.orchestrate import servers

    started: list[servers.Server] = []
    pport = servers.free_port()
    try:
        pf = servers.start_prefect(pport, home=tmp_path / "prefect",
                                   extra_env={"PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "2"})
        started.append(pf)
        ml = None
        if mlflow:
            ml = servers.start_mlflow(servers.free_port(), root=tmp_path,
                                      backend_uri=f"sqlite:///{tmp_path / 'mlflow-server.db'}",
                                      artifacts_dir=tmp_path / "artifacts", log_dir=tmp_path)
            started.append(ml)
        pf.wait_healthy(300)
        api = f"{pf.url}/api"
        monkeypatch.setenv("PREFECT_API_URL", api)
        if ml is not None:
            ml.wait_healthy(300)
            monkeypatch.setenv("MLFLOW_TRACKING_URI", ml.url)
            monkeypatch.setenv("SPLATFLOW_TRACKING", "on")
            monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
        # Prefect reads its settings from the environment once, at import: when an earlier test already imported
        # it, the env var alone is not seen and the client would silently start an ephemeral server instead.
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings(updates={PREFECT_API_URL: api}):
            yield {"prefect": pf, "mlflow": ml, "api": api, "started": started, "tmp": tmp_path}
    finally:
        for s in reversed(started):
            s.stop()
        assert not any(s.alive() for s in started)


@pytest.fixture()
def stack(tmp_path, monkeypatch):
    """A real Prefect server and MLflow server on free loopback ports (tests/test_servers.py, test_schedule.py).

    The Prefect scheduler loop is shortened so served cron deployments get their upcoming runs within seconds.
    The environment points at both servers (``SPLATFLOW_TRACKING=on``); everything started -- the two servers and
    whatever a test appends to ``stack["started"]`` -- is stopped at the end, also on failure.
    """
    yield from _servers(tmp_path, monkeypatch, mlflow=True)


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory):
    """The ``stack`` fixture's Prefect server alone, started once for every test of a module (tests/test_flows.py:
    the runs of ``splatflow run`` and the batches), with the environment pointing at it for the module's duration;
    no MLflow server (stages that record write to a local store the test names)."""
    mp = pytest.MonkeyPatch()
    try:
        yield from _servers(tmp_path_factory.mktemp("prefect_server"), mp, mlflow=False)
    finally:
        mp.undo()


# A reconstruction small enough to run end to end in seconds: what the report and viewer tests look at.
from tests._project import TINY_PARAMS as LOOK_PARAMS  # noqa: E402


def _reconstruct(root: Path) -> None:
    """``splatflow run tiny`` in ``root`` as a user runs it with no Prefect server up: through Prefect's ephemeral
    API, whose database goes in ``root.parent / "prefect-home"``, untracked; its output in ``root.parent /
    "run.json"`` (tests/test_run_flow.py checks what that run recorded). Where a Prefect server answers on the
    default port the run would record there instead, so the stages run with ``dvc repro`` alone and run.json says
    why (that test then skips)."""
    from splatflow.orchestrate import servers
    from tests._project import BIN, dvc, project_env, run

    record = root.parent / "run.json"
    if servers.port_in_use(servers.PREFECT_PORT):
        dvc(root, "repro")
        why = (f"a Prefect server answers on 127.0.0.1:{servers.PREFECT_PORT} (another `splatflow ui`): "
               "`splatflow run` would record there, not in an ephemeral API")
        record.write_text(json.dumps({"skip": why}))
        return
    env = {k: v for k, v in project_env().items() if not k.startswith("PREFECT_API")}
    # a loaded machine can take minutes to start the ephemeral server (its database migrations, uvicorn)
    env.update({"PREFECT_HOME": str(root.parent / "prefect-home"), "SPLATFLOW_TRACKING": "off",
                "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "600"})
    r = run([str(BIN / "splatflow"), "run", "tiny"], root, env=env)
    record.write_text(json.dumps({"stdout": r.stdout, "stderr": r.stderr}))


@pytest.fixture(scope="session")
def reconstructed(tmp_path_factory):
    """A throw-away project whose scene ``tiny`` went through every DVC stage, report included, by ``splatflow
    run`` (one ``dvc repro`` per stage, :func:`_reconstruct`); beside it ``run.json`` and ``prefect-home``, what
    that run printed and the ephemeral Prefect API's database."""
    from splatflow.present import webbundle
    from tests._project import SHARED, make_project, shared_lock

    if not webbundle.is_current():
        if shutil.which("npm") is None:
            pytest.skip("the report's viewer script is not built and npm is missing: run `make web`")
        webbundle.build(log=lambda s: None)
    if SHARED is None:
        root = make_project(tmp_path_factory.mktemp("look") / "p", overrides=LOOK_PARAMS)
        _reconstruct(root)
        return root
    # Built by the first worker that needs it, copied by the others (the report, viewer, metrics-file and
    # ephemeral-API tests only read it): one run of the whole pipeline per test run instead of one per worker.
    built = SHARED / "look" / "p"
    with shared_lock("look"):
        if not (built.parent / "done").exists():
            shutil.rmtree(built.parent, ignore_errors=True)
            make_project(built, overrides=LOOK_PARAMS)
            _reconstruct(built)
            (built.parent / "done").write_text("")
    look = tmp_path_factory.mktemp("look")
    for name in ("p", "prefect-home"):
        if (built.parent / name).exists():
            shutil.copytree(built.parent / name, look / name, symlinks=True)
    shutil.copy(built.parent / "run.json", look / "run.json")
    return look / "p"
