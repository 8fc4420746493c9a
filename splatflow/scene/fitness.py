"""How fit an SfM model is to train on, in numbers, and the warning a poor one gets (sfm stage, report).

A model can register every photo and still be unfit: on a real 252-photo 360-degree capture, sequential matching
gave a model with a 0.35 px mean reprojection error that trained to 26.5 dB, and exhaustive matching (repetitive
texture matched across the orbit) one with 0.90 px that trained to 20.6 dB with the same settings; both read
"252/252 registered". The demo and the Strecha scenes sit at 0.29-0.41 px. A model can also be locally exact and
globally wrong: a walk-around whose later part drifted apart from its start (a jump in the camera path).
"""

from __future__ import annotations

import numpy as np

# A model is flagged "poor" (a warning in the log and the report, ``fitness_poor: 1`` in sfm.json) past these.
POOR_REPROJECTION_PX = 0.8
POOR_IMAGE_ERROR_PX = 1.5  # an image whose points reproject this badly on average is probably misplaced
POOR_IMAGE_SHARE = 0.1  # ... and the model is poor when this share of its images are
FEW_OBSERVATIONS = 50  # an image seeing fewer SfM points than this is held weakly
# The camera path in name order (the capture order of a video or a walk-around): a step between two consecutive
# cameras this many times the median step, and this share of the cameras' extent, is a jump. On a real 252-photo
# 360-degree capture the sequential matcher's model had one of 45x (0.66 of the extent) between two consecutive
# photos, and the views around it rendered 6-8 dB below the rest: the walk after it was posed apart from the walk
# before (drift the matcher's pairs could not close). The demo, the Strecha scenes and a phone video stay at 2.4x.
JUMP_RATIO = 12.0
JUMP_EXTENT = 0.2
# An error spread evenly over the images (the 90th percentile of the per-image means within this factor of their
# median, none misplaced) is the camera model's rather than a few photos': on a 96-photo phone capture (0.98 px
# median, 1.03 p90, one shared SIMPLE_RADIAL camera) one camera per image fitted focal lengths 774-849 px (the
# phone's autofocus moves them), lowered the error to 0.79 px and trained 0.5 dB higher (26.72 against 26.19 dB
# unpruned, one run each; bench/RESULTS.md "Real captures").
EVEN_SPREAD = 1.25


def camera_path_jump(names, centers) -> dict:
    """The largest step of the camera path in name order: ``camera_path_jump_ratio`` (that step over the median
    step), ``camera_path_jump_extent`` (over the extent of all centres) and, past both limits (a jump),
    ``camera_path_jump_between`` ("A -> B"). Empty with fewer than four cameras."""
    if len(names) < 4:
        return {}
    order = np.argsort(np.asarray(names, dtype=object))
    c = np.asarray(centers, dtype=np.float64)[order]
    steps = np.linalg.norm(np.diff(c, axis=0), axis=1)
    med = float(np.median(steps))
    extent = float(np.linalg.norm(c.max(axis=0) - c.min(axis=0)))
    if med <= 0 or extent <= 0:
        return {}
    i = int(np.argmax(steps))
    out = {"camera_path_jump_ratio": round(float(steps[i]) / med, 2),
           "camera_path_jump_extent": round(float(steps[i]) / extent, 4)}
    if out["camera_path_jump_ratio"] >= JUMP_RATIO and out["camera_path_jump_extent"] >= JUMP_EXTENT:
        out["camera_path_jump_between"] = f"{names[order[i]]} -> {names[order[i + 1]]}"
    return out


