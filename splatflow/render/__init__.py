"""splatflow's rendering engine: one ``rasterize`` shaped like ``gsplat.rasterization``, three backends.

* ``"cpu"``: our numba tile rasterizer (:mod:`splatflow.render.cpu`) with an analytic backward. The default
  without a GPU.
* ``"cuda"``: ``gsplat.rasterization`` (unpacked). Asking for it without a GPU raises :class:`CudaUnavailableError`.
* ``"torch"``: a dense plain-PyTorch implementation of the same math (:mod:`splatflow.render.oracle`), slow, used as
  the oracle in tests.
* ``"auto"``: ``"cuda"`` when ``torch.cuda.is_available()``, else ``"cpu"``.

See docs/backends.md.
"""

from __future__ import annotations

import time
from typing import Any, Literal

import torch
from torch import Tensor

from splatflow.pipeline.errors import UserError

from ._numba_cache import install as _install_cache_locator

_install_cache_locator()  # before any kernel module is imported: numba picks a kernel's cache folder at decoration

from .constants import TILE  # noqa: E402
from .cpu import project_cpu, rasterize_cpu, removal_loss_cpu  # noqa: E402
from .oracle import rasterize_oracle  # noqa: E402
from .projection import gaussian_colors, project_gaussians, tile_grid  # noqa: E402
from .score_torch import removal_loss_torch  # noqa: E402
from .threads import configure_threads  # noqa: E402

__all__ = ["rasterize", "removal_loss", "resolve_backend", "configure_threads", "warmup", "CudaUnavailableError",
           "BACKENDS"]

BACKENDS = ("auto", "cpu", "cuda", "torch")


class CudaUnavailableError(UserError):
    """``backend="cuda"`` was requested on a machine where ``torch.cuda.is_available()`` is False (a user error:
    stages print it without a traceback)."""


