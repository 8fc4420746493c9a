"""The training views of a run as the loop renders them: images and masks per resolution level (decoded on the
host, uploaded per step), cameras on the run's device, training windows, and the validation renders."""

from __future__ import annotations

import math
import random

import numpy as np
import torch

from splatflow.gaussians.model import SPLAT_KEYS, Splats
from splatflow.render import rasterize
from splatflow.scene.images import ImageCache
from splatflow.train.sparse import candidates
from splatflow.train.windows import level_budget, patch_window


def render_psnr(rgb: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None) -> float:
    """PSNR of a render ``[H, W, 3]`` (clamped to [0, 1]) against its target, over the kept pixels when a mask keeps
    any; the MSE is floored at 1e-12 so a perfect fit logs a finite number."""
    err = (rgb.clamp(0, 1) - target) ** 2  # [H, W, 3]
    mse = float(err.mean() if mask is None or not bool(mask.any()) else err[mask].mean())
    return -10.0 * math.log10(max(mse, 1e-12))


class TrainingViews:
    """``views`` (the training views) on ``device``, rendered with the train settings ``cfg`` and training windows
    of ``window_pixels`` (``train.patch_max_pixels`` as resolved for the backend; 0 = whole images) drawn from
    ``rng``, the run's own ``random.Random`` (:mod:`splatflow.train.rng`)."""

    def __init__(self, views: list, cfg, device: torch.device, window_pixels: int, rng: random.Random):
        self.views, self.cfg, self.device, self.window_pixels = list(views), cfg, device, window_pixels
        self.rng = rng
        self.cache = ImageCache(self.views, cfg.image_cache_mb)
        self.viewmats = [torch.as_tensor(np.asarray(v.world_to_cam, dtype=np.float32), device=device)
                         for v in self.views]  # [4, 4] each
        self._ks: dict[float, torch.Tensor] = {}  # level factor -> every view's K [V, 3, 3] on the device
        n_val = min(cfg.early_stop.val_views, len(self.views))
        self.val_ids = sorted({int(round(x)) for x in np.linspace(0, len(self.views) - 1, n_val)})

    def level_ks(self, factor: float) -> torch.Tensor:
        """Every view's intrinsics at level ``factor`` (``[V, 3, 3]`` on the device), uploaded in one transfer the
        first time the level is rendered: an upload from the host waits for a GPU's queue, so once per level, not
        once per view and level."""
        ks = self._ks.get(factor)
        if ks is None:
            ks = np.stack([self.cache.intrinsics(j, factor) for j in range(len(self.views))]).astype(np.float32)
            ks = self._ks[factor] = torch.as_tensor(ks, device=self.device)
        return ks

    def render(self, params: dict, i: int, factor: float, sh_degree: int, background: torch.Tensor | None = None,
               patch: bool = False, sparse: bool = False, filter_3d: torch.Tensor | None = None):
        """Render view ``i`` at ``factor`` with ``params`` (and the 3D smoothing filter ``filter_3d`` [N], when
        the model has one: ``Splats.activated`` applies it): ``(rgb [H, W, 3], target [H, W, 3], info)``.

        With ``patch`` and a level larger than its window budget (:func:`~splatflow.train.windows.level_budget`),
        only a random window of that area is rendered (the rasterizer's ``window``: exactly those pixels of the
        whole render); ``info["width"]``/``["height"]`` stay the whole level's, so densification gradients keep
        their scale. With ``sparse`` only the Gaussians that may reach the window are rendered, from copies of
        their rows: ``info["rows"]`` holds their indices, ``info["leaves"]`` the copies the backward fills
        (``params`` get no gradient).
        """
        w, h = self.cache.shape(i, factor)
        win = patch_window(w, h, level_budget(self.window_pixels, factor, self.cfg.patch_level_exponent), self.rng) \
            if patch else None
        target, _ = self.cache.get(i, factor, device=self.device, window=win)  # only the window is uploaded
        mask = self.cache.mask(i, factor, window=win)  # [H, W] bool keep-mask, None without masks
        Kt = self.level_ks(factor)[i]  # [3, 3]
        src, rows, filt = params, None, filter_3d
        if sparse:
            rows = candidates(params, self.viewmats[i], Kt, w, h, win, filter_3d)  # [n] int64
            src = {k: params[k].detach().index_select(0, rows).requires_grad_(True) for k in SPLAT_KEYS}
            filt = None if filt is None else filt.index_select(0, rows)
        a = Splats.of(src).with_filter(filt).activated(sh_degree, sh_pair=True)  # differentiable: grads reach src
        rgb, _, info = rasterize(
            a.means, a.quats, a.scales, a.opacities, a.colors, self.viewmats[i][None], Kt[None], w, h,
            sh_degree=sh_degree, backgrounds=None if background is None else background[None],
            backend=self.cfg.backend, absgrad=self.cfg.densify.absgrad, window=win,
            rasterize_mode=self.cfg.rasterize_mode)
        info["loss_mask"] = None if mask is None else mask.to(target.device)  # read by the step and validation
        if sparse:
            info["rows"], info["leaves"] = rows, src
        return rgb[0], target, info  # [H, W, 3]
