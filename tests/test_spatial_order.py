"""The CPU trainer keeps the Gaussians in Morton order (train.spatial_order, splatflow/train/rows.py): the order is a
Z curve (reordering carries every per-Gaussian quantity with its row: tests/test_state.py), and training keeps the rows sorted after
each densification event without changing what it learns.

The scene is the synthetic room at 96x72 with its true cameras (as tests/test_train.py).
"""

import pytest
import torch

from splatflow.gaussians.model import Splats
from splatflow.render import configure_threads
from splatflow.train import Trainer
from splatflow.train.rows import morton_codes, spatial_order
from tests.test_train import small_cfg, train_off_and_on
from tests._tiny import scene, scene_dir  # noqa: F401 - the module's fixtures


@pytest.fixture(autouse=True)
def _threads():
    configure_threads(2)


def test_morton_codes_follow_the_z_curve():
    """On the corners of a cube the codes count x fastest, then y, then z; one grid step along an axis sets the
    axis' own bit; sorting random points brings neighbours in space next to each other in memory."""
    corners = torch.tensor([[x, y, z] for z in (0.0, 1.0) for y in (0.0, 1.0) for x in (0.0, 1.0)])
    codes = morton_codes(corners)
    top = (1 << 10) - 1  # the grid's last cell on each axis
    assert codes.tolist() == [sum(_spread_ref(top) << a for a, on in enumerate(c) if on) for c in corners.tolist()]
    assert torch.equal(torch.argsort(codes), torch.arange(8))
    g = torch.Generator().manual_seed(0)
    pts = torch.rand(20000, 3, generator=g) * torch.tensor([4.0, 1.0, 2.0]) - 1.0
    perm = spatial_order(pts)
    assert torch.equal(torch.sort(perm).values, torch.arange(len(pts)))  # a permutation
    assert bool((morton_codes(pts)[perm].diff() >= 0).all())
    step_before = (pts.diff(dim=0)).norm(dim=1).mean()
    step_after = (pts[perm].diff(dim=0)).norm(dim=1).mean()
    assert step_after < step_before / 8, (float(step_before), float(step_after))
    # sorted rows stay where they are (a stable sort: equal codes keep their order)
    assert torch.equal(spatial_order(pts[perm]), torch.arange(len(pts)))
    assert spatial_order(torch.zeros(0, 3)).numel() == 0


def _spread_ref(v: int) -> int:
    """Bit i of v moved to bit 3i (the reference the vectorised spread is checked against)."""
    return sum(((v >> i) & 1) << (3 * i) for i in range(10))


def _sorted(tr: Trainer) -> bool:
    return bool((morton_codes(tr.state.params["means"]).diff() >= 0).all())


def test_the_cpu_trainer_keeps_its_rows_in_spatial_order(scene):
    """Sorted from the start and again after every refine (densification appends clones and split children at the
    end), with the sparse step's bookkeeping still consistent (it raises on a replacement with rows behind); off
    with train.spatial_order: false."""
    tr = Trainer(scene, small_cfg(300, patch_max_pixels=1500), seed=0)
    assert tr.spatial_order and _sorted(tr)
    grown = 0
    while tr.step < 120:
        with tr.rng.lent():
            tr.train_step()
        tr.step += 1
        ev = tr.strategy.last_event
        if ev and ev["clones"] + ev["splits"] > 0:
            grown += 1
            assert _sorted(tr), tr.step
    assert grown >= 2
    off = Trainer(scene, small_cfg(300, patch_max_pixels=1500, spatial_order=False), seed=0)
    assert not off.spatial_order
    while off.step < 60:
        with off.rng.lent():
            off.train_step()
        off.step += 1
    assert not _sorted(off)  # appended rows break the order
    handed = Trainer(scene, small_cfg(30), seed=0, splats=Splats.of(off.state.params).detach())
    assert handed.spatial_order and torch.equal(handed.state.params["means"], off.state.params["means"])  # the caller's order


def test_training_in_spatial_order_learns_as_without_it(scene):
    """The order changes float rounding only: 300 steps from the same seed reach the same held-out PSNR (within
    0.5 dB, the seed-to-seed spread here) with about as many Gaussians."""
    out = train_off_and_on(scene, "spatial_order")
    assert abs(out[True][0] - out[False][0]) < 0.5, out
    assert abs(out[True][1] - out[False][1]) < 0.15 * out[False][1], out
