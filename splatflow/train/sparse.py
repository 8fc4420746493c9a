"""The sparse training step (``train.sparse_step``, CPU runs): a step works on the Gaussians its training window
can reach, and Adam stays exactly dense Adam.

Why: late in a run a 60K-pixel window of an 800x600 view reaches a few thousand of 120K Gaussians, but the
activations, the projection's per-Gaussian buffers and Adam ran over all of them, about a third of the step
(docs/experiments.md, Training). Here a step

1. picks the candidates (:func:`candidates`: the projection kernel's own cheap bound on the raw parameters, so no
   Gaussian the projection would keep is left out),
2. renders, differentiates and steps only those rows (copies of them are the leaves autograd fills),
3. updates them with :class:`SparseAdam`: Adam on those rows, each first brought up to date with the updates dense
   Adam would have made while it had zero gradients (its momentum still moves it; its moments decay), so the
   parameters follow dense Adam up to float rounding (``gsplat``'s ``visible_adam``/SelectiveAdam instead freezes
   unseen rows, a different optimizer, measured worse here).

Anything that reads or rewrites all rows (validation renders, checkpoints, the densification strategy's refine
and opacity reset, ``train.prune_during``'s cuts) first calls :meth:`SparseAdam.flush`, which brings every row up
to date; after such an operation has replaced the parameters, :meth:`SparseAdam.sync` starts the bookkeeping
afresh. The kernels are in :mod:`splatflow.render._sparse_kernels`.
"""

from __future__ import annotations

import numpy as np
import torch

from splatflow.gaussians.model import SPLAT_KEYS
from splatflow.render._sparse_kernels import adam_catch_up, adam_rows, window_candidates
from splatflow.train.multi_adam import adam_state

# a step that reaches more than this share of the rows updates all of them in order (streaming beats jumping)
DENSE_SHARE = 0.25
# what Trainer.render passes to rasterize (its defaults): the candidate bound must use the same camera model
NEAR_PLANE, FAR_PLANE, EPS2D = 0.01, 1e10, 0.3


@torch.no_grad()
def candidates(params: dict, viewmat: torch.Tensor, K: torch.Tensor, width: int, height: int,
               window: tuple[int, int, int, int] | None, filter_3d: torch.Tensor | None = None) -> torch.Tensor:
    """Indices (int64, ascending) of the Gaussians that may reach ``window`` (``(x0, y0, w, h)``; None = the whole
    ``width`` x ``height`` view) of the camera ``viewmat`` [4, 4] / ``K`` [3, 3]; CPU tensors. With a 3D smoothing
    filter ``filter_3d`` [N] the bound takes the filtered scales (the raw opacity bounds the filtered one)."""
    x0, y0, ww, wh = window if window is not None else (0, 0, int(width), int(height))
    log_scales = params["scales"].detach()  # [N, 3]
    if filter_3d is not None:  # log sqrt(s^2 + f^2) = log s + log1p(f^2 / s^2) / 2
        log_scales = log_scales + 0.5 * torch.log1p((filter_3d * filter_3d)[:, None] * torch.exp(-2.0 * log_scales))
    # C order always (a K built from a transposed array is F order): one compiled variant, the one precompiled
    vm = np.ascontiguousarray(viewmat.detach().to(torch.float64).reshape(1, 4, 4).numpy())
    ks = np.ascontiguousarray(K.detach().to(torch.float64).reshape(1, 3, 3).numpy())
    mask = window_candidates(params["means"].detach().numpy(), log_scales.contiguous().numpy(),
                             params["opacities"].detach().numpy(), vm, ks, int(width), int(height), NEAR_PLANE,
                             FAR_PLANE, EPS2D, int(x0), int(y0), int(x0 + ww), int(y0 + wh))
    return torch.from_numpy(np.flatnonzero(mask))


