"""Evaluation under the standard novel-view-synthesis protocol (docs/design.md §6).

* Only the split's TEST views are opened (the split's rule: every 8th image by name, as Mip-NeRF 360 and the
  3DGS paper, Kerbl et al. 2023); training images are never read, so a number here is never a training-set score.
* Gradients are off and one (render, ground truth) pair lives in memory at a time: memory stays flat however many
  views there are.
* PSNR and SSIM on RGB in [0, 1] (float renders clamped to [0, 1]; the ground truth comes from 8-bit files);
  optionally the render is rounded to 8 bits first, as when scoring saved PNGs. LPIPS variants are stored under
  their own names (:mod:`splatflow.evaluation.lpips`), null with the reason when weights are missing.
* Render time is the wall clock of one ``rasterize`` call per view (batch of one camera), after one untimed
  warm-up render (the first call compiles/caches kernels); FPS = 1 / mean render time.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from splatflow.pipeline import device as devices
from splatflow.pipeline.config import EvaluateConfig
from splatflow.pipeline.errors import UserError
from splatflow.evaluation.lpips import VARIANT_INPUTS, LpipsSet
from splatflow.evaluation.metrics import masked_pair, masked_psnr, masked_ssim, psnr, quantize_8bit, ssim
from splatflow.gaussians.model import Checkpoint, Splats, render_view
from splatflow.pipeline.runtime_env import peak_rss_mb
from splatflow.scene.dataset import load_scene, read_split
from splatflow.scene.masks import read_view_mask

PER_VIEW_COLUMNS = ["view", "width", "height", "psnr", "ssim", "lpips_vgg_01", "lpips_vgg", "lpips_alex",
                    "render_seconds", "rss_mb"]


def per_view_schema():
    """pandera schema of ``metrics/S/per_view.csv`` (coerce=True: pandas 3 reads strings as its own dtype)."""
    import pandera.pandas as pa

    lp = dict(nullable=True, checks=pa.Check.ge(0.0))
    return pa.DataFrameSchema(
        {
            "view": pa.Column(str, unique=True),
            "width": pa.Column(int, pa.Check.gt(0)),
            "height": pa.Column(int, pa.Check.gt(0)),
            "psnr": pa.Column(float, pa.Check.ge(0.0)),  # images in [0, 1]: MSE <= 1; inf for a perfect render
            "ssim": pa.Column(float, pa.Check.in_range(-1.0, 1.0)),
            "lpips_vgg_01": pa.Column(float, **lp),
            "lpips_vgg": pa.Column(float, **lp),
            "lpips_alex": pa.Column(float, **lp),
            "render_seconds": pa.Column(float, pa.Check.gt(0.0)),
            "rss_mb": pa.Column(float, pa.Check.gt(0.0)),
        },
        strict=True, coerce=True, ordered=True,
    )


def read_rgb(path: Path, width: int, height: int) -> torch.Tensor:
    """``[H, W, 3]`` float32 in [0, 1] from an image file; the size must match the camera."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            arr = np.asarray(im.convert("RGB"), dtype=np.float32) / 255.0
    except Exception as e:  # noqa: BLE001 - PIL raises many types for unreadable files
        raise UserError(f"{path}: cannot read this test image ({e}); rerun the sfm stage to rewrite "
                        f"data/<scene>/undistorted/images") from None
    if arr.shape[:2] != (height, width):
        raise UserError(f"{path}: image is {arr.shape[1]}x{arr.shape[0]} but its camera is {width}x{height}; "
                        f"rerun the sfm stage so images and cameras agree")
    return torch.from_numpy(arr)


def rss_mb() -> float:
    """Current resident set size of this process in MiB."""
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def error_heatmap(render: torch.Tensor, gt: torch.Tensor, gain: float) -> np.ndarray:
    """``[H, W, 3]`` uint8: mean absolute error x ``gain`` on a black-red-yellow-white ramp."""
    e = ((render - gt).abs().mean(dim=-1) * gain).clamp(0, 1).numpy()  # [H, W]
    rgb = np.stack([np.clip(3 * e, 0, 1), np.clip(3 * e - 1, 0, 1), np.clip(3 * e - 2, 0, 1)], axis=-1)
    return (rgb * 255 + 0.5).astype(np.uint8)


