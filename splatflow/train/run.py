"""A training run's parts around the loop (:mod:`.loop`): its wiring (device, plan, views, the Gaussians' state,
the policies, the plateau stop, the checks), its renders and validation, its checkpoints and its result.

The wiring builds everything a run needs once, from the train settings: the device, the plan (:mod:`.plan`), the
training views (:mod:`.views`), the :class:`~splatflow.train.state.GaussianState` with its optimizers, the hook
policies in hook order and the optimizer step (:func:`splatflow.train.policies.for_run`), the plateau stop and
the guards (:mod:`.guards`: immediate on the CPU, deferred on a GPU).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from splatflow.pipeline.config import TrainConfig
from splatflow.pipeline.device import gpu_memory_gib, reset_peak_memory, run_record
from splatflow.pipeline.device import resolve as resolve_device
from splatflow.pipeline.errors import UserError
from splatflow.gaussians.model import SPLAT_KEYS, Checkpoint, Splats, init_splats, scene_scale
from splatflow.train import checkpoint, plan, policies
from splatflow.train.appearance import Appearance
from splatflow.train.guards import DeferredChecks, StepChecks
from splatflow.train.hooks import LoopContext
from splatflow.train.prune_during import PruneDuring
from splatflow.train.result import TrainResult
from splatflow.train.rng import RunRNG
from splatflow.train.rows import spatial_order
from splatflow.train.schedules import PlateauStopper, Schedules
from splatflow.train.sink import MetricsSink
from splatflow.train.state import GaussianState
from splatflow.train.views import TrainingViews, render_psnr


class TrainingRun:
    """A run training Gaussians on ``scene.train_views`` (never ``test_views``).

    ``splats`` (optional) starts from given parameters instead of the SfM points (fine-tuning);
    ``densify=False`` switches densification and pruning off; ``schedules`` overrides the ones built from ``cfg``.
    ``stop_after`` ends the run early at that step with a resumable checkpoint (tests, SIGTERM drills).
    ``watchers`` see the run after every step through its sink (:meth:`MetricsSink.step`; the live view).
    ``moments`` (with ``splats``): Adam's state of those Gaussians to continue from
    (:meth:`GaussianState.moments`'s layout); without it Adam starts from zero.
    """

    def __init__(self, scene, cfg: TrainConfig, *, ckpt_path: str | Path | None = None,
                 csv_path: str | Path | None = None, seed: int = 0, splats: dict | None = None,
                 densify: bool = True, schedules: Schedules | None = None, stop_after: int | None = None,
                 step_logger=None, watchers=(), moments: dict | None = None):
        if not scene.train_views:
            raise UserError("no training views: the split left every view in the test set; check data/<scene>/"
                            "split.json and the split params")
        self.run_device = resolve_device(cfg.backend)  # one device for every tensor of the run
        self.device = self.run_device.device
        # train.max_steps / densify.max_gaussians "auto": sized from the scene and the device, once (plan.py)
        self.plan = plan.resolve(cfg, scene.train_views, self.run_device.backend, gpu_memory_gib(self.device))
        self.scene, self.cfg, self.seed = scene, (cfg := plan.apply(cfg, self.plan)), seed
        self.ckpt_path, self.stop_after = Path(ckpt_path) if ckpt_path else None, stop_after
        # plots/S/train.csv, the log, the tracking step logger and the watchers (the live view)
        self.sink = MetricsSink(csv_path, step_logger, watchers)
        self.compile_seconds: float | None = None
        # the views: images decoded on the host and uploaded per step, cameras on the device, training windows
        # this run's own generators: Python's drawn directly (view order, windows), torch's lent per step
        self.rng = RunRNG(seed, self.device)
        self.data = TrainingViews(scene.train_views, cfg, self.device, cfg.window_pixels(self.run_device.backend),
                                  rng=self.rng.python)
        self.views, self.cache, self.viewmats = self.data.views, self.data.cache, self.data.viewmats
        self.window_pixels = self.data.window_pixels  # train.patch_max_pixels, "auto" resolved
        reset_peak_memory(self.run_device)
        self.scene_scale = scene_scale(np.stack([v.world_to_cam for v in self.views]))  # training cameras only
        self.sched = schedules or Schedules.from_config(cfg, self.scene_scale)
        cpu = self.run_device.backend == "cpu"
        self.spatial_order = cfg.spatial_order and cpu  # rows in Morton order (splats handed in: after an event)
        if splats is None:
            splats = init_splats(scene.points, scene.colors, sh_degree=cfg.sh_degree,
                                 init_opacity=cfg.init_opacity, init_scale=cfg.init_scale)
            perm = spatial_order(splats["means"]) if self.spatial_order else None
            splats = splats if perm is None else {k: splats[k].index_select(0, perm) for k in SPLAT_KEYS}
        splats = Splats.of(splats, "the initial splats").validate("the initial splats", "check where they come from")
        self.initial_count = splats.n
        self.run_policies = policies.for_run(cfg, cpu=cpu, densify=densify, initial_count=splats.n,
                                             views=self.views, device=self.device)
        lrs = {"means": self.sched.means_lr.lr(0), "scales": cfg.lr.scales, "quats": cfg.lr.quats,
               "opacities": cfg.lr.opacities, "sh0": cfg.lr.sh0, "shN": cfg.lr.shN}
        self.state = GaussianState(splats, lrs, self.device, sparse=self.adam.sparse)
        if moments is not None:
            self.state.set_moments(moments)
        for p in self.policies:
            p.initialize(self.state, self.scene_scale)
        es = cfg.early_stop
        patience = max(es.eval_every, int(round(es.patience_steps * cfg.max_steps / es.reference_steps)))
        self.stopper = PlateauStopper(patience, es.min_delta_db,
                                      active_from=max(self.sched.resolution.last_start, self.sched.blur.end_step))
        self.ctx = LoopContext(self.validate, self.stopper, self.sched.sh.degree, self.views, self.cache,
                               self.sink.step_logger)
        self.step, self.elapsed_s, self.events, self.val_psnr = 0, 0.0, [], None
        self.resumed_from: int | None = None
        # a GPU reads nothing back per step (guards.DeferredChecks); on the CPU a read costs nothing
        self.checks = DeferredChecks() if self.device.type == "cuda" else StepChecks()
        self._identity: dict | None = None

    @property
    def policies(self) -> list:
        """The hook policies in hook order (:func:`splatflow.train.policies.for_run`)."""
        return self.run_policies.hooks

    @property
    def adam(self) -> policies.AdamStep:
        """The run's optimizer step."""
        return self.run_policies.adam

    @property
    def pruner(self) -> PruneDuring | None:
        """Pruning during training (its state checkpointed, its report in the result), or None."""
        return self.run_policies.pruner

    @property
    def appearance(self) -> Appearance | None:
        """The per-view appearance transforms (their state checkpointed, their report in the result), or None."""
        return self.run_policies.appearance

    @property
    def strategy(self):
        """The densification strategy (gsplat's protocol), or None; assigning one plugs it in (a fresh state)."""
        return self.run_policies.densify.strategy if self.run_policies.densify is not None else None

    @strategy.setter
    def strategy(self, strategy) -> None:
        self.run_policies = policies.with_strategy(self.run_policies, self.state, strategy, self.scene_scale)

    # ------------------------------------------------------------------------------------------ rendering
    def render(self, i: int, factor: float, sh_degree: int, background: torch.Tensor | None = None,
               patch: bool = False, sparse: bool = False):
        """Training view ``i`` rendered from the state (:meth:`splatflow.train.views.TrainingViews.render`)."""
        return self.data.render(self.state.params, i, factor, sh_degree, background, patch, sparse,
                                self.state.filter_3d)

    @torch.no_grad()
    def validate(self) -> float:
        """Mean PSNR over the validation subset of TRAINING views at ``early_stop.val_factor`` (no blur)."""
        self.state.flush()
        deg = self.sched.sh.degree(self.step)
        return float(np.mean([render_psnr(rgb, target, vinfo["loss_mask"]) for rgb, target, vinfo in
                              (self.render(i, self.cfg.early_stop.val_factor, deg) for i in self.data.val_ids)]))

    @torch.no_grad()
    def row_psnr(self) -> float:
        """PSNR of the last :meth:`train_step`'s render against its target (over the kept pixels with a mask),
        computed only for the rows the loop logs; both are the step's own tensors."""
        return render_psnr(*self._psnr_inputs)

    # ------------------------------------------------------------------------------------------ checkpoints
    def state_dict(self, finished: bool, stopped: str = "") -> Checkpoint:
        """Everything an exact resume needs, every tensor on the CPU (:func:`splatflow.train.checkpoint.capture`).
        A finished run's rows are brought up to date first; an unfinished one's are written as they are, with the
        sparse step's bookkeeping, so a resume continues bit for bit."""
        if finished:
            self.state.flush()
        self._identity = self._identity or checkpoint.identity(self.cfg, self.seed, self.scene)
        run = {"stopped": stopped, **self._identity, "scene_scale": self.scene_scale,
               "initial_count": self.initial_count, "stopper": self.stopper.state_dict(),
               "rng": self.rng.state_dict(), "elapsed_seconds": self.elapsed_s, "events": self.events,
               "val_psnr": self.val_psnr}
        if self.appearance is not None:
            run["appearance"] = self.appearance.state_dict()
        return checkpoint.capture(self.state, run, step=self.step, sh_degree=self.sched.sh.degree(
            max(self.step - 1, 0)), finished=finished, prune_during=self.pruner and self.pruner.state_dict(),
            rasterize_mode=self.cfg.rasterize_mode)

    def load_state_dict(self, ckpt: Checkpoint | dict) -> None:
        """Continue from ``ckpt``, moved to this run's device."""
        if not isinstance(ckpt, Checkpoint):
            ckpt = Checkpoint.from_dict(ckpt, str(self.ckpt_path or "checkpoint"))
        st = checkpoint.restore(self.state, ckpt)
        self.initial_count, self.step = int(st["initial_count"]), ckpt.step
        self.elapsed_s = float(st["elapsed_seconds"])
        self.events, self.val_psnr = list(st.get("events", [])), st.get("val_psnr")
        self.stopper.load_state_dict(st["stopper"])
        self.rng.load_state_dict(st["rng"])
        if self.pruner is not None and ckpt.prune_during:
            self.pruner.load_state_dict(ckpt.prune_during)
        if self.appearance is not None and "appearance" in st:
            self.appearance.load_state_dict(st["appearance"])

    def save(self, finished: bool, stopped: str = "") -> None:
        if self.ckpt_path:
            self.state_dict(finished, stopped).save(self.ckpt_path)
        self.sink.flush()

    def resume(self) -> bool:
        """Continue from an unfinished checkpoint of the same settings, seed and scene at ``ckpt_path``
        (:func:`splatflow.train.checkpoint.resumable`); True if it did."""
        if not (self.cfg.resume and self.ckpt_path):
            return False
        self._identity = checkpoint.identity(self.cfg, self.seed, self.scene)
        ckpt = checkpoint.resumable(self.ckpt_path, self._identity)
        if ckpt is not None:
            self.load_state_dict(ckpt)
        return ckpt is not None

    def _result(self, stopped, start_step, t_start, initial_psnr, saved) -> TrainResult:
        self.state.flush()
        self.sink.close()
        done = self.step - start_step
        if saved and self.ckpt_path and stopped.startswith("nonfinite"):
            splats = Checkpoint.load(self.ckpt_path).splats  # the last good parameters
        else:
            splats = self.state.splats().to("cpu").clone()  # results live on the host
        return TrainResult(splats=splats, sh_degree=self.sched.sh.degree(max(self.step - 1, 0)), steps=self.step,
                           stopped=stopped, train_seconds=self.elapsed_s,
                           it_per_s=done / max(self.elapsed_s - t_start, 1e-9) if done else 0.0,
                           val_psnr=self.val_psnr, events=list(self.events), initial_psnr=initial_psnr,
                           resumed_from=self.resumed_from, device=run_record(self.run_device),
                           prune_during=self.pruner.report() if self.pruner is not None else None,
                           appearance=self.appearance.report() if self.appearance is not None else None,
                           compile_seconds=self.compile_seconds, window_pixels=self.window_pixels,
                           plan=self.plan.record())


def progress_bar(enabled: bool, total: int, initial: int):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True, mininterval=0.5)
