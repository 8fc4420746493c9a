"""Densification policies that run on CPU, with a hard Gaussian budget and logged refine events.

Every strategy follows one small protocol, :class:`Strategy` (gsplat's hooks, ``initialize_state``,
``step_pre_backward``, ``step_post_backward``, plus ``loss_terms`` for the terms a strategy adds to the loss and
``last_event`` for the loop to log), so the training loop calls the same four methods whichever one runs and never
asks which it is.

* :class:`BudgetedDefaultStrategy`: gsplat's ``DefaultStrategy`` (adaptive density control of the 3DGS paper,
  Kerbl et al. 2023, §5.2) with a cap on the count. When more Gaussians qualify for cloning/splitting than the
  budget leaves room for, only the ones with the largest accumulated view-space gradient grow: the
  score-ordered, budget-limited growth of Taming 3DGS (Mallick et al. 2024, §4.2), with the gradient as score.
  Deviation from gsplat 1.5.3: its opacity reset test ``step % reset_every == 0 & step > 0`` is never true
  (operator precedence); we reset as the 3DGS reference does, every ``reset_every`` steps while refining.
  No loss terms.
* :class:`TorchMCMCStrategy`: gsplat's ``MCMCStrategy`` (3DGS as MCMC, Kheradmand et al. 2024) with the paper's
  opacity and scale regularisers as its loss terms. On a GPU it runs gsplat's own relocation / sample-add /
  noise ops (CUDA kernels); on the CPU, where those kernels do not exist, the free functions below
  (:func:`relocate`, :func:`sample_add`, :func:`inject_noise_to_position`), which take gsplat's arguments (the
  relocation table in place of gsplat's binomial table) so that one code path calls either set.

Device: the state is created on the run's device (``initialize_state(..., device=)``) and everything these
strategies allocate follows the parameters' device. gsplat's ops are called inside ``torch.device(...)`` of the
parameters, because one of them (``reset_opa``) builds a tensor without a device.
"""

from __future__ import annotations

import math
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from gsplat.strategy import DefaultStrategy, MCMCStrategy
from gsplat.strategy import ops as gsplat_ops
from gsplat.strategy.ops import (_multinomial_sample, _update_param_with_optimizer, duplicate, remove, reset_opa,
                                 split)
from gsplat.utils import normalized_quat_to_rotmat

Params = dict[str, torch.nn.Parameter]
Optimizers = dict[str, torch.optim.Optimizer]


@runtime_checkable
class Strategy(Protocol):
    """What the training loop calls, in this order, every step.

    ``loss_terms(params, info)`` after the photometric loss (a scalar to add, or None); ``step_pre_backward``
    before ``loss.backward()`` (e.g. to retain the screen-space gradients it reads); ``step_post_backward`` after
    the optimizer step, with the step's position learning rate ``lr`` (the MCMC noise scales with it; others
    ignore it). It may replace the parameters and resize the optimizers' moments (gsplat's convention), and sets
    ``last_event`` to a dict describing a refine (or None) for the loop to log.

    The training loop calls it through :class:`splatflow.train.policies.Densify`, with the dicts of the run's
    :class:`~splatflow.train.state.GaussianState`. Optional: ``changes_params_at(step)`` (whether the post-backward
    hook at ``step`` may rewrite every row; without it, every step is assumed to) and ``sparse_compatible``
    (True: the sparse step may run beside it; it reads only the rendered rows, ``info["rows"]``).
    """

    last_event: dict | None

    def initialize_state(self, scene_scale: float = 1.0,
                         device: torch.device | str = "cpu") -> dict[str, Any]: ...

    def loss_terms(self, params: Params, info: dict) -> torch.Tensor | None: ...

    def step_pre_backward(self, params: Params, optimizers: Optimizers, state: dict, step: int,
                          info: dict) -> None: ...

    def step_post_backward(self, params: Params, optimizers: Optimizers, state: dict, step: int, info: dict, *,
                           lr: float = 0.0) -> None: ...


