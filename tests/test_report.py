"""The per-scene report: a real `dvc repro` of a tiny scene writes reports/tiny/index.html, and headless Chromium,
opening that one file from disk with every network lookup failing, must show the splat in the embedded viewer
(at the first test camera it must look like our own rasterizer's render of that view), every image the page
references must exist, and every number it shows must equal the metrics JSON it came from.
"""

from __future__ import annotations

import base64
import io
import shutil
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from splatflow.pipeline.paths import ScenePaths
from splatflow.present.report import BACKGROUND, preview_subset
from tests import _chromium
from tests._project import stage_record

pytestmark = pytest.mark.slow


class _Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.imgs, self.links, self.metrics, self.viewer = [], [], [], {}
        self._metric = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "img":
            self.imgs.append(a.get("src", ""))
        elif tag == "a" and a.get("href"):
            self.links.append(a["href"])
        elif a.get("data-metric"):
            self._metric = [a["data-metric"], int(a["data-digits"]), ""]
        if a.get("id") == "viewer":
            self.viewer = a

    def handle_data(self, data):
        if self._metric is not None:
            self._metric[2] += data

    def handle_endtag(self, tag):
        if self._metric is not None and tag == "span":
            self.metrics.append(tuple(self._metric))
            self._metric = None


def _parse(text: str) -> _Page:
    p = _Page()
    p.feed(text)
    return p


def _json_value(root: Path, key: str):
    stage, _, path = key.partition(".")
    value = stage_record(root, "tiny", stage)  # a measure left out of <stage>.json is null in its info file
    for part in path.split("."):
        value = value[part]
    return value


def test_report_stage_output(reconstructed):
    paths = ScenePaths("tiny", reconstructed)
    assert paths.report_html.is_file()
    m = stage_record(paths.root, paths.scene, "report")
    assert m["path"] == "reports/tiny/index.html" and m["bytes"] == paths.report_html.stat().st_size
    ev = stage_record(paths.root, paths.scene, "evaluate")
    assert m["model_gaussians"] == ev["gaussians"] == m["preview_gaussians"]  # tiny: under the preview budget
    assert m["test_views_shown"] == ev["test_views"] and m["cameras"] == 12


def test_metrics_shown_equal_the_metrics_json(reconstructed):
    page = _parse((reconstructed / "reports/tiny/index.html").read_text())
    shown = {k: (d, t) for k, d, t in page.metrics}
    for key in ("evaluate.psnr", "evaluate.ssim", "evaluate.gaussians", "evaluate.model_size_mb",
                "train.train_seconds", "train.it_per_s", "sfm.images_registered", "sfm.images_total",
                "sfm.mean_reprojection_error_px", "split.test_views", "export.files.ply.size_mb"):
        assert key in shown, f"{key} is not shown in the report"
    for key, (digits, text) in shown.items():
        value = _json_value(reconstructed, key)
        if value is None:
            assert text == "n/a", key
            continue
        got = float(text.replace("\u2009", ""))
        assert abs(got - float(value)) <= 0.5 * 10 ** -digits + 1e-12, f"{key}: shown {text}, metrics JSON {value}"


def test_every_image_and_link_exists(reconstructed):
    from PIL import Image

    report = reconstructed / "reports/tiny/index.html"
    page = _parse(report.read_text())
    n_views = len(list((reconstructed / "data/tiny/renders").glob("*.png")))
    assert len(page.imgs) == n_views + 2  # training curves, pruning curve, one triptych per test view
    for src in page.imgs:
        if src.startswith("data:"):
            header, b64 = src.split(",", 1)
            assert header in ("data:image/png;base64", "data:image/jpeg;base64"), header
            with Image.open(io.BytesIO(base64.b64decode(b64))) as im:
                im.verify()
        else:
            assert (report.parent / src).is_file(), f"image {src} does not exist"
    local = [h for h in page.links if "://" not in h]
    assert any(h.endswith("models/tiny/export/scene.ply") for h in local)  # the full model is linked
    for href in local:
        assert (report.parent / href).is_file(), f"link {href} points at nothing"


