"""Fast differentiable SSIM for CPU training (Wang et al., "Image Quality Assessment: From Error Visibility to
Structural Similarity", IEEE TIP 2004), with the window and padding of the 3DGS reference code.

Why a custom autograd Function: on CPU a naive SSIM (five 11x11 depthwise convolutions, then autograd through
~20 element-wise ops) costs about as much as rendering the image (docs/design.md §4). Here

* the 11x11 Gaussian window (sigma 1.5) is applied as two 1-D passes (11+11 taps instead of 121), exact because
  the window is an outer product and zero "same" padding commutes with the separation;
* the five local moments (E[x], E[y], E[x^2], E[y^2], E[xy]) go through one grouped convolution;
* the backward is analytic: with S = A1 A2 / (B1 B2) per pixel, the derivatives of mean(S) w.r.t. the three
  moment maps that involve x are formed point-wise, blurred once more (the zero-padded symmetric Gaussian filter
  is its own adjoint), and combined as ``dL/dx = G*dmu_x + 2 x G*dE[x^2] + y G*dE[xy]``.

Two implementations of that one scheme: for CPU tensors the numba kernels of :mod:`.filters` (value and gradient
in one parallel pass over row chunks, the five moments fused, intermediates kept in cache; their speed does not
hang on torch's CPU convolution, which varies widely with the build and the processor), and for every other
device the torch code below (grouped ``conv2d``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

# the module, not its functions: the CPU kernels are looked up at the call (tests replace them to prove a path)
from splatflow.render import filters
from splatflow.render import ssim_triton
from splatflow.render.blur import gaussian_blur_pair
from splatflow.render.ssim_window import C1, C2, SIGMA, WINDOW, gaussian_window_1d  # noqa: F401 (re-exported)



def _blur(x: Tensor) -> Tensor:
    """Separable Gaussian filter with zero 'same' padding on [B, Ch, H, W]."""
    ch = x.shape[1]
    g = gaussian_window_1d(dtype=x.dtype, device=x.device)
    pad = WINDOW // 2
    x = F.conv2d(x, g.view(1, 1, 1, WINDOW).expand(ch, 1, 1, WINDOW), padding=(0, pad), groups=ch)
    return F.conv2d(x, g.view(1, 1, WINDOW, 1).expand(ch, 1, WINDOW, 1), padding=(pad, 0), groups=ch)


def _moments(x: Tensor, y: Tensor) -> tuple[Tensor, ...]:
    c = x.shape[1]
    m = _blur(torch.cat([x, y, x * x, y * y, x * y], dim=1))  # [B, 5C, H, W]
    return tuple(m.split(c, dim=1))  # mu_x, mu_y, E[x^2], E[y^2], E[xy]


class _SSIM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, y: Tensor) -> Tensor:
        mx, my, exx, eyy, exy = _moments(x, y)
        A1 = 2.0 * mx * my + C1
        A2 = 2.0 * (exy - mx * my) + C2
        B1 = mx * mx + my * my + C1
        B2 = (exx - mx * mx) + (eyy - my * my) + C2
        D = B1 * B2
        S = A1 * A2 / D  # [B, C, H, W]
        ctx.save_for_backward(x, y, mx, my, A1, A2, B1, B2, S)
        return S.mean()

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, y, mx, my, A1, A2, B1, B2, S = ctx.saved_tensors
        scale = grad / S.numel()
        inv_D = scale / (B1 * B2)
        d_exy = 2.0 * A1 * inv_D  # dL/dE[xy]
        s_b2 = scale * S / B2
        s_b1 = scale * S / B1
        gx = gy = None
        if ctx.needs_input_grad[0]:
            d_mx = 2.0 * my * (A2 - A1) * inv_D + 2.0 * mx * (s_b2 - s_b1)  # dL/dmu_x
            d_exx = -s_b2  # dL/dE[x^2]
            b = _blur(torch.cat([d_mx, d_exx, d_exy], dim=1)).chunk(3, dim=1)
            gx = b[0] + 2.0 * x * b[1] + y * b[2]
        if ctx.needs_input_grad[1]:
            d_my = 2.0 * mx * (A2 - A1) * inv_D + 2.0 * my * (s_b2 - s_b1)
            d_eyy = -s_b2
            b = _blur(torch.cat([d_my, d_eyy, d_exy], dim=1)).chunk(3, dim=1)
            gy = b[0] + 2.0 * y * b[1] + x * b[2]
        return gx, gy


def ssim(x: Tensor, y: Tensor) -> Tensor:
    """Mean SSIM of two image batches [B, 3, H, W] in [0, 1] (11x11 Gaussian window, sigma 1.5, C1 = 0.01^2,
    C2 = 0.03^2, zero 'same' padding, as the 3DGS reference). Differentiable in both arguments."""
    if x.shape != y.shape or x.dim() != 4:
        raise ValueError(f"ssim needs two [B, C, H, W] tensors of one shape, got {tuple(x.shape)} and {tuple(y.shape)}")
    if y.dtype != x.dtype:
        y = y.to(x.dtype)
    if x.device.type == "cpu" and y.device.type == "cpu":
        return filters.ssim_cpu(x, y)  # (the kernels read any layout)
    return _SSIM.apply(x.contiguous(), y.contiguous())


BLUR_MIN_SIGMA = 0.05  # px: below this the training blur is the identity (as render.blur.gaussian_blur)


def l1_ssim(x: Tensor, y: Tensor, blur_sigma: float = 0.0) -> tuple[Tensor, Tensor]:
    """``(mean |x - y|, mean SSIM)`` of two ``[B, C, H, W]`` batches, both differentiable: the two terms of the
    training loss. With ``blur_sigma`` (px) both images are first blurred by the training blur (see
    :func:`splatflow.render.blur.gaussian_blur`). On CPU tensors the kernels compute blur, both terms and
    their gradients in two passes forward and one backward; on a GPU with Triton the kernels of
    :mod:`.ssim_triton` (the target without a gradient); elsewhere torch ops."""
    if x.shape != y.shape or x.dim() != 4:
        raise ValueError(f"l1_ssim needs two [B, C, H, W] tensors of one shape, got {tuple(x.shape)} and "
                         f"{tuple(y.shape)}")
    if y.dtype != x.dtype:
        y = y.to(x.dtype)
    blur = blur_sigma >= BLUR_MIN_SIGMA
    if x.device.type == "cpu" and y.device.type == "cpu":
        # the kernels read the images where they lie (the training step's [H, W, 3] render and target seen as
        # [1, 3, H, W]) and hand the gradient back in the render's layout: no copy either way
        s, l1 = (filters.blurred_l1_ssim_cpu(x, y, blur_sigma) if blur else filters.ssim_l1_cpu(x, y))
        return l1, s
    if blur:  # the torch blur for other devices lives with the schedule that drives it
        x, y = gaussian_blur_pair(x, y, blur_sigma)
    if ssim_triton.available(x.device) and x.dtype == torch.float32 and not y.requires_grad:
        return ssim_triton.fused_l1_ssim(x, y)  # a GPU with Triton: six launches instead of some forty
    return (x - y).abs().mean(), _SSIM.apply(x.contiguous(), y.contiguous())


def ssim_torch(x: Tensor, y: Tensor) -> Tensor:
    """:func:`ssim` on the torch implementation whatever the device (the path of non-CPU tensors; on CPU for
    cross-checks and benchmarks)."""
    if y.dtype != x.dtype:
        y = y.to(x.dtype)
    return _SSIM.apply(x.contiguous(), y.contiguous())


def ssim_map_reference(x: Tensor, y: Tensor) -> Tensor:
    """Direct (non-separable, autograd) SSIM map, kept for documentation and cross-checks."""
    ch = x.shape[1]
    g = gaussian_window_1d(dtype=x.dtype, device=x.device)
    w = (g[:, None] * g[None, :]).expand(ch, 1, WINDOW, WINDOW)
    conv = lambda t: F.conv2d(t, w, padding=WINDOW // 2, groups=ch)  # noqa: E731
    mx, my = conv(x), conv(y)
    vx = conv(x * x) - mx * mx
    vy = conv(y * y) - my * my
    cxy = conv(x * y) - mx * my
    return ((2 * mx * my + C1) * (2 * cxy + C2)) / ((mx * mx + my * my + C1) * (vx + vy + C2))


__all__ = ["ssim", "l1_ssim", "ssim_torch", "gaussian_window_1d", "ssim_map_reference", "WINDOW", "SIGMA", "C1", "C2"]
