"""The MLflow links splatflow prints open on the work, seen in headless Chromium against a real `mlflow server`: the
experiment's runs table in the model-training view, and a run's page in the same view -- not MLflow 3's GenAI pages
(traces, judges, evaluation runs)."""

from __future__ import annotations

import re

import pytest

from tests import _chromium

needs_chromium = pytest.mark.skipif(_chromium.find() is None, reason=_chromium.SKIP_REASON)


@pytest.fixture
def mlflow_server(tmp_path, monkeypatch):
    from splatflow.orchestrate import servers

    ml = servers.start_mlflow(servers.free_port(), root=tmp_path, backend_uri=f"sqlite:///{tmp_path / 'ml.db'}",
                              artifacts_dir=tmp_path / "artifacts", log_dir=tmp_path)
    try:
        ml.wait_healthy(300)
        monkeypatch.setenv("SPLATFLOW_TRACKING", "on")
        yield ml
    finally:
        ml.stop()


def _text(dom: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", dom))


@needs_chromium
def test_experiment_link_opens_the_runs_table_in_the_model_training_view(mlflow_server, tmp_path):
    from splatflow import tracking

    uri = mlflow_server.url
    cl = tracking.client(uri)
    exp = tracking.experiment_id(cl, uri=uri)
    values = {"evaluate.psnr": 26.106, "evaluate.ssim": 0.7784, "evaluate.lpips_alex": 0.2468,
              "evaluate.gaussians": 11981, "train.train_seconds": 30.8}
    run = cl.create_run(exp, run_name="demo-first", tags={"splatflow.scene": "demo"})
    for k, v in values.items():
        cl.log_metric(run.info.run_id, k, v)
    cl.log_metric(run.info.run_id, "evaluate.fps", 154.0)  # not a headline: no column of its own
    cl.set_terminated(run.info.run_id, "FINISHED")

    url = tracking.experiment_ui_url(exp, uri)
    assert "workflowType=machine_learning" in url
    shot = tmp_path / "runs.png"
    dom = _chromium.dump_dom_until(url, lambda d: "demo-first" in d, timeout_s=300, size=(1600, 900))
    text = _text(dom)
    assert "demo-first" in text and "Run Name" in text, text[-2000:]  # the runs table, with the run
    assert "Model training" in text  # the model-training view
    assert "Detect issues" not in text and "Judges" not in text  # not the GenAI experiment page
    img = _chromium.screenshot_until(url, shot, lambda im: im.std() > 10, timeout_s=120, size=(1600, 900))
    assert img.std() > 10  # a drawn page, not a blank one

    page = _chromium.dump_dom_until(tracking.run_ui_url(exp, run.info.run_id, uri),
                                    lambda d: "demo-first" in d and "evaluate.psnr" in d, timeout_s=300)
    text = _text(page)
    assert "demo-first" in text and "evaluate.psnr" in text
    assert "Evaluation runs" not in text and "Detect issues" not in text


def test_the_experiment_carries_the_runs_view_an_old_store_gets_it_too(tmp_path):
    """The view MLflow's UI opens for ``viewStateShareKey=splatflow-runs``: the scene and the headline metrics as
    columns, in the UI's own column ids; an experiment made before the view existed gets it when next used."""
    import json

    from splatflow import tracking

    uri = f"sqlite:///{tmp_path / 'ml.db'}"
    cl = tracking.client(uri)
    old = cl.create_experiment("splatflow")  # as an older splatflow left it: no tags
    assert tracking.experiment_id(cl, uri=uri) == old
    tags = cl.get_experiment(old).tags
    assert tags[tracking.EXPERIMENT_KIND_TAG] == tracking.EXPERIMENT_KIND
    view = json.loads(tags[tracking.VIEW_TAG])
    assert view["selectedColumns"] == ["tags.`splatflow.scene`", "metrics.`evaluate.psnr`", "metrics.`evaluate.ssim`",
                                       "metrics.`evaluate.lpips_alex`", "metrics.`evaluate.gaussians`",
                                       "metrics.`train.train_seconds`"]
    assert view["orderByKey"] == "attributes.start_time" and view["orderByAsc"] is False
    url = tracking.experiment_ui_url(old, "http://127.0.0.1:5000")
    assert url == (f"http://127.0.0.1:5000/#/experiments/{old}?viewStateShareKey={tracking.VIEW_KEY}"
                   "&workflowType=machine_learning")
