"""LPIPS in plain torch, offline: the standard AlexNet/VGG16 trunks plus the v0.1 linear heads.

LPIPS (Zhang et al., "The Unreasonable Effectiveness of Deep Features as a Perceptual Metric", CVPR 2018)
compares unit-normalised trunk activations at five depths, weights the squared differences per channel with
learned 1x1 "linear" layers, averages over space and sums over depths.

Why our own copy: the ``lpips`` package and torchmetrics build the trunk through torchvision, which downloads
ImageNet weights at run time (impossible offline) and whose PyPI build does not import beside our CPU torch.
Here the trunk is a plain ``nn.Sequential`` named ``features`` with exactly torchvision's layer layout, so the
standard torch hub checkpoints (``alexnet-owt-7be5be79.pth``, ``vgg16-397923af.pth``) load into it unchanged;
the linear heads are the v0.1 ``.pth`` files shipped inside the ``lpips`` PyPI package, located without
importing that package (importing it imports torchvision). Nothing is downloaded at run time: when a file is
missing, :func:`load_lpips` returns ``None`` plus a reason string (naming ``splatflow weights fetch``, which
downloads the trunks on request, :mod:`splatflow.evaluation.weights`) and the caller records LPIPS as null.

Variants (published tables mix them, so every number is stored under its variant's name):

* ``lpips_vgg_01``: VGG trunk fed images in [0, 1] unchanged, as the 3DGS paper's evaluation code does (it passes
  [0, 1] renders to an LPIPS that expects [-1, 1]); numbers are lower than ``lpips_vgg``.
* ``lpips_vgg``: VGG on [-1, 1] (the package's intended input range; nerfbaselines).
* ``lpips_alex``: AlexNet on [-1, 1] (gsplat, nerfstudio).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

# Torch hub checkpoint file names (torchvision's ImageNet weights) for each trunk.
BACKBONE_FILES = {"alex": "alexnet-owt-7be5be79.pth", "vgg": "vgg16-397923af.pth"}
# Channels of the five tapped activations (the linear heads' input widths).
CHANNELS = {"alex": (64, 192, 384, 256, 256), "vgg": (64, 128, 256, 512, 512)}
# Tap points: the activation after features[i - 1] for i in TAPS is compared (same slices as the lpips package:
# AlexNet relu1..relu5, VGG16 relu1_2, relu2_2, relu3_3, relu4_3, relu5_3).
TAPS = {"alex": (2, 5, 8, 10, 12), "vgg": (4, 9, 16, 23, 30)}

# variant name -> (trunk, inputs are converted from [0, 1] to [-1, 1])
VARIANTS = {
    "lpips_vgg_01": ("vgg", False),
    "lpips_vgg": ("vgg", True),
    "lpips_alex": ("alex", True),
}
VARIANT_INPUTS = {
    "lpips_vgg_01": "VGG16 trunk, images in [0, 1] fed unchanged (3DGS paper evaluation code)",
    "lpips_vgg": "VGG16 trunk, images mapped to [-1, 1] (lpips package convention; nerfbaselines)",
    "lpips_alex": "AlexNet trunk, images mapped to [-1, 1] (gsplat, nerfstudio)",
}


def alexnet_features() -> nn.Sequential:
    """torchvision's ``alexnet().features`` layout (Krizhevsky 2014 "one weird trick" variant)."""
    return nn.Sequential(
        nn.Conv2d(3, 64, kernel_size=11, stride=4, padding=2), nn.ReLU(),
        nn.MaxPool2d(kernel_size=3, stride=2),
        nn.Conv2d(64, 192, kernel_size=5, padding=2), nn.ReLU(),
        nn.MaxPool2d(kernel_size=3, stride=2),
        nn.Conv2d(192, 384, kernel_size=3, padding=1), nn.ReLU(),
        nn.Conv2d(384, 256, kernel_size=3, padding=1), nn.ReLU(),
        nn.Conv2d(256, 256, kernel_size=3, padding=1), nn.ReLU(),
        nn.MaxPool2d(kernel_size=3, stride=2),
    )


