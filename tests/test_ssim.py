"""The fast SSIM equals a direct 11x11 conv2d implementation of the 3DGS formula, value and gradient."""

import os

import torch
import torch.nn.functional as F

from splatflow.render.ssim import ssim


def reference_ssim(x, y):
    """Written out independently: 2-D 11x11 Gaussian window (sigma 1.5), zero padding 5, C1=0.01^2, C2=0.03^2."""
    coords = torch.arange(11, dtype=torch.float64) - 5
    g = torch.exp(-coords**2 / (2 * 1.5**2))
    g = g / g.sum()
    win = (g[:, None] @ g[None, :]).to(x.dtype).expand(x.shape[1], 1, 11, 11)

    def blur(t):
        return F.conv2d(t, win, padding=5, groups=x.shape[1])

    mu_x, mu_y = blur(x), blur(y)
    s_xx = blur(x * x) - mu_x**2
    s_yy = blur(y * y) - mu_y**2
    s_xy = blur(x * y) - mu_x * mu_y
    c1, c2 = 0.01**2, 0.03**2
    m = ((2 * mu_x * mu_y + c1) * (2 * s_xy + c2)) / ((mu_x**2 + mu_y**2 + c1) * (s_xx + s_yy + c2))
    return m.mean()


def test_ssim_value_and_gradients_match_reference():
    g = torch.Generator().manual_seed(0)
    y = torch.rand(2, 3, 37, 53, generator=g, dtype=torch.float64)
    x = (y + 0.15 * torch.randn(y.shape, generator=g, dtype=torch.float64)).clamp(0, 1)
    x1, y1 = x.clone().requires_grad_(), y.clone().requires_grad_()
    x2, y2 = x.clone().requires_grad_(), y.clone().requires_grad_()
    a, b = ssim(x1, y1), reference_ssim(x2, y2)
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    a.backward()
    b.backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-9, atol=1e-14)
    torch.testing.assert_close(y1.grad, y2.grad, rtol=1e-9, atol=1e-14)
    assert 0.2 < a.item() < 0.95


def test_ssim_float32_identity_and_gradcheck():
    g = torch.Generator().manual_seed(1)
    x = torch.rand(1, 3, 24, 30, generator=g)
    assert abs(ssim(x, x).item() - 1.0) < 1e-5
    xs = torch.rand(1, 3, 12, 14, generator=g, dtype=torch.float64, requires_grad=True)
    ys = torch.rand(1, 3, 12, 14, generator=g, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda t: ssim(t, ys), (xs,))


# ---------------------------------------------------------------------------------------------------------------
# The CPU path (numba kernels of splatflow.render.filters) against the torch path kept for other devices, the
# written-out formula, and finite differences; and the device rule: CPU tensors -> numba, others -> torch, with
# no tensor made on the default device.

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from splatflow.render.filters import GaussianBlurCPU, SSIMCPU, band_matrix, gaussian_taps  # noqa: E402
from splatflow.render.ssim import ssim_torch  # noqa: E402
from splatflow.render.blur import gaussian_blur, gaussian_blur_pair, gaussian_blur_torch  # noqa: E402


