"""CPU separable Gaussian filters as autograd Functions: SSIM (Wang et al. 2004, the 3DGS window) and the
progressive training blur, both on the numba kernels of :mod:`._filter_kernels`.

These are the CPU paths only; :mod:`.ssim` and :func:`splatflow.render.blur.gaussian_blur` dispatch here for
tensors on the CPU and keep their torch implementations for every other device.

Two paddings are in use: zero "same" padding (SSIM, as the 3DGS reference's ``F.conv2d(padding=5)``) and reflect
padding (the training blur, as ``F.pad(mode="reflect")``, so a blurred constant image stays constant up to the
border). Along the rows the kernels pad each row and run the taps; down the columns a filter is a banded matrix
(see :mod:`._filter_kernels`), built here. The backward of a filter is its transpose; the SSIM window with zero
padding is symmetric, the reflect-padded blur is not (border pixels receive the gradient of the pixels mirrored
onto them), so its backward uses the transposed band and the transposed row filter.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from . import _filter_kernels as K

WINDOW = 11
SIGMA = 1.5
MIN_CHUNK_ROWS = 24  # a parallel work item is at least this many rows (or the whole plane)


def gaussian_taps(radius: int, sigma: float) -> np.ndarray:
    """Normalised Gaussian taps ``[2 radius + 1]`` in float64."""
    x = np.arange(-radius, radius + 1, dtype=np.float64)
    g = np.exp(-(x * x) / (2.0 * sigma * sigma))
    return g / g.sum()


def band_matrix(n: int, taps: np.ndarray, mode: str, transpose: bool = False):
    """The 1-D filter with ``taps`` (odd length ``2r + 1``) along an axis of length ``n``, as the kernels' band:
    ``(band [n, L], start [n] int64, lo, hi)`` with ``out[j] = sum_k band[j, k] in[start[j] + k]``, rows
    ``[lo, hi)`` being the plain stencil. ``mode`` is ``"zero"`` or ``"reflect"`` (needs ``r <= n - 1``, as
    ``F.pad``); ``transpose`` gives the adjoint (the backward pass)."""
    r = (len(taps) - 1) // 2
    if mode not in ("zero", "reflect"):
        raise ValueError(f"mode must be 'zero' or 'reflect', got {mode!r}")
    if mode == "reflect" and r > n - 1:
        raise ValueError(f"reflect padding needs a filter radius below the image side: radius {r}, side {n}")
    band, start, lo, hi = K.build_band(int(n), np.ascontiguousarray(taps, dtype=np.float64), mode == "reflect",
                                       bool(transpose))
    return band, start, int(lo), int(hi)


@functools.lru_cache(maxsize=32)
def _bands(n: int, radius: int, sigma: float, mode: str, transpose: bool, dtype: str):
    band, start, lo, hi = band_matrix(n, gaussian_taps(radius, sigma), mode, transpose)
    return band.astype(dtype), start, lo, hi


@functools.lru_cache(maxsize=32)
def _taps(radius: int, sigma: float, dtype: str, reverse: bool = False) -> np.ndarray:
    t = gaussian_taps(radius, sigma)
    return np.ascontiguousarray(t[::-1] if reverse else t, dtype=dtype)


def chunk_rows(H: int, planes: int, threads: int | None = None) -> int:
    """Rows per parallel work item for ``planes`` planes of ``H`` rows on ``threads`` threads (default: numba's
    current count). The kernels stream rows through small ring buffers, so a tall chunk costs no cache, only
    the rows in the filter's reach above and below it are filtered twice (by both chunks that need them): the
    fewest chunks that split evenly over the threads, as a parallel loop waits for its slowest thread."""
    if threads is None:
        import numba

        threads = numba.get_num_threads()
    planes, threads = max(1, int(planes)), max(1, int(threads))
    most = max(1, H // MIN_CHUNK_ROWS)
    nc = 1
    while nc < most and (planes * nc) % threads != 0 and planes * nc < 4 * threads:
        nc += 1
    return -(-H // nc)


def row_segments(P: int, H: int, threads: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The rows of ``P`` planes of ``H`` rows as one run per thread (default: numba's current count), each run
    cut where it crosses a plane: ``(segs [S, 3] int64 (plane, first row, end row), first [T + 1] int64)``, the
    segments of run ``t`` being ``segs[first[t]:first[t + 1]]``. A parallel loop over the runs gives every thread
    the same number of rows and cuts a plane only where a thread's share ends (3 planes on 2 threads: one cut,
    where chunks of whole-plane divisors made three), so the fewest rows in a filter's reach are done twice."""
    if threads is None:
        import numba

        threads = numba.get_num_threads()
    total = P * H
    runs = max(1, min(int(threads), total // MIN_CHUNK_ROWS))
    segs, first = [], [0]
    for t in range(runs):
        a, b = total * t // runs, total * (t + 1) // runs
        while a < b:
            p, r0 = divmod(a, H)
            r1 = min(H, r0 + (b - a))
            segs.append((p, r0, r1))
            a += r1 - r0
        first.append(len(segs))
    return np.asarray(segs, dtype=np.int64).reshape(-1, 3), np.asarray(first, dtype=np.int64)


def _planes(t: Tensor) -> np.ndarray:
    """``[B, C, H, W]`` tensor -> contiguous ``[B * C, H, W]`` numpy view (a copy only if not contiguous)."""
    B, C, H, W = t.shape
    return t.detach().contiguous().reshape(B * C, H, W).numpy()


def _plane_view(t: Tensor) -> np.ndarray:
    """``[1, C, H, W]`` tensor -> ``[C, H, W]`` numpy view in whatever layout it has (the training render and
    target are ``[H, W, 3]`` images seen through ``permute``), for kernels that read each row through a copy of
    their own (:func:`._filter_kernels.ssim_fused`); other batch sizes go through :func:`_planes`."""
    if t.shape[0] != 1 or min(t.stride()) < 0:
        return _planes(t)
    return t.detach()[0].numpy()


def _is_hwc(t: Tensor) -> bool:
    """Whether a ``[1, C, H, W]`` tensor is a view of a contiguous ``[H, W, C]`` image."""
    return t.shape[0] == 1 and t[0].permute(1, 2, 0).is_contiguous() and not t.is_contiguous()


def _grad_tensor(arr: np.ndarray, hwc: bool, shape) -> Tensor:
    """A kernel's gradient as the input's ``[B, C, H, W]`` gradient: ``arr`` laid out ``[H, W, C]`` for an input
    that is a view of such an image (``hwc``), else ``[B * C, H, W]`` planes."""
    t = torch.from_numpy(arr)
    return t.permute(2, 0, 1)[None] if hwc else t.view(shape)


def _dtype_name(t: Tensor) -> str:
    if t.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"CPU filters take float32 or float64 images, got {t.dtype}")
    return "float32" if t.dtype == torch.float32 else "float64"


# :func:`._filter_kernels.ssim_fused`'s blur arguments for "no blur", per dtype
_NO_BLUR = {dt: (np.empty(0, dtype=dt), np.empty((0, 0), dtype=dt), np.empty(0, dtype=np.int64), 0, 0)
            for dt in ("float32", "float64")}


def _ssim_kernel(xn: np.ndarray, yn: np.ndarray, want_x: bool, want_y: bool, want_sign: bool = False,
                 blur: tuple[float, int] | None = None):
    """:func:`._filter_kernels.ssim_fused` on ``[P, H, W]`` planes (any layout) with the SSIM window; with
    ``blur = (sigma_px, radius)`` of both images blurred by the training blur on the way in."""
    H = xn.shape[1]
    dt = str(xn.dtype)
    bh, sh, lo, hi = _bands(H, WINDOW // 2, SIGMA, "zero", False, dt)
    if blur is None:
        bt, bbh, bsh, blo, bhi = _NO_BLUR[dt]
    else:
        bt = _taps(int(blur[1]), float(blur[0]), dt)
        bbh, bsh, blo, bhi = _bands(H, int(blur[1]), float(blur[0]), "reflect", False, dt)
    return K.ssim_fused(xn, yn, _taps(WINDOW // 2, SIGMA, dt), bh, sh, lo, hi, bt, bbh, bsh, blo, bhi, want_x,
                        want_y, want_sign, *row_segments(xn.shape[0], H))


def _blur_kernel(a: np.ndarray, b: np.ndarray | None, sigma_px: float, radius: int, transpose: bool,
                 sgn: np.ndarray | None = None, ga: float = 0.0, gb: float = 0.0, hwc_out: bool = False):
    """:func:`._filter_kernels.separable_filter` with the training blur (or its transpose) on ``[P, H, W]``
    planes ``a`` and ``b`` (``None``: none; either may be a strided view); ``sgn, ga, gb``: the loss gradient
    ``ga * a + gb * sgn`` formed on the way in; ``hwc_out``: the blurred ``a`` laid out ``[H, W, P]``."""
    P, H, W = a.shape
    dt = str(a.dtype)
    empty = np.empty((0, H, W), dtype=dt)
    b = empty if b is None else b
    bh, sh, lo, hi = _bands(H, radius, float(sigma_px), "reflect", transpose, dt)
    return K.separable_filter(a, b, _taps(radius, float(sigma_px), dt, transpose),
                              K.REFLECT_T if transpose else K.REFLECT, bh, sh, lo, hi,
                              chunk_rows(H, P + b.shape[0]),
                              np.empty((0, H, W), dtype=np.int8) if sgn is None else sgn, float(ga), float(gb),
                              bool(hwc_out))


def _means(row_sums: np.ndarray, l1_rows: np.ndarray, x: Tensor) -> tuple[Tensor, Tensor]:
    """The kernels' per-row sums of the SSIM map and of ``|x - y|`` as the two means, on ``x``'s device."""
    n = x.numel()
    return (torch.tensor(float(row_sums.sum()) / n, dtype=x.dtype, device=x.device),
            torch.tensor(float(l1_rows.sum()) / n, dtype=x.dtype, device=x.device))


def _no_grad_pass(name: str, entry: str) -> RuntimeError:
    return RuntimeError(f"{name}.apply(..., with_grad=False) was differentiated; call it with with_grad=True "
                        f"({entry} does so whenever grad mode is on)")


class SSIMCPU(torch.autograd.Function):
    """Mean SSIM and mean absolute difference (L1) of ``[B, C, H, W]`` CPU tensors (SSIM: 11x11 Gaussian window,
    sigma 1.5, zero padding), with exact gradients. ``apply(x, y, with_grad) -> (ssim, l1)``: with
    ``with_grad`` (grad mode on and an input that requires grad) the one fused kernel pass that computes the values
    also computes the gradient of the sum of the SSIM map (its intermediates never leave the cache, see
    :func:`._filter_kernels.ssim_fused`); backward scales it and adds the L1 term's ``sign(x - y)`` in one pass."""

    @staticmethod
    def forward(ctx, x: Tensor, y: Tensor, with_grad: bool = True):
        B, C, H, W = x.shape
        _dtype_name(x)
        want_x = bool(with_grad and ctx.needs_input_grad[0])
        want_y = bool(with_grad and ctx.needs_input_grad[1])
        # read where they lie (the training step's render and target are [H, W, 3] images); the gradients go
        # back in each input's layout
        row_sums, l1_rows, gx, gy, sgn = _ssim_kernel(_plane_view(x), _plane_view(y), want_x, want_y,
                                                      want_x or want_y)
        ctx.arrays = (gx, gy, sgn)
        ctx.with_grad = bool(with_grad)
        ctx.shape = (B, C, H, W)
        ctx.hwc = (_is_hwc(x), _is_hwc(y))
        return _means(row_sums, l1_rows, x)

    @staticmethod
    @once_differentiable
    def backward(ctx, g_ssim: Tensor, g_l1: Tensor):
        if not ctx.with_grad:
            raise _no_grad_pass("SSIMCPU", "splatflow.render.ssim.ssim")
        gx, gy, sgn = ctx.arrays
        n = sgn.size
        a, b = float(g_ssim) / n, float(g_l1) / n
        out = []
        for i, (g, sb) in enumerate(((gx, b), (gy, -b))):  # d|x - y|/dy = -sign(x - y)
            if not ctx.needs_input_grad[i]:
                out.append(None)
                continue
            out.append(_grad_tensor(K.add_sign_grad(g, sgn, a, sb, ctx.hwc[i]), ctx.hwc[i], ctx.shape))
        return out[0], out[1], None


def blur_radius(sigma_px: float, width: int, height: int) -> int:
    """Truncation radius of the training blur: 3 sigma, at least 1 px, below both image sides (reflect padding)."""
    return min(max(1, int(math.ceil(3.0 * sigma_px))), width - 1, height - 1)


class GaussianBlurCPU(torch.autograd.Function):
    """Separable Gaussian blur with reflect padding of one or two ``[B, C, H, W]`` CPU tensors of one size (the
    render and the target: one kernel call for both); backward by the transposed filter (exact, including the
    reflected borders). ``apply(img, img2_or_None, sigma_px, radius)`` returns the blurred ``img``, or the pair."""

    @staticmethod
    def forward(ctx, img: Tensor, img2: Tensor | None, sigma_px: float, radius: int):
        B, C, H, W = img.shape
        dt = _dtype_name(img)
        if img2 is not None and (img2.shape[-2:] != img.shape[-2:] or img2.dtype != img.dtype):
            raise ValueError(f"blurring two images in one call needs one size and dtype, got {tuple(img.shape)} "
                             f"{img.dtype} and {tuple(img2.shape)} {img2.dtype}")
        out, out2 = _blur_kernel(_planes(img), _planes(img2) if img2 is not None else None, sigma_px, radius, False)
        ctx.params = (float(sigma_px), int(radius), dt, tuple(img.shape),
                      tuple(img2.shape) if img2 is not None else None)
        if img2 is None:
            return torch.from_numpy(out).view(B, C, H, W)
        o1, o2 = torch.from_numpy(out).view(B, C, H, W), torch.from_numpy(out2).view(img2.shape)
        for i, o in enumerate((o1, o2)):
            if not ctx.needs_input_grad[i]:  # e.g. the target: its blur is a constant, not part of the graph
                ctx.mark_non_differentiable(o)
        return o1, o2

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads: Tensor):
        sigma_px, radius, dt, shape, shape2 = ctx.params
        want = [i for i, s in enumerate((shape, shape2)) if s is not None and ctx.needs_input_grad[i]]
        planes = [_planes(grads[i].to(getattr(torch, dt))) for i in want]
        if not planes:
            return None, None, None, None
        outs = _blur_kernel(planes[0], planes[1] if len(planes) > 1 else None, sigma_px, radius, True)
        res = [None, None]
        for k, i in enumerate(want):
            res[i] = torch.from_numpy(outs[k]).view((shape, shape2)[i])
        return res[0], res[1], None, None


class BlurredL1SSIMCPU(torch.autograd.Function):
    """``(mean SSIM, mean L1)`` of ``x`` and ``y`` both blurred by the training blur (``[B, C, H, W]`` CPU
    tensors; gradient to ``x`` only, the target being data): the training loss's two terms of 3DGS Eq. 7 with
    the progressive blur. ``apply(x, y, sigma_px, radius, with_grad)``.

    Forward: one kernel blurs both row by row on the way into SSIM and L1 with SSIM's gradient (as
    :class:`SSIMCPU`; the blurred images never go through memory) and keeps ``sign(blurred x - blurred y)`` as
    int8. Backward: one kernel forms ``a dSSIM + b sign`` row by row and runs the transposed blur over it;
    through :class:`GaussianBlurCPU` and :class:`SSIMCPU` that would be two more images written and read again,
    and two more parallel loops."""

    @staticmethod
    def forward(ctx, x: Tensor, y: Tensor, sigma_px: float, radius: int, with_grad: bool = True):
        _dtype_name(x)
        # the render and target are read where they lie (the training step's are [H, W, 3] images), and the
        # gradient goes back in the render's layout: no copy of either image, nor of the gradient, on the way
        want = bool(with_grad and ctx.needs_input_grad[0])
        row_sums, l1_rows, gx, _, sgn = _ssim_kernel(_plane_view(x), _plane_view(y), want, False, want,
                                                     (float(sigma_px), int(radius)))
        ctx.arrays = (gx, sgn) if want else None
        ctx.params = (float(sigma_px), int(radius), x.shape, _is_hwc(x))
        return _means(row_sums, l1_rows, x)

    @staticmethod
    @once_differentiable
    def backward(ctx, g_ssim: Tensor, g_l1: Tensor):
        if ctx.arrays is None:
            raise _no_grad_pass("BlurredL1SSIMCPU", "splatflow.render.ssim.l1_ssim")
        gx, sgn = ctx.arrays
        sigma_px, radius, shape, hwc = ctx.params
        n = gx.size
        out, _ = _blur_kernel(gx, None, sigma_px, radius, True, sgn, float(g_ssim) / n, float(g_l1) / n, hwc)
        return _grad_tensor(out, hwc, shape), None, None, None, None


def _blur_is_identity(img: Tensor, sigma_px: float, radius: int) -> bool:
    """Below ~0.166 px the float32 blur's centre tap rounds to 1 and the others are < 2^-25: it changes a pixel by
    less than float32 resolves (at most 1.5e-8 absolute), so it is skipped, forward and backward (float64, used
    for gradient checks, always takes the filter)."""
    return img.dtype == torch.float32 and _taps(radius, float(sigma_px), "float32")[radius] == 1.0


def blurred_l1_ssim_cpu(x: Tensor, y: Tensor, sigma_px: float) -> tuple[Tensor, Tensor]:
    """``(mean SSIM, mean |x - y|)`` of ``[B, C, H, W]`` CPU tensors after the training blur of both by
    ``sigma_px`` (see :func:`splatflow.render.ssim.l1_ssim`): one fused pass forward and one backward when only
    ``x`` needs a gradient (training: the render and its target), else the blur and SSIM as two steps."""
    if x.device.type != "cpu" or y.device.type != "cpu":
        raise ValueError(f"blurred_l1_ssim_cpu needs CPU tensors, got {x.device} and {y.device}")
    if x.shape != y.shape or x.dtype != y.dtype or x.dim() != 4:
        raise ValueError(f"blurred_l1_ssim_cpu needs two [B, C, H, W] tensors of one shape and dtype, got "
                         f"{tuple(x.shape)} {x.dtype} and {tuple(y.shape)} {y.dtype}")
    H, W = x.shape[-2:]
    radius = blur_radius(sigma_px, W, H)
    if _blur_is_identity(x, sigma_px, radius):
        return ssim_l1_cpu(x, y)
    if y.requires_grad and torch.is_grad_enabled():
        return ssim_l1_cpu(*gaussian_blur_cpu(x, sigma_px, y))
    with_grad = torch.is_grad_enabled() and x.requires_grad
    return BlurredL1SSIMCPU.apply(x, y, float(sigma_px), radius, with_grad)


def gaussian_blur_cpu(img: Tensor, sigma_px: float, img2: Tensor | None = None):
    """The training blur (see :func:`splatflow.render.blur.gaussian_blur`) on CPU tensors; with ``img2`` both
    images in one kernel call, returned as a pair."""
    if img.device.type != "cpu" or (img2 is not None and img2.device.type != "cpu"):
        raise ValueError(f"gaussian_blur_cpu needs CPU tensors, got one on {img.device}")
    H, W = img.shape[-2:]
    radius = blur_radius(sigma_px, W, H)
    if _blur_is_identity(img, sigma_px, radius):
        return img if img2 is None else (img, img2)
    return GaussianBlurCPU.apply(img, img2, float(sigma_px), radius)


def ssim_l1_cpu(x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    """``(mean SSIM, mean |x - y|)`` of ``[B, C, H, W]`` CPU tensors of one shape and dtype (see
    :func:`splatflow.render.ssim.ssim`)."""
    if x.device.type != "cpu" or y.device.type != "cpu":
        raise ValueError(f"ssim_l1_cpu needs CPU tensors, got {x.device} and {y.device}")
    with_grad = torch.is_grad_enabled() and (x.requires_grad or y.requires_grad)
    return SSIMCPU.apply(x, y, with_grad)


def ssim_cpu(x: Tensor, y: Tensor) -> Tensor:
    """Mean SSIM of ``[B, C, H, W]`` CPU tensors of one shape and dtype (see :func:`splatflow.render.ssim.ssim`)."""
    return ssim_l1_cpu(x, y)[0]


__all__ = ["SSIMCPU", "GaussianBlurCPU", "BlurredL1SSIMCPU", "ssim_cpu", "ssim_l1_cpu", "blurred_l1_ssim_cpu",
           "gaussian_blur_cpu", "band_matrix", "gaussian_taps",
           "blur_radius"]
