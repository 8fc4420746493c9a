"""The removal cost in one Triton kernel per view (``splatflow/render/score_triton.py``, what a GPU run scores
with when Triton is enabled) against the CPU kernels' (``splatflow.render.removal_loss(backend="cpu")``): same
renders, same per-Gaussian costs.

No GPU here: Triton's interpreter (``TRITON_INTERPRET=1``) runs the kernel on CPU tensors, in a fresh process
(Triton reads the variable when it is imported). The interpreter runs each program in Python, so the scenes are
tiny: one view, a few hundred Gaussians. Skipped without Triton (``pip install triton``; torch's CUDA builds ship
it).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests._triton import needs_triton

ROOT = Path(__file__).resolve().parents[1]

pytestmark = needs_triton


def _scene(n: int, W: int, H: int, scale: float, seed: int = 0):
    """One view of ``n`` Gaussians spread over the whole image (SH degree 1), a tenth at opacity 1 (alpha clamped at
    ALPHA_MAX at their centres), and a random target. Returns ``(args, target)`` for ``removal_loss``."""
    g = torch.Generator().manual_seed(seed)
    means = torch.rand(n, 3, generator=g) * torch.tensor([3.0, 2.0, 2.0]) + torch.tensor([-1.5, -1.0, 3.0])
    quats = torch.randn(n, 4, generator=g)
    scales = torch.exp(torch.randn(n, 3, generator=g) * 0.3 + math.log(scale))
    opacities = torch.sigmoid(torch.randn(n, generator=g) * 2.5 + 1.0)
    opacities[: n // 10] = 1.0
    sh0 = torch.randn(n, 1, 3, generator=g) * 0.8
    shN = torch.randn(n, 3, 3, generator=g) * 0.2
    K = torch.tensor([[1.3 * W, 0.0, W / 2], [0.0, 1.3 * W, H / 2], [0.0, 0.0, 1.0]])
    viewmats = torch.eye(4)[None]
    target = torch.rand(1, H, W, 3, generator=g)
    return (means, quats, scales, opacities, (sh0, shN), viewmats, K[None]), target


def _close(ours: torch.Tensor, ref: torch.Tensor, rel: float) -> None:
    """Equal up to float32 rounding relative to the largest cost (sums of many float32 terms on both sides)."""
    scale = float(ref.abs().max())
    err = float((ours - ref).abs().max())
    assert err <= rel * scale, f"max difference {err:.3g} against a largest cost of {scale:.3g}"


def _triton_interpreted(tmp_path: Path, args, W: int, H: int, sh_degree: int, target, kernel: str = "walk"):
    """``removal_loss(..., backend="triton")`` in a fresh process under Triton's interpreter (with ``kernel``
    "scan", :func:`~splatflow.render.score_triton.removal_loss_triton`'s other kernel): the inputs and the results
    travel through files (the CPU kernels' reference is computed here, where their compiled cache is loaded once
    for the whole run)."""
    src, dst = tmp_path / "inputs.pt", tmp_path / "outputs.pt"
    torch.save({"args": args, "target": target}, src)
    call = "removal_loss(*d['args'], {W}, {H}, sh_degree={sh}, target=d['target'], backend='triton')" \
        if kernel == "walk" else \
        "removal_loss_triton(*d['args'], {W}, {H}, sh_degree={sh}, target=d['target'], kernel={kernel!r})"
    body = f"""
        import torch
        from splatflow.render import removal_loss
        from splatflow.render.score_triton import removal_loss_triton

        d = torch.load({str(src)!r})
        out = {call.format(W=W, H=H, sh=sh_degree, kernel=kernel)}
        torch.save(out, {str(dst)!r})
    """
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT), OMP_WAIT_POLICY="PASSIVE")
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(body)], capture_output=True, text=True, env=env,
                       timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    return torch.load(dst)


@pytest.mark.parametrize("kernel", ["walk", "scan"])
@pytest.mark.parametrize("with_target", [True, False])
def test_triton_removal_cost_equals_the_cpu_kernels(with_target, kernel, tmp_path):
    """A 64x48 view of 120 Gaussians, against a random target and against the render itself, through
    ``removal_loss``'s ``backend="triton"`` (the walk) and through the scan kernel."""
    from splatflow.render import removal_loss

    args, target = _scene(120, 64, 48, 0.08, seed=1)
    tgt = target if with_target else None
    img_c, inc_c = removal_loss(*args, 64, 48, sh_degree=1, target=tgt, backend="cpu")
    img_t, inc_t = _triton_interpreted(tmp_path, args, 64, 48, 1, tgt, kernel)
    assert inc_t.dtype == torch.float64 and inc_t.shape == inc_c.shape == (1, 120)
    assert img_t.shape == img_c.shape == (1, 48, 64, 3)
    torch.testing.assert_close(img_t, img_c, rtol=0, atol=2e-5)
    assert float(inc_c.abs().max()) > 0.1 and (inc_c != 0).sum() > 60  # most Gaussians cost something
    if tgt is None:
        assert (inc_c >= -1e-6).all()
    else:
        assert (inc_c < 0).any()
    _close(inc_t, inc_c, 2e-5)


