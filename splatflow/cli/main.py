"""The ``splatflow`` command line: scenes in, DVC pipeline runs, servers and run tracking.

One typer app made of sub-apps: the pipeline commands here (``demo-scene``, ``add-scene``, ``run``), the servers,
flows, ``runs`` and results of :mod:`splatflow.cli.ops`, and the viewing commands of :mod:`splatflow.cli.viewing`.
Commands raise :class:`~splatflow.pipeline.errors.UserError` (or :class:`~splatflow.pipeline.config.ConfigError`) for a
bad input; :class:`CLIGroup` prints it with :func:`splatflow.pipeline.errors.fail` -- the same helper as the stage
shell's -- and exits with the error's status (2; 3 for a busy workspace), without a traceback.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import click
import typer
from typer.core import TyperGroup

from splatflow.cli import ops, viewing
from splatflow.pipeline.config import ConfigError, load_params
from splatflow.pipeline.errors import UserError, fail
from splatflow.orchestrate.dvcrun import check_sources, stage_order
from splatflow.orchestrate.workspace import workspace_lock
from splatflow.pipeline.paths import require_project_root

PIPELINE = "Pipeline"


class CLIGroup(TyperGroup):
    """The root command group: a user error raised by any command, at any depth, ends as one red line, and so
    does a command line click cannot parse (a missing argument, an unknown option, a value out of range): the
    line names the command and its ``--help``, where typer's default draws a box of usage text."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (UserError, ConfigError) as e:
            fail(f"error: {e}", getattr(e, "exit_code", 2))

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        try:
            # `python -m splatflow.cli` reads the same as the `splatflow` script in messages and usage lines
            rv = super().main(args, prog_name or "splatflow", complete_var, standalone_mode=False, **extra)
        except Exception as e:  # typer carries its own copy of click: its exceptions are known by class name
            kinds = {c.__name__ for c in type(e).__mro__}
            ctx = getattr(e, "ctx", None)
            if "NoArgsIsHelpError" in kinds:  # `splatflow runs`: its help, as click would show it
                print(ctx.get_help() if ctx else str(e), file=sys.stderr)
                rv = e.exit_code
            elif "ClickException" in kinds:
                where = getattr(ctx, "command_path", None) or prog_name or "splatflow"
                message = " ".join(e.format_message().split())
                fail(f"error: {where}: {message} (`{where} --help` lists the arguments)", e.exit_code)
            elif "Abort" in kinds:
                fail("aborted", 1)
            else:
                raise
        if not standalone_mode:
            return rv
        sys.exit(rv if isinstance(rv, int) else 0)


app = typer.Typer(cls=CLIGroup, no_args_is_help=True, add_completion=False,
                  help="splatflow: reproducible 3D Gaussian Splatting (ingest → sfm → split → train → prune "
                       "→ evaluate → export)")

@app.command("demo-scene", rich_help_panel=PIPELINE)
def demo_scene(
    out: Path = typer.Option(Path("data/raw/demo"), help="output folder (images/ and ground_truth/ inside)"),
    views: Optional[int] = typer.Option(None, min=3, help="number of views (default: the demo's)"),
    width: Optional[int] = typer.Option(None, min=32, help="image width in pixels"),
    height: Optional[int] = typer.Option(None, min=32, help="image height in pixels"),
    arc: Optional[float] = typer.Option(None, min=1.0, max=360.0, help="orbit arc in degrees (360 = full orbit)"),
    seed: Optional[int] = typer.Option(None, help="random seed (the scene is deterministic for a seed)"),
    force: bool = typer.Option(False, help="rewrite the scene even if it exists"),
):
    """Write the synthetic demo scene (a textured room with boxes) with its true cameras."""
    from splatflow.scene import synthetic  # lazy: OpenCV loads only for the demo scene

    options = dict(synthetic.DEMO_DEFAULTS)
    for key, value in (("n_views", views), ("width", width), ("height", height), ("arc_deg", arc), ("seed", seed)):
        if value is not None:
            options[key] = value
    images = out / "images"
    if images.is_dir() and any(images.iterdir()) and not force:
        typer.echo(f"{out}: demo scene already there (use --force to rewrite it)")
        return
    synthetic.write_scene(out, **options)
    typer.echo(f"wrote {out} ({options})")


