"""The export stage: three files from the pruned checkpoint, each verified by an independent reader."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from splatflow.pipeline.config import Params, params_from_dict
from splatflow.present.export import ExportVerificationError, compare, export_model, verify_ply
from splatflow.formats.common import as_numpy_splats
from splatflow.gaussians.model import save_checkpoint
from splatflow.pipeline.paths import ScenePaths
from splatflow.pipeline.stage import write_metrics
from stages import export as export_stage
from tests._project import stage_record


def _splats(n=400, degree=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    k1 = (degree + 1) ** 2 - 1
    return {"means": torch.randn(n, 3, generator=g) * 2, "quats": torch.randn(n, 4, generator=g),
            "scales": torch.rand(n, 3, generator=g) * 5 - 7, "opacities": torch.randn(n, generator=g) * 3,
            "sh0": torch.randn(n, 1, 3, generator=g), "shN": torch.randn(n, k1, 3, generator=g) * 0.3}


def test_export_stage_writes_verified_files_and_metrics(tmp_path):
    plyfile = pytest.importorskip("plyfile")
    paths = ScenePaths("demo", tmp_path)
    s = _splats()
    save_checkpoint(paths.prune_ckpt, {"splats": s, "sh_degree": 2, "step": 10})
    metrics = export_stage.run(Params(), paths)
    write_metrics(paths, "export", metrics)

    out = stage_record(paths.root, paths.scene, "export")
    assert set(out["files"]) == {"ply", "splat", "spz"}
    for fmt, info in out["files"].items():
        f = paths.export_dir / f"scene.{fmt}"
        assert f.exists() and info["bytes"] == f.stat().st_size and info["gaussians"] == 400
        assert info["path"] == f"models/demo/export/scene.{fmt}"  # project-relative
    assert out["files"]["splat"]["bytes"] == 400 * 32
    assert out["files"]["spz"]["bytes"] < out["files"]["ply"]["bytes"] / 4  # SPZ is the compact one
    assert out["files"]["spz"]["verified_with"].startswith(("gsply", "splatflow"))
    assert out["files"]["ply"]["max_errors"]["means"] == 0.0

    v = plyfile.PlyData.read(str(paths.export_dir / "scene.ply"))["vertex"]
    assert v.count == 400 and len(v.properties) == 62  # degree 3 allocation keeps the 45 f_rest fields
    # sh_degree 2 is active: the degree-3 band (coefficients 8..14 per channel) is written as zero
    rest = np.stack([v.data[f"f_rest_{c * 15 + k}"] for c in range(3) for k in range(8, 15)])
    assert np.abs(rest).max() == 0.0
    assert np.abs(v.data["f_rest_0"] - s["shN"][:, 0, 0].numpy()).max() == 0.0


def test_verification_fails_loudly_on_a_corrupted_file(tmp_path):
    s = _splats(n=50)
    export_model(s, 3, tmp_path, formats=("ply",))
    p = tmp_path / "scene.ply"
    raw = bytearray(p.read_bytes())
    raw[-4:] = np.float32(123.0).tobytes()  # last property of the last vertex: rot_3
    p.write_bytes(bytes(raw))
    with pytest.raises(ExportVerificationError, match="quat"):
        verify_ply(p, as_numpy_splats(s, 3))


def test_compare_counts_and_tolerances():
    ref = as_numpy_splats(_splats(n=10))
    with pytest.raises(ExportVerificationError, match="9 Gaussians read back"):
        compare(ref, {k: v[:9] for k, v in ref.items()}, tol=None, what="x")


def test_missing_checkpoint_is_a_user_error(tmp_path):
    from splatflow.pipeline.errors import UserError

    with pytest.raises(UserError, match="ckpt.pt"):
        export_stage.run(params_from_dict({}), ScenePaths("demo", tmp_path))


def test_exported_files_read_back_with_the_degree_the_model_was_trained_to(tmp_path):
    """A model trained 200 steps (active SH degree 0 of 3) exported as a PLY with the 45 f_rest columns zeroed above
    degree 0: the report and `splatflow view` called it "SH degree 3" while its .spz said 0."""
    from splatflow.present.report import read_splat_file

    g = torch.Generator().manual_seed(0)
    n = 50
    splats = {"means": torch.randn(n, 3, generator=g), "quats": torch.randn(n, 4, generator=g),
              "scales": torch.randn(n, 3, generator=g) - 2, "opacities": torch.randn(n, generator=g),
              "sh0": torch.randn(n, 1, 3, generator=g), "shN": torch.randn(n, 15, 3, generator=g) * 0.1}
    for active in (0, 1, 3):
        out = tmp_path / f"d{active}"
        export_model(splats, active, out)
        for name in ("scene.ply", "scene.spz", "scene.splat"):
            _, degree = read_splat_file(out / name)
            assert degree == (0 if name == "scene.splat" else active), (name, active, degree)
