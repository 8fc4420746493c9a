"""A training run's checkpoint: what an exact resume needs, written as a :class:`splatflow.gaussians.model.Checkpoint`.

Besides the parameters and the SH degree, a training checkpoint carries the whole state of the run as its
``train`` entries (docs/CONTRACTS.md "Checkpoint"): the Gaussians' state (:class:`~splatflow.train.state.
GaussianState`: Adam's moments, the strategy's per-row statistics, the sparse step's bookkeeping), the stopper's
state, the run's random generators, the step, the elapsed time, the refine events, and the hash of the settings
that shape the trajectory. A run resumes only from an unfinished checkpoint of the same settings, seed and scene
(:func:`resumable`), and then continues bit for bit as if it had not stopped. Every tensor is written on the CPU
and moved to the run's device on resume, so a run started on a GPU can finish on a CPU and the other way round.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import time
from pathlib import Path

from splatflow.pipeline.config import TrainConfig, section_dict
from splatflow.pipeline.device import to_device
from splatflow.pipeline.errors import UserError
from splatflow.gaussians.model import Checkpoint
from splatflow.train.state import GaussianState

log = logging.getLogger("splatflow.train")

# settings that cannot change a run's trajectory: a checkpoint written with other values still resumes
QUIET_SETTINGS = ("progress", "log_every", "checkpoint_every", "resume", "image_cache_mb")


def config_hash(cfg: TrainConfig) -> str:
    """Hash of the settings that shape the trajectory (resume only continues a run of the same config)."""
    d = section_dict(cfg)
    for k in QUIET_SETTINGS:
        d.pop(k, None)
    if not d.get("filter_3d"):  # off: the hash of the settings before the switch existed (their checkpoints resume)
        d.pop("filter_3d", None)
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def identity(cfg: TrainConfig, seed: int, scene) -> dict:
    """What an unfinished checkpoint must share with a run to be resumed by it: the hash of the trajectory's
    settings, the seed and the scene's fingerprint (:meth:`splatflow.scene.dataset.SceneData.fingerprint`; None for
    a scene object without one)."""
    fp = getattr(scene, "fingerprint", None)
    return {"config_hash": config_hash(cfg), "scene_hash": fp() if callable(fp) else None, "seed": seed}


def capture(gs: GaussianState, train: dict, *, step: int, sh_degree: int, finished: bool,
            prune_during: dict | None = None, rasterize_mode: str = "classic") -> Checkpoint:
    """The checkpoint of a run now, every tensor on the CPU: the Gaussians' :meth:`GaussianState.state_dict`
    whole (its ``splats`` as the checkpoint's, the rest as ``train`` entries), the run's own ``train`` entries
    (identity, stopper, generators, time, events, ...) and ``train.prune_during``'s state."""
    g = gs.state_dict()
    splats = g.pop("splats")
    return Checkpoint(splats=splats, sh_degree=sh_degree, step=step, finished=finished,
                      prune_during=None if prune_during is None else to_device(prune_during, "cpu"),
                      train={**train, **g}, rasterize_mode=rasterize_mode)


def restore(gs: GaussianState, ckpt: Checkpoint) -> dict:
    """Put the Gaussians of ``ckpt`` into ``gs`` (on its device); returns the checkpoint's ``train`` entries, for
    the run's own state."""
    st = ckpt.train
    gs.load_state_dict({"splats": ckpt.splats, "optimizers": st["optimizers"],
                        "strategy_state": st["strategy_state"], "sparse": st.get("sparse")})
    return st


def _set_aside(path, error: Exception) -> None:
    """Move an unreadable checkpoint out of the way and say so: training starts from step 0, and the file stays
    beside the new one (``ckpt.pt.unreadable-<time>``) for the user to inspect or delete, since it may be the only
    copy of hours of training."""
    path = Path(path)
    reason = str(error).removeprefix(f"{path}: ").split("; delete it")[0].split(". ")[0]  # torch adds advice
    reason += ")" * (reason.count("(") - reason.count(")"))
    aside = path.with_name(f"{path.name}.unreadable-{time.strftime('%Y%m%dT%H%M%S')}")
    try:
        path.rename(aside)
    except OSError as e:  # a read-only folder: leave it; the run's own first save replaces it
        print(f"{path}: cannot be read ({reason}) and cannot be moved aside ({e}); training starts from step 0 and "
              f"its first checkpoint replaces it", file=sys.stderr, flush=True)
        return
    print(f"{path}: cannot be read ({reason}); moved it to {aside} (kept: delete it when you no longer need it); "
          f"training starts from step 0", file=sys.stderr, flush=True)


def resumable(path: Path | None, ident: dict, *, enabled: bool = True) -> Checkpoint | None:
    """The unfinished checkpoint at ``path`` of a run with identity ``ident`` (:func:`identity`), or None. A
    missing or finished checkpoint starts afresh quietly; an unreadable one (truncated by a full disk, damaged in
    a copy) is moved aside, kept, and named on stderr; an unfinished one written with other settings, another seed
    or on other scene data (new photos, a new SfM model, another split) starts afresh and says why on stderr, and
    so does a resume."""
    if not (enabled and path and path.exists()):
        return None
    try:
        ckpt = Checkpoint.load(path)
    except UserError as e:
        _set_aside(path, e)
        return None
    if not ckpt.resumable:
        log.info("%s: not resuming (a finished run)", path)
        return None
    why = []
    if ckpt.train.get("config_hash") != ident["config_hash"]:
        why.append("the train params differ")
    if ckpt.train.get("seed") != ident["seed"]:
        why.append(f"the seed differs ({ckpt.train.get('seed')} there, {ident['seed']} now)")
    if ckpt.train.get("scene_hash") != ident["scene_hash"]:
        why.append("the scene's data differ (images, SfM model or split)" if ckpt.train.get("scene_hash")
                   else "it does not record which scene data it was trained on")
    if why:
        print(f"{path}: an unfinished run stopped at step {ckpt.step}, not resumed because "
              f"{' and '.join(why)}; training starts afresh", file=sys.stderr, flush=True)
        return None
    print(f"{path}: resuming the unfinished run from step {ckpt.step} (same params, seed and scene data)",
          file=sys.stderr, flush=True)
    return ckpt