def rendered(info: dict, *, per_view: bool = False) -> torch.Tensor:
    """Bool mask of the Gaussians a render reached (non-zero screen radius): ``[N]`` over all of its views (or its
    window), or ``[C, N]`` per view with ``per_view``. Radii come as ``[C, N]`` or ``[C, N, 2]``."""
    radii = info["radii"]
    seen = (radii > 0).all(dim=-1) if radii.dim() == 3 else radii > 0  # [C, N]
    return seen if per_view else seen.any(0)


class BudgetedDefaultStrategy(DefaultStrategy):
    """Adaptive density control (clone small / split large high-gradient Gaussians, prune transparent and huge
    ones, periodic opacity reset) that never lets the count exceed ``cap``."""

    # the sparse step may run beside it: it reads only the rendered rows' screen-space gradients (info["rows"])
    # and says when it rewrites rows (changes_params_at)
    sparse_compatible = True

    def __init__(self, *, cap: int, initial_count: int = 0, ramp_end_iter: int = 0, **kwargs):
        super().__init__(**kwargs)
        self.cap = int(cap)
        self.initial_count = int(initial_count)
        self.ramp_end_iter = int(ramp_end_iter)
        self.last_event: dict | None = None
        self._scales: dict[tuple, torch.Tensor] = {}  # _ndc_scale's tensors

    def cap_at(self, step: int) -> int:
        """The count allowed at ``step``: the whole cap, or with a ramp (``ramp_end_iter`` after the refine start)
        the initial count growing linearly to the cap at ``ramp_end_iter``."""
        if self.ramp_end_iter <= self.refine_start_iter or self.initial_count >= self.cap:
            return self.cap
        t = min(1.0, max(0.0, (step - self.refine_start_iter) / (self.ramp_end_iter - self.refine_start_iter)))
        return int(round(self.initial_count + t * (self.cap - self.initial_count)))

    def initialize_state(self, scene_scale: float = 1.0, device: torch.device | str = "cpu") -> dict[str, Any]:
        # gsplat's state holds no tensors until the first step (grad2d/count are made on the gradients' device)
        return super().initialize_state(scene_scale=scene_scale)

    def loss_terms(self, params, info) -> None:
        return None  # adaptive density control adds nothing to the loss

    def step_pre_backward(self, params, optimizers, state, step, info):
        info[self.key_for_gradient].retain_grad()

    def _update_state(self, params, state, info, packed: bool = False):
        # Own version of gsplat's: accepts radii [C, N] as well as [C, N, 2] and needs no "gaussian_ids".
        grad = info[self.key_for_gradient].absgrad if self.absgrad else info[self.key_for_gradient].grad
        if grad is None:
            return
        scale = self._ndc_scale(info["width"] / 2.0 * info["n_cameras"], info["height"] / 2.0 * info["n_cameras"],
                                grad)
        n = params["means"].shape[0]
        if state["grad2d"] is None or state["grad2d"].shape[0] != n:
            state["grad2d"] = grad.new_zeros(n)  # [N]
            state["count"] = grad.new_zeros(n)  # [N]
        sel = rendered(info, per_view=True)  # [C, N] (or [C, n]: the sparse step's rows)
        norms = (grad * scale).norm(dim=-1)  # [C, N] gradient in NDC units, as the 3DGS reference
        rows = info.get("rows")  # the sparse step (splatflow.train.sparse): info covers these Gaussians only
        if rows is None:
            state["grad2d"] += (norms * sel).sum(dim=0)
            state["count"] += sel.sum(dim=0).to(state["count"].dtype)
        else:
            state["grad2d"].index_add_(0, rows, (norms * sel).sum(dim=0))
            state["count"].index_add_(0, rows, sel.sum(dim=0).to(state["count"].dtype))

    def _ndc_scale(self, sx: float, sy: float, like: torch.Tensor) -> torch.Tensor:
        """``[sx, sy]`` on ``like``'s device, made once per value: a tensor made from Python numbers is copied to a
        GPU with the host waiting, which every step would otherwise do (the views of a run share a few sizes)."""
        key = (sx, sy, like.device, like.dtype)
        if key not in self._scales:
            self._scales[key] = like.new_tensor([sx, sy])
        return self._scales[key]

    def changes_params_at(self, step: int) -> bool:
        """Whether :meth:`step_post_backward` at ``step`` may replace or rewrite the parameters (a refine or an
        opacity reset): the sparse step brings every row up to date first."""
        if step >= self.refine_stop_iter:
            return False
        return (step > self.refine_start_iter and step % self.refine_every == 0) or \
            (self.reset_every > 0 and step > 0 and step % self.reset_every == 0)

    def step_post_backward(self, params, optimizers, state, step, info, *, lr: float = 0.0, packed: bool = False):
        self.last_event = None  # lr: the protocol's; adaptive density control does not use it
        if step >= self.refine_stop_iter:
            return
        self._update_state(params, state, info)
        if step > self.refine_start_iter and step % self.refine_every == 0:
            n_before = params["means"].shape[0]
            n_clone, n_split = self._grow_gs(params, optimizers, state, step)
            n_prune = self._prune_gs(params, optimizers, state, step)
            state["grad2d"].zero_()
            state["count"].zero_()
            self.last_event = {"step": step, "clones": n_clone, "splits": n_split, "prunes": n_prune,
                               "before": n_before, "gaussians": params["means"].shape[0]}
        if self.reset_every > 0 and step > 0 and step % self.reset_every == 0:
            with torch.device(params["means"].device):
                reset_opa(params=params, optimizers=optimizers, state=state, value=self.prune_opa * 2.0)
            ev = self.last_event or {"step": step, "clones": 0, "splits": 0, "prunes": 0,
                                     "gaussians": params["means"].shape[0]}
            ev["opacity_reset"] = True
            self.last_event = ev

    @torch.no_grad()
    def _grow_gs(self, params, optimizers, state, step) -> tuple[int, int]:
        grads = state["grad2d"] / state["count"].clamp_min(1)  # [N] mean NDC gradient
        is_high = grads > self.grow_grad2d
        is_small = torch.exp(params["scales"]).max(dim=-1).values <= self.grow_scale3d * state["scene_scale"]
        # Cloning adds one Gaussian; splitting replaces one by two: each candidate costs one slot.
        room = max(0, self.cap_at(step) - params["means"].shape[0])
        n_cand = int(is_high.sum())
        if n_cand > room:
            keep = torch.zeros_like(is_high)
            if room > 0:
                score = torch.where(is_high, grads, torch.full_like(grads, -1.0))
                keep[torch.topk(score, room).indices] = True
            is_high = is_high & keep
        is_clone = is_high & is_small
        is_split = is_high & ~is_small
        n_clone, n_split = int(is_clone.sum()), int(is_split.sum())
        if n_clone > 0:
            duplicate(params=params, optimizers=optimizers, state=state, mask=is_clone)
        is_split = torch.cat([is_split, is_split.new_zeros(n_clone)])  # clones are not split
        if n_split > 0:
            split(params=params, optimizers=optimizers, state=state, mask=is_split,
                  revised_opacity=self.revised_opacity)
        return n_clone, n_split

    @torch.no_grad()
    def _prune_gs(self, params, optimizers, state, step) -> int:
        is_prune = torch.sigmoid(params["opacities"].flatten()) < self.prune_opa
        if step > self.reset_every > 0:
            is_prune |= torch.exp(params["scales"]).max(dim=-1).values > self.prune_scale3d * state["scene_scale"]
        n = int(is_prune.sum())
        if n > 0:
            remove(params=params, optimizers=optimizers, state=state, mask=is_prune)
        return n


