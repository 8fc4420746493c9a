"""Gaussian parameters (:class:`Splats`), the checkpoint (:class:`Checkpoint`), one render of one view
(:func:`render_view`), initialisation from SfM points and the scene scale.

Parameter layout and activations follow gsplat's ``simple_trainer`` (docs/CONTRACTS.md "Checkpoint"):
``means`` world positions, ``quats`` wxyz (unnormalised), ``scales`` log scales, ``opacities`` logit opacity,
``sh0``/``shN`` spherical-harmonic colour coefficients. Initialisation is the one of the 3DGS paper
(Kerbl et al. 2023, §5.1): one Gaussian per SfM point, isotropic, with a scale equal to the mean distance to its
three nearest neighbours, identity rotation and low opacity.
"""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from splatflow.pipeline.config import TrainConfig
from splatflow.pipeline.errors import UserError
from splatflow.render import rasterize, resolve_backend
from splatflow.scene.cameras import camera_centers
from splatflow.gaussians import smoothing
from splatflow.gaussians.sh import SH_C0

SPLAT_KEYS = ("means", "quats", "scales", "opacities", "sh0", "shN")


def num_sh_bases(degree: int) -> int:
    """Number of SH coefficients per colour channel up to ``degree`` ((d+1)^2)."""
    return (degree + 1) ** 2


def rgb_to_sh0(rgb: torch.Tensor) -> torch.Tensor:
    """DC coefficient whose degree-0 SH evaluation (+0.5 offset, as gsplat/3DGS) gives ``rgb`` in [0, 1]."""
    return (rgb - 0.5) / SH_C0


def knn_mean_distance(points: np.ndarray, k: int = 3, chunk: int = 65536) -> np.ndarray:
    """Mean Euclidean distance of each point to its ``k`` nearest other points, ``[P]`` float32.

    A KD-tree (O(P log P)) queried in chunks keeps memory at O(P + chunk * k) even for millions of points,
    where a dense distance matrix would need O(P^2). Duplicated points give distance 0; the caller clamps.
    """
    from scipy.spatial import cKDTree

    points = np.asarray(points, dtype=np.float64)
    n = len(points)
    if n < 2:
        return np.ones(n, dtype=np.float32)
    k_eff = min(k, n - 1)
    tree = cKDTree(points)
    out = np.empty(n, dtype=np.float32)
    for lo in range(0, n, chunk):
        d, _ = tree.query(points[lo:lo + chunk], k=k_eff + 1)  # [B, k+1]; column 0 is the point itself
        out[lo:lo + chunk] = d[:, 1:].mean(axis=1)
    return out


def scene_scale(world_to_cams: np.ndarray) -> float:
    """Scene extent from the cameras: 1.1 x the largest distance of a camera centre from their mean.

    This is the ``cameras_extent`` of the 3DGS reference (``getNerfppNorm``); it scales the position learning
    rate and the densification thresholds so they do not depend on the SfM's arbitrary world units.
    """
    c = camera_centers(world_to_cams)
    radius = float(np.linalg.norm(c - c.mean(axis=0), axis=1).max()) * 1.1
    return radius if radius > 1e-8 else 1.0


def init_splats(points: np.ndarray, colors_u8: np.ndarray, *, sh_degree: int = TrainConfig.sh_degree,
                init_opacity: float = TrainConfig.init_opacity, init_scale: float = TrainConfig.init_scale) -> "Splats":
    """Gaussians from SfM points ``[P, 3]`` and colours ``[P, 3]`` uint8 (float32 CPU tensors).

    Raises UserError when there are too few points to initialise from.
    """
    points = np.asarray(points, dtype=np.float32)
    if points.ndim != 2 or points.shape[1] != 3 or len(points) < 4:
        raise UserError(
            f"training needs at least 4 SfM points to initialise Gaussians, got {len(points)}; "
            "check that the sfm stage registered the images (metrics/<scene>/sfm.json) and rerun it")
    if not np.isfinite(points).all():
        raise UserError("the SfM points contain NaN/Inf coordinates; rerun the sfm stage")
    n = len(points)
    dist = knn_mean_distance(points, k=3)
    positive = dist[dist > 0]
    floor = float(positive.min()) if len(positive) else 1e-3
    dist = np.maximum(dist, max(floor, 1e-7))
    means = torch.from_numpy(points.copy())  # [N, 3]
    scales = torch.log(torch.from_numpy(dist * init_scale)).unsqueeze(-1).repeat(1, 3)  # [N, 3]
    quats = torch.zeros(n, 4, device="cpu")
    quats[:, 0] = 1.0  # identity rotation, wxyz
    opacities = torch.full((n,), math.log(init_opacity / (1.0 - init_opacity)), device="cpu")  # logit
    rgb = torch.from_numpy(np.asarray(colors_u8, dtype=np.float32) / 255.0)  # [N, 3]
    sh0 = rgb_to_sh0(rgb).unsqueeze(1)  # [N, 1, 3]
    shN = torch.zeros(n, num_sh_bases(sh_degree) - 1, 3, device="cpu")  # [N, K-1, 3]
    return Splats(means=means, quats=quats, scales=scales, opacities=opacities, sh0=sh0.contiguous(), shN=shN)




