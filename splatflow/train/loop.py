"""The training loop: short on purpose; every policy lives in a small object it calls.

One step (3DGS, Kerbl et al. 2023, §5 and Alg. 1): pick a random training view, render it at the current
resolution with the current SH degree, blur render and target alike, loss ``(1-l) L1 + l (1 - SSIM)``, backward,
Adam per parameter group, then the densification strategy. Around it: guards (gradient health after the first
backward, NaN/Inf), periodic validation for the plateau stop, periodic atomic checkpoints with everything an
exact resume needs, and SIGTERM handling.

The parts live in their own modules: :mod:`.checkpoint` (what a checkpoint holds, resume), :mod:`.windows`
(training windows of large views), :mod:`.optim` (Adam, plain or on the visible Gaussians), :mod:`.sink` (the
CSV, the log and the step logger), :mod:`.rng` (the run's own generators), :mod:`.strategies` (densification).
"""

from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from splatflow import stop
from splatflow.config import TrainConfig
from splatflow.device import reset_peak_memory, run_record
from splatflow.device import resolve as resolve_device
from splatflow.errors import UserError
from splatflow.model import SPLAT_KEYS, Checkpoint, Splats, init_splats, scene_scale
from splatflow.render import rasterize
from splatflow.render.ssim import l1_ssim
from splatflow.scene.images import ImageCache
from splatflow.train import checkpoint, optim, plan
from splatflow.train import precompile as compile_ahead  # the module: tests stand in for its compile
from splatflow.train.prune_during import PruneDuring
from splatflow.train.rng import RunRNG
from splatflow.train.rows import reorder_spatially, spatial_order
from splatflow.train.schedules import (BlurSchedule, ExpDecay, PlateauStopper, ResolutionSchedule, Schedules,
                                       SHSchedule)
from splatflow.train.sink import CSV_FIELDS, MetricsSink  # noqa: F401 - CSV_FIELDS: part of the interface
from splatflow.train.sparse import SparseAdam, candidates
from splatflow.train.strategies import BudgetedDefaultStrategy, make_strategy, rendered
from splatflow.train.windows import level_budget, patch_window

log = logging.getLogger("splatflow.train")

_NAN_CHECKED = ("means", "opacities", "scales")  # the groups whose NaN/Inf the step checks (after the strategy)


def _gpu_memory_gib(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    return round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1)


class GradientHealthError(UserError):
    """The first backward pass left positions, colours or opacities without any gradient."""


def photometric_loss(pred: torch.Tensor, gt: torch.Tensor, sigma_px: float, ssim_lambda: float):
    """``(loss, l1, ssim)`` of ``[1, 3, H, W]`` images after blurring both by ``sigma_px`` (3DGS Eq. 7)."""
    # on CPU: blur of both, L1 and SSIM in two kernel passes forward, one backward; the target gets no gradient
    l1, s = l1_ssim(pred, gt, blur_sigma=sigma_px)
    return (1.0 - ssim_lambda) * l1 + ssim_lambda * (1.0 - s), l1, s


@dataclass
class TrainResult:
    splats: Splats
    sh_degree: int
    steps: int
    stopped: str
    train_seconds: float
    it_per_s: float
    val_psnr: float | None
    events: list[dict] = field(default_factory=list)
    initial_psnr: float | None = None
    resumed_from: int | None = None  # step of the unfinished checkpoint this run continued, if any
    device: dict = field(default_factory=dict)  # splatflow.device.run_record: what ran, peak GPU memory
    prune_during: dict | None = None  # train.prune_during's report (PruneDuring.report), when it ran
    # numba compiling the CPU kernels before the first step (splatflow.train.precompile; not in train_seconds),
    # None when they were cached or the run is on a GPU
    compile_seconds: float | None = None
    window_pixels: int = 0  # train.patch_max_pixels as this run resolved it (0 = whole images)
    plan: dict = field(default_factory=dict)  # the resolved training plan (splatflow.train.plan.Plan.record)


