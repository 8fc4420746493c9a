"""Synthetic scene generator: a textured room with boxes, ray-cast from a camera orbit.

Why a synthetic scene: the demo and most tests need a scene whose true cameras are known exactly (to measure the
SfM camera error, see ``splatflow.scene.alignment``) and that is small and deterministic. Why this particular
scene: COLMAP's SIFT matching needs rich, non-repeating texture and enough overlap between neighbouring views
(docs/design.md §5: at most 10 degrees between neighbours). So every face of the room and of the boxes carries its own
texture, a crop of one of scikit-image's bundled photographs mixed with multi-scale colour noise, so no two places
look alike; shading is Lambertian (view-independent, which is what a 3D Gaussian Splatting model with low SH degree
reproduces best).

Image formation (per view): rays through a 2x2 grid of sub-pixel samples per pixel (2x supersampling, anti-aliasing),
first hit against the room (an axis-aligned box seen from inside) and the boxes (boxes rotated about the vertical
axis), bilinear texture lookup, shading, box-filter down to the output size, Gaussian sensor noise, 8-bit JPEG.

Camera convention is COLMAP's: ``x_cam = R @ X_world + t``; the camera looks along +z, x to the right, y down;
pixel ``(u, v) = (fx * x/z + cx, fy * y/z + cy)`` with the origin at the top-left *corner* of the image, so the
centre of pixel (row i, column j) is ``(j + 0.5, i + 0.5)``. World: z is up, the floor is z = 0.

Outputs of :func:`write_scene`::

    <out>/images/0000.jpg ...
    <out>/ground_truth/cameras.txt, images.txt, points3D.txt   COLMAP text model (PINHOLE camera), points sampled
                                                               on the scene surfaces with their visibility tracks
    <out>/ground_truth/cameras.json                            same cameras as K / world_to_cam matrices
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import cv2
import numpy as np

__all__ = [
    "DEMO_DEFAULTS",
    "MAX_STEP_DEG",
    "Box",
    "Room",
    "SceneOptions",
    "build_room",
    "orbit_cameras",
    "render_view",
    "write_scene",
    "write_colmap_text_model",
]

#: Largest angle between neighbouring views that still gives COLMAP enough overlap (docs/design.md §5).
MAX_STEP_DEG = 10.0

#: The demo scene (``splatflow demo-scene``): 36 views at 320x240 on a full orbit, 10 degrees apart, sized so that
#: `make demo` is a first look of a few minutes on 2 cores (its training settings: base.scenes.demo.params in
#: params.yaml). At 480x360 (measured on a 2-core machine shared with other jobs, so as CPU time): generation
#: ~30 CPU-s; full-resolution SfM ~65 CPU-s (SIFT ~45%, exhaustive matching of 630 pairs ~45%) with 36/36 views
#: registered, ~7.3k points, 0.21 px reprojection error, camera centres within 0.01% of the orbit extent.
DEMO_DEFAULTS: dict = {
    "n_views": 36,
    "width": 320,
    "height": 240,
    "arc_deg": 360.0,
    "radius_m": 2.8,
    "height_m": 1.4,
    "seed": 0,
}

# Texture density in texels per metre. The room is large and seen from afar, boxes are close to the cameras.
_ROOM_TEXELS_PER_M = 110.0
_BOX_TEXELS_PER_M = 260.0
# Directional light (towards the light), normalised at use. Lambertian shading = ambient + diffuse * max(n.l, 0).
_LIGHT_DIR = np.array([0.35, 0.55, 1.0])
_AMBIENT = 0.5
_DIFFUSE = 0.5


@dataclass(frozen=True)
class SceneOptions:
    """Everything that determines the generated images (deterministic for equal options)."""

    n_views: int = DEMO_DEFAULTS["n_views"]
    width: int = DEMO_DEFAULTS["width"]
    height: int = DEMO_DEFAULTS["height"]
    arc_deg: float = DEMO_DEFAULTS["arc_deg"]  # 360 = full orbit; otherwise the first and last view span the arc
    radius_m: float = DEMO_DEFAULTS["radius_m"]  # orbit radius around the room centre
    height_m: float = DEMO_DEFAULTS["height_m"]  # camera height above the floor
    seed: int = DEMO_DEFAULTS["seed"]
    hfov_deg: float = 65.0  # horizontal field of view
    n_points: int = 20000  # surface points sampled for points3D.txt (before dropping unseen ones)
    noise_sigma: float = 1.5  # sensor noise, in 8-bit levels
    jpeg_quality: int = 95
    supersample: int = 2

    def __post_init__(self) -> None:
        if self.n_views < 2:
            raise ValueError(f"n_views must be >= 2, got {self.n_views}")
        if self.width < 16 or self.height < 16:
            raise ValueError(f"width/height must be >= 16 px, got {self.width}x{self.height}")
        if not 0.0 < self.arc_deg <= 360.0:
            raise ValueError(f"arc_deg must be in (0, 360], got {self.arc_deg}")
        if self.step_deg > MAX_STEP_DEG + 1e-9:
            raise ValueError(
                f"{self.n_views} views on a {self.arc_deg:g} degree arc are {self.step_deg:.1f} degrees apart; COLMAP "
                f"needs <= {MAX_STEP_DEG:g} degrees between neighbours: use more views or a smaller arc"
            )
        if not 0.5 <= self.radius_m <= 3.5:
            raise ValueError(f"radius_m must be in [0.5, 3.5] (the room is 8 m wide), got {self.radius_m}")
        if not 0.2 <= self.height_m <= 2.8:
            raise ValueError(f"height_m must be in [0.2, 2.8] (the room is 3 m high), got {self.height_m}")
        if not 20.0 <= self.hfov_deg <= 120.0:
            raise ValueError(f"hfov_deg must be in [20, 120], got {self.hfov_deg}")
        if self.supersample < 1:
            raise ValueError(f"supersample must be >= 1, got {self.supersample}")
        if not 1 <= self.jpeg_quality <= 100:
            raise ValueError(f"jpeg_quality must be in [1, 100], got {self.jpeg_quality}")

    @property
    def step_deg(self) -> float:
        """Angle between neighbouring views on the orbit."""
        full = abs(self.arc_deg - 360.0) < 1e-9
        return self.arc_deg / (self.n_views if full else self.n_views - 1)


@dataclass
class Box:
    """An oriented box: centre, half extents (metres) and a rotation about the vertical (z) axis."""

    center: np.ndarray  # [3]
    half: np.ndarray  # [3]
    yaw_rad: float = 0.0

    @property
    def rot_world_from_local(self) -> np.ndarray:
        c, s = math.cos(self.yaw_rad), math.sin(self.yaw_rad)
        return np.array([[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]])


@dataclass
class Room:
    """The scene: ``boxes[0]`` is the room itself (seen from inside), the rest are solid boxes.

    ``textures[s]`` is the albedo texture (float32 [h, w, 3] in [0, 1]) of surface ``s = 6 * box + face`` where
    ``face = 2 * axis + (0 for the -side, 1 for the +side)`` in the box's local frame.
    """

    boxes: list[Box]
    textures: list[np.ndarray] = field(default_factory=list)

    def surface_frame(self, surface: int) -> tuple[int, int, int, int]:
        """``(box, axis, side, texels_per_m)`` of a surface id."""
        box, face = divmod(surface, 6)
        axis, side = divmod(face, 2)
        density = _ROOM_TEXELS_PER_M if box == 0 else _BOX_TEXELS_PER_M
        return box, axis, side, density


# --------------------------------------------------------------------------------------------- scene construction

_COLOUR_PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "hubble_deep_field", "immunohistochemistry",
                  "retina", "colorwheel")
_GREY_PHOTOS = ("camera", "brick", "grass", "gravel", "moon", "coins", "clock", "cell", "page", "text")


def _load_photos() -> list[np.ndarray]:
    """scikit-image's bundled photographs as float32 RGB in [0, 1] (bundled with the wheel: no download)."""
    import skimage.data

    photos = []
    for name in _COLOUR_PHOTOS + _GREY_PHOTOS:
        img = np.asarray(getattr(skimage.data, name)())
        if img.ndim == 2:
            img = np.repeat(img[:, :, None], 3, axis=2)
        photos.append(img[:, :, :3].astype(np.float32) / 255.0)
    return photos


