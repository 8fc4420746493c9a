"""The Gaussians of a training run as one object: parameters, their optimizers and every per-Gaussian row of state.

Why one object: a Gaussian is a row in six parameter tensors, in two Adam moments per tensor, in the densification
statistics (``grad2d``, ``count``, ``radii``) and in the sparse step's bookkeeping (the Adam count each row is
current at). Every operation that adds, removes, reorders or moves rows must move all of them together, and
anything that reads every row must first bring the rows the sparse step deferred up to date. :class:`GaussianState`
does both itself: its row operations (:meth:`~GaussianState.keep`, :meth:`~GaussianState.reorder`,
:meth:`~GaussianState.append`, :meth:`~GaussianState.relocate`) bring every row up to date first and keep every row
aligned, and its :meth:`~GaussianState.state_dict` is what a checkpoint holds of the model.

A densification strategy keeps gsplat's shape (``step_post_backward(params, optimizers, state, step, info)``): it
gets the state's dicts and may replace their entries with gsplat's own ops; :meth:`GaussianState.sync` then
restarts the sparse step's bookkeeping (it raises if rows were still behind: the hook must run after
:meth:`GaussianState.flush`, which the densification policy arranges).
"""

from __future__ import annotations

import torch

from splatflow.pipeline.device import to_device
from splatflow.gaussians.model import SPLAT_KEYS, Splats
from splatflow.train import optim
from splatflow.train.rows import spatial_order
from splatflow.train.sparse import SparseAdam

# per-Gaussian entries of a densification strategy's state (rows follow the Gaussians); a strategy keeping other
# per-Gaussian tensors adds their names here
ROW_KEYS = ("grad2d", "count", "radii")
ADAM_ROW_KEYS = ("exp_avg", "exp_avg_sq")