def save_side_by_side(path: Path, render: torch.Tensor, gt: torch.Tensor, gain: float) -> None:
    """``render | ground truth | error map`` as one PNG."""
    from PIL import Image

    to8 = lambda x: (x.clamp(0, 1).numpy() * 255 + 0.5).astype(np.uint8)  # noqa: E731
    row = np.concatenate([to8(render), to8(gt), error_heatmap(render, gt, gain)], axis=1)  # [H, 3W, 3]
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(row).save(path, compress_level=3)  # fast; level 6 barely smaller for renders


def render_timed(splats: Splats, view, sh_degree: int, backend: str,
                 rasterize_mode: str = "classic") -> tuple[torch.Tensor, float]:
    """``(render [H, W, 3] on the splats' device, seconds)``: the wall clock of one render, synchronised on a GPU
    so it measures the render, not the kernel launch."""
    t0 = time.perf_counter()
    render = render_view(splats, view, sh_degree, backend, rasterize_mode)
    if splats.device.type == "cuda":
        torch.cuda.synchronize(splats.device)
    return render, time.perf_counter() - t0


def _train_peak_rss(train_json: Path | None) -> float | None:
    if train_json is None or not Path(train_json).exists():
        return None
    try:
        return json.loads(Path(train_json).read_text()).get("peak_rss_mb")
    except (json.JSONDecodeError, AttributeError):
        return None