# --------------------------------------------------------------------------------------------- Splats


@dataclass(frozen=True)
class Activated:
    """Rasterizer inputs (``splatflow.render.rasterize``): real scales, opacities in [0, 1], SH ``[N, K, 3]``."""

    means: torch.Tensor  # [N, 3]
    quats: torch.Tensor  # [N, 4] wxyz, not necessarily unit (the rasterizer normalises)
    scales: torch.Tensor  # [N, 3]
    opacities: torch.Tensor  # [N]
    colors: torch.Tensor | tuple[torch.Tensor, torch.Tensor]  # [N, K, 3], or (sh0, shN) (activated(sh_pair=True))


@dataclass(frozen=True)
class Splats:
    """The six raw parameter tensors of N Gaussians, as they are trained and stored.

    ``scales`` are log scales and ``opacities`` logits, so Adam works on unconstrained values; :meth:`activated`
    turns them into what the rasterizer takes. The tensors are held, not copied: a ``Splats`` over a trainer's
    ``torch.nn.Parameter`` dict renders with gradients flowing back to them. Key access (``splats["means"]``,
    ``keys()``, ``items()``, ``in``) reads the same tensors in checkpoint order, for code written against the
    dict layout of gsplat's strategies.

    ``filter_3d`` (``[N]`` world units, or None) is Mip-Splatting's 3D smoothing filter of a model trained with
    ``train.filter_3d`` (:mod:`splatflow.gaussians.smoothing`): not a parameter but part of the model, so every
    copy, selection and move keeps it with its rows, :meth:`activated` renders with it and :meth:`baked` folds it
    into the scales and opacities for the files other viewers read.
    """

    means: torch.Tensor  # [N, 3] world positions
    quats: torch.Tensor  # [N, 4] wxyz
    scales: torch.Tensor  # [N, 3] log scales
    opacities: torch.Tensor  # [N] logit opacities
    sh0: torch.Tensor  # [N, 1, 3] DC SH coefficient
    shN: torch.Tensor  # [N, K-1, 3] higher SH bands, K = (max_sh_degree + 1)^2
    filter_3d: torch.Tensor | None = None  # [N] 3D smoothing filter's standard deviation (world units), or None

    # ---------------------------------------------------------------------------------------- construction
    @classmethod
    def of(cls, obj: "Splats | Mapping[str, torch.Tensor]", source: str = "splats") -> "Splats":
        """``obj`` itself, or a ``Splats`` over a dict's six tensors (and its ``filter_3d`` when it has one; no
        copy). A missing key raises :class:`UserError` naming ``source`` and the keys."""
        if isinstance(obj, Splats):
            return obj
        missing = [k for k in SPLAT_KEYS if k not in obj]
        if missing:
            raise UserError(f"{source}: lacks {', '.join(missing)} (a model needs {', '.join(SPLAT_KEYS)}); "
                            "rerun the stage that wrote it")
        return cls(**{k: obj[k] for k in SPLAT_KEYS}, filter_3d=obj.get("filter_3d"))

    @classmethod
    def empty(cls, sh_degree: int = 0, device: torch.device | str = "cpu") -> "Splats":
        """No Gaussians, with room for SH bands up to ``sh_degree``."""
        z = lambda *shape: torch.zeros(*shape, device=device)  # noqa: E731
        return cls(z(0, 3), z(0, 4), z(0, 3), z(0), z(0, 1, 3), z(0, num_sh_bases(sh_degree) - 1, 3))

    # ---------------------------------------------------------------------------------------- dict view
    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in SPLAT_KEYS:
            raise KeyError(key)
        return getattr(self, key)

    def __contains__(self, key: object) -> bool:
        return key in SPLAT_KEYS

    def __iter__(self) -> Iterator[str]:
        return iter(SPLAT_KEYS)

    def keys(self) -> tuple[str, ...]:
        return SPLAT_KEYS

    def values(self) -> list[torch.Tensor]:
        return [getattr(self, k) for k in SPLAT_KEYS]

    def items(self) -> list[tuple[str, torch.Tensor]]:
        return [(k, getattr(self, k)) for k in SPLAT_KEYS]

    def as_dict(self) -> dict[str, torch.Tensor]:
        """A new dict over the same tensors (gsplat strategies' ``params`` layout)."""
        return {k: getattr(self, k) for k in SPLAT_KEYS}

    def map(self, fn) -> "Splats":
        """A ``Splats`` of ``fn(tensor)`` for each of the six tensors and the filter (a row operation, a copy or a
        move keeps the filter with its rows)."""
        filt = None if self.filter_3d is None else fn(self.filter_3d)
        return Splats(**{k: fn(getattr(self, k)) for k in SPLAT_KEYS}, filter_3d=filt)

    def with_filter(self, filter_3d: torch.Tensor | None) -> "Splats":
        """The same tensors with the 3D smoothing filter ``filter_3d`` (``[N]``; None: without one)."""
        return replace(self, filter_3d=filter_3d)

    # ---------------------------------------------------------------------------------------- facts
    @property
    def n(self) -> int:
        """Number of Gaussians."""
        return int(self.means.shape[0])

    @property
    def device(self) -> torch.device:
        return self.means.device

    @property
    def max_sh_degree(self) -> int:
        """The highest SH degree the coefficients have room for (``shN`` holds ``(d+1)^2 - 1`` bands)."""
        return int(round(math.sqrt(self.shN.shape[1] + 1))) - 1

    @property
    def bytes_per_gaussian(self) -> int:
        return sum(int(math.prod(t.shape[1:])) * t.element_size() for t in self.values())

    @property
    def nbytes(self) -> int:
        """Bytes of the six tensors as held (float32 in every checkpoint: what an uncompressed model weighs)."""
        return sum(int(t.numel()) * t.element_size() for t in self.values())

    @property
    def size_mib(self) -> float:
        """:attr:`nbytes` in MiB (2^20 bytes), the one unit of every model size splatflow reports."""
        return self.nbytes / 2**20

    # ---------------------------------------------------------------------------------------- views and copies
    def activated(self, sh_degree: int | None = None, *, sh_pair: bool = False) -> Activated:
        """Rasterizer inputs: ``exp`` of the log scales, ``sigmoid`` of the logits, ``sh0`` and ``shN`` joined
        into ``colors [N, K, 3]``, only the ``(sh_degree+1)^2`` active bands when ``sh_degree`` is given; with a
        3D smoothing filter the effective scales and opacities (:func:`splatflow.gaussians.smoothing.smoothed`), so
        training, validation, evaluation and pruning render one model alike.
        Differentiable: gradients reach the raw tensors. ``sh_pair``: ``colors`` is the pair ``(sh0, shN)`` itself
        (all bands; the rasterizer uses the active ones), which spares a training step joining them and splitting
        their gradient."""
        k = self.shN.shape[1] + 1 if sh_degree is None else num_sh_bases(sh_degree)
        if k > self.shN.shape[1] + 1:
            raise ValueError(f"sh_degree {sh_degree} needs {k} SH coefficients per channel; these splats hold "
                             f"{self.shN.shape[1] + 1} (max degree {self.max_sh_degree})")
        colors = (self.sh0, self.shN) if sh_pair else torch.cat([self.sh0, self.shN[:, : k - 1]], dim=1)
        scales, opacities = torch.exp(self.scales), torch.sigmoid(self.opacities)
        if self.filter_3d is not None:
            scales, opacities = smoothing.smoothed(scales, opacities, self.filter_3d)
        return Activated(means=self.means, quats=self.quats, scales=scales, opacities=opacities,
                         colors=colors)  # [N, K, 3] or the pair

    def baked(self) -> "Splats":
        """Without a filter, ``self``; with one, detached copies whose log scales and logit opacities are the
        filtered Gaussians' (:func:`splatflow.gaussians.smoothing.baked`) and no filter: what renders the same
        image in any viewer, and what every file writer is given (:func:`splatflow.formats.common.as_numpy_splats`
        bakes what it is handed)."""
        if self.filter_3d is None:
            return self
        log_s, logit_o = smoothing.baked(self.scales.detach(), self.opacities.detach(), self.filter_3d.detach())
        return replace(self.detach(), scales=log_s, opacities=logit_o, filter_3d=None)

    def select(self, idx: torch.Tensor) -> "Splats":
        """The Gaussians ``idx`` (indices or a ``[N]`` bool mask), as detached contiguous copies."""
        if isinstance(idx, torch.Tensor) and idx.dtype == torch.bool and idx.shape != (self.n,):
            raise ValueError(f"a boolean selection must have shape ({self.n},), got {tuple(idx.shape)}")
        idx = idx.to(self.device) if isinstance(idx, torch.Tensor) else idx
        return self.map(lambda t: t.detach()[idx].contiguous().clone())

    def detach(self) -> "Splats":
        return self.map(lambda t: t.detach())

    def clone(self) -> "Splats":
        """Detached copies (the parameters of a result, no longer tied to a training run)."""
        return self.map(lambda t: t.detach().clone())

    def stored(self, copy: bool = True) -> "Splats":
        """Detached float32 contiguous CPU tensors, as every checkpoint holds them: copies, or with
        ``copy=False`` only where the tensors are not so already."""
        return self.map(lambda t: t.detach().to("cpu", torch.float32, copy=copy).contiguous())

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> "Splats":
        """On ``device`` (and as ``dtype``); tensors already there are not copied."""
        return self.map(lambda t: t.to(device=device, dtype=dtype))

    # ---------------------------------------------------------------------------------------- checks
    def validate(self, source: str = "splats", fix: str = "rerun the stage that wrote it") -> "Splats":
        """``self`` when the six tensors form a model; else :class:`UserError` naming ``source``, the tensor, what
        is wrong with it and ``fix``. Checks: tensors of a floating dtype on one device, the shapes of the
        layout with one N, a number of SH bands of a degree 0..3, finite values, no all-zero quaternion."""
        def bad(msg: str) -> UserError:
            return UserError(f"{source}: {msg}; {fix}")

        for k in SPLAT_KEYS:
            t = getattr(self, k)
            if not isinstance(t, torch.Tensor):
                raise bad(f"{k} is a {type(t).__name__}, not a tensor")
            if not t.is_floating_point():
                raise bad(f"{k} has dtype {t.dtype}, expected a floating dtype (float32)")
        devices = {str(getattr(self, k).device) for k in SPLAT_KEYS}
        if len(devices) > 1:
            raise bad(f"the tensors live on different devices ({', '.join(sorted(devices))})")
        n = self.means.shape[0] if self.means.dim() >= 1 else -1
        expected = {"means": (n, 3), "quats": (n, 4), "scales": (n, 3), "opacities": (n,), "sh0": (n, 1, 3)}
        for k, shape in expected.items():
            got = tuple(getattr(self, k).shape)
            if got != shape:
                raise bad(f"{k} has shape {got}, expected {shape} (N = {n} from means)")
        sh = tuple(self.shN.shape)
        if len(sh) != 3 or sh[0] != n or sh[2] != 3 or sh[1] + 1 not in (1, 4, 9, 16):
            raise bad(f"shN has shape {sh}, expected ({n}, K-1, 3) with K = (d+1)^2 for an SH degree d in 0..3")
        if n == 0:
            return self._validate_filter(bad)
        for k in SPLAT_KEYS:
            t = getattr(self, k)
            finite = torch.isfinite(t.detach())
            if not bool(finite.all()):
                rows = int((~finite.reshape(n, -1).all(dim=1)).sum())
                raise bad(f"{k} holds NaN/Inf values in {rows} of {n} Gaussians")
        zero = int((self.quats.detach().abs().sum(dim=1) == 0).sum())
        if zero:
            raise bad(f"quats holds {zero} all-zero quaternions (no rotation can be made from them)")
        return self._validate_filter(bad)

    def _validate_filter(self, bad) -> "Splats":
        """``self`` when the 3D smoothing filter is None or a finite, non-negative ``[N]`` tensor on the
        parameters' device; else ``bad(message)`` raised."""
        f = self.filter_3d
        if f is None:
            return self
        if not isinstance(f, torch.Tensor) or not f.is_floating_point():
            raise bad(f"filter_3d is a {getattr(f, 'dtype', type(f).__name__)}, expected a float tensor")
        if tuple(f.shape) != (self.n,):
            raise bad(f"filter_3d has shape {tuple(f.shape)}, expected ({self.n},) (one per Gaussian)")
        if f.device != self.means.device:
            raise bad(f"filter_3d lives on {f.device}, the parameters on {self.means.device}")
        if self.n and not bool((torch.isfinite(f) & (f >= 0)).all()):
            raise bad("filter_3d holds negative, NaN or Inf values")
        return self

    # ---------------------------------------------------------------------------------------- checkpoints
    @classmethod
    def from_checkpoint(cls, ckpt: "Checkpoint | Mapping | str | Path") -> "Splats":
        """The validated float32 CPU parameters of a :class:`Checkpoint`, of its dict or of a checkpoint file."""
        if isinstance(ckpt, (str, Path)):
            return Checkpoint.load(ckpt).splats
        if not isinstance(ckpt, Checkpoint):
            ckpt = Checkpoint.from_dict(ckpt)
        return ckpt.splats

    def to_checkpoint(self, sh_degree: int, step: int = 0, **fields_: Any) -> "Checkpoint":
        """A :class:`Checkpoint` of these parameters (float32 CPU copies: a checkpoint never depends on the
        device that wrote it); ``fields_`` are its other fields (``finished``, ``prune_during``, ``train``)."""
        return Checkpoint(splats=self.stored(), sh_degree=sh_degree, step=step, **fields_)


