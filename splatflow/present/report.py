"""One self-contained HTML page per scene run: ``reports/<scene>/index.html``.

What a person needs to judge a reconstruction, readable offline from the file alone (in a browser, or as the
MLflow artifact preview): the headline metrics with the evaluation protocol named, the SfM summary, the training
curves with the resolution and blur phases marked, the pruning curve, every test view as render | ground truth |
error map, and an interactive 3D view of the exported splat.

Self-contained means: the images are embedded as ``data:`` URIs, the splat is embedded as SPZ bytes (cut to the
``report.preview_max_gaussians`` most important Gaussians when larger, the full exported files linked beside it),
and the renderer script (Spark on three.js, bundled from the npm registry by :mod:`splatflow.present.webbundle`) is
inlined. Nothing is fetched when the page opens. The page's markup and style sheet are the templates in
``templates/`` (``report.html``, ``report.css``); this module computes what fills them.

Frames: our world follows COLMAP (x right, y down, z forward) and so do the embedded SPZ coordinates (written with
``from_coordinates="none"``, i.e. unchanged). A three.js camera looks down its -z axis with +y up, so each COLMAP
camera-to-world matrix is multiplied by diag(1, -1, -1) on the camera side (:func:`three_camera_matrix`).
"""

from __future__ import annotations

import base64
import functools
import html
import io
import json
import math
import os
import string
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from splatflow.pipeline import records
from splatflow.pipeline.config import ReportConfig
from splatflow.pipeline.errors import UserError
from splatflow.formats import common
from splatflow.formats.common import sigmoid, splats_to_torch
from splatflow.formats.ply import read_ply
from splatflow.formats.splat import read_splat
from splatflow.formats.spz import read_spz, write_spz
from splatflow.pipeline.paths import ScenePaths
from splatflow.scene.fitness import fitness_warning
from splatflow.scene.cameras import camera_centers
from splatflow.scene.dataset import load_scene
from splatflow.present.webbundle import load_bundle

#: Exported formats the report and the viewer read, in order of preference (the PLY is lossless).
SPLAT_SUFFIXES = (".ply", ".spz", ".splat")
BACKGROUND = "#101418"  # the 3D viewer's clear colour (tests look for it in screenshots)


# --------------------------------------------------------------------------------------------- splat files


def read_splat_file(path: str | Path) -> tuple[dict[str, np.ndarray], int]:
    """``(numpy splats, sh_degree)`` of an exported ``.ply`` / ``.spz`` / ``.splat`` (our world frame)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such splat file")
    suffix = path.suffix.lower()
    try:
        if suffix == ".ply":
            splats, degree = read_ply(path)
        elif suffix == ".spz":
            splats, degree = read_spz(path, to_coordinates="RDF")
        elif suffix == ".splat":
            splats, degree = read_splat(path)
        else:
            raise UserError(f"{path}: not a splat file this viewer reads (use .ply, .spz or .splat)")
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - a corrupt file: say which and why
        raise UserError(f"{path}: cannot read it as a {suffix} splat file: {e}") from e
    out = common.as_numpy_splats(splats, degree)
    return out, used_sh_degree(out["shN"], int(degree))


def used_sh_degree(shN: np.ndarray, degree: int) -> int:
    """The highest SH degree up to ``degree`` with a non-zero coefficient in ``shN`` [N, K-1, 3].

    An Inria PLY always has the 45 ``f_rest`` columns of degree 3, and the export writes a model trained to a lower
    active degree (a short run: one band per ``train.sh_degree_interval`` steps) with the bands above it zeroed; the
    report and the viewer said "SH degree 3" for such a model (its .spz and its checkpoint said 0)."""
    while degree > 0 and not np.any(shN[:, degree ** 2 - 1:(degree + 1) ** 2 - 1]):
        degree -= 1
    return degree


def exported_file(paths: ScenePaths) -> Path:
    """The scene's exported splat (PLY preferred), or a clear error naming the stage that writes it."""
    for suffix in SPLAT_SUFFIXES:
        f = paths.export_dir / f"scene{suffix}"
        if f.is_file():
            return f
    raise UserError(f"scene {paths.scene!r} has no exported splat in {paths.export_dir}: run the export stage "
                    f"(`splatflow run {paths.scene}`, or `dvc repro export@{paths.scene}`)")


