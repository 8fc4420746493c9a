"""Fixed per-scene paths: the same paths are the DVC ``outs`` in dvc.yaml (docs/CONTRACTS.md)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from splatflow.pipeline.errors import UserError


def project_root(start: str | Path | None = None) -> Path:
    """The checkout a command works in: the nearest folder holding params.yaml and dvc.yaml, searching upwards
    from ``start`` (default: the cwd); ``start`` itself when there is none (see :func:`require_project_root`)."""
    here = Path(start or Path.cwd()).resolve()
    for p in (here, *here.parents):
        if (p / "params.yaml").exists() and (p / "dvc.yaml").exists():
            return p
    return here


def repo_root(start: str | Path | None = None) -> Path:
    """The project root, seen through DVC's temporary experiment workspaces.

    ``dvc exp run --temp`` and the experiment queue run stages in ``<repo>/.dvc/tmp/exps/<tmpdir>``; a default
    tracking store (or a server's log folder) inside that folder would vanish with it, so the root is the repo that
    holds ``.dvc/tmp``. Anywhere else it is :func:`project_root`.
    """
    root = project_root(start)
    return experiment_origin(root) or root


def experiment_origin(path: Path) -> Path | None:
    """The repo whose ``.dvc/tmp/exps`` holds ``path`` (a DVC experiment's copy of the workspace), else None."""
    parts = path.parts
    for i in range(len(parts) - 3):
        if parts[i : i + 3] == (".dvc", "tmp", "exps"):
            return Path(*parts[:i])
    return None


def require_project_root(start: str | Path | None = None) -> Path:
    """:func:`repo_root`, or a :class:`~splatflow.pipeline.errors.UserError` saying where to run from when there is
    none."""
    root = repo_root(start)
    if not (root / "params.yaml").exists() or not (root / "dvc.yaml").exists():
        raise UserError(f"no params.yaml and dvc.yaml in {root} or its parents: run splatflow from the project "
                        "folder (the one with params.yaml, dvc.yaml and stages/)")
    return root


@dataclass(frozen=True)
class ScenePaths:
    scene: str
    root: Path = Path(".")

    def __post_init__(self):
        object.__setattr__(self, "root", Path(self.root))

    # data/<scene>/
    @property
    def data_dir(self) -> Path:
        return self.root / "data" / self.scene

    @property
    def settings_dir(self) -> Path:  # <stage>.json: each stage's share of the scene's entry (stage `settings`)
        return self.data_dir / "settings"

    @property
    def images_dir(self) -> Path:
        return self.data_dir / "images"

    @property
    def masks_dir(self) -> Path:  # <stem>.png per image, white = keep; only when the scene has masks
        return self.data_dir / "masks"

    def level_dir(self, n: int) -> Path:  # images_N: a dataset's own 1/N-size copies of images/ (same names)
        return self.data_dir / f"images_{n}"

    @property
    def sparse_dir(self) -> Path:
        return self.data_dir / "sparse"

    @property
    def undistorted_dir(self) -> Path:
        return self.data_dir / "undistorted"

    @property
    def split_json(self) -> Path:
        return self.data_dir / "split.json"

    @property
    def renders_dir(self) -> Path:
        return self.data_dir / "renders"

    # models/<scene>/
    @property
    def models_dir(self) -> Path:
        return self.root / "models" / self.scene

    @property
    def train_ckpt(self) -> Path:
        return self.models_dir / "train" / "ckpt.pt"

    @property
    def prune_ckpt(self) -> Path:
        return self.models_dir / "prune" / "ckpt.pt"

    @property
    def prune_phases(self) -> Path:
        """The state after the last finished prune phase (not a DVC out: a rerun continues from it)."""
        return self.models_dir / "prune" / "phases.pt"

    @property
    def export_dir(self) -> Path:
        return self.models_dir / "export"

    # metrics/<scene>/ and plots/<scene>/
    @property
    def metrics_dir(self) -> Path:
        return self.root / "metrics" / self.scene

    def metrics_json(self, stage: str) -> Path:
        return self.metrics_dir / f"{stage}.json"

    def info_json(self, stage: str) -> Path:
        """What a stage reports besides numbers (strings, settings, lists, reasons): splatflow.pipeline.records."""
        return self.metrics_dir / "info" / f"{stage}.json"

    @property
    def per_view_csv(self) -> Path:
        return self.metrics_dir / "per_view.csv"

    @property
    def plots_dir(self) -> Path:
        return self.root / "plots" / self.scene

    @property
    def train_csv(self) -> Path:
        return self.plots_dir / "train.csv"

    # reports/<scene>/
    @property
    def report_dir(self) -> Path:
        return self.root / "reports" / self.scene

    @property
    def report_html(self) -> Path:
        return self.report_dir / "index.html"
