"""`splatflow run` is a Prefect flow run: a tiny scene's run shows in a real Prefect server as a ``reconstruct`` flow
run with one task per DVC stage, and a stage DVC skipped is marked (state ``Skipped``), also in the UI as headless
Chromium sees it. The terminal keeps DVC's own output, and ``--view`` reaches the train stage."""

from __future__ import annotations

import time

import pytest

from tests import _chromium
from tests._project import BIN, TINY_PARAMS, make_project, project_env, run

pytestmark = pytest.mark.slow


def _task_runs(client, flow_run_id, n: int, timeout_s: float = 120) -> list:
    """The flow run's task runs once all ``n`` are recorded in a final state (the server records task runs from
    the events the client sends, a moment after the flow run returns)."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    deadline = time.monotonic() + timeout_s
    while True:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        if (len(runs) >= n and all(t.state is not None and t.state.is_final() for t in runs)) \
                or time.monotonic() > deadline:
            return runs
        time.sleep(1)


def test_run_shows_in_prefect_with_skipped_stages_marked(prefect_server, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName
    from prefect.client.schemas.sorting import FlowRunSort

    from splatflow.orchestrate import servers
    from splatflow.orchestrate.dvcrun import stage_order

    root = make_project(tmp_path / "p", overrides=TINY_PARAMS)
    # untracked: what is checked here is Prefect's record and the terminal (MLflow: test_flows, test_servers)
    env = {**project_env(), "PREFECT_API_URL": prefect_server["api"], "SPLATFLOW_TRACKING": "off"}
    stages = stage_order(root, "tiny")
    cli = str(BIN / "splatflow")

    first = run([cli, "run", "tiny", "--view", "--view-port", str(servers.free_port())], root, env=env)
    assert "$ dvc repro --single-item train@tiny" in first.stdout  # DVC's own output, as `splatflow run` showed
    assert "Running stage 'train@tiny'" in first.stdout
    assert "live view: open http://127.0.0.1:" in first.stdout, first.stdout[-3000:]
    assert f"{len(stages)} stages ran, 0 up to date" in first.stdout
    assert "Task run" not in first.stdout + first.stderr, "Prefect's log lines repeat the stages' output"

    second = run([cli, "run", "tiny"], root, env=env)
    # settings runs in every repro (dvc.yaml: always_changed); DVC finds every later stage up to date
    assert f"1 stage ran, {len(stages) - 1} up to date" in second.stdout, second.stdout[-3000:]
    assert f"{prefect_server['prefect'].url}/runs/flow-run/" in second.stdout

    with get_client(sync_client=True) as client:
        flow_runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["reconstruct"])),
                                          sort=FlowRunSort.START_TIME_ASC)
        assert len(flow_runs) == 2 and all(fr.state.is_completed() for fr in flow_runs)
        ran, skipped = (_task_runs(client, fr.id, len(stages)) for fr in flow_runs)
    assert sorted(t.name for t in ran) == sorted(stages) == sorted(t.name for t in skipped)
    assert {t.state.name for t in ran} == {"Completed"}, "a fresh project: every stage ran"
    assert {t.name: t.state.name for t in skipped} == {s: "Completed" if s.startswith("settings@") else "Skipped"
                                                        for s in stages}, "nothing changed: DVC skipped the stages"
    assert all(t.state.is_completed() for t in skipped)  # skipped is a way of finishing: the flow goes on

    if _chromium.find() is None:
        pytest.skip(_chromium.SKIP_REASON)
    train = next(t for t in skipped if t.name == "train@tiny")
    page = f"{prefect_server['prefect'].url}/runs/task-run/{train.id}"
    dom = _chromium.dump_dom_until(page, lambda d: "train@tiny" in d and "Skipped" in d)
    assert "train@tiny" in dom and "Skipped" in dom, "the Prefect UI does not show the stage as skipped"
    ran_train = next(t for t in ran if t.name == "train@tiny")
    dom = _chromium.dump_dom_until(f"{prefect_server['prefect'].url}/runs/task-run/{ran_train.id}",
                                   lambda d: "train@tiny" in d and "Completed" in d)
    assert "Completed" in dom and "Skipped" not in dom


def test_run_without_a_reachable_prefect_api_still_runs_the_stages(tmp_path):
    """A Prefect API that does not answer (a server gone, an ephemeral one that did not start in time on a loaded
    machine) must not stop the pipeline: the stages run with DVC alone, and the run says so in one line."""
    from splatflow.orchestrate import servers

    # no images: DVC runs settings, then ingest stops at once on the empty folder -- enough to see who ran them
    root = make_project(tmp_path / "p", generate=False)
    (root / "data" / "raw" / "tiny" / "images").mkdir(parents=True)
    env = {**project_env(), "PREFECT_API_URL": f"http://127.0.0.1:{servers.free_port()}/api",
           "PREFECT_CLIENT_MAX_RETRIES": "0", "SPLATFLOW_TRACKING": "off"}
    r = run([str(BIN / "splatflow"), "run", "tiny"], root, env=env, check=False, timeout=600)
    out = r.stdout + r.stderr
    assert "tiny: Prefect's API is not available" in out and "running the stages with DVC alone" in out, out
    assert "$ dvc repro settings@tiny ingest@tiny" in r.stdout, out
    assert "Running stage 'settings@tiny'" in out and "ingest" in out
    assert r.returncode not in (0, 2, 3) and "Traceback" not in out, out  # the failed stage's status, as dvc's


def test_run_without_a_server_is_recorded_where_splatflow_ui_finds_it(reconstructed, tmp_path):
    """No Prefect server up: `splatflow run` goes through Prefect's ephemeral API, whose database is the one in
    PREFECT_HOME; a Prefect server started later on that folder (what `splatflow ui` does) shows the flow run with
    one task run per stage. The run is the one that built the shared ``reconstructed`` project (tests/conftest.py:
    ``splatflow run tiny`` on a new tiny project, untracked, PREFECT_HOME beside it, no PREFECT_API_URL)."""
    import json

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from splatflow.orchestrate import servers
    from splatflow.orchestrate.dvcrun import stage_order

    r = json.loads((reconstructed.parent / "run.json").read_text())
    if "skip" in r:
        pytest.skip(r["skip"])
    home = reconstructed.parent / "prefect-home"
    stages = stage_order(reconstructed, "tiny")
    assert "using a temporary one" in r["stderr"], r["stderr"][-2000:]
    assert f"{len(stages)} stages ran, 0 up to date" in r["stdout"], r["stdout"][-3000:]
    assert "DVC alone" not in r["stdout"] + r["stderr"]
    assert (home / "prefect.db").exists(), "the ephemeral API did not use PREFECT_HOME's database"

    port = servers.free_port()
    pf = servers.start_prefect(port, home=home, log_dir=tmp_path)
    try:
        pf.wait_healthy(300)
        with temporary_settings(updates={PREFECT_API_URL: f"{pf.url}/api"}), get_client(sync_client=True) as client:
            flow_runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["reconstruct"])))
            assert len(flow_runs) == 1 and flow_runs[0].state.is_completed(), flow_runs
            tasks = _task_runs(client, flow_runs[0].id, len(stages), timeout_s=30)
        assert sorted(t.name for t in tasks) == sorted(stages), [t.name for t in tasks]
        assert {t.state.name for t in tasks} == {"Completed"}
    finally:
        pf.stop()
