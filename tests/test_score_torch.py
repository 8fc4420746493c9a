"""The removal cost in plain torch (``splatflow/render/score_torch.py``, what a GPU run scores with) against the
CPU kernels' (``splatflow.render.removal_loss``), on the CPU: same renders, same per-Gaussian costs.

The scene is dense enough that pixels stop early (transmittance below 1e-4), lists are long, partial tiles exist
(70 x 45 px) and some Gaussians are clamped at alpha 0.999: the cases where a re-derivation of the kernels' walk
would go wrong.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from splatflow.render import removal_loss
from splatflow.render.score_torch import removal_loss_torch

W, H = 70, 45
N = 1500


def _scene(seed: int = 0, n: int = N):
    g = torch.Generator().manual_seed(seed)
    means = torch.rand(n, 3, generator=g) * torch.tensor([3.0, 2.0, 4.0]) + torch.tensor([-1.5, -1.0, 2.0])
    quats = torch.randn(n, 4, generator=g)
    scales = torch.exp(torch.randn(n, 3, generator=g) * 0.5 + math.log(0.06))
    opacities = torch.sigmoid(torch.randn(n, generator=g) * 2.5 + 1.0)
    opacities[:40] = 1.0  # clamped at ALPHA_MAX at their centres
    sh0 = torch.randn(n, 1, 3, generator=g) * 0.8
    shN = torch.randn(n, 8, 3, generator=g) * 0.2  # degree 2
    K = torch.tensor([[60.0, 0.0, 35.0], [0.0, 60.0, 22.5], [0.0, 0.0, 1.0]])
    views = []
    for ang in (-0.08, 0.0, 0.11):
        c, s = math.cos(ang), math.sin(ang)
        vm = torch.eye(4)
        vm[:3, :3] = torch.tensor([[c, 0.0, s], [0.0, 1.0, 0.0], [-s, 0.0, c]])
        vm[0, 3] = 0.2 * ang
        views.append(vm)
    viewmats = torch.stack(views)  # [3, 4, 4]
    Ks = K[None].expand(3, 3, 3).contiguous()  # [3, 3, 3]
    target = torch.rand(3, H, W, 3, generator=g)
    return (means, quats, scales, opacities, (sh0, shN), viewmats, Ks), target


def _close(ours: torch.Tensor, ref: torch.Tensor, rel: float) -> None:
    """Equal up to float32 rounding relative to the largest cost (sums of many float32 terms on both sides)."""
    scale = float(ref.abs().max())
    err = float((ours - ref).abs().max())
    assert err <= rel * scale, f"max difference {err:.3g} against a largest cost of {scale:.3g}"


@pytest.mark.parametrize("with_target", [True, False])
def test_torch_removal_cost_equals_the_cpu_kernels(with_target):
    args, target = _scene()
    tgt = target if with_target else None
    img_cpu, inc_cpu = removal_loss(*args, W, H, sh_degree=2, target=tgt)
    img_t, inc_t = removal_loss_torch(*args, W, H, sh_degree=2, target=tgt, chunk_elems=1 << 16)  # many chunks
    assert inc_t.dtype == torch.float64 and inc_t.shape == inc_cpu.shape == (3, N)
    torch.testing.assert_close(img_t, img_cpu, rtol=0, atol=2e-5)
    assert float(inc_cpu.abs().max()) > 1.0 and (inc_cpu != 0).sum() > N  # a scene where the costs mean something
    if with_target:
        assert (inc_cpu < 0).any()  # against random targets some removals help
    else:
        assert (inc_cpu >= -1e-6).all()  # against the render itself removing anything costs
    _close(inc_t, inc_cpu, 2e-5)
    # every Gaussian in the same place of the ranking prune uses, but for near-ties
    order_cpu = torch.argsort(inc_cpu.sum(0), stable=True)
    order_t = torch.argsort(inc_t.sum(0), stable=True)
    assert (order_cpu == order_t).float().mean() > 0.95


def test_torch_removal_cost_does_not_depend_on_the_chunking():
    args, target = _scene(seed=3, n=600)
    _, small = removal_loss_torch(*args, W, H, sh_degree=2, target=target, chunk_elems=1)  # one tile a chunk
    _, large = removal_loss_torch(*args, W, H, sh_degree=2, target=target, chunk_elems=1 << 30)  # one chunk
    _close(small, large, 1e-6)  # float32 partial sums regroup with the chunks: a few 1e-7 of the largest cost


def test_render_removal_loss_dispatches_to_torch_off_the_cpu():
    """``removal_loss(..., backend="torch")`` is the path every non-CPU tensor takes (a GPU run's splats)."""
    args, target = _scene(seed=5, n=300)
    _, via = removal_loss(*args, W, H, sh_degree=2, target=target, backend="torch")
    _, direct = removal_loss_torch(*args, W, H, sh_degree=2, target=target)
    assert torch.equal(via, direct)
    with pytest.raises(ValueError, match="backend"):
        removal_loss(*args, W, H, sh_degree=2, target=target, backend="gpu")


def test_torch_removal_cost_allocates_on_its_inputs_device_only():
    """With torch's default device set to ``meta``, any tensor made without ``device=`` would land there and mix
    with the CPU inputs: the GPU scorer would crash the same way with a forgotten ``device=`` on CUDA."""
    args, target = _scene(seed=7, n=300)
    _, ref = removal_loss_torch(*args, W, H, sh_degree=2, target=target)
    torch.set_default_device("meta")
    try:
        img, inc = removal_loss_torch(*args, W, H, sh_degree=2, target=target)
    finally:
        torch.set_default_device(None)
    assert img.device.type == "cpu" and inc.device.type == "cpu"
    assert torch.equal(inc, ref)


def test_prune_scores_a_model_on_its_own_device():
    """``prune.removal_scores`` keeps the model where it is and scores it there: CPU splats on the CPU kernels
    (unchanged results), the torch scorer wherever else (checked on the CPU through the same function)."""
    from splatflow.compress import prune
    from splatflow.gaussians.model import Splats

    (means, quats, scales, opac, (sh0, shN), viewmats, Ks), target = _scene(seed=9, n=400)
    splats = Splats(means, quats, torch.log(scales), torch.logit(opac.clamp(1e-4, 1 - 1e-4)), sh0, shN)
    cams = [prune.Camera(viewmats[i].double().numpy(), Ks[i].double().numpy(), W, H) for i in range(3)]
    targets = [target[i] for i in range(3)]
    cpu = prune.removal_scores(splats, 2, cams, targets)
    assert cpu.device.type == "cpu" and cpu.dtype == torch.float64
    a = splats.activated(2, sh_pair=True)
    total = torch.zeros(400, dtype=torch.float64)
    for i, cam in enumerate(cams):
        _, inc = removal_loss(a.means, a.quats, a.scales, a.opacities, a.colors,
                              torch.as_tensor(cam.world_to_cam, dtype=torch.float32)[None],
                              torch.as_tensor(cam.K, dtype=torch.float32)[None], W, H, sh_degree=2,
                              target=targets[i][None], backend="torch")
        total += inc[0]
    _close(total, cpu, 2e-5)
    assert np.isfinite(cpu.numpy()).all()


@pytest.mark.cuda
def test_cuda_removal_cost_equals_the_cpu_kernels_and_a_cut_is_fast():
    """On a GPU: the torch scorer on CUDA tensors against the CPU kernels, and the time of one scoring pass of a
    prune cut's size (16 views of 800x600, 100K Gaussians), printed for bench/RESULTS.md (beside the Triton
    kernel's, ``tests/test_score_triton.py``)."""
    args, target = _scene()
    _, ref = removal_loss(*args, W, H, sh_degree=2, target=target)
    dev = torch.device("cuda")
    moved = [a.to(dev) if isinstance(a, torch.Tensor) else tuple(t.to(dev) for t in a) for a in args]
    _, inc = removal_loss(*moved, W, H, sh_degree=2, target=target.to(dev), backend="torch")
    assert inc.device.type == "cuda"
    _close(inc.cpu(), ref, 2e-5)

    secs = time_cut(*cut_scene(dev), "torch")
    print(f"removal cost on {torch.cuda.get_device_name()}, torch path: 16 views 800x600, 100K Gaussians: "
          f"{secs:.3f} s")


def cut_scene(dev, n: int = 100_000):
    """One scoring pass's inputs at a prune cut's size: ``n`` Gaussians seen by one 800x600 view with a target, on
    ``dev`` (the CUDA tests time 16 such passes, the views of a cut)."""
    (means, quats, scales, opac, (sh0, shN), _, _), _ = _scene(seed=11, n=n)
    K = torch.tensor([[700.0, 0.0, 400.0], [0.0, 700.0, 300.0], [0.0, 0.0, 1.0]], device=dev)
    big = [t.to(dev) for t in (means, quats, scales * 0.5, opac)]
    return (*big, (sh0.to(dev), shN.to(dev)), torch.eye(4, device=dev)[None], K[None]), torch.rand(1, 600, 800, 3,
                                                                                                   device=dev)


def time_cut(args, tgt, backend: str, views: int = 16, kernel: str | None = None) -> float:
    """Seconds of ``views`` scoring passes of a ``cut_scene`` (on a GPU) with ``backend`` (or the Triton
    ``kernel`` named), after one untimed pass."""
    import time

    def score():
        if kernel is None:
            return removal_loss(*args, 800, 600, sh_degree=2, target=tgt, backend=backend)
        from splatflow.render.score_triton import removal_loss_triton

        return removal_loss_triton(*args, 800, 600, sh_degree=2, target=tgt, kernel=kernel)

    score()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(views):
        score()
    torch.cuda.synchronize()
    return time.perf_counter() - t0
