"""Recovery fine-tuning after pruning: plain training steps on a given model, no densification."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from splatflow.pipeline import stop
from splatflow.pipeline.config import TrainConfig
from splatflow.gaussians.model import Splats, scene_scale
from splatflow.train.loop import Trainer
from splatflow.train.schedules import BlurSchedule, ExpDecay, ResolutionSchedule, Schedules, SHSchedule


def finetune(splats: Splats, scene, steps: int, cfg: TrainConfig, *, sh_degree: int,
             seed: int = 0, progress: bool = False, backend: str | None = None,
             means_lr_factor: float | None = None, moments: dict | None = None) -> Splats:
    """Recovery fine-tuning after pruning: ``steps`` plain steps on the training views, no densification.

    Full resolution, no blur, fixed ``sh_degree`` and the rates of ``cfg.lr``. The position learning rate is
    ``cfg.lr.means`` x scene scale x ``means_lr_factor``, constant; by default (None) the factor is training's
    final one, ``cfg.lr.means_final_factor`` (the end-of-training schedule of LightGaussian's recovery step,
    Fan et al. 2023). Pruning passes a larger factor (``prune.finetune_means_lr``) so the survivors can move into
    the gaps the removed Gaussians leave. ``moments`` (optional, :meth:`GaussianState.moments`'s layout, one row
    per Gaussian of ``splats``): Adam continues from them (the trained model's own, rows selected with the kept
    Gaussians) instead of starting from zero. Returns new float32 CPU parameters in the checkpoint layout;
    ``splats`` is not modified.
    """
    cfg2 = replace(cfg, max_steps=max(int(steps), 1), progress=progress, resume=False,
                   early_stop=replace(cfg.early_stop, enabled=False),
                   backend=backend or cfg.backend)
    sc = scene_scale(np.stack([v.world_to_cam for v in scene.train_views]))
    means_f = cfg.lr.means_final_factor if means_lr_factor is None else means_lr_factor
    sched = Schedules(resolution=ResolutionSchedule((0,), (1.0,)), blur=BlurSchedule(0.0, 0),
                      sh=SHSchedule(sh_degree, 1, start_degree=sh_degree),
                      means_lr=ExpDecay(cfg.lr.means * sc * means_f, 1.0, cfg2.max_steps))
    if steps <= 0:
        return Splats.of(splats).clone()
    # the trainer draws from its own generators (seeded from ``seed``): the caller's random state is untouched
    res = Trainer(scene, cfg2, seed=seed, splats=splats, densify=False, schedules=sched, moments=moments).run()
    if stop.is_stop_label(res.stopped):  # a partial fine-tune is not a result: the caller must not use it
        raise stop.StageStopped(f"stopped by {stop.label().upper()} during a fine-tune ({res.stopped})")
    return res.splats
