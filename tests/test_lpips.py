"""Our plain-torch LPIPS against the ``lpips`` package, and its offline behaviour.

Equality test: the ``lpips`` package (installed with --no-deps) builds its trunks through ``torchvision.models``.
If a real torchvision imports here, it is used as is. PyPI's torchvision does not import beside our CPU torch
('operator torchvision::nms does not exist'), so otherwise the test registers a minimal stand-in
``torchvision.models`` module in ``sys.modules`` whose ``alexnet()`` / ``vgg16()`` return randomly initialised
``features`` stacks with torchvision's layer layouts (written out below, independently of splatflow.evaluation.lpips).

What the stand-in run checks: everything the lpips package itself does on top of the trunk (its ScalingLayer
constants, its slicing of the trunk into five taps, unit-normalisation, the v0.1 linear heads it loads from its
own files, spatial averaging and the sum over layers) gives the same numbers as ours for the same trunk
weights. What it does not check: that the stand-in layouts equal torchvision's (they are transcribed from
torchvision's source; with a real torchvision installed, e.g. ``pip install --no-deps torchvision==0.15.2``,
which imports beside torch 2.13 CPU, the same test runs against torchvision's own constructors and also compares
the layouts).
"""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest
import torch
from torch import nn

from splatflow.evaluation.lpips import (BACKBONE_FILES, LPIPS, LpipsSet, load_lpips, lpips_package_weights_dir)


