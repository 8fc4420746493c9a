"""What a training run returns."""

from __future__ import annotations

from dataclasses import dataclass, field

from splatflow.gaussians.model import Splats


@dataclass
class TrainResult:
    splats: Splats
    sh_degree: int
    steps: int
    stopped: str
    train_seconds: float
    it_per_s: float
    val_psnr: float | None
    events: list[dict] = field(default_factory=list)
    initial_psnr: float | None = None
    resumed_from: int | None = None  # step of the unfinished checkpoint this run continued, if any
    device: dict = field(default_factory=dict)  # splatflow.pipeline.device.run_record: what ran, peak GPU memory
    prune_during: dict | None = None  # train.prune_during's report (PruneDuring.report), when it ran
    appearance: dict | None = None  # train.appearance: how far the transforms moved (Appearance.report)
    # numba compiling the CPU kernels before the first step (splatflow.train.precompile; not in train_seconds),
    # None when they were cached or the run is on a GPU
    compile_seconds: float | None = None
    window_pixels: int = 0  # train.patch_max_pixels as this run resolved it (0 = whole images)
    plan: dict = field(default_factory=dict)  # the resolved training plan (splatflow.train.plan.Plan.record)
