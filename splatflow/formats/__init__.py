"""Exchange formats for trained Gaussians: Inria PLY, antimatter15 ``.splat`` and Niantic SPZ.

Every writer takes and every reader returns the checkpoint ``splats`` dict of docs/CONTRACTS.md
(``means, quats (wxyz), scales (log), opacities (logit), sh0 [N,1,3], shN [N,K-1,3]``) as float32 CPU tensors.
"""

from splatflow.formats.common import as_numpy_splats, splats_to_torch
from splatflow.formats.ply import read_ply, write_ply
from splatflow.formats.splat import read_splat, write_splat
from splatflow.formats.spz import read_spz, write_spz

__all__ = ["as_numpy_splats", "splats_to_torch", "read_ply", "write_ply", "read_splat", "write_splat",
           "read_spz", "write_spz"]