def resolve_backend(backend: str) -> str:
    """Map ``"auto"`` to ``"cuda"`` or ``"cpu"`` and validate the name.

    The choice is made with ``torch.cuda.is_available()`` only: machines here have ``nvcc`` but no GPU, so
    whether gsplat's JIT compiles says nothing about whether it can run.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if backend == "cuda" and not torch.cuda.is_available():
        raise CudaUnavailableError(
            "backend='cuda' needs a CUDA GPU, but torch.cuda.is_available() is False on this machine "
            f"(torch {torch.__version__}). Use backend='cpu' (splatflow's numba rasterizer) or 'auto', which "
            "picks the CPU backend when no GPU is present."
        )
    return backend


def rasterize(
    means: Tensor,  # [N, 3]
    quats: Tensor,  # [N, 4]
    scales: Tensor,  # [N, 3]
    opacities: Tensor,  # [N]
    colors: Tensor | tuple[Tensor, Tensor],  # [N, K, 3] SH or its (sh0, shN) pair, or [N, D] / [C, N, D] plain
    viewmats: Tensor,  # [C, 4, 4]
    Ks: Tensor,  # [C, 3, 3]
    width: int,
    height: int,
    *,
    sh_degree: int | None = None,
    near_plane: float = 0.01,
    far_plane: float = 1e10,
    backgrounds: Tensor | None = None,  # [C, D]
    rasterize_mode: Literal["classic", "antialiased"] = "classic",
    render_mode: Literal["RGB", "RGB+ED"] = "RGB",
    backend: str = "auto",
    absgrad: bool = False,
    return_stats: bool = False,
    eps2d: float = 0.3,
    radius_clip: float = 0.0,
    window: tuple[int, int, int, int] | None = None,
) -> tuple[Tensor, Tensor, dict[str, Any]]:
    """Render C views of N Gaussians; differentiable w.r.t. means, quats, scales, opacities and colors.

    Inputs are activated (real scales, opacities in [0, 1], quaternions wxyz, not necessarily unit).
    Returns ``(render_colors [C, H, W, 3|4], render_alphas [C, H, W, 1], info)``. With ``render_mode="RGB+ED"``
    the 4th channel is the expected depth (accumulated depth / alpha). ``info`` carries what gsplat's strategies
    read (``means2d`` [C, N, 2] whose ``.grad`` / ``.absgrad`` are filled by backward, ``radii`` [C, N, 2],
    ``width``, ``height``, ``n_cameras``, ``gaussian_ids=None`` (unpacked), ...) and, with ``return_stats``,
    ``hit_count`` [C, N] (pixels each Gaussian contributed to) and ``weight_sum`` [C, N] (sum of alpha * T).

    ``window=(x0, y0, w, h)`` renders only that part of the ``width`` x ``height`` views: the output is
    [C, h, w, ...] and equals the window of the whole render (projection, culling and the EWA clamp use the whole
    view; only the compositing is restricted), at the cost of the window's pixels. ``info["radii"]`` is zero for
    Gaussians that do not reach the window. On the cuda backend the window is rendered as a camera of that size
    with a shifted principal point (gsplat has no windowed mode), which differs only in the EWA clamp of Gaussians
    centred far outside the window.

    SH colours may come as the pair ``(sh0 [N, 1, 3], shN [N, K-1, 3])`` the model stores (with ``sh_degree``):
    the CPU backend reads both where they are and returns their gradients as they are (a training step then
    neither joins nor splits ``[N, K, 3]`` arrays); the other backends join them.
    """
    name = resolve_backend(backend)
    if isinstance(colors, (tuple, list)):
        if sh_degree is None or len(colors) != 2:
            raise ValueError("colors as a pair means SH bands (sh0 [N, 1, 3], shN [N, K-1, 3]) and needs sh_degree")
        if name != "cpu" or means.dtype not in (torch.float32, torch.float64):
            colors = torch.cat(list(colors), dim=1)  # [N, K, 3]
    if rasterize_mode not in ("classic", "antialiased"):
        raise ValueError(f"rasterize_mode must be 'classic' or 'antialiased', got {rasterize_mode!r}")
    if render_mode not in ("RGB", "RGB+ED"):
        raise ValueError(f"render_mode must be 'RGB' or 'RGB+ED', got {render_mode!r}")
    N = means.shape[0]
    C = viewmats.shape[0]
    for nm, t, shape in (("means", means, (N, 3)), ("quats", quats, (N, 4)), ("scales", scales, (N, 3)),
                         ("opacities", opacities, (N,)), ("viewmats", viewmats, (C, 4, 4)), ("Ks", Ks, (C, 3, 3))):
        if tuple(t.shape) != shape:
            raise ValueError(f"{nm} must have shape {shape}, got {tuple(t.shape)}")
    if window is not None:
        x0, y0, ww, wh = (int(v) for v in window)
        if not (0 <= x0 and 0 <= y0 and ww >= 1 and wh >= 1 and x0 + ww <= width and y0 + wh <= height):
            raise ValueError(f"window {window} must lie inside the {width}x{height} view")
    if name == "cuda":
        cam_w, cam_h = width, height
        if window is not None:  # a camera of the window's size with a shifted principal point
            Ks = Ks.clone()
            Ks[:, 0, 2] -= x0
            Ks[:, 1, 2] -= y0
            cam_w, cam_h = ww, wh
        img, alpha, info = _rasterize_cuda(
            means, quats, scales, opacities, colors, viewmats, Ks, cam_w, cam_h, sh_degree=sh_degree,
            near_plane=near_plane, far_plane=far_plane, backgrounds=backgrounds, rasterize_mode=rasterize_mode,
            render_mode=render_mode, absgrad=absgrad, return_stats=return_stats, eps2d=eps2d, radius_clip=radius_clip)
        info["window"] = None
        if window is not None:
            info.update(width=width, height=height, window=(x0, y0, ww, wh))
        return img, alpha, info

    if name == "cpu" and means.dtype in (torch.float32, torch.float64):
        # fused numba projection + SH with an analytic backward (the torch version below is the oracle's)
        if sh_degree is not None:
            parts = colors if isinstance(colors, (tuple, list)) else (colors,)
            if any(c.dim() != 3 or c.shape[0] != N or c.shape[-1] != 3 for c in parts) or parts[0].shape[1] < 1:
                raise ValueError(f"SH colors must be [N, K, 3] or (sh0 [N, 1, 3], shN [N, K-1, 3]); got "
                                 f"{[tuple(c.shape) for c in parts]}")
            K = sum(c.shape[1] for c in parts)
            if len(parts) == 2 and parts[0].shape[1] != 1:
                raise ValueError(f"sh0 must be [N, 1, 3]; got {tuple(parts[0].shape)}")
            if not 0 <= sh_degree <= 3 or K < (sh_degree + 1) ** 2:
                raise ValueError(f"sh_degree {sh_degree} needs 0..3 and (sh_degree+1)^2 <= K = {K}")
        proj = project_cpu(means, quats, scales, opacities, colors if sh_degree is not None else None, viewmats,
                           Ks, width, height, near_plane=near_plane, far_plane=far_plane, eps2d=eps2d,
                           antialiased=rasterize_mode == "antialiased", radius_clip=radius_clip,
                           sh_degree=sh_degree, window=window)
        culled_to_window = True  # the numba projection culled what cannot reach the window itself
        if sh_degree is not None:
            rgb = proj["colors"]  # [C, N, 3]
        else:
            rgb = gaussian_colors(colors, None, means, viewmats, proj["valid"])  # [C, N, D]
    else:
        culled_to_window = False
        proj = project_gaussians(means, quats, scales, opacities, viewmats, Ks, width, height,
                                 near_plane=near_plane, far_plane=far_plane, eps2d=eps2d,
                                 antialiased=rasterize_mode == "antialiased", radius_clip=radius_clip)
        rgb = gaussian_colors(colors, sh_degree, means, viewmats, proj["valid"])  # [C, N, D]
    means2d = proj["means2d"]  # [C, N, 2]
    radii = proj["radii"]
    out_w, out_h = width, height
    if window is not None:
        # composite in window pixel coordinates; Gaussians that cannot reach the window count as not visible (the
        # torch projection knows only the whole view: the same test as the numba projection's, done here)
        means2d = means2d - means2d.new_tensor([x0, y0])
        if not culled_to_window:
            r = radii if radii.dim() == 3 else radii[..., None].expand(*radii.shape, 2)
            m = means2d.detach()
            reach = ((m[..., 0] + r[..., 0] > 0) & (m[..., 0] - r[..., 0] < ww)
                     & (m[..., 1] + r[..., 1] > 0) & (m[..., 1] - r[..., 1] < wh))
            radii = torch.where(reach[..., None] if radii.dim() == 3 else reach, radii, torch.zeros_like(radii))
        out_w, out_h = ww, wh
    feats = rgb
    bgs = backgrounds
    if render_mode == "RGB+ED":
        feats = torch.cat([rgb, proj["depths"][..., None]], dim=-1)  # [C, N, D+1]
        if bgs is not None:
            bgs = torch.cat([bgs, bgs.new_zeros(C, 1)], dim=-1)  # depth background is 0
    if bgs is not None and tuple(bgs.shape) != (C, feats.shape[-1]):
        raise ValueError(f"backgrounds must be [C, {feats.shape[-1] - (render_mode == 'RGB+ED')}], got {tuple(backgrounds.shape)}")

    if name == "cpu":
        img, alpha, hits, wsum = rasterize_cpu(
            means2d, proj["conics"], feats, proj["opacities"], radii, proj["depths"], out_w, out_h,
            backgrounds=bgs, absgrad=absgrad, return_stats=return_stats,
        )
    else:
        img, alpha, hits, wsum = rasterize_oracle(
            means2d, proj["conics"], feats, proj["opacities"], radii, proj["depths"], out_w, out_h,
            backgrounds=bgs, return_stats=return_stats,
        )
        if absgrad and means2d.requires_grad:
            # The oracle goes through autograd, which has no per-pixel |grad| sum; the training path uses "cpu".
            raise NotImplementedError("absgrad=True is supported by the 'cpu' and 'cuda' backends, not 'torch'")
    if render_mode == "RGB+ED":
        img = torch.cat([img[..., :-1], img[..., -1:] / alpha.clamp(min=1e-10)], dim=-1)

    tw, th = tile_grid(out_w, out_h, TILE)
    info: dict[str, Any] = {
        "backend": name,
        "batch_ids": None,
        "camera_ids": None,
        "gaussian_ids": None,
        "radii": radii,
        "means2d": means2d,
        "depths": proj["depths"],
        "conics": proj["conics"],
        "opacities": proj["opacities"],
        "width": width,
        "height": height,
        "tile_size": TILE,
        "tile_width": tw,
        "tile_height": th,
        "n_batches": 1,
        "n_cameras": C,
        "window": None if window is None else (x0, y0, out_w, out_h),
    }
    if return_stats:
        info["hit_count"] = hits
        info["weight_sum"] = wsum
    return img, alpha, info


@torch.no_grad()
def removal_loss(means: Tensor, quats: Tensor, scales: Tensor, opacities: Tensor, colors: Tensor, viewmats: Tensor,
                 Ks: Tensor, width: int, height: int, *, sh_degree: int, target: Tensor | None = None,
                 near_plane: float = 0.01, far_plane: float = 1e10, eps2d: float = 0.3,
                 backend: str = "auto") -> tuple[Tensor, Tensor]:
    """For every Gaussian, how much the squared error of C views would grow if it ALONE were removed.

    Inputs as :func:`rasterize` (SH colours ``[N, K, 3]`` or the pair ``(sh0, shN)``); ``target``
    ``[C, H, W, 3]`` (the render itself when None, giving the pure removal energy). Returns ``(render [C, H, W, 3], increase [C, N])`` in squared
    [0, 1] units summed over pixels and channels; see :func:`splatflow.render.cpu.removal_loss_cpu`. Exact for
    single removals (each pixel is affine in one Gaussian's alpha). ``backend``: ``"cpu"`` (the CPU kernels,
    inputs copied to the host), ``"torch"`` (:func:`.score_torch.removal_loss_torch`, the same score in torch on
    the inputs' device) or ``"auto"``: the CPU kernels for CPU tensors, torch for any other device (a GPU run's
    splats are scored where they are).
    """
    if backend not in ("auto", "cpu", "torch"):
        raise ValueError(f"removal_loss backend must be 'auto', 'cpu' or 'torch', got {backend!r}")
    if backend == "torch" or (backend == "auto" and means.device.type != "cpu"):
        return removal_loss_torch(means, quats, scales, opacities, colors, viewmats, Ks, width, height,
                                  sh_degree=sh_degree, target=target, near_plane=near_plane, far_plane=far_plane,
                                  eps2d=eps2d)
    dev = means.device
    a = [t.detach().cpu() for t in (means, quats, scales, opacities, viewmats, Ks)]
    sh = tuple(c.detach().cpu() for c in colors) if isinstance(colors, (tuple, list)) else colors.detach().cpu()
    proj = project_cpu(*a[:4], sh, a[4], a[5], width, height, near_plane=near_plane, far_plane=far_plane, eps2d=eps2d,
                       antialiased=False, radius_clip=0.0, sh_degree=sh_degree)
    img, inc = removal_loss_cpu(proj["means2d"], proj["conics"], proj["colors"], proj["opacities"], proj["radii"],
                                proj["depths"], int(width), int(height),
                                target=None if target is None else target.detach().cpu())
    return img.to(dev), inc.to(dev)


def warmup() -> float:
    """Load (or, first time, compile) every CPU-backend kernel on a tiny scene; return the seconds it took.

    The first call after a code change compiles the numba kernels (about a minute of CPU); later processes load
    them from numba's on-disk cache (``cache=True``) in about a second. ``bench/rasterize.py`` reports both.
    """
    t0 = time.perf_counter()
    for dtype in (torch.float32,):
        g = torch.Generator().manual_seed(0)
        N = 8
        means = (torch.randn(N, 3, generator=g, dtype=dtype, device="cpu") * 0.3).requires_grad_()
        quats = torch.randn(N, 4, generator=g, dtype=dtype, device="cpu").requires_grad_()
        scales = torch.full((N, 3), 0.1, dtype=dtype, device="cpu").requires_grad_()
        opac = torch.full((N,), 0.5, dtype=dtype, device="cpu").requires_grad_()
        sh = torch.randn(N, 16, 3, generator=g, dtype=dtype, device="cpu").mul(0.1).requires_grad_()
        view = torch.eye(4, dtype=dtype, device="cpu")[None].clone()
        view[0, 2, 3] = 3.0
        K = torch.tensor([[[40.0, 0, 16], [0, 40.0, 16], [0, 0, 1]]], dtype=dtype, device="cpu")
        img, alpha, info = rasterize(means, quats, scales, opac, sh, view, K, 32, 32, sh_degree=3,
                                     backend="cpu", render_mode="RGB+ED", return_stats=True, absgrad=True)
        (img.sum() + alpha.sum()).backward()
    return time.perf_counter() - t0


def _rasterize_cuda(means, quats, scales, opacities, colors, viewmats, Ks, width, height, *, sh_degree, near_plane,
                    far_plane, backgrounds, rasterize_mode, render_mode, absgrad, return_stats, eps2d, radius_clip):
    """gsplat's rasterization, unpacked so ``info`` has the same [C, N, ...] layout as the CPU backend."""
    from gsplat import rasterization

    img, alpha, info = rasterization(
        means, quats, scales, opacities, colors, viewmats, Ks, width, height,
        near_plane=near_plane, far_plane=far_plane, radius_clip=radius_clip, eps2d=eps2d, sh_degree=sh_degree,
        packed=False, backgrounds=backgrounds, render_mode=render_mode, absgrad=absgrad,
        rasterize_mode=rasterize_mode,
    )
    info["backend"] = "cuda"
    if return_stats:
        # gsplat has no such statistics: run our CPU compositing (forward only) on gsplat's own projection.
        with torch.no_grad():
            dev = means.device
            _, _, hits, wsum = rasterize_cpu(
                info["means2d"].detach().cpu(), info["conics"].detach().cpu(),
                torch.zeros(viewmats.shape[0], means.shape[0], 1, dtype=means.dtype, device="cpu"),
                info["opacities"].detach().cpu(), info["radii"].cpu(), info["depths"].detach().cpu(),
                width, height, return_stats=True,
            )
        info["hit_count"] = hits.to(dev)
        info["weight_sum"] = wsum.to(dev)
    return img, alpha, info
