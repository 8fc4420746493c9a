"""A training run's checkpoint: what an exact resume needs, written as a :class:`splatflow.model.Checkpoint`.

Besides the parameters and the SH degree, a training checkpoint carries the whole state of the run as its
``train`` entries (docs/CONTRACTS.md "Checkpoint"): Adam's moments, the strategy's and the stopper's state, the
run's random generators, the step, the elapsed time, the refine events, and the hash of the settings that shape
the trajectory. A run resumes only from an unfinished checkpoint of the same settings and seed
(:func:`try_resume`), and then continues bit for bit as if it had not stopped. Every tensor is written on the CPU
and moved to the run's device on resume, so a run started on a GPU can finish on a CPU and the other way round.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys

import torch

from splatflow.config import TrainConfig, section_dict
from splatflow.device import to_device
from splatflow.errors import UserError
from splatflow.model import SPLAT_KEYS, Checkpoint, Splats
from splatflow.train.optim import adam
from splatflow.train.sparse import SparseAdam

log = logging.getLogger("splatflow.train")

# settings that cannot change a run's trajectory: a checkpoint written with other values still resumes
QUIET_SETTINGS = ("progress", "log_every", "checkpoint_every", "resume", "image_cache_mb")


def config_hash(cfg: TrainConfig) -> str:
    """Hash of the settings that shape the trajectory (resume only continues a run of the same config)."""
    d = section_dict(cfg)
    for k in QUIET_SETTINGS:
        d.pop(k, None)
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def scene_hash(tr) -> str | None:
    """The fingerprint of trainer ``tr``'s scene (:meth:`splatflow.scene.dataset.SceneData.fingerprint`), once
    per trainer; None for a scene object without one."""
    if not hasattr(tr, "_scene_hash"):
        fp = getattr(tr.scene, "fingerprint", None)
        tr._scene_hash = fp() if callable(fp) else None
    return tr._scene_hash


def capture(tr, finished: bool, stopped: str = "") -> Checkpoint:
    """The checkpoint of trainer ``tr`` now, with every tensor on the CPU."""
    train = {
        "stopped": stopped,
        "config_hash": config_hash(tr.cfg),
        "scene_hash": scene_hash(tr),
        "seed": tr.seed,
        "scene_scale": tr.scene_scale,
        "initial_count": tr.initial_count,
        "optimizers": to_device({k: o.state_dict() for k, o in tr.optimizers.items()}, "cpu"),
        "strategy_state": to_device(tr.strategy_state, "cpu"),
        "stopper": tr.stopper.state_dict(),
        "rng": tr.rng.state_dict(),
        "elapsed_seconds": tr.elapsed_s,
        "events": tr.events,
        "val_psnr": tr.val_psnr,
    }
    sparse = getattr(tr, "sparse", None)
    if sparse is not None and sparse.pending:  # an unfinished checkpoint of the sparse step: rows still behind
        train["sparse"] = sparse.state_dict()
    return Splats.of(tr.params).to_checkpoint(
        tr.sched.sh.degree(max(tr.step - 1, 0)), tr.step, finished=finished,
        prune_during=to_device(tr.pruner.state_dict(), "cpu") if tr.pruner is not None else None, train=train)


def restore(tr, ckpt: Checkpoint | dict) -> None:
    """Put the state of ``ckpt`` (a :class:`Checkpoint` or its dict) into trainer ``tr``, on its device."""
    if not isinstance(ckpt, Checkpoint):
        ckpt = Checkpoint.from_dict(ckpt, str(tr.ckpt_path or "checkpoint"))
    st = ckpt.train
    tr.params = {k: torch.nn.Parameter(ckpt.splats[k].to(tr.device, copy=True)) for k in SPLAT_KEYS}
    for k in SPLAT_KEYS:
        opt = adam(tr.params[k], 1.0)  # the learning rate comes with the state
        opt.load_state_dict(to_device(st["optimizers"][k], tr.device))
        tr.optimizers[k] = opt
    tr.strategy_state = to_device(st["strategy_state"], tr.device)
    tr.initial_count = int(st["initial_count"])
    tr.stopper.load_state_dict(st["stopper"])
    tr.rng.load_state_dict(st["rng"])
    tr.step = ckpt.step
    tr.elapsed_s = float(st["elapsed_seconds"])
    tr.events = list(st.get("events", []))
    tr.val_psnr = st.get("val_psnr")
    _restore_sparse(tr, st.get("sparse"))
    if tr.pruner is not None and ckpt.prune_during:
        tr.pruner.load_state_dict(ckpt.prune_during)


def _restore_sparse(tr, state: dict | None) -> None:
    """The sparse step's bookkeeping (train.sparse_step): rows the checkpoint holds behind their Adam count
    continue from there; a run without the sparse step brings them up to date at once."""
    sparse = getattr(tr, "sparse", None)
    if state is None:
        if sparse is not None:
            sparse.sync(tr.params, tr.optimizers, force=True)
        return
    lazy = sparse or SparseAdam(tr.params, tr.optimizers)
    lazy.load_state_dict(to_device(state, "cpu"), tr.params, tr.optimizers)
    if sparse is None:
        lazy.flush(tr.params, tr.optimizers)


def _set_aside(path, error: Exception) -> None:
    """Move an unreadable checkpoint out of the way and say so: training starts from step 0, and the file stays
    beside the new one (``ckpt.pt.unreadable-<time>``) for the user to inspect or delete, since it may be the only
    copy of hours of training."""
    import time
    from pathlib import Path

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


def try_resume(tr) -> bool:
    """Continue trainer ``tr`` from an unfinished checkpoint of the same config, seed and scene at
    ``tr.ckpt_path``; True if it did. A missing or finished checkpoint starts afresh quietly; an unreadable one
    (truncated by a full disk, damaged in a copy) is moved aside, kept, and named on stderr; an unfinished one
    written with other settings, another seed or on other scene data (new photos, a new SfM model, another split)
    starts afresh and says why on stderr, and so does a resume."""
    if not (tr.cfg.resume and tr.ckpt_path and tr.ckpt_path.exists()):
        return False
    try:
        ckpt = Checkpoint.load(tr.ckpt_path)
    except UserError as e:
        _set_aside(tr.ckpt_path, e)
        return False
    if not ckpt.resumable:
        log.info("%s: not resuming (a finished run)", tr.ckpt_path)
        return False
    why = []
    if ckpt.train.get("config_hash") != config_hash(tr.cfg):
        why.append("the train params differ")
    if ckpt.train.get("seed") != tr.seed:
        why.append(f"the seed differs ({ckpt.train.get('seed')} there, {tr.seed} now)")
    if ckpt.train.get("scene_hash") != scene_hash(tr):
        why.append("the scene's data differ (images, SfM model or split)" if ckpt.train.get("scene_hash")
                   else "it does not record which scene data it was trained on")
    if why:
        print(f"{tr.ckpt_path}: an unfinished run stopped at step {ckpt.step}, not resumed because "
              f"{' and '.join(why)}; training starts afresh", file=sys.stderr, flush=True)
        return False
    print(f"{tr.ckpt_path}: resuming the unfinished run from step {ckpt.step} (same params, seed and scene data)",
          file=sys.stderr, flush=True)
    restore(tr, ckpt)
    return True
