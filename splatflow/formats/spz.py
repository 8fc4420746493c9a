"""Niantic SPZ (github.com/nianticlabs/spz): gzip-compressed, quantised Gaussians, ~10x smaller than PLY.

Implemented from the published format description (README "File Format" of the reference library), versions 2
and 3, written and read here; the export stage and tests cross-check files with the independent ``gsply``
package's decoder. Checked once by hand against Niantic's own C++ decoder (compiled to WebAssembly, npm
``@spz-loader/core`` 0.3.1) on v2 and v3 files written here: positions and SH identical, scales (as exp), alphas
(as sigmoid) and rotations equal to ours within 3e-6.

Layout (one gzip stream, little endian): a 16-byte header ``uint32 magic = 0x5053474e ("NGSP"), uint32 version,
uint32 numPoints, uint8 shDegree, uint8 fractionalBits, uint8 flags, uint8 reserved``, then the attributes
grouped by kind, in this order:

* positions: 3 x 24-bit signed fixed point per Gaussian, ``fractionalBits`` fractional bits (12 as the reference
  writes, i.e. 1/4096 units, range +-2048; we lower it only when the scene is larger, which any decoder follows);
* alphas: ``uint8(sigmoid(opacity) * 255)``;
* colours: ``uint8(dc * 0.15 * 255 + 127.5)`` per channel (0.15 < SH_C0 leaves room for out-of-range DC);
* scales: ``uint8((log scale + 10) * 16)``;
* rotations: v3 "smallest three": the index of the largest |component| of the unit xyzw quaternion in 2 bits,
  the other three as sign + 9-bit magnitude scaled by 1/sqrt(2), packed in a uint32; v2: xyz of the unit
  quaternion with w >= 0, ``uint8(c * 127.5 + 127.5)``;
* SH: the higher coefficients in ``[K-1, 3]`` order (channel fastest), ``uint8(round(c * 128) + 128)`` snapped to
  buckets of 8 (degree 1, 5 bits) or 16 (degrees 2-3, 4 bits), as the reference quantiser does.

Coordinates: SPZ stores a right-up-back (RUB, OpenGL) frame. Our world follows COLMAP / the Inria PLY
(right-down-front, RDF), so by default positions, rotations and SH coefficients are mirrored in y and z on
writing and back on reading (``from_coordinates="none"`` stores them unchanged).
"""

from __future__ import annotations

import gzip
import os
import struct
from pathlib import Path

import numpy as np

from splatflow.formats.common import (as_numpy_splats, logit, normalize_quats, sh_degree_of, sigmoid,
                                      splats_to_torch)

MAGIC = 0x5053474E
HEADER = struct.Struct("<IIIBBBB")  # magic, version, numPoints, shDegree, fractionalBits, flags, reserved
COLOR_SCALE = 0.15
FLAG_ANTIALIASED = 0x1
FLAG_HAS_EXTENSIONS = 0x2
SQRT1_2 = 0.7071067811865476
DEFAULT_FRACTIONAL_BITS = 12
SH1_BITS, SH_REST_BITS = 5, 4

# Sign of each higher SH coefficient (3DGS / gsplat basis order) under the mirror (x, y, z) -> (x, -y, -z):
# (-1)^(number of y and z factors) of each real SH basis polynomial. Degree 1: y, z, x; degree 2: xy, yz,
# 3z^2-1, xz, x^2-y^2; degree 3: y(3x^2-y^2), xyz, y(5z^2-1), z(5z^2-3), x(5z^2-1), z(x^2-y^2), x(x^2-3y^2).
SH_FLIP_YZ = np.array([-1, -1, 1, -1, 1, 1, -1, 1, -1, 1, -1, -1, 1, -1, 1], dtype=np.float32)
POS_FLIP_YZ = np.array([1, -1, -1], dtype=np.float32)


def _round_half_away(x: np.ndarray) -> np.ndarray:
    """C's ``round``: halves away from zero (numpy's ``rint`` rounds halves to even)."""
    return np.sign(x) * np.floor(np.abs(x) + 0.5)


def _to_u8(x: np.ndarray) -> np.ndarray:
    return np.clip(_round_half_away(x), 0, 255).astype(np.uint8)


def choose_fractional_bits(means: np.ndarray) -> int:
    """12 (the reference's choice) unless the scene is too large for 24-bit fixed point at that precision."""
    extent = float(np.abs(means).max()) if means.size else 0.0
    fb = DEFAULT_FRACTIONAL_BITS
    while fb > 0 and extent * (1 << fb) >= (1 << 23) - 1:
        fb -= 1
    if extent * (1 << fb) >= (1 << 23) - 1:
        raise ValueError(f"positions up to {extent:.3g} do not fit SPZ's 24-bit fixed point (max 8388607)")
    return fb


