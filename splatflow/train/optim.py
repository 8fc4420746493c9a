"""The optimizer of a training run: one Adam per parameter group, stepped plainly or on the visible Gaussians only.

One Adam per group is gsplat's convention: its strategies rewrite each optimizer's state rows when Gaussians are
added or removed. ``eps`` is the 3DGS reference's 1e-15, since the gradients of single Gaussians are tiny.
"""

from __future__ import annotations

import torch

from splatflow.train import multi_adam


def adam(param: torch.nn.Parameter, lr: float) -> torch.optim.Adam:
    """Adam with the 3DGS reference's eps; torch's fused kernel (same update, ~4x faster on CPU for six small
    groups than the foreach path: measured 4.6 vs 17.8 ms per step at 10K Gaussians)."""
    return torch.optim.Adam([param], lr=lr, eps=1e-15, fused=True)


def make_optimizers(params: dict[str, torch.nn.Parameter], lrs: dict[str, float]) -> dict[str, torch.optim.Adam]:
    """One :func:`adam` per parameter group, at the group's learning rate."""
    return {k: adam(p, lrs[k]) for k, p in params.items()}


def step(optimizers: dict[str, torch.optim.Adam]) -> None:
    """Plain Adam on every group, then drop the gradients. On a GPU with Triton all groups are stepped in one
    launch (:mod:`.multi_adam`: same update, same state); elsewhere, the CPU always, torch's fused Adam per group."""
    if multi_adam.steppable(optimizers):
        multi_adam.step(optimizers)
        return
    for opt in optimizers.values():
        opt.step()
        opt.zero_grad(set_to_none=True)


def visible_step(params: dict[str, torch.nn.Parameter], optimizers: dict[str, torch.optim.Adam],
                 unseen: torch.Tensor) -> None:
    """Adam on the Gaussians this step's render reached; the ``unseen`` ones (``[N]`` bool) keep their parameters
    AND moments.

    Plain Adam keeps moving a Gaussian that the current view (or training window) does not see, on the momentum of
    earlier steps, and decays its moments towards a zero gradient it never had; with windows of a fraction of the
    view most Gaussians are unseen in most steps. This is gsplat's ``visible_adam`` (its SelectiveAdam), done
    around torch's fused Adam: the unseen rows are restored after the step.
    """
    idx = unseen.nonzero().squeeze(1) if bool(unseen.any()) else None
    for k, opt in optimizers.items():
        p = params[k]
        saved = None
        if idx is not None:
            st = opt.state.get(p, {})
            saved = [p.data.index_select(0, idx)] + \
                    [st[n].index_select(0, idx) for n in ("exp_avg", "exp_avg_sq") if n in st]
        opt.step()
        opt.zero_grad(set_to_none=True)
        if saved is not None:
            st = opt.state[p]
            p.data.index_copy_(0, idx, saved[0])
            if len(saved) == 3:
                st["exp_avg"].index_copy_(0, idx, saved[1])
                st["exp_avg_sq"].index_copy_(0, idx, saved[2])
