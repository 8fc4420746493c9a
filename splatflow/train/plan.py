"""The training plan: how many steps and how many Gaussians a scene gets on the device it trains on.

``train.max_steps: auto`` and ``train.densify.max_gaussians: auto`` (the defaults) are resolved here, once, before
training, from three things that do not change between reruns: the scene's image content (training views x
pixels per view at the working size), the device kind (the CPU backend or a CUDA GPU, with its memory) and
``train.quality``. The resolved numbers go into ``metrics/S/train.json`` (``plan``) and MLflow, and the stage logs
them as the lines to paste into ``params.yaml`` to pin them. A number given for either key is used as it is.

Why these numbers (bench/RESULTS.md "Real captures"): the step count and budget that suit a 32-view synthetic
room (6,600 steps, 120K Gaussians, 5 minutes on 2 cores) underfit a 220-view 360° capture by 1.5-4 dB. The steps
follow the number of training views: each view needs a number of visits, whatever its size, and captures of up
to ``REFERENCE_VIEWS`` views keep the room's steps (on real captures of 42 and 84 views the test PSNR stops
rising by 3,000-6,000 steps while the training views go on fitting; a 220-view one still gains at 12,000). The
budget follows the square root of the content (views x pixels), which sets how much detail there is to hold.
Both stay between a floor (small scenes keep the room's plan) and a ceiling (a 2-core CPU's 12,000 steps, a
quarter of an hour on a 220-view capture, and 400K; a GPU's 30K steps, the field's standard schedule, and a
budget its memory holds).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from splatflow.pipeline.config import ResolutionPhase, TrainConfig

# The content of the benchmark room the CPU defaults were tuned on: 32 training views at 800x600.
REFERENCE_CONTENT_PX = 32 * 800 * 600
# Captures of up to this many training views keep the reference steps; past it the steps grow in proportion (a
# 220-view capture: 2.3x, past the CPU's ceiling of 12,000).
REFERENCE_VIEWS = 96


@dataclass(frozen=True)
class Limits:
    """Steps and budget at the reference content, and the floor and ceiling of each."""

    steps: int
    steps_min: int
    steps_max: int
    gaussians: int
    gaussians_min: int
    gaussians_max: int


# Per device kind and train.quality. CPU standard: ~15 minutes on 2 cores for a 250-photo capture at 800 px (12,000
# steps: 28.03 dB on Mip-NeRF 360's bonsai in 816 s on a Zen 4 host, where 15,000 gave 28.20 in 1,100-1,400 s);
# draft about half of it; max without a time limit. CUDA standard: the field's 30K-step schedule on whole images
# whatever the scene (a GPU runs it in minutes), a budget of the size gsplat's and 3DGS-MCMC's runs reach on real
# scenes (1-3M; simple_trainer grew bonsai at 512 px to 1.49M, where 0.95M ended 0.2 dB under it).
LIMITS = {
    ("cpu", "draft"): Limits(3300, 3000, 7500, 60_000, 40_000, 200_000),
    ("cpu", "standard"): Limits(6600, 6600, 12_000, 120_000, 120_000, 400_000),
    ("cpu", "max"): Limits(15_000, 15_000, 30_000, 400_000, 400_000, 1_000_000),
    ("cuda", "draft"): Limits(7000, 7000, 15_000, 300_000, 300_000, 1_000_000),
    ("cuda", "standard"): Limits(30_000, 30_000, 30_000, 1_000_000, 1_000_000, 3_000_000),
    ("cuda", "max"): Limits(40_000, 40_000, 60_000, 1_500_000, 1_500_000, 6_000_000),
}
# Gaussians a GPU holds per GiB of memory while training (parameters, Adam moments, gradients and the
# rasterizer's per-tile lists): a cap under the budget on small cards.
GAUSSIANS_PER_GIB = 250_000
# A whole-resolution run starts densifying once the SfM points have settled, after this many steps whatever the
# run's length (3DGS and gsplat: 500 of 30,000). A fraction of a long GPU plan would wait longer (1,185 steps of
# 23,700) and leave its early steps to a model of SfM points; coarse to fine keeps the fraction, which falls where
# its second resolution level begins.
WHOLE_RESOLUTION_REFINE_START = 500
# train.checkpoint_every: auto. A checkpoint of the parameters and Adam moments costs a GPU run about a second
# at ~900K Gaussians (640 MB written) where 1,000 steps take ~10 s; on the CPU 1,000 steps are minutes.
CHECKPOINT_EVERY = {"cpu": 1000, "cuda": 5000}


@dataclass(frozen=True)
class Plan:
    max_steps: int
    max_gaussians: int
    steps_auto: bool
    gaussians_auto: bool
    quality: str
    device_kind: str  # "cpu" (the numba or torch CPU backends) or "cuda"
    train_views: int
    pixels_per_view: int  # median at the working size
    content_ratio: float  # content / REFERENCE_CONTENT_PX
    gpu_memory_gib: float | None = None
    coarse_to_fine: bool = True
    coarse_to_fine_auto: bool = False
    refine_start_step: int | None = None  # whole resolution: densification from this step (None: the fraction)
    checkpoint_every: int = 1000
    early_stop: bool = True  # the plateau stop on training views (train.early_stop.enabled)
    early_stop_auto: bool = False

    def record(self) -> dict:
        """For train.json and MLflow: numbers only."""
        return {"max_steps": self.max_steps, "max_gaussians": self.max_gaussians,
                "steps_auto": int(self.steps_auto), "gaussians_auto": int(self.gaussians_auto),
                "coarse_to_fine": int(self.coarse_to_fine), "coarse_to_fine_auto": int(self.coarse_to_fine_auto),
                "refine_start_step": self.refine_start_step, "checkpoint_every": self.checkpoint_every,
                "early_stop": int(self.early_stop), "early_stop_auto": int(self.early_stop_auto),
                "train_views": self.train_views, "pixels_per_view": self.pixels_per_view,
                "content_ratio": round(self.content_ratio, 4), "gpu_memory_gib": self.gpu_memory_gib}

    def describe(self) -> str:
        what = []
        if self.steps_auto or self.gaussians_auto or self.coarse_to_fine_auto or self.early_stop_auto:
            what.append(f"{self.quality} plan for {self.train_views} training views of "
                        f"{self.pixels_per_view / 1e6:.2f} MP on {self.device_kind}")
        pin = []
        if self.steps_auto:
            pin.append(f"train.max_steps: {self.max_steps}")
        if self.gaussians_auto:
            pin.append(f"train.densify.max_gaussians: {self.max_gaussians}")
        if self.coarse_to_fine_auto:
            pin.append(f"train.coarse_to_fine: {str(self.coarse_to_fine).lower()}")
        if self.early_stop_auto:
            pin.append(f"train.early_stop.enabled: {str(self.early_stop).lower()}")
        head = (f"{self.max_steps} steps, at most {self.max_gaussians:,} Gaussians, "
                + ("coarse to fine" if self.coarse_to_fine else "whole resolution from the start"))
        head += "" if self.early_stop else ", no plateau stop"
        return head + (f" ({what[0]}; pin with {', '.join(pin)})" if pin else " (as set in params.yaml)")


def _clamped(value: float, lo: int, hi: int, round_to: int) -> int:
    """``value`` rounded to a multiple of ``round_to``, then held within ``[lo, hi]``."""
    return int(min(hi, max(lo, round(value / round_to) * round_to)))


def _scaled(base: int, lo: int, hi: int, ratio: float, round_to: int) -> int:
    return _clamped(base * math.sqrt(max(ratio, 0.0)), lo, hi, round_to)


def _by_views(lim: Limits, views: int) -> int:
    return _clamped(lim.steps * max(1.0, views / REFERENCE_VIEWS), lim.steps_min, lim.steps_max, 100)


def resolve(cfg: TrainConfig, views, device_kind: str, gpu_memory_gib: float | None = None,
            pixels=None) -> Plan:
    """The plan for training ``views`` (the training views at their working size) on ``device_kind``
    ("cpu" or "cuda"). ``pixels`` (optional) gives each view's pixel count instead of reading ``view.width`` and
    ``view.height``."""
    kind = "cuda" if device_kind == "cuda" else "cpu"
    sizes = list(pixels) if pixels is not None else [int(v.width) * int(v.height) for v in views]
    n = len(sizes)
    per_view = int(sorted(sizes)[n // 2]) if n else 0
    ratio = n * per_view / REFERENCE_CONTENT_PX
    lim = LIMITS[(kind, cfg.quality)]
    steps = cfg.max_steps if cfg.max_steps != "auto" else _by_views(lim, n)
    if cfg.densify.max_gaussians != "auto":
        budget = int(cfg.densify.max_gaussians)
    else:
        budget = _scaled(lim.gaussians, lim.gaussians_min, lim.gaussians_max, ratio, 10_000)
        if kind == "cuda" and gpu_memory_gib:
            budget = min(budget, int(GAUSSIANS_PER_GIB * gpu_memory_gib) // 10_000 * 10_000)
    c2f, stop = _cpu_switch(cfg.coarse_to_fine, kind), _cpu_switch(cfg.early_stop.enabled, kind)
    refine_start = None
    if not c2f:
        refine_start = min(int(cfg.densify.refine_start_fraction * steps), WHOLE_RESOLUTION_REFINE_START)
    return Plan(max_steps=int(steps), max_gaussians=int(budget), steps_auto=cfg.max_steps == "auto",
                gaussians_auto=cfg.densify.max_gaussians == "auto", quality=cfg.quality, device_kind=kind,
                train_views=n, pixels_per_view=per_view, content_ratio=ratio,
                gpu_memory_gib=None if kind == "cpu" else gpu_memory_gib, coarse_to_fine=c2f,
                coarse_to_fine_auto=cfg.coarse_to_fine == "auto", refine_start_step=refine_start,
                checkpoint_every=checkpoint_every(cfg, kind), early_stop=stop,
                early_stop_auto=cfg.early_stop.enabled == "auto")


def _cpu_switch(value, kind: str) -> bool:
    """A switch whose "auto" means on for the CPU plan and off for CUDA (coarse to fine, the plateau stop)."""
    return kind == "cpu" if value == "auto" else bool(value)


def checkpoint_every(cfg: TrainConfig, device_kind: str) -> int:
    """``train.checkpoint_every`` with "auto" resolved for ``device_kind`` ("cpu", "torch" or "cuda")."""
    if cfg.checkpoint_every != "auto":
        return int(cfg.checkpoint_every)
    return CHECKPOINT_EVERY["cuda" if device_kind == "cuda" else "cpu"]


def apply(cfg: TrainConfig, plan: Plan) -> TrainConfig:
    """``cfg`` with the plan's numbers and switches in place of "auto"; without coarse to fine, one
    whole-resolution phase, no blur in place of the schedules and densification from the plan's start step."""
    densify = dataclasses.replace(cfg.densify, max_gaussians=plan.max_gaussians)
    if plan.refine_start_step is not None:
        densify = dataclasses.replace(densify, refine_start_fraction=plan.refine_start_step / plan.max_steps)
    out = dataclasses.replace(cfg, max_steps=plan.max_steps, coarse_to_fine=plan.coarse_to_fine, densify=densify,
                              checkpoint_every=plan.checkpoint_every,
                              early_stop=dataclasses.replace(cfg.early_stop, enabled=plan.early_stop))
    if not plan.coarse_to_fine:
        out = dataclasses.replace(out, resolution=(ResolutionPhase(1.0, start_fraction=0.0),),
                                  blur=dataclasses.replace(cfg.blur, sigma_start_px=0.0))
    return out
