"""The user's side of a host scene run, without servers: results checked against their lock entries before
anything is written, lock entries merged in pipeline order, shared addresses from the environment over the config
file.  The host side and the whole round trip run in tests/test_hosts.py."""

from __future__ import annotations

import json
import pytest
import yaml

from splatflow.orchestrate import hosts
from tests._project import BIN, project_env, run
from tests.test_tracking import make_toy_project


@pytest.fixture()
def ran(tmp_path, monkeypatch):
    """A toy project whose scene ``a`` ran with `dvc repro` (the "host"), and a fresh clone of it (the "user")
    sharing a DVC remote folder; the host's results logged to a local MLflow store as a host run logs them."""
    from splatflow import tracking

    host = make_toy_project(tmp_path / "host")
    remote = tmp_path / "remote"
    run([str(BIN / "dvc"), "repro"], host, env={**project_env(), "SPLATFLOW_TRACKING": "off"})
    hosts.use_remote(host, str(remote))
    monkeypatch.setenv("SPLATFLOW_TRACKING", "on")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    cl = tracking.client()
    run_id = cl.create_run(tracking.experiment_id(cl)).info.run_id
    stages = ["one@a", "two@a"]
    hosts.publish_results(host, stages, run_id, cl)
    user = tmp_path / "user"
    run(["git", "clone", "-q", str(host), str(user)], tmp_path)
    hosts.use_remote(user, str(remote))
    return {"host": host, "user": user, "client": cl, "run_id": run_id, "stages": stages}


def test_results_land_with_lock_entries_and_dvc_status_clean(ran):
    user = ran["user"]
    got = hosts.collect_results(user, ran["run_id"], ran["client"], ["one@a", "two@a"])
    assert got == ["one@a", "two@a"]
    lock = yaml.safe_load((user / "dvc.lock").read_text())["stages"]
    assert list(lock) == ["one@a", "two@a"]
    assert json.loads((user / "metrics" / "a" / "two.json").read_text())["psnr"] == pytest.approx(20.02)
    assert (user / "out" / "a" / "two.ply").read_text() == "ply two 2"
    assert "up to date" in run([str(BIN / "dvc"), "status"], user).stdout
    assert "one.ply" in (user / "out" / "a" / ".gitignore").read_text()


def test_a_file_that_does_not_match_its_lock_entry_writes_nothing(ran, tmp_path):
    cl, user = ran["client"], ran["user"]
    bad = tmp_path / "bad" / "metrics" / "a"
    bad.mkdir(parents=True)
    (bad / "two.json").write_text('{"psnr": 99}')
    cl.log_artifact(ran["run_id"], str(bad / "two.json"), artifact_path=f"{hosts.RESULTS_DIR}/files/metrics/a")
    with pytest.raises(hosts.HostError, match="does not match its dvc.lock md5"):
        hosts.collect_results(user, ran["run_id"], cl, ["one@a", "two@a"])
    assert not (user / "dvc.lock").exists()
    assert not (user / "metrics" / "a" / "one.json").exists()
    assert not (user / "out" / "a").exists()


def test_a_run_that_published_nothing_is_refused(ran):
    from splatflow import tracking

    cl = ran["client"]
    empty = cl.create_run(tracking.experiment_id(cl)).info.run_id
    with pytest.raises(hosts.HostError, match="did not finish publishing"):
        hosts.collect_results(ran["user"], empty, cl, [])
    assert not (ran["user"] / "dvc.lock").exists()


def test_merge_keeps_other_entries_in_pipeline_order(tmp_path):
    lock = tmp_path / "dvc.lock"
    lock.write_text(yaml.safe_dump({"schema": "2.0", "stages": {"two@b": {"cmd": "old b"}, "one@b": {"cmd": "b"}}}))
    hosts.merge_lock(lock, {"two@a": {"cmd": "2a"}, "one@a": {"cmd": "1a"}, "two@b": {"cmd": "new b"}},
                     ["one@a", "one@b", "two@a", "two@b"])
    data = yaml.safe_load(lock.read_text())
    assert data["schema"] == "2.0"
    assert data["stages"] == {"one@a": {"cmd": "1a"}, "one@b": {"cmd": "b"}, "two@a": {"cmd": "2a"},
                              "two@b": {"cmd": "new b"}}
    assert list(data["stages"]) == ["one@a", "one@b", "two@a", "two@b"]


def test_shared_settings_environment_over_config_file(tmp_path, monkeypatch):
    cfg = tmp_path / "shared.yaml"
    cfg.write_text(yaml.safe_dump({"PREFECT_API_URL": "http://file:4200/api", "MLFLOW_TRACKING_URI": "http://file:5000",
                                   "SPLATFLOW_DVC_REMOTE": "/srv/dvc"}))
    for k in hosts.SETTINGS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://env:5000")
    got = hosts.shared_settings(cfg)
    assert got == {"PREFECT_API_URL": "http://file:4200/api", "MLFLOW_TRACKING_URI": "http://env:5000",
                   "SPLATFLOW_DVC_REMOTE": "/srv/dvc"}
    cfg.write_text("- not a mapping\n")
    with pytest.raises(hosts.HostError, match="must be a mapping"):
        hosts.shared_settings(cfg)
