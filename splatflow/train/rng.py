"""The random generators of one training run: seeded from the run seed, saved in its checkpoint, never shared.

A run draws random numbers for the view order, the training windows, random backgrounds and the densification
strategy's noise and sampling. The view order and the windows are drawn from the run's own ``random.Random``
(:attr:`RunRNG.python`), never from the ``random`` module, whose global state other threads of the process also
draw from (a live viewer's websocket server does, for its pings). The torch draws happen in code that takes no
generator argument (gsplat's strategy ops, ``torch.rand``), so the trainer LENDS its torch states to the global
generators for the span of a step (:meth:`RunRNG.lent`) and takes them back afterwards, leaving the caller's
global state exactly as it was. A run therefore repeats bit for bit for a given seed whatever the caller
drew before or draws between steps, and a fine-tune inside another stage (prune's recovery) cannot disturb the
stage's own random numbers.

The streams are those of ``random.seed(seed)`` and ``torch.manual_seed(seed)``, so a run draws the same numbers
as when the trainer seeded the global generators itself, and checkpoints of that time resume unchanged.
"""

from __future__ import annotations

import random
from contextlib import contextmanager
from typing import Iterator

import torch


class RunRNG:
    """Python's and torch's generators of one run (torch's on the CPU, plus the run's CUDA device on a GPU)."""

    def __init__(self, seed: int, device: torch.device | str = "cpu"):
        device = torch.device(device)
        self.python = random.Random(seed)
        self.torch = torch.Generator(device="cpu").manual_seed(seed)
        self.cuda = torch.Generator(device=device).manual_seed(seed) if device.type == "cuda" else None

    @contextmanager
    def lent(self) -> Iterator[None]:
        """Within the block the global torch generators carry this run's states; after it this run's generators
        hold where the block left them and the global ones are back where they were. (Python's generator is not
        lent: the run draws from :attr:`python` itself.)"""
        cuda = [] if self.cuda is None else [self.cuda.device]
        with torch.random.fork_rng(devices=cuda, device_type="cuda"):  # restores torch's global states on exit
            torch.set_rng_state(self.torch.get_state())
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda.get_state(), self.cuda.device)
            try:
                yield
            finally:
                self.torch.set_state(torch.get_rng_state())
                if self.cuda is not None:
                    self.cuda.set_state(torch.cuda.get_rng_state(self.cuda.device))

    def state_dict(self) -> dict:
        """The checkpoint's ``rng`` entry (CPU tensors and a tuple: device-independent)."""
        d = {"torch": self.torch.get_state(), "python": self.python.getstate()}
        if self.cuda is not None:
            d["cuda"] = self.cuda.get_state()
        return d

    def load_state_dict(self, d: dict) -> None:
        """Continue from a checkpoint's ``rng`` entry. A CPU checkpoint resumed on a GPU keeps the CUDA generator
        as seeded; checkpoints written before the run owned its generators also hold a ``numpy`` state, which
        training never drew from, and it is ignored."""
        self.torch.set_state(d["torch"])
        self.python.setstate(d["python"])
        if self.cuda is not None and "cuda" in d:
            self.cuda.set_state(d["cuda"])