def test_report_opened_from_disk_offline_shows_the_splat(reconstructed, tmp_path):
    if _chromium.find() is None:
        pytest.skip(_chromium.SKIP_REASON)
    alone = tmp_path / "alone" / "index.html"  # the file alone: nothing beside it to load
    alone.parent.mkdir()
    shutil.copy(reconstructed / "reports/tiny/index.html", alone)
    url = alone.as_uri()

    # until the page's script has decided (under load it may not have started at the first look)
    dom = _chromium.dump_dom_until(url, lambda d: _parse(d).viewer.get("data-state") in ("ready", "error"),
                                   offline=True)
    viewer = _parse(dom).viewer
    assert viewer.get("data-state") == "ready", viewer.get("data-error", viewer)

    style = viewer["style"]
    w = int(style.split("width:")[1].split("px")[0])
    h = int(style.split("height:")[1].split("px")[0])
    bg = np.array([int(BACKGROUND[i: i + 2], 16) for i in (1, 3, 5)])

    def viewer_canvas(shot):
        # The viewer box: the rows and columns at the top of the page that are not the page's light background.
        page_bg = shot[5, 5].astype(int)
        dark = np.abs(shot.astype(int) - page_bg).sum(2) > 30
        rows = np.where(dark.sum(1) > 0.8 * w)[0]
        cols = np.where(dark.sum(0) > 0.5 * min(h, shot.shape[0] - rows[0]))[0]
        top, left = rows[0] + 2, cols[0] + 2
        return shot[top: top + h - 4, left: left + w - 4]

    def drawn_fraction(shot):
        return float((np.abs(viewer_canvas(shot).astype(int) - bg).sum(2) > 24).mean())

    shot = _chromium.screenshot_until(url, tmp_path / "report.png", lambda s: drawn_fraction(s) > 0.3, offline=True,
                                      size=(1200, 900))
    canvas = viewer_canvas(shot)
    drawn = np.abs(canvas.astype(int) - bg).sum(2) > 24
    assert drawn.mean() > 0.3, f"only {drawn.mean():.1%} of the viewer canvas differs from its background"
    assert canvas.reshape(-1, 3).std(0).mean() > 8, "the viewer canvas is uniform"

    # At the first test camera the embedded viewer must show what our rasterizer rendered for that view:
    # a wrong frame (mirrored, upside down) or camera would not correlate.
    from PIL import Image

    first = sorted((reconstructed / "data/tiny/renders").glob("*.png"))[0]
    tri = np.asarray(Image.open(first).convert("RGB"))
    ours = tri[:, : tri.shape[1] // 3]
    corr = float((_chromium.normalized_small(canvas) * _chromium.normalized_small(ours)).mean())
    flipped = float((_chromium.normalized_small(canvas[::-1]) * _chromium.normalized_small(ours)).mean())
    assert corr > 0.6 and corr > flipped + 0.3, (corr, flipped)


def test_preview_keeps_the_most_important_gaussians():
    rng = np.random.default_rng(0)
    n = 1000
    s = {"means": rng.normal(size=(n, 3)).astype(np.float32), "quats": rng.normal(size=(n, 4)).astype(np.float32),
         "scales": rng.uniform(-6, -2, (n, 3)).astype(np.float32), "opacities": rng.normal(size=n).astype(np.float32),
         "sh0": rng.normal(size=(n, 1, 3)).astype(np.float32), "shN": np.zeros((n, 3, 3), np.float32)}
    sub = preview_subset(s, 100)
    assert len(sub["means"]) == 100
    imp = np.exp(s["scales"].astype(np.float64).sum(1)) / (1 + np.exp(-s["opacities"].astype(np.float64)))
    imp_sub = np.exp(sub["scales"].astype(np.float64).sum(1)) / (1 + np.exp(-sub["opacities"].astype(np.float64)))
    assert imp_sub.min() >= np.sort(imp)[-100]
    assert preview_subset(s, n) is s


def test_missing_viewer_script_names_the_command(tmp_path, monkeypatch):
    from splatflow.present import report, webbundle
    from splatflow.pipeline.errors import UserError

    monkeypatch.setattr(webbundle, "bundle_path", lambda: tmp_path / "missing.js")
    with pytest.raises(UserError, match="make web"):
        report.build_report(ScenePaths("demo", tmp_path))


def test_training_plot_phases_of_a_capture_with_two_image_sizes():
    """A photo folder with 320x240 and 640x480 images logs each row's view size, so the size changes from row to row
    within one coarse-to-fine phase: the plot drew a dashed phase line and an overlapping size label at almost every
    row (17 "phases" for 5). Phases follow the `phase` column; a phase's label lists its sizes."""
    import pandas as pd

    from splatflow.present.report import resolution_phases

    rows = [(10, 0, "80x60"), (20, 1, "80x60"), (30, 1, "160x120"), (40, 2, "160x120"), (50, 2, "320x240"),
            (60, 2, "160x120"), (70, 2, "320x240"), (80, 3, "239x179"), (90, 3, "239x179"), (100, 3, "479x359"),
            (110, 3, "239x179"), (130, 4, "319x239"), (140, 4, "639x479"), (150, 4, "319x239")]
    df = pd.DataFrame(rows, columns=["step", "phase", "resolution"])
    assert resolution_phases(df) == [(10, 10, "80x60"), (20, 30, "80x60\n160x120"), (40, 70, "160x120\n320x240"),
                                     (80, 110, "239x179\n479x359"), (130, 150, "319x239\n639x479")]
    single = pd.DataFrame([(10, 0, "80x60"), (20, 0, "80x60"), (30, 1, "160x120")], columns=df.columns)
    assert resolution_phases(single) == [(10, 20, "80x60"), (30, 30, "160x120")]
    assert resolution_phases(single.drop(columns="phase")) == [(10, 20, "80x60"), (30, 30, "160x120")]


def test_error_map_scale_reads_as_the_maps_colours():
    """The legend beside the test views: its ramp shows the error map's colours at the errors its ticks name."""
    import re

    import torch

    from splatflow.evaluation.evaluate import error_heatmap
    from splatflow.present.report import error_scale_html, page_css

    gain = 4.0
    legend = error_scale_html(gain)
    assert 'data-max="0.25"' in legend and "evaluate.error_gain = 4" in legend
    ticks = [float(t) for t in re.findall(r'left:[0-9.]+%">([0-9.]+)<', legend)]
    assert ticks == pytest.approx([0.0, 0.25 / 3, 0.5 / 3, 0.25], rel=1e-2)
    stops = re.findall(r"#([0-9a-f]{3}) ([0-9.]+)%", page_css().split("linear-gradient", 1)[1].split(")", 1)[0])
    assert len(stops) == 4
    for colour, pct in stops:
        err = float(pct) / 100 / gain  # the mean absolute error the ramp stands for at this stop
        rgb = error_heatmap(torch.full((1, 1, 3), err), torch.zeros(1, 1, 3), gain)[0, 0].astype(int)
        want = [int(ch, 16) * 17 for ch in colour]
        assert np.abs(rgb - want).max() <= 1, (colour, pct, rgb)
