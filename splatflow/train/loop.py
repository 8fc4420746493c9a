"""The training loop: short on purpose. The model is one state object (:mod:`.state`) and every policy a small
object whose hooks the loop calls in order (:mod:`.hooks`, :mod:`.policies`, :mod:`.prune_during`).

One step (3DGS, Kerbl et al. 2023, §5 and Alg. 1): pick a random training view, render it at the current
resolution with the current SH degree (:mod:`.views`), blur render and target alike, loss ``(1-l) L1 + l (1 -
SSIM)``, backward, the optimizer step, then the policies' hooks. Around it: guards (:mod:`.guards`), periodic
validation for the plateau stop, periodic atomic checkpoints for an exact resume (:mod:`.checkpoint`), SIGTERM.
"""

from __future__ import annotations

import time

import torch

from splatflow.pipeline import stop
from splatflow.pipeline.config import TrainConfig
from splatflow.render.ssim import l1_ssim
from splatflow.train import precompile as compile_ahead  # the module: tests stand in for its compile
from splatflow.train.result import TrainResult
from splatflow.train.run import TrainingRun, progress_bar
from splatflow.train.sink import CSV_FIELDS  # noqa: F401 - part of the interface


def photometric_loss(pred: torch.Tensor, gt: torch.Tensor, sigma_px: float, ssim_lambda: float):
    """``(loss, l1, ssim)`` of ``[1, 3, H, W]`` images after blurring both by ``sigma_px`` (3DGS Eq. 7)."""
    l1, s = l1_ssim(pred, gt, blur_sigma=sigma_px)  # on CPU: two kernel passes forward, one backward
    return (1.0 - ssim_lambda) * l1 + ssim_lambda * (1.0 - s), l1, s