def pack_quats_smallest_three(q_xyzw: np.ndarray) -> np.ndarray:
    """Unit xyzw quaternions ``[N, 4]`` -> ``[N, 4]`` uint8 (a little-endian uint32 each)."""
    q = q_xyzw.astype(np.float64)
    n = len(q)
    largest = np.argmax(np.abs(q), axis=1)  # first index on ties, as the reference's strict '>'
    negate = q[np.arange(n), largest] < 0
    comp = largest.astype(np.uint64)
    for i in range(4):
        use = largest != i
        negbit = ((q[:, i] < 0) ^ negate).astype(np.uint64)
        mag = np.minimum(np.floor(511.0 * np.abs(q[:, i]) / SQRT1_2 + 0.5), 511).astype(np.uint64)
        comp = np.where(use, (comp << np.uint64(10)) | (negbit << np.uint64(9)) | mag, comp)
    return comp.astype("<u4").view(np.uint8).reshape(n, 4)


def unpack_quats_smallest_three(packed: np.ndarray) -> np.ndarray:
    n = len(packed)
    comp = np.ascontiguousarray(packed, dtype=np.uint8).view("<u4").reshape(n).astype(np.uint64)
    largest = (comp >> np.uint64(30)).astype(np.int64)
    q = np.zeros((n, 4), np.float64)
    for i in (3, 2, 1, 0):
        use = largest != i
        mag = (comp & np.uint64(511)).astype(np.float64)
        neg = ((comp >> np.uint64(9)) & np.uint64(1)).astype(bool)
        val = SQRT1_2 * mag / 511.0
        q[:, i] = np.where(use, np.where(neg, -val, val), 0.0)
        comp = np.where(use, comp >> np.uint64(10), comp)
    rest = (q ** 2).sum(axis=1)
    q[np.arange(n), largest] = np.sqrt(np.maximum(0.0, 1.0 - rest))
    return q


def pack_quats_first_three(q_xyzw: np.ndarray) -> np.ndarray:
    q = q_xyzw.astype(np.float64)
    q = q * np.where(q[:, 3:4] < 0, -1.0, 1.0)  # w >= 0 so it can be recovered from xyz
    return _to_u8(q[:, :3] * 127.5 + 127.5)


def unpack_quats_first_three(packed: np.ndarray) -> np.ndarray:
    xyz = packed.astype(np.float64) / 127.5 - 1.0
    w = np.sqrt(np.maximum(0.0, 1.0 - (xyz ** 2).sum(axis=1, keepdims=True)))
    return np.concatenate([xyz, w], axis=1)