def vgg16_features() -> nn.Sequential:
    """torchvision's ``vgg16().features`` layout (Simonyan & Zisserman 2015, configuration D, no batch norm)."""
    layers: list[nn.Module] = []
    c_in = 3
    for v in (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"):
        if v == "M":
            layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
        else:
            layers += [nn.Conv2d(c_in, v, kernel_size=3, padding=1), nn.ReLU()]
            c_in = v
    return nn.Sequential(*layers)


def make_features(net: str) -> nn.Sequential:
    if net == "alex":
        return alexnet_features()
    if net == "vgg":
        return vgg16_features()
    raise ValueError(f"unknown LPIPS trunk {net!r}; expected 'alex' or 'vgg'")


def lpips_package_weights_dir() -> Path | None:
    """The ``weights/v0.1`` folder inside the installed ``lpips`` package, found without importing it."""
    try:
        spec = importlib.util.find_spec("lpips")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        d = Path(loc) / "weights" / "v0.1"
        if d.is_dir():
            return d
    return None


def default_backbone_dir() -> Path:
    """Where torch hub keeps downloaded checkpoints (we only ever read from it)."""
    return Path(torch.hub.get_dir()) / "checkpoints"


class LPIPS(nn.Module):
    """One LPIPS network: trunk ``features``, scaling layer, five 1x1 linear heads.

    ``forward(x, y)`` takes images already in the range the variant wants ([-1, 1] normally) as
    ``[B, 3, H, W]`` and returns ``[B]`` distances. Use :meth:`distance` with [0, 1] images and a variant name.
    """

    # The lpips package's ScalingLayer: inputs in [-1, 1] are shifted/scaled to ImageNet statistics.
    SHIFT = (-0.030, -0.088, -0.188)
    SCALE = (0.458, 0.448, 0.450)

    def __init__(self, net: str):
        super().__init__()
        self.net = net
        self.features = make_features(net)
        self.taps = TAPS[net]
        self.lins = nn.ModuleList(nn.Conv2d(c, 1, kernel_size=1, bias=False) for c in CHANNELS[net])
        self.register_buffer("shift", torch.tensor(self.SHIFT).view(1, 3, 1, 1))
        self.register_buffer("scale", torch.tensor(self.SCALE).view(1, 3, 1, 1))
        self.requires_grad_(False)
        self.eval()

    def load_backbone(self, state: dict[str, torch.Tensor]) -> None:
        """Load ``features.*`` from a torchvision-style state dict (extra keys such as the classifier are ignored)."""
        feats = {k[len("features."):]: v for k, v in state.items() if k.startswith("features.")}
        missing = set(self.features.state_dict()) - set(feats)
        if missing:
            raise ValueError(f"backbone checkpoint lacks {sorted(missing)[:3]}... (not a torchvision {self.net})")
        self.features.load_state_dict({k: feats[k] for k in self.features.state_dict()})

    def load_linear(self, state: dict[str, torch.Tensor]) -> None:
        """Load the heads from an lpips ``v0.1/<net>.pth`` (keys ``lin{k}.model.{i}.weight``, i = 1 after dropout)."""
        for k, lin in enumerate(self.lins):
            keys = [key for key in state if key.startswith(f"lin{k}.") and key.endswith(".weight")]
            if len(keys) != 1:
                raise ValueError(f"linear-layer file has no unique weight for lin{k} (found {keys})")
            w = state[keys[0]]
            if tuple(w.shape) != tuple(lin.weight.shape):
                raise ValueError(f"lin{k} weight has shape {tuple(w.shape)}, expected {tuple(lin.weight.shape)}")
            lin.weight.copy_(w)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        fx = self._taps((x - self.shift) / self.scale)
        fy = self._taps((y - self.shift) / self.scale)
        total = x.new_zeros(x.shape[0])
        for lin, a, b in zip(self.lins, fx, fy):
            d = (_unit(a) - _unit(b)) ** 2  # [B, C, h, w]
            total = total + lin(d).mean(dim=(1, 2, 3))  # lin: [B, 1, h, w] -> spatial average [B]
        return total

    def _taps(self, x: torch.Tensor) -> list[torch.Tensor]:
        out = []
        for i, layer in enumerate(self.features, start=1):
            x = layer(x)
            if i in self.taps:
                out.append(x)
                if len(out) == len(self.taps):
                    break
        return out


def _unit(f: torch.Tensor, eps: float = 1e-10) -> torch.Tensor:
    """Unit-normalise each pixel's feature vector over channels (the lpips package's ``normalize_tensor``)."""
    return f / (torch.sqrt((f * f).sum(dim=1, keepdim=True)) + eps)


@dataclass
class LpipsResult:
    model: LPIPS | None
    reason: str | None  # why ``model`` is None


def load_lpips(net: str, backbone_dir: str | Path | None = None, linear_dir: str | Path | None = None) -> LpipsResult:
    """Build the ``net`` ('alex' | 'vgg') LPIPS from local files only; never downloads, never raises for missing files.

    ``backbone_dir`` defaults to the torch hub cache; ``linear_dir`` defaults to the lpips package's ``weights/v0.1``.
    """
    bdir = Path(backbone_dir) if backbone_dir else default_backbone_dir()
    bfile = bdir / BACKBONE_FILES[net]
    if not bfile.is_file():
        return LpipsResult(None, f"{bfile.name} is not in {bdir}: run `splatflow weights fetch` to download "
                                 f"torchvision's ImageNet {net} weights (checksum-checked), or set "
                                 "evaluate.lpips_backbone_dir")
    ldir = Path(linear_dir) if linear_dir else lpips_package_weights_dir()
    if ldir is None:
        return LpipsResult(None, "the lpips package (which ships the v0.1 linear layers) is not installed; "
                                 "install it with `pip install --no-deps lpips==0.1.4`")
    lfile = ldir / f"{net}.pth"
    if not lfile.is_file():
        return LpipsResult(None, f"LPIPS linear-layer file {lfile} not found")
    with torch.device("cpu"):  # built on the host whatever the default device; LpipsSet.to() moves it
        model = LPIPS(net)
    try:
        model.load_backbone(torch.load(bfile, map_location="cpu", weights_only=True))
        model.load_linear(torch.load(lfile, map_location="cpu", weights_only=True))
    except Exception as e:  # a corrupt or foreign file: report, do not crash the evaluation
        return LpipsResult(None, f"could not load LPIPS weights ({bfile.name}, {lfile.name}): {e}")
    return LpipsResult(model, None)


class LpipsSet:
    """The configured LPIPS variants, sharing one network per trunk; null + reason for those that cannot load."""

    def __init__(self, variants: tuple[str, ...] | list[str], backbone_dir: str | Path | None = None,
                 linear_dir: str | Path | None = None):
        self.variants = list(variants)
        unknown = [v for v in self.variants if v not in VARIANTS]
        if unknown:
            raise ValueError(f"unknown LPIPS variant(s) {unknown}; known: {sorted(VARIANTS)}")
        self.models: dict[str, LPIPS | None] = {}
        self.reasons: dict[str, str] = {}
        nets = {VARIANTS[v][0] for v in self.variants}
        for net in sorted(nets):
            res = load_lpips(net, backbone_dir, linear_dir)
            self.models[net] = res.model
            if res.reason:
                self.reasons[net] = res.reason

    def reason(self, variant: str) -> str | None:
        return self.reasons.get(VARIANTS[variant][0])

    def to(self, device: torch.device | str) -> "LpipsSet":
        """Move the networks to ``device`` (LPIPS runs where the images are); returns self."""
        for net, model in self.models.items():
            if model is not None:
                self.models[net] = model.to(device)
        return self

    @torch.no_grad()
    def __call__(self, x01: torch.Tensor, y01: torch.Tensor) -> dict[str, float | None]:
        """All variants for one pair of ``[B, 3, H, W]`` images in [0, 1] (mean over the batch)."""
        out: dict[str, float | None] = {}
        for v in self.variants:
            net, to_pm1 = VARIANTS[v]
            model = self.models[net]
            if model is None:
                out[v] = None
                continue
            a, b = (x01 * 2 - 1, y01 * 2 - 1) if to_pm1 else (x01, y01)
            out[v] = float(model(a, b).mean())
        return out
