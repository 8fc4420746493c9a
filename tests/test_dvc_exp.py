"""``dvc exp`` as users run it, end to end on a tiny scene: ``dvc exp run -S``, ``dvc exp show``,
``dvc metrics diff``, ``dvc exp apply``; the experiment's MLflow run carries its name and its overrides."""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml

from tests._project import BIN, make_project, project_env, run

SCENE = "tiny"
pytestmark = pytest.mark.slow


def _dvc(root, *args, env):
    return run([str(BIN / "dvc"), *args], root, env=env)


def test_dvc_exp_run_show_diff_apply_and_the_mlflow_run(tmp_path):
    root = make_project(tmp_path / "proj", overrides={
        "base": {"threads": 1},
        "train": {"max_steps": 30, "progress": False, "early_stop": {"enabled": False}},
        "prune": {"phases": 1, "finetune_steps": 10, "progress": False, "val_views": 2, "score_rounds": 1,
                  "min_train_views": 0},
        "evaluate": {"lpips_variants": ["lpips_alex"]},
    })
    env = project_env()
    env.update({"SPLATFLOW_TRACKING": "on", "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}"})
    env.pop("MLFLOW_RUN_ID", None)
    # the project's own .gitignore (copied by make_project): metrics/ is committed, or `dvc exp show` and
    # `dvc metrics diff` find no metrics for other commits and experiments
    assert run(["git", "check-ignore", "-q", f"metrics/{SCENE}/train.json"], root, check=False).returncode == 1
    # the report stage needs the viewer bundle built by `make web` (npm), which is not what this tests: without it
    # in this project's dvc.yaml, everything below runs the whole graph as a user would
    graph = yaml.safe_load((root / "dvc.yaml").read_text())
    graph["stages"].pop("report", None)
    (root / "dvc.yaml").write_text(yaml.safe_dump(graph, sort_keys=False))
    _dvc(root, "repro", env=env)  # the baseline, committed as a user would
    run(["git", "add", "-A"], root)
    run(["git", "commit", "-qm", "baseline"], root)

    p = _dvc(root, "exp", "run", "-n", "short", "-S", "train.max_steps=20", env=env)
    assert "Running stage 'train@tiny'" in p.stdout and "Running stage 'ingest@tiny'" not in p.stdout, p.stdout
    assert json.loads((root / "metrics" / SCENE / "train.json").read_text())["steps"] == 20

    show = json.loads(_dvc(root, "exp", "show", "--json", env=env).stdout)
    exps = [e for base in show for e in (base.get("experiments") or [])]
    names = {run_["name"]: run_ for e in exps for run_ in e.get("revs", [])}
    assert "short" in names, show
    data = names["short"]["data"]
    assert data["params"]["params.yaml"]["data"]["train"]["max_steps"] == 20
    assert data["metrics"][f"metrics/{SCENE}/train.json"]["data"]["steps"] == 20

    diff = json.loads(_dvc(root, "metrics", "diff", "--json", env=env).stdout)  # HEAD (baseline) vs workspace
    steps = diff[f"metrics/{SCENE}/train.json"]["steps"]
    assert steps["old"] == 30 and steps["new"] == 20

    from splatflow import tracking

    cl = tracking.client(f"sqlite:///{root / 'mlflow.db'}")
    exp_ids = [e.experiment_id for e in cl.search_experiments()]
    runs = cl.search_runs(exp_ids, filter_string="tags.`dvc.exp.name` = 'short'")
    assert len(runs) == 1, [r.data.tags for r in runs]
    r = runs[0]
    assert r.info.run_name == f"{SCENE}-short" and r.info.status == "FINISHED"
    assert r.data.tags["splatflow.overrides"] == "train.max_steps=20"
    assert r.data.tags["dvc.exp.baseline"] == run(["git", "rev-parse", "HEAD"], root).stdout.strip()
    assert r.data.params["train.max_steps"] == "20" and r.data.metrics["train.steps"] == 20
    base_runs = cl.search_runs(exp_ids, filter_string="attributes.status = 'FINISHED'")
    assert any("dvc.exp.name" not in b.data.tags for b in base_runs)  # the baseline's run: no experiment tags

    # back to the baseline, then apply the experiment: its params and results return to the workspace
    run(["git", "checkout", "--", "."], root)
    _dvc(root, "checkout", "--force", env=env)
    assert yaml.safe_load((root / "params.yaml").read_text())["train"]["max_steps"] == 30
    assert json.loads((root / "metrics" / SCENE / "train.json").read_text())["steps"] == 30
    _dvc(root, "exp", "apply", "short", env=env)
    assert yaml.safe_load((root / "params.yaml").read_text())["train"]["max_steps"] == 20
    assert json.loads((root / "metrics" / SCENE / "train.json").read_text())["steps"] == 20
    status = subprocess.run([str(BIN / "dvc"), "status"], cwd=root, env=env, capture_output=True, text=True)
    # (the settings stage runs in every repro: DVC lists it as "always changed", which is no change of results)
    rest = [ln for ln in status.stdout.splitlines() if ln.strip() and not ln.startswith("settings@")
            and ln.strip() != "always changed"]
    assert not rest or "up to date" in status.stdout.lower(), status.stdout