def quantize_sh(x: np.ndarray, bits: int) -> np.ndarray:
    bucket = 1 << (8 - bits)
    q = _round_half_away(x.astype(np.float64) * 128.0) + 128.0
    q = np.floor((q + bucket // 2) / bucket) * bucket
    return np.clip(q, 0, 255).astype(np.uint8)


def write_spz(path: str | Path, splats: dict, sh_degree: int | None = None, *, version: int = 3,
              from_coordinates: str = "RDF", antialiased: bool = False) -> Path:
    """Write ``splats`` as SPZ ``version`` (2 or 3) with SH up to ``sh_degree`` (default: all allocated bands)."""
    if version not in (2, 3):
        raise ValueError(f"SPZ version {version} not supported for writing (2 or 3)")
    if from_coordinates not in ("RDF", "none"):
        raise ValueError(f"from_coordinates must be 'RDF' or 'none', got {from_coordinates!r}")
    a = as_numpy_splats(splats)
    n = len(a["means"])
    alloc_degree = sh_degree_of(a["shN"].shape[1])
    degree = alloc_degree if sh_degree is None else min(sh_degree, alloc_degree)
    if degree > 3:
        raise ValueError(f"SH degree {degree} > 3 is not supported")
    k1 = (degree + 1) ** 2 - 1
    means, q, sh = a["means"].astype(np.float64), normalize_quats(a["quats"].astype(np.float64)), a["shN"][:, :k1, :]
    q_xyzw = np.concatenate([q[:, 1:], q[:, :1]], axis=1)  # wxyz -> xyzw
    if from_coordinates == "RDF":
        means = means * POS_FLIP_YZ
        q_xyzw = q_xyzw * np.array([1.0, -1.0, -1.0, 1.0])
        sh = sh * SH_FLIP_YZ[:k1, None]

    fb = choose_fractional_bits(means)
    fixed = _round_half_away(means * (1 << fb)).astype(np.int64).reshape(-1)  # [N*3]
    pos = np.stack([(fixed >> s) & 0xFF for s in (0, 8, 16)], axis=1).astype(np.uint8)  # [N*3, 3] little endian
    alphas = _to_u8(sigmoid(a["opacities"].astype(np.float64)) * 255.0)
    colors = _to_u8(a["sh0"][:, 0, :].astype(np.float64) * (COLOR_SCALE * 255.0) + 0.5 * 255.0)
    scales = _to_u8((a["scales"].astype(np.float64) + 10.0) * 16.0)
    rots = pack_quats_smallest_three(q_xyzw) if version == 3 else pack_quats_first_three(q_xyzw)
    sh_q = np.empty((n, k1, 3), np.uint8)
    if k1:
        sh_q[:, :3] = quantize_sh(sh[:, :3], SH1_BITS)
        sh_q[:, 3:] = quantize_sh(sh[:, 3:], SH_REST_BITS)
    flags = FLAG_ANTIALIASED if antialiased else 0
    payload = b"".join([HEADER.pack(MAGIC, version, n, degree, fb, flags, 0), pos.tobytes(), alphas.tobytes(),
                        colors.tobytes(), scales.tobytes(), rots.tobytes(), sh_q.tobytes()])
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(gzip.compress(payload, compresslevel=6, mtime=0))
    os.replace(tmp, path)
    return path


def read_spz(path: str | Path, *, to_coordinates: str = "RDF") -> tuple[dict, int]:
    """``(splats, sh_degree)`` from an SPZ file (versions 1-3, gzip container)."""
    path = Path(path)
    try:
        raw = gzip.decompress(path.read_bytes())
    except (OSError, EOFError) as e:
        raise ValueError(f"{path}: not a gzip stream, so not an SPZ (v1-v3) file: {e}") from e
    if len(raw) < HEADER.size:
        raise ValueError(f"{path}: SPZ payload shorter than its 16-byte header")
    magic, version, n, degree, fb, flags, _ = HEADER.unpack_from(raw, 0)
    if magic != MAGIC:
        raise ValueError(f"{path}: bad SPZ magic 0x{magic:08x} (expected 0x{MAGIC:08x})")
    if version not in (1, 2, 3):
        raise ValueError(f"{path}: SPZ version {version} not supported (1-3)")
    if flags & FLAG_HAS_EXTENSIONS:
        raise ValueError(f"{path}: SPZ extensions are not supported by this reader")
    if degree > 3:
        raise ValueError(f"{path}: SH degree {degree} > 3 not supported")
    k1 = (degree + 1) ** 2 - 1
    pos_bytes = 6 if version == 1 else 9
    rot_bytes = 4 if version >= 3 else 3
    sizes = [n * pos_bytes, n, n * 3, n * 3, n * rot_bytes, n * k1 * 3]
    if len(raw) < HEADER.size + sum(sizes):
        raise ValueError(f"{path}: truncated SPZ payload ({len(raw)} bytes, need {HEADER.size + sum(sizes)})")
    off = HEADER.size
    parts = []
    for s in sizes:
        parts.append(np.frombuffer(raw, dtype=np.uint8, count=s, offset=off))
        off += s
    pos, alphas, colors, scales, rots, sh = parts
    if version == 1:
        means = pos.view("<f2").astype(np.float64).reshape(n, 3)
    else:
        b = pos.reshape(n * 3, 3).astype(np.int64)
        fixed = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        fixed = np.where(fixed & 0x800000, fixed - (1 << 24), fixed)  # sign extension
        means = (fixed.astype(np.float64) / (1 << fb)).reshape(n, 3)
    q_xyzw = (unpack_quats_smallest_three(rots.reshape(n, 4)) if version >= 3
              else unpack_quats_first_three(rots.reshape(n, 3)))
    shN = (sh.reshape(n, k1, 3).astype(np.float64) - 128.0) / 128.0
    if to_coordinates == "RDF":
        means = means * POS_FLIP_YZ
        q_xyzw = q_xyzw * np.array([1.0, -1.0, -1.0, 1.0])
        shN = shN * SH_FLIP_YZ[:k1, None]
    elif to_coordinates != "none":
        raise ValueError(f"to_coordinates must be 'RDF' or 'none', got {to_coordinates!r}")
    arrays = {
        "means": means,
        "quats": np.concatenate([q_xyzw[:, 3:], q_xyzw[:, :3]], axis=1),  # xyzw -> wxyz
        "scales": scales.reshape(n, 3).astype(np.float64) / 16.0 - 10.0,
        "opacities": logit(alphas.astype(np.float64) / 255.0, 0.5 / 255.0),
        "sh0": ((colors.reshape(n, 1, 3).astype(np.float64) / 255.0) - 0.5) / COLOR_SCALE,
        "shN": shN,
    }
    return splats_to_torch(arrays), degree
