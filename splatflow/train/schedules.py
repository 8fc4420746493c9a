"""Training schedules as small policies with explicit state (docs/design.md §1 habit 4).

Each is a frozen function of the step (so resuming needs no hidden state), except :class:`PlateauStopper`,
whose state is explicit and checkpointed (``state_dict``/``load_state_dict``).

* Progressive resolution: coarse-to-fine training (progressive image downscaling as in EAGLES, Girish et al.
  2023); early steps at 1/8 resolution cost ~1/64 of the pixels and settle the coarse layout.
* Progressive blur: blurring render AND target with the same Gaussian compares like with like and gives the
  optimiser a wide basin early on (coarse-to-fine in scale space).
* SH degree: one more band every N steps, as the 3DGS reference (``oneupSHdegree`` every 1000 iterations).
* Position learning rate: exponential decay to a final factor, as the 3DGS reference ``get_expon_lr_func``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ResolutionSchedule:
    """Phases ``(start_step, factor)``, sorted by start; the first starts at 0."""

    starts: tuple[int, ...]
    factors: tuple[float, ...]

    @classmethod
    def from_config(cls, phases, max_steps: int) -> "ResolutionSchedule":
        starts = [p.start_step if p.start_step is not None else int(round(p.start_fraction * max_steps))
                  for p in phases]
        return cls(tuple(starts), tuple(float(p.factor) for p in phases))

    def phase(self, step: int) -> int:
        """Index of the phase active at ``step``."""
        i = 0
        for j, s in enumerate(self.starts):
            if step >= s:
                i = j
        return i

    def factor(self, step: int) -> float:
        return self.factors[self.phase(step)]

    @property
    def last_start(self) -> int:
        return self.starts[-1]


@dataclass(frozen=True)
class BlurSchedule:
    """Gaussian blur sigma (px at the current resolution): ``sigma_start`` at step 0, linearly to 0 at ``end_step``."""

    sigma_start_px: float
    end_step: int

    def sigma(self, step: int) -> float:
        if self.end_step <= 0 or step >= self.end_step:
            return 0.0
        return self.sigma_start_px * (1.0 - step / self.end_step)


@dataclass(frozen=True)
class SHSchedule:
    """Active SH degree: ``start_degree`` at first, +1 every ``interval`` steps, up to ``max_degree``."""

    max_degree: int
    interval: int
    start_degree: int = 0

    def degree(self, step: int) -> int:
        return min(self.max_degree, self.start_degree + step // self.interval)


@dataclass(frozen=True)
class ExpDecay:
    """``lr(step) = lr0 * final_factor ** (step / max_steps)`` (log-linear interpolation, 3DGS reference)."""

    lr0: float
    final_factor: float
    max_steps: int

    def lr(self, step: int) -> float:
        t = min(max(step / max(self.max_steps, 1), 0.0), 1.0)
        return self.lr0 * math.exp(t * math.log(self.final_factor))


@dataclass
class PlateauStopper:
    """Stop when validation PSNR has not improved by ``min_delta_db`` for ``patience_steps`` steps.

    Only steps at or after ``active_from`` count: before the last resolution phase and the end of the blur the
    PSNR moves because the schedule moves, not because learning has stalled.
    """

    patience_steps: int
    min_delta_db: float
    active_from: int = 0
    best_db: float = -math.inf
    best_step: int = -1

    def update(self, step: int, psnr_db: float) -> str | None:
        """Record a validation PSNR; return the stop reason or None to go on."""
        if step < self.active_from:
            return None
        if self.best_step < 0 or psnr_db > self.best_db + self.min_delta_db:
            self.best_db, self.best_step = psnr_db, step
            return None
        if step - self.best_step >= self.patience_steps:
            return (f"plateau: validation PSNR {psnr_db:.2f} dB has not improved by {self.min_delta_db} dB "
                    f"on {self.best_db:.2f} dB (step {self.best_step}) for {step - self.best_step} steps")
        return None

    def hold(self, step: int) -> None:
        """Count no plateau time up to ``step`` (a policy that still has to change the model holds the clock)."""
        if self.best_step >= 0:
            self.best_step = step

    def restart(self) -> None:
        """The model just changed: the plateau is measured afresh from the next validation."""
        self.best_db, self.best_step = -math.inf, -1

    def state_dict(self) -> dict:
        return {"best_db": self.best_db, "best_step": self.best_step}

    def load_state_dict(self, d: dict) -> None:
        self.best_db, self.best_step = float(d["best_db"]), int(d["best_step"])


@dataclass
class Schedules:
    """All step-driven schedules of one run, built from ``TrainConfig``."""

    resolution: ResolutionSchedule
    blur: BlurSchedule
    sh: SHSchedule
    means_lr: ExpDecay

    @classmethod
    def from_config(cls, cfg, scene_scale: float) -> "Schedules":
        return cls(
            resolution=ResolutionSchedule.from_config(cfg.resolution, cfg.max_steps),
            blur=BlurSchedule(cfg.blur.sigma_start_px, int(round(cfg.blur.end_fraction * cfg.max_steps))),
            sh=SHSchedule(cfg.sh_degree, cfg.sh_degree_interval),
            means_lr=ExpDecay(cfg.lr.means * scene_scale, cfg.lr.means_final_factor, cfg.max_steps),
        )
