"""Looking at results from the ``splatflow`` CLI: ``view`` (interactive viewer), ``report`` and ``build-web``.

A typer sub-app (:data:`app`) that ``splatflow.cli`` mounts; viser, torch and matplotlib are imported inside the
commands. A bad input raises :class:`~splatflow.errors.UserError`, which the CLI prints without a traceback.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from splatflow.errors import UserError
from splatflow.paths import ScenePaths, project_root
from splatflow.webbundle import build

app = typer.Typer()
PANEL = "Results"


@app.command("view", rich_help_panel=PANEL)
def view_cmd(
    target: str = typer.Argument(..., help="a scene name (params.yaml) or a .ply/.splat/.spz file"),
    port: int = typer.Option(8080, help="port on 127.0.0.1 (the next free one if it is taken)"),
    stage: Optional[str] = typer.Option(None, help="train | prune | export (default: the newest model)"),
    camera: Optional[str] = typer.Option(None, help="start at this scene camera (image name; default: the "
                                                    "first test camera)"),
    host: str = typer.Option("127.0.0.1", help="interface to listen on (127.0.0.1: this machine only)"),
):
    """Serve the scene's splat in an interactive viewer (viser), with its cameras; Ctrl-C stops it."""
    from splatflow.viewer import SplatViewer, load_target, serve_forever  # lazy: viser and torch load only to serve

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
    paths = ScenePaths(scene, project_root())
    if not paths.report_html.exists():
        raise UserError(f"{paths.report_html} does not exist yet: run `splatflow run {scene}` (its last stage, "
                        f"report, writes it)")
    typer.echo(f"{paths.report_html.resolve().as_uri()}")


@app.command("build-web", rich_help_panel=PANEL)
def build_web_cmd(force: bool = typer.Option(False, help="rebuild even when the bundle is current")):
    """npm-install the pinned splat renderer (splatflow/web) and bundle the report's 3D viewer script."""
    out = build(force=force, log=typer.echo)
    typer.echo(f"viewer script: {Path(out)}")