def _area_resize(img: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """``[H, W, 3]`` float of 8-bit values area-downscaled in 8 bits (as training's targets and images_N files)."""
    import cv2

    u8 = (img.numpy() * 255.0 + 0.5).astype(np.uint8)
    return torch.from_numpy(cv2.resize(u8, (width, height), interpolation=cv2.INTER_AREA).astype(np.float32) / 255.0)


def _view_mask(view) -> torch.Tensor | None:
    m = read_view_mask(view)
    return None if m is None else torch.from_numpy(m)


def evaluate(splats: Splats, sh_degree: int, test_views: list, cfg: EvaluateConfig, *, renders_dir: Path | None = None,
             split_rule: str | None = None, train_json: Path | None = None, progress: bool = True,
             lpips: LpipsSet | None = None, resolution: dict | None = None,
             rasterize_mode: str = "classic") -> tuple[dict, "object"]:
    """Score ``splats`` on ``test_views``, rendered in the ``rasterize_mode`` they were trained for; returns
    ``(summary dict, per-view DataFrame)`` (validated)."""
    import pandas as pd
    from tqdm import tqdm

    if not test_views:
        raise UserError("the split has no test views, so there is nothing to evaluate; check data/<scene>/split.json "
                        "(split.every_n in params.yaml) and rerun the split stage")
    run_dev = devices.resolve(cfg.backend)
    backend, dev = run_dev.backend, run_dev.device
    devices.reset_peak_memory(run_dev)
    model = Splats.of(splats).to(dev)  # once for all views
    lpips = (lpips if lpips is not None else LpipsSet(cfg.lpips_variants, cfg.lpips_backbone_dir)).to(dev)

    rows, masked_fracs = [], []
    with torch.no_grad():
        render_timed(model, test_views[0], sh_degree, backend, rasterize_mode)  # untimed warm-up (kernel compilation / caches)
        for view in tqdm(test_views, desc="evaluate", unit="view", disable=not progress):
            render, seconds = render_timed(model, view, sh_degree, backend, rasterize_mode)  # [H, W, 3]
            # one image pair on the device at a time: decoded on the host, uploaded, freed after the view
            src = getattr(view, "source_size", None)  # a larger file: area-downscaled as training's targets
            gt = read_rgb(Path(view.image_path), *(src or (int(view.width), int(view.height))))  # [H, W, 3]
            if src is not None:
                gt = _area_resize(gt, int(view.width), int(view.height))
            gt = gt.to(dev)
            if cfg.quantize_8bit:
                render = quantize_8bit(render)
            x, y = render.permute(2, 0, 1)[None], gt.permute(2, 0, 1)[None]  # [1, 3, H, W]
            keep = _view_mask(view)  # [H, W] bool or None
            if keep is None:
                lp = lpips(x, y)
                p_, s_ = psnr(x, y), ssim(x, y)
            else:  # kept pixels only; LPIPS on the render with the ground truth in its masked pixels
                lp = lpips(masked_pair(x, y, keep), y)
                p_, s_ = masked_psnr(x, y, keep), masked_ssim(x, y, keep)
                masked_fracs.append(1.0 - float(keep.float().mean()))
            row = {"view": view.name, "width": int(view.width), "height": int(view.height), "psnr": p_,
                   "ssim": s_, **{v: lp.get(v) for v in ("lpips_vgg_01", "lpips_vgg", "lpips_alex")},
                   "render_seconds": seconds}
            if renders_dir is not None and cfg.save_renders:
                save_side_by_side(Path(renders_dir) / Path(view.name).with_suffix(".png"), render.cpu(), gt.cpu(),
                                  cfg.error_gain)
            del render, gt, x, y
            row["rss_mb"] = rss_mb()
            rows.append(row)

    df = pd.DataFrame(rows, columns=PER_VIEW_COLUMNS)
    df = per_view_schema().validate(df)

    def mean(col):
        vals = df[col].dropna()
        return float(vals.mean()) if len(vals) else None

    mean_seconds = float(df["render_seconds"].mean())
    summary = {
        "test_views": len(df),
        "psnr": mean("psnr"),
        "ssim": mean("ssim"),
        **{v: mean(v) for v in cfg.lpips_variants},
        "render_seconds_mean": mean_seconds,
        "fps": 1.0 / mean_seconds if mean_seconds > 0 else None,
        "gaussians": model.n,
        "model_size_mb": round(model.size_mib, 4),
        "peak_rss_mb_evaluate": round(peak_rss_mb(), 1),
        "peak_rss_mb_train": _train_peak_rss(train_json),
        "device": devices.run_record(run_dev),
        "protocol": {
            "views": "test views of the split only (training images are never opened)",
            "split_rule": split_rule,
            "image_sizes": sorted({f"{w}x{h}" for w, h in zip(df["width"], df["height"])}),
            "color": "RGB in [0, 1]; renders clamped to [0, 1], black background; ground truth from 8-bit files",
            "rasterize_mode": rasterize_mode,  # as the model was trained (train.rasterize_mode)
            "render_quantized_8bit": cfg.quantize_8bit,
            "metrics_on_8bit_images": bool(cfg.quantize_8bit),  # ground truth is 8-bit; the render only if quantized
            "resolution": resolution,  # the working size and the image source (splatflow.scene.resolution)
            "masks": None if not masked_fracs else {
                "views": len(masked_fracs), "masked_fraction_mean": round(float(np.mean(masked_fracs)), 4),
                "rule": "PSNR and SSIM over kept (white) pixels only; SSIM windows and LPIPS see the render with "
                        "the ground truth in its masked pixels"},
            "psnr": "-10 log10(MSE) over all pixels and channels of each view, then the mean over views",
            "ssim": "11x11 Gaussian window, sigma 1.5, C1=0.01^2, C2=0.03^2, zero 'same' padding (3DGS code)",
            "lpips": {v: VARIANT_INPUTS[v] for v in cfg.lpips_variants},
            "lpips_weights": "v0.1 linear layers from the lpips package files; ImageNet trunks from "
                             + (cfg.lpips_backbone_dir or "the torch hub cache"),
            "lpips_null_reasons": {v: lpips.reason(v) for v in cfg.lpips_variants if lpips.reason(v)},
            "sh_degree": sh_degree,
            "backend": backend,
            "threads": torch.get_num_threads(),
            "render_timing": "wall clock of one rasterize() call per view (1 camera) after one untimed warm-up",
        },
    }
    if summary["psnr"] is not None and math.isinf(summary["psnr"]):
        summary["protocol"]["note"] = "at least one view is rendered exactly (PSNR inf)"
    return summary, df


def evaluate_scene(ckpt_path: Path, undistorted_dir: Path, split_json: Path, cfg: EvaluateConfig, *,
                   renders_dir: Path | None, per_view_csv: Path, train_json: Path | None = None,
                   progress: bool = True, scene=None, resolution: dict | None = None) -> dict:
    """Load checkpoint and scene, evaluate on the test views, write ``per_view.csv``; return the summary.

    ``scene`` (already at its working size, with masks: :func:`splatflow.scene.resolution.load_working_scene`)
    replaces loading ``undistorted_dir``; ``resolution`` is what chose its size, recorded in the protocol."""
    ckpt = Checkpoint.load(ckpt_path)
    splats, sh_degree = ckpt.splats, ckpt.sh_degree
    if scene is None:
        scene = load_scene(undistorted_dir, split_json)
    rule = read_split(split_json).get("rule")
    summary, df = evaluate(splats, sh_degree, scene.test_views, cfg, renders_dir=renders_dir, split_rule=rule,
                           train_json=train_json, progress=progress, resolution=resolution,
                           rasterize_mode=ckpt.rasterize_mode)
    per_view_csv = Path(per_view_csv)
    per_view_csv.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(per_view_csv, index=False)
    return summary