@app.command("add-scene", rich_help_panel=PIPELINE)
def add_scene(
    name: str = typer.Argument(..., help="scene name (letters, digits, - and _)"),
    path: Path = typer.Argument(..., help="a folder of images, a video file, or a COLMAP dataset (images/ + "
                                          "sparse/0/ or sparse/, optional images_2|4|8/)"),
    ground_truth: Optional[Path] = typer.Option(None, help="true cameras (COLMAP text model folder, "
                                                           "cameras.json or Strecha camera folder)"),
    force: bool = typer.Option(False, help="replace an existing scene of that name"),
    masks: Optional[Path] = typer.Option(None, help="folder of masks named like the images (white = keep)"),
    downscale: Optional[int] = typer.Option(None, min=1, help="this scene's working resolution: 1, 2, 4 or 8 "
                                                       "(default: base.resolution)"),
):
    """Register a folder of images, a video or a COLMAP dataset as a scene in params.yaml (keeps its comments)."""
    from ruamel.yaml import YAML

    from splatflow.scene import colmap  # lazy: pycolmap loads only for the commands that read a dataset

    root = require_project_root()
    if not path.exists():
        raise UserError(f"{path} does not exist; give a folder of images or a video file")
    if path.is_file():
        from splatflow.scene.video import check_video_source  # lazy: OpenCV loads only for a video source

        check_video_source(path)  # ingest's own test: opened and a frame decoded, whatever the suffix
    if not name or not all(c.isascii() and (c.isalnum() or c in "-_") for c in name):
        raise UserError(f"scene name {name!r}: use ASCII letters, digits, '-' and '_' only")
    params_path = root / "params.yaml"
    yaml = YAML()
    yaml.preserve_quotes = True
    # written back as it was laid out: lists indented under their key, and null spelled out (ruamel's defaults
    # re-indented train.resolution and left `downscale:` empty, changing lines the user never touched)
    yaml.indent(mapping=2, sequence=4, offset=2)
    yaml.representer.add_representer(
        type(None), lambda rep, _: rep.represent_scalar("tag:yaml.org,2002:null", "null"))
    data = yaml.load(params_path.read_text())
    scenes = data.setdefault("base", {}).setdefault("scenes", {})
    if name in scenes and not force:
        raise UserError(f"scene {name!r} is already in params.yaml (use --force to replace it)")
    twin = next((s for s in scenes if s != name and s.lower() == name.lower()), None)
    if twin is not None:  # data/<name>, models/<name>: one folder on a case-insensitive file system
        raise UserError(f"scene {name!r} differs from the existing scene {twin!r} only in case; their folders would "
                        "collide on macOS and Windows file systems: choose another name")

    def rel(p: Path) -> str:
        p = p.resolve()
        try:
            return str(p.relative_to(root))
        except ValueError:
            return str(p)

    entry = {"source": rel(path)}
    if path.is_dir() and colmap.is_colmap_dataset(path):
        # An existing reconstruction: the sfm stage imports it instead of running SfM (splatflow.scene.colmap).
        entry["colmap"] = colmap.find_model(path)
    elif path.is_dir() and (path / "images").is_dir() and colmap.partial_model(path) is not None:
        raise UserError(colmap.incomplete_model_message(*colmap.partial_model(path), images=path / "images"))
    elif path.is_dir() and (path / "images").is_dir() and not any(
            p.is_file() and not p.name.startswith(".") for p in path.iterdir()):
        raise UserError(f"{path} holds an images/ folder but no COLMAP model (cameras, images, points3D as .bin or "
                        f".txt in sparse/0/ or sparse/); give {path / 'images'} to run SfM on the images, or add the "
                        "model")
    if ground_truth is not None:
        if not ground_truth.exists():
            raise UserError(f"{ground_truth} does not exist")
        entry["ground_truth"] = rel(ground_truth)
    if masks is not None:
        if not masks.is_dir():
            raise UserError(f"{masks} is not a folder; give the folder of masks (named like the images, white = "
                            "keep)")
        entry["masks"] = rel(masks)
    if downscale is not None:
        entry["resolution"] = {"downscale": downscale}  # checked with the rest by load_params below
    scenes[name] = entry
    tmp = params_path.with_suffix(".yaml.tmp")
    with tmp.open("w") as f:
        yaml.dump(data, f)
    try:
        load_params(tmp)  # never leave an invalid params.yaml behind
    except ConfigError:
        tmp.unlink()
        raise
    os.replace(tmp, params_path)
    kind = f" (COLMAP dataset, model {entry['colmap']}: SfM is not run again)" if "colmap" in entry else ""
    typer.echo(f"added scene {name!r} -> {entry['source']}{kind}; run it with `splatflow run {name}`")
    if path.is_dir() and "colmap" not in entry:
        _warn_if_too_few_images(path)


def _warn_if_too_few_images(folder: Path) -> None:
    """Say at once, not after `splatflow run` has started, that a folder cannot make a reconstruction (the scene is
    still added: photos may be copied in later; ingest then checks every file)."""
    # lazy: ingest brings OpenCV and Pillow, which the other commands (and --help) do without
    from splatflow.scene.ingest import IMAGE_FILE_SUFFIXES, MIN_USABLE_IMAGES, TYPICAL_CAPTURE

    files = [p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_FILE_SUFFIXES
             and not any(part.startswith(".") for part in p.relative_to(folder).parts)]
    if len(files) < MIN_USABLE_IMAGES:
        typer.secho(f"warning: {folder} holds {len(files)} image file{'s' * (len(files) != 1)}; structure from "
                    f"motion needs at least {MIN_USABLE_IMAGES} overlapping views, so `splatflow run` would stop at "
                    f"ingest. Add photos first: {TYPICAL_CAPTURE}.", fg=typer.colors.YELLOW, err=True)