def _pair(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    y = torch.rand(shape, generator=g, dtype=dtype)
    x = (y + 0.2 * torch.randn(shape, generator=g, dtype=dtype)).clamp(0, 1)
    return x, y


def _dense(n, taps, mode, transpose=False):
    """The banded matrix as a dense [n, n] one."""
    band, start, _, _ = band_matrix(n, taps, mode, transpose)
    M = np.zeros((n, n))
    for j in range(n):
        M[j, start[j]:start[j] + band.shape[1]] += band[j]
    return M


@pytest.mark.parametrize("n,r", [(1, 0), (4, 3), (7, 5), (11, 5), (12, 5), (40, 5), (23, 8)])
def test_band_matrices_are_the_padded_filters_and_their_transposes(n, r):
    taps = gaussian_taps(r, 1.7)
    e = np.eye(n)
    # zero padding: M @ e_k is the filter applied to a unit impulse with zeros outside
    Z = _dense(n, taps, "zero")
    zref = torch.nn.functional.conv1d(torch.from_numpy(e)[:, None], torch.from_numpy(taps)[None, None], padding=r)
    np.testing.assert_allclose(Z, zref[:, 0].numpy().T, atol=1e-15)
    np.testing.assert_allclose(_dense(n, taps, "zero", True), Z.T, atol=1e-15)
    if r <= n - 1:
        R = _dense(n, taps, "reflect")
        padded = torch.nn.functional.pad(torch.from_numpy(e)[:, None], (r, r), mode="reflect") if r else \
            torch.from_numpy(e)[:, None]
        rref = torch.nn.functional.conv1d(padded, torch.from_numpy(taps)[None, None])
        np.testing.assert_allclose(R, rref[:, 0].numpy().T, atol=1e-15)
        np.testing.assert_allclose(_dense(n, taps, "reflect", True), R.T, atol=1e-15)
        assert np.allclose(R.sum(axis=1), 1.0)  # a constant row stays constant
    else:
        with pytest.raises(ValueError, match="radius"):
            band_matrix(n, taps, "reflect")


@pytest.mark.parametrize("shape", [(1, 3, 37, 53), (2, 3, 16, 16), (1, 3, 7, 9), (1, 1, 12, 11), (1, 3, 1, 20)])
def test_cpu_ssim_matches_torch_path_float32(shape):
    x, y = _pair(shape, torch.float32, 3)
    x1, y1 = x.clone().requires_grad_(), y.clone().requires_grad_()
    x2, y2 = x.clone().requires_grad_(), y.clone().requires_grad_()
    a, b = ssim(x1, y1), ssim_torch(x2, y2)
    torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)
    a.backward()
    b.backward()
    scale = float(x2.grad.abs().max())
    torch.testing.assert_close(x1.grad, x2.grad, rtol=0, atol=5e-5 * scale)
    torch.testing.assert_close(y1.grad, y2.grad, rtol=0, atol=5e-5 * scale)
    assert x1.grad.dtype == torch.float32 and x1.grad.device.type == "cpu"


@pytest.mark.parametrize("shape", [(1, 2, 13, 15), (1, 1, 6, 8), (2, 1, 11, 4)])
def test_cpu_ssim_gradcheck_float64(shape):
    x, y = _pair(shape, torch.float64, 4)
    x.requires_grad_()
    y.requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: SSIMCPU.apply(a, b, True), (x, y))  # both outputs: SSIM and L1
    # one input at a time (the kernels skip the other's gradient)
    assert torch.autograd.gradcheck(lambda t: SSIMCPU.apply(t, y.detach(), True), (x,))
    assert torch.autograd.gradcheck(lambda t: SSIMCPU.apply(x.detach(), t, True), (y,))


def test_cpu_ssim_against_reference_on_training_size():
    x, y = _pair((1, 3, 61, 109), torch.float64, 5)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    a, b = ssim(x1, y), reference_ssim(x2, y)
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    a.backward()
    b.backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-9, atol=1e-14)


