"""Strict, typed configuration: one frozen dataclass per ``params.yaml`` section.

``params.yaml`` is DVC's parameter file, so a typo there would otherwise silently fall back to a default and
make a run that looks reproducible but is not. The loader therefore refuses unknown keys, wrong types and
out-of-range values, and every error names the full key (``train.max_steps``) and what is allowed.

Range checks live in each dataclass's ``__post_init__`` through :func:`check`; the loader handles types,
nesting (a dataclass-typed field is loaded from a mapping, ``list[X]`` from a list, ``Literal`` from its choices)
and unknown keys generically.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

# train.patch_max_pixels "auto" on the CPU backend: the window area a 2-core step was tuned for (RESULTS.md)
CPU_WINDOW_PIXELS = 60000


class ConfigError(ValueError):
    """A params.yaml value that is unknown, of the wrong type or out of range."""


def check(ok: bool, key: str, allowed: str, value: Any) -> None:
    """Raise a ConfigError naming ``key`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"params.yaml: {key} = {value!r} is not allowed; expected {allowed}")


# --------------------------------------------------------------------------------------------- sections


@dataclass(frozen=True)
class ResolutionConfig:
    """The image size train, prune and evaluate work at (:mod:`splatflow.scene.resolution`).

    ``downscale`` (1, 2, 4 or 8, as the benchmark protocols use) takes the dataset's own ``images_N`` level when
    it is usable and area-downscales the undistorted images by N otherwise; ``max_side_px`` area-downscales so the
    longest side is at most that many pixels (never upscales). With neither, images whose longest side exceeds
    ``default_max_side_px`` are brought to it (1600, as the reference 3DGS code does; 0 keeps full resolution).
    """

    downscale: int | None = None
    max_side_px: int | None = None
    default_max_side_px: int = 1600

    def __post_init__(self):
        if self.downscale is not None:
            check(self.downscale in (1, 2, 4, 8), "resolution.downscale", "1, 2, 4 or 8 (or null)", self.downscale)
        if self.max_side_px is not None:
            check(self.max_side_px >= 64, "resolution.max_side_px", "an integer >= 64 (or null)", self.max_side_px)
        check(self.downscale is None or self.max_side_px is None, "resolution",
              "at most one of downscale and max_side_px", (self.downscale, self.max_side_px))
        check(self.default_max_side_px == 0 or self.default_max_side_px >= 64, "resolution.default_max_side_px",
              "0 (full resolution) or an integer >= 64", self.default_max_side_px)


@dataclass(frozen=True)
class SceneSource:
    """One scene: where its raw capture lives and, optionally, its true cameras."""

    source: str  # folder of images or a video file; never modified (a COLMAP dataset: its root folder)
    ground_truth: str | None = None  # COLMAP text model folder, generator cameras.json, or Strecha camera folder
    # An existing COLMAP dataset (Inria / Mip-NeRF 360 layout: images/, optional images_2|4|8/, sparse/0/): the
    # model folder, relative to ``source`` (or absolute). Set: ingest reads ``source``/images and copies the
    # images_N levels; the sfm stage imports this model instead of running SfM (splatflow.scene.colmap).
    colmap: str | None = None
    masks: str | None = None  # folder of masks named like the images (white = keep); ingest copies them
    resolution: ResolutionConfig | None = None  # this scene's size; null: base.resolution
    # this scene's own settings: any keys of the stage sections, nested as in params.yaml
    # ({train: {max_steps: 1500}, prune: {phases: 2}}); checked like the sections (Params.for_scene)
    params: dict[str, Any] | None = None

    def __post_init__(self):
        if self.colmap is not None:
            check(bool(self.colmap.strip()), "base.scenes.<scene>.colmap",
                  "a COLMAP model folder such as sparse/0 (relative to source) or null", self.colmap)


@dataclass(frozen=True)
class BaseConfig:
    scenes: dict[str, SceneSource] = field(default_factory=dict)
    seed: int = 0
    threads: int = 2  # numba + torch threads per stage process
    resolution: ResolutionConfig = field(default_factory=ResolutionConfig)  # default for every scene

    def scene_resolution(self, name: str) -> ResolutionConfig:
        """The resolution block of scene ``name``: its own, else ``base.resolution``."""
        own = self.scenes[name].resolution if name in self.scenes else None
        return own if own is not None else self.resolution

    def __post_init__(self):
        check(self.threads >= 1, "base.threads", "an integer >= 1", self.threads)
        for name in self.scenes:
            check(
                bool(name) and all(c.isascii() and (c.isalnum() or c in "-_") for c in name),
                f"base.scenes.{name}",
                "a scene name of ASCII letters, digits, '-' and '_'",
                name,
            )


@dataclass(frozen=True)
class IngestConfig:
    min_side_px: int = 64  # images whose shorter side is smaller are rejected
    blur_rel_threshold: float = 0.35  # reject if sharpness < threshold * median sharpness of neighbours
    blur_window: int = 7  # neighbours (by name order) the sharpness is compared with
    blur_measure_width: int = 640  # sharpness is measured after resizing to this width (it depends on resolution)
    dedupe_max_distance: int = 10  # perceptual-hash Hamming distance (of 64 bits) at or below which images are compared
    dedupe_min_correlation: float = 0.995  # ...and then duplicates if their 128-px grey thumbnails correlate this well
    video_frames: int = 60  # frames to extract from a video source
    image_format: Literal["jpg", "png"] = "jpg"
    jpeg_quality: int = 95

    def __post_init__(self):
        check(self.min_side_px >= 8, "ingest.min_side_px", "an integer >= 8", self.min_side_px)
        check(0.0 <= self.blur_rel_threshold < 1.0, "ingest.blur_rel_threshold", "a number in [0, 1)",
              self.blur_rel_threshold)
        check(self.blur_window >= 2, "ingest.blur_window", "an integer >= 2", self.blur_window)
        check(self.blur_measure_width >= 64, "ingest.blur_measure_width", "an integer >= 64",
              self.blur_measure_width)
        check(0 <= self.dedupe_max_distance <= 32, "ingest.dedupe_max_distance", "an integer in [0, 32]",
              self.dedupe_max_distance)
        check(0.0 < self.dedupe_min_correlation <= 1.0, "ingest.dedupe_min_correlation", "a number in (0, 1]",
              self.dedupe_min_correlation)
        check(self.video_frames >= 3, "ingest.video_frames", "an integer >= 3", self.video_frames)
        check(50 <= self.jpeg_quality <= 100, "ingest.jpeg_quality", "an integer in [50, 100]", self.jpeg_quality)


@dataclass(frozen=True)
class SfmConfig:
    # Which images share intrinsics: "auto" = one camera per distinct (image size, EXIF make/model/focal length)
    # and source sub-folder, "single" = one camera for all (images must share one size), "per_folder" = one camera
    # per sub-folder of the source (ingest reads them; each folder one size), "per_image" = one camera per image.
    # Ingest reads sub-folders for per_folder, and for auto when the source has no image files of its own.
    camera_mode: Literal["auto", "single", "per_folder", "per_image"] = "auto"
    camera_model: Literal["SIMPLE_PINHOLE", "PINHOLE", "SIMPLE_RADIAL", "RADIAL", "OPENCV"] = "SIMPLE_RADIAL"
    # "auto": exhaustive up to `exhaustive_max_images` images, sequential beyond (or for video sources).
    matcher: Literal["auto", "exhaustive", "sequential"] = "auto"
    exhaustive_max_images: int = 120
    sequential_overlap: int = 10
    # "auto": global mapping for sets past `exhaustive_max_images` (matched sequentially: incremental mapping lets
    # drift along a long walk-around stand, global mapping solves every camera at once), incremental below
    mapper: Literal["auto", "incremental", "global"] = "auto"
    max_num_features: int = 8192
    min_registered_fraction: float = 0.8  # fewer registered images than this fraction fails the stage
    refine_principal_point: bool = False
    # COLMAP's feature extraction, matching and mapping on several threads give a slightly different model from
    # run to run (the demo: 3794-3803 points, then 26.10-26.37 dB after training; bench/RESULTS.md). true: they run
    # on one thread, and a rerun gives the same model (slower on large captures); undistortion keeps base.threads
    deterministic: bool = False

    def __post_init__(self):
        check(self.exhaustive_max_images >= 2, "sfm.exhaustive_max_images", "an integer >= 2",
              self.exhaustive_max_images)
        check(self.sequential_overlap >= 1, "sfm.sequential_overlap", "an integer >= 1", self.sequential_overlap)
        check(self.max_num_features >= 256, "sfm.max_num_features", "an integer >= 256", self.max_num_features)
        check(0.0 < self.min_registered_fraction <= 1.0, "sfm.min_registered_fraction", "a number in (0, 1]",
              self.min_registered_fraction)


@dataclass(frozen=True)
class SplitConfig:
    rule: Literal["every_nth", "fraction"] = "every_nth"
    every_n: int = 8  # index % every_n == 0 is a test view (the standard protocol)
    test_fraction: float = 0.125  # for rule "fraction": evenly spaced test views
    # named test views (e.g. another tool's hold-out); when given they replace the rule
    test_names: tuple[str, ...] | None = None

    def __post_init__(self):
        if self.test_names is not None:
            check(len(self.test_names) >= 1 and all(n.strip() for n in self.test_names), "split.test_names",
                  "a non-empty list of image names, or null", self.test_names)
            dup = sorted({n for n in self.test_names if self.test_names.count(n) > 1})
            check(not dup, "split.test_names", f"a list without repeats ({', '.join(dup)} repeated)",
                  self.test_names)
        check(self.every_n >= 2, "split.every_n", "an integer >= 2", self.every_n)
        check(0.0 < self.test_fraction < 1.0, "split.test_fraction", "a number in (0, 1)", self.test_fraction)


@dataclass(frozen=True)
class ResolutionPhase:
    """One progressive-resolution phase: train at ``factor`` x full resolution from its start on.

    Give the start either as an absolute step (``start_step``) or as a fraction of ``train.max_steps``
    (``start_fraction``), not both.
    """

    factor: float
    start_step: int | None = None
    start_fraction: float | None = None

    def __post_init__(self):
        check(0.0 < self.factor <= 1.0, "train.resolution[].factor", "a number in (0, 1]", self.factor)
        check((self.start_step is None) != (self.start_fraction is None), "train.resolution[]",
              "exactly one of start_step or start_fraction", (self.start_step, self.start_fraction))
        if self.start_step is not None:
            check(self.start_step >= 0, "train.resolution[].start_step", "an integer >= 0", self.start_step)
        if self.start_fraction is not None:
            check(0.0 <= self.start_fraction < 1.0, "train.resolution[].start_fraction", "a number in [0, 1)",
                  self.start_fraction)


def _default_phases() -> tuple[ResolutionPhase, ...]:
    return (ResolutionPhase(0.125, start_fraction=0.0), ResolutionPhase(0.25, start_fraction=0.05),
            ResolutionPhase(0.5, start_fraction=0.15), ResolutionPhase(0.75, start_fraction=0.35),
            ResolutionPhase(1.0, start_fraction=0.6))


@dataclass(frozen=True)
class BlurConfig:
    """Progressive blur of render and target: sigma (px at the current resolution) falls linearly to 0."""

    sigma_start_px: float = 2.4
    end_fraction: float = 0.5  # sigma reaches 0 at this fraction of max_steps

    def __post_init__(self):
        check(self.sigma_start_px >= 0.0, "train.blur.sigma_start_px", "a number >= 0", self.sigma_start_px)
        check(0.0 <= self.end_fraction <= 1.0, "train.blur.end_fraction", "a number in [0, 1]", self.end_fraction)


@dataclass(frozen=True)
class LearningRates:
    """Adam learning rate per parameter group (3DGS reference values; means scaled by the scene scale)."""

    means: float = 1.6e-4
    means_final_factor: float = 0.01  # means lr decays exponentially to this factor at max_steps
    scales: float = 5e-3
    quats: float = 1e-3
    opacities: float = 5e-2
    sh0: float = 2.5e-3
    shN: float = 2.5e-3 / 20

    def __post_init__(self):
        for name in ("means", "scales", "quats", "opacities", "sh0", "shN"):
            v = getattr(self, name)
            check(0.0 < v < 1.0, f"train.lr.{name}", "a number in (0, 1)", v)
        check(0.0 < self.means_final_factor <= 1.0, "train.lr.means_final_factor", "a number in (0, 1]",
              self.means_final_factor)


@dataclass(frozen=True)
class DensifyConfig:
    """Densification policy (gsplat strategies) and the Gaussian budget (Taming 3DGS)."""

    strategy: Literal["default", "mcmc", "none"] = "default"
    refine_start_fraction: float = 0.05
    refine_stop_fraction: float = 0.6
    refine_every: int = 100
    # opacity reset period (default strategy) and the step after which refines also prune too-large Gaussians; 0
    # disables both (the default: a reset costs more than it cleans in a 5-minute schedule, bench/RESULTS.md)
    reset_every: int = 0
    grow_grad2d: float = 0.0002
    grow_scale3d: float = 0.01
    prune_opa: float = 0.005
    prune_scale3d: float = 0.1
    absgrad: bool = False
    # hard cap on the count; "auto": sized from the scene and the device (splatflow.train.plan, train.quality)
    max_gaussians: int | Literal["auto"] = "auto"
    # cap = min(max_gaussians, budget_multiplier * initial count); 16x: +0.35 dB test PSNR on the demo over 8x, and
    # the redundancy that lets pruning to 10% cost < 1 dB (docs/experiments.md, Pruning, 2026-11-25)
    budget_multiplier: float = 16.0
    # the cap grows linearly from the initial count to the whole budget at this fraction of max_steps (0: the whole
    # budget from the start): the count grows with the training resolution, so early low-resolution steps carry
    # fewer Gaussians (primitive growth scheduled with resolution, as DashGaussian, Chen et al. CVPR 2025)
    budget_ramp_fraction: float = 0.0
    mcmc_noise_lr: float = 5e5
    mcmc_min_opacity: float = 0.005
    mcmc_scale_reg: float = 0.01
    mcmc_opacity_reg: float = 0.01

    def __post_init__(self):
        check(0.0 <= self.refine_start_fraction <= self.refine_stop_fraction <= 1.0,
              "train.densify.refine_start_fraction/refine_stop_fraction", "0 <= start <= stop <= 1",
              (self.refine_start_fraction, self.refine_stop_fraction))
        check(self.refine_every >= 1, "train.densify.refine_every", "an integer >= 1", self.refine_every)
        check(self.reset_every >= 0, "train.densify.reset_every", "an integer >= 0 (0 disables)", self.reset_every)
        check(self.grow_grad2d > 0, "train.densify.grow_grad2d", "a number > 0", self.grow_grad2d)
        check(self.grow_scale3d > 0, "train.densify.grow_scale3d", "a number > 0", self.grow_scale3d)
        check(0.0 <= self.prune_opa < 1.0, "train.densify.prune_opa", "a number in [0, 1)", self.prune_opa)
        check(self.prune_scale3d > 0, "train.densify.prune_scale3d", "a number > 0", self.prune_scale3d)
        check(self.max_gaussians == "auto" or self.max_gaussians >= 1, "train.densify.max_gaussians",
              "auto or an integer >= 1", self.max_gaussians)
        check(self.budget_multiplier >= 1.0, "train.densify.budget_multiplier", "a number >= 1",
              self.budget_multiplier)
        check(0.0 <= self.budget_ramp_fraction <= 1.0, "train.densify.budget_ramp_fraction",
              "a number in [0, 1] (0: the whole budget from the start)", self.budget_ramp_fraction)
        check(self.mcmc_noise_lr >= 0, "train.densify.mcmc_noise_lr", "a number >= 0", self.mcmc_noise_lr)
        check(0.0 <= self.mcmc_min_opacity < 1.0, "train.densify.mcmc_min_opacity", "a number in [0, 1)",
              self.mcmc_min_opacity)
        check(self.mcmc_scale_reg >= 0, "train.densify.mcmc_scale_reg", "a number >= 0", self.mcmc_scale_reg)
        check(self.mcmc_opacity_reg >= 0, "train.densify.mcmc_opacity_reg", "a number >= 0", self.mcmc_opacity_reg)


@dataclass(frozen=True)
class AppearanceConfig:
    """Per-image appearance compensation (splatflow.train.appearance): an affine colour transform per training
    view, learnt from ``start_fraction`` of the steps on, identity at evaluation and export."""

    enabled: bool = False
    lr: float = 1.0e-3
    start_fraction: float = 0.1
    reg: float = 0.0  # weight of |transform - identity|^2 in the loss

    def __post_init__(self):
        check(self.lr > 0, "train.appearance.lr", "a number > 0", self.lr)
        check(0.0 <= self.start_fraction < 1.0, "train.appearance.start_fraction", "a number in [0, 1)",
              self.start_fraction)
        check(self.reg >= 0, "train.appearance.reg", "a number >= 0", self.reg)


@dataclass(frozen=True)
class EarlyStopConfig:
    """PSNR-plateau early stop on a few TRAINING views (never test views).

    ``patience_steps`` is given for a ``reference_steps``-long run and scaled linearly to ``max_steps``.
    The plateau is only judged once the last resolution phase has started and the blur has ended: before that,
    PSNR moves because the schedule moves.
    """

    # "auto": on for the CPU backend (its steps are costly, a plateau saves minutes), off on CUDA (the field's fixed
    # 30K steps take minutes there, and the plateau on three training views stopped a GPU run at 20K of 23.7K while
    # test PSNR still rose 0.07 dB per 1,000 steps: bench/RESULTS.md "GPU path"). Resolved by the plan
    enabled: bool | Literal["auto"] = "auto"
    eval_every: int = 100
    patience_steps: int = 1000
    reference_steps: int = 6000
    min_delta_db: float = 0.1
    val_views: int = 3
    val_factor: float = 1.0  # resolution factor the validation renders use

    def __post_init__(self):
        check(self.enabled in (True, False, "auto"), "train.early_stop.enabled", "auto, true or false", self.enabled)
        check(self.eval_every >= 1, "train.early_stop.eval_every", "an integer >= 1", self.eval_every)
        check(self.patience_steps >= 1, "train.early_stop.patience_steps", "an integer >= 1", self.patience_steps)
        check(self.reference_steps >= 1, "train.early_stop.reference_steps", "an integer >= 1",
              self.reference_steps)
        check(self.min_delta_db >= 0, "train.early_stop.min_delta_db", "a number >= 0", self.min_delta_db)
        check(self.val_views >= 1, "train.early_stop.val_views", "an integer >= 1", self.val_views)
        check(0.0 < self.val_factor <= 1.0, "train.early_stop.val_factor", "a number in (0, 1]", self.val_factor)


@dataclass(frozen=True)
class PruneDuringConfig:
    """Pruning inside the last part of training (``splatflow.train.prune_during``): ``phases`` cuts at evenly
    spaced steps from ``start_fraction`` to ``end_fraction`` of ``max_steps``, each keeping a geometric share of the
    Gaussians counted at the first cut (``keep_final`` after the last), ranked by the removal cost (as the prune
    stage's default score) on ``score_views`` training views, in ``score_rounds`` re-scored sub-cuts. The training
    steps after each cut are its recovery, so pruning costs the scoring only. Early stop: a phase whose validation
    PSNR (the training's own validation views) is more than ``max_psnr_drop_db`` below the PSNR just before the
    first cut is undone (the model, its optimizer state and its training go back to before that cut) and no
    further cut is made. The prune stage then only verifies and copies the model.
    """

    enabled: bool = False  # on real captures its cuts cost 1-2.5 dB (bench/RESULTS.md "Real captures")
    start_fraction: float = 0.6  # first cut, as a fraction of max_steps (not before densification stops)
    end_fraction: float = 0.75  # last cut; the steps after it recover the final model
    phases: int = 3
    keep_final: float = 0.1  # fraction of the Gaussians at the first cut kept after the last
    score_rounds: int = 4  # re-scored geometric sub-cuts per phase (as prune.score_rounds)
    score_views: int = 16  # training views the removal cost is summed over, evenly spaced (0 = all)
    max_psnr_drop_db: float = 2.0  # early stop, against the validation PSNR just before the first cut
    recovery_lr_boost: float = 1.0  # means LR x this right after a cut, back to the schedule by the next cut (1 = off)

    def __post_init__(self):
        check(0.0 < self.start_fraction < 1.0, "train.prune_during.start_fraction", "a number in (0, 1)",
              self.start_fraction)
        check(self.start_fraction <= self.end_fraction < 1.0, "train.prune_during.end_fraction",
              "a number in [start_fraction, 1)", self.end_fraction)
        check(1 <= self.phases <= 20, "train.prune_during.phases", "an integer in [1, 20]", self.phases)
        check(0.0 < self.keep_final < 1.0, "train.prune_during.keep_final", "a number in (0, 1)", self.keep_final)
        check(1 <= self.score_rounds <= 20, "train.prune_during.score_rounds", "an integer in [1, 20]",
              self.score_rounds)
        check(self.score_views >= 0, "train.prune_during.score_views", "an integer >= 0 (0 = all training views)",
              self.score_views)
        check(self.max_psnr_drop_db >= 0.0, "train.prune_during.max_psnr_drop_db", "a number >= 0",
              self.max_psnr_drop_db)
        check(1.0 <= self.recovery_lr_boost <= 100.0, "train.prune_during.recovery_lr_boost",
              "a number in [1, 100] (1 = the schedule's rate)", self.recovery_lr_boost)


@dataclass(frozen=True)
class TrainConfig:
    """Training: every behaviour of the loop is one of these named settings."""

    # "auto": steps sized from the scene (training views x pixels) and the device (splatflow.train.plan); a number
    # pins it. train.quality scales the auto plan: draft (about half the time), standard, max (no time limit).
    max_steps: int | Literal["auto"] = "auto"
    quality: Literal["draft", "standard", "max"] = "standard"
    sh_degree: int = 3  # highest SH degree (its coefficients are allocated from the start)
    sh_degree_interval: int = 500  # active SH degree rises by one every this many steps
    init_opacity: float = 0.1
    init_scale: float = 1.0  # multiplies the mean 3-NN distance
    ssim_lambda: float = 0.2  # loss = (1 - l) L1 + l (1 - SSIM)
    random_background: bool = False
    # pixels rendered per step: a level with more pixels trains on a random window of this area (same aspect,
    # full detail) instead of the whole image; 0 = always whole images; "auto" = CPU_WINDOW_PIXELS on the CPU
    # backend, whole images on CUDA (a GPU step is launch-bound: windows only cost it quality; see window_pixels)
    patch_max_pixels: int | Literal["auto"] = "auto"
    # a lower-resolution level (factor f < 1) trains on windows of patch_max_pixels / f^exponent pixels (whole images
    # once that exceeds the level): its steps cost little more and see more of the scene; 0 = the same area at every
    # level (docs/experiments.md, Training, 2026-11-25 22:50: exponent 1 gained 0.7 dB at the same training time)
    patch_level_exponent: float = 1.0
    # Adam updates only the Gaussians a step's render reaches (gsplat's visible_adam); others keep params + moments
    visible_adam: bool = False
    # CPU backend: a step activates, projects and updates only the Gaussians its window can reach (splatflow.train.
    # sparse), with Adam brought up to date lazily so the result is dense Adam's; false = every Gaussian every step
    sparse_step: bool = True
    # CPU backend: keep the Gaussians sorted along a Morton curve of their positions (at the start and after every
    # densification event), so a window's rows are contiguous in memory (splatflow.train.rows); false = the order
    # densification leaves them in
    spatial_order: bool = True
    backend: Literal["auto", "cpu", "cuda", "torch"] = "auto"
    # classic: 3DGS's 0.3 px screen-space dilation; antialiased: the dilation with its opacity compensation
    # (Mip-Splatting's 2D filter, gsplat's rasterize_mode). The model records it; evaluate renders with it
    rasterize_mode: Literal["classic", "antialiased"] = "classic"
    # Mip-Splatting's 3D smoothing filter (splatflow.gaussians.smoothing): every Gaussian low-passed to what the
    # training cameras can resolve (variance 0.2 px^2 at its highest sampling rate), recomputed at the start and
    # after each densification event. The checkpoint keeps the filter; export bakes it into scales and opacities
    filter_3d: bool = False
    lr: LearningRates = field(default_factory=LearningRates)
    resolution: tuple[ResolutionPhase, ...] = field(default_factory=_default_phases)
    blur: BlurConfig = field(default_factory=BlurConfig)
    # true: the resolution and blur schedules above; false: whole resolution and no blur from the first step;
    # "auto": true on the CPU backend (its early steps are cheap at low resolution), false on CUDA (a GPU step costs
    # about the same at any size, so a coarse start only delays the detail). Resolved by the plan (train/plan.py)
    coarse_to_fine: bool | Literal["auto"] = "auto"
    densify: DensifyConfig = field(default_factory=DensifyConfig)
    early_stop: EarlyStopConfig = field(default_factory=EarlyStopConfig)
    appearance: AppearanceConfig = field(default_factory=AppearanceConfig)
    prune_during: PruneDuringConfig = field(default_factory=PruneDuringConfig)
    # steps between checkpoints; "auto": 1000 on the CPU, 5000 on CUDA (train/plan.py: a GPU does 1000 steps in
    # ~10 s and a checkpoint of a million Gaussians costs it ~1 s)
    checkpoint_every: int | Literal["auto"] = "auto"
    resume: bool = True  # continue from an unfinished checkpoint of the same config
    log_every: int = 10  # rows in plots/S/train.csv and batched MLflow step metrics
    image_cache_mb: int = 2048
    progress: bool = True

    def __post_init__(self):
        check(self.max_steps == "auto" or self.max_steps >= 1, "train.max_steps", "auto or an integer >= 1",
              self.max_steps)
        check(0 <= self.sh_degree <= 3, "train.sh_degree", "an integer in [0, 3]", self.sh_degree)
        check(self.sh_degree_interval >= 1, "train.sh_degree_interval", "an integer >= 1", self.sh_degree_interval)
        check(0.0 < self.init_opacity < 1.0, "train.init_opacity", "a number in (0, 1)", self.init_opacity)
        check(self.init_scale > 0, "train.init_scale", "a number > 0", self.init_scale)
        check(0.0 <= self.ssim_lambda <= 1.0, "train.ssim_lambda", "a number in [0, 1]", self.ssim_lambda)
        check(self.patch_max_pixels == "auto" or self.patch_max_pixels == 0 or self.patch_max_pixels >= 1024,
              "train.patch_max_pixels", "auto, 0 (whole images) or an integer >= 1024", self.patch_max_pixels)
        check(0.0 <= self.patch_level_exponent <= 4.0, "train.patch_level_exponent", "a number in [0, 4]",
              self.patch_level_exponent)
        check(self.coarse_to_fine in (True, False, "auto"), "train.coarse_to_fine", "auto, true or false",
              self.coarse_to_fine)
        check(len(self.resolution) >= 1, "train.resolution", "a non-empty list of phases", self.resolution)
        steps = self.max_steps if self.max_steps != "auto" else 10_000  # fractions keep their order at any length
        starts = [p.start_step if p.start_step is not None else p.start_fraction * steps
                  for p in self.resolution]
        check(starts[0] == 0, "train.resolution[0]", "a first phase starting at step 0", self.resolution[0])
        check(all(a < b for a, b in zip(starts, starts[1:])), "train.resolution",
              "phases with strictly increasing starts", starts)
        check(self.checkpoint_every == "auto" or self.checkpoint_every >= 1, "train.checkpoint_every",
              "auto or an integer >= 1", self.checkpoint_every)
        check(self.log_every >= 1, "train.log_every", "an integer >= 1", self.log_every)
        check(self.image_cache_mb >= 16, "train.image_cache_mb", "an integer >= 16", self.image_cache_mb)
        pd = self.prune_during
        # a cut while densification still runs would be refilled by it (and its per-Gaussian state re-sized)
        check(not pd.enabled or self.densify.strategy == "none"
              or pd.start_fraction >= self.densify.refine_stop_fraction, "train.prune_during.start_fraction",
              f"a fraction >= train.densify.refine_stop_fraction ({self.densify.refine_stop_fraction})",
              pd.start_fraction)

    @property
    def planned(self) -> bool:
        """True when the step count, the Gaussian budget and the schedule are settled (pinned, or resolved by the
        plan)."""
        return "auto" not in (self.max_steps, self.densify.max_gaussians, self.coarse_to_fine, self.checkpoint_every,
                              self.early_stop.enabled)

    def window_pixels(self, backend: str) -> int:
        """The window area a run on ``backend`` ("cpu", "cuda", "torch") trains on: ``patch_max_pixels``, with
        "auto" resolved per backend. On the CPU a step's cost grows with its pixels, so 60K-pixel windows buy more
        steps per minute (docs/experiments.md, Training, 2026-11-25 22:50); a GPU step is bound by its ~180 kernel
        launches, not its pixels, so windows only cost it quality: whole images on an H100 trained the 36-view
        benchmark scene to 30.56-30.57 dB in 39-40 s against 29.84-30.12 dB in 52-59 s with windows
        (bench/RESULTS.md, "GPU path")."""
        if self.patch_max_pixels == "auto":
            return 0 if backend == "cuda" else CPU_WINDOW_PIXELS
        return int(self.patch_max_pixels)


@dataclass(frozen=True)
class PruneConfig:
    """Phased pruning with recovery after LightGaussian (Fan et al. 2023), each Gaussian scored by the
    exact cost of removing it (``score: removal``, the default) or by LightGaussian's global significance.

    Phase ``k`` (0-based) keeps ``keep_first * keep_decay**k`` of the TRAINED model's Gaussians (default: one
    phase to half; on real captures deeper cuts cost 1-2.5 dB, bench/RESULTS.md "Real captures"); each phase is followed by ``finetune_steps * keep**-finetune_growth``
    steps of recovery training without densification. Pruning stops early, keeping the last accepted phase, when
    the PSNR on ``val_views`` TRAINING views (never test views) falls more than ``max_psnr_drop_db`` below the
    unpruned model's. ``enabled: false``, ``phases: 0`` or a schedule that keeps everything is a no-op that still
    writes the outputs. ``volume_beta``/``volume_ref_quantile`` (significance only): the volume weight
    ``clamp(V / V_ref, 0, 1)**beta`` with ``V_ref`` the volume that a fraction ``1 - volume_ref_quantile`` of the
    Gaussians exceed (paper: 90%).
    """

    enabled: bool = True
    keep_first: float = 0.5  # fraction of the trained model's Gaussians kept after the first phase
    keep_decay: float = 0.7  # each later phase keeps this fraction of the previous phase's target
    phases: int = 1
    finetune_steps: int = 2000  # recovery steps after each phase (no densification), x keep^-finetune_growth
    # recovery steps grow as the model shrinks: finetune_steps x keep_fraction^-finetune_growth (0: constant);
    # a step of a smaller model is cheaper, so 0.5 keeps each phase's recovery time roughly level
    finetune_growth: float = 0.5
    # early stop: validation PSNR below (before - this) rejects the phase. The validation views are TRAINING views,
    # which the unpruned model fits better than unseen ones, so they overstate the loss (demo, 10%: 1.70 dB on
    # training views for 0.89 dB on the test views); 2 dB there still catches a pruning that breaks the model
    max_psnr_drop_db: float = 0.5
    val_views: int = 4  # evenly spaced TRAINING views for the validation PSNR
    # fewer training views: no pruning (the model is copied). On 10 views a halving's recovery raised the training
    # views' PSNR while the test view lost 2.5 dB: the check on training views cannot see it
    min_train_views: int = 24
    val_factor: float = 1.0  # resolution factor of the validation renders (full: pruning loses fine detail first)
    # what ranks the Gaussians: "significance" (LightGaussian: alpha x transmittance summed over the training
    # pixels, x a volume weight) or "removal" (the exact growth of the training views' squared error if the
    # Gaussian alone were removed)
    score: Literal["significance", "removal"] = "removal"
    # each phase cuts in this many geometric steps, re-scoring the survivors before each: a Gaussian whose
    # look-alike neighbour was just cut becomes expensive to remove (1: one cut per phase, as LightGaussian)
    score_rounds: int = 4
    score_factor: float = 1.0  # resolution factor of the renders that measure the scores
    # position learning rate of the recovery, as a factor of train.lr.means (x scene scale): training ends at
    # train.lr.means_final_factor (0.01), too slow for the survivors to move into the gaps the cut ones leave
    finetune_means_lr: float = 0.01
    # Adam state of the recovery: "trained" continues from the trained model's moments (rows of the kept
    # Gaussians, as LightGaussian's recovery keeps the optimizer); "fresh" starts Adam from zero
    finetune_adam: Literal["trained", "fresh"] = "trained"
    volume_beta: float = 0.1
    volume_ref_quantile: float = 0.1
    backend: Literal["auto", "cpu", "cuda", "torch"] = "auto"
    progress: bool = True

    def __post_init__(self):
        check(0.0 < self.keep_first <= 1.0, "prune.keep_first", "a number in (0, 1]", self.keep_first)
        check(0.0 < self.keep_decay <= 1.0, "prune.keep_decay", "a number in (0, 1]", self.keep_decay)
        check(0 <= self.phases <= 50, "prune.phases", "an integer in [0, 50] (0 disables pruning)", self.phases)
        check(self.finetune_steps >= 0, "prune.finetune_steps", "an integer >= 0", self.finetune_steps)
        check(0.0 <= self.finetune_growth <= 2.0, "prune.finetune_growth", "a number in [0, 2]",
              self.finetune_growth)
        check(self.max_psnr_drop_db >= 0.0, "prune.max_psnr_drop_db", "a number >= 0", self.max_psnr_drop_db)
        check(self.val_views >= 1, "prune.val_views", "an integer >= 1", self.val_views)
        check(self.min_train_views >= 0, "prune.min_train_views", "an integer >= 0 (0: prune any scene)",
              self.min_train_views)
        check(0.0 < self.val_factor <= 1.0, "prune.val_factor", "a number in (0, 1]", self.val_factor)
        check(self.score in ("significance", "removal"), "prune.score", "significance or removal", self.score)
        check(1 <= self.score_rounds <= 20, "prune.score_rounds", "an integer in [1, 20]", self.score_rounds)
        check(0.0 < self.finetune_means_lr <= 1.0, "prune.finetune_means_lr", "a number in (0, 1]",
              self.finetune_means_lr)
        check(self.finetune_adam in ("trained", "fresh"), "prune.finetune_adam", "trained or fresh",
              self.finetune_adam)
        check(0.0 < self.score_factor <= 1.0, "prune.score_factor", "a number in (0, 1]", self.score_factor)
        check(0.0 <= self.volume_beta <= 1.0, "prune.volume_beta", "a number in [0, 1] (0: no volume term)",
              self.volume_beta)
        check(0.0 <= self.volume_ref_quantile < 1.0, "prune.volume_ref_quantile", "a number in [0, 1)",
              self.volume_ref_quantile)


LpipsVariant = Literal["lpips_vgg_01", "lpips_vgg", "lpips_alex"]


@dataclass(frozen=True)
class EvaluateConfig:
    """Evaluation on the split's test views (docs/design.md §6).

    ``lpips_variants``: ``lpips_vgg_01`` = VGG on [0, 1] inputs (3DGS paper code), ``lpips_vgg`` = VGG on
    [-1, 1] (nerfbaselines), ``lpips_alex`` = AlexNet on [-1, 1] (gsplat, nerfstudio).
    ``lpips_backbone_dir``: folder holding ``alexnet-owt-7be5be79.pth`` / ``vgg16-397923af.pth``; null means the
    torch hub cache (``torch.hub.get_dir()/checkpoints``). Missing weights make LPIPS null with a reason.
    """

    lpips_variants: tuple[LpipsVariant, ...] = ("lpips_vgg_01", "lpips_vgg", "lpips_alex")
    lpips_backbone_dir: str | None = None
    backend: Literal["auto", "cpu", "cuda", "torch"] = "auto"
    save_renders: bool = True  # data/S/renders/<view>.png: render | ground truth | error map
    error_gain: float = 4.0  # the error map shows gain * |render - gt| (clipped), so small errors are visible
    quantize_8bit: bool = False  # round renders to 8 bits before the metrics (as when comparing saved PNGs)

    def __post_init__(self):
        check(len(set(self.lpips_variants)) == len(self.lpips_variants), "evaluate.lpips_variants",
              "a list without repeats", self.lpips_variants)
        check(self.error_gain > 0, "evaluate.error_gain", "a number > 0", self.error_gain)


@dataclass(frozen=True)
class ExportConfig:
    """Exported files (models/S/export/scene.<format>); each is read back and checked after writing."""

    formats: tuple[Literal["ply", "splat", "spz"], ...] = ("ply", "splat", "spz")
    spz_version: int = 3  # 3: smallest-three quaternions (10 bit); 2: xyz of the quaternion (8 bit)
    # Our world frame follows COLMAP/PLY (x right, y down, z forward: "RDF"); SPZ stores RUB, so it is converted.
    # "none" writes the coordinates unchanged (what Niantic's tools do when no frame is given).
    spz_from_coordinates: Literal["RDF", "none"] = "RDF"

    def __post_init__(self):
        check(len(self.formats) >= 1 and len(set(self.formats)) == len(self.formats), "export.formats",
              "a non-empty list of ply, splat, spz without repeats", self.formats)
        check(self.spz_version in (2, 3), "export.spz_version", "2 or 3", self.spz_version)


@dataclass(frozen=True)
class ReportConfig:
    """The per-scene report (reports/S/index.html): one self-contained page with an embedded 3D viewer."""

    # The embedded splat is cut to the most important Gaussians (opacity x volume) above this count, so the page
    # stays small enough to open anywhere; the full exported file is linked beside it.
    preview_max_gaussians: int = 200000
    preview_sh_degree: int = 3  # SH bands kept in the embedded preview (0-3; fewer bands, smaller page)
    max_test_views: int = 60  # test views shown as render | ground truth | error (the first ones by name)

    def __post_init__(self):
        check(self.preview_max_gaussians >= 1, "report.preview_max_gaussians", ">= 1", self.preview_max_gaussians)
        check(0 <= self.preview_sh_degree <= 3, "report.preview_sh_degree", "0, 1, 2 or 3", self.preview_sh_degree)
        check(self.max_test_views >= 0, "report.max_test_views", ">= 0", self.max_test_views)


@dataclass(frozen=True)
class Params:
    base: BaseConfig = field(default_factory=BaseConfig)
    ingest: IngestConfig = field(default_factory=IngestConfig)
    sfm: SfmConfig = field(default_factory=SfmConfig)
    split: SplitConfig = field(default_factory=SplitConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    prune: PruneConfig = field(default_factory=PruneConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    report: ReportConfig = field(default_factory=ReportConfig)

    def scene(self, name: str) -> SceneSource:
        if name not in self.base.scenes:
            known = ", ".join(sorted(self.base.scenes)) or "none"
            raise ConfigError(
                f"params.yaml: scene {name!r} is not in base.scenes (known: {known}); "
                f"register it with `splatflow add-scene {name} PATH`"
            )
        return self.base.scenes[name]

    def for_scene(self, name: str) -> "Params":
        """The effective params of scene ``name``: its ``base.scenes.<name>.params`` overrides merged into the
        stage sections (mappings merged key by key, any other value, lists included, replaced), checked exactly
        as params.yaml is. Every stage of a scene runs with these, and logs them."""
        self.scene(name)
        return _scene_params(self, name)


STAGE_SECTIONS = ("ingest", "sfm", "split", "train", "prune", "evaluate", "export", "report")


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _scene_params(params: Params, name: str) -> Params:
    over = params.base.scenes[name].params
    if not over:
        return params
    where = f"params.yaml: scene {name!r} (base.scenes.{name}.params)"
    changes = {}
    for section, values in over.items():
        if section not in STAGE_SECTIONS:
            raise ConfigError(f"{where}: unknown section {section!r}; a scene may override only the stage "
                              f"sections {', '.join(STAGE_SECTIONS)}")
        if not isinstance(values, dict):
            raise ConfigError(f"{where}: {section} = {values!r} is not allowed; expected a mapping of "
                              f"{section} keys, e.g. {{{section}: {{key: value}}}}")
        current = getattr(params, section)
        try:
            changes[section] = _build(type(current), _merge(section_dict(current), values), section)
        except ConfigError as e:
            msg = str(e).removeprefix("params.yaml: ")
            raise ConfigError(f"{where}: {msg}") from None
    return dataclasses.replace(params, **changes)


# --------------------------------------------------------------------------------------------- loader


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if dataclasses.is_dataclass(tp):
        return f"a mapping ({tp.__name__})"
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, key: str) -> Any:
    """Convert a YAML value to the annotated type, or raise ConfigError naming ``key``."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else
                          f"params.yaml: {key} = {value!r} is not allowed; expected "
                          + " or ".join(_type_name(a) for a in args))
    if origin is Literal:
        check(value in args, key, _type_name(tp), value)
        return value
    if dataclasses.is_dataclass(tp):
        if tp is SceneSource and isinstance(value, str):  # shorthand `name: path`
            value = {"source": value}
        check(isinstance(value, dict), key, _type_name(tp), value)
        return _build(tp, value, key)
    if origin in (list, tuple):
        check(isinstance(value, (list, tuple)), key, "a list", value)
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            check(len(value) == len(args), key, f"a list of {len(args)} items", value)
            return tuple(_convert(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        item_tp = args[0] if args else Any
        out = [_convert(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(out)  # frozen configs hold tuples
    if origin is dict:
        check(isinstance(value, dict), key, "a mapping", value)
        k_tp, v_tp = args if args else (Any, Any)
        if k_tp is str:
            for k in value:
                if not isinstance(k, str):  # YAML reads 123: or true: as a number or a bool; DVC keeps it so, and
                    # then makes no stages for it
                    raise ConfigError(f"params.yaml: {key}.{k}: this key is read as the {type(k).__name__} {k!r}, "
                                      f"not a name; write it quoted ('{k}':)")
        return {str(k): _convert(v, v_tp, f"{key}.{k}") for k, v in value.items()}
    if tp is bool:
        check(isinstance(value, bool), key, "true or false", value)
        return value
    if tp is int:
        check(isinstance(value, int) and not isinstance(value, bool), key, "an integer", value)
        return value
    if tp is float:
        if isinstance(value, str) and _YAML11_FLOAT.fullmatch(value.strip()):
            return float(value)  # 8e-5: PyYAML (YAML 1.1) reads it as text; DVC's YAML 1.2 as the number it is
        check(isinstance(value, (int, float)) and not isinstance(value, bool), key, "a number", value)
        return float(value)
    if tp is str:
        check(isinstance(value, str), key, "a string", value)
        return value
    raise ConfigError(f"params.yaml: {key}: unsupported type {tp!r} in the config schema")


# exponent notation without a dot (8e-5, 1E+3), which YAML 1.1 leaves a string
_YAML11_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _build(cls: type, data: dict, prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        allowed = ", ".join(sorted(fields)) or "(no keys)"
        raise ConfigError(
            f"params.yaml: unknown key {prefix + '.' if prefix else ''}{unknown[0]}; "
            f"allowed keys{' in ' + prefix if prefix else ''}: {allowed}"
        )
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else name
        kwargs[name] = _convert(value, hints[name], key)
    if cls is ResolutionConfig and prefix:  # the same block sits in base and in each scene: name the one at fault
        try:
            return cls(**kwargs)
        except ConfigError as e:
            raise ConfigError(str(e).replace("params.yaml: resolution", f"params.yaml: {prefix}", 1)) from None
    return cls(**kwargs)


def params_from_dict(data: dict | None) -> Params:
    """Build :class:`Params` from a parsed params.yaml mapping (strict)."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError("params.yaml: the top level must be a mapping of sections")
    params = _build(Params, data, "")
    for name in params.base.scenes:  # a scene's overrides fail on load, not when its stage starts
        _scene_params(params, name)
    return params


def load_params(path: str | Path = "params.yaml") -> Params:
    """Load and validate ``params.yaml``."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path}: not found; run from the project root (where params.yaml lives)")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from e
    return params_from_dict(data)


def section_dict(cfg: Any) -> dict:
    """A config dataclass as plain nested dicts/lists (for logging and JSON)."""

    def plain(v):
        if dataclasses.is_dataclass(v):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    return plain(cfg)


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """``{"train": {"lr": {"means": 1}}}`` -> ``{"train.lr.means": 1}`` (lists kept as values)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict):
            out.update(flatten(v, key))
        else:
            out[key] = v
    return out
