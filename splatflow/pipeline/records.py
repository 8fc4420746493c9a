"""A stage's result as two files: its numbers (a DVC metric) and the rest (a sidecar DVC out).

``metrics/S/<stage>.json`` holds numbers only (ints and floats, nested in groups), so that ``dvc metrics show``,
``dvc metrics diff`` and ``dvc exp show`` have a number in every cell. Everything else a stage reports -- strings
(backends, paths, reasons, protocol texts), booleans that describe a setting, lists (cameras, prune phases) and
nulls (a measure that could not be taken: its reason is beside it) -- goes under the same key path to
``metrics/S/info/<stage>.json`` (a DVC out with ``cache: false``, committed like the metrics). :func:`split` divides
a stage's dict, :func:`merge` puts the two halves back together, so a reader that wants the whole record reads
:func:`read` and sees the dict the stage returned (after JSON).

A boolean that is a measure is written by its stage as 0/1 (``fitness_poor``, ``stopped_early``); a missing measure
is omitted from the numbers and kept as null in the info (``lpips_alex`` without backbone weights, with
``protocol.lpips_null_reasons`` saying why).

``metrics/S/headline.json`` (written by the evaluate stage) repeats the headline numbers of a scene under names no
stage file uses, so DVC shows them without a path prefix: ``dvc metrics show metrics/*/headline.json`` is one row
per scene within 120 columns.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from splatflow.pipeline.errors import UserError
from splatflow.pipeline.paths import ScenePaths

#: ``metrics/S/headline.json``: name -> (stage, key in ``metrics/S/<stage>.json``). The names are unique among all
#: metrics and params, so ``dvc exp show`` lists them unprefixed (a name two files share is shown as
#: ``<file>:<name>``). LPIPS is the AlexNet variant on [-1, 1] (gsplat, nerfstudio); absent without its weights.
HEADLINE = {
    "test_psnr": ("evaluate", "psnr"),
    "test_ssim": ("evaluate", "ssim"),
    "test_lpips": ("evaluate", "lpips_alex"),
    "gaussians_final": ("evaluate", "gaussians"),
    "train_s": ("train", "train_seconds"),
}
HEADLINE_FILE = "headline.json"


class Info(dict):
    """A mapping that goes to the info file whole, numbers included: counts keyed by data (``image_sizes``:
    ``{"320x240": 36}``, ``rejected_by_reason``), which would be one DVC column per distinct key."""


def is_number(value) -> bool:
    """An int or a finite float (not a bool): what a metrics file may hold."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(float(value)))


def _plain(value):
    """numpy/torch scalars as Python numbers; NaN/Inf as None (JSON has neither; DVC and MLflow choke on them)."""
    if hasattr(value, "item") and callable(value.item) and not isinstance(value, (dict, list, tuple, str)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def split(record: dict) -> tuple[dict, dict]:
    """``record`` -> ``(numbers, info)``: the numbers (nested dicts kept as groups) and everything else, each under
    its own key path. Empty groups are left out of either side."""
    numbers: dict = {}
    info: dict = {}
    for key, value in (record or {}).items():
        key = str(key)
        value = _plain(value)
        if isinstance(value, Info):
            info[key] = _jsonable(value)
        elif isinstance(value, dict):
            n, i = split(value)
            if n:
                numbers[key] = n
            if i or not n and not value:
                info[key] = i
        elif is_number(value):
            numbers[key] = value
        else:
            info[key] = _jsonable(value)
    return numbers, info


def _jsonable(value):
    value = _plain(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def merge(numbers: dict, info: dict) -> dict:
    """The two halves of :func:`split` as one dict (groups merged key by key)."""
    out = dict(info or {})
    for key, value in (numbers or {}).items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(value, out[key])
        else:
            out[key] = value
    return out


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)


def write(paths: ScenePaths, stage: str, record: dict) -> tuple[Path, Path]:
    """Write one stage's record, once: its numbers to ``metrics/S/<stage>.json`` and the rest to
    ``metrics/S/info/<stage>.json`` (both atomically; the info file is written even when empty: a DVC out)."""
    numbers, info = split(record)
    _write_json(paths.metrics_json(stage), numbers)
    _write_json(paths.info_json(stage), info)
    return paths.metrics_json(stage), paths.info_json(stage)


def write_headline(paths: ScenePaths, stages: dict[str, dict]) -> Path:
    """``metrics/S/headline.json`` from the stages' numbers (``{"evaluate": {...}, "train": {...}}``); a headline
    number a stage lacks (LPIPS without its weights) is left out."""
    data = {}
    for name, (stage, key) in HEADLINE.items():
        value = _plain((stages.get(stage) or {}).get(key))
        if is_number(value):
            data[name] = value
    out = paths.metrics_dir / HEADLINE_FILE
    _write_json(out, data)
    return out


def _read(path: Path, scene: str) -> dict:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: not readable as JSON ({e}); rerun the stage that writes it "
                        f"(`splatflow run {scene} --force`)") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: not a JSON object; rerun the stage that writes it (`splatflow run {scene} "
                        "--force`)")
    return data


def read_numbers(paths: ScenePaths, stage: str) -> dict:
    """``metrics/S/<stage>.json`` (``{}`` when the stage has not run)."""
    return _read(paths.metrics_json(stage), paths.scene)


def read_info(paths: ScenePaths, stage: str) -> dict:
    """``metrics/S/info/<stage>.json`` (``{}`` when absent)."""
    return _read(paths.info_json(stage), paths.scene)


def read(paths: ScenePaths, stage: str) -> dict:
    """The whole record of a stage: its numbers and its info merged (``{}`` when the stage has not run)."""
    return merge(read_numbers(paths, stage), read_info(paths, stage))


def stage_metric_files(paths: ScenePaths) -> list[Path]:
    """The stages' metrics files of a scene (``metrics/S/<stage>.json``; the headline file repeats some of their
    numbers and is left out), sorted by name."""
    d = paths.metrics_dir
    return sorted(f for f in d.glob("*.json") if f.name != HEADLINE_FILE) if d.is_dir() else []
