"""The sparse training step (train.sparse_step, splatflow/train/sparse.py): the window's candidates never miss a
Gaussian the projection reaches, the gradients are the dense step's, SparseAdam is torch's Adam, and training
with it learns as the dense step does.

The scene is the synthetic room at 96x72 with its true cameras (as tests/test_train.py).
"""

import random
from dataclasses import replace

import pytest
import torch

from splatflow.gaussians.model import SPLAT_KEYS
from splatflow.render import configure_threads
from splatflow.render.constants import ALPHA_MIN
from splatflow.train import Trainer, optim
from splatflow.train.loop import photometric_loss
from splatflow.train.sparse import SparseAdam, candidates
from splatflow.train.windows import level_budget, patch_window
from tests.test_train import small_cfg, train_off_and_on
from tests._tiny import scene, scene_dir  # noqa: F401 - the module's fixtures


@pytest.fixture(autouse=True)
def _threads():
    configure_threads(2)


SHAPES = {"means": (3,), "quats": (4,), "scales": (3,), "opacities": (), "sh0": (1, 3), "shN": (15, 3)}


def test_sparse_adam_is_torch_adam_on_the_same_gradients():
    """Rows without a gradient in a step are deferred and caught up later; after a flush parameters and both
    moments equal torch's (fused) Adam fed the same gradients with zeros for those rows, including rows whose
    gradients are so small that Adam's eps matters, and a position learning rate that changes every step."""
    g = torch.Generator().manual_seed(0)
    n = 400
    init = {k: torch.randn((n,) + s, generator=g) for k, s in SHAPES.items()}
    dense = {k: torch.nn.Parameter(v.clone()) for k, v in init.items()}
    lazy = {k: torch.nn.Parameter(v.clone()) for k, v in init.items()}
    od = optim.make_optimizers(dense, dict.fromkeys(SHAPES, 1e-2))
    ol = optim.make_optimizers(lazy, dict.fromkeys(SHAPES, 1e-2))
    sparse = SparseAdam(lazy, ol)
    tiny = torch.zeros(n, dtype=torch.bool)
    tiny[:40] = True  # these rows only ever get gradients near 1e-14: eps dominates Adam's denominator
    for step in range(300):
        for opt in (od["means"], ol["means"]):
            opt.param_groups[0]["lr"] = 1e-2 * 0.99 ** step
        seen = torch.rand(n, generator=g) < (0.5 if step < 30 else 0.06)  # long gaps later (rows unseen 100+ steps)
        rows = seen.nonzero().squeeze(1)
        grads = {}
        for k, s in SHAPES.items():
            gk = torch.randn((n,) + s, generator=g) * 10.0 ** torch.randint(-6, 1, (n,) + (1,) * len(s), generator=g)
            gk[tiny] *= 1e-9
            gk[~seen] = 0.0
            grads[k] = gk
            dense[k].grad = gk.clone()
        optim.step(od)
        sparse.step(lazy, ol, rows, {k: grads[k][rows] for k in SHAPES})
        if step in (57, 299):
            assert sparse.pending
            sparse.flush(lazy, ol)
            assert not sparse.pending
            for k in SHAPES:
                sd, sl = od[k].state[dense[k]], ol[k].state[lazy[k]]
                assert float(sd["step"]) == float(sl["step"]) == step + 1
                torch.testing.assert_close(lazy[k].detach(), dense[k].detach(), rtol=1e-5, atol=2e-5)
                for m in ("exp_avg", "exp_avg_sq"):
                    scale = float(sd[m].abs().max())
                    torch.testing.assert_close(sl[m], sd[m], rtol=1e-4, atol=1e-5 * scale)
            # the eps-dominated rows moved (a sum that ignored eps would have moved them far more, or not at all)
            assert not torch.equal(lazy["means"].detach()[tiny], init["means"][tiny])


