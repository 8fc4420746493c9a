"""One source of defaults: every default of the config dataclasses equals the value params.yaml gives that key.

A library call without params.yaml (a test, a bench, a notebook: ``TrainConfig()``) must train, prune and report
exactly as the pipeline does; a default that disagrees with params.yaml makes the two quietly different runs.
The comparison is generic, key by key over every section, so a new or changed setting is checked the day it
lands; a scene's own settings (``base.scenes``) have no default and are left out.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from splatflow.pipeline.config import Params, flatten, load_params, params_from_dict, section_dict

REPO = Path(__file__).resolve().parents[1]
NO_DEFAULT = ("base.scenes",)  # the scenes are the project's own, not settings with a default


def _flat(params: Params) -> dict:
    sections = {f.name: section_dict(getattr(params, f.name)) for f in dataclasses.fields(Params)}
    return {k: v for k, v in flatten(sections).items() if not k.startswith(NO_DEFAULT)}


def differences(defaults: Params, given: Params) -> list[str]:
    """``key: default X, params.yaml Y`` for every key whose two values differ."""
    a, b = _flat(defaults), _flat(given)
    missing = object()
    return [f"{k}: dataclass default {a.get(k, missing)!r}, params.yaml {b.get(k, missing)!r}"
            for k in sorted(set(a) | set(b)) if a.get(k, missing) != b.get(k, missing)]


def test_dataclass_defaults_equal_params_yaml():
    diff = differences(Params(), load_params(REPO / "params.yaml"))
    assert not diff, ("splatflow/pipeline/config.py and params.yaml disagree; change the two together (the dataclass "
                      "default is what a library call without params.yaml uses):\n" + "\n".join(diff))


def test_a_changed_value_anywhere_is_found():
    """The comparison can fail: a value changed in a nested section, or a list, is reported by its full key."""
    diff = differences(Params(), params_from_dict({"train": {"max_steps": 1234,  # default: auto
                                                             "prune_during": {"score_views": 3}},
                                                   "export": {"formats": ["ply"]}}))
    keys = [d.split(":")[0] for d in diff]
    assert keys == ["export.formats", "train.max_steps", "train.prune_during.score_views"]
