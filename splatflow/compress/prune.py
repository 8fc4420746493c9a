"""Phased pruning with recovery after LightGaussian (Fan et al., "LightGaussian: Unbounded 3D Gaussian Compression
with 15x Reduction and 200+ FPS", NeurIPS 2024, arXiv:2311.17245, §3.2). Each Gaussian is ranked by the exact cost
of removing it (the default, see the deviations below) or by LightGaussian's global significance. With
``train.prune_during`` (the default) the same ranking cuts the model inside training and the prune stage only
verifies and copies it (:mod:`splatflow.train.prune_during`).

Why: densification leaves many Gaussians that barely change any pixel (tiny, transparent, or hidden behind
others). They cost memory, disk and render time for nothing. LightGaussian ranks every Gaussian by how much it
contributes to the training images and drops the least significant ones, then briefly fine-tunes the rest
("recovery") so they absorb what the removed ones did.

The scores themselves are in :mod:`splatflow.compress.scoring` (shared with pruning during training).

Phases: pruning all the way to 10% at once destroys the scene; pruning in steps with a short recovery after each
(the "prune and recover" of the paper, here repeated) lets the survivors adapt. Each phase re-scores the current
model, so a Gaussian that became important after the previous recovery is kept. Pruning stops early, keeping the
last accepted phase, when the PSNR on a few TRAINING views falls more than a tolerance below the unpruned model's
(test views stay untouched, docs/design.md §6). That check cannot see a recovery that overfits the views it trains
on, which happens on few views: a scene with fewer than ``prune.min_train_views`` training views is not pruned.

Deviations from LightGaussian, each measured on the demo scene (docs/experiments.md, Pruning, 2026-11-25), all
configurable:

- The default score is the REMOVAL cost (``prune.score: removal``), not the significance: for each Gaussian, the
  exact growth of the training views' squared error if it alone were removed (:func:`removal_scores`). The
  significance counts how much a Gaussian is seen, so a large one that merely repeats what lies behind it ranks
  first and a small one that draws an edge ranks last; the removal cost ranks by what each is worth. At 10% of
  the Gaussians it lost 2.2 dB of test PSNR where the significance lost 3.8 dB.
- Each phase cuts in ``score_rounds`` geometric steps, re-scoring the survivors before each. Single-removal
  costs cannot see redundancy: of two look-alike Gaussians each is cheap to remove while the other stays, and
  one cut drops both. After a smaller cut the remaining one becomes expensive and is kept.
- The recovery moves positions at ``prune.finetune_means_lr`` x the initial training rate: by default training's
  final one (0.01). Deep cuts of the synthetic demo recovered better at 0.3 (the survivors move into the gaps the
  removed ones leave), but on a real 360-degree capture halved once, 0.3 fitted the training views and lost
  0.4 dB more on the test views than 0.01 (bench/RESULTS.md, "Real captures").
- The recovery is long: 2,000 steps x keep^-0.5 (2,828 after halving). On real captures the cut itself costs
  1.6-2.4 dB (a trained model's Gaussians share the work: each alone is cheap to remove, half of them are not),
  and the test views recover slowly: halving a 360-degree capture's 300K model left it 0.65 dB under the unpruned
  model after 1,414 steps, 0.39 after 2,828 and 0.18 after 5,657 (bench/RESULTS.md, "Real captures").
- The recovery continues Adam from the trained model's moments (the rows of the kept Gaussians), as
  LightGaussian's recovery keeps the optimizer, instead of restarting it (``prune.finetune_adam: fresh``): a
  restarted Adam's first steps move every parameter by the full rate. Measured +0.04-0.05 dB on the test views.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import time
from collections import abc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
from tqdm.auto import tqdm

from splatflow.pipeline import device as devices
from splatflow.pipeline import stop
from splatflow.pipeline.config import PruneConfig, section_dict
from splatflow.pipeline.errors import UserError
from splatflow.gaussians.model import SPLAT_KEYS, Checkpoint, Splats, save_checkpoint
from splatflow.scene.dataset import load_scene
from splatflow.scene.images import ImageCache
from splatflow.compress.scoring import (SCORES, Camera, cameras_at, mean_psnr, removal_scores, significance,
                                        top_indices, val_indices)
from splatflow.train import finetune as _finetune
from splatflow.train.checkpoint import restore
from splatflow.train.prune_during import verify
from splatflow.train.state import GaussianState, select_moments

log = logging.getLogger("splatflow.prune")

# A recovery fine-tune: (splats, sh_degree, steps, description, rows) -> fine-tuned splats (detached float32 CPU);
# ``rows`` are the indices of the Gaussians of ``splats`` in the model given to :func:`prune_phases`
FinetuneFn = Callable[[Splats, int, int, str, torch.Tensor], Splats]


def keep_schedule(keep_first: float, keep_decay: float, phases: int) -> list[float]:
    """Cumulative keep fractions of the original count, one per phase; phases that keep everything are dropped.

    Default 0.6 * 0.7^k for k = 0..5: 0.60, 0.42, 0.294, 0.206, 0.144, 0.101.
    """
    fracs = [keep_first * keep_decay ** k for k in range(phases)]
    return [f for f in fracs if f < 1.0]


# --------------------------------------------------------------------------------------------- driver


@dataclass
class PruneResult:
    splats: Splats
    report: dict = field(default_factory=dict)


def prune_phases(splats: Splats, sh_degree: int, cfg: PruneConfig, *, score_cameras: Sequence[Camera],
                 val_cameras: Sequence[Camera], val_targets: Sequence[torch.Tensor], keep_fractions: Sequence[float],
                 finetune: FinetuneFn | None, score_targets: Sequence[torch.Tensor] | None = None,
                 phase_callback: Callable[[dict, dict], None] | None = None, resume: dict | None = None,
                 on_accepted: Callable[[dict], None] | None = None) -> PruneResult:
    """Prune ``splats`` in phases down to ``keep_fractions`` (of the ORIGINAL count), recovering after each.

    Each phase, with the settings of ``cfg`` (:class:`splatflow.pipeline.config.PruneConfig`): score the current model
    on ``score_cameras`` (training views; ``cfg.score`` is "significance" or "removal", which needs the images
    ``score_targets``), keep the top ``round(fraction * N0)`` (in ``cfg.score_rounds`` geometric cuts, re-scoring
    before each), fine-tune ``cfg.finetune_steps * fraction**-cfg.finetune_growth`` steps, measure validation PSNR.
    A phase whose PSNR is more than ``cfg.max_psnr_drop_db`` below the unpruned model's is rejected and pruning
    stops; the result is the last accepted phase (the unpruned model if the first phase is rejected).
    ``phase_callback(record, splats)`` is called after every phase (accepted or not), e.g. for the benchmark's
    test-view PSNR.

    ``on_accepted(state)`` receives, after each accepted phase, everything needed to continue after it; passing
    such a ``state`` back as ``resume`` (same inputs) skips the phases it finished, so a killed run loses at most
    one phase (the recovery fine-tune is seeded, so the result is the same as without the interruption).

    Returns the splats and a report with the keys of ``metrics/S/prune.json``.
    """
    if cfg.score not in SCORES:
        raise ValueError(f"score must be one of {SCORES}, got {cfg.score!r}")
    if cfg.score == "removal" and (score_targets is None or len(score_targets) != len(score_cameras)):
        raise ValueError("score='removal' needs one target image per score camera")
    splats = Splats.of(splats)
    n0 = splats.n
    if n0 == 0:
        raise UserError("the trained checkpoint holds no Gaussians; rerun the train stage")
    current = splats.clone()
    rows = torch.arange(n0)  # current's Gaussians as rows of ``splats`` (the fine-tune's Adam state follows them)
    first_phase = 1
    if resume is not None:
        current = Splats.of(resume["splats"]).to(splats.device)
        rows = resume["rows"].to(torch.int64)
        report = copy.deepcopy(resume["report"])
        psnr_before, accepted_psnr = report["val_psnr_before"], resume["accepted_psnr"]
        first_phase = int(resume["next_phase"])
    else:
        psnr_before = mean_psnr(current, sh_degree, val_cameras, val_targets, cfg.backend)
        report: dict = {
            "gaussians_before": n0,
            "size_mb_before": round(current.size_mib, 4),
            "val_psnr_before": psnr_before,
            "phases": [],
            "stopped_early": 0,  # 0/1: a measure (metrics files hold numbers)
            "stop_reason": None,
        }
        accepted_psnr = psnr_before
    floor_db = psnr_before - cfg.max_psnr_drop_db
    bar = tqdm(list(enumerate(keep_fractions, start=1)), desc="prune phases", disable=not cfg.progress)
    for phase, frac in bar:
        if phase < first_phase:  # finished by the run this one resumes
            continue
        t0 = time.perf_counter()
        n_keep = max(1, int(round(frac * n0)))
        n_cur = current.n
        if n_keep >= n_cur:  # the schedule asks for nothing new (e.g. decay 1.0)
            continue
        candidate, cand_rows = current, rows
        rounds = cfg.score_rounds
        for r in range(1, rounds + 1):  # geometric sub-cuts, each re-scored without the ones cut before
            n_sub = n_keep if r == rounds else int(round(n_cur * (n_keep / n_cur) ** (r / rounds)))
            if cfg.score == "removal":
                scores = removal_scores(candidate, sh_degree, score_cameras, score_targets, progress=cfg.progress)
            else:
                scores = significance(candidate, score_cameras, beta=cfg.volume_beta,
                                      ref_quantile=cfg.volume_ref_quantile, backend=cfg.backend,
                                      progress=cfg.progress)
            top = top_indices(scores, n_sub)
            candidate, cand_rows = candidate.select(top), cand_rows[top.to(cand_rows.device)]
        steps = int(round(cfg.finetune_steps * float(frac) ** -cfg.finetune_growth)) if finetune is not None else 0
        if steps > 0:
            candidate = finetune(candidate, sh_degree, steps, f"recover phase {phase}", cand_rows)
        val = mean_psnr(candidate, sh_degree, val_cameras, val_targets, cfg.backend)
        ok = bool(val >= floor_db)
        record = {"phase": phase, "keep_fraction": round(float(frac), 6), "gaussians": n_keep,
                  "size_mb": round(candidate.size_mib, 4), "val_psnr": val, "finetune_steps": steps,
                  "accepted": ok, "seconds": round(time.perf_counter() - t0, 3)}
        report["phases"].append(record)
        bar.set_postfix(gaussians=n_keep, val_psnr=f"{val:.2f}")
        if phase_callback is not None:
            phase_callback(record, candidate)
        if not ok:
            report["stopped_early"] = 1
            report["stop_reason"] = (f"phase {phase} (keep {frac:.3f}) gave validation PSNR {val:.2f} dB, more "
                                     f"than {cfg.max_psnr_drop_db:g} dB below the unpruned {psnr_before:.2f} dB; "
                                     f"kept phase {phase - 1}")
            break
        current, rows, accepted_psnr = candidate, cand_rows, val
        if on_accepted is not None:
            on_accepted({"splats": current, "rows": rows, "report": report, "accepted_psnr": val,
                         "next_phase": phase + 1})
    bar.close()
    report.update({
        "gaussians_after": current.n,
        "size_mb_after": round(current.size_mib, 4),
        "val_psnr_after": accepted_psnr,
    })
    return PruneResult(current, report)


def trained_moments(ckpt: Checkpoint) -> dict | None:
    """The Adam moments of a trained checkpoint's Gaussians, rows up to date (:meth:`GaussianState.moments`), or
    None when it holds no optimizer state (a model imported or written without one: the recovery then starts
    Adam from zero)."""
    st = ckpt.train or {}
    if set(st.get("optimizers") or {}) != set(SPLAT_KEYS) or "strategy_state" not in st:
        return None
    gs = GaussianState(ckpt.splats, {k: 1.0 for k in SPLAT_KEYS}, "cpu")
    restore(gs, ckpt)
    return gs.moments(copy=False)


def val_set(scene, n_views: int, factor: float, image_cache_mb: int = 256) -> tuple[list[Camera], list[torch.Tensor]]:
    """Validation cameras and targets: ``n_views`` evenly spaced TRAINING views at ``factor`` (never test views).

    Images come from the training image cache (area-downsampled, intrinsics scaled to match).
    """
    idx = val_indices(len(scene.train_views), n_views)
    images = CachedImages([scene.train_views[i] for i in idx], factor, image_cache_mb)
    return cameras_at(images.cache.views, factor), list(images)


class CachedImages(abc.Sequence):
    """The TRAINING images ``[H, W, 3]`` at ``factor``, decoded on demand through an LRU
    :class:`~splatflow.scene.images.ImageCache` of ``image_cache_mb`` (all views of a large scene at full
    resolution need not fit in memory at once). Matches :func:`cameras_at` view for view."""

    def __init__(self, views: Sequence, factor: float, image_cache_mb: int = 256):
        self.cache = ImageCache(views, image_cache_mb)
        self.factor = float(factor)

    def __len__(self) -> int:
        return len(self.cache.views)

    def __getitem__(self, i: int) -> torch.Tensor:
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self.cache.get(i, self.factor)[0]


def run_prune(cfg, train_cfg, *, train_ckpt, out_ckpt, undistorted_dir=None, split_json=None, scene=None,
              seed: int = 0, phase_callback: Callable[[dict, dict], None] | None = None,
              phases_ckpt=None) -> dict:
    """The prune stage's work: read the trained checkpoint, prune (or copy), write ``out_ckpt``, return metrics.

    ``cfg`` is :class:`splatflow.pipeline.config.PruneConfig`; ``train_cfg`` the :class:`TrainConfig` whose learning
    rates and loss the recovery fine-tune (:func:`splatflow.train.finetune`) reuses. ``scene`` (a ``SceneData``) may
    be given instead of ``undistorted_dir``/``split_json``. The written checkpoint holds ``splats``,
    ``sh_degree`` and the training ``step`` only (no optimizer state).

    ``phases_ckpt`` (optional path): the state after each accepted phase is written there, and a run with the same
    inputs (trained checkpoint, split, prune/train params, seed) continues after the last phase found there; the
    file is removed once ``out_ckpt`` is written.
    """
    run_dev = devices.resolve(cfg.backend)  # the validation renders and the recovery fine-tunes run here
    devices.reset_peak_memory(run_dev)
    ckpt = Checkpoint.load(train_ckpt)  # validated float32 CPU splats
    splats, sh_degree = ckpt.splats, ckpt.sh_degree
    if scene is None:
        scene = load_scene(undistorted_dir, split_json)
    if not scene.train_views:
        raise UserError(f"{split_json}: no training views; check the split stage's output and params")

    schedule = keep_schedule(cfg.keep_first, cfg.keep_decay, cfg.phases) if cfg.enabled else []
    val_cams, val_targets = val_set(scene, cfg.val_views, cfg.val_factor)

    during = (ckpt.prune_during or {}).get("report") or {}
    if during.get("cuts"):  # pruned inside training (train.prune_during): verify and copy, never cut again
        result = PruneResult(splats.clone(),
                             verify(during, splats, mean_psnr(splats, sh_degree, val_cams, val_targets, cfg.backend)))
    elif not schedule or len(scene.train_views) < cfg.min_train_views:  # no-op: copy, still measure and write
        psnr = mean_psnr(splats, sh_degree, val_cams, val_targets, cfg.backend)
        if not cfg.enabled:
            why = "prune.enabled is false"
        elif not schedule:
            why = "the keep schedule keeps every Gaussian"
        else:
            why = (f"{len(scene.train_views)} training views, fewer than prune.min_train_views "
                   f"({cfg.min_train_views}): a recovery on so few views fits them and loses the others, unseen "
                   "by the check on training views")
        result = PruneResult(splats.clone(), {
            "gaussians_before": splats.n, "size_mb_before": round(splats.size_mib, 4),
            "val_psnr_before": psnr, "phases": [], "stopped_early": 0, "stop_reason": f"no-op: {why}",
            "gaussians_after": splats.n, "size_mb_after": round(splats.size_mib, 4), "val_psnr_after": psnr})
    else:
        moments = trained_moments(ckpt) if cfg.finetune_adam == "trained" and cfg.finetune_steps > 0 else None

        def recover(s: Splats, deg: int, steps: int, desc: str, rows: torch.Tensor) -> Splats:
            return _finetune(s, scene, steps, train_cfg, sh_degree=deg, seed=seed, progress=cfg.progress,
                             backend=cfg.backend, means_lr_factor=cfg.finetune_means_lr,
                             moments=None if moments is None else select_moments(moments, rows))

        score_cams = cameras_at(scene.train_views, cfg.score_factor)
        score_targets = (CachedImages(scene.train_views, cfg.score_factor, train_cfg.image_cache_mb)
                         if cfg.score == "removal" else None)
        resume, key = None, None
        if phases_ckpt is not None:
            key = phases_key(train_ckpt, split_json, cfg, train_cfg, seed)
            resume = load_phases(phases_ckpt, key)
        result = prune_phases(
            splats, sh_degree, cfg, score_cameras=score_cams, val_cameras=val_cams, val_targets=val_targets,
            keep_fractions=schedule, finetune=recover, score_targets=score_targets, phase_callback=phase_callback,
            resume=resume,
            on_accepted=None if phases_ckpt is None else lambda state: save_phases(phases_ckpt, key, state))
        result.report["resumed_after_phase"] = None if resume is None else int(resume["next_phase"]) - 1

    result.splats.to_checkpoint(sh_degree, step=ckpt.step, rasterize_mode=ckpt.rasterize_mode).save(out_ckpt)  # no optimizer or resume state
    r = result.report
    order = ("gaussians_before", "gaussians_after", "size_mb_before", "size_mb_after", "val_psnr_before",
             "val_psnr_after", "phases", "stopped_early", "stop_reason")
    metrics = {k: r[k] for k in order}
    metrics.update({"keep_fraction_final": r["gaussians_after"] / max(1, r["gaussians_before"]),
                    "val_views": len(val_cams), "val_factor": cfg.val_factor, "sh_degree": sh_degree,
                    "device": devices.run_record(run_dev)})
    if r.get("resumed_after_phase") is not None:
        metrics["resumed_after_phase"] = r["resumed_after_phase"]
    if phases_ckpt is not None:
        Path(phases_ckpt).unlink(missing_ok=True)  # the result is written: nothing left to resume
    return metrics


# --------------------------------------------------------------------------------------------- phase checkpoints


def phases_key(train_ckpt, split_json, cfg, train_cfg, seed: int) -> str:
    """Digest of everything a phase's result depends on: a saved phase is only reused for the same inputs."""
    h = hashlib.sha256()
    for f in (train_ckpt, split_json):
        if f is not None and Path(f).exists():
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
    quiet = {"progress", "log_every", "checkpoint_every", "resume"}  # cannot change a result
    settings = {"prune": {k: v for k, v in section_dict(cfg).items() if k not in quiet},
                "train": {k: v for k, v in section_dict(train_cfg).items() if k not in quiet}, "seed": seed}
    h.update(json.dumps(settings, sort_keys=True, default=str).encode())
    return h.hexdigest()[:32]


def save_phases(path, key: str, state: dict) -> None:
    """Write the state after a finished phase; a SIGTERM meanwhile waits for the write, then stops the run."""
    splats = Splats.of(state["splats"]).stored()
    with stop.cooperative():  # the splats as a dict, the 3D smoothing filter in it when the model has one
        save_checkpoint(path, {"key": key, "splats": {**splats.as_dict(), **({} if splats.filter_3d is None else
                                                                            {"filter_3d": splats.filter_3d})},
                               "rows": state["rows"], "report": state["report"],
                               "accepted_psnr": state["accepted_psnr"],
                               "next_phase": state["next_phase"]})
    stop.raise_if_requested(f"after saving prune phase {state['next_phase'] - 1} to {path}")


def load_phases(path, key: str) -> dict | None:
    """The saved state after the last finished phase, or None (absent, unreadable, or other inputs)."""
    if not Path(path).exists():
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - a damaged file only costs the phases it held
        log.warning("%s: not resuming pruning (unreadable: %s)", path, e)
        return None
    if state.get("key") != key:
        log.info("%s: not resuming pruning (written for other inputs or params)", path)
        return None
    log.info("%s: resuming pruning after phase %d", path, int(state["next_phase"]) - 1)
    return state
