"""`splatflow run` where no Prefect server answers: through Prefect's ephemeral API, recorded where `splatflow ui`
finds it, and with the stages run by DVC alone when the API does not answer at all. (A run on a Prefect server, its
task per DVC stage, the stages it skipped and its MLflow run: tests/test_flows.py.)"""

from __future__ import annotations

import pytest

from tests._project import BIN, make_project, project_env, run, task_runs

pytestmark = pytest.mark.slow


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
            tasks = task_runs(client, flow_runs[0].id, len(stages), timeout_s=30)
        assert sorted(t.name for t in tasks) == sorted(stages), [t.name for t in tasks]
        assert {t.state.name for t in tasks} == {"Completed"}
    finally:
        pf.stop()