def _render_psnr(rgb: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None) -> float:
    """Training-time PSNR of a render ``[H, W, 3]`` (clamped to [0, 1]) against its target, over the kept pixels
    when a mask keeps any; the MSE is floored at 1e-12 so a perfect fit logs a finite number."""
    err = (rgb.clamp(0, 1) - target) ** 2  # [H, W, 3]
    mse = float(err.mean() if mask is None or not bool(mask.any()) else err[mask].mean())
    return -10.0 * math.log10(max(mse, 1e-12))


class Trainer:
    """Trains Gaussians on ``scene.train_views`` (never ``test_views``).

    ``splats`` (optional) starts from given parameters instead of the SfM points (fine-tuning);
    ``densify=False`` switches the strategy off; ``schedules`` overrides the ones built from ``cfg``.
    ``stop_after`` ends the run early at that step with a resumable checkpoint (tests, SIGTERM drills).
    ``watchers`` see the run after every step through its sink (:meth:`MetricsSink.step`; the live view).
    """

    def __init__(self, scene, cfg: TrainConfig, *, ckpt_path: str | Path | None = None,
                 csv_path: str | Path | None = None, seed: int = 0, splats: dict | None = None,
                 densify: bool = True, schedules: Schedules | None = None, stop_after: int | None = None,
                 step_logger=None, watchers=()):
        if not scene.train_views:
            raise UserError("no training views: the split left every view in the test set; check data/<scene>/"
                            "split.json and the split params")
        # One device for the whole run (CUDA with a GPU and backend auto/cuda, else the CPU): every tensor below
        # is made on it or moved to it; images are decoded on the host and uploaded per step (scene/images.py).
        self.run_device = resolve_device(cfg.backend)
        self.device = self.run_device.device
        # train.max_steps / densify.max_gaussians "auto": sized from the scene and the device, once (plan.py)
        self.plan = plan.resolve(cfg, scene.train_views, self.run_device.backend, _gpu_memory_gib(self.device))
        cfg = plan.apply(cfg, self.plan)
        self.scene, self.cfg, self.seed = scene, cfg, seed
        self.ckpt_path = Path(ckpt_path) if ckpt_path else None
        # plots/S/train.csv, the log, the tracking step logger and the watchers (the live view)
        self.sink = MetricsSink(csv_path, step_logger, watchers)
        self.stop_after = stop_after
        self.compile_seconds: float | None = None  # set by run() when it compiled the CPU kernels first
        self.loss_fn: Callable = photometric_loss
        self.views = list(scene.train_views)
        self.cache = ImageCache(self.views, cfg.image_cache_mb)
        reset_peak_memory(self.run_device)
        self.rng = RunRNG(seed, self.device)  # this run's own generators, lent to the global ones per step
        self.viewmats = [torch.as_tensor(np.asarray(v.world_to_cam, dtype=np.float32), device=self.device)
                         for v in self.views]  # [4, 4] each
        self._k_cache: dict[tuple[int, float], torch.Tensor] = {}  # (view, level factor) -> K [3, 3] on the device
        self.scene_scale = scene_scale(np.stack([v.world_to_cam for v in self.views]))  # training cameras only
        self.sched = schedules or Schedules.from_config(cfg, self.scene_scale)
        # CPU: rows in Morton order of position, kept so after every densification event (splatflow.train.rows);
        # splats handed in keep the caller's order until the first event
        self.spatial_order = cfg.spatial_order and self.run_device.backend == "cpu"
        self.window_pixels = cfg.window_pixels(self.run_device.backend)  # train.patch_max_pixels, "auto" resolved
        if splats is None:
            splats = init_splats(scene.points, scene.colors, sh_degree=cfg.sh_degree,
                                 init_opacity=cfg.init_opacity, init_scale=cfg.init_scale)
            if self.spatial_order:
                perm = spatial_order(splats["means"])
                splats = {k: splats[k].index_select(0, perm) for k in SPLAT_KEYS}
        splats = Splats.of(splats, "the initial splats").validate("the initial splats", "check where they come from")
        self.initial_count = splats.n
        self.params = {k: torch.nn.Parameter(splats[k].detach().to(self.device, torch.float32, copy=True))
                       for k in SPLAT_KEYS}
        lrs = {"means": self.sched.means_lr.lr(0), "scales": cfg.lr.scales, "quats": cfg.lr.quats,
               "opacities": cfg.lr.opacities, "sh0": cfg.lr.sh0, "shN": cfg.lr.shN}
        self.optimizers = optim.make_optimizers(self.params, lrs)
        self.strategy = make_strategy(cfg.densify, max_steps=cfg.max_steps, initial_count=self.initial_count) \
            if densify else None
        self.strategy_state = self.strategy.initialize_state(scene_scale=self.scene_scale, device=self.device) \
            if self.strategy else {}
        self.pruner = PruneDuring.from_config(cfg.prune_during, cfg.max_steps) \
            if densify and cfg.prune_during.enabled else None
        # the sparse step (train.sparse_step): CPU rasterizer, plain Adam, a strategy that reads only screen-space
        # gradients (3DGS-MCMC adds noise and regularisers to every Gaussian every step: it stays dense)
        self.sparse = SparseAdam(self.params, self.optimizers) \
            if cfg.sparse_step and self.run_device.backend == "cpu" and not cfg.visible_adam \
            and _sparse_compatible(self.strategy) else None
        es = cfg.early_stop
        patience = max(es.eval_every, int(round(es.patience_steps * cfg.max_steps / es.reference_steps)))
        self.stopper = PlateauStopper(patience, es.min_delta_db,
                                      active_from=max(self.sched.resolution.last_start, self.sched.blur.end_step))
        n_val = min(es.val_views, len(self.views))
        self.val_ids = sorted({int(round(x)) for x in np.linspace(0, len(self.views) - 1, n_val)})
        self.step = 0
        self.elapsed_s = 0.0
        self.events: list[dict] = []
        self.val_psnr: float | None = None
        self._grad_checked = False
        self.resumed_from: int | None = None
        # On a GPU the step's guards read nothing back (see :meth:`settle`): the host queues the next step while
        # the GPU runs this one. On the CPU a read costs nothing, and each step checks at once.
        self.defer_checks = self.device.type == "cuda"
        self._bad: torch.Tensor | None = None  # [2] bool on the device: a non-finite loss / parameter since settle
        self._bad_from = 0  # the first step not yet settled

    @property
    def step_logger(self):
        """The tracking step logger, or None: policies (train.prune_during) send their own step metrics to it."""
        return self.sink.step_logger

    # ------------------------------------------------------------------------------------------ rendering
    def render(self, i: int, factor: float, sh_degree: int, background: torch.Tensor | None = None,
               patch: bool = False, sparse: bool = False):
        """Render training view ``i`` at ``factor``: ``(rgb [H, W, 3], target [H, W, 3], info)``.

        With ``patch`` and a level larger than its window budget (``train.patch_max_pixels``, larger at coarse
        levels: :func:`~splatflow.train.windows.level_budget`), only a random window of that area (same
        aspect ratio) is rendered and returned (the rasterizer's ``window``: exactly those pixels of the whole
        render), so the Gaussians see full-detail pixels at a fraction of the cost. ``info["width"]``/``["height"]``
        stay those of the whole level, so densification gradients keep their scale (NDC units of the full view).

        With ``sparse`` (the sparse step, :mod:`splatflow.train.sparse`) only the Gaussians that may reach the
        window are rendered, from copies of their rows: ``info["rows"]`` holds their indices and ``info["leaves"]``
        the copies, whose ``.grad`` the backward fills (``self.params`` get none).
        """
        w, h = self.cache.shape(i, factor)
        budget = level_budget(self.window_pixels, factor, self.cfg.patch_level_exponent)
        win = patch_window(w, h, budget) if patch else None
        # only the window's pixels are converted and uploaded; K is the whole level's
        target, K = self.cache.get(i, factor, device=self.device, window=win)
        mask = self.cache.mask(i, factor, window=win)  # [H, W] bool keep-mask, None without masks
        Kt = self._k_cache.get((i, factor))  # [3, 3]: uploaded once per view and level (an upload waits for the GPU)
        if Kt is None:
            Kt = self._k_cache[(i, factor)] = torch.as_tensor(K, dtype=torch.float32, device=self.device)
        src, rows = self.params, None
        if sparse:
            rows = candidates(self.params, self.viewmats[i], Kt, w, h, win)  # [n] int64
            src = {k: self.params[k].detach().index_select(0, rows).requires_grad_(True) for k in SPLAT_KEYS}
        a = Splats.of(src).activated(sh_degree, sh_pair=True)  # differentiable: grads reach src
        rgb, _, info = rasterize(
            a.means, a.quats, a.scales, a.opacities, a.colors, self.viewmats[i][None], Kt[None], w, h,
            sh_degree=sh_degree, backgrounds=None if background is None else background[None],
            backend=self.cfg.backend, absgrad=self.cfg.densify.absgrad, window=win)
        info["loss_mask"] = None if mask is None else mask.to(target.device)  # read by train_step and validate
        if sparse:
            info["rows"], info["leaves"] = rows, src
        return rgb[0], target, info  # [H, W, 3]

    @torch.no_grad()
    def validate(self) -> float:
        """Mean PSNR over the validation subset of TRAINING views at ``early_stop.val_factor`` (no blur)."""
        self.flush()
        deg = self.sched.sh.degree(self.step)
        vals = []
        for i in self.val_ids:
            rgb, target, vinfo = self.render(i, self.cfg.early_stop.val_factor, deg)
            vals.append(_render_psnr(rgb, target, vinfo["loss_mask"]))
        return float(np.mean(vals))

    # ------------------------------------------------------------------------------------------ one step
    def train_step(self) -> dict:
        step, cfg, s = self.step, self.cfg, self.sched
        if self.sparse is not None and not _sparse_compatible(self.strategy):
            # a strategy plugged in after construction may read or write every row, or add loss terms on them,
            # at any step: bring every row up to date and go on with dense steps
            self.flush()
            self.sparse = None
        i = random.randrange(len(self.views))
        phase = s.resolution.phase(step)
        factor = s.resolution.factors[phase]
        sigma = s.blur.sigma(step)
        deg = s.sh.degree(step)
        means_lr = s.means_lr.lr(step) * (self.pruner.lr_factor(step) if self.pruner is not None else 1.0)
        for g in self.optimizers["means"].param_groups:
            g["lr"] = means_lr
        bg = torch.rand(3, device=self.device) if cfg.random_background else None
        rgb, target, info = self.render(i, factor, deg, bg, patch=True, sparse=self.sparse is not None)
        if self.strategy is not None:
            self.strategy.step_pre_backward(self.params, self.optimizers, self.strategy_state, step, info)
        pred = rgb.permute(2, 0, 1)[None]  # [1, 3, H, W]
        gt = target.permute(2, 0, 1)[None]  # [1, 3, H, W]
        mask = info["loss_mask"]  # [H, W] bool or None
        if mask is not None:  # masked pixels show the target instead of the render: no loss, no gradient there
            pred = torch.where(mask[None, None], pred, gt)
        loss, l1, ssim_v = self.loss_fn(pred, gt, sigma, cfg.ssim_lambda)
        if mask is not None:  # the means ran over every pixel: rescale to a mean over the kept ones
            loss = loss * (mask.numel() / max(int(mask.sum()), 1))
        if self.strategy is not None:  # the strategy's own terms (3DGS-MCMC's opacity and scale regularisers)
            terms = self.strategy.loss_terms(self.params, info)
            if terms is not None:
                loss = loss + terms
        if not self._grad_checked and not loss.requires_grad:
            raise GradientHealthError(
                f"the training loss does not depend on the Gaussians at all (view {self.views[i].name}): the render "
                "was detached from the parameters. Training would run and learn nothing, so it stops here.")
        # (found_inf exists only in torch's fused Adam, which every run's optimizers are: optim.adam)
        defer = self.defer_checks and all(o.defaults.get("fused") for o in self.optimizers.values())
        if defer:
            loss_bad = ~torch.isfinite(loss.detach())
            found_inf = loss_bad.float()  # fused Adam skips its update (and its step count) where this is 1
            for opt in self.optimizers.values():
                opt.found_inf = found_inf
        else:
            loss_f = float(loss.detach())
            if not math.isfinite(loss_f):
                raise FloatingPointError(f"loss is {loss_f} at step {step} (view {self.views[i].name})")
        loss.backward()
        if not self._grad_checked:
            self._check_gradients(self.views[i].name, info.get("leaves", self.params))
        if self.sparse is not None:
            leaves = info["leaves"]
            self.sparse.step(self.params, self.optimizers, info["rows"], {k: leaves[k].grad for k in SPLAT_KEYS})
        elif cfg.visible_adam:
            self._visible_adam_step(info)
        else:
            optim.step(self.optimizers)
        if self.strategy is not None:
            if self.sparse is not None and self.strategy.changes_params_at(step):
                self.sparse.flush(self.params, self.optimizers)  # a refine or reset reads and rewrites all rows
            self.strategy.step_post_backward(self.params, self.optimizers, self.strategy_state, step, info,
                                             lr=s.means_lr.lr(step))
            if self.spatial_order and getattr(self.strategy, "last_event", None):
                # new rows were appended (or rows removed): sort again; all rows are current (flushed above)
                reorder_spatially(self.params, self.optimizers, self.strategy_state)
            if self.sparse is not None:
                self.sparse.sync(self.params, self.optimizers)
        with torch.no_grad():  # any NaN/Inf entry makes its group's sum non-finite: one check, one host sync
            sums = torch.stack([self.params[k].sum() for k in _NAN_CHECKED])
            if defer:
                bad = torch.stack([loss_bad, ~torch.isfinite(sums).all()])
                self._bad = bad if self._bad is None else self._bad | bad
            elif not bool(torch.isfinite(sums).all()):
                bad = [k for k, v in zip(_NAN_CHECKED, sums.tolist()) if not math.isfinite(v)]
                raise FloatingPointError(f"parameters {', '.join(bad)} became NaN/Inf at step {step}")
        ev = getattr(self.strategy, "last_event", None)
        if ev:
            self._log_event(ev)
        # the training PSNR is four image-sized ops for a number only logged rows show: kept for :meth:`row_psnr`
        self._psnr_inputs = (rgb.detach(), target, mask)
        row = {"step": step + 1, "phase": phase, "resolution": f"{info['width']}x{info['height']}",
               "sigma": round(sigma, 4), "gaussians": self.params["means"].shape[0]}
        if defer:  # device scalars, read once per logged row (:meth:`settle`)
            row.update(loss=loss.detach(), l1=l1.detach(), ssim=ssim_v.detach())
        else:
            row.update(loss=loss_f, l1=float(l1.detach()), ssim=float(ssim_v.detach()))
        return row

    def settle(self, row: dict | None = None) -> None:
        """With :attr:`defer_checks` (a GPU run), read back what the steps since the last call left on the device,
        in one transfer: raise ``FloatingPointError`` if a loss or a checked parameter group went NaN/Inf, and
        turn ``row``'s device scalars into numbers. The run loop calls it right after a step (``self.step`` not
        yet counted) when anything reads or saves the model next (a logged row, validation, a prune cut or
        judgement, a checkpoint, a stop, the end: :meth:`_reads_model`), so a non-finite value
        is caught as on the CPU, at most ``log_every`` steps later. A non-finite loss still never reaches the
        parameters: fused Adam skips that step's update on the device (its ``found_inf``). Without
        :attr:`defer_checks` every step checks at once and this does nothing."""
        keys = [k for k in ("loss", "l1", "ssim") if row is not None and isinstance(row.get(k), torch.Tensor)]
        if self._bad is None and not keys:
            return
        parts = ([self._bad.float()] if self._bad is not None else []) + [row[k].float().reshape(1) for k in keys]
        vals = torch.cat(parts).tolist()  # the one host sync
        bad, first, last = self._bad is not None, self._bad_from, self.step  # (steps first..last, 0-based)
        self._bad, self._bad_from = None, self.step + 1
        if bad and vals[0]:
            raise FloatingPointError(f"the loss became NaN/Inf at one of steps {first} to {last}")
        if bad and vals[1]:
            raise FloatingPointError(f"parameters became NaN/Inf at one of steps {first} to {last}")
        for k, v in zip(keys, vals[2 if bad else 0:]):
            row[k] = v

    @torch.no_grad()
    def row_psnr(self) -> float:
        """PSNR of the last :meth:`train_step`'s render against its target (over the kept pixels with a mask),
        computed only for the rows the loop keeps. The step leaves its render and target for it; both are its own
        tensors (the image cache hands out a fresh target per call), so validation in between changes neither."""
        return _render_psnr(*self._psnr_inputs)

    def _visible_adam_step(self, info: dict) -> None:
        """Adam on the Gaussians this step's render reached (:func:`splatflow.train.optim.visible_step`)."""
        optim.visible_step(self.params, self.optimizers, ~rendered(info))

    def _log_event(self, ev: dict) -> None:
        """Record a refine event: kept in the checkpoint, logged, and sent as step metrics."""
        self.events.append(ev)
        self.sink.event(ev)

    def _check_gradients(self, view_name: str, params: dict) -> None:
        """Gradient health: all-zero gradients mean the loss does not reach the Gaussians (``params``: the tensors
        the step differentiated, the sparse step's row copies or ``self.params``)."""
        self._grad_checked = True
        dead = [k for k in ("means", "sh0", "opacities")
                if params[k].grad is None or not bool(params[k].grad.abs().sum() > 0)]
        if dead:
            raise GradientHealthError(
                f"after the first backward pass the gradients of {', '.join(dead)} are all zero (view "
                f"{view_name}): the loss is not connected to the Gaussians (a detached render?) or no Gaussian is "
                "visible from the cameras (check the SfM model's cameras and points in data/<scene>/undistorted). "
                "Training would run and learn nothing, so it stops here.")

    # ------------------------------------------------------------------------------------------ state
    def flush(self) -> None:
        """Bring every Gaussian's parameters and Adam moments up to date (the sparse step defers the rows a step
        does not reach): before anything reads or rewrites all of them. A no-op for the dense step."""
        if self.sparse is not None:
            self.sparse.flush(self.params, self.optimizers)

    def state_dict(self, finished: bool, stopped: str = "") -> Checkpoint:
        """Everything an exact resume needs, every tensor on the CPU (:func:`splatflow.train.checkpoint.capture`).

        A finished run's parameters are brought up to date first; an unfinished one's are written as they are,
        with the sparse step's bookkeeping, so that resuming continues bit for bit (bringing rows up to date at a
        step the uninterrupted run did not would round differently)."""
        if finished:
            self.flush()
        return checkpoint.capture(self, finished, stopped)

    def load_state_dict(self, ckpt: Checkpoint | dict) -> None:
        """Continue from ``ckpt``, moved to this run's device (:func:`splatflow.train.checkpoint.restore`)."""
        checkpoint.restore(self, ckpt)

    def try_resume(self) -> bool:
        """Continue from an unfinished checkpoint of the same config at ``ckpt_path``; True if resumed."""
        return checkpoint.try_resume(self)

    def save(self, finished: bool, stopped: str = "") -> None:
        if self.ckpt_path:
            self.state_dict(finished, stopped).save(self.ckpt_path)
        self.sink.flush()

    # ------------------------------------------------------------------------------------------ the loop
    def run(self) -> TrainResult:
        cfg = self.cfg
        # a fresh run's generators are seeded from the run seed (RunRNG); a resumed one continues the saved ones
        self.resumed_from = self.step if self.try_resume() else None
        self.sink.start(self.step)
        start_step = self.step
        if self.run_device.backend == "cpu":  # a first run after an install or a kernel change: helper processes
            import numba

            self.compile_seconds = compile_ahead.precompile(numba.get_num_threads())
        initial_psnr = self.validate() if self.step == 0 and cfg.early_stop.enabled else None
        old_handler = self._install_sigterm()
        pbar = _progress(cfg.progress, cfg.max_steps, self.step)
        stopped, t_start, t_last = "max_steps", self.elapsed_s, time.perf_counter()
        last_good = self.resumed_from  # the step of the newest checkpoint on disk that is known to be finite
        try:
            while self.step < cfg.max_steps:
                try:
                    with self.rng.lent():  # view order, windows, backgrounds, strategy noise: this run's streams
                        row = self.train_step()
                    if self.defer_checks and self._reads_model(self.step + 1):
                        self.settle(row)
                except FloatingPointError as e:
                    stopped = f"nonfinite: {e}; kept the last good checkpoint (step {last_good})"
                    self.step = last_good if last_good is not None else self.step
                    return self._result(stopped, start_step, t_start, initial_psnr, saved=last_good is not None)
                self.step += 1
                now = time.perf_counter()
                self.elapsed_s += now - t_last
                t_last = now
                row["seconds"] = round(self.elapsed_s, 3)
                reason = None
                if cfg.early_stop.enabled and self.step % cfg.early_stop.eval_every == 0:
                    self.val_psnr = self.validate()
                    reason = self.stopper.update(self.step, self.val_psnr)
                    t_last = time.perf_counter()  # validation is not training time
                if self.pruner is not None:  # train.prune_during cuts; their scoring counts as training time
                    self.pruner.after_step(self)  # (it validates, so flushes, before it cuts or undoes)
                    if self.sparse is not None:
                        self.sparse.sync(self.params, self.optimizers)
                if self.step % cfg.log_every == 0 or self.step == cfg.max_steps or reason:
                    row["psnr"] = self.row_psnr()
                    self.sink.row(row)  # live: plots/S/train.csv can be watched while training runs
                    if pbar is not None:
                        pbar.set_postfix({"#G": row["gaussians"], "loss": f"{row['loss']:.4f}",
                                          "psnr": f"{row['psnr']:.2f}"}, refresh=False)
                if pbar is not None:
                    pbar.update(1)
                self.sink.step(self, row)  # the watchers (the live view): they read the model, never change it
                if reason:
                    stopped = reason
                    break
                if stop.requested():
                    stopped = f"{stop.label()} at step {self.step}"
                    self.save(finished=False, stopped=stopped)
                    return self._result(stopped, start_step, t_start, initial_psnr, saved=True)
                if self.stop_after is not None and self.step >= self.stop_after:
                    stopped = f"stop_after {self.stop_after}"
                    self.save(finished=False, stopped=stopped)
                    return self._result(stopped, start_step, t_start, initial_psnr, saved=True)
                if self.step % cfg.checkpoint_every == 0 and self.step < cfg.max_steps:
                    self.save(finished=False)
                    last_good = self.step
            if self.pruner is not None:
                self.pruner.finish(self)  # judges the last phase (may restore the model before its cut)
            if cfg.early_stop.enabled:
                self.val_psnr = self.validate()
            self.save(finished=True, stopped=stopped)
            return self._result(stopped, start_step, t_start, initial_psnr, saved=True)
        finally:
            if pbar is not None:
                pbar.close()
            self._restore_sigterm(old_handler)

    def _reads_model(self, step: int) -> bool:
        """Whether the loop, after ``step`` completed steps, reads or saves the model or logs a row (then a GPU
        run's deferred checks must be settled first: :meth:`settle`)."""
        cfg = self.cfg
        return (step % cfg.log_every == 0 or step >= cfg.max_steps or step % cfg.checkpoint_every == 0
                or (cfg.early_stop.enabled and step % cfg.early_stop.eval_every == 0)
                or (self.pruner is not None and self.pruner.acts_at(step))
                or stop.requested() or (self.stop_after is not None and step >= self.stop_after))

    def _result(self, stopped, start_step, t_start, initial_psnr, saved) -> TrainResult:
        self.flush()
        self.sink.close()
        done = self.step - start_step
        if saved and self.ckpt_path and stopped.startswith("nonfinite"):
            splats = Checkpoint.load(self.ckpt_path).splats  # the last good parameters
        else:
            splats = Splats.of(self.params).to("cpu").clone()  # results live on the host
        train_s = self.elapsed_s
        return TrainResult(splats=splats, sh_degree=self.sched.sh.degree(max(self.step - 1, 0)), steps=self.step,
                           stopped=stopped, train_seconds=train_s,
                           it_per_s=done / max(self.elapsed_s - t_start, 1e-9) if done else 0.0,
                           val_psnr=self.val_psnr, events=list(self.events), initial_psnr=initial_psnr,
                           resumed_from=self.resumed_from, device=run_record(self.run_device),
                           prune_during=self.pruner.report() if self.pruner is not None else None,
                           compile_seconds=self.compile_seconds, window_pixels=self.window_pixels,
                           plan=self.plan.record())

    def _install_sigterm(self):
        """SIGTERM belongs to the stage shell (:mod:`splatflow.stop`); the loop only polls its flag, so it can
        write a resumable checkpoint before returning."""
        block = stop.cooperative()
        block.__enter__()
        return block

    def _restore_sigterm(self, block) -> None:
        block.__exit__(None, None, None)



