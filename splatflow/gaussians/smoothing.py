"""Mip-Splatting's 3D smoothing filter (Yu et al., "Mip-Splatting: Alias-free 3D Gaussian Splatting", CVPR 2024,
§4): a 3D low-pass per Gaussian, sized by the highest sampling rate any training camera has for it.

Why: a Gaussian optimised only against the training images can shrink far below what those images resolve; zoomed
in, such Gaussians show as high-frequency artefacts, and zoomed out they erode. The filter convolves each Gaussian
with an isotropic Gaussian of standard deviation ``f = sqrt(VARIANCE_SCALE) * d / focal`` (world units), where
``focal / d`` is the highest sampling rate (pixels per world unit) among the training cameras whose frustum holds
the Gaussian's centre (``d``: its depth there). The convolution of two Gaussians is a Gaussian of covariance
``S^2 + f^2 I``; to keep its integral, the opacity is scaled by ``sqrt(det(S^2) / det(S^2 + f^2 I))``. With the
covariance ``R S^2 R^T`` and an isotropic filter both are per-axis: the effective scales are ``sqrt(s^2 + f^2)``
and the factor is ``prod(s) / prod(sqrt(s^2 + f^2))``.

The filter is a fixed attribute of each Gaussian, not a parameter: training recomputes it from the training cameras
at the start and after every densification event (:class:`splatflow.train.policies.Smoothing3D`); everything that
renders a model applies it through :func:`smoothed` (``Splats.activated``), and the files other viewers read get the
effective values baked in (:func:`baked`), so every viewer renders what was trained.

Deviations from the reference code (``compute_3D_filter``): it takes the smallest depth over the cameras and the
largest focal length over all cameras, which is the highest rate only when every camera has the same focal length;
here each camera's own ``max(fx, fy) / depth`` is compared. The frustum test is the reference's: the centre in front
of the near plane and within the image widened by :data:`FRUSTUM_MARGIN` of its size on each side (using the
principal point of ``K``, where the reference assumes the image centre); the near plane is the rasterizer's.
"""

from __future__ import annotations

import math

import torch

VARIANCE_SCALE = 0.2  # the filter's variance in squared pixels at the highest sampling rate (the paper's constant)
FRUSTUM_MARGIN = 0.15  # a centre this share of the image size outside it still counts as seen (reference code)
NEAR_PLANE = 0.01  # world units: what splatflow.render.rasterize draws by default
CHUNK_ELEMENTS = 1 << 24  # cameras x Gaussians per chunk: bounds the temporary memory (~6 such tensors)


