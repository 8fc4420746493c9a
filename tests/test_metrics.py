"""PSNR and SSIM of the evaluation protocol, on cases with known answers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from splatflow.evaluation.metrics import psnr, quantize_8bit, ssim


def test_psnr_known_values_and_layouts():
    a = torch.zeros(16, 20, 3)
    b = torch.full((16, 20, 3), 0.25)  # exact in float32: MSE 1/16
    assert psnr(a, b) == pytest.approx(10 * math.log10(16), abs=1e-12)
    assert psnr(a.permute(2, 0, 1)[None], b.permute(2, 0, 1)[None]) == pytest.approx(10 * math.log10(16), abs=1e-12)
    assert psnr(a, a) == math.inf
    c = a.clone()
    c[0, 0, 0] = 1.0  # one channel of one pixel fully wrong: MSE = 1 / (16*20*3)
    assert psnr(a, c) == pytest.approx(10 * math.log10(16 * 20 * 3), rel=1e-12)
    with pytest.raises(ValueError, match="shapes differ"):
        psnr(a, torch.zeros(8, 8, 3))


def test_ssim_identity_monotone_and_close_to_skimage():
    skm = pytest.importorskip("skimage.metrics")
    g = torch.Generator().manual_seed(0)
    base = torch.nn.functional.avg_pool2d(torch.rand(1, 3, 136, 168, generator=g), 5, 1)  # smooth-ish texture
    base = base[..., :128, :160]
    assert ssim(base, base) == pytest.approx(1.0, abs=1e-6)
    noisy1 = (base + 0.02 * torch.randn(base.shape, generator=g)).clamp(0, 1)
    noisy2 = (base + 0.08 * torch.randn(base.shape, generator=g)).clamp(0, 1)
    s1, s2 = ssim(base, noisy1), ssim(base, noisy2)
    assert 1.0 > s1 > s2 > 0.0
    # Independent reference with scipy: the same definition written out per channel (Gaussian sigma 1.5 truncated
    # at radius 5 = 11 taps, zero "same" padding as the 3DGS code, C1 = 0.01^2, C2 = 0.03^2), mean of the map.
    from scipy.ndimage import gaussian_filter

    def blur(im):
        return gaussian_filter(im, 1.5, mode="constant", cval=0.0, truncate=5 / 1.5)

    x, y = base[0].double().numpy(), noisy2[0].double().numpy()
    vals = []
    for c in range(3):
        mx, my = blur(x[c]), blur(y[c])
        vx, vy, cxy = blur(x[c] ** 2) - mx ** 2, blur(y[c] ** 2) - my ** 2, blur(x[c] * y[c]) - mx * my
        c1, c2 = 0.01 ** 2, 0.03 ** 2
        vals.append(((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx ** 2 + my ** 2 + c1) * (vx + vy + c2)))
    assert s2 == pytest.approx(float(np.mean(vals)), abs=2e-4)
    # skimage (same window, but it drops a 5-pixel border instead of zero-padding): same ballpark only
    ref = skm.structural_similarity(x.transpose(1, 2, 0), y.transpose(1, 2, 0), gaussian_weights=True, sigma=1.5,
                                    use_sample_covariance=False, data_range=1.0, channel_axis=2)
    assert s2 == pytest.approx(ref, abs=0.08)


def test_quantize_8bit():
    x = torch.tensor([-0.1, 0.0, 0.5, 0.50196, 1.2])
    np.testing.assert_allclose(quantize_8bit(x).numpy(), [0, 0, 128 / 255, 128 / 255, 1.0], atol=1e-7)
