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
from dataclasses import dataclass
from typing import Any, Callable, Literal

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
    if isinstance(colors, (tuple, list)) and (sh_degree is None or len(colors) != 2):
        raise ValueError("colors as a pair means SH bands (sh0 [N, 1, 3], shN [N, K-1, 3]) and needs sh_degree")
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
        window = (x0, y0, ww, wh)
    request = _Request(means, quats, scales, opacities, colors, viewmats, Ks, width, height, sh_degree=sh_degree,
                       near_plane=near_plane, far_plane=far_plane, backgrounds=backgrounds,
                       rasterize_mode=rasterize_mode, render_mode=render_mode, absgrad=absgrad,
                       return_stats=return_stats, eps2d=eps2d, radius_clip=radius_clip, window=window)
    return _RENDERERS[name](request)


@dataclass(frozen=True, slots=True)
class _Request:
    """One :func:`rasterize` call's inputs, checked: what every backend reads."""

    means: Tensor  # [N, 3]
    quats: Tensor  # [N, 4]
    scales: Tensor  # [N, 3]
    opacities: Tensor  # [N]
    colors: Tensor | tuple[Tensor, Tensor]  # [N, K, 3] SH or its (sh0, shN) pair, or [N, D] / [C, N, D] plain
    viewmats: Tensor  # [C, 4, 4]
    Ks: Tensor  # [C, 3, 3]
    width: int
    height: int
    sh_degree: int | None
    near_plane: float
    far_plane: float
    backgrounds: Tensor | None  # [C, D]
    rasterize_mode: str
    render_mode: str
    absgrad: bool
    return_stats: bool
    eps2d: float
    radius_clip: float
    window: tuple[int, int, int, int] | None

    @property
    def antialiased(self) -> bool:
        return self.rasterize_mode == "antialiased"

    def joined_colors(self) -> Tensor:
        """The colours as one tensor: SH bands as a pair joined into ``[N, K, 3]`` (for the backends that read no
        pair)."""
        return torch.cat(list(self.colors), dim=1) if isinstance(self.colors, (tuple, list)) else self.colors


Rendered = tuple[Tensor, Tensor, dict[str, Any]]


def _render_cpu(r: _Request) -> Rendered:
    """Our tile rasterizer: the fused numba projection (float32/float64; the torch one otherwise) and the numba
    compositing with its analytic backward."""
    if r.means.dtype in (torch.float32, torch.float64):
        return _composite("cpu", r, *_project_numba(r), culled_to_window=True, compositor=_composite_cpu)
    return _composite("cpu", r, *_project_torch(r), culled_to_window=False, compositor=_composite_cpu)


def _render_torch(r: _Request) -> Rendered:
    """The oracle: the torch projection and dense compositing, differentiated by autograd."""
    return _composite("torch", r, *_project_torch(r), culled_to_window=False, compositor=_composite_oracle)


def _render_gsplat(r: _Request) -> Rendered:
    """gsplat's CUDA rasterization; a window is rendered as a camera of the window's size with a shifted principal
    point."""
    Ks, cam_w, cam_h = r.Ks, r.width, r.height
    if r.window is not None:
        x0, y0, ww, wh = r.window
        Ks = Ks.clone()
        Ks[:, 0, 2] -= x0
        Ks[:, 1, 2] -= y0
        cam_w, cam_h = ww, wh
    img, alpha, info = _rasterize_cuda(
        r.means, r.quats, r.scales, r.opacities, r.joined_colors(), r.viewmats, Ks, cam_w, cam_h,
        sh_degree=r.sh_degree, near_plane=r.near_plane, far_plane=r.far_plane, backgrounds=r.backgrounds,
        rasterize_mode=r.rasterize_mode, render_mode=r.render_mode, absgrad=r.absgrad, return_stats=r.return_stats,
        eps2d=r.eps2d, radius_clip=r.radius_clip)
    info["window"] = None
    if r.window is not None:
        info.update(width=r.width, height=r.height, window=r.window)
    return img, alpha, info