def _smooth_noise(rng: np.random.Generator, h: int, w: int, cell_px: int) -> np.ndarray:
    """Colour noise with features of about ``cell_px`` texels: a random grid upsampled with bicubic interpolation."""
    gh, gw = max(2, h // cell_px + 2), max(2, w // cell_px + 2)
    grid = rng.random((gh, gw, 3), dtype=np.float32)
    return np.clip(cv2.resize(grid, (w, h), interpolation=cv2.INTER_CUBIC), 0.0, 1.0)


def _make_texture(rng: np.random.Generator, photos: list[np.ndarray], photo_idx: int, h: int, w: int) -> np.ndarray:
    """A unique texture: a random crop of a photo (grey photos get a random tint) mixed with multi-scale noise."""
    photo = photos[photo_idx % len(photos)]
    ph, pw = photo.shape[:2]
    # Crop with the face's aspect ratio, at least half of the photo's shorter side.
    aspect = w / h
    crop_h = int(rng.uniform(0.5, 1.0) * min(ph, pw / aspect))
    crop_w = max(8, min(pw, int(crop_h * aspect)))
    crop_h = max(8, min(ph, crop_h))
    y0 = int(rng.integers(0, ph - crop_h + 1))
    x0 = int(rng.integers(0, pw - crop_w + 1))
    crop = cv2.resize(photo[y0:y0 + crop_h, x0:x0 + crop_w], (w, h), interpolation=cv2.INTER_LINEAR)
    if photo_idx % len(photos) >= len(_COLOUR_PHOTOS):
        crop = crop * rng.uniform(0.4, 1.0, size=3).astype(np.float32)
    low = _smooth_noise(rng, h, w, 48)
    mid = _smooth_noise(rng, h, w, 10)
    fine = _smooth_noise(rng, h, w, 3)
    tex = 0.5 * crop + 0.25 * low + 0.15 * mid + 0.10 * fine
    _draw_blobs(rng, tex)
    return np.clip(tex, 0.0, 1.0).astype(np.float32)


def _draw_blobs(rng: np.random.Generator, tex: np.ndarray) -> None:
    """Scatter sharp-edged discs and squares (3-24 texels, random colours) over ``tex`` in place.

    Photos resized onto large faces and smooth noise are blurry at the pixel scale; SIFT's difference-of-Gaussians
    detector needs blob-like structure of a few pixels, so these shapes raise the number of stable, unique
    keypoints (and thus registered views and points) several-fold.
    """
    h, w = tex.shape[:2]
    n = max(4, (h * w) // 500)
    xs = rng.integers(0, w, n)
    ys = rng.integers(0, h, n)
    radii = np.exp(rng.uniform(np.log(1.5), np.log(12.0), n))
    colours = rng.random((n, 3))
    squares = rng.random(n) < 0.4
    for x, y, r, c, sq in zip(xs, ys, radii, colours, squares):
        colour = tuple(float(v) for v in c)
        if sq:
            ri = int(round(r))
            cv2.rectangle(tex, (int(x) - ri, int(y) - ri), (int(x) + ri, int(y) + ri), colour, -1)
        else:
            cv2.circle(tex, (int(x), int(y)), max(1, int(round(r))), colour, -1, lineType=cv2.LINE_AA)


def build_room(seed: int, n_boxes: int = 7) -> Room:
    """The room (8 x 8 x 3 m, floor at z = 0) with ``n_boxes`` boxes on the floor near the centre, and textures.

    Box placement uses rejection sampling so boxes do not overlap; one small box stands on top of another to give
    the scene some vertical structure.
    """
    rng = np.random.default_rng(seed)
    boxes = [Box(center=np.array([0.0, 0.0, 1.5]), half=np.array([4.0, 4.0, 1.5]))]
    placed: list[tuple[float, float, float]] = []  # (x, y, bounding radius)
    attempts = 0
    while len(placed) < n_boxes and attempts < 1000:
        attempts += 1
        half = rng.uniform([0.15, 0.15, 0.15], [0.45, 0.45, 0.6])
        r_xy = float(np.hypot(half[0], half[1]))
        ang = rng.uniform(0, 2 * np.pi)
        dist = rng.uniform(0.0, 1.7 - r_xy)
        x, y = dist * math.cos(ang), dist * math.sin(ang)
        if any(math.hypot(x - px, y - py) < r_xy + pr + 0.1 for px, py, pr in placed):
            continue
        placed.append((x, y, r_xy))
        boxes.append(Box(center=np.array([x, y, half[2]]), half=half, yaw_rad=float(rng.uniform(0, np.pi / 2))))
    # A smaller box on top of the tallest one.
    tallest = max(boxes[1:], key=lambda b: b.half[2])
    top_half = np.minimum(tallest.half * 0.5, 0.2)
    boxes.append(Box(center=np.array([tallest.center[0], tallest.center[1], 2 * tallest.half[2] + top_half[2]]),
                     half=top_half, yaw_rad=tallest.yaw_rad + 0.4))

    photos = _load_photos()
    room = Room(boxes=boxes)
    photo_order = rng.permutation(len(photos))
    for s in range(6 * len(boxes)):
        box_i, axis, _side, density = room.surface_frame(s)
        a1, a2 = _uv_axes(axis)
        ext = 2.0 * boxes[box_i].half
        w = max(8, int(math.ceil(ext[a1] * density)) + 2)
        h = max(8, int(math.ceil(ext[a2] * density)) + 2)
        room.textures.append(_make_texture(rng, photos, int(photo_order[s % len(photos)]) + s // len(photos), h, w))
    return room


def _uv_axes(axis: int) -> tuple[int, int]:
    """The two in-plane local axes of a face normal to ``axis``; the second is vertical for walls."""
    return {0: (1, 2), 1: (0, 2), 2: (0, 1)}[axis]


# --------------------------------------------------------------------------------------------------- ray casting


def _intersect(room: Room, origin: np.ndarray, dirs: np.ndarray, candidates: list | None = None):
    """First hit of rays ``origin + t * dirs`` (one shared origin [3], directions [R, 3], world) with the scene.

    Slab method (Kay & Kajiya 1986) per box in the box's local frame. The room is hit from inside: its exit point.
    ``candidates[b]`` (optional) lists the ray indices that can hit box ``b`` (e.g. those inside the box's projected
    bounding rectangle); None tests every ray.
    Returns ``t [R]``, ``surface [R] int``, ``local_point [R, 3]`` (hit point in the hit box's local frame).
    """
    n = dirs.shape[0]
    dt = dirs.dtype
    d_safe = np.where(np.abs(dirs) < 1e-12, np.asarray(1e-12, dt), dirs)
    # The room (axis-aligned, seen from inside): exit distance along each axis is (sign(d) * half - o) / d.
    room_box = room.boxes[0]
    o_l = (origin - room_box.center).astype(dt)  # [3]
    t_axes = (np.copysign(room_box.half.astype(dt), d_safe) - o_l) / d_safe  # [R, 3]
    axis = np.argmin(t_axes, axis=1)
    best_t = np.take_along_axis(t_axes, axis[:, None], 1)[:, 0]
    side = np.take_along_axis(d_safe, axis[:, None], 1)[:, 0] > 0  # exit face on the side the ray travels to
    best_surface = 2 * axis + side.astype(np.int64)
    best_local = o_l + best_t[:, None] * dirs
    for bi in range(1, len(room.boxes)):
        box = room.boxes[bi]
        idx = np.arange(n) if candidates is None or candidates[bi] is None else candidates[bi]
        if idx.size == 0:
            continue
        rot = box.rot_world_from_local.astype(dt)
        o_b = ((origin - box.center) @ box.rot_world_from_local).astype(dt)  # [3] = R^T (o - c)
        d_w = dirs[idx]
        # d_b = d_w @ rot, spelled out: numpy's matmul with an inner size of 3 is several times slower.
        d_b = d_w[:, 0:1] * rot[0] + d_w[:, 1:2] * rot[1] + d_w[:, 2:3] * rot[2]  # [r, 3]
        d_b = np.where(np.abs(d_b) < 1e-12, np.asarray(1e-12, dt), d_b)
        half = box.half.astype(dt)
        t_near = (-np.copysign(half, d_b) - o_b) / d_b  # [r, 3] entry distance per slab
        t_far = (np.copysign(half, d_b) - o_b) / d_b
        axis = np.argmax(t_near, axis=1)
        t = np.take_along_axis(t_near, axis[:, None], 1)[:, 0]
        hit = (t <= t_far.min(axis=1)) & (t > 1e-6) & (t < best_t[idx])
        if not hit.any():
            continue
        h_idx = idx[hit]
        axis = axis[hit]
        t = t[hit]
        side = np.take_along_axis(d_b[hit], axis[:, None], 1)[:, 0] < 0  # entry face on the side the ray comes from
        best_t[h_idx] = t
        best_surface[h_idx] = 6 * bi + 2 * axis + side.astype(np.int64)
        best_local[h_idx] = o_b + t[:, None] * d_b[hit]
    return best_t, best_surface, best_local


def _box_candidates(room: Room, K: np.ndarray, world_to_cam: np.ndarray, width_s: int, height_s: int,
                    s: int) -> list:
    """Per box, the indices of sub-pixel rays (row-major [H*s, W*s]) inside its projected bounding rectangle.

    A convex box projects inside the rectangle spanned by its projected corners when all corners are in front of
    the camera; otherwise every ray is a candidate. This cuts ray-box tests to a few percent of the image.
    """
    out: list = [None]
    signs = np.array([[sx, sy, sz] for sx in (-1, 1) for sy in (-1, 1) for sz in (-1, 1)], dtype=float)  # [8, 3]
    grid = np.arange(width_s * height_s).reshape(height_s, width_s)
    for box in room.boxes[1:]:
        corners = (signs * box.half) @ box.rot_world_from_local.T + box.center  # [8, 3]
        cam = corners @ world_to_cam[:3, :3].T + world_to_cam[:3, 3]
        if np.any(cam[:, 2] <= 1e-3):
            out.append(None)
            continue
        uv = cam[:, :2] / cam[:, 2:3] * np.array([K[0, 0], K[1, 1]]) + K[:2, 2]  # [8, 2] pixels
        c0 = int(np.clip(np.floor(uv[:, 0].min() * s) - 1, 0, width_s))
        c1 = int(np.clip(np.ceil(uv[:, 0].max() * s) + 1, 0, width_s))
        r0 = int(np.clip(np.floor(uv[:, 1].min() * s) - 1, 0, height_s))
        r1 = int(np.clip(np.ceil(uv[:, 1].max() * s) + 1, 0, height_s))
        out.append(grid[r0:r1, c0:c1].ravel())
    return out


def _face_normal_world(room: Room, surface: int) -> np.ndarray:
    """Outward normal of a box face, or the inward normal of a room face (towards the viewer in both cases)."""
    box_i, axis, side, _ = room.surface_frame(surface)
    n_local = np.zeros(3)
    n_local[axis] = 1.0 if side == 1 else -1.0
    if box_i == 0:
        n_local = -n_local
    return room.boxes[box_i].rot_world_from_local @ n_local


def _shade(room: Room, surface: int) -> float:
    light = _LIGHT_DIR / np.linalg.norm(_LIGHT_DIR)
    return float(_AMBIENT + _DIFFUSE * max(0.0, float(_face_normal_world(room, surface) @ light)))


def _surface_colour(room: Room, surface: np.ndarray, local: np.ndarray) -> np.ndarray:
    """Shaded colour (float [R, 3] in [0, 1]) at hit points given by surface id and local coordinates."""
    out = np.zeros((surface.shape[0], 3), dtype=np.float32)
    for s in np.unique(surface):
        if s < 0:
            continue
        sel = np.nonzero(surface == s)[0]
        box_i, axis, _side, density = room.surface_frame(int(s))
        a1, a2 = _uv_axes(axis)
        half = room.boxes[box_i].half
        tex = room.textures[int(s)]
        # Texel coordinates: column along a1, row along a2 from the top (high a2 = row 0), +1 texel margin.
        col = (local[sel, a1] + half[a1]) * density + 0.5
        row = (half[a2] - local[sel, a2]) * density + 0.5
        out[sel] = _bilinear(tex, row, col) * _shade(room, int(s))
    return out


def _bilinear(tex: np.ndarray, row: np.ndarray, col: np.ndarray) -> np.ndarray:
    """Bilinear texture lookup (texel centres at integer + 0.5), clamped at the border."""
    h, w = tex.shape[:2]
    r = np.clip(row - 0.5, 0, h - 1.000001)
    c = np.clip(col - 0.5, 0, w - 1.000001)
    r0 = r.astype(np.int64)
    c0 = c.astype(np.int64)
    fr = (r - r0)[:, None].astype(np.float32)
    fc = (c - c0)[:, None].astype(np.float32)
    top = tex[r0, c0] * (1 - fc) + tex[r0, c0 + 1] * fc
    bot = tex[r0 + 1, c0] * (1 - fc) + tex[r0 + 1, c0 + 1] * fc
    return top * (1 - fr) + bot * fr


# ------------------------------------------------------------------------------------------------------ cameras


def look_at(center: np.ndarray, target: np.ndarray, up: np.ndarray = np.array([0.0, 0.0, 1.0])) -> np.ndarray:
    """World-to-camera 4x4 (COLMAP convention: x right, y down, z forward) for a camera at ``center``."""
    fwd = target - center
    fwd = fwd / np.linalg.norm(fwd)
    right = np.cross(fwd, up)
    right = right / np.linalg.norm(right)
    down = np.cross(fwd, right)
    rot = np.stack([right, down, fwd])  # rows: camera axes in world coordinates = R_cam_from_world
    w2c = np.eye(4)
    w2c[:3, :3] = rot
    w2c[:3, 3] = -rot @ center
    return w2c


def orbit_cameras(opts: SceneOptions) -> tuple[np.ndarray, list[np.ndarray]]:
    """``K [3, 3]`` and one world-to-camera 4x4 per view on the orbit, looking at the room centre.

    The camera height varies by +-0.15 m along the orbit (one and a half periods): a perfectly planar orbit is a
    weak configuration for the focal length in self-calibration.
    """
    fx = 0.5 * opts.width / math.tan(math.radians(opts.hfov_deg) / 2.0)
    K = np.array([[fx, 0.0, opts.width / 2.0], [0.0, fx, opts.height / 2.0], [0.0, 0.0, 1.0]])
    rng = np.random.default_rng(opts.seed + 1)
    phase = rng.uniform(0, 2 * np.pi)
    w2cs = []
    for i in range(opts.n_views):
        ang = math.radians(i * opts.step_deg) + phase
        center = np.array([opts.radius_m * math.cos(ang), opts.radius_m * math.sin(ang),
                           opts.height_m + 0.15 * math.sin(1.5 * ang)])
        target = np.array([0.0, 0.0, 0.45])
        w2cs.append(look_at(center, target))
    return K, w2cs


def render_view(room: Room, K: np.ndarray, world_to_cam: np.ndarray, width: int, height: int,
                supersample: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """Ray-cast one view. Returns ``(rgb float32 [H, W, 3] in [0, 1], depth float32 [H*s, W*s])``.

    ``depth`` is the camera-space z of the first hit at every sub-pixel sample (for visibility tests).
    """
    s = supersample
    # Sub-pixel sample positions: pixel j spans [j, j+1); samples at j + (k + 0.5) / s.
    x_cam = ((np.arange(width * s) + 0.5) / s - K[0, 2]) / K[0, 0]  # [W*s] normalised image coordinates
    y_cam = ((np.arange(height * s) + 0.5) / s - K[1, 2]) / K[1, 1]  # [H*s]
    rot = world_to_cam[:3, :3]
    center = -rot.T @ world_to_cam[:3, 3]
    # World ray directions R^T [x, y, 1] (camera z = 1), built by broadcasting instead of an [R, 3] @ [3, 3] product.
    d_world = (x_cam[None, :, None] * rot[0] + y_cam[:, None, None] * rot[1] + rot[2]).reshape(-1, 3)  # [R, 3]
    d_world = d_world.astype(np.float32)  # float32 halves memory traffic; t and texel positions need ~1e-5 m
    candidates = _box_candidates(room, K, world_to_cam, width * s, height * s, s)
    t, surface, local = _intersect(room, center, d_world, candidates)
    rgb = _surface_colour(room, surface, local)
    depth = t.astype(np.float32)  # rays have camera z = 1, so t is the camera-space depth
    rgb = rgb.reshape(height, s, width, s, 3)  # [H, s, W, s, 3]
    rgb = rgb.sum(axis=3).sum(axis=1) / float(s * s)  # [H, W, 3] box filter
    return rgb, depth.reshape(height * s, width * s)


# ----------------------------------------------------------------------------------------------- surface points


def sample_surface_points(room: Room, n_points: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``n_points`` points spread over all surfaces in proportion to area; returns (xyz [P, 3], rgb uint8 [P, 3])."""
    areas = []
    for s in range(6 * len(room.boxes)):
        box_i, axis, _side, _ = room.surface_frame(s)
        a1, a2 = _uv_axes(axis)
        h = room.boxes[box_i].half
        areas.append(4.0 * h[a1] * h[a2])
    areas_np = np.asarray(areas)
    surface = rng.choice(len(areas), size=n_points, p=areas_np / areas_np.sum())
    local = np.zeros((n_points, 3))
    xyz = np.zeros((n_points, 3))
    for s in np.unique(surface):
        sel = np.nonzero(surface == s)[0]
        box_i, axis, side, _ = room.surface_frame(int(s))
        box = room.boxes[box_i]
        pts = rng.uniform(-box.half, box.half, size=(sel.size, 3))
        pts[:, axis] = box.half[axis] if side == 1 else -box.half[axis]
        local[sel] = pts
        xyz[sel] = pts @ box.rot_world_from_local.T + box.center
    rgb = _surface_colour(room, surface, local)
    return xyz, np.clip(np.round(rgb * 255.0), 0, 255).astype(np.uint8)


def _project(K: np.ndarray, w2c: np.ndarray, xyz: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pixel coordinates [P, 2] and camera z [P] of world points."""
    cam = xyz @ w2c[:3, :3].T + w2c[:3, 3]  # [P, 3]
    z = cam[:, 2]
    with np.errstate(divide="ignore", invalid="ignore"):
        uv = (cam[:, :2] / z[:, None]) * np.array([K[0, 0], K[1, 1]]) + K[:2, 2]
    return uv, z


def visible_points(uv: np.ndarray, z: np.ndarray, depth: np.ndarray, width: int, height: int,
                   rel_tol: float = 0.01) -> np.ndarray:
    """Mask of points inside the image and not occluded, using the sub-pixel depth map of the view."""
    s = depth.shape[1] // width
    inside = (z > 1e-3) & (uv[:, 0] >= 0) & (uv[:, 0] < width) & (uv[:, 1] >= 0) & (uv[:, 1] < height)
    mask = np.zeros(z.shape[0], dtype=bool)
    idx = np.nonzero(inside)[0]
    cols = np.clip((uv[idx, 0] * s).astype(np.int64), 0, width * s - 1)
    rows = np.clip((uv[idx, 1] * s).astype(np.int64), 0, height * s - 1)
    mask[idx] = z[idx] <= depth[rows, cols] * (1.0 + rel_tol) + 1e-3
    return mask


# ---------------------------------------------------------------------------------------------------- writing


def _rotmat_to_qvec(rot: np.ndarray) -> np.ndarray:
    """Rotation matrix -> unit quaternion (w, x, y, z), w >= 0 (Shepperd's method via the largest diagonal)."""
    m = rot
    tr = np.trace(m)
    if tr > 0:
        s = 2.0 * math.sqrt(tr + 1.0)
        q = [0.25 * s, (m[2, 1] - m[1, 2]) / s, (m[0, 2] - m[2, 0]) / s, (m[1, 0] - m[0, 1]) / s]
    elif m[0, 0] > m[1, 1] and m[0, 0] > m[2, 2]:
        s = 2.0 * math.sqrt(1.0 + m[0, 0] - m[1, 1] - m[2, 2])
        q = [(m[2, 1] - m[1, 2]) / s, 0.25 * s, (m[0, 1] + m[1, 0]) / s, (m[0, 2] + m[2, 0]) / s]
    elif m[1, 1] > m[2, 2]:
        s = 2.0 * math.sqrt(1.0 + m[1, 1] - m[0, 0] - m[2, 2])
        q = [(m[0, 2] - m[2, 0]) / s, (m[0, 1] + m[1, 0]) / s, 0.25 * s, (m[1, 2] + m[2, 1]) / s]
    else:
        s = 2.0 * math.sqrt(1.0 + m[2, 2] - m[0, 0] - m[1, 1])
        q = [(m[1, 0] - m[0, 1]) / s, (m[0, 2] + m[2, 0]) / s, (m[1, 2] + m[2, 1]) / s, 0.25 * s]
    q = np.asarray(q)
    q /= np.linalg.norm(q)
    return -q if q[0] < 0 else q


def write_colmap_text_model(model_dir: Path, K: np.ndarray, width: int, height: int, names: list[str],
                            w2cs: list[np.ndarray], xyz: np.ndarray, rgb: np.ndarray,
                            observations: list[list[tuple[int, np.ndarray]]]) -> None:
    """Write a COLMAP text model (one PINHOLE camera, id 1; images 1..N; points 1..P).

    ``observations[i]`` lists ``(point_index, uv [2])`` seen in image i; the point tracks are derived from it.
    """
    model_dir.mkdir(parents=True, exist_ok=True)
    with open(model_dir / "cameras.txt", "w") as f:
        f.write("# Camera list with one line of data per camera:\n#   CAMERA_ID, MODEL, WIDTH, HEIGHT, PARAMS[]\n")
        f.write(f"# Number of cameras: 1\n1 PINHOLE {width} {height} "
                f"{K[0, 0]:.10g} {K[1, 1]:.10g} {K[0, 2]:.10g} {K[1, 2]:.10g}\n")
    tracks: dict[int, list[tuple[int, int]]] = {}
    with open(model_dir / "images.txt", "w") as f:
        f.write("# Image list with two lines of data per image:\n"
                "#   IMAGE_ID, QW, QX, QY, QZ, TX, TY, TZ, CAMERA_ID, NAME\n"
                "#   POINTS2D[] as (X, Y, POINT3D_ID)\n")
        f.write(f"# Number of images: {len(names)}\n")
        for i, (name, w2c) in enumerate(zip(names, w2cs)):
            q = _rotmat_to_qvec(w2c[:3, :3])
            t = w2c[:3, 3]
            f.write(f"{i + 1} {q[0]:.12g} {q[1]:.12g} {q[2]:.12g} {q[3]:.12g} "
                    f"{t[0]:.12g} {t[1]:.12g} {t[2]:.12g} 1 {name}\n")
            parts = []
            for k, (pidx, uv) in enumerate(observations[i]):
                parts.append(f"{uv[0]:.3f} {uv[1]:.3f} {pidx + 1}")
                tracks.setdefault(pidx, []).append((i + 1, k))
            f.write(" ".join(parts) + "\n")
    with open(model_dir / "points3D.txt", "w") as f:
        f.write("# 3D point list with one line of data per point:\n"
                "#   POINT3D_ID, X, Y, Z, R, G, B, ERROR, TRACK[] as (IMAGE_ID, POINT2D_IDX)\n")
        f.write(f"# Number of points: {len(tracks)}\n")
        for pidx in sorted(tracks):
            x, y, z = xyz[pidx]
            r, g, b = rgb[pidx]
            track = " ".join(f"{im} {k}" for im, k in tracks[pidx])
            f.write(f"{pidx + 1} {x:.8g} {y:.8g} {z:.8g} {r} {g} {b} 0 {track}\n")


def _progress(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="view", disable=not enabled)


def write_scene(out_dir: str | Path, progress: bool = True, **options) -> dict:
    """Generate the scene into ``out_dir`` (see the module docstring for the layout); returns a summary dict.

    ``options`` are the fields of :class:`SceneOptions` (n_views, width, height, arc_deg, radius_m, height_m, seed,
    hfov_deg, n_points, noise_sigma, jpeg_quality, supersample). Equal options give byte-identical files.
    Existing ``images/`` and ``ground_truth/`` folders are replaced, so stale views never linger.
    """
    opts = SceneOptions(**options)
    out = Path(out_dir)
    img_dir = out / "images"
    gt_dir = out / "ground_truth"
    for d in (img_dir, gt_dir):
        if d.exists():
            for p in d.iterdir():
                if p.is_file():
                    p.unlink()
        d.mkdir(parents=True, exist_ok=True)

    room = build_room(opts.seed)
    K, w2cs = orbit_cameras(opts)
    rng = np.random.default_rng(opts.seed + 2)
    xyz, rgb = sample_surface_points(room, opts.n_points, rng)
    names = [f"{i:04d}.jpg" for i in range(opts.n_views)]
    seen = np.zeros((opts.n_views, xyz.shape[0]), dtype=bool)
    uvs = []
    noise_rng = np.random.default_rng(opts.seed + 3)
    with _progress(opts.n_views, "render synthetic views", progress) as bar:
        for i, w2c in enumerate(w2cs):
            img, depth = render_view(room, K, w2c, opts.width, opts.height, opts.supersample)
            img8 = img * 255.0 + noise_rng.normal(0.0, opts.noise_sigma, size=img.shape)
            img8 = np.clip(np.round(img8), 0, 255).astype(np.uint8)
            ok, buf = cv2.imencode(".jpg", cv2.cvtColor(img8, cv2.COLOR_RGB2BGR),
                                   [cv2.IMWRITE_JPEG_QUALITY, opts.jpeg_quality])
            if not ok:
                raise RuntimeError(f"JPEG encoding failed for view {i}")
            (img_dir / names[i]).write_bytes(buf.tobytes())
            uv, z = _project(K, w2c, xyz)
            seen[i] = visible_points(uv, z, depth, opts.width, opts.height)
            uvs.append(uv)
            bar.update(1)

    # Keep points seen by at least two views, as an SfM point would be.
    keep = seen.sum(axis=0) >= 2
    observations = [[(int(p), uvs[i][p]) for p in np.nonzero(seen[i] & keep)[0]] for i in range(opts.n_views)]
    write_colmap_text_model(gt_dir, K, opts.width, opts.height, names, w2cs, xyz, rgb, observations)
    cams = {
        "format": "splatflow-synthetic-cameras/1",
        "convention": "COLMAP/OpenCV: x_cam = world_to_cam @ [X, 1]; x right, y down, z forward; pixel centres at +0.5",
        "options": asdict(opts),
        "frames": [
            {"name": n, "width": opts.width, "height": opts.height, "K": K.tolist(), "world_to_cam": w2c.tolist()}
            for n, w2c in zip(names, w2cs)
        ],
    }
    (gt_dir / "cameras.json").write_text(json.dumps(cams, indent=1))
    return {"out_dir": str(out), "n_views": opts.n_views, "points3d": int(keep.sum()),
            "width": opts.width, "height": opts.height, "step_deg": opts.step_deg}