def model_fitness(rec) -> dict:
    """How fit a model is to train on, in numbers (sfm.json; docs/CONTRACTS.md): per-image mean reprojection error
    (median, 90th percentile, worst, and the share of images over ``POOR_IMAGE_ERROR_PX``), the share of points
    seen by only two views (weakly triangulated), images seeing fewer than ``FEW_OBSERVATIONS`` points, and
    ``fitness_poor`` (1 when the mean reprojection error or the share of badly placed images is past its limit)."""
    point_error = {pid: float(p.error) for pid, p in rec.points3D.items()}
    track_len = np.array([p.track.length() for p in rec.points3D.values()], dtype=np.int64)
    per_image, observations = [], []
    for im in rec.images.values():
        if not im.has_pose:
            continue
        errs = [point_error[p.point3D_id] for p in im.points2D if p.has_point3D() and p.point3D_id in point_error]
        observations.append(len(errs))
        if errs:
            per_image.append(float(np.mean(errs)))
    per_image_a = np.asarray(per_image) if per_image else np.zeros(1)
    bad_share = float(np.mean(per_image_a > POOR_IMAGE_ERROR_PX)) if per_image else 0.0
    mean_err = float(rec.compute_mean_reprojection_error())
    posed = [im for im in rec.images.values() if im.has_pose]
    path = camera_path_jump([im.name for im in posed], [im.projection_center() for im in posed])
    return {
        "image_reprojection_error_px_median": round(float(np.median(per_image_a)), 4),
        "image_reprojection_error_px_p90": round(float(np.percentile(per_image_a, 90)), 4),
        "image_reprojection_error_px_max": round(float(per_image_a.max()), 4),
        "images_poorly_placed_fraction": round(bad_share, 4),
        "points_two_view_fraction": round(float(np.mean(track_len <= 2)), 4) if track_len.size else None,
        "images_few_observations": int(sum(o < FEW_OBSERVATIONS for o in observations)),
        "observations_per_image_median": int(np.median(observations)) if observations else 0,
        **path,
        "fitness_poor": int(mean_err > POOR_REPROJECTION_PX or bad_share > POOR_IMAGE_SHARE
                            or "camera_path_jump_between" in path),
    }


def fitness_warning(metrics: dict) -> str | None:
    """One line for the log and the report when ``metrics`` (sfm.json) say the model is poor, else None."""
    if not metrics.get("fitness_poor"):
        return None
    why = []
    cost = "Training on it gives a blurred, wrong splat"
    advice = ("try sfm.matcher: sequential for a video or an ordered walk-around, exhaustive for an unordered photo "
              "set, or remove blurred or repetitive photos")
    if metrics.get("mean_reprojection_error_px", 0) > POOR_REPROJECTION_PX:
        why.append(f"mean reprojection error {metrics['mean_reprojection_error_px']:.2f} px (> {POOR_REPROJECTION_PX})")
        med, p90 = metrics.get("image_reprojection_error_px_median"), metrics.get("image_reprojection_error_px_p90")
        if (med and p90 and p90 <= EVEN_SPREAD * med and not metrics.get("images_poorly_placed_fraction")
                and not metrics.get("camera_path_jump_between")):
            why[-1] += (f", spread evenly over the images (median {med:.2f} px, 90th percentile {p90:.2f}): the "
                        "camera model fits them all alike badly, not a few misplaced photos")
            cost = "Training on it loses detail"
            advice = ("if the photos share one camera in sfm.json but come from a phone or a zoom lens (autofocus "
                      "and zoom move the focal length between shots), try sfm.camera_mode: per_image; else " + advice)
    if metrics.get("images_poorly_placed_fraction", 0) > POOR_IMAGE_SHARE:
        why.append(f"{100 * metrics['images_poorly_placed_fraction']:.0f}% of the images reproject worse than "
                   f"{POOR_IMAGE_ERROR_PX} px")
    if metrics.get("camera_path_jump_between"):
        why.append(f"the camera path jumps between {metrics['camera_path_jump_between'].replace(' -> ', ' and ')} "
                   f"({metrics['camera_path_jump_ratio']:.0f}x the median step between consecutive photos): if the "
                   "photos were taken in one walk, the views on one side are posed apart from the other")
    return "the SfM model looks poor to train on: " + "; ".join(why) + f". {cost}; {advice}"
