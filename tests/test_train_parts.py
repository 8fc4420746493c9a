"""The training run's parts outside the loop: its generators, its metrics sink, its optimizer step, its windows."""

from __future__ import annotations

import csv
import random

import torch

from splatflow.train import optim
from splatflow.train.rng import RunRNG
from splatflow.train.sink import CSV_FIELDS, MetricsSink


def test_run_rng_streams_are_the_seeded_global_ones_and_leave_the_caller_alone():
    """The run draws the streams of ``random.seed(seed)`` and ``torch.manual_seed(seed)`` (so checkpoints of the
    time the trainer seeded the global generators resume unchanged): Python's from its own ``random.Random``, which
    never touches the ``random`` module, torch's lent to the global generator for a block and taken back after."""
    rng = RunRNG(5)
    random.seed(99), torch.manual_seed(99)
    caller = random.random(), torch.rand(2)
    random.seed(99), torch.manual_seed(99)
    with rng.lent():
        first = rng.python.random(), torch.rand(3)
    assert random.random() == caller[0] and torch.equal(torch.rand(2), caller[1])  # untouched by the block
    random.seed(99)
    second = [rng.python.random()]  # drawn outside a lent block too: the caller's stream stays untouched
    with rng.lent():
        second.append(torch.rand(3))
    assert random.random() == caller[0]
    random.seed(5), torch.manual_seed(5)  # the same streams as seeding the global generators
    assert first[0] == random.random() and torch.equal(first[1], torch.rand(3))
    assert second[0] == random.random() and torch.equal(second[1], torch.rand(3))
    # a saved state continues the streams in a new run object
    saved = rng.state_dict()
    with rng.lent():
        third = rng.python.random(), torch.rand(3)
    other = RunRNG(0)
    other.load_state_dict({**saved, "numpy": ("MT19937", [0] * 624, 0, 0, 0.0)})  # old files: numpy ignored
    with other.lent():
        assert other.python.random() == third[0] and torch.equal(torch.rand(3), third[1])


class _Logger:
    def __init__(self):
        self.calls, self.closed = [], False

    def log(self, step, metrics):
        self.calls.append((step, metrics))

    def close(self):
        self.closed = True
        raise RuntimeError("the tracking server went away")  # must not break training


def _row(step: int) -> dict:
    return {"step": step, "phase": 0, "resolution": "8x6", "sigma": 0.0, "loss": 0.5, "l1": 0.4, "ssim": 0.7,
            "psnr": 20.0, "gaussians": 10, "seconds": 0.1 * step}


def test_metrics_sink_writes_rows_live_and_keeps_rows_up_to_a_resumed_step(tmp_path):
    path = tmp_path / "plots" / "train.csv"
    logger = _Logger()
    sink = MetricsSink(path, logger)
    sink.start(0)
    for s in (10, 20, 30):
        sink.row(_row(s))
        assert len(list(csv.DictReader(open(path)))) == s // 10  # on disk as it comes
    sink.event({"step": 25, "clones": 3, "splits": 1, "gaussians": 14})
    assert logger.calls[-1] == (25, {"refine_clones": 3.0, "refine_splits": 1.0, "refine_gaussians": 14.0})
    assert logger.calls[0] == (10, {"loss": 0.5, "l1": 0.4, "ssim": 0.7, "psnr": 20.0, "gaussians": 10.0,
                                    "sigma": 0.0})
    sink.close()
    assert logger.closed
    resumed = MetricsSink(path)
    resumed.start(20)  # a run resumed at step 20 drops the rows after it
    rows = list(csv.DictReader(open(path)))
    assert tuple(rows[0]) == CSV_FIELDS and [int(r["step"]) for r in rows] == [10, 20]
    MetricsSink(path).start(0)  # a fresh run starts the file afresh
    assert list(csv.DictReader(open(path))) == []


def test_visible_step_leaves_unseen_gaussians_and_their_moments_alone():
    g = torch.Generator().manual_seed(0)
    params = {k: torch.nn.Parameter(torch.randn(6, 3, generator=g)) for k in ("means", "scales")}
    opts = optim.make_optimizers(params, {"means": 0.1, "scales": 0.1})
    for _ in range(2):  # build up moments everywhere first
        sum((p ** 2).sum() for p in params.values()).backward()
        optim.step(opts)
    unseen = torch.tensor([True, False, True, False, False, False])
    before = {k: (p.detach().clone(), opts[k].state[p]["exp_avg"].clone()) for k, p in params.items()}
    sum((p ** 2).sum() for p in params.values()).backward()
    optim.visible_step(params, opts, unseen)
    for k, p in params.items():
        assert torch.equal(p.detach()[unseen], before[k][0][unseen])
        assert torch.equal(opts[k].state[p]["exp_avg"][unseen], before[k][1][unseen])
        assert not torch.equal(p.detach()[~unseen], before[k][0][~unseen])
        assert p.grad is None
