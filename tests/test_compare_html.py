"""`splatflow compare A B --html`: two MLflow runs side by side (params, metric deltas, curves, test views)."""

from __future__ import annotations

import base64
import io
from html.parser import HTMLParser

import numpy as np
from PIL import Image

from splatflow.present.compare_html import write_compare_html


class _Imgs(HTMLParser):
    def __init__(self):
        super().__init__()
        self.imgs = []

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            self.imgs.append(dict(attrs))


def _run(cl, exp, name, lr, psnr, color, tmp_path):
    r = cl.create_run(exp, run_name=name, tags={"splatflow.scene": "s"})
    rid = r.info.run_id
    cl.log_param(rid, "train.lr.means", str(lr))
    cl.log_param(rid, "train.max_steps", "100")
    cl.log_metric(rid, "evaluate.psnr", psnr)
    for step in range(0, 100, 10):
        cl.log_metric(rid, "train/loss", 1.0 / (step + 1) * lr * 1e4, step=step)
        cl.log_metric(rid, "train/psnr", psnr * step / 100, step=step)
    tri = np.zeros((20, 90, 3), np.uint8)
    tri[:, :30] = color  # render
    tri[:, 30:60] = 200  # ground truth
    d = tmp_path / name / "data/s/renders"
    d.mkdir(parents=True)
    Image.fromarray(tri).save(d / "0000.png")
    cl.log_artifact(rid, str(d / "0000.png"), "data/s/renders")
    return rid


def test_compare_page_shows_diffs_curves_and_both_renders(tmp_path, monkeypatch):
    from splatflow import tracking

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    cl = tracking.client(uri)
    exp = tracking.experiment_id(cl, uri=uri)
    a = _run(cl, exp, "a", 1.6e-4, 20.0, 50, tmp_path)
    b = _run(cl, exp, "b", 3.2e-4, 21.5, 150, tmp_path)
    out = write_compare_html(a, b, tmp_path / "cmp.html", uri)
    text = out.read_text()
    assert "train.lr.means" in text and "train.max_steps" not in text  # only params that differ
    assert "<th>PSNR (dB)</th><td>20</td><td>21.5</td><td class=up>1.5</td>" in text
    assert text.index('id="headline"') < text.index('id="params"') < text.index('id="metrics"')  # headline first
    assert "has no training curve" not in text
    p = _Imgs()
    p.feed(text)
    alts = [i["alt"] for i in p.imgs]
    assert alts == ["training curves", "0000"]
    view = np.asarray(Image.open(io.BytesIO(base64.b64decode(p.imgs[1]["src"].split(",", 1)[1]))).convert("RGB"))
    assert view.shape == (20, 90, 3)  # A's render | B's render | ground truth
    assert (view[:, :30] == 50).all() and (view[:, 30:60] == 150).all() and (view[:, 60:] == 200).all()


def test_a_run_without_a_curve_says_why(tmp_path, monkeypatch):
    """A batch that found a scene up to date records a run that trained nothing: the page says so, and where the
    curve is, instead of showing one curve without a word."""
    from splatflow import tracking

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    cl = tracking.client(uri)
    exp = tracking.experiment_id(cl, uri=uri)
    a = _run(cl, exp, "a", 1.6e-4, 20.0, 50, tmp_path)
    b = cl.create_run(exp, run_name="b", tags={"splatflow.scene": "s", "splatflow.skipped": "up to date",
                                              "splatflow.same_as": a}).info.run_id
    cl.log_param(b, "train.lr.means", "1.6e-4")  # the same value, written another way: not a difference
    cl.log_param(b, "train.max_steps", "100")
    cl.log_metric(b, "evaluate.psnr", 20.0)
    text = write_compare_html(a, b, tmp_path / "cmp.html", uri).read_text()
    assert f"B has no training curve: trained nothing: its stages were up to date (its results are those of run " \
           f"{a[:8]}, which has the curve)." in text
    assert "every param is equal" in text