def _sparse_compatible(strategy) -> bool:
    """Whether the sparse step can run beside ``strategy``: none, or adaptive density control, which reads only the
    rendered rows' screen-space gradients and says when it rewrites rows (``changes_params_at``)."""
    return strategy is None or isinstance(strategy, BudgetedDefaultStrategy)


def _progress(enabled: bool, total: int, initial: int):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True, mininterval=0.5)


def train(scene, cfg: TrainConfig, **kwargs) -> TrainResult:
    """Train Gaussians on ``scene`` with ``cfg`` (see :class:`Trainer` for the keyword arguments)."""
    return Trainer(scene, cfg, **kwargs).run()


def finetune(splats: Splats, scene, steps: int, cfg: TrainConfig, *, sh_degree: int,
             seed: int = 0, progress: bool = False, backend: str | None = None,
             means_lr_factor: float | None = None) -> Splats:
    """Recovery fine-tuning after pruning: ``steps`` plain steps on the training views, no densification.

    Full resolution, no blur, fixed ``sh_degree`` and the rates of ``cfg.lr``. The position learning rate is
    ``cfg.lr.means`` x scene scale x ``means_lr_factor``, constant; by default (None) the factor is training's
    final one, ``cfg.lr.means_final_factor`` (the end-of-training schedule of LightGaussian's recovery step,
    Fan et al. 2023). Pruning passes a larger factor (``prune.finetune_means_lr``) so the survivors can move into
    the gaps the removed Gaussians leave. Returns new float32 CPU parameters in the checkpoint layout; ``splats``
    is not modified.
    """
    from dataclasses import replace

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
    res = Trainer(scene, cfg2, seed=seed, splats=splats, densify=False, schedules=sched).run()
    if stop.is_stop_label(res.stopped):  # a partial fine-tune is not a result: the caller must not use it
        raise stop.StageStopped(f"stopped by {stop.label().upper()} during a fine-tune ({res.stopped})")
    return res.splats
