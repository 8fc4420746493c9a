"""DVC stage `evaluate`: the pruned model scored on the split's test views (docs/design.md §6).

Reads ``models/<scene>/prune/ckpt.pt``, ``data/<scene>/undistorted`` and ``data/<scene>/split.json``; writes
``metrics/<scene>/evaluate.json`` (the means; the protocol and any LPIPS variant's reason for being n/a go to
``metrics/<scene>/info/evaluate.json``), ``metrics/<scene>/headline.json`` (the scene's headline numbers, train's
time included: :data:`splatflow.pipeline.records.HEADLINE`), ``metrics/<scene>/per_view.csv`` (pandera-validated) and
``data/<scene>/renders/<view>.png`` (render | ground truth | error map). The work is in
:mod:`splatflow.evaluation.evaluate`.
"""

from __future__ import annotations

from splatflow.pipeline import records
from splatflow.pipeline.config import Params
from splatflow.evaluation.evaluate import evaluate_scene
from splatflow.pipeline.paths import ScenePaths
from splatflow.pipeline.stage import stage_main


def run(params: Params, paths: ScenePaths) -> dict:
    from splatflow.pipeline.device import resolve

    cfg = params.evaluate
    resolve(cfg.backend)  # a missing GPU or a broken gsplat build is reported before anything else
    renders = paths.renders_dir
    if renders.exists():  # no stale images of views that are no longer test views
        for old in renders.rglob("*.png"):
            old.unlink()
    renders.mkdir(parents=True, exist_ok=True)  # a DVC output: it must exist (empty) when save_renders is false
    from splatflow.scene.resolution import describe, load_working_scene

    scene, resolution = load_working_scene(params, paths)  # the size (and masks) training used
    print(f"evaluate [{paths.scene}]: {describe(resolution)}")
    summary = evaluate_scene(paths.prune_ckpt, paths.undistorted_dir, paths.split_json, cfg,
                             renders_dir=renders if cfg.save_renders else None, per_view_csv=paths.per_view_csv,
                             train_json=paths.metrics_json("train"), scene=scene, resolution=resolution)
    print(f"evaluate [{paths.scene}]: {summary_line(summary, cfg.lpips_variants)}")
    for v, why in summary["protocol"]["lpips_null_reasons"].items():
        print(f"evaluate [{paths.scene}]: {v} n/a (left out of evaluate.json): {why}")
    records.write_headline(paths, {"evaluate": summary, "train": records.read_numbers(paths, "train")})
    return summary


def summary_line(summary: dict, lpips_variants) -> str:
    """``3 test views: PSNR 21.71 dB, SSIM 0.5436, lpips_alex 0.1234; 56.5 FPS, 463 Gaussians`` (no LPIPS part when
    ``evaluate.lpips_variants`` is empty)."""
    scores = [f"PSNR {summary['psnr']:.2f} dB", f"SSIM {summary['ssim']:.4f}"]
    scores += [f"{v} {summary[v]:.4f}" if summary[v] is not None else f"{v} n/a" for v in lpips_variants]
    return (f"{summary['test_views']} test views: {', '.join(scores)}; {summary['fps']:.1f} FPS, "
            f"{summary['gaussians']} Gaussians")


def main(argv: list[str] | None = None) -> None:
    stage_main("evaluate", run, argv)


if __name__ == "__main__":
    main()
