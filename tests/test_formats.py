"""Export formats: exact Inria PLY layout read by plyfile, and round trips within each format's quantisation."""

from __future__ import annotations

import gzip
import struct

import numpy as np
import pytest
import torch

from splatflow.formats import read_ply, read_splat, read_spz, write_ply, write_splat, write_spz
from splatflow.gaussians.sh import SH_C0
from splatflow.formats.spz import (pack_quats_smallest_three, unpack_quats_smallest_three)

INRIA_DEG3 = (["x", "y", "z", "nx", "ny", "nz", "f_dc_0", "f_dc_1", "f_dc_2"]
              + [f"f_rest_{i}" for i in range(45)]
              + ["opacity", "scale_0", "scale_1", "scale_2", "rot_0", "rot_1", "rot_2", "rot_3"])


def make_splats(n=300, sh_degree=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    k1 = (sh_degree + 1) ** 2 - 1
    return {
        "means": torch.randn(n, 3, generator=g) * 4,
        "quats": torch.randn(n, 4, generator=g),
        "scales": torch.rand(n, 3, generator=g) * 6 - 8,  # log scales in [-8, -2]
        "opacities": torch.randn(n, generator=g) * 2,
        "sh0": torch.randn(n, 1, 3, generator=g) * 0.8,
        "shN": (torch.rand(n, k1, 3, generator=g) - 0.5) * 0.6,
    }


def unit(q):
    return q / q.norm(dim=1, keepdim=True)


def quat_angle_err(a, b):
    """1 - |<a, b>| of unit quaternions (0 for the same rotation, sign-insensitive)."""
    return 1 - (unit(a) * unit(b)).sum(1).abs()


def test_ply_header_is_exactly_inria_layout_and_plyfile_reads_it(tmp_path):
    plyfile = pytest.importorskip("plyfile")
    s = make_splats()
    p = write_ply(tmp_path / "scene.ply", s)
    head = p.read_bytes().split(b"end_header\n")[0].decode().splitlines()
    assert head[:3] == ["ply", "format binary_little_endian 1.0", "element vertex 300"]
    assert head[3:] == [f"property float {n}" for n in INRIA_DEG3]
    assert p.stat().st_size == len("\n".join(head)) + len("\nend_header\n") + 300 * 62 * 4

    el = plyfile.PlyData.read(str(p))["vertex"]
    assert [pr.name for pr in el.properties] == INRIA_DEG3
    assert all(pr.val_dtype in ("f4", "<f4", "float32") or np.dtype(pr.val_dtype) == np.float32
               for pr in el.properties)
    d = el.data
    np.testing.assert_array_equal(d["x"], s["means"][:, 0].numpy())
    np.testing.assert_array_equal(d["opacity"], s["opacities"].numpy())
    np.testing.assert_array_equal(d["scale_2"], s["scales"][:, 2].numpy())
    np.testing.assert_array_equal(d["rot_0"], s["quats"][:, 0].numpy())  # w first
    np.testing.assert_array_equal(d["nx"], 0)
    # f_rest is channel-major: f_rest_0..14 = red of coefficients 1..15, f_rest_15 = green of coefficient 1
    np.testing.assert_array_equal(d["f_rest_0"], s["shN"][:, 0, 0].numpy())
    np.testing.assert_array_equal(d["f_rest_1"], s["shN"][:, 1, 0].numpy())
    np.testing.assert_array_equal(d["f_rest_15"], s["shN"][:, 0, 1].numpy())
    np.testing.assert_array_equal(d["f_rest_44"], s["shN"][:, 14, 2].numpy())


def test_ply_round_trip_is_exact_and_zeroes_inactive_bands(tmp_path):
    s = make_splats()
    r, deg = read_ply(write_ply(tmp_path / "a.ply", s))
    assert deg == 3
    for k in s:
        torch.testing.assert_close(r[k], s[k], rtol=0, atol=0)
    r1, deg1 = read_ply(write_ply(tmp_path / "b.ply", s, sh_degree=1))
    assert deg1 == 3 and r1["shN"][:, 3:].abs().max() == 0  # fields stay (45), bands above 1 are zero
    torch.testing.assert_close(r1["shN"][:, :3], s["shN"][:, :3], rtol=0, atol=0)
    r0, deg0 = read_ply(write_ply(tmp_path / "c.ply", make_splats(sh_degree=0)))
    assert deg0 == 0 and r0["shN"].shape == (300, 0, 3)


def test_splat_layout_order_and_round_trip(tmp_path):
    s = make_splats()
    p = write_splat(tmp_path / "a.splat", s)
    assert p.stat().st_size == 300 * 32
    raw = p.read_bytes()
    # record 0 is the most important Gaussian: largest volume * opacity
    score = torch.exp(s["scales"].sum(1)) * torch.sigmoid(s["opacities"])
    top = int(score.argmax())
    x, y, z, sx, sy, sz = struct.unpack_from("<6f", raw, 0)
    assert (x, y, z) == tuple(s["means"][top].tolist())
    np.testing.assert_allclose((sx, sy, sz), torch.exp(s["scales"][top]).numpy(), rtol=1e-6)
    r, g, b, a = raw[24:28]
    assert a == round(float(torch.sigmoid(s["opacities"][top])) * 255)

    rd, deg = read_splat(p)
    order = torch.argsort(-score, stable=True)
    ref = {k: v[order] for k, v in s.items()}
    assert deg == 0
    torch.testing.assert_close(rd["means"], ref["means"], rtol=0, atol=0)
    torch.testing.assert_close(rd["scales"], ref["scales"], rtol=0, atol=1e-5)
    rgb = (0.5 + SH_C0 * ref["sh0"]).clamp(0, 1)
    assert float(((0.5 + SH_C0 * rd["sh0"]) - rgb).abs().max()) <= 0.5 / 255 + 1e-6
    alpha = torch.sigmoid(ref["opacities"]).clamp(0.5 / 255, 1 - 0.5 / 255)
    assert float((torch.sigmoid(rd["opacities"]) - alpha).abs().max()) <= 0.5 / 255 + 1e-6
    assert float(quat_angle_err(rd["quats"], ref["quats"]).max()) < 2e-4


@pytest.mark.parametrize("version", [2, 3])
def test_spz_header_and_round_trip_within_quantisation(tmp_path, version):
    s = make_splats()
    p = write_spz(tmp_path / "a.spz", s, version=version)
    raw = gzip.decompress(p.read_bytes())
    magic, ver, n, deg, fb, flags, res = struct.unpack_from("<IIIBBBB", raw)
    assert (magic, ver, n, deg, fb, flags, res) == (0x5053474E, version, 300, 3, 12, 0, 0)
    assert len(raw) == 16 + 300 * (9 + 1 + 3 + 3 + (4 if version == 3 else 3) + 45)

    r, rdeg = read_spz(p)
    assert rdeg == 3
    assert float((r["means"] - s["means"]).abs().max()) <= 0.5 / 4096 + 1e-6
    assert float((r["scales"] - s["scales"]).abs().max()) <= 0.5 / 16 + 1e-6
    assert float((torch.sigmoid(r["opacities"]) - torch.sigmoid(s["opacities"])).abs().max()) <= 0.5 / 255 + 1e-6
    assert float((r["sh0"] - s["sh0"]).abs().max()) <= 0.5 / (0.15 * 255) + 1e-6
    # SH: 5 bits for degree 1 (step 8/128), 4 bits above (step 16/128), plus the 1/128 grid
    assert float((r["shN"][:, :3] - s["shN"][:, :3]).abs().max()) <= 4 / 128 + 0.5 / 128 + 1e-6
    assert float((r["shN"][:, 3:] - s["shN"][:, 3:]).abs().max()) <= 8 / 128 + 0.5 / 128 + 1e-6
    assert float(quat_angle_err(r["quats"], s["quats"]).max()) < (2e-5 if version == 3 else 5e-3)


def test_spz_smallest_three_exact_cases():
    q = torch.tensor([[0.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0], [0.5, -0.5, 0.5, -0.5],
                      [0.1, -0.2, 0.3, -0.9]], dtype=torch.float64)
    q = (q / q.norm(dim=1, keepdim=True)).numpy()
    back = unpack_quats_smallest_three(pack_quats_smallest_three(q))
    np.testing.assert_allclose(np.abs((back * q).sum(1)), 1.0, atol=2e-6)
    np.testing.assert_allclose(back[0], [0, 0, 0, 1], atol=1e-7)


def test_spz_coordinate_frame_and_independent_reader(tmp_path):
    """gsply (an independent SPZ decoder) reads our file; SPZ stores RUB, i.e. y and z mirrored from our RDF."""
    gsply = pytest.importorskip("gsply")
    s = make_splats(n=200)
    p = write_spz(tmp_path / "a.spz", s)
    g = gsply.read_spz(str(p))
    ours_raw, _ = read_spz(p, to_coordinates="none")
    np.testing.assert_allclose(g.means, ours_raw["means"].numpy(), atol=1e-6)
    np.testing.assert_allclose(g.means * np.array([1, -1, -1]), s["means"].numpy(), atol=0.5 / 4096 + 1e-6)
    np.testing.assert_allclose(g.scales, ours_raw["scales"].numpy(), atol=1e-6)
    np.testing.assert_allclose(g.sh0, ours_raw["sh0"][:, 0].numpy(), atol=1e-6)
    np.testing.assert_allclose(g.shN, ours_raw["shN"].numpy(), atol=1e-6)
    np.testing.assert_allclose(np.abs((g.quats * ours_raw["quats"].numpy()).sum(1)), 1.0, atol=1e-5)
    # mirror y, z: rotation (w, x, y, z) -> (w, x, -y, -z); degree-1 SH coefficients (y, z, x) -> (-, -, +)
    q_rdf = torch.from_numpy(g.quats * np.array([1, 1, -1, -1], dtype=np.float32))
    assert float(quat_angle_err(q_rdf, s["quats"]).max()) < 2e-5
    np.testing.assert_allclose(-g.shN[:, 0], s["shN"][:, 0].numpy(), atol=4.5 / 128 + 1e-6)
    np.testing.assert_allclose(g.shN[:, 2], s["shN"][:, 2].numpy(), atol=4.5 / 128 + 1e-6)


def test_spz_large_scene_lowers_fractional_bits(tmp_path):
    s = make_splats(n=20, sh_degree=0)
    s["means"][0] = torch.tensor([5000.0, -3000.0, 10.0])
    p = write_spz(tmp_path / "big.spz", s)
    fb = gzip.decompress(p.read_bytes())[13]
    assert fb < 12
    r, _ = read_spz(p)
    assert float((r["means"] - s["means"]).abs().max()) <= 0.5 / (1 << fb) + 1e-3


def test_bad_files_raise_clear_errors(tmp_path):
    bad = tmp_path / "x.spz"
    bad.write_bytes(b"not gzip")
    with pytest.raises(ValueError, match="gzip"):
        read_spz(bad)
    bad.write_bytes(gzip.compress(b"\0" * 32))
    with pytest.raises(ValueError, match="magic"):
        read_spz(bad)
    b2 = tmp_path / "x.splat"
    b2.write_bytes(b"\0" * 33)
    with pytest.raises(ValueError, match="multiple of 32"):
        read_splat(b2)
    b3 = tmp_path / "x.ply"
    b3.write_bytes(b"hello\n")
    with pytest.raises(ValueError, match="not a PLY"):
        read_ply(b3)


def test_our_spz_reader_decodes_files_written_by_gsply(tmp_path):
    """The other direction: an independent encoder (gsply, v3) writes, our reader decodes within quantisation."""
    gsply = pytest.importorskip("gsply")
    s = make_splats(n=200)
    q = unit(s["quats"]).numpy()
    data = gsply.GSData.from_arrays(means=s["means"].numpy(), scales=s["scales"].numpy(), quats=q,
                                    opacities=s["opacities"].numpy(), sh0=s["sh0"][:, 0].numpy(),
                                    shN=s["shN"].numpy(), format="ply")
    p = tmp_path / "g.spz"
    gsply.write_spz(str(p), data)
    r, deg = read_spz(p, to_coordinates="none")  # gsply writes the arrays as given (no frame change)
    assert deg == 3
    assert float((r["means"] - s["means"]).abs().max()) <= 0.5 / 4096 + 1e-6
    assert float((r["scales"] - s["scales"]).abs().max()) <= 0.5 / 16 + 1e-6
    assert float((r["sh0"] - s["sh0"]).abs().max()) <= 0.5 / (0.15 * 255) + 1e-6
    assert float((r["shN"] - s["shN"]).abs().max()) <= 8.5 / 128 + 1e-6
    assert float(quat_angle_err(r["quats"], s["quats"]).max()) < 2e-5
