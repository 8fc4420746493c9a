"""Run metadata: provenance tags (git, dvc.lock, ``dvc exp``, owner process, device), params and metrics in MLflow's
flat naming, and which files of a stage are kept as artifacts."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, Iterable

from splatflow.pipeline import records
from splatflow.pipeline.config import flatten, params_from_dict, section_dict
from splatflow.orchestrate.plots import render_csv_png
from splatflow.pipeline.paths import ScenePaths

#: not: they live in the DVC cache and would double the artifact store).
ARTIFACT_SUFFIXES = {".ply", ".splat", ".spz", ".json", ".csv", ".png", ".jpg", ".jpeg", ".html", ".md", ".txt",
                     ".tsv", ".yaml"}
#: Folders among a stage's outs that are logged file by file (renders of test views).
ARTIFACT_DIR_NAMES = {"renders", "export", "reports"}
MAX_ARTIFACT_BYTES = 200 * 1024 * 1024  # one file
MAX_DIR_FILES = 500


def _git(root: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_tags(root: Path) -> dict[str, str]:
    """Commit and dirty flag (tracked files only: untracked outputs don't make a run unreproducible)."""
    commit = _git(root, "rev-parse", "HEAD")
    tags = {"git.commit": commit or "none"}
    if commit:
        tags["mlflow.source.git.commit"] = commit
        status = _git(root, "status", "--porcelain", "--untracked-files=no")
        tags["git.dirty"] = "true" if status else "false"
        branch = _git(root, "rev-parse", "--abbrev-ref", "HEAD")
        if branch:
            tags["git.branch"] = branch
    return tags


def dvc_lock_tags(root: Path, scene: str) -> dict[str, str]:
    """One tag per stage of ``scene`` in dvc.lock: a short digest of its deps, params and outs hashes.

    Two runs with equal ``dvc.hash.<stage>`` tags ran that stage on identical inputs and produced identical
    outputs (DVC's own md5s); tags carry the state of dvc.lock when they were logged.
    """
    lock = root / "dvc.lock"
    if not lock.exists():
        return {}
    import yaml

    try:
        data = yaml.safe_load(lock.read_text()) or {}
    except Exception:
        return {}
    tags = {}
    for name, entry in (data.get("stages") or {}).items():
        base, _, item = name.partition("@")
        if item and item != scene:
            continue
        digest = hashlib.sha1(json.dumps(entry, sort_keys=True, default=str).encode()).hexdigest()[:16]
        tags[f"dvc.hash.{base}"] = digest
    return tags


def dvc_exp_tags(root: Path, params: Any = None) -> dict[str, str]:
    """Under ``dvc exp run`` (DVC sets ``DVC_EXP_NAME``/``DVC_EXP_BASELINE_REV`` for every stage): the
    experiment's name, its baseline commit and its param overrides (``train.max_steps=2000``: every key whose
    value differs from params.yaml at the baseline), so the run shows which experiment it is. {} otherwise."""
    name = os.environ.get("DVC_EXP_NAME", "").strip()
    if not name:
        return {}
    tags = {"dvc.exp.name": name}
    base = os.environ.get("DVC_EXP_BASELINE_REV", "").strip()
    if base:
        tags["dvc.exp.baseline"] = base
    if params is not None:
        with contextlib.suppress(Exception):  # best effort: the tag is information, not provenance
            import yaml

            text = _git(root, "show", f"{base or 'HEAD'}:params.yaml")
            if text is not None:
                before = flatten_params(params_from_dict(yaml.safe_load(text)))
                now = flatten_params(params)
                changed = sorted(k for k in now if before.get(k) != now[k])
                tags["splatflow.overrides"] = ",".join(f"{k}={now[k]}" for k in changed)
    return tags


def process_tags(pid: int | None = None) -> dict[str, str]:
    """Host, pid and the pid's start time of the process that owns a run: what :func:`~splatflow.tracking.reap`
    checks to tell a live owner from a dead one (the start time, so a recycled pid does not count as alive)."""
    import psutil

    proc = psutil.Process(pid or os.getpid())
    return {"splatflow.host": socket.gethostname(), "splatflow.pid": str(proc.pid),
            "splatflow.pid_start": f"{proc.create_time():.3f}"}


def backend_tags(params: Any) -> dict[str, str]:
    """The training backend asked for in the params, and whether this process sees a GPU."""
    tags = {}
    train = getattr(params, "train", None)
    if train is not None and hasattr(train, "backend"):
        tags["train.backend"] = str(train.backend)
    torch = sys.modules.get("torch")  # never import torch just for a tag
    if torch is not None:  # whether a GPU exists; what each stage actually ran on is tagged by log_result
        tags["gpu_available"] = str(bool(torch.cuda.is_available())).lower()
    return tags


def device_tags(stage: str, metrics: dict) -> dict[str, str]:
    """``<stage>.backend``, ``<stage>.device_name``, ``<stage>.torch``, ... from a stage's ``device`` record
    (:func:`splatflow.pipeline.device.run_record`): the backend and versions that actually ran."""
    rec = (metrics or {}).get("device")
    if not isinstance(rec, dict):
        return {}
    return {f"{stage}.{k}": str(v) for k, v in rec.items() if isinstance(v, str)}


def flatten_params(params: Any, sections: Iterable[str] | None = None) -> dict[str, str]:
    """``Params`` (or a plain dict) -> ``{"train.lr.means": "0.00016", ...}`` for the given sections.

    A section may be a dotted key (``base.seed``), as dvc.yaml allows.  Values are strings (MLflow params are).
    """
    data = section_dict(params) if dataclasses.is_dataclass(params) else dict(params or {})
    flat = flatten(data)
    if sections is None:
        keep = flat
    else:
        prefixes = list(sections)
        keep = {k: v for k, v in flat.items() if any(k == p or k.startswith(p + ".") for p in prefixes)}
    return {k: json.dumps(v) if isinstance(v, (list, dict, tuple)) else str(v) for k, v in keep.items()}


def numeric_metrics(metrics: dict, prefix: str) -> dict[str, float]:
    """Flatten a metrics dict to finite floats named ``<prefix>.<key>``; strings/None/lists are skipped."""
    out: dict[str, float] = {}

    def walk(d: dict, pre: str) -> None:
        for k, v in d.items():
            key = f"{pre}.{k}"
            if isinstance(v, dict):
                walk(v, key)
            elif isinstance(v, bool):
                out[key] = float(v)
            elif isinstance(v, (int, float)) and math.isfinite(float(v)):
                out[key] = float(v)

    walk(metrics or {}, prefix)
    return out


def stage_sections(root: Path, stage: str) -> list[str] | None:
    """The params a stage declares in dvc.yaml (``base.seed``, ``train``); None if dvc.yaml can't say."""
    import yaml

    try:
        data = yaml.safe_load((root / "dvc.yaml").read_text()) or {}
        spec = data["stages"][stage]
    except Exception:
        return None
    spec = spec.get("do", spec)
    out = []
    for p in spec.get("params") or []:
        if isinstance(p, str):
            out.append(p)
        elif isinstance(p, dict):  # {params_file: [keys]}
            for keys in p.values():
                out.extend(keys or [])
    return out


def stage_files(root: Path, stage: str, scene: str) -> list[Path]:
    """The outs, metrics and plots of ``<stage>@<scene>`` as dvc.yaml declares them (``${key}`` filled in)."""
    import yaml

    try:
        data = yaml.safe_load((root / "dvc.yaml").read_text()) or {}
        spec = data["stages"][stage]
    except Exception:
        return []
    spec = spec.get("do", spec)
    files = []
    for field_name in ("outs", "metrics", "plots"):
        for entry in spec.get(field_name) or []:
            path = entry if isinstance(entry, str) else next(iter(entry), None)
            if isinstance(path, str):
                files.append(root / path.replace("${key}", scene).replace("${item}", scene))
    return files


def artifact_files(root: Path, stage: str, scene: str) -> list[Path]:
    """Files worth keeping in MLflow from one stage: exports, renders, reports, metrics, plots (no checkpoints)."""
    paths = ScenePaths(scene, root)
    candidates = stage_files(root, stage, scene) or [paths.metrics_json(stage)]
    candidates.append(paths.metrics_json(stage))
    out: list[Path] = []
    for c in candidates:
        if c.is_file() and c.suffix.lower() in ARTIFACT_SUFFIXES and c.stat().st_size <= MAX_ARTIFACT_BYTES:
            out.append(c)
        elif c.is_dir() and (c.name in ARTIFACT_DIR_NAMES):
            files = sorted(f for f in c.rglob("*") if f.is_file() and f.suffix.lower() in ARTIFACT_SUFFIXES
                           and f.stat().st_size <= MAX_ARTIFACT_BYTES)
            out.extend(files[:MAX_DIR_FILES])
    seen, unique = set(), []
    for f in out:
        if f.resolve() not in seen:
            seen.add(f.resolve())
            unique.append(f)
    return unique


def log_files(cl, run_id: str, root: Path, files: Iterable[Path]) -> int:
    """Log files under their repo-relative folder (``models/demo/export/scene.ply``); returns how many."""
    n = 0
    for f in files:
        try:
            rel = f.resolve().relative_to(root.resolve())
            folder = str(rel.parent) if str(rel.parent) != "." else None
        except ValueError:
            folder = None
        cl.log_artifact(run_id, str(f), artifact_path=folder)
        n += 1
    return n


def scene_metrics(root: Path, scene: str) -> dict[str, float]:
    """Every stage's current final metrics of ``scene`` (``metrics/<scene>/*.json``) as ``<stage>.<name>``."""
    out: dict[str, float] = {}
    for f in records.stage_metric_files(ScenePaths(scene, root)):
        with contextlib.suppress(Exception):
            out.update(numeric_metrics(json.loads(f.read_text()), f.stem))
    return out


def log_train_plot(cl, run_id: str, root: Path, scene: str) -> None:
    """The training curves (``train.csv``) drawn as ``plots/<scene>/train.png`` in the run; best effort."""
    csv = ScenePaths(scene, root).train_csv
    if not csv.exists():
        return

    with tempfile.TemporaryDirectory() as tmp:
        try:
            png = render_csv_png(csv, Path(tmp) / "train.png", title=f"{scene}: train")
            if png:
                cl.log_artifact(run_id, str(png), f"plots/{scene}")
        except Exception as e:  # noqa: BLE001 - a plot must never fail a stage or a flow
            warnings.warn(f"splatflow tracking: train plot of {scene} not logged: {e}", stacklevel=2)
