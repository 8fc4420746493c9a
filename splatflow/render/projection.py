"""EWA projection of 3D Gaussians and spherical-harmonics colour, in plain PyTorch (differentiable by autograd).

Both the CPU backend and the torch oracle start from these functions, so their only difference is the
rasterization (tile lists and compositing), which is where the speed and the risk are. Projection itself is
checked against gsplat's own PyTorch reference (`gsplat.cuda._torch_impl`) in the tests.

The math follows gsplat 1.5.3's CUDA kernels, which follow the EWA splatting of Zwicker et al., "EWA Volume
Splatting" (IEEE Vis 2001) as used by Kerbl et al., "3D Gaussian Splatting for Real-Time Radiance Field
Rendering" (SIGGRAPH 2023):

* camera-space mean ``t = R x + t0``; a Gaussian with ``t_z`` outside ``[near, far]`` is culled (radius 0);
* the Jacobian of the pinhole projection is taken at the mean with ``x/z``, ``y/z`` clamped to 1.3x the field of
  view, so Gaussians far outside the image do not get huge 2D footprints;
* ``eps2d`` (0.3 px^2) is added to the 2D covariance (a one-pixel low-pass filter). In ``antialiased`` mode the
  opacity is multiplied by ``sqrt(det(S) / det(S + eps I))`` (Yu et al., "Mip-Splatting", CVPR 2024) so the
  filter does not change a Gaussian's total energy;
* the screen-space bounding radius is opacity aware (Radl et al., "StopThePop", SIGGRAPH 2024, Sec. B.2 of
  arXiv:2402.00525): ``extend = min(3.33, sqrt(2 ln(opacity / (1/255))))`` standard deviations per axis, so every
  pixel outside the radius has ``alpha < 1/255`` and would be skipped anyway. A Gaussian whose opacity is below
  1/255, whose rectangle misses the image, or whose radius is not above ``radius_clip`` gets radius 0.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .constants import ALPHA_MIN, EXTEND_MAX, SH_C0, SH_C1, SH_C2, SH_C3, TILE


def quat_to_rotmat(quats: Tensor) -> Tensor:
    """Rotation matrices from (not necessarily unit) quaternions in wxyz order. [..., 4] -> [..., 3, 3]."""
    w, x, y, z = F.normalize(quats, p=2, dim=-1).unbind(-1)
    rows = [
        1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y),
        2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x),
        2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y),
    ]
    return torch.stack(rows, dim=-1).reshape(quats.shape[:-1] + (3, 3))


def quat_scale_to_covar(quats: Tensor, scales: Tensor) -> Tensor:
    """World-space covariance ``R S S^T R^T`` from quaternions [N, 4] and (real, not log) scales [N, 3]."""
    M = quat_to_rotmat(quats) * scales[..., None, :]  # [N, 3, 3]  (R @ diag(s))
    return M @ M.transpose(-1, -2)  # [N, 3, 3]


def eval_sh(degree: int, dirs: Tensor, coeffs: Tensor) -> Tensor:
    """Evaluate real SH of ``degree`` (0..3) with coefficients [..., K, 3] along directions [..., 3].

    ``dirs`` need not be unit length (they are normalised here, as gsplat does); only the first
    ``(degree + 1)**2`` coefficients are used. Returns the raw sum [..., 3] (no +0.5 offset, no clamp).
    """
    if not 0 <= degree <= 3:
        raise ValueError(f"sh_degree must be 0..3, got {degree}")
    n_bases = (degree + 1) ** 2
    if coeffs.shape[-2] < n_bases:
        raise ValueError(f"sh_degree {degree} needs {n_bases} coefficients per Gaussian, colors has {coeffs.shape[-2]}")
    bases = [torch.full_like(dirs[..., 0], SH_C0)]
    if degree > 0:
        x, y, z = F.normalize(dirs, p=2, dim=-1).unbind(-1)
        bases += [-SH_C1 * y, SH_C1 * z, -SH_C1 * x]
        if degree > 1:
            xx, yy, zz = x * x, y * y, z * z
            xy, yz, xz = x * y, y * z, x * z
            bases += [
                SH_C2[0] * xy,
                SH_C2[1] * yz,
                SH_C2[2] * (2.0 * zz - xx - yy),
                SH_C2[3] * xz,
                SH_C2[4] * (xx - yy),
            ]
            if degree > 2:
                bases += [
                    SH_C3[0] * y * (3.0 * xx - yy),
                    SH_C3[1] * xy * z,
                    SH_C3[2] * y * (4.0 * zz - xx - yy),
                    SH_C3[3] * z * (2.0 * zz - 3.0 * xx - 3.0 * yy),
                    SH_C3[4] * x * (4.0 * zz - xx - yy),
                    SH_C3[5] * z * (xx - yy),
                    SH_C3[6] * x * (xx - 3.0 * yy),
                ]
    B = torch.stack(bases, dim=-1)  # [..., n_bases]
    return (B[..., None] * coeffs[..., :n_bases, :]).sum(dim=-2)  # [..., 3]


def project_gaussians(
    means: Tensor,  # [N, 3]
    quats: Tensor,  # [N, 4]
    scales: Tensor,  # [N, 3]
    opacities: Tensor,  # [N]
    viewmats: Tensor,  # [C, 4, 4]
    Ks: Tensor,  # [C, 3, 3]
    width: int,
    height: int,
    near_plane: float = 0.01,
    far_plane: float = 1e10,
    eps2d: float = 0.3,
    antialiased: bool = False,
    radius_clip: float = 0.0,
) -> dict[str, Tensor]:
    """Project N Gaussians into C pinhole cameras (gsplat's ``fully_fused_projection``, unpacked).

    Returns a dict with ``means2d`` [C, N, 2] (pixels), ``conics`` [C, N, 3] (upper triangle a, b, c of the
    inverse 2D covariance), ``depths`` [C, N] (camera z), ``opacities`` [C, N] (times the compensation in
    antialiased mode), ``radii`` [C, N, 2] int32 (0 = culled) and ``valid`` [C, N] bool. Culled entries hold
    zeros and receive zero gradient; no NaN is produced for Gaussians behind the camera.
    """
    C = viewmats.shape[0]
    R = viewmats[:, :3, :3]  # [C, 3, 3]
    t = viewmats[:, :3, 3]  # [C, 3]
    means_c = torch.einsum("cij,nj->cni", R, means) + t[:, None, :]  # [C, N, 3]
    covar = quat_scale_to_covar(quats, scales)  # [N, 3, 3]
    covar_c = torch.einsum("cij,njk,clk->cnil", R, covar, R)  # [C, N, 3, 3]

    x, y, z = means_c.unbind(-1)  # [C, N] each
    in_depth = (z >= near_plane) & (z <= far_plane)  # [C, N]
    z_safe = torch.where(in_depth, z, torch.ones_like(z))

    fx = Ks[:, 0, 0, None]  # [C, 1]
    fy = Ks[:, 1, 1, None]
    cx = Ks[:, 0, 2, None]
    cy = Ks[:, 1, 2, None]
    tan_fovx = 0.5 * width / fx
    tan_fovy = 0.5 * height / fy
    lim_x_pos = (width - cx) / fx + 0.3 * tan_fovx
    lim_x_neg = cx / fx + 0.3 * tan_fovx
    lim_y_pos = (height - cy) / fy + 0.3 * tan_fovy
    lim_y_neg = cy / fy + 0.3 * tan_fovy
    rz = 1.0 / z_safe
    tx = z_safe * torch.minimum(lim_x_pos, torch.maximum(-lim_x_neg, x * rz))  # [C, N]
    ty = z_safe * torch.minimum(lim_y_pos, torch.maximum(-lim_y_neg, y * rz))
    zeros = torch.zeros_like(z)
    J = torch.stack(
        [fx * rz, zeros, -fx * tx * rz * rz, zeros, fy * rz, -fy * ty * rz * rz], dim=-1
    ).reshape(C, -1, 2, 3)  # [C, N, 2, 3]
    cov2d = J @ covar_c @ J.transpose(-1, -2)  # [C, N, 2, 2]
    means2d = torch.stack([fx * x * rz + cx, fy * y * rz + cy], dim=-1)  # [C, N, 2]

    a = cov2d[..., 0, 0]
    b = 0.5 * (cov2d[..., 0, 1] + cov2d[..., 1, 0])
    c = cov2d[..., 1, 1]
    det_orig = a * c - b * b
    a = a + eps2d
    c = c + eps2d
    det = a * c - b * b  # [C, N]
    valid = in_depth & (det > 0)
    det_safe = torch.where(valid, det, torch.ones_like(det))
    conics = torch.stack([c / det_safe, -b / det_safe, a / det_safe], dim=-1)  # [C, N, 3]

    opac = opacities[None, :].expand(C, -1)  # [C, N]
    if antialiased:
        ratio = det_orig / det_safe
        pos = valid & (ratio > 0)
        comp = torch.where(pos, torch.sqrt(torch.where(pos, ratio, torch.ones_like(ratio))), torch.zeros_like(ratio))
        opac = opac * comp  # [C, N]

    with torch.no_grad():
        # radii are integers and carry no gradient (gsplat: "non differentiable")
        op_d = opac.detach()
        valid = valid & (op_d >= ALPHA_MIN)
        extend = torch.clamp(
            torch.sqrt(2.0 * torch.log(torch.clamp(op_d, min=ALPHA_MIN) / ALPHA_MIN)), max=EXTEND_MAX
        )
        rad_x = torch.ceil(extend * torch.sqrt(torch.clamp(a.detach(), min=0.0)))  # [C, N]
        rad_y = torch.ceil(extend * torch.sqrt(torch.clamp(c.detach(), min=0.0)))
        valid = valid & ~((rad_x <= radius_clip) & (rad_y <= radius_clip))
        m2 = means2d.detach()
        on_screen = (
            (m2[..., 0] + rad_x > 0)
            & (m2[..., 0] - rad_x < width)
            & (m2[..., 1] + rad_y > 0)
            & (m2[..., 1] - rad_y < height)
        )
        valid = valid & on_screen & torch.isfinite(rad_x) & torch.isfinite(rad_y)
        radii = torch.stack([rad_x, rad_y], dim=-1).where(valid[..., None], rad_x.new_zeros(()))
        radii = radii.to(torch.int32)  # [C, N, 2]

    vmask = valid[..., None]
    return {
        "means2d": torch.where(vmask, means2d, means2d.new_zeros(())),  # [C, N, 2]
        "conics": torch.where(vmask, conics, conics.new_zeros(())),  # [C, N, 3]
        "depths": torch.where(valid, z, z.new_zeros(())),  # [C, N]
        "opacities": torch.where(valid, opac, opac.new_zeros(())),  # [C, N]
        "radii": radii,
        "valid": valid,
    }


def camera_centers(viewmats: Tensor) -> Tensor:
    """World-space camera centres [C, 3] of world-to-camera matrices [C, 4, 4] (``-R^T t``)."""
    R = viewmats[:, :3, :3]
    t = viewmats[:, :3, 3]
    return -torch.einsum("cji,cj->ci", R, t)  # [C, 3]


def gaussian_colors(
    colors: Tensor, sh_degree: int | None, means: Tensor, viewmats: Tensor, valid: Tensor
) -> Tensor:
    """Per-camera RGB [C, N, 3] from SH coefficients ([N, K, 3] with ``sh_degree``) or plain colours.

    SH colours get gsplat's ``clamp_min(sh + 0.5, 0)``; the view direction is ``mean - camera centre``.
    Plain colours ([N, D] or [C, N, D]) are used as given.
    """
    C = viewmats.shape[0]
    N = means.shape[0]
    if sh_degree is None:
        if colors.dim() == 2:
            return colors[None].expand(C, -1, -1)  # [C, N, D]
        if colors.dim() == 3 and colors.shape[0] == C and colors.shape[1] == N:
            return colors
        raise ValueError(f"colors without sh_degree must be [N, D] or [C, N, D]; got {tuple(colors.shape)}")
    if colors.dim() != 3 or colors.shape[0] != N or colors.shape[-1] != 3:
        raise ValueError(f"SH colors must be [N, K, 3]; got {tuple(colors.shape)}")
    dirs = means[None, :, :] - camera_centers(viewmats)[:, None, :]  # [C, N, 3]
    if sh_degree > 0:
        # Keep normalisation finite for culled Gaussians sitting on the camera centre.
        dirs = torch.where(valid[..., None], dirs, torch.ones_like(dirs))
    rgb = eval_sh(sh_degree, dirs, colors[None].expand(C, -1, -1, -1))  # [C, N, 3]
    return torch.clamp_min(rgb + 0.5, 0.0)


def tile_grid(width: int, height: int, tile_size: int = TILE) -> tuple[int, int]:
    """Number of tiles (across, down)."""
    return math.ceil(width / tile_size), math.ceil(height / tile_size)