# ------------------------------------------------------------------------------------------------ MCMC


def relocation_coefficients(n_max: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``coef[r, k]`` such that the 3DGS-MCMC scale-preserving denominator for ``r`` copies is
    ``sum_k coef[r, k] * o_new**(k+1)``  (float64, ``[n_max + 1, n_max]``).

    Kheradmand et al. 2024, Eq. 9: ``denom = sum_{i=1}^{r} sum_{k=0}^{i-1} C(i-1, k) (-1)^k o_new^(k+1) / sqrt(k+1)``.
    Swapping the sums, the coefficient of ``o_new^(k+1)`` is ``(-1)^k / sqrt(k+1) * sum_{i=k+1}^{r} C(i-1, k)``.
    """
    coef = torch.zeros(n_max + 1, n_max, dtype=torch.float64, device=device)
    for r in range(1, n_max + 1):
        for k in range(r):
            s = sum(math.comb(i - 1, k) for i in range(k + 1, r + 1))
            coef[r, k] = (-1) ** k / math.sqrt(k + 1) * s
    return coef


def compute_relocation_torch(opacities: torch.Tensor, scales: torch.Tensor, ratios: torch.Tensor,
                             coef: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """New opacity and scale when a Gaussian is shared by ``ratios`` copies (3DGS-MCMC Eq. 9), in torch.

    ``o_new = 1 - (1 - o)^(1/r)`` keeps the summed opacity; the scale is shrunk by ``o / denom`` so the
    rendered footprint of the ``r`` overlapping copies matches the original. ``opacities [M]``, ``scales
    [M, 3]``, ``ratios [M]`` int (clamped to ``coef``'s range as gsplat's kernel does).
    """
    n_max = coef.shape[1]
    r = ratios.clamp(1, n_max).long()
    o = opacities.double()
    o_new = 1.0 - torch.pow(1.0 - o, 1.0 / r.double())  # [M]
    powers = o_new.unsqueeze(-1) ** torch.arange(1, n_max + 1, dtype=torch.float64, device=o.device)  # [M, n_max]
    denom = (coef[r] * powers).sum(-1)  # [M]
    factor = o / denom
    return o_new.float(), scales * factor.float().unsqueeze(-1)


def _sample_shared(params: Params, coef: torch.Tensor, n: int, candidates: torch.Tensor | None,
                   min_opacity: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw ``n`` indices (among ``candidates``, default all) with probability ~ opacity, and the opacity and
    scale each drawn Gaussian gets once it is shared by its copies (:func:`compute_relocation_torch`)."""
    opac = torch.sigmoid(params["opacities"])
    pool = opac if candidates is None else opac[candidates]
    idx = _multinomial_sample(pool, n, replacement=True)  # [n]
    if candidates is not None:
        idx = candidates[idx]
    new_o, new_s = compute_relocation_torch(opac[idx], torch.exp(params["scales"])[idx],
                                            torch.bincount(idx)[idx] + 1, coef)
    eps = torch.finfo(torch.float32).eps
    return idx, torch.clamp(new_o, min=min_opacity, max=1.0 - eps), new_s


@torch.no_grad()
def relocate(params: Params, optimizers: Optimizers, state: dict, mask: torch.Tensor, coef: torch.Tensor,
             min_opacity: float = 0.005) -> None:
    """Move the Gaussians of ``mask`` (dead ones) onto live ones drawn by opacity, in place (3DGS-MCMC §4.2).

    gsplat's ``relocate`` in torch, with the same arguments except ``coef`` (:func:`relocation_coefficients`) in
    place of its binomial table. Each drawn Gaussian and its new copies share its opacity and scale
    (:func:`compute_relocation_torch`); the drawn ones' Adam moments are zeroed, as are their rows of every tensor
    in ``state`` (per-Gaussian statistics; pass ``{}`` for none). Nothing happens when no Gaussian is dead or none
    is alive."""
    dead_idx = mask.nonzero(as_tuple=True)[0]
    alive_idx = (~mask).nonzero(as_tuple=True)[0]
    n = len(dead_idx)
    if n == 0 or len(alive_idx) == 0:
        return
    idx, new_o, new_s = _sample_shared(params, coef, n, alive_idx, min_opacity)

    def param_fn(name, p):
        _set_sampled(name, p, idx, new_o, new_s)
        p[dead_idx] = p[idx]
        return torch.nn.Parameter(p, requires_grad=p.requires_grad)

    def optimizer_fn(key, v):
        v[idx] = 0
        return v

    _update_param_with_optimizer(param_fn, optimizer_fn, params, optimizers)
    for v in state.values():
        if isinstance(v, torch.Tensor):
            v[idx] = 0


def _set_sampled(name: str, p: torch.Tensor, idx: torch.Tensor, new_o: torch.Tensor, new_s: torch.Tensor) -> None:
    """Give the drawn Gaussians ``idx`` their shared opacity and scale (3DGS-MCMC's moment-preserving split), in
    the raw parametrisation of tensor ``name`` (logit opacities, log scales); other tensors are left as they are."""
    if name == "opacities":
        p[idx] = torch.logit(new_o)
    elif name == "scales":
        p[idx] = torch.log(new_s)


@torch.no_grad()
def sample_add(params: Params, optimizers: Optimizers, state: dict, n: int, coef: torch.Tensor,
               min_opacity: float = 0.005) -> None:
    """Append ``n`` copies of Gaussians drawn by opacity, in place (3DGS-MCMC §4.2).

    gsplat's ``sample_add`` in torch, with ``coef`` in place of its binomial table. The drawn Gaussians and their
    copies share their opacity and scale; the copies start with zero Adam moments and zero rows in every tensor
    of ``state``."""
    if n <= 0:
        return
    idx, new_o, new_s = _sample_shared(params, coef, n, None, min_opacity)

    def param_fn(name, p):
        _set_sampled(name, p, idx, new_o, new_s)
        return torch.nn.Parameter(torch.cat([p, p[idx]]), requires_grad=p.requires_grad)

    def optimizer_fn(key, v):
        return torch.cat([v, v.new_zeros((n, *v.shape[1:]))])

    _update_param_with_optimizer(param_fn, optimizer_fn, params, optimizers)
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            state[k] = torch.cat([v, v.new_zeros((n, *v.shape[1:]))])


@torch.no_grad()
def inject_noise_to_position(params: Params, optimizers: Optimizers, state: dict, scaler: float) -> None:
    """SGLD position noise ``Sigma eps``, gated to near-transparent Gaussians by ``sigmoid(100 (1 - o - 0.995))``
    (3DGS-MCMC Eq. 10): gsplat's ``inject_noise_to_position`` with the covariance built in torch."""
    if scaler <= 0:
        return
    opac = torch.sigmoid(params["opacities"].flatten())
    R = normalized_quat_to_rotmat(F.normalize(params["quats"], dim=-1))  # [N, 3, 3]
    s2 = torch.exp(2.0 * params["scales"])  # [N, 3]
    cov = (R * s2.unsqueeze(1)) @ R.transpose(1, 2)  # [N, 3, 3] = R diag(s^2) R^T
    gate = torch.sigmoid(100.0 * ((1.0 - opac) - 0.995)).unsqueeze(-1)  # [N, 1]
    noise = torch.randn_like(params["means"]) * gate * scaler
    params["means"].add_(torch.einsum("nij,nj->ni", cov, noise))


class TorchMCMCStrategy(MCMCStrategy):
    """3DGS-MCMC: relocate dead Gaussians to live ones, grow 5% per refine up to ``cap_max``, add opacity-gated
    covariance-shaped noise to positions every step, and regularise opacities and scales (``opacity_reg``,
    ``scale_reg``: the weights of the paper's L1 terms, §4.3). gsplat's CUDA ops on a GPU, ours on the CPU."""

    def __init__(self, *, opacity_reg: float = 0.0, scale_reg: float = 0.0, **kwargs):
        super().__init__(**kwargs)
        self.opacity_reg = float(opacity_reg)
        self.scale_reg = float(scale_reg)
        self.last_event: dict | None = None

    def initialize_state(self, scene_scale: float = 1.0, device: torch.device | str = "cpu") -> dict[str, Any]:
        if torch.device(device).type == "cuda":  # gsplat's kernels take binomial coefficients
            n = 51
            binoms = torch.tensor([[math.comb(i, k) if k <= i else 0 for k in range(n)] for i in range(n)],
                                  dtype=torch.float32, device=device)  # [n, n]
            return {"binoms": binoms}
        return {"coef": relocation_coefficients(51, device=device)}

    def loss_terms(self, params, info) -> torch.Tensor | None:
        """3DGS-MCMC's opacity and scale L1 terms, averaged over the Gaussians this step RENDERS.

        The paper averages over all Gaussians; with Adam that is harmless only when a view shows most of them.
        On a window (``patch_max_pixels``) or a partial view, an unseen Gaussian's only gradient would be the
        regulariser's, which Adam rescales to a full-size step: its opacity would be driven to zero (and the
        Gaussian relocated) in a few hundred steps without the images ever asking for it (measured: validation
        PSNR fell 0.6 dB over the last phase, docs/experiments.md). The mean over the rendered ones keeps the
        paper's balance between the two losses, since the photometric term is a mean over the rendered pixels.
        A render that reaches no Gaussian gets a zero term.
        """
        if self.opacity_reg == 0.0 and self.scale_reg == 0.0:
            return None
        vis = rendered(info).to(params["means"].dtype)  # [N] 1 where rendered; weights, not a boolean index,
        n = vis.sum().clamp_min(1.0)  # so that no step waits for the GPU to count them
        opac = (torch.sigmoid(params["opacities"].flatten()) * vis).sum() / n
        scale = (torch.exp(params["scales"]).mean(-1) * vis).sum() / n
        return self.opacity_reg * opac + self.scale_reg * scale

    def step_pre_backward(self, params, optimizers, state, step, info) -> None:
        return None  # reads no gradients of the render

    def step_post_backward(self, params, optimizers, state, step, info, *, lr: float = 0.0):
        self.last_event = None
        if "binoms" in state and params["means"].is_cuda:  # gsplat's CUDA relocation, sample-add and noise kernels
            ops, table = (gsplat_ops.relocate, gsplat_ops.sample_add, gsplat_ops.inject_noise_to_position), \
                state["binoms"]
        else:  # the same steps in torch
            ops, table = (relocate, sample_add, inject_noise_to_position), state["coef"]
        relocate_fn, sample_add_fn, noise_fn = ops
        if self.refine_start_iter < step < self.refine_stop_iter and step % self.refine_every == 0:
            n_before = params["means"].shape[0]
            dead = torch.sigmoid(params["opacities"].flatten()) <= self.min_opacity  # [N]
            n_reloc = int(dead.sum())
            if 0 < n_reloc < n_before:  # else nothing to move, or nothing alive to move onto
                relocate_fn(params, optimizers, {}, dead, table, self.min_opacity)
            else:
                n_reloc = 0
            n_add = max(0, min(self.cap_max, int(1.05 * n_before)) - n_before)
            if n_add > 0:
                sample_add_fn(params, optimizers, {}, n_add, table, self.min_opacity)
            self.last_event = {"step": step, "relocated": n_reloc, "added": n_add, "clones": 0, "splits": 0,
                               "prunes": 0, "before": n_before, "gaussians": params["means"].shape[0]}
        if lr * self.noise_lr > 0:
            noise_fn(params, optimizers, {}, lr * self.noise_lr)


def make_strategy(dcfg, *, max_steps: int, initial_count: int) -> Strategy | None:
    """The strategy named by ``train.densify.strategy`` (or None for "none"), with its cap.

    cap = min(max_gaussians, budget_multiplier x initial count) (Taming 3DGS's budget).
    """
    cap = int(min(dcfg.max_gaussians, math.floor(dcfg.budget_multiplier * initial_count)))
    start = int(dcfg.refine_start_fraction * max_steps + 1e-9)  # a plan's step / max_steps gives the step back
    stop = int(dcfg.refine_stop_fraction * max_steps)
    if dcfg.strategy == "default":
        return BudgetedDefaultStrategy(
            cap=cap, initial_count=initial_count, ramp_end_iter=int(dcfg.budget_ramp_fraction * max_steps),
            prune_opa=dcfg.prune_opa, grow_grad2d=dcfg.grow_grad2d, grow_scale3d=dcfg.grow_scale3d,
            prune_scale3d=dcfg.prune_scale3d, refine_start_iter=start, refine_stop_iter=stop,
            refine_every=dcfg.refine_every, reset_every=dcfg.reset_every if dcfg.reset_every > 0 else 0,
            absgrad=dcfg.absgrad)
    if dcfg.strategy == "mcmc":
        return TorchMCMCStrategy(cap_max=cap, noise_lr=dcfg.mcmc_noise_lr, refine_start_iter=start,
                                 refine_stop_iter=stop, refine_every=dcfg.refine_every,
                                 min_opacity=dcfg.mcmc_min_opacity, opacity_reg=dcfg.mcmc_opacity_reg,
                                 scale_reg=dcfg.mcmc_scale_reg)
    return None