class GaussianState:
    """``params`` (the six ``torch.nn.Parameter`` groups, gsplat's naming), ``optimizers`` (one Adam per group),
    ``strategy`` (the densification strategy's state dict, gsplat's layout; ``{}`` without one) and ``sparse``
    (the sparse step's :class:`~splatflow.train.sparse.SparseAdam` bookkeeping, None for dense steps) and
    ``filter_3d`` (Mip-Splatting's 3D smoothing filter, ``[N]``, a row of every Gaussian but no parameter; None
    without one: ``train.filter_3d``'s policy sets it, :class:`splatflow.train.policies.Smoothing3D`).

    ``splats`` are copied to ``device`` as float32 parameters (their filter, when they have one, as the filter);
    ``lrs`` are the groups' learning rates.
    """

    def __init__(self, splats, lrs: dict[str, float], device: torch.device | str, *, sparse: bool = False):
        splats = Splats.of(splats)
        self.params = {k: torch.nn.Parameter(splats[k].detach().to(device, torch.float32, copy=True))
                       for k in SPLAT_KEYS}
        self.optimizers = optim.make_optimizers(self.params, lrs)
        self.strategy: dict = {}
        self.sparse = SparseAdam(self.params, self.optimizers) if sparse else None
        self.filter_3d: torch.Tensor | None = None if splats.filter_3d is None else \
            splats.filter_3d.detach().to(device, torch.float32, copy=True)  # [N]

    # ------------------------------------------------------------------------------------------ reading
    @property
    def n(self) -> int:
        """The number of Gaussians (rows)."""
        return int(self.params["means"].shape[0])

    @property
    def device(self) -> torch.device:
        return self.params["means"].device

    def splats(self) -> Splats:
        """The parameters and the 3D smoothing filter as :class:`~splatflow.gaussians.model.Splats` (the same
        tensors: renders differentiate them)."""
        return Splats.of(self.params).with_filter(self.filter_3d)

    def set_lr(self, group: str, lr: float) -> None:
        for g in self.optimizers[group].param_groups:
            g["lr"] = lr

    # ------------------------------------------------------------------------------------------ optimizer steps
    def step(self) -> None:
        """Adam on every row (:func:`splatflow.train.optim.step`), then drop the gradients."""
        optim.step(self.optimizers)

    def step_visible(self, unseen: torch.Tensor) -> None:
        """Adam on every row but the ``unseen`` ones (``[N]`` bool), which keep parameters and moments
        (:func:`splatflow.train.optim.visible_step`)."""
        optim.visible_step(self.params, self.optimizers, unseen)

    def step_rows(self, rows: torch.Tensor, grads: dict) -> None:
        """The sparse step's Adam: rows ``rows`` with gradients ``grads[k]`` (``[len(rows), ...]``), every other
        row deferred (:meth:`splatflow.train.sparse.SparseAdam.step`)."""
        self.sparse.step(self.params, self.optimizers, rows, grads)

    # ------------------------------------------------------------------------------------------ deferred rows
    @property
    def pending(self) -> bool:
        """Whether the sparse step left rows behind their Adam count (a :meth:`flush` is due before a full read)."""
        return self.sparse is not None and self.sparse.pending

    def flush(self) -> None:
        """Bring every row's parameters and Adam moments up to date (what dense Adam would hold now); before
        anything reads or rewrites all rows. A no-op for dense steps and when nothing is behind."""
        if self.sparse is not None:
            self.sparse.flush(self.params, self.optimizers)

    def sync(self) -> None:
        """Restart the sparse step's bookkeeping after the parameters were replaced (by a strategy's ops); raises
        if rows were still behind. A no-op when nothing was replaced."""
        if self.sparse is not None:
            self.sparse.sync(self.params, self.optimizers)

    def go_dense(self) -> None:
        """Bring every row up to date and drop the sparse step's bookkeeping: every later step is dense."""
        self.flush()
        self.sparse = None

    # ------------------------------------------------------------------------------------------ row operations
    def _replace(self, fn_param, fn_moment, fn_row) -> None:
        """Apply the row operation to every parameter (``fn_param(name, tensor) -> tensor``), its Adam moments
        (``fn_moment``), the strategy's per-row tensors (``fn_row``) and the 3D smoothing filter (as a parameter,
        ``fn_param("filter_3d", tensor)``: it moves with the Gaussian), as new ``Parameter`` objects (as gsplat's
        strategy ops make), with every row brought up to date first."""
        self.flush()
        n_old = self.n
        if self.filter_3d is not None:
            if self.filter_3d.shape[0] != n_old:  # a strategy changed the rows without the filter policy after it
                raise RuntimeError(f"the 3D smoothing filter has {self.filter_3d.shape[0]} rows, the model {n_old}: "
                                   "the filter must be recomputed after a densification event before a row operation")
            with torch.no_grad():
                self.filter_3d = fn_param("filter_3d", self.filter_3d).contiguous()
        with torch.no_grad():
            for k in SPLAT_KEYS:
                old = self.params[k]
                new = torch.nn.Parameter(fn_param(k, old.detach()).contiguous())
                opt = self.optimizers[k]
                st = opt.state.pop(old, {})
                for name in ADAM_ROW_KEYS:
                    if name in st:
                        st[name] = fn_moment(st[name]).contiguous()
                opt.param_groups[0]["params"] = [new]
                if st:
                    opt.state[new] = st
                self.params[k] = new
            for name in ROW_KEYS:
                v = self.strategy.get(name)
                if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == n_old:
                    self.strategy[name] = fn_row(v).contiguous()
        self.sync()

    def keep(self, rows: torch.Tensor) -> None:
        """Keep Gaussians ``rows`` (int64 indices into the current rows: ascending to cut, a permutation to
        reorder), in that order, in every per-Gaussian tensor."""
        r = rows.to(self.device)

        def take(t: torch.Tensor) -> torch.Tensor:
            return t.index_select(0, r if t.device == r.device else rows.to(t.device))

        self._replace(lambda k, p: take(p), take, take)

    def reorder(self, perm: torch.Tensor) -> None:
        """Put the rows in the order ``perm`` (a permutation of ``range(n)``)."""
        if perm.shape != (self.n,):
            raise ValueError(f"a reordering needs a permutation of {self.n} rows, got shape {tuple(perm.shape)}")
        self.keep(perm)

    def reorder_spatially(self) -> None:
        """Put the rows in Morton order of position (:func:`splatflow.train.rows.spatial_order`)."""
        self.reorder(spatial_order(self.params["means"]))

    def append(self, values: dict[str, torch.Tensor]) -> None:
        """Add Gaussians with the parameters ``values`` (``[m, ...]`` per group) after the current rows; their
        Adam moments and per-row statistics start at zero (a new Gaussian has no history)."""
        m = int(values["means"].shape[0])

        def zeros_after(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([t, t.new_zeros((m, *t.shape[1:]))])

        def param(k: str, p: torch.Tensor) -> torch.Tensor:
            if k == "filter_3d" and k not in values:  # no filter given: none until the next recompute
                return zeros_after(p)
            return torch.cat([p, values[k].to(p.device, p.dtype)])

        self._replace(param, zeros_after, zeros_after)

    def relocate(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Move Gaussians ``dst`` onto ``src``: rows ``dst`` take the parameters of rows ``src`` (3DGS-MCMC's
        relocation of dead Gaussians), and rows ``src`` restart their Adam moments and per-row statistics from zero,
        since they now share their opacity with their copies; rows ``dst`` keep their moments, as gsplat's
        ``relocate`` does."""
        def move(k, p):
            p = p.clone()
            p[dst.to(p.device)] = p[src.to(p.device)]
            return p

        def restart(t):
            t = t.clone()
            t[src.to(t.device)] = 0
            return t

        self._replace(move, restart, restart)

    # ------------------------------------------------------------------------------------------ undo
    def snapshot(self) -> dict:
        """Copies of the parameters, their Adam state and the 3D smoothing filter (what :meth:`restore` puts
        back)."""
        out = {}
        for k in SPLAT_KEYS:
            p = self.params[k]
            st = self.optimizers[k].state.get(p, {})
            out[k] = {"param": p.detach().clone(), **{n: v.detach().clone() for n, v in st.items()}}
        if self.filter_3d is not None:
            out["filter_3d"] = self.filter_3d.clone()
        return out

    def restore(self, snap: dict) -> None:
        """Put a :meth:`snapshot` back (new ``Parameter`` objects); the strategy's per-row statistics, which
        described the rows in between, are dropped (the strategy starts them afresh)."""
        self.flush()
        for k in SPLAT_KEYS:
            old = self.params[k]
            new = torch.nn.Parameter(snap[k]["param"].clone().to(old.device))
            opt = self.optimizers[k]
            opt.state.pop(old, None)
            opt.param_groups[0]["params"] = [new]
            st = {n: v.clone().to(old.device) for n, v in snap[k].items() if n != "param"}
            if st:
                opt.state[new] = st
            self.params[k] = new
        if snap.get("filter_3d") is not None:
            self.filter_3d = snap["filter_3d"].clone().to(self.device)
        for name in ROW_KEYS:
            if isinstance(self.strategy.get(name), torch.Tensor):
                self.strategy[name] = None
        self.sync()

    # ------------------------------------------------------------------------------------------ Adam moments
    def moments(self, copy: bool = True) -> dict:
        """Each group's Adam state, rows up to date, on the CPU: ``{group: {"step", "exp_avg", "exp_avg_sq"}}``,
        one row per Gaussian; ``{}`` for a group not stepped yet. What :meth:`set_moments` takes, after selecting
        rows with :func:`select_moments`. ``copy=False`` hands out the state's own CPU tensors (for a state about
        to be dropped) instead of copies."""
        self.flush()
        out = {}
        for k in SPLAT_KEYS:
            st = self.optimizers[k].state.get(self.params[k], {})
            out[k] = {n: v.detach().to("cpu", copy=copy) for n, v in st.items()}
        return out

    def set_moments(self, moments: dict) -> None:
        """Continue Adam from ``moments`` (:meth:`moments`'s layout, one row per current Gaussian; a group given
        as ``{}`` starts from zero): a fine-tune of a trained model then takes the steps its training would have
        taken, instead of restarting with bias-corrected moments of a few samples."""
        self.flush()
        for k in SPLAT_KEYS:
            m = moments.get(k) or {}
            p, opt = self.params[k], self.optimizers[k]
            if not m:
                opt.state.pop(p, None)
                continue
            for name in ADAM_ROW_KEYS:
                if tuple(m[name].shape) != tuple(p.shape):
                    raise ValueError(f"Adam {name} of {k} has shape {tuple(m[name].shape)}, the parameter "
                                     f"{tuple(p.shape)}: the moments must follow the Gaussians' rows")
            step = m["step"].detach().to(torch.float32).reshape(())
            opt.state[p] = {"step": step.to(p.device, copy=True),
                            **{n: m[n].detach().to(p.device, torch.float32, copy=True) for n in ADAM_ROW_KEYS}}
        if self.sparse is not None:
            self.sparse.sync(self.params, self.optimizers, force=True)

    # ------------------------------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        """Everything a checkpoint holds of the Gaussians, every tensor on the CPU: ``splats`` (the parameters as
        they are), ``optimizers`` (each group's Adam state dict), ``strategy_state`` and, while rows are behind
        (an unfinished run of the sparse step), ``sparse`` (their bookkeeping, for a bit-exact resume)."""
        d = {"splats": self.splats().stored(),  # with the 3D smoothing filter, when there is one
             "optimizers": to_device({k: o.state_dict() for k, o in self.optimizers.items()}, "cpu"),
             "strategy_state": to_device(self.strategy, "cpu")}
        if self.pending:
            d["sparse"] = self.sparse.state_dict()
        return d

    def load_state_dict(self, d: dict) -> None:
        """Continue from :meth:`state_dict` (tensors on any device; moved to this state's device). A checkpoint
        with rows behind continues them with the sparse step's bookkeeping, or, for dense steps, brings them up to
        date at once. Every tensor is copied: the state shares none with ``d``."""
        device = self.device
        splats = Splats.of(d["splats"])
        self.params = {k: torch.nn.Parameter(splats[k].to(device, copy=True)) for k in SPLAT_KEYS}
        self.filter_3d = None if splats.filter_3d is None else splats.filter_3d.to(device, copy=True)
        for k in SPLAT_KEYS:
            opt = optim.adam(self.params[k], 1.0)  # the learning rate comes with the state
            opt.load_state_dict(_copied(d["optimizers"][k], device))
            self.optimizers[k] = opt
        self.strategy = _copied(d["strategy_state"], device)
        sparse = d.get("sparse")
        if sparse is None:
            if self.sparse is not None:
                self.sparse.sync(self.params, self.optimizers, force=True)
            return
        lazy = self.sparse or SparseAdam(self.params, self.optimizers)
        lazy.load_state_dict(to_device(sparse, "cpu"), self.params, self.optimizers)
        if self.sparse is None:
            lazy.flush(self.params, self.optimizers)



def select_moments(moments: dict, rows: torch.Tensor) -> dict:
    """``moments`` (:meth:`GaussianState.moments`'s layout) of the Gaussians ``rows`` only (int64 indices)."""
    return {k: {n: (v.index_select(0, rows.to(v.device)) if n in ADAM_ROW_KEYS else v) for n, v in m.items()}
            for k, m in moments.items()}


def _copied(obj, device: torch.device):
    """``obj`` (tensors nested in dicts, lists and tuples) with every tensor copied to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, copy=True)
    if isinstance(obj, dict):
        return {k: _copied(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_copied(v, device) for v in obj)
    return obj
