"""Train/test split rules and the split stage's file."""

import json

import pytest

from splatflow.pipeline.config import SplitConfig
from splatflow.pipeline.errors import UserError
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


def test_test_names_pick_exactly_the_named_views_and_replace_the_rule():
    names = [f"{i:04d}.jpg" for i in range(20)]
    split = split_names(names, SplitConfig(test_names=("0005.jpg", "0013.jpg")))
    assert split["test"] == ["0005.jpg", "0013.jpg"]  # not every 8th: 0000, 0008, 0016 train
    assert split["train"] == [n for n in names if n not in ("0005.jpg", "0013.jpg")]
    assert split["rule"].startswith("test_names")
    # ingest may have changed the extension (0005.png -> 0005.jpg): a unique stem still names the view
    assert split_names(names, SplitConfig(test_names=("0005.png", "0007")))["test"] == ["0005.jpg", "0007.jpg"]


def test_unknown_or_all_test_names_are_clear_errors():
    names = [f"{i:04d}.jpg" for i in range(12)]
    with pytest.raises(UserError) as e:
        split_names(names, SplitConfig(test_names=("0005.jpg", "IMG_9999.jpg")))
    msg = str(e.value)
    assert "split.test_names" in msg and "'IMG_9999.jpg'" in msg and "0000.jpg" in msg and "12 in all" in msg
    assert "0005.jpg'" not in msg  # only the unknown name is reported
    with pytest.raises(UserError, match="every image"):
        split_names(names[:2], SplitConfig(test_names=("0000.jpg", "0001.jpg")))


def test_test_names_are_validated_by_the_config_loader():
    from splatflow.pipeline.config import ConfigError, params_from_dict

    p = params_from_dict({"split": {"test_names": ["0005.jpg"]}})
    assert p.split.test_names == ("0005.jpg",)
    assert params_from_dict({"split": {"test_names": None}}).split.test_names is None
    for bad, match in (([], "non-empty"), (["a.jpg", "a.jpg"], "repeat"), ("a.jpg", "split.test_names"),
                       ([3], r"split.test_names\[0\]")):
        with pytest.raises(ConfigError, match=match):
            params_from_dict({"split": {"test_names": bad}})
