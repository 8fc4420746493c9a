"""Train/test split of the registered images.

The standard protocol of the novel-view-synthesis literature (Mip-NeRF 360, Barron et al., CVPR 2022; 3D Gaussian
Splatting, Kerbl et al., SIGGRAPH 2023): sort the images by name and hold out every 8th one, starting with the
first (``index % 8 == 0``). Keeping this exact rule is what makes our PSNR/SSIM/LPIPS comparable with published
tables. The ``fraction`` rule holds out ``round(test_fraction * n)`` views spread evenly over the sorted list, for
small captures where every 8th image would leave too few (or too many) test views. ``split.test_names`` names the
test views instead (e.g. the hold-out of another tool, for a like-for-like comparison); it replaces the rule.
SfM sees every image; only the training loss must never see a test view.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from splatflow.pipeline.config import SplitConfig
from splatflow.pipeline.errors import UserError
from splatflow.scene.dataset import load_scene

__all__ = ["split_names", "registered_names", "write_split"]


def split_names(names: list[str], cfg: SplitConfig) -> dict:
    """``{"train": [...], "test": [...], "rule": str}`` for image ``names`` (sorted here; order does not matter)."""
    ordered = sorted(set(names))
    n = len(ordered)
    if n < 2:
        raise UserError(f"{n} registered image(s): a train/test split needs at least 2")
    if cfg.test_names is not None:
        test_idx = {ordered.index(x) for x in _named(ordered, cfg.test_names)}
        rule = f"test_names: {len(test_idx)} named test views (split.test_names)"
    elif cfg.rule == "every_nth":
        test_idx = set(range(0, n, cfg.every_n))
        rule = f"every_nth: sorted by name, index % {cfg.every_n} == 0 is test"
    elif cfg.rule == "fraction":
        n_test = min(n - 1, max(1, int(round(cfg.test_fraction * n))))
        # Evenly spaced over the sorted list, the first view included (as in the every_nth rule).
        test_idx = {int(i) for i in np.floor(np.arange(n_test) * n / n_test)}
        rule = f"fraction: {n_test} of {n} evenly spaced views (test_fraction {cfg.test_fraction:g}) are test"
    else:  # pragma: no cover - the config loader only admits the two rules
        raise ValueError(f"unknown split rule {cfg.rule!r}")
    if len(test_idx) >= n:
        what = "split.test_names names every image" if cfg.test_names is not None else \
            f"split rule {cfg.rule} would put all {n} images in test; raise split.every_n"
        raise UserError(f"{what}: training needs at least one view")
    return {"train": [x for i, x in enumerate(ordered) if i not in test_idx],
            "test": [x for i, x in enumerate(ordered) if i in test_idx],
            "rule": rule}


def _named(ordered: list[str], wanted: tuple[str, ...]) -> list[str]:
    """The registered names ``wanted`` refers to: exact names, or a stem that one image has (``0005`` or
    ``0005.png`` for ``0005.jpg``: ingest may change the extension). UserError naming the unknown ones."""
    by_stem: dict[str, list[str]] = {}
    for x in ordered:
        by_stem.setdefault(Path(x).stem, []).append(x)
    found, unknown = [], []
    for w in wanted:
        if w in ordered:
            found.append(w)
            continue
        same = by_stem.get(Path(w).stem if Path(w).suffix else w, [])
        (found if len(same) == 1 else unknown).append(same[0] if len(same) == 1 else w)
    if unknown:
        few = ", ".join(ordered[:5]) + (f", ... ({len(ordered)} in all)" if len(ordered) > 5 else "")
        raise UserError(f"params.yaml: split.test_names: {', '.join(map(repr, unknown[:5]))} "
                        f"{'is not a registered image' if len(unknown) == 1 else 'are not registered images'}; "
                        f"registered images are named like {few}. Use those names (an image that ingest rejected "
                        f"or SfM did not register cannot be a test view)")
    dup = sorted({x for x in found if found.count(x) > 1})
    if dup:
        raise UserError(f"params.yaml: split.test_names names {dup[0]} twice (e.g. as a name and as its stem)")
    return found


def registered_names(undistorted_dir: str | Path) -> list[str]:
    """Names of the registered images of the undistorted model (what training and evaluation can use)."""
    return [v.name for v in load_scene(undistorted_dir).views]


def write_split(undistorted_dir: str | Path, out_json: str | Path, cfg: SplitConfig) -> dict:
    """Split the registered images of ``undistorted_dir`` and write ``out_json`` atomically; returns the split."""
    split = split_names(registered_names(undistorted_dir), cfg)
    out = Path(out_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(split, indent=1) + "\n")
    os.replace(tmp, out)
    return split
