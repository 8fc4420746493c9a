"""pandera schemas for the camera, image and point tables of a COLMAP reconstruction.

Why validate what COLMAP wrote: a degenerate reconstruction (a focal length collapsed to a few pixels, NaN poses
after a failed bundle adjustment, a principal point outside the image) still writes valid binary files, and the
training stage would then fail late and confusingly. Checking the tables at the sfm stage boundary turns that into
one clear error naming the table, the column and the offending rows.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pandera.pandas as pa
from pandera.errors import SchemaError, SchemaErrors

from splatflow.pipeline.errors import UserError

__all__ = ["CAMERAS", "IMAGES", "POINTS", "reconstruction_tables", "validate_reconstruction"]

_finite = pa.Check(lambda s: np.isfinite(s.astype(float)), element_wise=False, error="must be finite")


def _table(name: str, columns: dict, checks: list | None = None) -> pa.DataFrameSchema:
    """A table schema as every one here is: named (errors name the table), ``coerce`` (pandas 3 strings),
    ``strict`` (an unexpected column is an error, not ignored)."""
    return pa.DataFrameSchema(columns, checks=checks, coerce=True, strict=True, name=name)


CAMERAS = _table(
    "cameras",
    {
        "camera_id": pa.Column(int, pa.Check.ge(1), unique=True),
        "model": pa.Column(str),
        "width": pa.Column(int, pa.Check.gt(0)),
        "height": pa.Column(int, pa.Check.gt(0)),
        "fx": pa.Column(float, [pa.Check.gt(0), _finite]),
        "fy": pa.Column(float, [pa.Check.gt(0), _finite]),
        "cx": pa.Column(float, _finite),
        "cy": pa.Column(float, _finite),
    },
    checks=[
        pa.Check(lambda df: (df.cx > 0) & (df.cx < df.width), error="principal point x must lie inside the image"),
        pa.Check(lambda df: (df.cy > 0) & (df.cy < df.height), error="principal point y must lie inside the image"),
        # A focal length outside [0.1, 10] x the image size is a collapsed self-calibration, not a real lens.
        pa.Check(lambda df: (df.fx > 0.1 * df.width) & (df.fx < 10 * df.width),
                 error="focal length must be within 0.1-10x the image width"),
    ],
)

IMAGES = _table(
    "images",
    {
        "image_id": pa.Column(int, pa.Check.ge(1), unique=True),
        "name": pa.Column(str, unique=True),
        "camera_id": pa.Column(int, pa.Check.ge(1)),
        "qw": pa.Column(float, _finite),
        "qx": pa.Column(float, _finite),
        "qy": pa.Column(float, _finite),
        "qz": pa.Column(float, _finite),
        "tx": pa.Column(float, _finite),
        "ty": pa.Column(float, _finite),
        "tz": pa.Column(float, _finite),
        "num_points3d": pa.Column(int, pa.Check.ge(0)),
    },
    checks=[
        pa.Check(lambda df: np.abs(np.sqrt(df.qw ** 2 + df.qx ** 2 + df.qy ** 2 + df.qz ** 2) - 1.0) < 1e-6,
                 error="rotation quaternion must have unit norm"),
    ],
)

POINTS = _table(
    "points3D",
    {
        "point3d_id": pa.Column(int, pa.Check.ge(1), unique=True),
        "x": pa.Column(float, _finite),
        "y": pa.Column(float, _finite),
        "z": pa.Column(float, _finite),
        "r": pa.Column(int, pa.Check.in_range(0, 255)),
        "g": pa.Column(int, pa.Check.in_range(0, 255)),
        "b": pa.Column(int, pa.Check.in_range(0, 255)),
        "error": pa.Column(float, [pa.Check.ge(0), _finite]),
        "track_length": pa.Column(int, pa.Check.ge(2)),  # a triangulated point needs two observations
    },
)


def reconstruction_tables(rec) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """(cameras, images, points) DataFrames of a ``pycolmap.Reconstruction`` (registered images only)."""
    cams = []
    for cam in rec.cameras.values():
        K = np.asarray(cam.calibration_matrix())
        cams.append({"camera_id": cam.camera_id, "model": cam.model_name, "width": cam.width, "height": cam.height,
                     "fx": K[0, 0], "fy": K[1, 1], "cx": K[0, 2], "cy": K[1, 2]})
    imgs = []
    for im in rec.images.values():
        if not im.has_pose:
            continue
        pose = im.cam_from_world()
        x, y, z, w = np.asarray(pose.rotation.quat)  # pycolmap quaternions are xyzw
        t = np.asarray(pose.translation)
        imgs.append({"image_id": im.image_id, "name": im.name, "camera_id": im.camera_id, "qw": w, "qx": x,
                     "qy": y, "qz": z, "tx": t[0], "ty": t[1], "tz": t[2], "num_points3d": im.num_points3D})
    pts = [{"point3d_id": pid, "x": p.xyz[0], "y": p.xyz[1], "z": p.xyz[2], "r": int(p.color[0]),
            "g": int(p.color[1]), "b": int(p.color[2]), "error": p.error, "track_length": p.track.length()}
           for pid, p in rec.points3D.items()]
    return (pd.DataFrame(cams, columns=list(CAMERAS.columns)), pd.DataFrame(imgs, columns=list(IMAGES.columns)),
            pd.DataFrame(pts, columns=list(POINTS.columns)))


def validate_reconstruction(rec, where: str) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Validate the three tables of ``rec``; raise UserError naming ``where`` (the model folder) on failure."""
    tables = reconstruction_tables(rec)
    out = []
    for schema, df in zip((CAMERAS, IMAGES, POINTS), tables):
        try:
            out.append(schema.validate(df, lazy=True))
        except (SchemaErrors, SchemaError) as e:
            cases = getattr(e, "failure_cases", None)
            detail = cases.head(5).to_string() if cases is not None else str(e)
            raise UserError(
                f"{where}: the reconstruction's {schema.name} table is invalid, so SfM produced a degenerate model:\n"
                f"{detail}\nUsually more overlap between photos, more texture, or a simpler camera model "
                f"(sfm.camera_model) helps; rerun the sfm stage."
            ) from None
    return tuple(out)