@pytest.mark.parametrize("kernel", ["walk", "scan"])
def test_triton_removal_cost_where_pixels_stop_and_tiles_are_partial(kernel, tmp_path):
    """Large, overlapping Gaussians on a 40x24 view (partial tiles on the right and at the bottom): many pixels reach
    the transmittance floor, so the walk stops there (and the whole tile's walk ends early), within a block of the
    scan kernel as well as at its edge."""
    from splatflow.render import removal_loss
    from splatflow.render.constants import ALPHA_MAX, ALPHA_MIN, T_MIN
    from splatflow.render.projection import project_gaussians

    W, H = 40, 24
    args, target = _scene(150, W, H, 0.3, seed=2)
    # the transmittance each pixel would reach without the stop: at or below T_MIN where the stop is taken
    p = project_gaussians(*args[:4], args[5], args[6], W, H, antialiased=False, radius_clip=0.0)
    ys, xs = torch.meshgrid(torch.arange(H) + 0.5, torch.arange(W) + 0.5, indexing="ij")
    d = p["means2d"][0][:, None, :] - torch.stack([xs, ys], -1).reshape(1, -1, 2)  # [N, P, 2]
    con = p["conics"][0][:, None, :]
    sigma = 0.5 * (con[..., 0] * d[..., 0] ** 2 + con[..., 2] * d[..., 1] ** 2) + con[..., 1] * d[..., 0] * d[..., 1]
    a = torch.clamp(p["opacities"][0][:, None] * torch.exp(-sigma), max=ALPHA_MAX)
    a = torch.where(p["valid"][0][:, None] & (sigma >= 0) & (a >= ALPHA_MIN), a, 0.0)
    stopped = torch.prod(1.0 - a.double(), dim=0) <= T_MIN
    assert stopped.float().mean() > 0.3, float(stopped.float().mean())
    img_c, inc_c = removal_loss(*args, W, H, sh_degree=1, target=target, backend="cpu")
    img_t, inc_t = _triton_interpreted(tmp_path, args, W, H, 1, target, kernel)
    torch.testing.assert_close(img_t, img_c, rtol=0, atol=2e-5)
    assert (inc_c != 0).sum() > 50
    _close(inc_t, inc_c, 2e-5)