class Trainer(TrainingRun):
    """Trains Gaussians on ``scene.train_views`` (never ``test_views``); the arguments are
    :class:`~splatflow.train.run.TrainingRun`'s. ``loss_fn`` is :func:`photometric_loss` unless replaced."""

    loss_fn = staticmethod(photometric_loss)

    # ------------------------------------------------------------------------------------------ one step
    def train_step(self) -> dict:
        step, cfg, s, gs = self.step, self.cfg, self.sched, self.state
        i = self.rng.python.randrange(len(self.views))
        phase = s.resolution.phase(step)
        factor, sigma, deg = s.resolution.factors[phase], s.blur.sigma(step), s.sh.degree(step)
        lr_factor = 1.0
        for p in self.policies:
            lr_factor *= p.lr_factor(step)
        gs.set_lr("means", s.means_lr.lr(step) * lr_factor)
        bg = torch.rand(3, device=self.device) if cfg.random_background else None
        rgb, target, info = self.render(i, factor, deg, bg, patch=True, sparse=self.adam.sparse)
        for p in self.policies:
            p.step_pre_backward(gs, step, info)
        pred, gt = rgb.permute(2, 0, 1)[None], target.permute(2, 0, 1)[None]  # [1, 3, H, W]
        for p in self.policies:
            pred = p.transform_render(pred, i, step)
        mask = info["loss_mask"]  # [H, W] bool or None
        if mask is not None:  # masked pixels show the target instead of the render: no loss, no gradient there
            pred = torch.where(mask[None, None], pred, gt)
        loss, l1, ssim_v = self.loss_fn(pred, gt, sigma, cfg.ssim_lambda)
        if mask is not None:  # the means ran over every pixel: rescale to a mean over the kept ones
            loss = loss * (mask.numel() / max(int(mask.sum()), 1))
        for p in self.policies:  # a policy's own terms (3DGS-MCMC's opacity and scale regularisers)
            terms = p.loss_terms(gs, info)
            loss = loss if terms is None else loss + terms
        view = self.views[i].name
        self.checks.check_connected(loss, view)
        self.checks.check_loss(loss, gs.optimizers, step, view)
        loss.backward()
        self.checks.check_gradients(view, info.get("leaves", gs.params))
        self.adam.step(gs, info)
        for p in self.policies:
            p.step_post_backward(gs, step, info, lr=s.means_lr.lr(step))
        self.checks.check_params(gs.params, step)
        if info.get("refine"):  # a refine event: kept in the checkpoint, logged, sent as step metrics
            self.events.append(info["refine"])
            self.sink.event(info["refine"])
        self._psnr_inputs = (rgb.detach(), target, mask)  # for row_psnr: a number only logged rows show
        row = {"step": step + 1, "phase": phase, "resolution": f"{info['width']}x{info['height']}",
               "sigma": round(sigma, 4), "gaussians": gs.n}
        row.update(self.checks.values(loss, l1, ssim_v))
        return row

    # ------------------------------------------------------------------------------------------ the loop
    def _due(self, n: int) -> tuple[bool, bool, bool]:
        """What the loop itself does after ``n`` completed steps: (validate, log a row, write a checkpoint)."""
        cfg = self.cfg
        return (cfg.early_stop.enabled and n % cfg.early_stop.eval_every == 0,
                n % cfg.log_every == 0 or n == cfg.max_steps, n % cfg.checkpoint_every == 0 and n < cfg.max_steps)

    def _reads_model(self, n: int) -> bool:
        """Whether the loop or a policy reads or saves the model after ``n`` completed steps (the deferred checks
        settle first)."""
        return any(self._due(n)) or n >= self.cfg.max_steps or any(p.acts_at(n) for p in self.policies) \
            or stop.requested() or (self.stop_after is not None and n >= self.stop_after)

    def run(self) -> TrainResult:
        cfg = self.cfg
        # a fresh run's generators are seeded from the run seed (RunRNG); a resumed one continues the saved ones
        self.resumed_from = self.step if self.resume() else None
        self.sink.start(self.step)
        start_step = self.step
        self.compile_seconds = compile_ahead.before_training(self.run_device.backend)
        initial_psnr = self.validate() if self.step == 0 and cfg.early_stop.enabled else None
        block = stop.cooperative()  # SIGTERM belongs to the stage shell; the loop polls its flag
        block.__enter__()
        pbar = progress_bar(cfg.progress, cfg.max_steps, self.step)
        stopped, t_start, t_last = "max_steps", self.elapsed_s, time.perf_counter()
        last_good = self.resumed_from  # the step of the newest checkpoint on disk that is known to be finite
        try:
            while self.step < cfg.max_steps:
                try:
                    with self.rng.lent():  # view order, windows, backgrounds, strategy noise: this run's streams
                        row = self.train_step()
                    if self._reads_model(self.step + 1):
                        self.checks.settle(row, self.step)
                except FloatingPointError as e:
                    stopped = f"nonfinite: {e}; kept the last good checkpoint (step {last_good})"
                    self.step = last_good if last_good is not None else self.step
                    return self._result(stopped, start_step, t_start, initial_psnr, saved=last_good is not None)
                self.step += 1
                now = time.perf_counter()
                self.elapsed_s += now - t_last
                t_last = now
                row["seconds"] = round(self.elapsed_s, 3)
                validate, log_row, save = self._due(self.step)
                reason = None
                if validate:
                    self.val_psnr = self.validate()
                    reason = self.stopper.update(self.step, self.val_psnr)
                    t_last = time.perf_counter()  # validation is not training time
                for p in self.policies:  # (train.prune_during's cuts: their scoring counts as training time)
                    p.after_step(self.state, self.step, self.ctx)
                if log_row or reason:
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
                if stop.requested() or (self.stop_after is not None and self.step >= self.stop_after):
                    stopped = f"{stop.label()} at step {self.step}" if stop.requested() else \
                        f"stop_after {self.stop_after}"
                    self.save(finished=False, stopped=stopped)
                    return self._result(stopped, start_step, t_start, initial_psnr, saved=True)
                if save:
                    self.save(finished=False)
                    last_good = self.step
            for p in self.policies:
                p.finish(self.state, self.step, self.ctx)  # (prune_during judges its last phase, may undo it)
            if cfg.early_stop.enabled:
                self.val_psnr = self.validate()
            self.save(finished=True, stopped=stopped)
            return self._result(stopped, start_step, t_start, initial_psnr, saved=True)
        finally:
            if pbar is not None:
                pbar.close()
            block.__exit__(None, None, None)


def train(scene, cfg: TrainConfig, **kwargs) -> TrainResult:
    """Train Gaussians on ``scene`` with ``cfg`` (see :class:`Trainer` for the keyword arguments)."""
    return Trainer(scene, cfg, **kwargs).run()