# --------------------------------------------------------------------------------------------- rendering


@torch.no_grad()
def render_view(splats: Splats, camera, sh_degree: int, backend: str = "auto",
                rasterize_mode: str = "classic") -> torch.Tensor:
    """One view ``[H, W, 3]`` in [0, 1], black background, on the splats' device.

    ``camera`` has ``world_to_cam [4, 4]``, ``K [3, 3]``, ``width`` and ``height`` (a ``View`` of the scene or a
    :class:`splatflow.compress.scoring.Camera`). Only the active ``(sh_degree+1)^2`` SH bands are passed to the
    rasterizer. Move the splats to the backend's device once (``splats.to(device)``), not per view: a mismatch raises.
    """
    name = resolve_backend(backend)
    dev = splats.device
    if (name == "cuda") != (dev.type == "cuda"):
        raise ValueError(f"the {name!r} backend cannot render splats on {dev}; move them with splats.to(device)")
    a = splats.activated(sh_degree)
    viewmat = torch.as_tensor(np.asarray(camera.world_to_cam), dtype=torch.float32, device=dev)[None]  # [1, 4, 4]
    K = torch.as_tensor(np.asarray(camera.K), dtype=torch.float32, device=dev)[None]  # [1, 3, 3]
    colors, _, _ = rasterize(a.means, a.quats, a.scales, a.opacities, a.colors, viewmat, K, int(camera.width),
                             int(camera.height), sh_degree=sh_degree, backend=name, rasterize_mode=rasterize_mode)
    return colors[0, ..., :3].clamp(0.0, 1.0)  # [H, W, 3]