def test_triton_removal_cost_rejects_what_it_cannot_score():
    """float64 Gaussians, a target of the wrong shape and an unknown kernel: one-line errors naming the input and the
    fix."""
    from splatflow.render import removal_loss

    args, target = _scene(20, 32, 16, 0.1)
    with pytest.raises(ValueError, match="float32"):
        removal_loss(*[a.double() if isinstance(a, torch.Tensor) else a for a in args], 32, 16, sh_degree=1,
                     backend="triton")
    with pytest.raises(ValueError, match=r"target must have shape \(1, 16, 32, 3\)"):
        removal_loss(*args, 32, 16, sh_degree=1, target=target[:, :8], backend="triton")
    from splatflow.render.score_triton import removal_loss_triton

    with pytest.raises(ValueError, match=r"one of \('walk', 'scan'\), got 'fast'"):
        removal_loss_triton(*args, 32, 16, sh_degree=1, kernel="fast")


@pytest.mark.cuda
def test_cuda_triton_removal_cost_equals_the_cpu_kernels_and_a_cut_is_fast():
    """On a GPU: the compiled kernel on CUDA tensors against the CPU kernels (three views of 70x45 with pixels that
    stop early and partial tiles), and the time of one scoring pass of a prune cut's size (16 views of 800x600,
    100K Gaussians), printed for bench/RESULTS.md (``tests/test_score_torch.py`` prints the torch path's)."""
    from splatflow.render import removal_loss
    from tests.test_score_torch import cut_scene, time_cut

    _check_on_cuda("walk")
    big, tgt = cut_scene(torch.device("cuda"))
    _, inc_t = removal_loss(*big, 800, 600, sh_degree=2, target=tgt, backend="triton")
    _, inc_r = removal_loss(*big, 800, 600, sh_degree=2, target=tgt, backend="torch")
    _close(inc_t.cpu(), inc_r.cpu(), 2e-5)  # the cut's scene too: the same score as the torch path
    secs = time_cut(big, tgt, "triton")
    print(f"removal cost on {torch.cuda.get_device_name()}: 16 views 800x600, 100K Gaussians: {secs:.3f} s")


@pytest.mark.cuda
def test_cuda_scan_kernel_equals_the_cpu_kernels_and_its_cut_time():
    """The scan kernel (``kernel="scan"``), checked and timed as the walk above; a test of its own, so that
    ``bench/gpu_check.sh`` keeps the other Triton kernels on when only this one fails."""
    from splatflow.render import removal_loss
    from splatflow.render.score_triton import removal_loss_triton
    from tests.test_score_torch import cut_scene, time_cut

    _check_on_cuda("scan")
    big, tgt = cut_scene(torch.device("cuda"))
    _, inc_r = removal_loss(*big, 800, 600, sh_degree=2, target=tgt, backend="torch")
    _, inc_s = removal_loss_triton(*big, 800, 600, sh_degree=2, target=tgt, kernel="scan")
    _close(inc_s.cpu(), inc_r.cpu(), 2e-5)
    secs = time_cut(big, tgt, "triton", kernel="scan")
    print(f"removal cost on {torch.cuda.get_device_name()}, scan kernel: 16 views 800x600, 100K Gaussians: "
          f"{secs:.3f} s")


def _check_on_cuda(kernel: str) -> None:
    """``kernel`` on CUDA tensors against the CPU kernels: three views of 70x45 with pixels that stop early and
    partial tiles, with a target and against the render itself."""
    from splatflow.render import removal_loss
    from splatflow.render.score_triton import removal_loss_triton
    from tests.test_score_torch import W, H, _scene as _scene3

    dev = torch.device("cuda")
    args, target = _scene3()
    moved = [a.to(dev) if isinstance(a, torch.Tensor) else tuple(t.to(dev) for t in a) for a in args]
    for tgt in (target, None):
        img_c, ref = removal_loss(*args, W, H, sh_degree=2, target=tgt, backend="cpu")
        img, inc = removal_loss_triton(*moved, W, H, sh_degree=2, target=None if tgt is None else tgt.to(dev),
                                       kernel=kernel)
        assert inc.device.type == "cuda" and inc.dtype == torch.float64
        torch.testing.assert_close(img.cpu(), img_c, rtol=0, atol=2e-5)
        _close(inc.cpu(), ref, 2e-5)
