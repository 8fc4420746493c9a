"""Looking at results from the ``splatflow`` CLI: ``view`` (interactive viewer), ``report`` and ``build-web``.

A typer sub-app (:data:`app`) that ``splatflow.cli`` mounts; viser, torch and matplotlib are imported inside the
commands. A bad input raises :class:`~splatflow.pipeline.errors.UserError`, which the CLI prints without a traceback.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from splatflow.pipeline import records
from splatflow.pipeline.config import load_params
from splatflow.pipeline.errors import UserError
from splatflow.pipeline.paths import ScenePaths, project_root, require_project_root
from splatflow.present.webbundle import build

app = typer.Typer()
PANEL = "Results"


@app.command("view", rich_help_panel=PANEL)
def view_cmd(
    target: str = typer.Argument(..., help="a scene name (params.yaml) or a .ply/.splat/.spz file"),
    port: int = typer.Option(8080, min=1, max=65535, help="port on 127.0.0.1 (the next free one if it is taken)"),
    stage: Optional[str] = typer.Option(None, help="train | prune | export (default: the newest model)"),
    camera: Optional[str] = typer.Option(None, help="start at this scene camera (image name; default: the "
                                                    "first training camera)"),
    host: str = typer.Option("127.0.0.1", help="interface to listen on (127.0.0.1: this machine only)"),
):
    """Serve the scene's splat in an interactive viewer (viser), with its cameras; Ctrl-C stops it."""
    # lazy: viser and torch load only to serve
    from splatflow.present.viewer import SplatViewer, load_target, serve_forever

    model = load_target(target, project_root(), stage)
    viewer = SplatViewer(model, host=host, port=port, start_camera=camera)
    n = len(model.splats["means"])
    typer.echo(f"splatflow view: {model.source} ({model.stage or 'file'}): {n:,} Gaussians, SH degree "
               f"{model.sh_degree}, {len(model.cameras)} cameras")
    if viewer.server.get_port() != port:
        typer.echo(f"splatflow view: port {port} is taken; using {viewer.server.get_port()}")
    typer.echo(f"splatflow view: open {viewer.url}  (Ctrl-C stops)", color=None)
    serve_forever(viewer, log=typer.echo)


@app.command("report", rich_help_panel=PANEL)
def report_cmd(scene: str = typer.Argument("demo")):
    """Where a scene's report is (written by the `report` DVC stage), or how to make it."""
    root = project_root()
    if (root / "params.yaml").exists():
        load_params(root / "params.yaml").scene(scene)  # an unknown scene: a ConfigError naming `add-scene`
    paths = ScenePaths(scene, root)
    if not paths.report_html.exists():
        raise UserError(f"{paths.report_html} does not exist yet: run `splatflow run {scene}` (its last stage, "
                        f"report, writes it)")
    typer.echo(f"{paths.report_html.resolve().as_uri()}")


@app.command("build-web", rich_help_panel=PANEL)
def build_web_cmd(force: bool = typer.Option(False, help="rebuild even when the bundle is current")):
    """npm-install the pinned splat renderer (splatflow/web) and bundle the report's 3D viewer script."""
    out = build(force=force, log=typer.echo)
    typer.echo(f"viewer script: {Path(out)}")


weights_app = typer.Typer(help="model weights the evaluation uses (LPIPS backbones)", no_args_is_help=True)


@weights_app.command("fetch")
def weights_fetch_cmd(
    net: Optional[list[str]] = typer.Option(None, "--net", help="alex | vgg (repeatable; default: both)"),
    dest: Optional[Path] = typer.Option(None, help="folder to save them in (default: the torch hub cache, "
                                                   "$TORCH_HOME/hub/checkpoints, where evaluation looks)"),
    mirror: Optional[str] = typer.Option(None, help="download from this base URL instead of torchvision's "
                                                    "(the files keep their names and checksums)"),
):
    """Download the ImageNet AlexNet and VGG16 weights LPIPS needs (torchvision's files, checksum-checked)."""
    # lazy: torch, through splatflow.evaluation.lpips
    from splatflow.evaluation.weights import OFFICIAL_BASE_URL, fetch_backbones

    saved = fetch_backbones(tuple(net or ("alex", "vgg")), dest_dir=dest, base_url=mirror or OFFICIAL_BASE_URL,
                            log=typer.echo)
    typer.echo(f"LPIPS backbones ready in {saved[0].parent}. Runs from now on report LPIPS; to add it to a finished "
               "scene S: `.venv/bin/dvc repro --force --single-item evaluate@S report@S`")