@pytest.mark.parametrize("shape,sigma", [((1, 3, 37, 53), 2.4), ((1, 3, 37, 53), 0.7), ((2, 3, 20, 30), 9.0),
                                         ((1, 3, 5, 7), 2.4), ((1, 1, 1, 6), 1.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cpu_blur_matches_torch_path(shape, sigma, dtype):
    x, _ = _pair(shape, dtype, 6)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    a, b = gaussian_blur(x1, sigma), gaussian_blur_torch(x2, sigma)
    tol = 2e-6 if dtype == torch.float32 else 1e-13
    torch.testing.assert_close(a, b, rtol=0, atol=tol)
    w = torch.rand(a.shape, generator=torch.Generator().manual_seed(7), dtype=dtype)
    (a * w).sum().backward()
    (b * w).sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=0, atol=tol)


@pytest.mark.parametrize("shape,sigma,radius", [((1, 2, 9, 12), 1.3, 4), ((1, 1, 5, 7), 2.4, 4),
                                                ((2, 1, 6, 6), 0.6, 2)])
def test_cpu_blur_gradcheck_float64(shape, sigma, radius):
    x, _ = _pair(shape, torch.float64, 8)
    x.requires_grad_()
    assert torch.autograd.gradcheck(lambda t: GaussianBlurCPU.apply(t, None, sigma, radius), (x,))
    # two images in one call, gradients to both
    x2 = torch.rand(x.shape, generator=torch.Generator().manual_seed(12), dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: GaussianBlurCPU.apply(a, b, sigma, radius), (x, x2))


def test_cpu_paths_make_no_tensor_on_the_default_device():
    """Every tensor the CPU paths (and the torch paths run on CPU) create is made on the input's device: with the
    default device set to ``meta`` anything created without ``device=`` would land there and fail."""
    x, y = _pair((1, 3, 24, 31), torch.float32, 9)
    want_s = float(ssim(x, y))
    want_b = gaussian_blur(x, 1.5)
    prev = torch.get_default_device()
    torch.set_default_device("meta")
    try:
        for fs, fb in ((ssim, gaussian_blur), (ssim_torch, gaussian_blur_torch)):
            xg = x.clone().requires_grad_()
            b = fb(xg, 1.5)
            s = fs(b, fb(y, 1.5))
            s.backward()
            assert s.device.type == "cpu" and b.device.type == "cpu" and xg.grad.device.type == "cpu"
            assert float(fs(x, y)) == pytest.approx(want_s, abs=2e-6)
            torch.testing.assert_close(b.detach(), want_b, rtol=0, atol=2e-6)
    finally:
        torch.set_default_device(prev)


def test_non_cpu_tensors_take_the_torch_path(monkeypatch):
    """Dispatch is on the tensor's device: ``meta`` tensors (shape-only, no GPU needed) must never reach the
    numba kernels, which would fail on them, and come out on their own device."""
    import splatflow.render.filters as filters

    def boom(*a, **k):
        raise AssertionError("the numba path was called for a non-CPU tensor")

    monkeypatch.setattr(filters, "ssim_cpu", boom)
    monkeypatch.setattr(filters, "gaussian_blur_cpu", boom)
    x = torch.empty(1, 3, 20, 24, device="meta")
    assert ssim(x, x).device.type == "meta"
    assert gaussian_blur(x, 1.5).device.type == "meta"
    assert gaussian_blur(x, 1.5).shape == x.shape


@pytest.mark.cuda
def test_cuda_torch_path_matches_cpu_path():
    x, y = _pair((1, 3, 45, 61), torch.float32, 10)
    xc = x.cuda().requires_grad_()
    xh = x.clone().requires_grad_()
    bc, bh = gaussian_blur(xc, 2.0), gaussian_blur(xh, 2.0)
    sc, sh = ssim(bc, gaussian_blur(y.cuda(), 2.0)), ssim(bh, gaussian_blur(y, 2.0))
    assert sc.device.type == "cuda"
    torch.testing.assert_close(sc.cpu(), sh, rtol=2e-6, atol=2e-6)
    sc.backward()
    sh.backward()
    torch.testing.assert_close(xc.grad.cpu(), xh.grad, rtol=0, atol=5e-5 * float(xh.grad.abs().max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_l1_ssim_matches_torch_ops(dtype):
    """The training loss's two terms from one CPU kernel pass equal the plain torch expressions, with gradients
    through any combination of the two."""
    from splatflow.render.ssim import l1_ssim

    x, y = _pair((1, 3, 29, 41), dtype, 11)
    x1, y1 = x.clone().requires_grad_(), y.clone().requires_grad_()
    x2, y2 = x.clone().requires_grad_(), y.clone().requires_grad_()
    l1a, sa = l1_ssim(x1, y1)
    l1b, sb = (x2 - y2).abs().mean(), ssim_torch(x2, y2)
    tol = 2e-6 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(l1a, l1b, rtol=tol, atol=tol)
    torch.testing.assert_close(sa, sb, rtol=tol, atol=tol)
    (0.8 * l1a + 0.2 * (1 - sa)).backward()
    (0.8 * l1b + 0.2 * (1 - sb)).backward()
    scale = float(x2.grad.abs().max())
    torch.testing.assert_close(x1.grad, x2.grad, rtol=0, atol=5e-5 * scale if dtype == torch.float32 else 1e-12)
    torch.testing.assert_close(y1.grad, y2.grad, rtol=0, atol=5e-5 * scale if dtype == torch.float32 else 1e-12)
    # only the L1 term
    x3 = x.clone().requires_grad_()
    l1_ssim(x3, y)[0].backward()
    torch.testing.assert_close(x3.grad, torch.sign(x - y) / x.numel())
    # off the CPU: torch ops on the tensors' device
    m = torch.empty(1, 3, 20, 24, device="meta")
    assert all(t.device.type == "meta" for t in l1_ssim(m, m))


def test_blur_pair_equals_two_blurs():
    """Render and target blurred in one kernel call equal two separate calls; only the render gets a gradient."""
    x, y = _pair((1, 3, 31, 45), torch.float32, 13)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    a, b = gaussian_blur_pair(x1, y, 2.4)
    assert not b.requires_grad
    torch.testing.assert_close(a, gaussian_blur(x2, 2.4), rtol=0, atol=0)
    torch.testing.assert_close(b, gaussian_blur(y, 2.4), rtol=0, atol=0)
    w = torch.rand(a.shape, generator=torch.Generator().manual_seed(14))
    (a * w).sum().backward()
    (gaussian_blur(x2, 2.4) * w).sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=0, atol=0)
    assert gaussian_blur_pair(x, y, 0.0) == (x, y)
    m = torch.empty(1, 3, 20, 24, device="meta")
    assert all(t.device.type == "meta" for t in gaussian_blur_pair(m, m, 1.5))


def test_blur_skipped_only_where_it_is_the_identity_in_float32():
    """Below ~0.166 px the float32 blur is the identity to within float32 resolution, and is skipped (the input
    itself comes back); just above it the blur runs. Either way it agrees with the torch path."""
    x, y = _pair((1, 3, 23, 29), torch.float32, 15)
    for sigma, skipped in ((0.06, True), (0.15, True), (0.166, True), (0.17, False), (0.3, False)):
        a = gaussian_blur(x, sigma)
        assert (a is x) == skipped, sigma
        # skipped: within a float32 rounding step of the real blur; run: the usual float32 tolerance
        torch.testing.assert_close(a, gaussian_blur_torch(x, sigma), rtol=0, atol=1.2e-7 if skipped else 2e-6)
        pa, pb = gaussian_blur_pair(x, y, sigma)
        assert (pa is x and pb is y) == skipped
    # float64 (gradient checks) always takes the exact filter
    x64 = x.double()
    assert gaussian_blur(x64, 0.1) is not x64


@pytest.mark.parametrize("shape,sigma", [((1, 3, 31, 45), 2.4), ((1, 3, 17, 23), 0.7), ((2, 1, 12, 9), 1.3)])
def test_blurred_l1_ssim_equals_blur_then_l1_ssim(shape, sigma):
    """The fused CPU path (blur, SSIM and L1 in two kernel passes forward and one backward) equals blurring both
    images and taking both terms (the torch path), values and gradients, for either weighting of the terms."""
    from splatflow.render.ssim import l1_ssim

    x, y = _pair(shape, torch.float32, 16)
    for lam in (0.2, 1.0, 0.0):
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        l1a, sa = l1_ssim(x1, y, blur_sigma=sigma)
        xb, yb = gaussian_blur_torch(x2, sigma), gaussian_blur_torch(y, sigma)
        l1b, sb = (xb - yb).abs().mean(), ssim_torch(xb, yb)
        torch.testing.assert_close(l1a, l1b, rtol=2e-6, atol=2e-6)
        torch.testing.assert_close(sa, sb, rtol=2e-6, atol=2e-6)
        ((1 - lam) * l1a + lam * (1 - sa)).backward()
        ((1 - lam) * l1b + lam * (1 - sb)).backward()
        torch.testing.assert_close(x1.grad, x2.grad, rtol=0, atol=5e-5 * float(x2.grad.abs().max()))
    # a target that needs a gradient too takes the two-step path, with both gradients
    x1, y1 = x.clone().requires_grad_(), y.clone().requires_grad_()
    x2, y2 = x.clone().requires_grad_(), y.clone().requires_grad_()
    l1a, sa = l1_ssim(x1, y1, blur_sigma=sigma)
    xb, yb = gaussian_blur_torch(x2, sigma), gaussian_blur_torch(y2, sigma)
    (l1a + sa).backward()
    ((xb - yb).abs().mean() + ssim_torch(xb, yb)).backward()
    torch.testing.assert_close(y1.grad, y2.grad, rtol=0, atol=5e-5 * float(y2.grad.abs().max()))
    # no grad mode: values only
    with torch.no_grad():
        torch.testing.assert_close(l1_ssim(x, y, blur_sigma=sigma)[1], sb.detach(), rtol=2e-6, atol=2e-6)
    m = torch.empty(1, 3, 20, 24, device="meta")
    assert all(t.device.type == "meta" for t in l1_ssim(m, m, blur_sigma=sigma))


def test_blurred_l1_ssim_reads_and_returns_the_render_layout():
    """The training step hands the loss ``[H, W, 3]`` render and target seen as ``[1, 3, H, W]``: the CPU paths
    (with and without the blur) read them where they lie and returns the render's gradient in that layout (no copy of either image,
    nor of the gradient for the rasterizer's backward), with the same numbers as contiguous planes."""
    from splatflow.render.filters import BlurredL1SSIMCPU
    from splatflow.render.ssim import l1_ssim

    g = torch.Generator().manual_seed(21)
    rgb, tgt = torch.rand(29, 41, 3, generator=g), torch.rand(29, 41, 3, generator=g)
    for sigma in (2.4, 0.7, 0.0):  # 0: no blur, the SSIM + L1 Function alone
        r1, r2 = rgb.clone().requires_grad_(), rgb.clone().requires_grad_()
        pred = r1.permute(2, 0, 1)[None]
        seen = []
        pred.register_hook(seen.append)
        l1a, sa = l1_ssim(pred, tgt.permute(2, 0, 1)[None], blur_sigma=sigma)
        l1b, sb = l1_ssim(r2.permute(2, 0, 1).contiguous()[None], tgt.permute(2, 0, 1).contiguous()[None],
                          blur_sigma=sigma)
        assert torch.equal(l1a, l1b) and torch.equal(sa, sb)
        (0.8 * l1a + 0.2 * (1 - sa)).backward()
        (0.8 * l1b + 0.2 * (1 - sb)).backward()
        assert torch.equal(r1.grad, r2.grad)
        assert seen[0].permute(0, 2, 3, 1).is_contiguous() and not seen[0].is_contiguous()
    x = torch.rand(11, 13, 2, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.rand(11, 13, 2, generator=g, dtype=torch.float64)
    assert torch.autograd.gradcheck(
        lambda t: BlurredL1SSIMCPU.apply(t.permute(2, 0, 1)[None], y.permute(2, 0, 1)[None], 1.3, 4, True), (x,))
    y.requires_grad_()
    assert torch.autograd.gradcheck(
        lambda a, b: SSIMCPU.apply(a.permute(2, 0, 1)[None], b.permute(2, 0, 1)[None], True), (x, y))


def test_blurred_l1_ssim_gradcheck_float64():
    from splatflow.render.filters import BlurredL1SSIMCPU

    x, y = _pair((1, 2, 11, 13), torch.float64, 17)
    x.requires_grad_()
    assert torch.autograd.gradcheck(lambda t: BlurredL1SSIMCPU.apply(t, y, 1.3, 4, True), (x,))
    assert torch.autograd.gradcheck(lambda t: BlurredL1SSIMCPU.apply(t, y, 0.6, 2, True), (x,))


def test_filter_kernels_compile_first_in_a_fresh_process(tmp_path):
    """The blur kernel compiles when it is the first numba function a process compiles (every other kernel loaded
    from the cache, e.g. training after a run that never blurred): a constant-array idiom in it used to fail
    numba's rewrite pass there with ``AssertionError: key already in dictionary``."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import numpy as np\n"
            "from splatflow.render import filters as F\n"
            "a = np.random.default_rng(0).random((3, 40, 50)).astype(np.float32)\n"
            "out, _ = F._blur_kernel(a, None, 2.4, 8, False)\n"
            "print(float(abs(out.mean() - a.mean())) < 0.05)\n")
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "True"


def test_ssim_kernel_results_do_not_depend_on_how_rows_are_cut():
    """The SSIM kernel's parallel runs (``row_segments``: every row of every plane exactly once, one run per
    thread, a plane cut where a run ends) give the same bits however many runs there are, with and without the
    training blur: the rows in the filters' reach of a cut are made by both sides."""
    from splatflow.render import _filter_kernels as K
    from splatflow.render.filters import _bands, _taps, row_segments

    H, W = 61, 45
    rng = np.random.default_rng(3)
    x, y = rng.random((3, H, W), dtype=np.float32), rng.random((3, H, W), dtype=np.float32)
    bh, sh, lo, hi = _bands(H, 5, 1.5, "zero", False, "float32")
    for blur in (None, (2.4, 8)):
        if blur is None:
            bt, bb, bs, blo, bhi = (np.empty(0, np.float32), np.empty((0, 0), np.float32), np.empty(0, np.int64), 0, 0)
        else:
            bt = _taps(blur[1], blur[0], "float32")
            bb, bs, blo, bhi = _bands(H, blur[1], blur[0], "reflect", False, "float32")
        results = []
        for threads in (1, 2, 3, 4, 7):
            segs, first = row_segments(3, H, threads)
            rows = np.zeros((3, H), dtype=int)
            for p, r0, r1 in segs:
                rows[p, r0:r1] += 1
            assert (rows == 1).all() and first[0] == 0 and first[-1] == len(segs)
            results.append(K.ssim_fused(x, y, _taps(5, 1.5, "float32"), bh, sh, lo, hi, bt, bb, bs, blo, bhi,
                                        True, True, True, segs, first))
        assert len({len(row_segments(3, H, t)[0]) for t in (1, 2, 3, 4, 7)}) > 1  # the cuts did differ
        for r in results[1:]:
            assert all(np.array_equal(a, b) for a, b in zip(results[0], r))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_column_stencils_match_numpy_for_every_tap_count(dtype):
    """The column stencils (:func:`_vconv4`: four rows, :func:`_vconv`: one), built as LLVM IR with ``noalias``
    pointers for the literal tap counts of :func:`_unrolled` and a numba loop for any other count, give the
    banded sums down a block of ring rows, read through a slice of the ring as the kernels do, for rows of a
    vector's length and of odd widths."""
    import numba as nb

    from splatflow.render import _filter_kernels as K

    @nb.njit(fastmath=True)
    def both(ring, b, out4, out1, w):
        L = w.shape[0]
        K._unrolled(K._vconv4, ring[b:b + L + 3], 0, out4, w, out4.shape[1], L)
        K._unrolled(K._vconv, ring[b:b + L], 0, out1, w, out1.shape[0], L)

    rng = np.random.default_rng(11)
    for L in (3, 5, 7, 9, 11, 13, 15, 17, 19, 4):  # 19 and 4: counts without a literal specialisation
        for W in (1, 16, 37, 490):
            ring = rng.random((2 * (L + 3) + 2, W)).astype(dtype)
            w = rng.random(L).astype(dtype)
            out4, out1 = np.full((4, W), np.nan, dtype), np.full(W, np.nan, dtype)
            b = 2
            both(ring, b, out4, out1, w)
            want = np.stack([w @ ring[b + q:b + q + L].astype(np.float64) for q in range(4)])
            tol = 1e-5 if dtype == np.float32 else 1e-12
            np.testing.assert_allclose(out4, want, rtol=tol, atol=tol)
            np.testing.assert_allclose(out1, want[0], rtol=tol, atol=tol)
