"""DVC owns the graph: a second `dvc repro` does nothing, and a param change reruns only the stage that reads it."""

import json
import re

import yaml

from tests._project import dvc, make_project


def _ran(output: str) -> list[str]:
    return re.findall(r"Running stage '([^']+)'", output)


def test_repro_twice_then_split_param_reruns_only_split(tmp_path):
    root = make_project(tmp_path / "proj")
    first = dvc(root, "repro", "split@tiny")
    assert _ran(first.stdout) == ["settings@tiny", "ingest@tiny", "sfm@tiny", "split@tiny"]
    # the folders a capture leaves empty by design hold a note saying why, so DVC has nothing to warn about (it
    # printed "WARNING: 'data/tiny/images_2' is empty." for each of them at every stage)
    assert "is empty" not in first.stdout + first.stderr, first.stderr
    for folder in ("images_2", "images_4", "images_8", "masks"):
        assert [p.name for p in (root / "data/tiny" / folder).iterdir()] == ["README.txt"]
    assert "no masks" in (root / "data/tiny/masks/README.txt").read_text()

    ingest = json.loads((root / "metrics/tiny/ingest.json").read_text())
    sfm = json.loads((root / "metrics/tiny/sfm.json").read_text())
    split = json.loads((root / "data/tiny/split.json").read_text())
    assert ingest["images_kept"] == 12
    assert sfm["images_registered"] == 12
    assert len(split["test"]) == 2 and len(split["train"]) == 10  # indices 0 and 8 of 12 sorted names

    second = dvc(root, "repro", "split@tiny")
    # settings always runs (about a second: it checks the source and the whole params.yaml before DVC removes any
    # output); it rewrites identical files, so nothing after it reruns
    assert _ran(second.stdout) == ["settings@tiny"]

    params = yaml.safe_load((root / "params.yaml").read_text())
    params["split"]["every_n"] = 4
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    third = dvc(root, "repro", "split@tiny")
    assert _ran(third.stdout) == ["settings@tiny", "split@tiny"]
    assert len(json.loads((root / "data/tiny/split.json").read_text())["test"]) == 3
