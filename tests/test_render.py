"""The rendering engine: CPU backend vs the torch oracle (values and gradients), edge cases, gradcheck, stats,
gsplat's DefaultStrategy on top of our info, projection and SH vs gsplat's own PyTorch reference, backends."""

from __future__ import annotations

import math

import pytest
import torch

from splatflow.render import CudaUnavailableError, configure_threads, rasterize, resolve_backend

PARAMS = ("means", "quats", "scales", "opacities", "colors")


def make_scene(N=160, C=2, W=64, H=48, sh_degree=3, seed=0, dtype=torch.float32):
    """Random Gaussians in a unit cube 3 units in front of C cameras spread by 0.3 rad around it."""
    g = torch.Generator().manual_seed(seed)
    means = (torch.rand(N, 3, generator=g, dtype=dtype) - 0.5) * 2.0
    quats = torch.randn(N, 4, generator=g, dtype=dtype)
    scales = torch.exp(torch.randn(N, 3, generator=g, dtype=dtype) * 0.5 - 2.5)
    opac = torch.rand(N, generator=g, dtype=dtype)
    if sh_degree is None:
        colors = torch.rand(N, 3, generator=g, dtype=dtype)
    else:
        colors = torch.randn(N, (sh_degree + 1) ** 2, 3, generator=g, dtype=dtype) * 0.3
    views = []
    for c in range(C):
        ang = 0.3 * c
        v = torch.eye(4, dtype=dtype)
        v[:3, :3] = torch.tensor(
            [[math.cos(ang), 0, -math.sin(ang)], [0, 1, 0], [math.sin(ang), 0, math.cos(ang)]], dtype=dtype
        )
        v[:3, 3] = torch.tensor([0.1 * c, -0.05 * c, 3.0], dtype=dtype)
        views.append(v)
    f = 0.8 * W
    Ks = torch.tensor([[f, 0, W / 2], [0, f * 1.1, H / 2 + 1], [0, 0, 1]], dtype=dtype).expand(C, 3, 3).contiguous()
    return dict(means=means, quats=quats, scales=scales, opacities=opac, colors=colors,
                viewmats=torch.stack(views), Ks=Ks, width=W, height=H, sh_degree=sh_degree)


def edge_case_scene(dtype=torch.float32):
    """One camera at the origin looking down +z; one Gaussian per edge case the issue lists."""
    rows = [  # mean, scales, opacity
        ((0.0, 0.0, -2.0), (0.1, 0.1, 0.1), 0.9),  # behind the camera
        ((0.0, 0.0, 0.005), (0.01, 0.01, 0.01), 0.9),  # in front but nearer than near_plane
        ((40.0, 0.0, 3.0), (0.1, 0.1, 0.1), 0.9),  # far off screen
        ((-1.2, 0.3, 3.0), (0.15, 0.1, 0.1), 0.8),  # straddling the left border
        ((0.2, 0.88, 3.0), (0.08, 0.12, 0.1), 0.7),  # straddling the bottom border
        ((0.0, 0.0, 6.0), (3.0, 2.0, 1.0), 0.3),  # huge (covers the whole image)
        ((0.3, -0.2, 2.5), (1e-4, 1e-4, 1e-4), 0.9),  # tiny (sub-pixel: the 0.3 px^2 blur dominates)
        ((-0.3, -0.3, 2.5), (0.2, 0.0, 0.1), 0.8),  # degenerate: one zero scale (a flat disc)
        ((0.4, 0.3, 2.0), (0.0, 0.0, 0.0), 0.8),  # degenerate: all scales zero (a point)
        ((0.1, 0.1, 2.0), (0.1, 0.1, 0.1), 0.0),  # zero opacity
        ((0.05, -0.05, 2.2), (0.12, 0.05, 0.08), 0.95),  # ordinary, overlapping others
    ]
    g = torch.Generator().manual_seed(3)
    N = len(rows)
    means = torch.tensor([r[0] for r in rows], dtype=dtype)
    scales = torch.tensor([r[1] for r in rows], dtype=dtype)
    opac = torch.tensor([r[2] for r in rows], dtype=dtype)
    quats = torch.randn(N, 4, generator=g, dtype=dtype)
    colors = torch.randn(N, 4, 3, generator=g, dtype=dtype) * 0.3
    W, H = 48, 40
    Ks = torch.tensor([[[40.0, 0, 24.0], [0, 40.0, 20.0], [0, 0, 1]]], dtype=dtype)
    return dict(means=means, quats=quats, scales=scales, opacities=opac, colors=colors,
                viewmats=torch.eye(4, dtype=dtype)[None], Ks=Ks, width=W, height=H, sh_degree=1)


