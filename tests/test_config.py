import textwrap

import pytest

from splatflow.pipeline.config import ConfigError, Params, load_params, params_from_dict


def test_repo_params_load():
    p = load_params("params.yaml")
    assert isinstance(p, Params)
    assert "demo" in p.base.scenes
    assert p.split.every_n == 8


@pytest.mark.parametrize(
    "data, key, allowed",
    [
        ({"sfm": {"matcher": "vocab_tree"}}, "sfm.matcher", "'exhaustive'"),  # would abort pycolmap: not allowed
        ({"split": {"every_m": 8}}, "split.every_m", "every_n"),  # unknown key lists the allowed keys
        ({"split": {"every_n": "8"}}, "split.every_n", "an integer"),  # wrong type
        ({"split": {"every_n": 1}}, "split.every_n", ">= 2"),  # out of range
        ({"base": {"threads": 0}}, "base.threads", ">= 1"),
        ({"ingest": {"blur_rel_threshold": 1.5}}, "ingest.blur_rel_threshold", "[0, 1)"),
        ({"sfm": {"refine_principal_point": "yes"}}, "sfm.refine_principal_point", "true or false"),
        ({"nonsense": {}}, "nonsense", "allowed keys"),
        ({"base": {"scenes": {"a b": "x"}}}, "base.scenes.a b", "letters"),
        ({"sfm": {"camera_mode": "per_rig"}}, "sfm.camera_mode", "'per_folder'"),
        ({"base": {"scenes": {"g": {"source": "x", "colmap": ""}}}}, "colmap", "sparse/0"),
        ({"base": {"scenes": {"g": {"source": "x", "colmap": 0}}}}, "base.scenes.g.colmap", "a string"),
        ({"split": {"test_names": ["a.jpg", "a.jpg"]}}, "split.test_names", "repeat"),
    ],
)
def test_bad_values_name_key_and_allowed(data, key, allowed):
    with pytest.raises(ConfigError) as e:
        params_from_dict(data)
    assert key in str(e.value)
    assert allowed in str(e.value)


def test_scene_shorthand_and_unknown_scene(tmp_path):
    f = tmp_path / "params.yaml"
    f.write_text(textwrap.dedent("""
        base:
          scenes:
            garden: raw/garden.mp4
    """))
    p = load_params(f)
    assert p.scene("garden").source == "raw/garden.mp4"
    assert p.scene("garden").ground_truth is None
    with pytest.raises(ConfigError, match="add-scene"):
        p.scene("kitchen")


def test_configs_are_frozen():
    p = params_from_dict({})
    with pytest.raises(Exception):
        p.split.every_n = 3  # type: ignore[misc]


def test_colmap_scene_and_new_defaults():
    p = params_from_dict({"base": {"scenes": {"garden": {"source": "/data/garden", "colmap": "sparse/0"}}}})
    assert p.scene("garden").colmap == "sparse/0" and p.scene("garden").ground_truth is None
    assert params_from_dict({"base": {"scenes": {"a": "x"}}}).scene("a").colmap is None
    assert p.sfm.camera_mode == "auto" and p.split.test_names is None


def test_exponent_without_dot_is_a_number(tmp_path):
    """`8e-5` is text to PyYAML (YAML 1.1) but a number to DVC's YAML 1.2 (`dvc exp run -S train.lr.means=8e-5`
    writes it so): a float field takes it; other text there is still refused."""
    f = tmp_path / "params.yaml"
    f.write_text("train:\n  lr:\n    means: 8e-5\n  densify:\n    grow_grad2d: 2E-4\n")
    p = load_params(f)
    assert p.train.lr.means == pytest.approx(8e-5)
    assert p.train.densify.grow_grad2d == pytest.approx(2e-4)
    with pytest.raises(ConfigError, match="train.lr.means"):
        params_from_dict({"train": {"lr": {"means": "8e-5x"}}})
    with pytest.raises(ConfigError, match="split.every_n"):
        params_from_dict({"split": {"every_n": "8e1"}})  # integers stay strict


def test_a_scene_key_yaml_reads_as_a_number_is_refused_with_the_fix():
    """``123:`` under base.scenes is an int to YAML: DVC then makes no stages for it, and `splatflow run 123`
    ran `dvc repro` without targets, i.e. every scene."""
    with pytest.raises(ConfigError, match=r"base.scenes.123: this key is read as the int 123, not a name.*"
                                          r"quoted \('123':\)"):
        params_from_dict({"base": {"scenes": {123: {"source": "x"}}}})
    assert "123" in params_from_dict({"base": {"scenes": {"123": {"source": "x"}}}}).base.scenes