def _rows2d(t: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor as an [N, D] numpy view of the same memory."""
    if not t.is_contiguous():
        raise ValueError("the sparse step needs contiguous parameters and Adam moments")
    return t.detach().view(t.shape[0], -1).numpy()


class SparseAdam:
    """Adam on the rows a step touched, equal to dense torch Adam on all rows (see the module docstring).

    The state lives where torch's Adam keeps it (``optimizer.state[param]``: ``step``, ``exp_avg``,
    ``exp_avg_sq``), so checkpoints, the strategies' row surgery and ``prune_during`` see ordinary Adam state,
    always brought up to date first (:meth:`flush`). Per group it adds the Adam count each row is current at
    (``last``) and the learning rate of every count (dense Adam would have used it for the rows it skipped).
    """

    def __init__(self, params: dict, optimizers: dict):
        g = optimizers["means"].param_groups[0]
        self.beta1, self.beta2 = (float(b) for b in g["betas"])
        self.eps = float(g["eps"])
        for k, opt in optimizers.items():
            pg = opt.param_groups[0]
            if tuple(pg["betas"]) != (self.beta1, self.beta2) or pg["eps"] != self.eps or pg.get("amsgrad") \
                    or pg.get("weight_decay", 0.0) or pg.get("maximize"):
                raise ValueError(f"the sparse step implements plain Adam; group {k} is configured otherwise")
        self.lr: dict[str, np.ndarray] = {k: np.zeros(1024, np.float64) for k in params}
        self._bc1 = self._bc2s = np.ones(1, np.float64)
        self.last: dict[str, np.ndarray] = {}
        self.count: dict[str, int] = {}  # the latest Adam count stepped per group (learning rates recorded so far)
        self.pending = False  # rows behind their group's count (a flush is due before anyone reads all rows)
        self._ids: dict[str, int] = {}
        self.sync(params, optimizers, force=True)

    # ------------------------------------------------------------------------------------------ bookkeeping
    _state = staticmethod(adam_state)  # the param's Adam state, created as torch's Adam creates it

    def _tables(self, t: int) -> None:
        """Bias corrections per Adam count up to ``t``: ``1 - b1^c`` and ``sqrt(1 - b2^c)``."""
        if self._bc1.shape[0] > t:
            return
        c = np.arange(max(2 * t, 1024), dtype=np.float64)
        with np.errstate(divide="ignore"):
            self._bc1 = 1.0 - self.beta1 ** c
            self._bc2s = np.sqrt(1.0 - self.beta2 ** c)
        self._bc1[0] = self._bc2s[0] = 1.0  # count 0 is never used

    def _record_lr(self, k: str, t: int, lr: float) -> None:
        a = self.lr[k]
        if a.shape[0] <= t:
            a = np.concatenate([a, np.zeros(max(t + 1, 2 * a.shape[0]) - a.shape[0], np.float64)])
            self.lr[k] = a
        a[t] = lr

    def sync(self, params: dict, optimizers: dict, *, force: bool = False) -> None:
        """Start the bookkeeping afresh when the parameters were replaced (new rows, a cut, an undo, a resume, an
        opacity reset): every row is then current at its group's count. Those operations read all rows, so they
        must come after :meth:`flush`; a replacement while rows are behind is a bug and raises."""
        ids = {k: id(params[k]) for k in SPLAT_KEYS}
        if not force and ids == self._ids:
            return
        if self.pending:
            raise RuntimeError("the parameters were replaced while the sparse step's Adam had rows behind; "
                               "SparseAdam.flush must run before anything that reads or rewrites all rows")
        self._ids = ids
        for k in SPLAT_KEYS:
            st = self._state(optimizers[k], params[k])
            self.last[k] = np.full(params[k].shape[0], int(st["step"].item()), np.int64)

    def state_dict(self) -> dict:
        """The bookkeeping a checkpoint of an unflushed run needs to resume bit for bit: each row's count and the
        learning rates of the counts rows may still have to catch up on (CPU tensors)."""
        return {"last": {k: torch.from_numpy(v.copy()) for k, v in self.last.items()},
                "lr": {k: torch.from_numpy(self.lr[k][: self.count.get(k, 0) + 1].copy()) for k in self.last}}

    def load_state_dict(self, d: dict, params: dict, optimizers: dict) -> None:
        """Continue from :meth:`state_dict` taken with ``params``/``optimizers`` as they are now (just restored)."""
        self._ids = {k: id(params[k]) for k in SPLAT_KEYS}
        self.pending = False
        for k in SPLAT_KEYS:
            last = d["last"][k].numpy().astype(np.int64).copy()
            if last.shape[0] != params[k].shape[0]:
                raise ValueError(f"sparse step state has {last.shape[0]} rows for {k}, the model {params[k].shape[0]}")
            self.last[k] = last
            lr = d["lr"][k].numpy().astype(np.float64)
            self.lr[k] = np.zeros(max(1024, 2 * lr.shape[0]), np.float64)
            self.lr[k][: lr.shape[0]] = lr
            t = int(self._state(optimizers[k], params[k])["step"].item())
            self._tables(t)
            self.count[k] = t
            self.pending |= bool((last < t).any())

    # ------------------------------------------------------------------------------------------ updates
    def step(self, params: dict, optimizers: dict, rows: torch.Tensor, grads: dict) -> None:
        """One Adam count for every group: rows ``rows`` with gradients ``grads[k]`` ([len(rows), ...]; None =
        zeros), the other rows deferred."""
        self.sync(params, optimizers)
        r = rows.numpy()
        n_all = params["means"].shape[0]
        if len(r) > DENSE_SHARE * n_all:  # most rows reached: stream through all of them instead of jumping
            walk, gpos = np.arange(n_all, dtype=np.int64), np.full(n_all, -1, np.int64)
            gpos[r] = np.arange(len(r))
        else:
            walk, gpos = r, np.arange(len(r), dtype=np.int64)
        for k in SPLAT_KEYS:
            p, opt = params[k], optimizers[k]
            st = self._state(opt, p)
            st["step"] += 1
            t = int(st["step"].item())
            self._tables(t)
            self._record_lr(k, t, float(opt.param_groups[0]["lr"]))
            self.count[k] = t
            g = grads.get(k)
            g = torch.zeros((len(r),) + tuple(p.shape[1:]), dtype=p.dtype, device=p.device) if g is None \
                else g.contiguous()
            adam_rows(_rows2d(p), _rows2d(st["exp_avg"]), _rows2d(st["exp_avg_sq"]), self.last[k], walk, gpos,
                      g.detach().view(len(r), -1).numpy(), t, self.lr[k], self._bc1, self._bc2s, self.beta1,
                      self.beta2, self.eps)
        self.pending = True

    def flush(self, params: dict, optimizers: dict) -> None:
        """Bring every row up to its group's count (what dense Adam would hold now)."""
        if not self.pending:
            return
        self.sync(params, optimizers)
        for k in SPLAT_KEYS:
            st = optimizers[k].state[params[k]]
            t = int(st["step"].item())
            adam_catch_up(_rows2d(params[k]), _rows2d(st["exp_avg"]), _rows2d(st["exp_avg_sq"]), self.last[k], t,
                          self.lr[k], self._bc1, self._bc2s, self.beta1, self.beta2, self.eps)
        self.pending = False
