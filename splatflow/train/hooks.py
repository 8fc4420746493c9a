"""The hooks a training policy offers the loop, and what it is given between steps (docs/design.md §1 habit 4).

Per step, in this order (gsplat's ``step_pre_backward`` / ``step_post_backward`` with the run's
:class:`~splatflow.train.state.GaussianState` in place of ``params, optimizers, state``):

* ``lr_factor(step)``: a multiplier of the position learning rate (1 for most),
* ``step_pre_backward(gs, step, info)`` after the render (e.g. to retain the screen-space gradients it reads),
* ``transform_render(image, view, step)``: the render ``[1, 3, H, W]`` of training view ``view`` as the loss
  compares it with the photo (identity for most; train.appearance's colour transform),
* ``loss_terms(gs, info)``: a term to add to the loss, or None,
* ``step_post_backward(gs, step, info, lr=)`` after the optimizer step; ``info["refine"]`` carries a refine event
  to the policies after the one that made it and to the log,

and between steps:

* ``acts_at(step)``: whether ``after_step`` will read or rewrite the model after ``step`` completed steps (a GPU
  run settles its deferred checks first: :mod:`.guards`),
* ``after_step(gs, step, ctx)`` and, once when training ends, ``finish(gs, step, ctx)``, with ``ctx`` a
  :class:`LoopContext`.

``info`` is the render's dict (the rasterizer's ``info``, plus ``loss_mask`` and, for the sparse step, ``rows``
and ``leaves``): a per-step hook that needs more of the step (the rendered image before the loss, the
rasterizer's settings) gets it there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from splatflow.train.schedules import PlateauStopper
from splatflow.train.state import GaussianState


@dataclass
class LoopContext:
    """What a policy acting between steps may use besides the state: validation on the training views (it
    brings every row up to date), the plateau stop, the active SH degree per step, the training views with their
    image cache, and the step logger (or None)."""

    validate: Callable[[], float]
    stopper: PlateauStopper
    sh_degree: Callable[[int], int]
    views: list
    cache: Any
    step_logger: Any = None


class Policy:
    """The hooks, each doing nothing; a policy overrides the ones it needs (see the module docstring)."""

    def initialize(self, gs: GaussianState, scene_scale: float) -> None:
        """Make the policy's state in ``gs`` (gsplat's ``initialize_state``), once when the run is built."""
        return None

    def lr_factor(self, step: int) -> float:
        return 1.0

    def step_pre_backward(self, gs: GaussianState, step: int, info: dict) -> None:
        return None

    def transform_render(self, image: torch.Tensor, view: int, step: int) -> torch.Tensor:
        return image

    def loss_terms(self, gs: GaussianState, info: dict) -> torch.Tensor | None:
        return None

    def step_post_backward(self, gs: GaussianState, step: int, info: dict, *, lr: float = 0.0) -> None:
        return None

    def acts_at(self, step: int) -> bool:
        return False

    def after_step(self, gs: GaussianState, step: int, ctx: LoopContext) -> None:
        return None

    def finish(self, gs: GaussianState, step: int, ctx: LoopContext) -> None:
        return None