def test_candidates_keep_every_gaussian_the_projection_reaches(scene):
    """The cull on raw parameters is conservative: every Gaussian the projection keeps for a window (radius > 0)
    is a candidate, also with opacities at the cut-off, huge scales and Gaussians behind the camera; and it culls
    (a small window keeps a fraction of the model)."""
    tr = Trainer(scene, small_cfg(patch_max_pixels=1200), seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        n = tr.state.params["means"].shape[0]
        op = tr.state.params["opacities"]
        alpha_logit = torch.logit(torch.tensor(ALPHA_MIN))
        op[: n // 4] = alpha_logit + 1e-4 * torch.randn(n // 4, generator=gen)  # at the opacity cut-off
        tr.state.params["scales"][n // 4: n // 3] += 3.0  # ~20x larger
        tr.state.params["means"][n // 3: n // 3 + 20] *= -1.0  # some behind the cameras
    fractions = []
    for trial in range(24):
        i, factor = trial % len(tr.views), (0.25, 0.5, 1.0)[trial % 3]
        tr.rng.python.seed(trial)  # the run's own generator draws the render's window
        with torch.no_grad():
            _, _, info = tr.render(i, factor, 1, patch=True)
        seen = set((info["radii"][0] > 0).all(-1).nonzero().squeeze(1).tolist())
        w, h = tr.cache.shape(i, factor)
        win = patch_window(w, h, level_budget(1200, factor, tr.cfg.patch_level_exponent), random.Random(trial))
        _, K = tr.cache.get(i, factor)
        cand = candidates(tr.state.params, tr.viewmats[i], torch.as_tensor(K, dtype=torch.float32), w, h, win)
        assert seen <= set(cand.tolist()), (trial, len(seen - set(cand.tolist())))
        if win is not None and win[2] * win[3] < w * h / 2:
            fractions.append(len(cand) / n)
    assert fractions and min(fractions) < 0.6  # windows of a quarter of the view keep a fraction of the model


def test_sparse_step_differentiates_exactly_what_the_dense_step_does(scene):
    """The rows' copies get exactly the gradients the dense step gives those rows, and every other row's dense
    gradient is zero (so deferring it loses nothing)."""
    tr = Trainer(scene, small_cfg(patch_max_pixels=1500), seed=0)
    for trial, factor in enumerate((1.0, 0.5, 1.0)):
        grads = {}
        for sparse in (False, True):
            tr.rng.python.seed(trial)  # the same window for both
            rgb, target, info = tr.render(trial, factor, 3, patch=True, sparse=sparse)
            loss, _, _ = photometric_loss(rgb.permute(2, 0, 1)[None], target.permute(2, 0, 1)[None], 1.0, 0.2)
            loss.backward()
            if sparse:
                rows, leaves = info["rows"], info["leaves"]
                grads[sparse] = {k: torch.zeros_like(tr.state.params[k]).index_copy_(0, rows, leaves[k].grad)
                                 for k in SPLAT_KEYS}
                assert all(tr.state.params[k].grad is None for k in SPLAT_KEYS)
            else:
                grads[sparse] = {k: tr.state.params[k].grad.clone() for k in SPLAT_KEYS}
                for p in tr.state.params.values():
                    p.grad = None
        for k in SPLAT_KEYS:
            assert torch.equal(grads[True][k], grads[False][k]), k
        assert len(rows) < tr.state.params["means"].shape[0] or factor < 1.0


def test_flush_before_anything_reads_every_row(scene):
    """Validation and a finished checkpoint see every row up to date (an unfinished one carries the rows behind
    with their bookkeeping, for a bit-exact resume: tests/test_train.py); replacing the parameters while rows are
    behind is refused instead of silently dropping their pending updates."""
    tr = Trainer(scene, small_cfg(patch_max_pixels=1200), seed=0)
    assert tr.state.sparse is not None
    for _ in range(5):
        with tr.rng.lent():
            tr.train_step()
        tr.step += 1
    assert tr.state.sparse.pending
    tr.validate()
    assert not tr.state.sparse.pending
    with tr.rng.lent():
        tr.train_step()
    tr.step += 1
    assert tr.state.sparse.pending
    ck = tr.state_dict(finished=False)
    assert tr.state.sparse.pending and set(ck.train["sparse"]["last"]) == set(SPLAT_KEYS)
    ck = tr.state_dict(finished=True)
    assert not tr.state.sparse.pending and "sparse" not in ck.train
    with tr.rng.lent():
        tr.train_step()
    means = tr.state.params["means"]
    tr.state.params["means"] = torch.nn.Parameter(means.detach().clone())  # a replacement without a flush
    with pytest.raises(RuntimeError, match="flush"):
        tr.state.sync()


def test_sparse_step_only_where_it_is_dense_adam(scene):
    """On by default on the CPU rasterizer; off with train.sparse_step: false, with visible_adam (another
    optimizer) and with 3DGS-MCMC (noise and regularisers on every Gaussian every step)."""
    assert Trainer(scene, small_cfg()).state.sparse is not None
    assert Trainer(scene, small_cfg(sparse_step=False)).state.sparse is None
    assert Trainer(scene, small_cfg(visible_adam=True)).state.sparse is None
    cfg = small_cfg()
    assert Trainer(scene, replace(cfg, densify=replace(cfg.densify, strategy="mcmc"))).state.sparse is None
    # a strategy plugged in later (any object with the protocol's methods) may touch every row at any step: the
    # trainer brings every row up to date and goes on densely
    from splatflow.train.strategies import TorchMCMCStrategy

    tr = Trainer(scene, small_cfg(patch_max_pixels=1200), seed=0)
    for _ in range(3):
        with tr.rng.lent():
            tr.train_step()
        tr.step += 1
    assert tr.state.sparse.pending
    sparse, flushed = tr.state.sparse, []
    flush = sparse.flush
    sparse.flush = lambda *a: (flushed.append(True), flush(*a))
    tr.strategy = TorchMCMCStrategy()  # (with a fresh strategy state)
    with tr.rng.lent():
        tr.train_step()
    assert tr.state.sparse is None and flushed and not sparse.pending


def test_sparse_training_learns_as_the_dense_step_does(scene):
    """300 steps on quarter-view windows with densification, sparse against dense from the same seed: float
    rounding differs (Adam turns it into different steps where a gradient is pure noise), so the runs are not
    bit-equal, but the held-out views come out as well (within 0.5 dB, the seed-to-seed spread here) and the
    densification grows about as many Gaussians."""
    out = train_off_and_on(scene, "sparse_step")
    (p_dense, n_dense), (p_sparse, n_sparse) = out[False], out[True]
    assert abs(p_sparse - p_dense) < 0.5, out
    assert abs(n_sparse - n_dense) < 0.05 * n_dense, out