def render(scene, backend, *, grad=True, weights_seed=1, **kw):
    """Render with ``backend``; with ``grad`` backprop a fixed random weighting of colour and alpha and return
    the parameter gradients and the means2d gradient too."""
    p = {k: scene[k].clone().requires_grad_(grad) for k in PARAMS}
    img, alpha, info = rasterize(p["means"], p["quats"], p["scales"], p["opacities"], p["colors"], scene["viewmats"],
                                 scene["Ks"], scene["width"], scene["height"], sh_degree=scene["sh_degree"],
                                 backend=backend, **kw)
    out = {"img": img.detach(), "alpha": alpha.detach(), "info": info}
    if grad:
        info["means2d"].retain_grad()
        g = torch.Generator().manual_seed(weights_seed)
        w_img = torch.randn(img.shape, generator=g, dtype=img.dtype).to(img.device)
        w_alpha = torch.randn(alpha.shape, generator=g, dtype=img.dtype).to(img.device)
        ((img * w_img).sum() + (alpha * w_alpha).sum()).backward()
        out["grads"] = {k: p[k].grad for k in PARAMS}
        out["means2d_grad"] = info["means2d"].grad
    return out


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()


def assert_close_to_oracle(scene, **kw):
    cpu = render(scene, "cpu", **kw)
    ref = render(scene, "torch", **kw)
    assert cpu["img"].shape == ref["img"].shape
    rgb_diff = (cpu["img"][..., :3] - ref["img"][..., :3]).abs().max().item()
    assert rgb_diff <= 1e-5, rgb_diff
    assert (cpu["alpha"] - ref["alpha"]).abs().max().item() <= 1e-5
    if cpu["img"].shape[-1] == 4:  # expected depth = accumulated depth / alpha: compare where alpha is not tiny
        m = ref["alpha"][..., 0] > 1e-2
        assert rel_err(cpu["img"][..., 3][m], ref["img"][..., 3][m]) <= 1e-5
    for k in PARAMS:
        assert ref["grads"][k].abs().max() > 0, f"oracle gradient of {k} is zero: the scene tests nothing"
        assert rel_err(cpu["grads"][k], ref["grads"][k]) <= 1e-4, k
    assert rel_err(cpu["means2d_grad"], ref["means2d_grad"]) <= 1e-4
    return cpu, ref


@pytest.mark.parametrize("sh_degree", [0, 1, 2, 3])
def test_cpu_matches_oracle_sh_degrees(sh_degree):
    assert_close_to_oracle(make_scene(sh_degree=sh_degree, seed=sh_degree))


@pytest.mark.parametrize("rasterize_mode", ["classic", "antialiased"])
@pytest.mark.parametrize("render_mode", ["RGB", "RGB+ED"])
def test_cpu_matches_oracle_modes(rasterize_mode, render_mode):
    scene = make_scene(N=220, C=3, sh_degree=2, seed=7)
    cpu, ref = assert_close_to_oracle(scene, rasterize_mode=rasterize_mode, render_mode=render_mode)
    assert cpu["img"].shape == (3, 48, 64, 4 if render_mode == "RGB+ED" else 3)


def test_cpu_matches_oracle_with_backgrounds_and_rgb_colors():
    scene = make_scene(N=120, C=2, sh_degree=None, seed=11)
    bg = torch.tensor([[0.2, 0.5, 0.9], [1.0, 0.0, 0.3]])
    assert_close_to_oracle(scene, backgrounds=bg)
    # background shows where nothing is drawn
    empty = dict(scene, means=scene["means"][:0], quats=scene["quats"][:0], scales=scene["scales"][:0],
                 opacities=scene["opacities"][:0], colors=scene["colors"][:0])
    out = render(empty, "cpu", grad=False, backgrounds=bg)
    assert torch.equal(out["img"], bg[:, None, None, :].expand(2, 48, 64, 3))


