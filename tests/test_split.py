"""Train/test split rules and the split stage's file."""

import json

import pytest

from splatflow.config import SplitConfig
from splatflow.errors import UserError
from splatflow.scene.split import split_names, write_split


def test_every_8th_from_the_first_is_test_after_sorting_by_name():
    names = [f"{i:03d}.jpg" for i in range(20)][::-1]  # given in reverse: the rule sorts
    split = split_names(names, SplitConfig())
    assert split["test"] == ["000.jpg", "008.jpg", "016.jpg"]
    assert len(split["train"]) == 17 and split["train"][0] == "001.jpg"
    assert set(split["train"]).isdisjoint(split["test"])
    assert sorted(split["train"] + split["test"]) == sorted(names)
    assert "every_nth" in split["rule"] and "8" in split["rule"]


def test_every_nth_uses_the_configured_n():
    split = split_names([f"v{i}.png" for i in range(10)], SplitConfig(every_n=3))
    # Name order, not numeric order: v0 v1 v2 ... v9 sort the same here.
    assert split["test"] == ["v0.png", "v3.png", "v6.png", "v9.png"]


def test_fraction_rule_spreads_test_views_evenly():
    names = [f"{i:02d}.jpg" for i in range(20)]
    split = split_names(names, SplitConfig(rule="fraction", test_fraction=0.2))
    assert split["test"] == ["00.jpg", "05.jpg", "10.jpg", "15.jpg"]
    assert len(split["train"]) == 16
    assert split["rule"].startswith("fraction")
    # Never everything in test, never nothing in test.
    assert len(split_names(names[:3], SplitConfig(rule="fraction", test_fraction=0.01))["test"]) == 1
    assert len(split_names(names[:3], SplitConfig(rule="fraction", test_fraction=0.99))["train"]) == 1


def test_too_few_images_is_a_user_error():
    with pytest.raises(UserError, match="at least 2"):
        split_names(["a.jpg"], SplitConfig())


def test_write_split_reads_registered_images_of_a_model(tmp_path):
    """The split of a COLMAP model folder (the synthetic generator's ground truth stands in for sfm's output)."""
    pytest.importorskip("pycolmap")
    from splatflow.scene.dataset import load_scene
    from splatflow.scene.synthetic import write_scene

    scene = tmp_path / "scene"
    write_scene(scene, progress=False, n_views=10, width=48, height=32, arc_deg=60.0, n_points=300)
    out = tmp_path / "data" / "split.json"
    write_split(scene, out, SplitConfig())
    split = json.loads(out.read_text())
    assert split["test"] == ["0000.jpg", "0008.jpg"]
    assert len(split["train"]) == 8
    loaded = load_scene(scene, out)  # the loader accepts what the stage wrote
    assert [v.name for v in loaded.test_views] == split["test"]
