"""The fused L1 + SSIM loss of a GPU run (``splatflow/render/ssim_triton.py``) against the torch path it replaces
(``splatflow.render.ssim``: ``|x - y|.mean()`` and the separable SSIM with its analytic backward), to 1e-6.

No GPU here: Triton's interpreter (``TRITON_INTERPRET=1``) runs the kernels on CPU tensors, in a fresh process
(Triton reads the variable when it is imported). Skipped without Triton (``pip install triton``; torch's CUDA
builds ship it).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests._triton import needs_triton

ROOT = Path(__file__).resolve().parents[1]

pytestmark = needs_triton


def _run(body: str) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT), OMP_WAIT_POLICY="PASSIVE")
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(body)], capture_output=True, text=True, env=env,
                       timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


def test_fused_loss_equals_the_torch_loss_value_and_gradient():
    """Sizes that are not multiples of the 128-column block or of the 11-tap window, two images in a batch, the
    render's gradient through both terms with different incoming weights (the loss's (1 - l) L1 + l (1 - SSIM))."""
    _run("""
        import torch
        from splatflow.render.ssim import _SSIM
        from splatflow.render.ssim_triton import fused_l1_ssim, available

        assert available(torch.device("cpu"))
        g = torch.Generator().manual_seed(0)
        for shape in [(1, 3, 23, 133), (2, 3, 9, 13)]:  # small: Triton's interpreter runs each program in Python
            y = torch.rand(*shape, generator=g)
            x0 = (y + 0.15 * torch.randn(*shape, generator=g)).clamp(0, 1)
            x0[..., :3, :5] = y[..., :3, :5]  # equal pixels: |x - y| has gradient 0 there, as torch's abs
            xa = x0.clone().requires_grad_(True)
            xb = x0.clone().requires_grad_(True)
            l1a, sa = fused_l1_ssim(xa, y)
            l1b, sb = (xb - y).abs().mean(), _SSIM.apply(xb, y)
            torch.testing.assert_close(l1a, l1b, rtol=0, atol=1e-6)
            torch.testing.assert_close(sa, sb, rtol=0, atol=1e-6)
            (0.8 * l1a + 0.2 * (1 - sa)).backward()
            (0.8 * l1b + 0.2 * (1 - sb)).backward()
            scale = float(xb.grad.abs().max())
            err = float((xa.grad - xb.grad).abs().max())
            assert err <= 1e-6 * max(scale, 1.0), (shape, err, scale)
            assert float(sa) < 0.99 and scale > 0
    """)


def test_fused_loss_with_one_term_unused_and_the_training_dispatch():
    """Only SSIM differentiated (the L1 output's gradient is None); and ``l1_ssim`` hands non-CPU float32
    tensors with a gradient-free target to the kernels, the rest to torch."""
    _run("""
        import torch
        from splatflow.render import ssim_triton
        from splatflow.render.ssim import _SSIM, l1_ssim

        g = torch.Generator().manual_seed(1)
        y = torch.rand(1, 3, 20, 30, generator=g)
        x = torch.rand(1, 3, 20, 30, generator=g, requires_grad=True)
        _, s = ssim_triton.fused_l1_ssim(x, y)
        s.backward()
        xr = x.detach().clone().requires_grad_(True)
        _SSIM.apply(xr, y).backward()
        torch.testing.assert_close(x.grad, xr.grad, rtol=0, atol=1e-6 * float(xr.grad.abs().max()) + 1e-12)
        # l1_ssim on CPU tensors keeps the numba kernels whatever Triton says (the CPU path is unchanged)
        calls = []
        orig = ssim_triton.fused_l1_ssim
        ssim_triton.fused_l1_ssim = lambda a, b: calls.append(1) or orig(a, b)
        l1_ssim(x, y)
        assert calls == []
    """)


@pytest.mark.cuda
def test_cuda_fused_loss_equals_the_torch_loss(monkeypatch):
    """On a GPU, compiled, through ``l1_ssim`` (the training loss's call): value and gradient as the torch path."""
    import torch

    monkeypatch.setenv("SPLATFLOW_TRITON", "1")  # opt-in until this test has passed on a GPU

    from splatflow.render.ssim import _SSIM, l1_ssim

    g = torch.Generator().manual_seed(2)
    y = torch.rand(1, 3, 600, 800, generator=g).cuda()
    x0 = (y + 0.1 * torch.randn(1, 3, 600, 800, generator=g).cuda()).clamp(0, 1)
    xa, xb = x0.clone().requires_grad_(True), x0.clone().requires_grad_(True)
    l1a, sa = l1_ssim(xa, y)
    l1b, sb = (xb - y).abs().mean(), _SSIM.apply(xb, y)
    torch.testing.assert_close(l1a, l1b, rtol=0, atol=1e-6)
    torch.testing.assert_close(sa, sb, rtol=0, atol=1e-6)
    (0.8 * l1a + 0.2 * (1 - sa)).backward()
    (0.8 * l1b + 0.2 * (1 - sb)).backward()
    assert float((xa.grad - xb.grad).abs().max()) <= 1e-6 * float(xb.grad.abs().max())