def test_edge_cases_match_oracle_and_are_culled():
    scene = edge_case_scene()
    for mode in ("classic", "antialiased"):
        cpu, ref = assert_close_to_oracle(scene, rasterize_mode=mode)
        radii = cpu["info"]["radii"][0]  # [N, 2]
        assert torch.equal(radii, ref["info"]["radii"][0])
        assert (radii[[0, 1, 2, 9]] == 0).all(), "behind / too near / off screen / zero opacity must be culled"
        if mode == "classic":
            assert (radii[[3, 4, 5, 6, 7, 8, 10]] > 0).all()
        else:  # the compensation sqrt(det / det_blurred) takes a point's and a sub-pixel speck's opacity to ~0
            assert (radii[[3, 4, 5, 7, 10]] > 0).all() and (radii[[6, 8]] == 0).all()
        for k in PARAMS:
            assert torch.isfinite(cpu["grads"][k]).all(), k
        assert (cpu["grads"]["means"][[0, 1, 2, 9]] == 0).all()
    # the huge Gaussian reaches every corner; the tiny one still has at least one pixel
    stats = render(scene, "cpu", grad=False, return_stats=True)["info"]
    assert stats["hit_count"][0, 5] == 48 * 40
    assert stats["hit_count"][0, 6] >= 1


def test_single_gaussian_and_empty_scene():
    scene = edge_case_scene()
    one = {k: (v[10:11] if k in PARAMS else v) for k, v in scene.items()}
    assert_close_to_oracle(one)
    empty = {k: (v[:0] if k in PARAMS else v) for k, v in scene.items()}
    for backend in ("cpu", "torch"):
        out = render(empty, backend, grad=False)
        assert out["img"].shape == (1, 40, 48, 3) and out["img"].abs().max() == 0
        assert out["alpha"].abs().max() == 0
    out = render(empty, "cpu")  # backward through an empty scene is fine too (a trainer may prune to zero)
    assert out["grads"]["means"].shape == (0, 3)


def test_gradcheck_float64_cpu_backend():
    """Finite differences through the whole CPU path (projection, SH, numba compositing) in float64."""
    scene = make_scene(N=6, C=2, W=20, H=16, sh_degree=1, seed=5, dtype=torch.float64)
    scene["scales"] = scene["scales"] * 3.0
    scene["opacities"] = scene["opacities"] * 0.6 + 0.2
    g = torch.Generator().manual_seed(9)
    w_img = torch.randn(2, 16, 20, 4, generator=g, dtype=torch.float64)
    w_alpha = torch.randn(2, 16, 20, 1, generator=g, dtype=torch.float64)

    def f(means, quats, scales, opacities, colors):
        img, alpha, _ = rasterize(means, quats, scales, opacities, colors, scene["viewmats"], scene["Ks"], 20, 16,
                                  sh_degree=1, backend="cpu", render_mode="RGB+ED", rasterize_mode="antialiased")
        return (img * w_img).sum() + (alpha * w_alpha).sum()

    inputs = tuple(scene[k].clone().requires_grad_() for k in PARAMS)
    assert f(*inputs).item() != 0
    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-5, rtol=1e-3)


def test_stats_match_oracle_and_add_up():
    scene = make_scene(N=200, C=2, sh_degree=0, seed=21)
    cpu = render(scene, "cpu", grad=False, return_stats=True)
    ref = render(scene, "torch", grad=False, return_stats=True)
    hits, wsum = cpu["info"]["hit_count"], cpu["info"]["weight_sum"]
    assert hits.shape == (2, 200) and wsum.shape == (2, 200)
    assert torch.equal(hits, ref["info"]["hit_count"])
    assert (wsum - ref["info"]["weight_sum"]).abs().max() <= 1e-4
    # alpha of a pixel is the sum of the weights alpha_i T_i of the Gaussians drawn there
    torch.testing.assert_close(wsum.sum(1), cpu["alpha"].sum(dim=(1, 2, 3)), rtol=1e-5, atol=1e-3)
    assert (hits[cpu["info"]["radii"].amax(-1) == 0] == 0).all()
    assert hits.sum() > 0


