"""Per-scene settings (base.scenes.<name>.params): applied to that scene only, checked like params.yaml, seen by
DVC (a change reruns only that scene's stages) and logged to MLflow as the scene run's effective params."""

import json
import re
from pathlib import Path

import pytest
import yaml

from splatflow.pipeline.config import ConfigError, load_params, params_from_dict
from tests._project import BIN, TINY_SCENE, dvc, make_project, project_env, run

pytestmark = pytest.mark.slow  # runs the pipeline through DVC

REPO = Path(__file__).resolve().parents[1]


def _raw(**scene_b_params) -> dict:
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["base"]["scenes"] = {"a": {"source": "raw/a"}, "b": {"source": "raw/b", "params": scene_b_params}}
    return raw


def test_overrides_apply_to_their_scene_only():
    p = params_from_dict(_raw(train={"max_steps": 1500, "densify": {"budget_multiplier": 8}}, prune={"phases": 2}))
    a, b = p.for_scene("a"), p.for_scene("b")
    assert (b.train.max_steps, b.train.densify.budget_multiplier, b.prune.phases) == (1500, 8.0, 2)
    assert (a.train.max_steps, a.train.densify.budget_multiplier, a.prune.phases) == \
        (p.train.max_steps, p.train.densify.budget_multiplier, p.prune.phases)
    # nested mappings merge key by key: the rest of train.densify is the file's
    assert b.train.densify.max_gaussians == p.train.densify.max_gaussians
    assert b.train.lr == p.train.lr and b.evaluate == p.evaluate
    assert b.base == p.base  # the scene list and its entries are unchanged


def test_lists_are_replaced_whole():
    res = [{"factor": 0.5, "start_fraction": 0.0}, {"factor": 1.0, "start_fraction": 0.5}]
    b = params_from_dict(_raw(train={"resolution": res})).for_scene("b")
    assert [ph.factor for ph in b.train.resolution] == [0.5, 1.0]


@pytest.mark.parametrize("over, key", [
    ({"train": {"max_stepz": 10}}, "train.max_stepz"),
    ({"train": {"max_steps": "many"}}, "train.max_steps"),
    ({"train": {"max_steps": 0}}, "train.max_steps"),
    ({"train": {"densify": {"budget_multiplier": -1}}}, "train.densify.budget_multiplier"),
    ({"prune": {"phases": 99}}, "prune.phases"),
    ({"train": {"densify": {"strategy": "magic"}}}, "train.densify.strategy"),
    ({"base": {"seed": 3}}, "'base'"),
    ({"train": 5}, "train"),
])
def test_invalid_overrides_name_the_scene_and_the_key(over, key):
    with pytest.raises(ConfigError) as e:
        params_from_dict(_raw(**over))  # refused on load, before any stage runs
    msg = str(e.value)
    assert "scene 'b'" in msg and "base.scenes.b.params" in msg and key in msg


def test_params_must_be_a_mapping_and_unknown_scene_is_refused():
    raw = _raw()
    raw["base"]["scenes"]["b"]["params"] = [1, 2]
    with pytest.raises(ConfigError, match="base.scenes.b.params"):
        params_from_dict(raw)
    with pytest.raises(ConfigError, match="add-scene"):
        params_from_dict(_raw()).for_scene("c")


def test_repo_params_scenes_load():
    p = load_params(REPO / "params.yaml")
    for name in p.base.scenes:
        p.for_scene(name)


def _ran(output: str) -> list[str]:
    return re.findall(r"Running stage '([^']+)'", output)


def test_dvc_reruns_only_the_scene_whose_override_changed_and_mlflow_logs_effective_params(tmp_path):
    from splatflow import tracking
    from splatflow.scene.synthetic import write_scene

    root = make_project(tmp_path / "proj", scene="a")
    write_scene(root / "data/raw/b", progress=False, **dict(TINY_SCENE, seed=1))
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["base"]["scenes"]["a"]["params"] = {"split": {"every_n": 4}}
    params["base"]["scenes"]["b"] = {"source": "data/raw/b/images", "ground_truth": "data/raw/b/ground_truth"}
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    run(["git", "add", "-A"], root)
    run(["git", "commit", "-qm", "two scenes"], root)

    db = f"sqlite:///{root / 'mlflow.db'}"
    env = dict(project_env(), SPLATFLOW_TRACKING="on", MLFLOW_TRACKING_URI=db)
    first = run([str(BIN / "dvc"), "repro", "split@a", "split@b"], root, env=env)
    assert sorted(_ran(first.stdout)) == ["ingest@a", "ingest@b", "settings@a", "settings@b", "sfm@a", "sfm@b",
                                          "split@a", "split@b"]
    test_a = json.loads((root / "data/a/split.json").read_text())["test"]
    test_b = json.loads((root / "data/b/split.json").read_text())["test"]
    assert (len(test_a), len(test_b)) == (3, 2)  # every 4th of 12 views for a, every 8th for b

    cl = tracking.client(db)
    exps = [e.experiment_id for e in cl.search_experiments()]
    for scene, every_n in (("a", "4"), ("b", "8")):
        runs = cl.search_runs(exps, filter_string=f"tags.`splatflow.scene` = '{scene}'")
        assert len(runs) == 1
        assert runs[0].data.params["split.every_n"] == every_n  # the effective value this scene ran with
    runs_a = cl.search_runs(exps, filter_string="tags.`splatflow.scene` = 'a'")
    assert runs_a[0].data.params["base.scenes.a.params.split.every_n"] == "4"

    # settings runs in every repro (it checks the sources and params.yaml first) and rewrites identical files
    assert sorted(_ran(dvc(root, "repro", "split@a", "split@b").stdout)) == ["settings@a", "settings@b"]

    params["base"]["scenes"]["a"]["params"] = {"split": {"every_n": 6}}
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    assert json.loads(dvc(root, "status", "split@b", "--json").stdout) == {}
    # the entry is a param of the settings stage (split@a's own status changes once that has rewritten its file)
    assert "base.scenes.a" in dvc(root, "status", "split@a", "--with-deps").stdout
    third = dvc(root, "repro", "split@a", "split@b")
    # only the stage whose section changed (ingest and SfM of scene a used to rerun too: every stage declared the
    # whole entry), after the settings stage that writes each stage's share of it
    assert sorted(_ran(third.stdout)) == ["settings@a", "settings@b", "split@a"]
    assert len(json.loads((root / "data/a/split.json").read_text())["test"]) == 2  # views 0 and 6
    assert json.loads((root / "data/b/split.json").read_text())["test"] == test_b

    # a scene's own export settings rerun none of its upstream stages
    params["base"]["scenes"]["a"]["params"] = {"split": {"every_n": 6}, "export": {"formats": ["spz"]}}
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    assert sorted(_ran(dvc(root, "repro", "split@a", "split@b").stdout)) == ["settings@a", "settings@b"]
    assert json.loads((root / "data/a/settings/export.json").read_text())["params"] == {"export": {"formats": ["spz"]}}
    # its source, masks or resolution (the entry outside params) still concern every stage
    params["base"]["scenes"]["a"]["resolution"] = {"downscale": 2}
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    assert sorted(_ran(dvc(root, "repro", "split@a").stdout)) == ["ingest@a", "settings@a", "sfm@a", "split@a"]
