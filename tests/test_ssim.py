"""The fast SSIM equals a direct 11x11 conv2d implementation of the 3DGS formula, value and gradient."""

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
