"""The Gaussians of a training run as one object (splatflow/train/state.py): every row operation keeps the
parameters, their Adam moments, the strategy's per-row statistics and the sparse step's bookkeeping aligned, brings
deferred rows up to date first, and the state's state_dict round-trips."""

import pytest
import torch

from splatflow.gaussians.model import SPLAT_KEYS
from splatflow.train.rows import spatial_order
from splatflow.train.state import GaussianState

SHAPES = {"means": (3,), "quats": (4,), "scales": (3,), "opacities": (), "sh0": (1, 3), "shN": (15, 3)}


def _state(n=50, seed=1, sparse=False, steps=1) -> GaussianState:
    """A state of ``n`` random Gaussians after ``steps`` Adam steps on random gradients (moments everywhere), with
    per-row strategy statistics whose values name their row."""
    g = torch.Generator().manual_seed(seed)
    gs = GaussianState({k: torch.randn((n,) + s, generator=g) for k, s in SHAPES.items()},
                       dict.fromkeys(SHAPES, 1e-2), "cpu", sparse=sparse)
    for _ in range(steps):
        if sparse:  # a fifth of the rows each step: the others deferred
            rows = torch.arange(0, n, 5)
            gs.step_rows(rows, {k: torch.randn((len(rows),) + s, generator=g) for k, s in SHAPES.items()})
        else:
            for k in SPLAT_KEYS:
                gs.params[k].grad = torch.randn(gs.params[k].shape, generator=g)
            gs.step()
    gs.strategy = {"grad2d": torch.rand(n, generator=g), "count": torch.arange(n, dtype=torch.float32),
                   "scene_scale": 1.0}
    return gs


def _rows(gs: GaussianState) -> dict:
    """Every per-row tensor of ``gs``: parameters, both moments of each group, the strategy's statistics."""
    out = {}
    for k in SPLAT_KEYS:
        st = gs.optimizers[k].state[gs.params[k]]
        out[k], out[k + ".m"], out[k + ".v"] = gs.params[k].detach().clone(), st["exp_avg"], st["exp_avg_sq"]
        assert gs.optimizers[k].param_groups[0]["params"][0] is gs.params[k]  # the optimizer steps the new one
    out["grad2d"], out["count"] = gs.strategy["grad2d"], gs.strategy["count"]
    return out


def test_reordering_moves_parameters_moments_and_strategy_state_with_their_rows():
    gs = _state()
    before = _rows(gs)
    perm = spatial_order(gs.params["means"])
    gs.reorder_spatially()
    for name, t in _rows(gs).items():
        assert torch.equal(t, before[name][perm]), name
    assert torch.equal(gs.strategy["count"], perm.float()) and gs.strategy["scene_scale"] == 1.0
    with pytest.raises(ValueError, match="permutation"):
        gs.reorder(perm[:10])


def test_keep_cuts_every_per_row_tensor_alike():
    gs = _state()
    before = _rows(gs)
    rows = torch.tensor([1, 4, 7])
    gs.keep(rows)
    assert gs.n == 3
    for name, t in _rows(gs).items():
        assert torch.equal(t, before[name][rows]), name
    assert gs.strategy["count"].tolist() == [1.0, 4.0, 7.0]


def test_append_adds_rows_with_fresh_moments_and_statistics():
    gs = _state()
    before = _rows(gs)
    new = {k: torch.full((4,) + s, 0.5) for k, s in SHAPES.items()}
    gs.append(new)
    assert gs.n == 54
    after = _rows(gs)
    for k in SPLAT_KEYS:
        assert torch.equal(after[k][:50], before[k]) and torch.equal(after[k][50:], new[k]), k
        for m in (".m", ".v"):
            assert torch.equal(after[k + m][:50], before[k + m]) and not after[k + m][50:].any(), k + m
    for name in ("grad2d", "count"):
        assert torch.equal(after[name][:50], before[name]) and not after[name][50:].any(), name