def _standin_alexnet_features():
    # torchvision/models/alexnet.py, AlexNet.features
    return nn.Sequential(
        nn.Conv2d(3, 64, 11, 4, 2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
        nn.Conv2d(64, 192, 5, padding=2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
        nn.Conv2d(192, 384, 3, padding=1), nn.ReLU(inplace=True),
        nn.Conv2d(384, 256, 3, padding=1), nn.ReLU(inplace=True),
        nn.Conv2d(256, 256, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2))


def _standin_vgg16_features():
    # torchvision/models/vgg.py, cfgs["D"] through make_layers(batch_norm=False)
    layers, c = [], 3
    for v in [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]:
        if v == "M":
            layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
        else:
            layers += [nn.Conv2d(c, v, kernel_size=3, padding=1), nn.ReLU(inplace=True)]
            c = v
    return nn.Sequential(*layers)


def _standin_torchvision() -> types.ModuleType:
    tv = types.ModuleType("torchvision")
    models = types.ModuleType("torchvision.models")

    def make(fn):
        def ctor(pretrained=False, **kw):
            assert not pretrained, "the stand-in has no pretrained weights (tests use pnet_rand=True)"
            return types.SimpleNamespace(features=fn())
        return ctor

    models.alexnet = make(_standin_alexnet_features)
    models.vgg16 = make(_standin_vgg16_features)
    tv.models = models
    return tv


def _drop(prefixes):
    for name in list(sys.modules):
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            del sys.modules[name]


@pytest.fixture
def lpips_pkg(monkeypatch):
    """The lpips package module, imported over a real torchvision or the stand-in (restored afterwards)."""
    if importlib.util.find_spec("lpips") is None:
        pytest.skip("the lpips package is not installed (pip install --no-deps lpips==0.1.4)")
    saved = {k: v for k, v in sys.modules.items() if k == "torchvision" or k.startswith("torchvision.")}
    _drop(["lpips"])
    real = True
    try:
        import torchvision.models  # noqa: F401
    except Exception:  # noqa: BLE001 - PyPI torchvision raises RuntimeError beside torch+cpu
        real = False
        _drop(["torchvision"])
        tv = _standin_torchvision()
        monkeypatch.setitem(sys.modules, "torchvision", tv)
        monkeypatch.setitem(sys.modules, "torchvision.models", tv.models)
    import lpips

    yield lpips, real
    _drop(["lpips"])
    if not real:
        _drop(["torchvision"])
        sys.modules.update(saved)


@pytest.mark.parametrize("net", ["alex", "vgg"])
def test_equals_lpips_package_with_same_random_backbone(lpips_pkg, net):
    lpips, real_tv = lpips_pkg
    torch.manual_seed(0)
    ref = lpips.LPIPS(net=net, pnet_rand=True, version="0.1", verbose=False).eval()

    ours = LPIPS(net)
    # lpips slices keep torchvision's module indices as names: net.slice{k}.{idx}.weight -> features.{idx}.weight
    trunk = {"features." + k.split(".", 1)[1]: v for k, v in ref.net.state_dict().items()}
    ours.load_backbone(trunk)
    ours.load_linear(torch.load(lpips_package_weights_dir() / f"{net}.pth", map_location="cpu", weights_only=True))
    if real_tv:  # layouts: ours vs torchvision's own constructor
        import torchvision.models as tvm
        tv_feats = (tvm.alexnet() if net == "alex" else tvm.vgg16()).features
        assert [tuple(t.shape) for t in tv_feats.state_dict().values()] == \
               [tuple(t.shape) for t in ours.features.state_dict().values()]

    g = torch.Generator().manual_seed(1)
    x = torch.rand(2, 3, 40, 48, generator=g) * 2 - 1
    y = (x + 0.3 * torch.randn(2, 3, 40, 48, generator=g)).clamp(-1, 1)
    with torch.no_grad():
        expect = ref(x, y).flatten()  # [B]
        got = ours(x, y)
        expect01 = ref((x + 1) / 2, (y + 1) / 2, normalize=True).flatten()  # the package's [0,1] path
    assert expect.abs().min() > 1e-4  # a real difference, not a trivially zero distance
    assert got.shape == expect.shape
    assert float(((got - expect).abs() / expect.abs()).max()) < 1e-5
    assert float(((got - expect01).abs() / expect.abs()).max()) < 1e-5
    with torch.no_grad():
        assert float(ours(x, x).abs().max()) < 1e-7


def test_missing_backbone_gives_null_and_reason(tmp_path):
    res = load_lpips("vgg", backbone_dir=tmp_path)
    assert res.model is None and BACKBONE_FILES["vgg"] in res.reason and "download" in res.reason
    s = LpipsSet(["lpips_vgg_01", "lpips_vgg", "lpips_alex"], backbone_dir=tmp_path)
    x = torch.rand(1, 3, 32, 32)
    assert s(x, x) == {"lpips_vgg_01": None, "lpips_vgg": None, "lpips_alex": None}
    assert BACKBONE_FILES["alex"] in s.reason("lpips_alex")


def test_missing_linear_layers_gives_null_and_reason(tmp_path):
    torch.save({"features." + k: v for k, v in LPIPS("alex").features.state_dict().items()},
               tmp_path / BACKBONE_FILES["alex"])
    res = load_lpips("alex", backbone_dir=tmp_path, linear_dir=tmp_path / "nowhere")
    assert res.model is None and "alex.pth" in res.reason


def test_configured_backbone_dir_loads_and_variants_differ_by_input_range(tmp_path):
    if lpips_package_weights_dir() is None:
        pytest.skip("the lpips package (v0.1 linear layers) is not installed")
    torch.manual_seed(0)
    trunk = LPIPS("vgg")
    for m in trunk.features:
        if isinstance(m, nn.Conv2d):
            nn.init.normal_(m.weight, std=0.05)
    state = {"features." + k: v for k, v in trunk.features.state_dict().items()}
    state["classifier.0.weight"] = torch.zeros(2, 2)  # torchvision checkpoints carry a classifier: ignored
    torch.save(state, tmp_path / BACKBONE_FILES["vgg"])
    s = LpipsSet(["lpips_vgg_01", "lpips_vgg"], backbone_dir=tmp_path)
    assert s.reason("lpips_vgg") is None
    g = torch.Generator().manual_seed(2)
    x = torch.rand(1, 3, 32, 32, generator=g)
    y = (x + 0.2 * torch.randn(1, 3, 32, 32, generator=g)).clamp(0, 1)
    out = s(x, y)
    model = s.models["vgg"]
    with torch.no_grad():
        assert out["lpips_vgg"] == pytest.approx(float(model(2 * x - 1, 2 * y - 1)), rel=1e-6)
        assert out["lpips_vgg_01"] == pytest.approx(float(model(x, y)), rel=1e-6)
    assert out["lpips_vgg"] != pytest.approx(out["lpips_vgg_01"], rel=1e-3)
    assert s(x, x)["lpips_vgg"] == pytest.approx(0.0, abs=1e-7)