def importance(splats: dict[str, np.ndarray]) -> np.ndarray:
    """opacity x volume: what a Gaussian contributes to an image, for choosing which ones a preview keeps."""
    return np.exp(splats["scales"].astype(np.float64).sum(1)) * sigmoid(splats["opacities"].astype(np.float64))


def preview_subset(splats: dict[str, np.ndarray], max_gaussians: int) -> dict[str, np.ndarray]:
    """At most ``max_gaussians`` of the most important Gaussians (all of them when the model is smaller)."""
    n = len(splats["means"])
    if n <= max_gaussians:
        return splats
    keep = np.sort(np.argsort(-importance(splats), kind="stable")[:max_gaussians])
    return {k: v[keep] for k, v in splats.items()}


def spz_bytes(splats: dict[str, np.ndarray], sh_degree: int) -> bytes:
    """SPZ v3 bytes in our own (COLMAP) frame: Spark reads SPZ coordinates unchanged, the page sets the frame."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "preview.spz"
        write_spz(out, splats_to_torch(splats), sh_degree, version=3, from_coordinates="none")
        return out.read_bytes()


# --------------------------------------------------------------------------------------------- cameras


def three_camera_matrix(world_to_cam: np.ndarray) -> np.ndarray:
    """COLMAP world->camera [4, 4] -> three.js camera->world [4, 4] (camera looks down -z, +y up)."""
    c2w = np.linalg.inv(np.asarray(world_to_cam, np.float64))
    return c2w @ np.diag([1.0, -1.0, -1.0, 1.0])


@dataclass(frozen=True)
class CameraInfo:
    name: str
    split: str  # "train" | "test"
    world_to_cam: np.ndarray  # [4, 4] COLMAP
    width: int
    height: int
    fy: float
    fx: float

    @property
    def fov_y_deg(self) -> float:
        return math.degrees(2.0 * math.atan(self.height / (2.0 * self.fy)))

    @property
    def center(self) -> np.ndarray:
        return camera_centers(self.world_to_cam)


def scene_cameras(paths: ScenePaths) -> list[CameraInfo]:
    """Training and test cameras of the scene (empty when SfM or the split has not run)."""
    if not paths.split_json.exists() or not (paths.undistorted_dir / "sparse").exists():
        return []

    scene = load_scene(paths.undistorted_dir, paths.split_json)
    out = []
    for split, views in (("test", scene.test_views), ("train", scene.train_views)):
        for v in views:
            out.append(CameraInfo(v.name, split, np.asarray(v.world_to_cam, np.float64), int(v.width),
                                  int(v.height), float(v.K[1, 1]), float(v.K[0, 0])))
    return out


def camera_json(c: CameraInfo) -> dict:
    return {"name": c.name, "split": c.split, "fovY": round(c.fov_y_deg, 4), "aspect": c.width / c.height,
            "matrix": [round(float(x), 7) for x in three_camera_matrix(c.world_to_cam).flatten(order="F")]}


# --------------------------------------------------------------------------------------------- plots


def _png_data_uri(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def resolution_phases(df) -> list[tuple[int, int, str]]:
    """``(first step, last step, label)`` per resolution phase of ``plots/S/train.csv``, for the shading.

    A phase is a contiguous run of one ``phase`` value (the coarse-to-fine level). Its label is the image size it
    trained at, or every size seen in it, smallest first, one per line: a capture with images of several sizes logs
    the size of each row's view, which changes from row to row within a phase. Files without a ``phase`` column
    fall back to runs of one ``resolution`` value."""
    if "resolution" not in df.columns:
        return []
    res = df["resolution"].astype(str).tolist()
    key = df["phase"].tolist() if "phase" in df.columns else res

    def pixels(r: str) -> int:
        w, _, h = r.partition("x")
        return int(w) * int(h) if w.isdigit() and h.isdigit() else 0

    spans, start = [], 0
    for i in range(1, len(key) + 1):
        if i == len(key) or key[i] != key[start]:
            sizes = list(dict.fromkeys(res[start:i]))
            spans.append((int(df["step"].iloc[start]), int(df["step"].iloc[i - 1]),
                          "\n".join(sorted(sizes, key=pixels))))
            start = i
    return spans


def training_curves(train_csv: Path) -> str | None:
    """Loss, PSNR, Gaussian count and blur sigma against step; resolution phases shaded and labelled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    if not train_csv.exists():
        return None
    df = pd.read_csv(train_csv)
    if df.empty or "step" not in df.columns:
        return None
    fig, axes = plt.subplots(2, 2, figsize=(11, 6.4), sharex=True)
    panels = [("loss", "training loss (L1 + SSIM mix)"), ("psnr", "training PSNR (dB, current batch)"),
              ("gaussians", "Gaussians"), ("sigma", "blur sigma (px)")]
    spans = resolution_phases(df)
    for ax, (col, title) in zip(axes.flat, panels):
        for k, (a, b, label) in enumerate(spans):
            if k % 2:
                ax.axvspan(a, b, color="0.92", zorder=0)
            ax.axvline(a, color="0.6", lw=0.6, ls="--", zorder=1)
        if col in df.columns:
            ax.plot(df["step"], df[col], lw=1.1, color="C0" if col != "sigma" else "C3",
                    label="loss" if col == "loss" else None)
            if col == "loss" and "l1" in df.columns:
                ax.plot(df["step"], df["l1"], lw=0.8, color="C1", alpha=0.7, label="L1")
                ax.legend(loc="upper right", bbox_to_anchor=(1, 0.85), fontsize=8)  # below the size labels
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("step")
    top = axes[0][0]
    for a, b, label in spans:
        top.annotate(label, xy=((a + b) / 2, 0.98), xycoords=("data", "axes fraction"), ha="center",
                     va="top", fontsize=7, color="0.35")
    fig.suptitle("training (shaded/dashed: resolution phases; blur sigma falls to 0)", fontsize=11)
    fig.tight_layout()
    return _png_data_uri(fig)