@app.command("run", rich_help_panel=PIPELINE)
def run(
    scene: Optional[str] = typer.Argument(None, help="scene to run (default: every scene in params.yaml)"),
    force: bool = typer.Option(False, help="rerun stages even if DVC finds them up to date"),
    wait: bool = typer.Option(True, "--wait/--no-wait",
                              help="when another run reproduces in this checkout: wait for it (default) or stop "
                                   "at once with exit status 3"),
    view: bool = typer.Option(False, "--view", help="serve the splat being trained in the viewer (viser), "
                                                    "refreshed every few seconds, while the train stage runs"),
    view_port: int = typer.Option(8080, help="--view: port on 127.0.0.1 (the next free one if it is taken)"),
    view_every: float = typer.Option(5.0, help="--view: seconds between two refreshes of the live view"),
):
    """Run the pipeline with DVC (only what changed reruns), as a Prefect `reconstruct` flow run per scene (one
    task per stage). One writer per checkout: a second run waits."""
    root = require_project_root()
    params = load_params(root / "params.yaml")
    scenes = [scene] if scene else sorted(params.base.scenes)
    for s in scenes:
        params.scene(s)  # an unknown scene: a ConfigError naming `splatflow add-scene`

    check_sources(root, scenes)  # a capture that is not there: say so before DVC removes the scene's outputs
    from splatflow import tracking  # lazy: MLflow loads only for the commands that record runs

    if tracking.enabled():  # once per run, before DVC: a dead server stops here in seconds (exit 2)
        uri = tracking.tracking_uri(root)
        tracking.check_reachable(uri)
        problem = tracking.store_problem(uri)
        if problem:  # said once here; the flow and its stages then run untracked without saying it again
            typer.secho(f"warning: {problem}", fg=typer.colors.YELLOW, err=True)
            os.environ["SPLATFLOW_TRACKING"] = "off"
    for s in scenes:
        if not stage_order(root, s):  # the flow would find nothing to run
            raise UserError(f"dvc.yaml makes no stages for scene {s!r}; check its entry under base.scenes in "
                            "params.yaml (a scene name must be a string: quote it) and dvc.yaml's foreach")
    if view:
        # lazy: torch (the live view's snapshots), which the other commands skip
        from splatflow.present import live_view

        os.environ[live_view.ENV] = f"127.0.0.1:{live_view.parse_address(str(view_port), '--view-port')[1]}"
        os.environ[live_view.ENV_EVERY] = str(live_view.parse_every(str(view_every), "--view-every"))
    ops._use_local_prefect_server()  # the user's Prefect server (`splatflow ui`) when one answers
    from splatflow.orchestrate.flowrun import run_scenes  # lazy: Prefect loads only for the commands that run flows

    def tell(msg: str) -> None:
        typer.secho(f"waiting: {msg} (Ctrl-C to give up)", fg=typer.colors.YELLOW, err=True)

    with workspace_lock(root, wait_s=None if wait else 0, on_wait=tell):  # WorkspaceBusy: exit 3
        outcomes = run_scenes(root, scenes, force=force, say=typer.echo)
    rc = next((o.returncode for o in outcomes if o.returncode), 0)
    if rc in (130, 143):
        typer.secho(f"stopped ({'Ctrl-C' if rc == 130 else 'SIGTERM'}): the stage that ran kept its partial work "
                    f"(train: its checkpoint) and its MLflow run is KILLED; `{' '.join(['splatflow run', *scenes])}` "
                    "continues from there", fg=typer.colors.YELLOW, err=True)
    if rc != 0:
        raise typer.Exit(rc)
    if view and not any(stage.startswith("train@") for o in outcomes for stage in o.ran):
        typer.echo("(--view: no training ran, every train stage was up to date; `splatflow view SCENE` shows the "
                   "trained splat)")
    for s in scenes:
        typer.echo(f"\n{s}: metrics in metrics/{s}/ ; `splatflow metrics {s}` shows them as a table")


# The sub-apps: their commands keep the command lines they always had (`splatflow ui`, `splatflow runs reap`).
app.add_typer(ops.servers_app)
app.add_typer(ops.flows_app)
app.add_typer(ops.runs_app, name="runs", rich_help_panel=ops.RESULTS)
app.add_typer(ops.results_app)
app.add_typer(viewing.app)
app.add_typer(viewing.weights_app, name="weights", rich_help_panel=viewing.PANEL)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
