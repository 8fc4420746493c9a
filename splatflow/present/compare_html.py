"""``splatflow compare RUN_A RUN_B --html OUT``: two MLflow runs side by side, to judge a change by looking.

One self-contained page (images as ``data:`` URIs): the headline metrics with their deltas, the params that differ,
both runs' training curves on one plot per quantity (the live ``train/<name>`` step metrics; a sentence says why a
run has none), every other final metric with its delta, and each test view
both runs rendered, next to each other with the ground truth (the ``data/<scene>/renders/<view>.png`` triptychs
logged by the evaluate stage: render | ground truth | error map).
"""

from __future__ import annotations

import base64
import html
import io
import math
import tempfile
from pathlib import Path

import numpy as np

from splatflow import tracking
from splatflow.pipeline.errors import UserError

CURVES = ("loss", "psnr", "gaussians")


def _fig_uri(fig) -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _img_uri(arr: np.ndarray) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _label(run) -> str:
    return f"{run.info.run_name or ''} [{run.info.run_id[:8]}]"


def _curves(cl, runs) -> str | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hist = {(r.info.run_id, k): cl.get_metric_history(r.info.run_id, f"train/{k}") for r in runs for k in CURVES}
    if not any(hist.values()):
        return None
    fig, axes = plt.subplots(1, len(CURVES), figsize=(4.2 * len(CURVES), 3.2))
    for ax, k in zip(axes, CURVES):
        for i, r in enumerate(runs):
            h = sorted(hist[(r.info.run_id, k)], key=lambda m: m.step)
            if h:
                ax.plot([m.step for m in h], [m.value for m in h], lw=1.1, color=f"C{i}", label=_label(r))
        ax.set_title(f"train/{k}", fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    return _fig_uri(fig)


def _renders(cl, run, scene: str, tmp: Path) -> dict[str, np.ndarray]:
    from PIL import Image

    folder = f"data/{scene}/renders"
    out = {}
    try:
        arts = cl.list_artifacts(run.info.run_id, folder)
    except Exception:  # noqa: BLE001 - a run without renders shows none
        return out
    for a in arts:
        if a.is_dir or not a.path.endswith(".png"):
            continue
        local = cl.download_artifacts(run.info.run_id, a.path, str(tmp / run.info.run_id))
        out[Path(a.path).stem] = np.asarray(Image.open(local).convert("RGB"))
    return out


def _fmt(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    return html.escape(str(v))


def write_compare_html(run_a: str, run_b: str, out: str | Path, uri: str | None = None) -> Path:
    """Write the side-by-side page of two runs to ``out``; returns its path."""
    cl = tracking.client(uri)
    try:
        runs = [cl.get_run(run_a), cl.get_run(run_b)]
    except Exception as e:  # noqa: BLE001
        raise UserError(f"cannot read run {run_a} or {run_b} from {uri or tracking.tracking_uri()}: {e} "
                        f"(`splatflow runs list` shows run ids)") from e
    df = tracking.compare([run_a, run_b], uri)
    labels = [_label(r) for r in runs]
    param_rows, headline_rows, metric_rows = [], [], []
    for (kind, key), row in df.iterrows():
        a, b = row.iloc[0], row.iloc[1]
        if kind == "param":
            param_rows.append(f"<tr><th>{html.escape(key)}</th><td>{_fmt(a)}</td><td>{_fmt(b)}</td></tr>")
        else:  # headline and other final metrics; the live curves are plotted below
            d = row.get("delta")
            cls = "" if d is None or (isinstance(d, float) and math.isnan(d)) or d == 0 else (" class=up" if d > 0
                                                                                              else " class=down")
            (headline_rows if kind == "headline" else metric_rows).append(
                f"<tr><th>{html.escape(key)}</th><td>{_fmt(a)}</td><td>{_fmt(b)}</td><td{cls}>{_fmt(d)}</td></tr>")
    curves = _curves(cl, runs)
    notes = [(letter, tracking.curve_note(cl, r)) for letter, r in zip("AB", runs)]
    curve_notes = "".join(f"<p class=note>{letter} has no training curve: {html.escape(note)}.</p>"
                          for letter, note in notes if note)
    scenes = [r.data.tags.get("splatflow.scene") for r in runs]
    views_html = []
    with tempfile.TemporaryDirectory() as tmp:
        ra = _renders(cl, runs[0], scenes[0], Path(tmp)) if scenes[0] else {}
        rb = _renders(cl, runs[1], scenes[1], Path(tmp)) if scenes[1] else {}
        for name in sorted(set(ra) & set(rb)):
            a, b = ra[name], rb[name]
            wa, wb = a.shape[1] // 3, b.shape[1] // 3
            if a.shape[0] != b.shape[0]:
                continue  # different resolutions: not the same view to compare pixel by pixel
            gt = a[:, wa: 2 * wa]
            row = np.concatenate([a[:, :wa], b[:, :wb], gt], axis=1)
            views_html.append(f'<figure><img alt="{html.escape(name)}" src="{_img_uri(row)}"><figcaption>'
                              f"{html.escape(name)}: {html.escape(labels[0])} | {html.escape(labels[1])} | ground "
                              f"truth</figcaption></figure>")
    page = f"""<!doctype html><html lang="en"><head><meta charset="utf-8"><title>splatflow compare</title>
<style>body{{font:14px/1.45 system-ui,sans-serif;margin:0;background:#f6f7f9;color:#1d232a}}
main{{max-width:1280px;margin:0 auto;padding:18px 22px 60px}}h2{{font-size:17px;border-bottom:1px solid #d8dde3}}
table{{border-collapse:collapse;background:#fff}}th,td{{padding:3px 10px;border-bottom:1px solid #eceff2;
text-align:left}}td{{font-variant-numeric:tabular-nums}}.up{{color:#1a7f37}}.down{{color:#c62828}}
figure{{margin:0 0 14px}}img{{max-width:100%;border:1px solid #e1e5ea}}figcaption{{font-size:12px;color:#5b6670}}
.note{{color:#8a5a00}}
</style></head><body><main>
<h1>splatflow compare</h1>
<p>A = {html.escape(labels[0])} (scene {html.escape(str(scenes[0]))}), B = {html.escape(labels[1])}
(scene {html.escape(str(scenes[1]))}).</p>
<h2>Headline metrics (delta = B - A)</h2>
<table id="headline"><tr><th></th><th>A</th><th>B</th><th>delta</th></tr>{''.join(headline_rows)}</table>
<h2>Params that differ</h2>
{f'<table id="params"><tr><th></th><th>A</th><th>B</th></tr>{"".join(param_rows)}</table>' if param_rows
 else '<p id="params">every param is equal</p>'}
<h2>Training curves</h2>
{f'<img alt="training curves" src="{curves}">' if curves else ''}{curve_notes}
<h2>Other final metrics (delta = B - A)</h2>
<table id="metrics"><tr><th></th><th>A</th><th>B</th><th>delta</th></tr>{''.join(metric_rows)}</table>
<h2>Test views: A | B | ground truth</h2>
{''.join(views_html) or '<p>no test view rendered by both runs (evaluate logs data/S/renders)</p>'}
</main></body></html>
"""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")
    return out
