"""``splatflow view``: a local interactive viewer of a scene's splat on viser (gsplat's and nerfstudio's viewer).

viser's wheel ships its built web client, so the viewer works offline; it draws Gaussian splats natively from
centres, covariances, colours and opacities. What this module adds:

- the model of a scene at a chosen stage (``train`` / ``prune`` checkpoint or the ``export`` file), or any
  ``.ply`` / ``.splat`` / ``.spz`` file;
- the training cameras as frustums (test cameras in another colour); a click on one flies every connected
  browser to it;
- controls: SH degree (view-dependent colour evaluated on the CPU for each browser's camera, because viser's splats
  carry one RGB per Gaussian), an opacity scale, a Gaussian size scale, and a points mode with a point size.

Frames: our world is COLMAP's (x right, y down, z forward); viser's cameras and frustums use the same OpenCV
convention, so poses go in unchanged; the scene's up direction is the mean of the cameras' up vectors (-y of each).
"""

from __future__ import annotations

import math
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from splatflow.pipeline.config import load_params
from splatflow.pipeline.errors import UserError
from splatflow.formats.common import as_numpy_splats
from splatflow.gaussians.model import load_splats
from splatflow.pipeline.paths import ScenePaths
from splatflow.render.projection import eval_sh
from splatflow.present.report import CameraInfo, read_splat_file, scene_cameras
from splatflow.gaussians.sh import SH_C0

STAGES = ("export", "prune", "train")  # newest first: what `view SCENE` shows without --stage
TRAIN_COLOR = (150, 150, 150)
TEST_COLOR = (230, 120, 20)


@dataclass
class LoadedModel:
    splats: dict[str, np.ndarray]
    sh_degree: int
    source: Path
    stage: str | None  # None for a file given directly
    cameras: list[CameraInfo] = field(default_factory=list)
    status: str | None = None  # the caption's first line instead of the file's name (the live view's progress)


def _stage_file(paths: ScenePaths, stage: str) -> Path | None:
    if stage == "export":
        for suffix in (".ply", ".spz", ".splat"):
            f = paths.export_dir / f"scene{suffix}"
            if f.is_file():
                return f
        return None
    f = paths.train_ckpt if stage == "train" else paths.prune_ckpt
    return f if f.is_file() else None


def load_target(target: str, root: Path, stage: str | None = None) -> LoadedModel:
    """A scene name (its newest model, or ``stage``'s) or a splat file path -> the model to show."""
    p = Path(target)
    if p.suffix.lower() in (".ply", ".splat", ".spz"):
        if stage is not None:
            raise UserError("--stage applies to a scene name, not to a file")
        splats, degree = read_splat_file(p)
        return LoadedModel(_checked_splats(splats, p), degree, p, None)
    if p.exists() and p.is_file():
        raise UserError(f"{p}: not a splat file this viewer reads (use .ply, .spz or .splat) and not a scene name")
    paths = ScenePaths(target, root)
    known = _known_scenes(root)
    if known is not None and target not in known and not paths.models_dir.exists():
        raise UserError(f"{target!r} is neither a scene of params.yaml (known: {', '.join(sorted(known)) or 'none'}) "
                        f"nor a .ply/.splat/.spz file")
    if stage is not None:
        if stage not in STAGES:
            raise UserError(f"--stage must be one of {', '.join(STAGES)}, not {stage!r}")
        source = _stage_file(paths, stage)
        if source is None:
            raise UserError(f"scene {target!r} has no {stage} model yet: run the {stage} stage "
                            f"(`dvc repro {stage}@{target}`, or `splatflow run {target}` for the whole pipeline)")
    else:
        found = [(s, _stage_file(paths, s)) for s in STAGES]
        found = [(s, f) for s, f in found if f is not None]
        if not found:
            raise UserError(f"scene {target!r} has no model yet: run the train stage (`splatflow run {target}`, "
                            f"or `dvc repro train@{target}`); it writes {paths.train_ckpt}")
        stage, source = found[0]
    if source.suffix == ".pt":
        splats_t, degree = load_splats(source)
        splats = as_numpy_splats(splats_t, degree)
    else:
        splats, degree = read_splat_file(source)
    return LoadedModel(_checked_splats(splats, source, target), int(degree), source, stage, scene_cameras(paths))