@torch.no_grad()
def filter_3d(means: torch.Tensor, viewmats: torch.Tensor, Ks: torch.Tensor, widths, heights, *,
              chunk_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """The filter's standard deviation ``[N]`` (world units) of Gaussians at ``means [N, 3]`` for the cameras
    ``viewmats [C, 4, 4]`` (world to camera), ``Ks [C, 3, 3]`` of images ``widths`` x ``heights`` (``C`` each).

    ``sqrt(VARIANCE_SCALE) * d / focal`` at the camera of highest rate ``max(fx, fy) / d`` among those whose frustum
    holds the centre; a Gaussian no camera sees takes the largest filter of the others (the reference code), and
    every one is 0 when no camera sees any. Vectorised over chunks of cameras (``chunk_elements`` bounds cameras x
    Gaussians per chunk); on the means' device and dtype, without reading anything back to the host.
    """
    dev, dt = means.device, means.dtype
    n = means.shape[0]
    viewmats = viewmats.to(dev, dt)
    Ks = Ks.to(dev, dt)
    w = torch.as_tensor(widths, device=dev, dtype=dt).reshape(-1)  # [C]
    h = torch.as_tensor(heights, device=dev, dtype=dt).reshape(-1)  # [C]
    c_total = viewmats.shape[0]
    if not (Ks.shape[0] == w.shape[0] == h.shape[0] == c_total):
        raise ValueError(f"filter_3d: {c_total} view matrices, {Ks.shape[0]} intrinsics, {w.shape[0]} widths and "
                         f"{h.shape[0]} heights; one of each per camera")
    rate = torch.zeros(n, device=dev, dtype=dt)  # [N] highest focal / depth seen so far, 0 = no camera
    step = max(1, chunk_elements // max(n, 1))
    for c0 in range(0, c_total, step):
        vm, K = viewmats[c0:c0 + step], Ks[c0:c0 + step]  # [c, 4, 4], [c, 3, 3]
        cam = torch.einsum("cij,nj->cni", vm[:, :3, :3], means) + vm[:, None, :3, 3]  # [c, N, 3]
        z = cam[..., 2]  # [c, N]
        zs = z.clamp_min(NEAR_PLANE)
        fx, fy, cx, cy = K[:, 0, 0, None], K[:, 1, 1, None], K[:, 0, 2, None], K[:, 1, 2, None]  # [c, 1]
        u = cam[..., 0] / zs * fx + cx  # [c, N] pixels
        v = cam[..., 1] / zs * fy + cy
        cw, ch = w[c0:c0 + step, None], h[c0:c0 + step, None]  # [c, 1]
        seen = (z > NEAR_PLANE) & (u >= -FRUSTUM_MARGIN * cw) & (u <= (1.0 + FRUSTUM_MARGIN) * cw) \
            & (v >= -FRUSTUM_MARGIN * ch) & (v <= (1.0 + FRUSTUM_MARGIN) * ch)  # [c, N]
        r = torch.where(seen, torch.maximum(fx, fy) / zs, torch.zeros((), device=dev, dtype=dt))  # [c, N]
        rate = torch.maximum(rate, r.amax(dim=0))
    seen_any = rate > 0  # [N]
    f = math.sqrt(VARIANCE_SCALE) / torch.where(seen_any, rate, torch.ones((), device=dev, dtype=dt))  # [N]
    f = torch.where(seen_any, f, torch.zeros((), device=dev, dtype=dt))
    largest = f.amax() if n else torch.zeros((), device=dev, dtype=dt)  # 0 when no camera sees any
    return torch.where(seen_any, f, largest).contiguous()


def smoothed(scales: torch.Tensor, opacities: torch.Tensor, filt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The filtered Gaussians as the rasterizer takes them: ``(sqrt(s^2 + f^2) [N, 3], o * prod(s) /
    prod(sqrt(s^2 + f^2)) [N])`` from real scales ``s [N, 3]``, opacities ``o [N]`` in [0, 1] and the filter
    ``f [N]``. Differentiable in ``s`` and ``o``."""
    f2 = (filt * filt)[:, None]  # [N, 1]
    var = scales * scales + f2  # [N, 3]
    eff = torch.sqrt(var)
    ratio = torch.sqrt((scales * scales / var).prod(dim=1))  # [N] = prod(s) / prod(sqrt(s^2 + f^2))
    return eff, opacities * ratio


@torch.no_grad()
def baked(log_scales: torch.Tensor, logit_opacities: torch.Tensor,
          filt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The filter baked into raw parameters: ``(log scales [N, 3], logit opacities [N])`` of the effective
    Gaussians of :func:`smoothed`, in the input dtype, computed in float64 in forms that stay exact where a
    direct ``log(sqrt(exp(2 s) + f^2))`` or ``logit(sigmoid(o) * ratio)`` would round to 0 or overflow:
    ``s + log1p(f^2 e^{-2s}) / 2`` and ``log p - log(1 - p)`` with ``1 - p = sigmoid(-o) + sigmoid(o) (1 - r)``."""
    s = log_scales.double()
    o = logit_opacities.double()
    f2 = (filt.double() ** 2)[:, None]  # [N, 1]
    grow = 0.5 * torch.log1p(f2 * torch.exp(-2.0 * s))  # [N, 3] log(sqrt(s^2 + f^2) / s) per axis
    log_r = -grow.sum(dim=1)  # [N] log of the opacity factor
    log_p = torch.nn.functional.logsigmoid(o) + log_r
    log_1mp = torch.log(torch.sigmoid(-o) + torch.sigmoid(o) * -torch.expm1(log_r))
    return (s + grow).to(log_scales.dtype), (log_p - log_1mp).to(logit_opacities.dtype)
