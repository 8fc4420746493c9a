"""Inria 3DGS PLY: the layout every Gaussian-splat viewer reads.

Kerbl et al. 2023's reference code (``GaussianModel.save_ply``) writes one ``vertex`` element, binary little
endian, all ``float`` (float32) properties in this order::

    x y z nx ny nz f_dc_0 f_dc_1 f_dc_2 f_rest_0 .. f_rest_{3(K-1)-1} opacity scale_0 scale_1 scale_2 rot_0 .. rot_3

* normals are written as zeros (3DGS has none; viewers ignore them but expect the fields);
* ``f_dc_c`` is the DC SH coefficient of channel c;
* ``f_rest`` is **channel-major**: the reference transposes ``features_rest [N, K-1, 3]`` to ``[N, 3, K-1]``
  before flattening, so ``f_rest_0 .. f_rest_{K-2}`` are red, then green, then blue (45 fields for degree 3);
* ``opacity`` is the logit, ``scale_*`` are log scales and ``rot_*`` is the raw quaternion (w, x, y, z).

The reader here is a small numpy parser for exactly what we write (and any PLY with these float properties);
the export stage cross-checks files with the independent ``plyfile`` package.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from splatflow.formats.common import as_numpy_splats, sh_degree_of, splats_to_torch


def inria_property_names(sh_degree: int) -> list[str]:
    """Vertex property names, in file order, for SH degree ``sh_degree``."""
    n_rest = 3 * ((sh_degree + 1) ** 2 - 1)
    return (["x", "y", "z", "nx", "ny", "nz", "f_dc_0", "f_dc_1", "f_dc_2"]
            + [f"f_rest_{i}" for i in range(n_rest)]
            + ["opacity", "scale_0", "scale_1", "scale_2", "rot_0", "rot_1", "rot_2", "rot_3"])


def ply_header(n: int, sh_degree: int) -> str:
    lines = ["ply", "format binary_little_endian 1.0", f"element vertex {n}"]
    lines += [f"property float {name}" for name in inria_property_names(sh_degree)]
    lines.append("end_header")
    return "\n".join(lines) + "\n"


def splats_to_ply_array(splats: dict, sh_degree: int | None = None) -> np.ndarray:
    """The ``[N, P]`` float32 table of the Inria layout (P = 62 for degree 3)."""
    a = as_numpy_splats(splats, sh_degree)
    n, k1 = a["shN"].shape[:2]
    f_rest = a["shN"].transpose(0, 2, 1).reshape(n, 3 * k1)  # [N, K-1, 3] -> [N, 3, K-1] -> channel-major
    cols = [a["means"], np.zeros((n, 3), np.float32), a["sh0"].reshape(n, 3), f_rest,
            a["opacities"][:, None], a["scales"], a["quats"]]
    return np.concatenate(cols, axis=1).astype("<f4", copy=False)


def write_ply(path: str | Path, splats: dict, sh_degree: int | None = None) -> Path:
    """Write ``splats`` as an Inria PLY (atomically). ``sh_degree`` limits the bands (default: all allocated)."""
    path = Path(path)
    table = splats_to_ply_array(splats, sh_degree)
    n = table.shape[0]
    k1 = (table.shape[1] - 17) // 3  # 17 = xyz + normals + dc + opacity + scales + rot
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(ply_header(n, sh_degree_of(k1)).encode("ascii"))
        f.write(np.ascontiguousarray(table).tobytes())
    os.replace(tmp, path)
    return path


_PLY_TYPES = {"float": "f4", "float32": "f4", "double": "f8", "float64": "f8", "uchar": "u1", "uint8": "u1",
              "char": "i1", "int8": "i1", "short": "i2", "int16": "i2", "ushort": "u2", "uint16": "u2",
              "int": "i4", "int32": "i4", "uint": "u4", "uint32": "u4"}


def read_ply_vertices(path: str | Path) -> np.ndarray:
    """The ``vertex`` element of a binary PLY as a numpy structured array (our own parser)."""
    path = Path(path)
    with open(path, "rb") as f:
        if f.readline().strip() != b"ply":
            raise ValueError(f"{path}: not a PLY file (no 'ply' magic line)")
        fmt, n, props, seen_vertex, other_before = None, None, [], False, False
        while True:
            line = f.readline()
            if not line:
                raise ValueError(f"{path}: PLY header has no end_header")
            tok = line.decode("ascii", "replace").split()
            if not tok or tok[0] in ("comment", "obj_info"):
                continue
            if tok[0] == "end_header":
                break
            if tok[0] == "format":
                fmt = tok[1]
            elif tok[0] == "element":
                # elements after the vertex element are ignored (their data follows the vertex block)
                seen_vertex = tok[1] == "vertex"
                if seen_vertex:
                    n = int(tok[2])
                elif n is None:
                    other_before = True
            elif tok[0] == "property" and seen_vertex:
                if tok[1] == "list":
                    raise ValueError(f"{path}: list properties in the vertex element are not supported")
                props.append((tok[2], _PLY_TYPES[tok[1]]))
        if fmt not in ("binary_little_endian", "binary_big_endian"):
            raise ValueError(f"{path}: PLY format {fmt!r} not supported (binary only)")
        if n is None or other_before:
            raise ValueError(f"{path}: PLY must start with a 'vertex' element")
        endian = "<" if fmt == "binary_little_endian" else ">"
        dtype = np.dtype([(name, endian + t) for name, t in props])
        data = np.fromfile(f, dtype=dtype, count=n)
    if len(data) != n:
        raise ValueError(f"{path}: truncated PLY ({len(data)} of {n} vertices)")
    return data


def vertices_to_splats(v: np.ndarray, source: str = "PLY") -> dict:
    """Inria-layout vertex records (numpy structured array, e.g. from plyfile) -> splats dict (torch)."""
    names = v.dtype.names
    need = ["x", "y", "z", "f_dc_0", "f_dc_1", "f_dc_2", "opacity", "scale_0", "scale_1", "scale_2",
            "rot_0", "rot_1", "rot_2", "rot_3"]
    missing = [k for k in need if k not in names]
    if missing:
        raise ValueError(f"{source}: not an Inria 3DGS PLY, missing properties {missing}")
    rest = sorted((int(k.split("_")[-1]) for k in names if k.startswith("f_rest_")))
    n_rest = len(rest)
    if rest != list(range(n_rest)) or n_rest % 3:
        raise ValueError(f"{source}: f_rest_* properties are not 0..3(K-1)-1")
    k1 = n_rest // 3
    sh_degree_of(k1)
    n = len(v)

    def cols(keys):
        return np.stack([np.asarray(v[k], dtype=np.float32) for k in keys], axis=1) if keys else np.zeros((n, 0),
                                                                                                        np.float32)

    f_rest = cols([f"f_rest_{i}" for i in range(n_rest)])  # [N, 3*(K-1)], channel-major
    arrays = {
        "means": cols(["x", "y", "z"]),
        "quats": cols(["rot_0", "rot_1", "rot_2", "rot_3"]),
        "scales": cols(["scale_0", "scale_1", "scale_2"]),
        "opacities": np.asarray(v["opacity"], dtype=np.float32),
        "sh0": cols(["f_dc_0", "f_dc_1", "f_dc_2"]).reshape(n, 1, 3),
        "shN": f_rest.reshape(n, 3, k1).transpose(0, 2, 1),  # [N, 3, K-1] -> [N, K-1, 3]
    }
    return splats_to_torch(arrays)


def read_ply(path: str | Path) -> tuple[dict, int]:
    """``(splats, sh_degree)`` from an Inria 3DGS PLY."""
    splats = vertices_to_splats(read_ply_vertices(path), str(path))
    return splats, sh_degree_of(splats["shN"].shape[1])