def _checked_splats(splats: dict[str, np.ndarray], source: Path, scene: str | None = None) -> dict[str, np.ndarray]:
    """``splats`` when the viewer can draw them; else a UserError naming ``source`` and the fix.

    An empty model (a valid file with zero Gaussians) has no extent to frame; NaN/Inf centres, scales or
    opacities would reach viser as broken covariances. Like a checkpoint's own validation, a bad model is refused
    with the count of bad Gaussians rather than drawn in part."""
    n = len(splats["means"])
    if n == 0:
        how = (f"`splatflow run {scene}` (or `dvc repro export@{scene}`) writes a trained model" if scene
               else "export a trained model (`splatflow run <scene>`) and view that, or `splatflow view <scene>`")
        raise UserError(f"{source}: holds no Gaussians (an empty model), so there is nothing to view; {how}")
    bad = np.zeros(n, dtype=bool)
    which = []
    for k in ("means", "scales", "opacities", "quats", "sh0", "shN"):
        rows = ~np.isfinite(splats[k].reshape(n, -1)).all(axis=1)
        if rows.any():
            which.append(k)
            bad |= rows
    if bad.any():
        raise UserError(f"{source}: {int(bad.sum()):,} of {n:,} Gaussians hold NaN/Inf values (in "
                        f"{', '.join(which)}); the viewer cannot draw them: re-export the model from a finite "
                        f"checkpoint, or rerun the stage that wrote it")
    return splats


def _known_scenes(root: Path) -> set[str] | None:
    try:
        return set(load_params(root / "params.yaml").base.scenes)
    except Exception:  # noqa: BLE001 - no or broken params.yaml: judge by the folders alone
        return None


def _quat_to_rotmat(q: np.ndarray) -> np.ndarray:
    q = q / np.maximum(np.linalg.norm(q, axis=1, keepdims=True), 1e-12)
    w, x, y, z = q.T
    return np.stack([1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y),
                     2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x),
                     2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)], axis=1).reshape(-1, 3, 3)


def covariances(splats: dict[str, np.ndarray], scale: float = 1.0) -> np.ndarray:
    """World covariances R S S^T R^T [N, 3, 3] (log scales in the splats, times ``scale``)."""
    M = _quat_to_rotmat(splats["quats"].astype(np.float64)) * (np.exp(splats["scales"].astype(np.float64))
                                                                * scale)[:, None, :]
    return (M @ M.transpose(0, 2, 1)).astype(np.float32)


def sh_colors(splats: dict[str, np.ndarray], degree: int, eye: np.ndarray | None) -> np.ndarray:
    """RGB in [0, 1] [N, 3] seen from ``eye``: SH up to ``degree`` (degree 0 needs no eye), as the rasterizer does."""
    import torch

    coeffs = np.concatenate([splats["sh0"], splats["shN"]], axis=1)  # [N, K, 3]
    degree = min(degree, int(round(math.sqrt(coeffs.shape[1]))) - 1)
    if degree == 0 or eye is None:
        rgb = 0.5 + coeffs[:, 0, :] * SH_C0
    else:
        dirs = torch.from_numpy(splats["means"].astype(np.float32) - np.asarray(eye, np.float32)[None])
        rgb = (eval_sh(degree, dirs, torch.from_numpy(coeffs.astype(np.float32))) + 0.5).numpy()
    return np.clip(rgb, 0.0, 1.0).astype(np.float32)


def _wxyz_from_rotmat(R: np.ndarray) -> np.ndarray:
    import viser.transforms as tf

    return tf.SO3.from_matrix(R).wxyz


def scene_up(cameras: list[CameraInfo]) -> np.ndarray:
    """Mean camera up vector (COLMAP: -y of each camera, in world), the direction viser keeps up while orbiting."""
    if not cameras:
        return np.array([0.0, -1.0, 0.0])
    ups = np.stack([-c.world_to_cam[1, :3] for c in cameras])
    up = ups.mean(0)
    n = np.linalg.norm(up)
    return up / n if n > 1e-9 else np.array([0.0, -1.0, 0.0])


def camera_spacing(cameras: list[CameraInfo], extent: float) -> float:
    """Median distance from each camera to its nearest neighbour (frustum size, overview distance)."""
    if len(cameras) < 2:
        return max(extent / 20, 1e-3)
    c = np.stack([cam.center for cam in cameras])
    d = np.linalg.norm(c[:, None] - c[None], axis=2)
    np.fill_diagonal(d, np.inf)
    return float(max(np.median(d.min(1)), 1e-6))


