"""Shared test settings: quiet, offline, deterministic, and no MLflow unless a test asks for it."""

import os
import shutil

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
    # The files reading the shared reconstructed project (the fixture below): the first builds it, the others wait
    # for it, so they go after the other slow files, by when it is built, instead of waiting idle beside its build.
    readers = list(dict.fromkeys(item.module.__name__ for item in items if "reconstructed" in item.fixturenames))
    later = set(readers[1:])
    items.sort(key=lambda item: (item.module.__name__ not in slow_modules, item.module.__name__ in later))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture()
def stack(tmp_path, monkeypatch):
    """A real Prefect server and MLflow server on free loopback ports (tests/test_servers.py, test_schedule.py).

    The Prefect scheduler loop is shortened so served cron deployments get their upcoming runs within seconds.
    The environment points at both servers (``SPLATFLOW_TRACKING=on``); everything started -- the two servers and
    whatever a test appends to ``stack["started"]`` -- is stopped at the end, also on failure.
    """
    from splatflow.orchestrate import servers

    started: list[servers.Server] = []
    pport, mport = servers.free_port(), servers.free_port()
    try:
        pf = servers.start_prefect(pport, home=tmp_path / "prefect",
                                   extra_env={"PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "2"})
        started.append(pf)
        ml = servers.start_mlflow(mport, root=tmp_path, backend_uri=f"sqlite:///{tmp_path / 'mlflow-server.db'}",
                                  artifacts_dir=tmp_path / "artifacts", log_dir=tmp_path)
        started.append(ml)
        pf.wait_healthy(300)
        ml.wait_healthy(300)
        api = f"{pf.url}/api"
        monkeypatch.setenv("PREFECT_API_URL", api)
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


# A reconstruction small enough to run end to end in seconds: what the report and viewer tests look at.
from tests._project import TINY_PARAMS as LOOK_PARAMS  # noqa: E402


@pytest.fixture(scope="session")
def reconstructed(tmp_path_factory):
    """A throw-away project whose scene ``tiny`` went through every DVC stage, report included (``dvc repro``)."""
    from splatflow.present import webbundle
    from tests._project import SHARED, dvc, make_project, shared_lock

    if not webbundle.is_current():
        if shutil.which("npm") is None:
            pytest.skip("the report's viewer script is not built and npm is missing: run `make web`")
        webbundle.build(log=lambda s: None)
    if SHARED is None:
        root = make_project(tmp_path_factory.mktemp("look") / "p", overrides=LOOK_PARAMS)
        dvc(root, "repro")
        return root
    # Built by the first worker that needs it, copied by the others (the report, viewer and metrics-file tests
    # only read it): one `dvc repro` of the whole pipeline per run instead of one per worker.
    built = SHARED / "look" / "p"
    with shared_lock("look"):
        if not (built.parent / "done").exists():
            shutil.rmtree(built.parent, ignore_errors=True)
            make_project(built, overrides=LOOK_PARAMS)
            dvc(built, "repro")
            (built.parent / "done").write_text("")
    root = tmp_path_factory.mktemp("look") / "p"
    shutil.copytree(built, root, symlinks=True)
    return root