def test_absgrad_is_sum_of_per_pixel_abs_gradients():
    """info["means2d"].absgrad (DefaultStrategy(absgrad=True)) is sum_pixels |dL_pixel/dmean2d|."""
    scene = make_scene(N=4, C=1, W=12, H=10, sh_degree=None, seed=2)
    scene["scales"] = scene["scales"] * 4
    cpu = render(scene, "cpu", absgrad=True)
    absgrad = cpu["info"]["means2d"].absgrad  # [1, N, 2]
    g = torch.Generator().manual_seed(1)
    w_img = torch.randn(1, 10, 12, 3, generator=g)
    w_alpha = torch.randn(1, 10, 12, 1, generator=g)
    p = {k: scene[k].clone().requires_grad_() for k in PARAMS}
    img, alpha, info = rasterize(p["means"], p["quats"], p["scales"], p["opacities"], p["colors"], scene["viewmats"],
                                 scene["Ks"], 12, 10, backend="torch")
    m2 = info["means2d"]
    ref = torch.zeros_like(absgrad)
    for y in range(10):
        for x in range(12):
            lp = (img[0, y, x] * w_img[0, y, x]).sum() + alpha[0, y, x, 0] * w_alpha[0, y, x, 0]
            (gp,) = torch.autograd.grad(lp, m2, retain_graph=True)
            ref += gp.abs()
    assert ref.abs().max() > 0
    torch.testing.assert_close(absgrad, ref, rtol=1e-4, atol=1e-6)
    assert (absgrad >= cpu["means2d_grad"].abs() - 1e-6).all()


