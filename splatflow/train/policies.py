"""The training policies a run is built from (the hooks: :mod:`.hooks`): densification, the 3D smoothing filter
(:class:`Smoothing3D`), the spatial order of the rows, pruning during training (:mod:`.prune_during`), the per-view
appearance transforms (:mod:`.appearance`),
and the optimizer step (one per run: :class:`AdamStep`, :class:`VisibleAdamStep` or :class:`SparseStep`,
``train.sparse_step``, :mod:`.sparse`; each says whether a step renders only its candidate rows, ``sparse``, and
makes the step, ``step(gs, info)``). :func:`for_run` builds them from the train settings as a :class:`RunPolicies`:
the loop calls their hooks in order and never asks which policy it is; the run reads the ones whose state it
checkpoints and reports by name, as :func:`for_run` hands them over.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from splatflow.pipeline.config import TrainConfig
from splatflow.gaussians.model import SPLAT_KEYS
from splatflow.gaussians.smoothing import filter_3d
from splatflow.train.appearance import Appearance
from splatflow.train.hooks import Policy
from splatflow.train.prune_during import PruneDuring
from splatflow.train.state import GaussianState
from splatflow.train.strategies import Strategy, make_strategy, rendered


class Densify(Policy):
    """A densification strategy (:class:`~splatflow.train.strategies.Strategy`, gsplat's protocol) over the
    state's dicts. Before a step at which the strategy may rewrite every row (a refine, an opacity reset: its
    ``changes_params_at``; every step for a strategy that does not say), the rows the sparse step deferred are
    brought up to date; after it, the sparse step's bookkeeping restarts if the parameters were replaced."""

    def __init__(self, strategy: Strategy):
        self.strategy = strategy

    @property
    def sparse_compatible(self) -> bool:
        """Whether the sparse step can run beside the strategy: it reads only the rendered rows' screen-space
        gradients and says when it rewrites rows (adaptive density control). 3DGS-MCMC adds noise and
        regularisers to every Gaussian every step."""
        return bool(getattr(self.strategy, "sparse_compatible", False))

    def initialize(self, gs: GaussianState, scene_scale: float) -> None:
        gs.strategy = self.strategy.initialize_state(scene_scale=scene_scale, device=gs.device)

    def step_pre_backward(self, gs, step, info) -> None:
        self.strategy.step_pre_backward(gs.params, gs.optimizers, gs.strategy, step, info)

    def loss_terms(self, gs, info):
        return self.strategy.loss_terms(gs.params, info)

    def step_post_backward(self, gs, step, info, *, lr=0.0) -> None:
        rewrites = getattr(self.strategy, "changes_params_at", None)
        if rewrites is None or rewrites(step):
            gs.flush()  # a refine or reset reads and rewrites all rows
        self.strategy.step_post_backward(gs.params, gs.optimizers, gs.strategy, step, info, lr=lr)
        gs.sync()
        ev = getattr(self.strategy, "last_event", None)
        if ev:
            info["refine"] = ev


class Smoothing3D(Policy):
    """Mip-Splatting's 3D smoothing filter (``train.filter_3d``; Yu et al., CVPR 2024, §4;
    :mod:`splatflow.gaussians.smoothing`): each Gaussian's filter from the training ``views``' cameras (at the
    working resolution), computed when the run starts and again after every densification event (the paper's
    schedule; positions drift little in between), into ``gs.filter_3d``, which every render of the run applies.
    It comes right after the densification in hook order: a refine changes the rows without it, and the row
    operations of the later policies move the filter with the rows."""

    def __init__(self, views, device: torch.device | str):
        self.viewmats = torch.as_tensor(np.stack([v.world_to_cam for v in views]), dtype=torch.float32,
                                        device=device)  # [C, 4, 4]
        self.Ks = torch.as_tensor(np.stack([v.K for v in views]), dtype=torch.float32, device=device)  # [C, 3, 3]
        self.widths = [int(v.width) for v in views]
        self.heights = [int(v.height) for v in views]

    def update(self, gs: GaussianState) -> None:
        """Recompute the filter of every row from its current position."""
        gs.filter_3d = filter_3d(gs.params["means"].detach(), self.viewmats, self.Ks, self.widths, self.heights)

    def initialize(self, gs: GaussianState, scene_scale: float) -> None:
        self.update(gs)

    def step_post_backward(self, gs, step, info, *, lr=0.0) -> None:
        if info.get("refine"):  # rows added, removed or moved (and, harmlessly, an opacity reset)
            self.update(gs)