def test_relocate_copies_parameters_and_restarts_the_sources():
    """Rows ``dst`` take the parameters of rows ``src``; the sources' moments and statistics restart from zero
    (3DGS-MCMC's relocation, as gsplat's ``relocate``); every other row is untouched."""
    gs = _state()
    before = _rows(gs)
    dst, src = torch.tensor([3, 9]), torch.tensor([20, 30])
    gs.relocate(dst, src)
    after = _rows(gs)
    other = torch.ones(50, dtype=torch.bool)
    other[dst] = other[src] = False
    for k in SPLAT_KEYS:
        assert torch.equal(after[k][dst], before[k][src]) and torch.equal(after[k][src], before[k][src]), k
        for m in (".m", ".v"):
            assert not after[k + m][src].any() and torch.equal(after[k + m][dst], before[k + m][dst]), k + m
    for name, t in after.items():
        assert torch.equal(t[other], before[name][other]), name
    assert not after["grad2d"][src].any() and not after["count"][src].any()


def test_row_operations_bring_deferred_rows_up_to_date_first():
    """With the sparse step's rows behind, a row operation first brings them up to date (what a flush gives),
    then moves them, and the bookkeeping restarts for the new rows: the next sparse step runs."""
    lazy, ref = _state(sparse=True, steps=3), _state(sparse=True, steps=3)
    assert lazy.pending
    ref.flush()
    rows = torch.arange(0, 40, 2)
    expected = {name: t[rows] for name, t in _rows(ref).items()}
    lazy.keep(rows)
    assert not lazy.pending
    for name, t in _rows(lazy).items():
        assert torch.equal(t, expected[name]), name
    lazy.step_rows(torch.tensor([0, 2]), {k: torch.ones((2,) + s) for k, s in SHAPES.items()})  # 2 of 20 rows
    assert lazy.pending and lazy.sparse.last["means"][:5].tolist() == [4, 3, 4, 3, 3]


def test_snapshot_and_restore_carry_parameters_and_adam_moments():
    gs = _state()
    before = _rows(gs)
    snap = gs.snapshot()
    gs.keep(torch.tensor([1, 4, 7]))
    gs.restore(snap)
    assert gs.strategy["grad2d"] is None and gs.strategy["count"] is None  # statistics of the rows in between
    for k in SPLAT_KEYS:
        st = gs.optimizers[k].state[gs.params[k]]
        assert torch.equal(gs.params[k].detach(), before[k]) and torch.equal(st["exp_avg"], before[k + ".m"])
    for k in SPLAT_KEYS:  # the optimizer still steps the restored parameters
        gs.params[k].grad = torch.ones_like(gs.params[k])
    gs.step()


@pytest.mark.parametrize("sparse", [False, True])
def test_state_dict_round_trips(sparse):
    """A state loaded from another's state_dict holds the same rows, moments, statistics and (rows behind) the
    same sparse bookkeeping, and continues with the same steps to the bit; a dense state loading rows behind brings
    them up to date at once."""
    a = _state(sparse=sparse, steps=3)
    d = a.state_dict()
    assert ("sparse" in d) == sparse and all(t.device.type == "cpu" for t in d["splats"].values())
    b = _state(n=7, seed=5, sparse=sparse, steps=0)
    b.load_state_dict(d)
    assert b.n == a.n and b.pending == a.pending
    for name, t in _rows(a).items():
        assert torch.equal(_rows(b)[name], t), name
    for gs in (a, b):
        rows = torch.arange(1, gs.n, 3)
        if sparse:
            gs.step_rows(rows, {k: torch.ones((len(rows),) + s) for k, s in SHAPES.items()})
        else:
            for k in SPLAT_KEYS:
                gs.params[k].grad = torch.ones_like(gs.params[k])
            gs.step()
        gs.flush()
    for name, t in _rows(a).items():
        assert torch.equal(_rows(b)[name], t), name
    if sparse:  # a dense run resuming a sparse run's checkpoint
        dense = _state(n=7, steps=0)
        c = _state(sparse=True, steps=3)
        dense.load_state_dict(c.state_dict())
        c.flush()
        assert not dense.pending and torch.equal(dense.params["means"], c.params["means"])