class SplatViewer:
    """The running viewer: a viser server holding the splats, the frustums and the GUI controls."""

    def __init__(self, model: LoadedModel, *, host: str = "127.0.0.1", port: int = 8080,
                 start_camera: str | None = None, verbose: bool = False):
        import viser

        self.model = model
        self.server = viser.ViserServer(host=host, port=port, label="splatflow", verbose=verbose)
        self.server.gui.configure_theme(control_layout="collapsible", dark_mode=True, show_logo=False)
        self._lock = threading.Lock()
        self._degree = model.sh_degree
        self._opacity = 1.0
        self._scale = 1.0
        self._mode = "Gaussians"
        self._point_size = 0.01
        self._eyes: dict[int, np.ndarray] = {}
        s = model.splats
        self._base_alpha = 1.0 / (1.0 + np.exp(-s["opacities"].astype(np.float64)))
        self._extent = float(np.linalg.norm(np.percentile(s["means"], 95, 0) - np.percentile(s["means"], 5, 0)))
        self._point_size = max(1e-4, self._extent / 400.0)
        self._spacing = camera_spacing(model.cameras, self._extent)
        up = scene_up(model.cameras)
        self.server.scene.set_up_direction(tuple(float(x) for x in up))
        self._add_cameras()
        self._add_gui()
        self._start = self._pick_start(start_camera)
        if self._start is not None:
            # the view starts exactly where a photo was taken, so the splat is in sight as the camera saw it (from
            # behind a camera, its own frustum and its neighbours' stood between the eye and the splat)
            self._set_initial_camera(self._start)
        self._redraw(None)
        self.server.on_client_connect(self._on_connect)
        self.server.on_client_disconnect(lambda client: self._eyes.pop(client.client_id, None))

    # -- scene ------------------------------------------------------------------------------------------------
    def _pick_start(self, name: str | None) -> CameraInfo | None:
        cams = self.model.cameras
        if name is None:  # the first training camera: a view the splat was fitted to (test views come first)
            return next((c for c in cams if c.split == "train"), cams[0] if cams else None)
        for c in cams:
            if name in (c.name, Path(c.name).stem):
                return c
        raise UserError(f"--camera {name!r} is not a camera of this scene "
                        f"(cameras: {', '.join(Path(c.name).stem for c in cams) or 'none'})")

    def _set_initial_camera(self, cam: CameraInfo, back: float = 0.0) -> None:
        R = cam.world_to_cam[:3, :3].T  # camera -> world
        ic = self.server.initial_camera
        ic.position = tuple(float(x) for x in cam.center - R[:, 2] * back)
        ic.look_at = tuple(float(x) for x in cam.center + R[:, 2] * self._look_distance(cam))
        ic.up = tuple(float(x) for x in -R[:, 1])
        ic.fov = math.radians(cam.fov_y_deg)

    def _look_distance(self, cam: CameraInfo) -> float:
        centre = np.median(self.model.splats["means"], axis=0)
        d = float(np.dot(centre - cam.center, cam.world_to_cam[2, :3]))
        return d if d > 1e-3 else max(self._extent / 4, 1e-2)

    def _add_cameras(self) -> None:
        self._frustums = []
        cams = self.model.cameras
        if not cams:
            return
        size = float(max(self._spacing * 0.6, 1e-3))
        for c in cams:
            R = c.world_to_cam[:3, :3].T
            h = self.server.scene.add_camera_frustum(
                f"/cameras/{c.split}/{Path(c.name).stem}", fov=math.radians(c.fov_y_deg), aspect=c.width / c.height,
                scale=size, color=TEST_COLOR if c.split == "test" else TRAIN_COLOR, wxyz=_wxyz_from_rotmat(R),
                position=c.center, thickness=size * 0.03)
            h.on_click(lambda event, cam=c: self.fly_to(cam, event.client))
            self._frustums.append(h)

    def fly_to(self, cam: CameraInfo, client=None) -> None:
        """Move one browser's camera (or every browser's) to a scene camera's pose and field of view."""
        R = cam.world_to_cam[:3, :3].T
        clients = [client] if client is not None else list(self.server.get_clients().values())
        for cl in clients:
            with cl.atomic():
                cl.camera.fov = math.radians(cam.fov_y_deg)
                cl.camera.position = cam.center
                cl.camera.up_direction = -R[:, 1]
                cl.camera.look_at = cam.center + R[:, 2] * self._look_distance(cam)

    def _add_gui(self) -> None:
        gui = self.server.gui
        m = self.model
        self._info = gui.add_markdown(self._caption())
        self._gui_degree = gui.add_slider("SH degree", min=0, max=max(m.sh_degree, 0), step=1,
                                          initial_value=m.sh_degree, disabled=m.sh_degree == 0)
        self._gui_opacity = gui.add_slider("opacity scale", min=0.0, max=1.0, step=0.01, initial_value=1.0)
        self._gui_scale = gui.add_slider("Gaussian size", min=0.1, max=2.0, step=0.05, initial_value=1.0)
        self._gui_mode = gui.add_dropdown("draw as", options=("Gaussians", "points"), initial_value="Gaussians")
        self._gui_point = gui.add_slider("point size", min=self._point_size / 10, max=self._point_size * 10,
                                         step=self._point_size / 10, initial_value=self._point_size)
        self._gui_frustums = gui.add_checkbox("show cameras", initial_value=True)
        for h in (self._gui_degree, self._gui_opacity, self._gui_scale, self._gui_mode, self._gui_point):
            h.on_update(lambda _e: self._on_controls())
        self._gui_frustums.on_update(lambda _e: self._toggle_frustums())

    def _caption(self) -> str:
        m = self.model
        src = m.status or (f"{m.source.name} ({m.stage})" if m.stage else m.source.name)
        return (f"**{src}**  \n{len(m.splats['means']):,} Gaussians, SH degree {m.sh_degree}; "
                f"cameras: grey = training, orange = test (click one to fly there)")

    def show(self, splats: dict[str, np.ndarray], status: str) -> None:
        """Replace the splat every browser sees (a model being trained) and the caption above the controls; the
        cameras, the controls and each browser's own camera stay as they are."""
        with self._lock:
            self.model.splats = splats
            self.model.status = status
            self._base_alpha = 1.0 / (1.0 + np.exp(-splats["opacities"].astype(np.float64)))
        self._info.content = self._caption()
        self._redraw(self._eye())

    def _toggle_frustums(self) -> None:
        for h in self._frustums:
            h.visible = bool(self._gui_frustums.value)

    def _on_controls(self) -> None:
        self._degree = int(self._gui_degree.value)
        self._opacity = float(self._gui_opacity.value)
        self._scale = float(self._gui_scale.value)
        self._mode = str(self._gui_mode.value)
        self._point_size = float(self._gui_point.value)
        self._redraw(self._eye())

    def _eye(self) -> np.ndarray | None:
        if self._eyes:
            return next(iter(self._eyes.values()))
        return self._start.center if self._start is not None else None

    def _on_connect(self, client) -> None:
        def moved(_cam) -> None:
            self._eyes[client.client_id] = np.asarray(client.camera.position, np.float64)
            if self._degree > 0:
                self._schedule_redraw()

        client.camera.on_update(moved)

    _pending = False

    def _schedule_redraw(self) -> None:
        """View-dependent colour follows the camera, at most ~4 times a second (a redraw resends the colours)."""
        if self._pending:
            return
        self._pending = True

        def later():
            time.sleep(0.25)
            self._pending = False
            self._redraw(self._eye())

        threading.Thread(target=later, daemon=True).start()

    def _redraw(self, eye: np.ndarray | None) -> None:
        with self._lock:
            s = self.model.splats
            rgb = sh_colors(s, self._degree, eye)
            scene = self.server.scene
            if self._mode == "points":
                with_removed = getattr(self, "_splat_handle", None)
                if with_removed is not None:
                    with_removed.remove()
                    self._splat_handle = None
                self._points_handle = scene.add_point_cloud(
                    "/splat/points", points=s["means"].astype(np.float32), colors=rgb,
                    point_size=self._point_size, point_shape="circle")
            else:
                ph = getattr(self, "_points_handle", None)
                if ph is not None:
                    ph.remove()
                    self._points_handle = None
                alpha = (self._base_alpha * self._opacity).astype(np.float32)[:, None]
                self._splat_handle = scene.add_gaussian_splats(
                    "/splat/gaussians", centers=s["means"].astype(np.float32),
                    covariances=covariances(s, self._scale), rgbs=rgb, opacities=alpha)

    # -- lifetime ---------------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        host = self.server.get_host()
        return f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{self.server.get_port()}"

    def stop(self) -> None:
        self.server.stop()


def serve_forever(viewer: SplatViewer, log=print) -> None:
    """Block until Ctrl-C or SIGTERM, then stop the server (no thread or port left behind)."""
    stop = threading.Event()

    def on_signal(signum, frame):  # noqa: ARG001
        stop.set()

    prev = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stop.wait(0.5):
            pass
    finally:
        for s, h in prev.items():
            signal.signal(s, h)
        log("splatflow view: stopping")
        viewer.stop()