# --------------------------------------------------------------------------------------------- Checkpoint

@dataclass
class Checkpoint:
    """A model on disk: the parameters, the SH degree to render with, and what the writer adds.

    On disk it is a plain dict (:meth:`to_dict`, docs/CONTRACTS.md "Checkpoint"): ``splats`` (the six float32 CPU
    tensors), ``sh_degree`` and ``step`` always; ``finished`` and ``prune_during`` when set, ``filter_3d`` (the
    splats' 3D smoothing filter, ``[N]``) for a model trained with one; train's resume state
    (:attr:`train`: optimizer, strategy, RNG and stopper state, config hash, seed, ...) as further top-level keys.
    Readers ignore keys they do not know and default the ones a file lacks, so checkpoints written before this
    type existed (the same keys, tensors possibly saved as parameters, float64 or non-contiguous) still load
    (:meth:`from_dict`). Every tensor is on the CPU whatever device wrote it.
    """

    splats: Splats
    sh_degree: int
    step: int = 0
    finished: bool | None = None  # train: False while a run is unfinished (resumable); None: not a training run
    prune_during: dict | None = None  # train.prune_during's state; its "report" has "cuts", "phases", ...
    train: dict = field(default_factory=dict)  # the trainer's resume state (top-level keys on disk)
    rasterize_mode: str = "classic"  # how the model was trained to be rendered (train.rasterize_mode)

    def to_dict(self) -> dict:
        d: dict[str, Any] = {"splats": self.splats.stored(copy=False).as_dict(), "sh_degree": int(self.sh_degree),
                             "step": int(self.step)}
        if self.finished is not None:
            d["finished"] = bool(self.finished)
        if self.prune_during is not None:
            d["prune_during"] = self.prune_during
        if self.rasterize_mode != "classic":  # (absent: classic, as every checkpoint written before the key)
            d["rasterize_mode"] = self.rasterize_mode
        if self.splats.filter_3d is not None:  # (absent: trained without the 3D smoothing filter)
            d["filter_3d"] = self.splats.filter_3d.detach().to("cpu", torch.float32).contiguous()
        clash = sorted(set(self.train) & (set(d) | {"finished", "prune_during", "rasterize_mode", "filter_3d"}))
        if clash:
            raise ValueError(f"train state keys {clash} would overwrite the checkpoint's own entries")
        d.update(self.train)
        return d

    @classmethod
    def from_dict(cls, d: Mapping, source: str = "checkpoint") -> "Checkpoint":
        """Read a checkpoint dict (this layout or an earlier one: see the class); the splats are validated and
        made float32 contiguous CPU tensors. Errors name ``source``."""
        fix = "delete it and rerun the stage that wrote it"
        if not isinstance(d, Mapping) or "splats" not in d:
            raise UserError(f"{source}: not a splatflow checkpoint (no 'splats' entry); {fix}")
        splats = Splats.of(d["splats"], source)
        splats = splats.with_filter(d.get("filter_3d", splats.filter_3d)).validate(source, fix).stored(copy=False)
        own = {f.name for f in fields(cls)} | {"filter_3d"}
        finished = d.get("finished")
        return cls(splats=splats, sh_degree=int(d.get("sh_degree", 0)), step=int(d.get("step", 0)),
                   finished=None if finished is None else bool(finished), prune_during=d.get("prune_during"),
                   train={k: v for k, v in d.items() if k not in own},
                   rasterize_mode=str(d.get("rasterize_mode", "classic")))

    @property
    def resumable(self) -> bool:
        """An unfinished training run (``finished`` False) that carries its optimizer state."""
        return self.finished is False and "optimizers" in self.train

    def save(self, path: str | Path) -> None:
        save_checkpoint(path, self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> "Checkpoint":
        """The checkpoint at ``path``; :class:`UserError` naming the file when it is missing, unreadable or
        not a valid model."""
        return cls.from_dict(load_checkpoint(path), str(path))


def _umask() -> int:
    """The process's umask, read without setting it (``os.umask`` sets it process-wide, racing other threads)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def save_checkpoint(path: str | Path, payload: dict) -> None:
    """``torch.save`` to a temporary file in the same folder, then atomically rename over ``path``.

    A crash or SIGKILL mid-write leaves the previous checkpoint intact (rename is atomic on POSIX).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # as open() would create it (mkstemp's 0600 hid it from other users)
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _missing_checkpoint_hint(path: Path) -> str:
    """How to make a missing checkpoint: for the pipeline's ``models/<scene>/<train|prune>/ckpt.pt`` the stage of
    that one scene (``dvc repro train`` alone would train every scene), else the generic advice."""
    parts = path.parts
    if len(parts) >= 4 and parts[-1] == "ckpt.pt" and parts[-2] in ("train", "prune") and parts[-4] == "models":
        scene, stage = parts[-3], parts[-2]
        return (f"the {stage} stage of scene {scene!r} writes it: run `splatflow run {scene}` "
                f"(or `dvc repro {stage}@{scene}`)")
    return "run the stage that writes it (`splatflow run <scene>` runs a scene's pipeline up to it)"


def load_checkpoint(path: str | Path) -> dict:
    """The raw checkpoint dict (CPU tensors), unvalidated: :meth:`Checkpoint.load` reads it as a model.
    Raises UserError for a missing or unreadable file."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: checkpoint not found; {_missing_checkpoint_hint(path)}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means the file is unusable
        raise UserError(f"{path}: not a readable checkpoint ({e}); delete it and rerun the stage") from e
    if not isinstance(ckpt, dict) or "splats" not in ckpt:
        raise UserError(f"{path}: not a splatflow checkpoint (no 'splats' entry); delete it and rerun the stage")
    return ckpt


def load_splats(path: str | Path) -> tuple[Splats, int]:
    """``(splats, sh_degree)`` from a checkpoint written by train or prune (float32 CPU, validated)."""
    ckpt = Checkpoint.load(path)
    return ckpt.splats, ckpt.sh_degree
