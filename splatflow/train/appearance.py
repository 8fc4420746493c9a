"""Per-image appearance compensation: an affine colour transform for each training view, learnt with the splat.

Photos of one scene rarely share one exposure and white balance (a phone's automatic exposure, photos from
several cameras or days). A splat fitted to all of them directly averages the differences into floaters and
colour noise. Here each training view ``i`` renders as ``M_i c + b_i`` (a 3x3 matrix and an offset on the rendered
colour ``c``, the per-image exposure / colour correction of Hierarchical 3DGS and of gsplat's, nerfstudio's and
LichtFeld's appearance options in their simplest form), so the splat keeps one consistent colour and the
transform absorbs what differs between photos.

The transforms start at identity and are kept centred: after every update their mean over the training views is
moved back to identity, which fixes the one ambiguity of the model (a colour change of the whole splat undone by
every transform) so that the splat's own colours are those of an average photo. Evaluation and export use the
splat alone (identity): the test views are never fitted.
"""

from __future__ import annotations

import torch

from splatflow.pipeline.config import AppearanceConfig
from splatflow.train.hooks import Policy
from splatflow.train.state import GaussianState


class Appearance(Policy):
    """The transforms of ``n_views`` training views: ``delta [n, 3, 4]``, the deviation from ``[I | 0]``. As a
    training policy: ``transform_render`` applies view ``i``'s transform from ``start_fraction`` of the steps on,
    ``loss_terms`` adds its regulariser, ``step_post_backward`` updates the transform the step used."""

    def __init__(self, n_views: int, cfg: AppearanceConfig, max_steps: int, device: torch.device | str = "cpu"):
        self.cfg = cfg
        self.start_step = int(round(cfg.start_fraction * max_steps))
        self.delta = torch.nn.Parameter(torch.zeros(n_views, 3, 4, device=device))
        self.optimizer = torch.optim.Adam([self.delta], lr=cfg.lr, eps=1e-15)
        self._eye = torch.eye(3, 4, device=device)
        self._view: int | None = None  # the view whose transform this step applied

    # ------------------------------------------------------------------------------------------ hooks
    def transform_render(self, image: torch.Tensor, view: int, step: int) -> torch.Tensor:
        self._view = view if self.active(step) else None
        return image if self._view is None else self.apply(image, view)

    def loss_terms(self, gs: GaussianState, info: dict) -> torch.Tensor | None:
        return self.regulariser(self._view) if self._view is not None and self.cfg.reg > 0 else None

    def step_post_backward(self, gs: GaussianState, step: int, info: dict, *, lr: float = 0.0) -> None:
        if self._view is not None:
            self.step()
            self._view = None

    def active(self, step: int) -> bool:
        return step >= self.start_step

    def apply(self, image: torch.Tensor, i: int) -> torch.Tensor:
        """``image [1, 3, H, W]`` as training view ``i`` shows it."""
        t = self._eye + self.delta[i]  # [3, 4]
        return torch.einsum("cd,bdhw->bchw", t[:, :3], image) + t[:, 3][None, :, None, None]

    def regulariser(self, i: int) -> torch.Tensor:
        """``reg * |delta_i|^2``: keeps a transform from explaining what the splat should (view-dependent colour)."""
        return self.cfg.reg * self.delta[i].square().sum()

    @torch.no_grad()
    def step(self) -> None:
        """One Adam update, then the transforms are centred again (their mean is the identity)."""
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.delta.sub_(self.delta.mean(dim=0, keepdim=True))

    def report(self) -> dict:
        """Numbers for train.json: how far the transforms moved from identity (mean and largest of the views)."""
        d = self.delta.detach().flatten(1).norm(dim=1)  # [n]
        return {"views": int(d.numel()), "mean_deviation": round(float(d.mean()), 5),
                "max_deviation": round(float(d.max()), 5) if d.numel() else 0.0}

    def state_dict(self) -> dict:
        return {"delta": self.delta.detach().cpu().clone(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            self.delta.copy_(state["delta"].to(self.delta.device))
        self.optimizer.load_state_dict(state["optimizer"])