#: The backends :func:`rasterize` renders with, by the name :func:`resolve_backend` gives.
_RENDERERS: dict[str, Callable[[_Request], Rendered]] = {"cpu": _render_cpu, "cuda": _render_gsplat,
                                                         "torch": _render_torch}


def _project_numba(r: _Request) -> tuple[dict, Tensor]:
    """The fused numba projection + SH with an analytic backward (the torch version is the oracle's): ``(proj,
    colours [C, N, D])``. It culls what cannot reach the window itself."""
    if r.sh_degree is not None:
        parts = r.colors if isinstance(r.colors, (tuple, list)) else (r.colors,)
        N = r.means.shape[0]
        if any(c.dim() != 3 or c.shape[0] != N or c.shape[-1] != 3 for c in parts) or parts[0].shape[1] < 1:
            raise ValueError(f"SH colors must be [N, K, 3] or (sh0 [N, 1, 3], shN [N, K-1, 3]); got "
                             f"{[tuple(c.shape) for c in parts]}")
        K = sum(c.shape[1] for c in parts)
        if len(parts) == 2 and parts[0].shape[1] != 1:
            raise ValueError(f"sh0 must be [N, 1, 3]; got {tuple(parts[0].shape)}")
        if not 0 <= r.sh_degree <= 3 or K < (r.sh_degree + 1) ** 2:
            raise ValueError(f"sh_degree {r.sh_degree} needs 0..3 and (sh_degree+1)^2 <= K = {K}")
    proj = project_cpu(r.means, r.quats, r.scales, r.opacities, r.colors if r.sh_degree is not None else None,
                       r.viewmats, r.Ks, r.width, r.height, near_plane=r.near_plane, far_plane=r.far_plane,
                       eps2d=r.eps2d, antialiased=r.antialiased, radius_clip=r.radius_clip, sh_degree=r.sh_degree,
                       window=r.window)
    if r.sh_degree is not None:
        return proj, proj["colors"]  # [C, N, 3]
    return proj, gaussian_colors(r.colors, None, r.means, r.viewmats, proj["valid"])  # [C, N, D]


def _project_torch(r: _Request) -> tuple[dict, Tensor]:
    """The torch projection of the whole view and the colours it sees: ``(proj, colours [C, N, D])``."""
    proj = project_gaussians(r.means, r.quats, r.scales, r.opacities, r.viewmats, r.Ks, r.width, r.height,
                             near_plane=r.near_plane, far_plane=r.far_plane, eps2d=r.eps2d,
                             antialiased=r.antialiased, radius_clip=r.radius_clip)
    return proj, gaussian_colors(r.joined_colors(), r.sh_degree, r.means, r.viewmats, proj["valid"])  # [C, N, D]


def _composite_cpu(r: _Request, means2d, proj, feats, radii, out_w, out_h, bgs):
    return rasterize_cpu(means2d, proj["conics"], feats, proj["opacities"], radii, proj["depths"], out_w, out_h,
                         backgrounds=bgs, absgrad=r.absgrad, return_stats=r.return_stats)


def _composite_oracle(r: _Request, means2d, proj, feats, radii, out_w, out_h, bgs):
    out = rasterize_oracle(means2d, proj["conics"], feats, proj["opacities"], radii, proj["depths"], out_w, out_h,
                           backgrounds=bgs, return_stats=r.return_stats)
    if r.absgrad and means2d.requires_grad:
        # The oracle goes through autograd, which has no per-pixel |grad| sum; the training path uses "cpu".
        raise NotImplementedError("absgrad=True is supported by the 'cpu' and 'cuda' backends, not 'torch'")
    return out