#: The per-scene table of ``splatflow metrics``: (column, stage, key in metrics/S/<stage>.json, format).
HEADLINE_COLUMNS = (("PSNR dB", "evaluate", "psnr", "{:.2f}"), ("SSIM", "evaluate", "ssim", "{:.3f}"),
                    ("LPIPS", "evaluate", "lpips_alex", "{:.3f}"), ("Gaussians", "evaluate", "gaussians", "{:,.0f}"),
                    ("train s", "train", "train_seconds", "{:.1f}"), ("steps", "train", "steps", "{:.0f}"),
                    ("FPS", "evaluate", "fps", "{:.0f}"), ("model MB", "evaluate", "model_size_mb", "{:.1f}"),
                    ("SfM views", "sfm", "images_registered", "{:.0f}"))
STAGE_ORDER = ("settings", "ingest", "sfm", "split", "train", "prune", "evaluate", "export", "report")


@app.command("metrics", rich_help_panel=PANEL)
def metrics_cmd(
    scenes: Optional[list[str]] = typer.Argument(None, help="scenes (default: every scene with metrics)"),
    all_: bool = typer.Option(False, "--all", help="every number of every stage, one per line"),
):
    """The scenes' headline metrics as one table (metrics/S/*.json); --all lists every stage's numbers."""
    root = require_project_root()
    params = load_params(root / "params.yaml")
    for s in scenes or []:
        params.scene(s)  # an unknown scene: a ConfigError naming `splatflow add-scene`
    names = list(scenes or [s for s in sorted(params.base.scenes) if ScenePaths(s, root).metrics_dir.is_dir()])
    if not names:
        raise UserError("no scene has metrics yet: run the pipeline first (`splatflow run SCENE`, or `make demo`)")

    def load(scene: str) -> dict[str, dict]:
        paths = ScenePaths(scene, root)
        return {f.stem: records.read_numbers(paths, f.stem) for f in records.stage_metric_files(paths)}

    data = {s: load(s) for s in names}
    width = max(8, *(len(s) for s in names))
    typer.echo(f"{'scene':{width}s}" + "".join(f"{c:>10s}" for c, *_ in HEADLINE_COLUMNS))
    lpips_missing = False
    for s in names:
        cells = []
        for _, stage, key, fmt in HEADLINE_COLUMNS:
            v = data[s].get(stage, {}).get(key)
            ok = isinstance(v, (int, float)) and not isinstance(v, bool)
            cells.append(fmt.format(v) if ok else "n/a" if stage in data[s] else "-")
            lpips_missing |= key == "lpips_alex" and "evaluate" in data[s] and not ok
        typer.echo(f"{s:{width}s}" + "".join(f"{c:>10s}" for c in cells))
    typer.echo("(-: stage not run yet; LPIPS: AlexNet on [-1, 1], as gsplat and nerfstudio report it)")
    if lpips_missing:
        typer.echo("LPIPS n/a: `splatflow weights fetch` downloads the ImageNet weights it needs")
    if not all_:
        typer.echo("`splatflow metrics --all` lists every number of every stage")
        return

    def flat(d: dict, pre: str = ""):
        for k, v in d.items():
            key = f"{pre}{k}"
            if isinstance(v, dict):
                yield from flat(v, key + ".")
            elif records.is_number(v):
                yield key, v

    for s in names:
        stages = sorted(data[s], key=lambda n: (STAGE_ORDER.index(n) if n in STAGE_ORDER else 99, n))
        for stage in stages:
            typer.echo(f"\n{s} / {stage}  (metrics/{s}/{stage}.json)")
            for key, v in flat(data[s][stage]):
                text = f"{v:,}" if isinstance(v, int) else f"{v:.6g}"
                typer.echo(f"  {key:60s} {text:>16s}")
