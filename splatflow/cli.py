"""The ``splatflow`` command line: scenes in, DVC pipeline runs, servers and run tracking."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

import typer

from splatflow.config import ConfigError, load_params
from splatflow.paths import project_root

app = typer.Typer(help="splatflow: reproducible 3D Gaussian Splatting (ingest → sfm → split → train → prune → "
                       "evaluate → export)", no_args_is_help=True, add_completion=False)

VIDEO_SUFFIXES = {".mp4", ".mov", ".avi", ".mkv", ".m4v", ".webm"}


def _fail(msg: str) -> None:
    typer.secho(f"error: {msg}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


def _root() -> Path:
    root = project_root()
    if not (root / "params.yaml").exists():
        _fail(f"no params.yaml in {root} or its parents; run splatflow from the project folder")
    return root


def _dvc() -> str:
    exe = Path(sys.executable).parent / "dvc"
    return str(exe) if exe.exists() else (shutil.which("dvc") or "dvc")


@app.command("demo-scene")
def demo_scene(
    out: Path = typer.Option(Path("data/raw/demo"), help="output folder (images/ and ground_truth/ inside)"),
    views: Optional[int] = typer.Option(None, help="number of views (default: the demo's)"),
    width: Optional[int] = typer.Option(None, help="image width in pixels"),
    height: Optional[int] = typer.Option(None, help="image height in pixels"),
    arc: Optional[float] = typer.Option(None, help="orbit arc in degrees (360 = full orbit)"),
    seed: Optional[int] = typer.Option(None, help="random seed (the scene is deterministic for a seed)"),
    force: bool = typer.Option(False, help="rewrite the scene even if it exists"),
):
    """Write the synthetic demo scene (a textured room with boxes) with its true cameras."""
    from splatflow.scene import synthetic

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


@app.command("add-scene")
def add_scene(
    name: str = typer.Argument(..., help="scene name (letters, digits, - and _)"),
    path: Path = typer.Argument(..., help="a folder of images, a video file, or a COLMAP dataset (images/ + "
                                          "sparse/0/ or sparse/, optional images_2|4|8/)"),
    ground_truth: Optional[Path] = typer.Option(None, help="true cameras (COLMAP text model folder, "
                                                           "cameras.json or Strecha camera folder)"),
    force: bool = typer.Option(False, help="replace an existing scene of that name"),
    masks: Optional[Path] = typer.Option(None, help="folder of masks named like the images (white = keep)"),
    downscale: Optional[int] = typer.Option(None, help="this scene's working resolution: 1, 2, 4 or 8 "
                                                       "(default: base.resolution)"),
):
    """Register a folder of images, a video or a COLMAP dataset as a scene in params.yaml (keeps its comments)."""
    from ruamel.yaml import YAML

    from splatflow.scene import colmap

    root = _root()
    if not path.exists():
        _fail(f"{path} does not exist; give a folder of images or a video file")
    if path.is_file() and path.suffix.lower() not in VIDEO_SUFFIXES:
        _fail(f"{path} is a file but not a video ({', '.join(sorted(VIDEO_SUFFIXES))}); "
              "give a folder of images or a video file")
    if not all(c.isalnum() or c in "-_" for c in name):
        _fail(f"scene name {name!r}: use letters, digits, '-' and '_' only")
    params_path = root / "params.yaml"
    yaml = YAML()
    yaml.preserve_quotes = True
    data = yaml.load(params_path.read_text())
    scenes = data.setdefault("base", {}).setdefault("scenes", {})
    if name in scenes and not force:
        _fail(f"scene {name!r} is already in params.yaml (use --force to replace it)")

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
    elif path.is_dir() and (path / "images").is_dir() and not any(
            p.is_file() and not p.name.startswith(".") for p in path.iterdir()):
        _fail(f"{path} holds an images/ folder but no COLMAP model (cameras, images, points3D as .bin or .txt in "
              f"sparse/0/ or sparse/); give {path / 'images'} to run SfM on the images, or add the model")
    if ground_truth is not None:
        if not ground_truth.exists():
            _fail(f"{ground_truth} does not exist")
        entry["ground_truth"] = rel(ground_truth)
    if masks is not None:
        if not masks.is_dir():
            _fail(f"{masks} is not a folder; give the folder of masks (named like the images, white = keep)")
        entry["masks"] = rel(masks)
    if downscale is not None:
        entry["resolution"] = {"downscale": downscale}  # checked with the rest by load_params below
    scenes[name] = entry
    tmp = params_path.with_suffix(".yaml.tmp")
    with tmp.open("w") as f:
        yaml.dump(data, f)
    try:
        load_params(tmp)  # never leave an invalid params.yaml behind
    except ConfigError as e:
        tmp.unlink()
        _fail(str(e))
    os.replace(tmp, params_path)
    kind = f" (COLMAP dataset, model {entry['colmap']}: SfM is not run again)" if "colmap" in entry else ""
    typer.echo(f"added scene {name!r} -> {entry['source']}{kind}; run it with `splatflow run {name}`")


@app.command("run")
def run(
    scene: Optional[str] = typer.Argument(None, help="scene to run (default: every scene in params.yaml)"),
    force: bool = typer.Option(False, help="rerun stages even if DVC finds them up to date"),
    wait: bool = typer.Option(True, "--wait/--no-wait",
                              help="when another run reproduces in this checkout: wait for it (default) or stop "
                                   "at once with exit status 3"),
):
    """Run the pipeline with DVC (only what changed reruns). One writer per checkout: a second run waits."""
    root = _root()
    try:
        params = load_params(root / "params.yaml")
        scenes = [scene] if scene else sorted(params.base.scenes)
        for s in scenes:
            params.scene(s)
    except ConfigError as e:
        _fail(str(e))
    from splatflow.orchestrate.dvcrun import stage_env, stage_order

    targets = [t for s in scenes for t in stage_order(root, s)]
    cmd = [_dvc(), "repro", *targets] + (["--force"] if force else [])
    from splatflow.orchestrate.workspace import WorkspaceBusy, run_foreground, workspace_lock

    def tell(msg: str) -> None:
        typer.secho(f"waiting: {msg} (Ctrl-C to give up)", fg=typer.colors.YELLOW, err=True)

    try:
        with workspace_lock(root, wait_s=None if wait else 0, on_wait=tell):
            typer.echo("$ " + " ".join(["dvc", *cmd[1:]]))
            rc = run_foreground(cmd, root, stage_env())
    except WorkspaceBusy as e:
        typer.secho(f"error: {e}", fg=typer.colors.RED, err=True)
        raise typer.Exit(3) from None
    if rc in (130, 143):
        typer.secho(f"stopped ({'Ctrl-C' if rc == 130 else 'SIGTERM'}): the stage that ran kept its partial work "
                    f"(train: its checkpoint) and its MLflow run is KILLED; `splatflow run {scene or ''}` "
                    "continues from there".replace("  ", " "), fg=typer.colors.YELLOW, err=True)
    if rc != 0:
        raise typer.Exit(rc)
    for s in scenes:
        typer.echo(f"\n{s}: metrics in metrics/{s}/ ; `dvc metrics show` to see them")


from splatflow import ops_cli  # noqa: E402  (servers, flows, runs: registered after the core commands)

ops_cli.register(app)

from splatflow import view_cli  # noqa: E402  (view, report, build-web)

view_cli.register(app)


if __name__ == "__main__":
    app()