def _composite(name: str, r: _Request, proj: dict, rgb: Tensor, *, culled_to_window: bool,
               compositor: Callable) -> Rendered:
    """Composite projected Gaussians front to back in 16x16 tiles (``compositor``: the numba kernels or the oracle),
    in window pixel coordinates with a window, and build the ``info`` dict gsplat's strategies read."""
    C = r.viewmats.shape[0]
    means2d = proj["means2d"]  # [C, N, 2]
    radii = proj["radii"]
    out_w, out_h = r.width, r.height
    if r.window is not None:
        x0, y0, ww, wh = r.window
        # composite in window pixel coordinates; Gaussians that cannot reach the window count as not visible (the
        # torch projection knows only the whole view: the same test as the numba projection's, done here)
        means2d = means2d - means2d.new_tensor([x0, y0])
        if not culled_to_window:
            rr = radii if radii.dim() == 3 else radii[..., None].expand(*radii.shape, 2)
            m = means2d.detach()
            reach = ((m[..., 0] + rr[..., 0] > 0) & (m[..., 0] - rr[..., 0] < ww)
                     & (m[..., 1] + rr[..., 1] > 0) & (m[..., 1] - rr[..., 1] < wh))
            radii = torch.where(reach[..., None] if radii.dim() == 3 else reach, radii, torch.zeros_like(radii))
        out_w, out_h = ww, wh
    feats = rgb
    bgs = r.backgrounds
    if r.render_mode == "RGB+ED":
        feats = torch.cat([rgb, proj["depths"][..., None]], dim=-1)  # [C, N, D+1]
        if bgs is not None:
            bgs = torch.cat([bgs, bgs.new_zeros(C, 1)], dim=-1)  # depth background is 0
    if bgs is not None and tuple(bgs.shape) != (C, feats.shape[-1]):
        raise ValueError(f"backgrounds must be [C, {feats.shape[-1] - (r.render_mode == 'RGB+ED')}], got "
                         f"{tuple(r.backgrounds.shape)}")

    img, alpha, hits, wsum = compositor(r, means2d, proj, feats, radii, out_w, out_h, bgs)
    if r.render_mode == "RGB+ED":
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
        "width": r.width,
        "height": r.height,
        "tile_size": TILE,
        "tile_width": tw,
        "tile_height": th,
        "n_batches": 1,
        "n_cameras": C,
        "window": None if r.window is None else (r.window[0], r.window[1], out_w, out_h),
    }
    if r.return_stats:
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
    ``[C, H, W, 3]`` (the render itself when None, giving the pure removal energy). Returns ``(render [C, H, W,
    3], increase [C, N])`` in squared [0, 1] units summed over pixels and channels; see :func:`splatflow.render.cpu.removal_loss_cpu`. Exact for
    single removals (each pixel is affine in one Gaussian's alpha). ``backend``: ``"cpu"`` (the CPU kernels,
    inputs copied to the host), ``"triton"`` (:func:`.score_triton.removal_loss_triton`, one Triton kernel launch
    per view on the inputs' device, float32), ``"torch"`` (:func:`.score_torch.removal_loss_torch`, the same score
    in torch on the inputs' device) or ``"auto"``: the CPU kernels for CPU tensors; for any other device the Triton
    kernel where its gate allows it (:func:`.triton_gate.enabled`: CUDA with ``SPLATFLOW_TRITON=1``) and the
    Gaussians are float32, else torch (a GPU run's splats are scored where they are).
    """
    if backend not in ("auto", "cpu", "torch", "triton"):
        raise ValueError(f"removal_loss backend must be 'auto', 'cpu', 'torch' or 'triton', got {backend!r}")
    kw = dict(sh_degree=sh_degree, target=target, near_plane=near_plane, far_plane=far_plane, eps2d=eps2d)
    if backend == "triton" or (backend == "auto" and means.device.type != "cpu"):
        from . import score_triton  # lazy: Triton (its kernels compile on import), only off the CPU or when asked for

        if backend == "auto" and not (score_triton.available(means.device) and means.dtype == torch.float32):
            return removal_loss_torch(means, quats, scales, opacities, colors, viewmats, Ks, width, height, **kw)
        return score_triton.removal_loss_triton(means, quats, scales, opacities, colors, viewmats, Ks, width, height,
                                                **kw)
    if backend == "torch":
        return removal_loss_torch(means, quats, scales, opacities, colors, viewmats, Ks, width, height, **kw)
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