def test_projection_and_sh_match_gsplat_reference():
    """Our projection/SH against gsplat's own PyTorch implementation (an independent code path)."""
    from gsplat.cuda._torch_impl import _fully_fused_projection, _spherical_harmonics

    from splatflow.render.projection import eval_sh, project_gaussians, quat_scale_to_covar

    scene = make_scene(N=300, C=2, sh_degree=3, seed=4)
    covars = quat_scale_to_covar(scene["quats"], scene["scales"])
    for aa in (False, True):
        ours = project_gaussians(scene["means"], scene["quats"], scene["scales"], scene["opacities"],
                                 scene["viewmats"], scene["Ks"], 64, 48, antialiased=aa)
        radii, means2d, depths, conics, comp = _fully_fused_projection(
            scene["means"], covars, scene["viewmats"], scene["Ks"], 64, 48, calc_compensations=aa)
        v = ours["valid"]
        assert v.sum() > 100
        assert ((radii > 0).all(-1) | ~v).all(), "we cull a superset of what gsplat's 3-sigma reference culls"
        torch.testing.assert_close(ours["means2d"][v], means2d[v], rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(ours["depths"][v], depths[v])
        torch.testing.assert_close(ours["conics"][v], conics[v], rtol=1e-4, atol=1e-5)
        if aa:
            opac = scene["opacities"][None].expand(2, -1) * comp
            torch.testing.assert_close(ours["opacities"][v], opac[v], rtol=1e-5, atol=1e-6)
    dirs = torch.randn(50, 3)
    coeffs = torch.randn(50, 16, 3)
    for deg in range(4):
        torch.testing.assert_close(eval_sh(deg, dirs, coeffs), _spherical_harmonics(deg, dirs, coeffs),
                                   rtol=1e-5, atol=1e-5)


def test_default_strategy_grows_and_prunes_on_cpu():
    """gsplat's DefaultStrategy, unchanged, densifies from our info (means2d grads, radii, width, n_cameras)."""
    from gsplat.strategy import DefaultStrategy

    scene = make_scene(N=120, C=2, sh_degree=1, seed=8)
    N = 120
    logit_opac = torch.logit(scene["opacities"].clamp(0.05, 0.95))
    logit_opac[:10] = -10.0  # opacity 4.5e-5: below prune_opa
    splats = torch.nn.ParameterDict({
        "means": scene["means"], "quats": scene["quats"], "scales": torch.log(scene["scales"]),
        "opacities": logit_opac, "sh0": scene["colors"][:, :1].clone(), "shN": scene["colors"][:, 1:].clone(),
    })
    optimizers = {k: torch.optim.Adam([v], lr=1e-4) for k, v in splats.items()}
    strategy = DefaultStrategy(refine_start_iter=3, refine_every=4, reset_every=1000, grow_grad2d=1e-7,
                               grow_scale3d=0.05, prune_opa=0.005, verbose=False)
    strategy.check_sanity(splats, optimizers)
    state = strategy.initialize_state(scene_scale=1.0)
    target = torch.rand(2, 48, 64, 3, generator=torch.Generator().manual_seed(0))
    for step in range(5):
        colors = torch.cat([splats["sh0"], splats["shN"]], dim=1)
        img, _, info = rasterize(splats["means"], splats["quats"], torch.exp(splats["scales"]),
                                 torch.sigmoid(splats["opacities"]), colors, scene["viewmats"], scene["Ks"], 64, 48,
                                 sh_degree=1, backend="cpu")
        loss = (img - target).abs().mean()
        strategy.step_pre_backward(splats, optimizers, state, step, info)
        loss.backward()
        strategy.step_post_backward(splats, optimizers, state, step, info, packed=False)
        for opt in optimizers.values():
            opt.step()
            opt.zero_grad(set_to_none=True)
        if step == 3:
            assert splats["means"].shape[0] == N and state["count"].max() == 4 * 2  # 4 steps x 2 cameras
    # refinement at step 4: every visible Gaussian (grad2d above 1e-7) is duplicated or split, 10 are pruned
    assert splats["means"].shape[0] > N + 50, "visible Gaussians with gradients should have been duplicated or split"
    assert (torch.sigmoid(splats["opacities"]) > 0.005).all(), "near-transparent Gaussians should be pruned"
    assert state["grad2d"].shape[0] == splats["means"].shape[0]


def test_backend_resolution_and_cuda_error():
    assert resolve_backend("cpu") == "cpu" and resolve_backend("torch") == "torch"
    with pytest.raises(ValueError, match="backend must be one of"):
        resolve_backend("metal")
    if torch.cuda.is_available():
        assert resolve_backend("auto") == "cuda"
        return
    assert resolve_backend("auto") == "cpu"
    scene = make_scene(N=10, C=1)
    with pytest.raises(CudaUnavailableError, match="torch.cuda.is_available\\(\\) is False"):
        render(scene, "cuda", grad=False)


def test_configure_threads_sets_both_pools():
    import numba

    before = torch.get_num_threads()
    try:
        assert configure_threads(1) == 1
        assert torch.get_num_threads() == 1 and numba.get_num_threads() == 1
    finally:
        configure_threads(before)


@pytest.mark.cuda
def test_cpu_matches_cuda():
    scene = make_scene(N=300, C=2, sh_degree=3, seed=12)
    cpu = render(scene, "cpu")
    dev = {k: (v.cuda() if torch.is_tensor(v) else v) for k, v in scene.items()}
    gpu = render(dev, "cuda")
    assert (cpu["img"] - gpu["img"].cpu()).abs().max() <= 1e-4
    for k in PARAMS:
        assert rel_err(cpu["grads"][k], gpu["grads"][k].cpu()) <= 1e-3, k


@pytest.mark.parametrize("F, tol", [("float64", 1e-8), ("float32", 5e-6)])
def test_polynomial_exp_matches_libm_to_float32_precision(F, tol):
    """The kernels' exp(-s) (no libm call, no branch) is as accurate as a float32 exp over the whole range where
    alpha can reach 1/255 (in float64 lanes to 1e-8; in float32 lanes within a few float32 roundings), and beyond
    its clamp it stays below what any opacity needs to be drawn."""
    import numpy as np

    from splatflow.render._kernels import SIGMA_CLAMP, _exp
    from splatflow.render.constants import ALPHA_MIN

    F = getattr(np, F)
    s = np.concatenate([np.linspace(0.0, SIGMA_CLAMP, 40001), np.linspace(SIGMA_CLAMP, 85.0, 2001)]).astype(F)
    got = np.array([_exp(x, F) for x in s])
    want = np.exp(-s.astype(np.float64))
    inside = s <= SIGMA_CLAMP
    rel = np.abs(got[inside] - want[inside]) / want[inside]
    assert rel.max() < tol, rel.max()
    assert np.all(got[~inside] < ALPHA_MIN) and np.all(got[~inside] > 0.0)
    assert _exp(F(-1.0), F) == 1.0  # a negative sigma (not a valid conic there) is clamped, never above 1


@pytest.mark.parametrize("removal", [False, True])
def test_vectorised_rgb_backward_equals_the_general_kernel(removal):
    """The vectorised RGB backward (training, and pruning's removal columns) gives the per-Gaussian rows of the
    general per-pixel kernel (which serves other channel counts), backgrounds and a pixel-alpha gradient included."""
    import numba
    import numpy as np

    from splatflow.render import _kernels as K
    from splatflow.render.cpu import _binned, project_cpu
    from splatflow.render.projection import tile_grid

    sc = make_scene(N=300, C=2, W=70, H=50, dtype=torch.float64)
    with torch.no_grad():
        p = project_cpu(sc["means"], sc["quats"], sc["scales"], sc["opacities"], sc["colors"], sc["viewmats"],
                        sc["Ks"], sc["width"], sc["height"], near_plane=0.01, far_plane=1e10, eps2d=0.3,
                        antialiased=False, radius_clip=0.0, sh_degree=sc["sh_degree"])
    tx, ty = tile_grid(sc["width"], sc["height"])
    bg = torch.rand(2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    offsets, ids, m2, con, col, op, rad, bgn = _binned(p["means2d"], p["conics"], p["colors"], p["opacities"],
                                                       p["radii"], p["depths"], bg, tx, ty)
    n_par = numba.get_num_threads()
    out, T, last, _, _ = K.rasterize_fwd(offsets, ids, m2, con, col, op, rad, bgn, 2, sc["width"], sc["height"], tx,
                                         ty, False, n_par, np.float64)
    rng = np.random.default_rng(0)
    args = (offsets, ids, m2, con, col, op, rad, bgn, T, last, rng.standard_normal(out.shape),
            rng.standard_normal(T.shape), 2, sc["width"], sc["height"], tx, ty, n_par)
    general = K.rasterize_bwd(*args, removal)
    rgb = K.rasterize_bwd_rgb(*args, np.float64, True if removal else None)
    assert rgb.shape == general.shape == (2 * 300, 13 if removal else 11)
    assert np.abs(general).max() > 0
    np.testing.assert_allclose(rgb, general, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_tiles_a_splat_cannot_reach_are_left_out_with_identical_results(dtype):
    """Binning lists a splat only in the tiles of its radius rectangle where it can reach alpha >= 1/255: fewer
    list entries than the rectangle's tiles (elongated, tilted splats), and the same image, transmittance and
    gradients, bit for bit, as the rectangle lists (what the kernels got before)."""
    import numba
    import numpy as np

    from splatflow.render import _kernels as K
    from splatflow.render.cpu import _binned, project_cpu
    from splatflow.render.projection import tile_grid

    sc = make_scene(N=400, C=2, W=96, H=80, dtype=dtype)
    sc["scales"][:, 0] *= 6.0  # elongated: their rectangles hold many tiles they never reach
    with torch.no_grad():
        p = project_cpu(sc["means"], sc["quats"], sc["scales"], sc["opacities"], sc["colors"], sc["viewmats"],
                        sc["Ks"], sc["width"], sc["height"], near_plane=0.01, far_plane=1e10, eps2d=0.3,
                        antialiased=False, radius_clip=0.0, sh_degree=sc["sh_degree"])
    tx, ty = tile_grid(sc["width"], sc["height"])
    offsets, ids, m2, con, col, op, rad, bg = _binned(p["means2d"], p["conics"], p["colors"], p["opacities"],
                                                      p["radii"], p["depths"], None, tx, ty)
    G = m2.shape[0]
    vis = np.flatnonzero((rad[:, 0] > 0) & (rad[:, 1] > 0))
    order = vis[np.argsort(p["depths"].numpy().reshape(G)[vis], kind="stable")]
    # zero conics make the reach test pass everywhere: the radius-rectangle lists
    r_offsets, r_ids = K.bin_tiles(m2, rad, np.zeros_like(con), op, order, G // 2, 2, tx, ty)
    assert len(ids) < 0.9 * len(r_ids)
    n_par = numba.get_num_threads()
    F = np.float32 if dtype == torch.float32 else np.float64
    results = []
    for o, i in ((offsets, ids), (r_offsets, r_ids)):
        out, T, last, _, _ = K.rasterize_fwd(o, i, m2, con, col, op, rad, bg, 2, sc["width"], sc["height"], tx, ty,
                                             False, n_par, F)
        v_img = np.random.default_rng(1).standard_normal(out.shape)
        v_alpha = np.random.default_rng(2).standard_normal(T.shape)
        grads = K.rasterize_bwd_rgb(o, i, m2, con, col, op, rad, bg, T, last, v_img, v_alpha, 2, sc["width"],
                                    sc["height"], tx, ty, n_par, F, None)
        results.append((out, T, grads))
    assert np.abs(results[0][2]).max() > 0
    for a, b in zip(results[0], results[1]):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("sh_degree", [1, 3])
def test_sh_pair_renders_and_differentiates_like_joined_colors(backend, sh_degree):
    """Training passes SH as the model stores it, ``(sh0, shN)`` with all bands (``activated(sh_pair=True)``):
    the same image and the same gradients for every band as the joined ``[N, K, 3]`` of the active bands (the
    inactive bands get exactly zero), on the numba kernels and on the torch path that joins the pair."""
    from splatflow.render import rasterize

    sc = make_scene(N=120, C=2, sh_degree=3, dtype=torch.float64)
    sh0 = sc["colors"][:, :1].clone().requires_grad_(True)
    shN = sc["colors"][:, 1:].clone().requires_grad_(True)
    k = (sh_degree + 1) ** 2
    w = torch.randn(2, sc["height"], sc["width"], 3, dtype=torch.float64, generator=torch.Generator().manual_seed(3))

    def run(colors):
        img, _, _ = rasterize(sc["means"], sc["quats"], sc["scales"], sc["opacities"], colors, sc["viewmats"],
                              sc["Ks"], sc["width"], sc["height"], sh_degree=sh_degree, backend=backend)
        (img * w).sum().backward()
        return img.detach()

    img_pair = run((sh0, shN))
    g_pair = sh0.grad.clone(), shN.grad.clone()
    sh0.grad = shN.grad = None
    img_cat = run(torch.cat([sh0, shN[:, : k - 1]], dim=1))
    assert torch.allclose(img_pair, img_cat, atol=1e-12)
    assert torch.allclose(g_pair[0], sh0.grad, atol=1e-12)
    assert torch.allclose(g_pair[1], shN.grad, atol=1e-12)
    assert g_pair[1][:, : k - 1].abs().sum() > 0 and g_pair[1][:, k - 1:].abs().sum() == 0


def test_float32_compositing_follows_float64_on_deep_lists():
    """A float32 model composites in float32 (as gsplat does on the GPU): on a scene whose pixels see hundreds of
    overlapping splats (the deep lists of training, where float32 sums would drift first), the image, alpha and
    every gradient stay within float32 accuracy of the float64 compositing of the same model."""
    sc64 = make_scene(N=4000, C=2, W=64, H=48, sh_degree=3, seed=2, dtype=torch.float64)
    sc64["scales"] = sc64["scales"] * 2.5  # larger splats: deeper lists
    sc64["opacities"] = sc64["opacities"] * 0.3  # translucent: many contribute before a pixel saturates
    g = torch.Generator().manual_seed(1)
    w_img = torch.randn(2, 48, 64, 3, generator=g, dtype=torch.float64)
    w_alpha = torch.randn(2, 48, 64, 1, generator=g, dtype=torch.float64)

    def run(dtype):
        p = {k: sc64[k].to(dtype).clone().requires_grad_(True) for k in PARAMS}
        img, alpha, info = rasterize(p["means"], p["quats"], p["scales"], p["opacities"], p["colors"],
                                     sc64["viewmats"].to(dtype), sc64["Ks"].to(dtype), 64, 48, sh_degree=3,
                                     backend="cpu", return_stats=True)
        ((img * w_img.to(dtype)).sum() + (alpha * w_alpha.to(dtype)).sum()).backward()
        return img.detach().double(), alpha.detach().double(), {k: p[k].grad.double() for k in PARAMS}, info

    img64, alpha64, g64, info = run(torch.float64)
    img32, alpha32, g32, _ = run(torch.float32)
    assert float(info["hit_count"].double().sum()) / (2 * 64 * 48) > 100  # a pixel sees > 100 splats on average
    assert (img32 - img64).abs().max().item() <= 1e-5  # measured 8e-7
    assert (alpha32 - alpha64).abs().max().item() <= 1e-5
    for k in PARAMS:
        assert g64[k].abs().max() > 0, k
        # measured 0.8-1.5e-6 on a Zen 5 host (AVX-512), 2.5e-5 for the means on a Zen 3 host (AVX2): the float32
        # sums run in another order there; either is far below a broken float32 path (> 1e-2)
        assert rel_err(g32[k], g64[k]) <= 5e-5, k


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_window_render_is_the_window_of_the_whole_render(backend):
    """``window`` renders exactly the pixels of the whole view inside it, and its gradients equal those of the
    whole render with the loss restricted to the window (what patch training relies on)."""
    scene = make_scene(N=200, C=1, W=80, H=60, dtype=torch.float64)
    x0, y0, w, h = 17, 9, 40, 30
    g = torch.Generator().manual_seed(5)
    wts = torch.randn(1, h, w, 3, generator=g, dtype=torch.float64)

    def run(window):
        p = {k: scene[k].clone().requires_grad_(True) for k in PARAMS}
        img, alpha, info = rasterize(p["means"], p["quats"], p["scales"], p["opacities"], p["colors"],
                                     scene["viewmats"], scene["Ks"], scene["width"], scene["height"],
                                     sh_degree=scene["sh_degree"], backend=backend, window=window)
        part = img if window else img[:, y0:y0 + h, x0:x0 + w]
        (part * wts).sum().backward()
        return part.detach(), {k: p[k].grad for k in PARAMS}, info

    whole, g_whole, _ = run(None)
    part, g_part, info = run((x0, y0, w, h))
    assert part.shape == (1, h, w, 3)
    torch.testing.assert_close(part, whole, rtol=1e-9, atol=1e-12)
    for k in PARAMS:
        torch.testing.assert_close(g_part[k], g_whole[k], rtol=1e-7, atol=1e-10)
    assert (info["width"], info["height"], info["window"]) == (80, 60, (x0, y0, w, h))
    # Gaussians that cannot reach the window are not "visible" to densification
    _, _, info_all = run(None)
    assert int((info["radii"] > 0).all(-1).sum()) < int((info_all["radii"] > 0).all(-1).sum())
    with pytest.raises(ValueError, match="inside"):
        rasterize(scene["means"], scene["quats"], scene["scales"], scene["opacities"], scene["colors"],
                  scene["viewmats"], scene["Ks"], 80, 60, sh_degree=3, window=(50, 0, 40, 30))


def test_kernel_cache_folder_is_the_same_through_a_symlink(tmp_path):
    """The test projects (and any project that links ``splatflow/``) import the kernels through a symbolic link:
    numba must file them in the checkout's cache folder, not compile them again in a new one per path."""
    from pathlib import Path

    from numba.core import caching

    import splatflow.render._kernels as K
    from splatflow.render import _numba_cache

    assert _numba_cache.install()  # idempotent: already installed by importing splatflow.render
    impl = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl")
    locators = [c for c in impl._locator_classes if getattr(c, "splatflow_resolved", False)]
    assert len(locators) == 1 and impl._locator_classes[0] is locators[0]
    real = Path(K.__file__).resolve()
    link = tmp_path / "linked_render"
    link.symlink_to(real.parent, target_is_directory=True)
    fn = K.bin_tiles.py_func
    via_link = locators[0](fn, str(link / real.name))
    assert via_link.get_cache_path() == locators[0](fn, str(real)).get_cache_path()
    assert via_link.get_source_stamp() == locators[0](fn, str(real)).get_source_stamp()  # numba's content check
    # numba's own locator would have used another folder for the linked path
    plain = getattr(caching, "UserProvidedCacheLocator", None) or getattr(caching, "_UserProvidedCacheLocator")
    assert plain(fn, str(link / real.name)).get_cache_path() != via_link.get_cache_path()


def test_a_dvc_experiment_copy_uses_its_repos_kernel_cache(tmp_path):
    """``dvc exp run --temp`` and queued experiments run in a copy of the workspace under ``.dvc/tmp/exps``: its
    kernels (same sources) go to the repo's cache folder, filed under the same name, so they are not compiled
    again per experiment."""
    import shutil
    from pathlib import Path

    from numba.core import caching

    import splatflow.render._kernels as K
    from splatflow.pipeline.runtime_env import _kernel_cache_dir

    real_render = Path(K.__file__).resolve().parent
    repo = tmp_path / "repo"
    shutil.copytree(real_render, repo / "splatflow" / "render", ignore=shutil.ignore_patterns("__pycache__"))
    copy = repo / ".dvc" / "tmp" / "exps" / "tmpab12" / "splatflow" / "render"
    shutil.copytree(real_render, copy, ignore=shutil.ignore_patterns("__pycache__"))
    own = _kernel_cache_dir(repo / "splatflow" / "render")
    assert own.startswith(str(repo / "splatflow" / "render" / "__pycache__" / "numba-"))
    assert _kernel_cache_dir(copy) == own  # the experiment's copy: the repo's folder
    impl = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl")
    loc = next(c for c in impl._locator_classes if getattr(c, "splatflow_resolved", False))
    assert loc.get_suitable_cache_subpath(str(copy / "_kernels.py")) == "splatflow_render"
    assert loc.get_suitable_cache_subpath(str(real_render / "_kernels.py")) == "splatflow_render"
    fn = K.bin_tiles.py_func  # numba's stamp is the file's content: the copy's kernels match the repo's
    assert loc(fn, str(copy / "_kernels.py")).get_source_stamp() == loc(fn, str(real_render / "_kernels.py")).get_source_stamp()