class SpatialOrder(Policy):
    """Rows in Morton order of position (``train.spatial_order``, :mod:`.rows`): sorted again after every refine
    event (clones and split children are appended at the end)."""

    def step_post_backward(self, gs, step, info, *, lr=0.0) -> None:
        if info.get("refine"):
            gs.reorder_spatially()


# ------------------------------------------------------------------------------------------------ optimizer steps


class AdamStep:
    """Plain Adam on every row (:func:`splatflow.train.optim.step`)."""

    sparse = False

    def step(self, gs: GaussianState, info: dict) -> None:
        gs.step()


class VisibleAdamStep(AdamStep):
    """Adam on the Gaussians the step's render reached (``train.visible_adam``,
    :func:`splatflow.train.optim.visible_step`)."""

    def step(self, gs, info) -> None:
        gs.step_visible(~rendered(info))


class SparseStep(AdamStep):
    """The sparse step (``train.sparse_step``): the render differentiates copies of its candidate rows
    (``info["rows"]``, ``info["leaves"]``) and Adam steps those rows, deferring the others
    (:class:`~splatflow.train.sparse.SparseAdam`, owned by the state)."""

    sparse = True

    def step(self, gs, info) -> None:
        leaves = info["leaves"]
        gs.step_rows(info["rows"], {k: leaves[k].grad for k in SPLAT_KEYS})


def sparse_ok(cfg: TrainConfig, cpu: bool, dens: Densify | None) -> bool:
    """Whether a run takes the sparse step: ``train.sparse_step`` on the CPU rasterizer, plain Adam (not
    ``visible_adam``) and a strategy that allows it."""
    return cfg.sparse_step and cpu and not cfg.visible_adam and (dens is None or dens.sparse_compatible)


@dataclass
class RunPolicies:
    """A run's policies: ``hooks`` in hook order (what the loop calls), the optimizer step, and by name the ones
    the run itself reads (the densification's strategy; the pruner's and the appearance transforms' checkpointed
    state and report), None when switched off."""

    hooks: list[Policy] = field(default_factory=list)
    adam: AdamStep = field(default_factory=AdamStep)
    densify: Densify | None = None
    pruner: PruneDuring | None = None
    appearance: Appearance | None = None


def for_run(cfg: TrainConfig, *, cpu: bool, densify: bool, initial_count: int, views,
            device: torch.device | str = "cpu") -> RunPolicies:
    """The policies of a run on the training ``views``: the hooks in hook order (densification, the 3D smoothing
    filter, the spatial order on the CPU, pruning during training, the appearance transforms; those switched on,
    none but the filter, the spatial order and the appearance transforms for ``densify=False``), and its optimizer
    step."""
    strategy = make_strategy(cfg.densify, max_steps=cfg.max_steps, initial_count=initial_count) if densify else None
    dens = Densify(strategy) if strategy is not None else None
    pruner = PruneDuring.from_config(cfg.prune_during, cfg.max_steps) if densify and cfg.prune_during.enabled \
        else None
    order = SpatialOrder() if cfg.spatial_order and cpu else None
    # train.appearance: a colour transform per training view between the render and the loss
    appearance = Appearance(len(views), cfg.appearance, cfg.max_steps, device) if cfg.appearance.enabled else None
    smoothing = Smoothing3D(views, device) if cfg.filter_3d else None  # train.filter_3d
    adam = SparseStep() if sparse_ok(cfg, cpu, dens) else VisibleAdamStep() if cfg.visible_adam else AdamStep()
    return RunPolicies([p for p in (dens, smoothing, order, pruner, appearance) if p is not None], adam, dens,
                       pruner, appearance)


def with_strategy(policies: RunPolicies, gs: GaussianState, strategy: Strategy, scene_scale: float) -> RunPolicies:
    """``policies`` with ``strategy`` plugged in for the densification (its state fresh in ``gs``). One that may
    touch every row at any step ends the sparse step: every row is brought up to date and the steps are dense."""
    dens = Densify(strategy)
    dens.initialize(gs, scene_scale)
    adam = policies.adam
    if adam.sparse and not dens.sparse_compatible:
        gs.go_dense()
        adam = AdamStep()
    return replace(policies, hooks=[dens] + [p for p in policies.hooks if p is not policies.densify], adam=adam,
                   densify=dens)