def pruning_curve(prune: dict, max_drop_db: float | None) -> str | None:
    """Validation PSNR on training views against the kept fraction, one point per phase."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = prune.get("phases") or []
    before = prune.get("val_psnr_before")
    if not phases or before is None:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    xs = [1.0] + [p["keep_fraction"] for p in phases]
    ys = [before] + [p["val_psnr"] for p in phases]
    ax.plot(xs, ys, "-", color="C0", lw=1)
    ax.plot([1.0], [before], "o", color="C0", label="trained (unpruned)")
    ok = [p for p in phases if p.get("accepted")]
    bad = [p for p in phases if not p.get("accepted")]
    if ok:
        ax.plot([p["keep_fraction"] for p in ok], [p["val_psnr"] for p in ok], "o", color="C2", label="kept phase")
    if bad:
        ax.plot([p["keep_fraction"] for p in bad], [p["val_psnr"] for p in bad], "x", color="C3", ms=8,
                label="rejected phase")
    for p in phases:
        ax.annotate(f"{p['phase']}: {p['gaussians']}", (p["keep_fraction"], p["val_psnr"]), fontsize=7,
                    textcoords="offset points", xytext=(4, 4))
    if max_drop_db is not None:
        ax.axhline(before - max_drop_db, color="C3", lw=0.8, ls="--", label=f"stop floor (-{max_drop_db:g} dB)")
    ax.set_xscale("log")
    ax.invert_xaxis()
    ax.set_xlabel("kept fraction of the trained Gaussians (log)")
    ax.set_ylabel("validation PSNR (dB, training views)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _png_data_uri(fig)


def image_data_uri(path: Path, max_bytes: int = 600_000) -> str:
    """PNG as is when small, else re-encoded as JPEG (quality 92) so a report with many views stays light."""
    raw = path.read_bytes()
    if len(raw) <= max_bytes:
        return "data:image/png;base64," + base64.b64encode(raw).decode("ascii")
    from PIL import Image

    buf = io.BytesIO()
    with Image.open(path) as im:
        im.convert("RGB").save(buf, format="JPEG", quality=92)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


# --------------------------------------------------------------------------------------------- page


def _get(d: dict, dotted: str):
    for part in dotted.split("."):
        if not isinstance(d, dict) or part not in d:
            return None
        d = d[part]
    return d


def fmt_value(value: Any, digits: int) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int) or (isinstance(value, float) and digits == 0):
        return f"{int(round(value)):,}".replace(",", "\u2009")  # thin space: readable, and a test strips it
    return f"{float(value):.{digits}f}"


def _metric(metrics: dict[str, dict], key: str, digits: int, unit: str = "") -> str:
    """A value cell bound to ``metrics/<scene>/<stage>.json``: ``data-metric="<stage>.<path>"`` (tests compare);
    ``n/a`` for a measure the stage could not take (left out of that file, null in its info file)."""
    stage, _, path = key.partition(".")
    value = _get(metrics.get(stage, {}), path)
    text = fmt_value(value, digits)
    unit_html = f" <span class=unit>{html.escape(unit)}</span>" if unit and value is not None else ""
    return (f'<span class=value data-metric="{html.escape(key)}" data-digits="{digits}">{text}</span>{unit_html}')


def _row(label: str, cell: str, note: str = "") -> str:
    note_html = f"<td class=note>{note}</td>" if note else "<td></td>"
    return f"<tr><th>{html.escape(label)}</th><td>{cell}</td>{note_html}</tr>"


LPIPS_NAMES = {"lpips_vgg_01": "LPIPS (VGG, inputs [0,1]: 3DGS paper code)",
               "lpips_vgg": "LPIPS (VGG, inputs [-1,1])", "lpips_alex": "LPIPS (AlexNet, inputs [-1,1]: gsplat)"}

#: The page's HTML and CSS, with ``$name`` placeholders (:class:`string.Template`).
TEMPLATES = Path(__file__).resolve().parent / "templates"


@functools.cache
def _template(name: str) -> string.Template:
    return string.Template((TEMPLATES / name).read_text(encoding="utf-8"))


def page_css() -> str:
    """The report's style sheet (``templates/report.css``), the viewer's clear colour filled in."""
    return _template("report.css").substitute(background=BACKGROUND)


def error_scale_html(error_gain: float) -> str:
    """The colour scale of the error maps (:func:`splatflow.evaluation.evaluate.error_heatmap`: black at 0, red, yellow,
    white at 1 / ``error_gain`` and above, of the mean absolute RGB error in [0, 1]), so a colour reads as a number."""
    top = 1.0 / error_gain
    ticks = "".join(f"<span style=\"left:{100 * i / 3:.2f}%\">{top * i / 3:.3g}</span>" for i in range(4))
    return (f'<div class=errscale id=error-scale data-max="{top:.6g}"><b>error map</b> '
            f'<span class=ramp><i></i>{ticks}</span> mean |render &minus; ground truth| over R, G, B (0-1); '
            f"{top:.3g} and above is white (evaluate.error_gain = {error_gain:g})</div>")


def build_report(paths: ScenePaths, cfg: ReportConfig | None = None, *, max_psnr_drop_db: float | None = None,
                 title: str | None = None, error_gain: float = 4.0) -> dict:
    """Write ``reports/<scene>/index.html`` from the scene's stage outputs; return the report's metrics.

    ``cfg`` (params.yaml's ``report`` section; its defaults when None) sizes the embedded preview and the list of
    test views."""
    cfg = cfg if cfg is not None else ReportConfig()
    bundle = load_bundle()  # first: a missing viewer script is the one error a user must fix before anything else
    stages = ("ingest", "sfm", "split", "train", "prune", "evaluate", "export")
    metrics = {s: records.read(paths, s) for s in stages}  # numbers and texts (metrics/S/info/) of each stage
    if not metrics["evaluate"]:
        raise UserError(f"{paths.metrics_json('evaluate')} is missing: run the evaluate stage first "
                        f"(`dvc repro evaluate@{paths.scene}`)")
    model_file = exported_file(paths)
    splats, degree = read_splat_file(model_file)
    n_full = len(splats["means"])
    preview = preview_subset(splats, cfg.preview_max_gaussians)
    n_prev = len(preview["means"])
    prev_degree = min(degree, cfg.preview_sh_degree)
    spz = spz_bytes(preview, prev_degree)
    cameras = scene_cameras(paths)
    target = np.median(preview["means"], axis=0) if n_prev else np.zeros(3)
    first = cameras[0] if cameras else None
    view_w = 880
    view_h = int(round(view_w * (first.height / first.width))) if first else 560
    view_cfg = {"fileType": "spz", "background": BACKGROUND, "target": [float(x) for x in target],
                "cameras": [camera_json(c) for c in cameras]}

    root = Path(paths.root).resolve()
    report_dir = paths.report_dir.resolve()

    def rel(p: Path) -> str:
        return os.path.relpath(Path(p).resolve(), report_dir)

    m = metrics
    ev, tr, pr, sfm = m["evaluate"], m["train"], m["prune"], m["sfm"]
    lpips_rows = []
    for v in (ev.get("protocol") or {}).get("lpips", {}) or {}:
        reason = ((ev.get("protocol") or {}).get("lpips_null_reasons") or {}).get(v, "")
        lpips_rows.append(_row(LPIPS_NAMES.get(v, v), _metric(m, f"evaluate.{v}", 4),
                               html.escape(reason) if ev.get(v) is None else "lower is better"))
    protocol = ev.get("protocol") or {}
    sizes = ", ".join(protocol.get("image_sizes") or [])
    headline = "".join([
        _row("test PSNR", _metric(m, "evaluate.psnr", 2, "dB"), html.escape(protocol.get("psnr", ""))),
        _row("test SSIM", _metric(m, "evaluate.ssim", 4), html.escape(protocol.get("ssim", ""))),
        *lpips_rows,
        _row("test views", _metric(m, "evaluate.test_views", 0),
             html.escape(f"{protocol.get('split_rule', '')}; {sizes}; "
                         f"{'8-bit renders' if protocol.get('render_quantized_8bit') else 'float renders'}")),
        _row("Gaussians (final)", _metric(m, "evaluate.gaussians", 0),
             f"trained: {fmt_value(tr.get('gaussians'), 0)}; kept after pruning: "
             f"{fmt_value(pr.get('keep_fraction_final'), 3)}"),
        _row("model size", _metric(m, "evaluate.model_size_mb", 2, "MiB"), "float32 parameters in memory"),
        *[_row(f"exported .{fmt}", _metric(m, f"export.files.{fmt}.size_mb", 2, "MiB"),
               f'<a href="{html.escape(rel(paths.export_dir / f"scene.{fmt}"))}">scene.{fmt}</a>')
          for fmt in (m["export"].get("files") or {})],
        _row("training time", _metric(m, "train.train_seconds", 1, "s"),
             f"{fmt_value(tr.get('steps'), 0)} steps, stopped by {html.escape(str(tr.get('stopped', 'n/a')))}"),
        _row("training speed", _metric(m, "train.it_per_s", 2, "steps/s"), ""),
        _row("pruning time", _metric(m, "prune.stage_seconds", 1, "s"), ""),
        _row("render speed", _metric(m, "evaluate.fps", 1, "frames/s"),
             html.escape(f"{protocol.get('backend', '')}, {protocol.get('threads', '')} threads; "
                         f"{protocol.get('render_timing', '')}")),
        _row("peak memory (train)", _metric(m, "train.peak_rss_mb", 0, "MiB"), "resident set size"),
        _row("peak memory (evaluate)", _metric(m, "evaluate.peak_rss_mb_evaluate", 0, "MiB"), ""),
    ])
    sfm_rows = "".join([
        _row("registered images", _metric(m, "sfm.images_registered", 0)
             + f" / {_metric(m, 'sfm.images_total', 0)}", ""),
        _row("3D points", _metric(m, "sfm.points3d", 0), ""),
        _row("mean reprojection error", _metric(m, "sfm.mean_reprojection_error_px", 3, "px"), ""),
        _row("mean track length", _metric(m, "sfm.mean_track_length", 2), ""),
        *([_row("per-image reprojection error", _metric(m, "sfm.image_reprojection_error_px_median", 3, "px")
                + " median, " + _metric(m, "sfm.image_reprojection_error_px_p90", 3, "px") + " 90th percentile",
                "each image's mean over the points it sees"),
           _row("points seen by two views only", _metric(m, "sfm.points_two_view_fraction", 3),
                "weakly triangulated")]
          if sfm.get("image_reprojection_error_px_median") is not None else []),
        *([_row("camera path", _metric(m, "sfm.camera_path_jump_ratio", 1, "x")
                + (f" <b>jump: {html.escape(sfm['camera_path_jump_between'])}</b>"
                   if sfm.get("camera_path_jump_between") else ""),
                "largest step between cameras consecutive in name order, over the median step")]
          if sfm.get("camera_path_jump_ratio") is not None else []),
        *([_row("fit to train on", "<b>poor</b>", html.escape(fitness_warning(sfm) or ""))]
          if sfm.get("fitness_poor") else []),
        *([_row("camera centre error", _metric(m, "sfm.camera_center_error_rel", 5),
                "relative to the scene size, after similarity alignment to the ground truth"),
           _row("camera rotation error", _metric(m, "sfm.camera_rotation_error_deg", 3, "deg"), "")]
          if sfm.get("camera_center_error_rel") is not None else []),
        _row("split", _metric(m, "split.train_views", 0) + " training / " + _metric(m, "split.test_views", 0)
             + " test views", "the loss never sees a test view"),
    ])

    curves = training_curves(paths.train_csv)
    prune_png = pruning_curve(pr, max_psnr_drop_db)
    per_view = {}
    if paths.per_view_csv.exists():
        import pandas as pd

        for _, r in pd.read_csv(paths.per_view_csv).iterrows():
            per_view[Path(str(r["view"])).stem] = r
    renders = sorted(paths.renders_dir.glob("*.png")) if paths.renders_dir.exists() else []
    shown = renders[:cfg.max_test_views]
    figures = []
    for f in shown:
        r = per_view.get(f.stem)
        cap = f"{html.escape(f.stem)}: render | ground truth | error map"
        if r is not None:
            cap += f" &middot; PSNR {float(r['psnr']):.2f} dB, SSIM {float(r['ssim']):.4f}"
        figures.append(f'<figure><img alt="test view {html.escape(f.stem)}" src="{image_data_uri(f)}">'
                       f"<figcaption>{cap}</figcaption></figure>")
    more = (f"<p class=sub>{len(renders) - len(shown)} more test views in <code>{html.escape(rel(paths.renders_dir))}"
            f"</code> (report.max_test_views).</p>" if len(renders) > len(shown) else "")

    cams_html = "".join(
        f'<button class="{c.split}" data-cam="{i}" title="{c.split} camera {html.escape(c.name)}">'
        f"{html.escape(Path(c.name).stem)}</button>" for i, c in enumerate(cameras))
    preview_note = (f"all {n_full:,} Gaussians" if n_prev == n_full else
                    f"the {n_prev:,} most important of {n_full:,} Gaussians (opacity x volume; "
                    f"report.preview_max_gaussians)")
    title = title or f"splatflow report: {paths.scene}"
    # "</" would end a <script> element early: JSON and JS both accept "<\/" for it.
    cfg_json = json.dumps(view_cfg).replace("</", "<\\/")
    bundle_js = bundle.replace("</script", "<\\/script")
    spz_b64 = base64.b64encode(spz).decode("ascii")
    page = _template("report.html").substitute(
        title=html.escape(title), css=page_css(), scene=html.escape(paths.scene), view_w=view_w, view_h=view_h,
        cams=cams_html, preview_note=preview_note, preview_sh_degree=prev_degree,
        preview_mib=f"{len(spz) / 2**20:.2f}", model_href=html.escape(rel(model_file)),
        model_name=html.escape(model_file.name), headline=headline,
        views_note=html.escape(protocol.get("views", "")), color_note=html.escape(protocol.get("color", "")),
        sfm_rows=sfm_rows,
        training=(f'<figure><img alt="training curves" src="{curves}"></figure>' if curves
                  else "<p class=sub>no training log (plots/S/train.csv)</p>"),
        pruning=(f'<figure><img alt="pruning curve" src="{prune_png}"></figure>' if prune_png
                 else "<p class=sub>no pruning phases ran</p>"),
        prune_note=(html.escape(str(pr.get("stop_reason") or ""))
                    or f"{len(pr.get('phases') or [])} phases, all kept."),
        error_scale=error_scale_html(error_gain) if figures else "",
        figures="".join(figures) or "<p class=sub>no renders (evaluate.save_renders is off)</p>",
        more=more, spz_b64=spz_b64, viewer_config=cfg_json, viewer_script=bundle_js)
    paths.report_dir.mkdir(parents=True, exist_ok=True)
    out = paths.report_html
    tmp = out.with_suffix(".html.tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(out)
    return {"path": str(out.resolve().relative_to(root)) if out.resolve().is_relative_to(root) else str(out),
            "bytes": out.stat().st_size, "preview_gaussians": n_prev, "model_gaussians": n_full,
            "preview_sh_degree": prev_degree, "preview_spz_bytes": len(spz), "test_views_shown": len(shown),
            "cameras": len(cameras), "model_file": rel(model_file)}


# --------------------------------------------------------------------------------------------- dashboards


def headline(paths: ScenePaths) -> dict[str, Any]:
    """The few numbers a dashboard shows for a scene run (None where a stage has not written them)."""
    m = {s: records.read(paths, s) for s in ("sfm", "train", "prune", "evaluate", "export")}
    ev = m["evaluate"]
    lpips = {k: ev.get(k) for k in LPIPS_NAMES if k in ev}
    return {"psnr": ev.get("psnr"), "ssim": ev.get("ssim"), **lpips, "gaussians": ev.get("gaussians"),
            "model_size_mb": ev.get("model_size_mb"), "train_seconds": m["train"].get("train_seconds"),
            "steps_per_s": m["train"].get("it_per_s"), "peak_rss_mb_train": m["train"].get("peak_rss_mb"),
            "registered": m["sfm"].get("images_registered"), "images": m["sfm"].get("images_total"),
            "test_views": ev.get("test_views")}


def summary_markdown(paths: ScenePaths, *, run_url: str | None = None, report_location: str | None = None) -> str:
    """Markdown for a Prefect artifact: headline metrics, the MLflow run and where the report is."""
    h = headline(paths)
    rows = [("test PSNR (dB)", fmt_value(h["psnr"], 2)), ("test SSIM", fmt_value(h["ssim"], 4)),
            *[(LPIPS_NAMES[k], fmt_value(h[k], 4)) for k in LPIPS_NAMES if k in h],
            ("Gaussians", fmt_value(h["gaussians"], 0)), ("model size (MiB)", fmt_value(h["model_size_mb"], 2)),
            ("training time (s)", fmt_value(h["train_seconds"], 1)), ("steps/s", fmt_value(h["steps_per_s"], 2)),
            ("peak memory, train (MiB)", fmt_value(h["peak_rss_mb_train"], 0)),
            ("registered images", f"{fmt_value(h['registered'], 0)} / {fmt_value(h['images'], 0)}"),
            ("test views", fmt_value(h["test_views"], 0))]
    lines = [f"# splatflow: {paths.scene}", "", "| metric | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    lines.append("")
    if run_url:
        lines.append(f"MLflow run: [{run_url}]({run_url}) (the report is its artifact `reports/{paths.scene}/index.html`)")
    if report_location:
        lines.append(f"\nReport: `{report_location}`")
    lines.append(f"\nInteractive viewer: `splatflow view {paths.scene}`")
    return "\n".join(lines) + "\n"
