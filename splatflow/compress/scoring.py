"""Scores that rank Gaussians for pruning: LightGaussian's global significance and the exact removal cost.

Both the prune stage (:mod:`splatflow.compress.prune`) and pruning during training (:mod:`splatflow.train.prune_during`)
rank with these, so they live below both: this module imports neither training nor the prune stage.

Global significance (paper §3.2): ``GS_j = sum_i 1(G(X_j), r_i) * sigma_j * gamma(Sigma_j)`` over all rays
``r_i`` of all training views (``M * H * W`` pixels). The indicator times opacity is, in the rasterizer, the
compositing weight of Gaussian ``j`` at pixel ``i``; like the authors' released rasterizer we use the full weight
``alpha_ij * T_ij`` (alpha times the transmittance in front of it), so a Gaussian hidden behind an opaque surface
scores ~0 even where it overlaps the pixel. Our rasterizer returns exactly this per-view sum as
``info["weight_sum"] [C, N]`` (``return_stats=True``; docs/CONTRACTS.md "Rendering").

Volume term (same section): ``gamma(Sigma_j) = V_norm ** beta``, ``V_norm = min(max(V_j / V_max90, 0), 1)`` with
``V_j`` the Gaussian's volume (product of its three scales; the 4/3 pi factor cancels in the ratio), ``V_max90``
the volume 90% of the Gaussians exceed, and ``beta = 0.1``. It keeps a large but faint background Gaussian from
losing against a tiny one that happens to be sharp; with the clamp it only down-weights the smallest Gaussians.
Deviation: the authors' code divides by ``V_max90`` without the clamp; we follow the paper's equation.
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from splatflow.pipeline.config import PruneConfig
from splatflow.pipeline.errors import UserError
from splatflow.evaluation.metrics import psnr
from splatflow.gaussians.model import Splats, render_view
from splatflow.render import rasterize, removal_loss, resolve_backend
from splatflow.scene.cameras import level_size, scale_intrinsics

SCORES = typing.get_args(typing.get_type_hints(PruneConfig)["score"])
"""The rankings ``prune.score`` names (the choices :class:`splatflow.pipeline.config.PruneConfig` allows)."""


# --------------------------------------------------------------------------------------------- cameras


@dataclass(frozen=True)
class Camera:
    """One view as the rasterizer wants it: world-to-camera ``[4, 4]``, intrinsics ``[3, 3]``, size in px."""

    world_to_cam: np.ndarray
    K: np.ndarray
    width: int
    height: int


def cameras_at(views: Sequence, factor: float) -> list[Camera]:
    """Cameras of ``views`` (``splatflow.scene.dataset.View``) at resolution ``factor`` (intrinsics rescaled)."""
    cams = []
    for v in views:
        w, h = level_size(v.width, v.height, factor)
        cams.append(Camera(np.asarray(v.world_to_cam, dtype=np.float64), scale_intrinsics(v.K, v.width, v.height,
                                                                                            w, h), w, h))
    return cams


# --------------------------------------------------------------------------------------------- scoring


def volume_weight(log_scales: torch.Tensor, beta: float = PruneConfig.volume_beta,
                  ref_quantile: float = PruneConfig.volume_ref_quantile) -> torch.Tensor:
    """LightGaussian's ``gamma(Sigma) = clamp(V / V_ref, 0, 1) ** beta`` per Gaussian, ``[N]``.

    ``V = prod(scales)`` (computed in log space, so tiny Gaussians do not underflow); ``V_ref`` is the volume at
    quantile ``ref_quantile`` of the ascending order, i.e. the one a fraction ``1 - ref_quantile`` of the
    Gaussians exceed (paper: "the 90% largest", ``ref_quantile = 0.1``). ``beta = 0`` disables the term.
    """
    n = log_scales.shape[0]
    if n == 0 or beta == 0.0:
        return torch.ones(n, dtype=torch.float64, device=log_scales.device)
    log_v = log_scales.double().sum(dim=-1)  # [N] log volume (up to the constant 4/3 pi)
    idx = min(n - 1, max(0, int(math.floor(ref_quantile * n))))
    log_ref = torch.sort(log_v).values[idx]
    return torch.exp(beta * torch.clamp(log_v - log_ref, max=0.0))  # clamp(V / V_ref, 0, 1) ** beta


def _backend_device(backend: str) -> tuple[str, torch.device]:
    """The concrete backend ("auto" resolved, CUDA availability checked) and the device its inputs live on."""
    name = resolve_backend(backend)
    return name, torch.device("cuda" if name == "cuda" else "cpu")


@torch.no_grad()
def view_weight_sums(splats: Splats, cameras: Sequence[Camera], *, backend: str = "auto",
                     progress: bool = False, desc: str = "significance") -> torch.Tensor:
    """``sum over views of info["weight_sum"]``: each Gaussian's summed ``alpha * T`` over all pixels, ``[N]``.

    One view per rasterizer call, so memory stays that of one image whatever the number of views. Colours do
    not change the weights, so the renders use constant RGB (no SH evaluation).
    """
    backend, dev = _backend_device(backend)
    a = Splats.of(splats).to(dev).activated()
    n = a.means.shape[0]
    total = torch.zeros(n, dtype=torch.float64, device="cpu")  # scores live on the host
    if n == 0:
        return total
    rgb = torch.zeros(n, 3, device=dev)  # [N, 3]: weights do not depend on colour
    for cam in tqdm(cameras, desc=desc, disable=not progress, leave=False):
        viewmat = torch.as_tensor(cam.world_to_cam, dtype=torch.float32, device=dev)[None]  # [1, 4, 4]
        K = torch.as_tensor(cam.K, dtype=torch.float32, device=dev)[None]  # [1, 3, 3]
        _, _, info = rasterize(a.means, a.quats, a.scales, a.opacities, rgb, viewmat, K,
                               cam.width, cam.height, backend=backend, return_stats=True)
        if "weight_sum" not in info:
            # gsplat's CUDA rasterizer has no per-Gaussian weight output; our wrapper must provide it.
            raise UserError(f"the {backend!r} rasterizer backend returned no per-Gaussian weight sums, which "
                            "significance pruning needs; set prune.backend: cpu in params.yaml")
        total += info["weight_sum"][0].double().cpu()  # [N]
    return total


def significance(splats: Splats, cameras: Sequence[Camera], *, beta: float = PruneConfig.volume_beta,
                 ref_quantile: float = PruneConfig.volume_ref_quantile, backend: str = "auto",
                 progress: bool = False) -> torch.Tensor:
    """LightGaussian global significance ``GS_j`` of every Gaussian over ``cameras`` (training views), ``[N]``."""
    weights = view_weight_sums(splats, cameras, backend=backend, progress=progress)
    return weights * volume_weight(Splats.of(splats).scales, beta, ref_quantile)


@torch.no_grad()
def removal_scores(splats: Splats, sh_degree: int, cameras: Sequence[Camera],
                   targets: Sequence[torch.Tensor], *, progress: bool = False) -> torch.Tensor:
    """Each Gaussian's removal cost over ``cameras``: how much the summed squared error against ``targets``
    (training images ``[H, W, 3]``) would grow if it alone were removed, ``[N]`` (may be negative).

    Unlike the significance, which counts how much a Gaussian is SEEN, this counts what it is WORTH: a large
    Gaussian whose colour matches what lies behind or around it costs little to remove, a small one that draws
    an edge costs a lot. Exact per Gaussian (:func:`splatflow.render.removal_loss`); what removing many at once
    does is left to the re-scored rounds and the recovery fine-tune (:func:`splatflow.compress.prune.prune_phases`).
    ``targets`` is indexed view by view, so it may decode on demand (:class:`splatflow.compress.prune.CachedImages`).

    It needs, per pixel, every Gaussian's contribution and the colour composited behind it, which gsplat's CUDA
    backward sums into gradients: CPU splats are scored by our numba backward, splats on a GPU where they are by
    the same score in torch (:mod:`splatflow.render.score_torch`). Returns float64 on the splats' device.
    """
    # SH as stored, so no view copies the [N, K, 3] bands; scored on the splats' device (removal_loss dispatches)
    a = Splats.of(splats).activated(sh_degree, sh_pair=True)
    n = a.means.shape[0]
    total = torch.zeros(n, dtype=torch.float64, device=a.means.device)
    for i in tqdm(range(len(cameras)), desc="removal cost", disable=not progress, leave=False):
        cam, tgt = cameras[i], targets[i]
        viewmat = torch.as_tensor(cam.world_to_cam, dtype=torch.float32, device="cpu")[None]  # [1, 4, 4]
        K = torch.as_tensor(cam.K, dtype=torch.float32, device="cpu")[None]  # [1, 3, 3]
        _, inc = removal_loss(a.means, a.quats, a.scales, a.opacities, a.colors, viewmat, K, cam.width,
                              cam.height, sh_degree=sh_degree, target=tgt[None])
        total += inc[0].double()
    return total


def top_indices(scores: torch.Tensor, n_keep: int) -> torch.Tensor:
    """Indices of the ``n_keep`` highest scores, in ascending index order (ties: the lower index wins).

    A stable sort makes the kept set deterministic; ascending order keeps the survivors' storage order.
    """
    n_keep = max(0, min(int(n_keep), scores.shape[0]))
    order = torch.sort(-scores, stable=True).indices  # [N] best first
    return torch.sort(order[:n_keep]).values



# --------------------------------------------------------------------------------------------- validation


@torch.no_grad()
def mean_psnr(splats: Splats, sh_degree: int, cameras: Sequence[Camera],
              targets: Sequence[torch.Tensor], backend: str = "auto") -> float:
    """Mean per-view PSNR (dB) of renders (black background, as training) against ``targets`` ``[H, W, 3]``
    in [0, 1] (host tensors)."""
    backend, dev = _backend_device(backend)
    splats = Splats.of(splats).to(dev)  # once, not per view
    vals = [psnr(render_view(splats, cam, sh_degree, backend).cpu(), tgt) for cam, tgt in zip(cameras, targets)]
    return float(np.mean(vals)) if vals else float("nan")


def val_indices(n_train: int, n_val: int) -> list[int]:
    """``n_val`` evenly spaced indices into the training views (all of them when there are fewer)."""
    if n_train <= n_val:
        return list(range(n_train))
    return sorted({int(round(x)) for x in np.linspace(0, n_train - 1, n_val)})
